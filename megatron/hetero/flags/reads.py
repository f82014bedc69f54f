"""Where Megatron-LM's pretrain_gpt.py reads each flag, and the flags it never reads.

megatron_lm_reads.json (next to this file) is written by tools/megatron_flag_reads.py: for each
flag's ``dest``, every place of the code pretrain_gpt.py runs at the pinned tag that reads
``args.<dest>``, with the flags whose ``if`` encloses the read; and the megatron-core config
dataclass the dest is a field of, if any.

The rule (Megatron-LM's own behaviour, so no judgement per flag): a flag whose dest is no
megatron-core config field megatron-core reads, and whose every read on that path runs only
under a switch that Megatron-Hetero refuses, changes nothing that pretrain_gpt.py does. It is a no-op. A flag
read nowhere belongs to another program (vision, BERT, retrieval, RL, inference, export) or
is a leftover; a flag read only under ``if args.fim_data:`` matters only with --fim-data; a
flag read only by assertions can stop a run but never changes one.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from megatron.hetero.flags.facts import MegatronFlag, megatron_tag

READS_FILE = Path(__file__).with_name("megatron_lm_reads.json")
# One scan per Megatron-LM tag of facts.FACTS_FILES.
READS_FILES: dict[str, Path] = {
    "core_v0.16.1": READS_FILE,
    "core_v0.19.0": Path(__file__).with_name("megatron_lm_reads.core_v0.19.0.json"),
}


def _document() -> dict:
    return _read(READS_FILES[megatron_tag()])


@functools.cache
def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def scanned_tag() -> str:
    """The Megatron-LM tag the scan read (facts.megatron_tag() must be the same)."""
    return _document()["megatron_lm_tag"]


def scanned_dests() -> set[str]:
    return set(_document()["reads"])


def reads(dest: str) -> list[dict]:
    """Every read of ``args.<dest>`` on pretrain_gpt.py's path: {"at": "file:function",
    "gated_by": [dests of the switches enclosing it], "check": read only by an assertion}."""
    return _document()["reads"].get(dest, [])


def config_field(dest: str) -> str | None:
    """The megatron-core config dataclass with a field named ``dest`` (Megatron-LM copies
    such args into it), or None."""
    return _document()["config_fields"].get(dest)


def core_reads(dest: str) -> list[str]:
    """The files of the installed megatron-core (relative to megatron/core) that read a config
    field named ``dest``."""
    return _document()["core_reads"].get(dest, [])


# megatron-core's code that only one feature builds, and the switch that asks for it (refused
# by Megatron-Hetero: tests/test_flags.py checks it). A config field read only there changes
# nothing in a run without the feature.
CORE_FEATURES: dict[str, str] = {
    "distributed/fsdp/": "--use-megatron-fsdp",
    "ssm/mamba": "--is-hybrid-model",
    "ssm/gated_delta_net.py": "--experimental-attention-variant",
    "transformer/experimental_attention_variant/": "--experimental-attention-variant",
    "models/gpt/experimental_attention_variant_module_specs.py": "--experimental-attention-variant",
    "optimizer/muon.py": "--optimizer muon",
    "optimizer/cpu_offloading/": "--optimizer-cpu-offload",
}


def _feature_of(path: str) -> str | None:
    return next((switch for prefix, switch in CORE_FEATURES.items() if path.startswith(prefix)), None)


def unread_reason(flag: MegatronFlag, refused_switches: dict[str, str], tag: str) -> str | None:
    """Why ``flag`` has no effect in Megatron-LM's pretrain_gpt.py, or None when it has one.
    ``refused_switches``: dest -> name of the refused flags that are off unless given."""
    if flag.dest not in _document()["reads"]:
        return None  # not scanned (facts newer than the scan): never a no-op by default
    field = config_field(flag.dest)
    features = {_feature_of(path) for path in core_reads(flag.dest)}
    if field is not None and None in features:
        return None  # Megatron-LM copies it into the config, and megatron-core acts on it
    gates: set[str] = set()
    for read in reads(flag.dest):
        if read["check"]:
            continue  # an assertion can stop a run, never change one
        inert = set(refused_switches).intersection(read["gated_by"])
        if not inert:
            return None
        gates |= inert
    switches = sorted({refused_switches[g] for g in gates} | (features - {None}))
    where = " or ".join(switches)
    if field is not None and features:
        return f"megatron-core's {field}.{flag.dest}, read only for {where} (refused)"
    if field is not None:
        return (f"megatron-core's {field}.{flag.dest}, which megatron-core (the release of {tag}) "
                "reads nowhere" + (f" and Megatron-LM only for {where} (refused)" if gates else ""))
    if gates:
        return f"Megatron-LM's pretrain_gpt.py reads it only with {where}, which is refused"
    return f"read nowhere by Megatron-LM's pretrain_gpt.py at {tag} (another program's flag)"
