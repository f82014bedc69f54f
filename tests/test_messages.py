"""What users read carries no internal references and no stale statuses.

Every string constant of the runtime (megatron/hetero/) and the planner (hetero/) - error
messages, help texts, docstrings that become --help - and every reason of the flag registry
is checked for: our internal work-item numbers ("issue 2.2", "round 3", "stop 4"), "not
supported yet" said of a feature that exists, and names of files that do not exist.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from megatron.hetero import flags
from megatron.hetero.arguments import build_parser
from megatron.hetero.flags import catalog

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("megatron/hetero", "hetero")

INTERNAL_REFERENCE = re.compile(r"\b(issue|round|stop)\s+#?\d", re.IGNORECASE)
NOT_YET = re.compile(r"\bnot (supported|built|implemented) yet\b|\bnot yet (supported|built|implemented)\b",
                     re.IGNORECASE)
# Features Megatron-Hetero runs (performance/, arguments/), as a refusal reason would
# name them at its head ("activation recomputation (...), ...; not supported yet"): such a
# reason is stale. A reason about a variant of one ("a recomputation variant beyond ...")
# names the variant.
EXISTING_FEATURES = re.compile(
    r"recomputation\b(?! variant)|\boverlaps?\b|interleav|virtual pipeline|sequence parallel|"
    r"distributed optimizer|tensor parallelism|pipeline parallelism", re.IGNORECASE)
FILE_NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|json|ya?ml|cpp|hpp))\b")
# Our top-level folders: a path starting with one names a file of this repository.
OURS = ("megatron/hetero/", "hetero/", "hetero_comm/", "tools/", "tests/", "docs/", "examples/",
        "bench/", "csrc/")
# Megatron-LM's own files, named where a message points a user at Megatron-LM.
MEGATRON_LM_FILES = {"preprocess_data.py", "tools/preprocess_data.py"}


def _repository_files() -> list[str]:
    files = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "__pycache__")
                   and not d.endswith(".egg-info")]
        files += [str(Path(root, n).relative_to(REPO)) for n in names]
    return files


FILES = _repository_files()
BASENAMES = {Path(f).name for f in FILES}


def _strings() -> list[tuple[str, int, str]]:
    """(file, line, text) of every string constant (f-strings' literal parts included)."""
    found = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.append((str(path.relative_to(REPO)), node.lineno, node.value))
    return found


def _registry_texts() -> list[tuple[str, str]]:
    """(what, text) of every reason the flag registry can show a user."""
    parser = build_parser()
    table = flags.rulings(flags.defined_options(parser))
    texts = [(f"ruling of {name}", r.reason) for name, r in table.items() if r.reason]
    texts += [(f"theme {key}", theme.reason()) for key, theme in catalog.THEMES.items()]
    texts += [(f"refused value {a.option_strings[0]} {value}", reason) for a in parser._actions
              for value, reason in getattr(a, "refused_values", {}).items()]
    texts += [(f"default difference of {name}", note) for name, note in catalog.DEFAULT_DIFFERENCES.items()]
    return texts


STRINGS = _strings()
HONOURED = {option for r in flags.rulings(flags.defined_options(build_parser())).values()
            if r.status is flags.Status.HONOURED for option in r.flag.option_strings}


def _not_yet_of_honoured_flag(text: str) -> str | None:
    """The honoured flag a clause calls not supported yet, if any."""
    for clause in re.split(r"[;.]\s", text):
        if NOT_YET.search(clause):
            named = [f for f in re.findall(r"--[a-z0-9][a-z0-9_-]*", clause) if f in HONOURED]
            if named:
                return named[0]
    return None


def _refuses_an_existing_feature(text: str) -> bool:
    """A registry reason saying "not supported yet" of a feature named at its head (up to
    the first parenthesis, comma or semicolon)."""
    head = re.split(r"[(,;]", text, maxsplit=1)[0]
    return bool(NOT_YET.search(text) and EXISTING_FEATURES.search(head))


def _missing_file(name: str) -> bool:
    if name in MEGATRON_LM_FILES:
        return False
    if name.startswith(OURS):
        return name not in FILES
    if "/" in name or not name.endswith((".py", ".md")):
        return False  # another program's path, or a file name the user chooses (plan.json)
    return name not in BASENAMES


def test_no_internal_references_reach_users():
    found = [f"{path}:{line}: {m.group(0)!r} in {text[:100]!r}" for path, line, text in STRINGS
             for m in INTERNAL_REFERENCE.finditer(text)]
    found += [f"{what}: {text!r}" for what, text in _registry_texts() if INTERNAL_REFERENCE.search(text)]
    assert found == []


def test_no_message_calls_a_supported_feature_not_supported_yet():
    found = [f"{path}:{line}: {flag} in {text[:140]!r}" for path, line, text in STRINGS
             if (flag := _not_yet_of_honoured_flag(text))]
    found += [f"{what}: {text!r}" for what, text in _registry_texts()
              if _refuses_an_existing_feature(text) or _not_yet_of_honoured_flag(text)]
    assert found == []


def test_every_file_a_message_names_exists():
    found = [f"{path}:{line}: {m.group(1)}" for path, line, text in STRINGS
             for m in FILE_NAME.finditer(text) if _missing_file(m.group(1))]
    found += [f"{what}: {m.group(1)}" for what, text in _registry_texts()
              for m in FILE_NAME.finditer(text) if _missing_file(m.group(1))]
    assert found == []


# What the scans exist for: the messages they caught before they were fixed.
CAUGHT = [
    ("a performance feature of issue 2.2; not supported yet - remove it", "internal"),
    ("measured in round 3 of the bench", "internal"),
    ("removed from Megatron-LM (its replacement, --recompute-activations, is a performance "
     "feature, not supported yet) - remove it", "not yet"),
    ("activation recomputation (trades compute for memory), a performance feature; not "
     "supported yet - remove it", "feature"),
    ("overlaps or buckets gradient/parameter/tensor-parallel communication, a performance "
     "feature; not supported yet - remove it", "feature"),
    ("interleaved (virtual) pipeline stages, context or sequence parallelism; not supported "
     "yet - remove it", "feature"),
    ("See hetero/cluster.py for the format.", "file"),
]


@pytest.mark.parametrize("text, problem", CAUGHT)
def test_the_checks_catch_what_they_are_for(text, problem):
    """The scans above prove nothing if they let the messages they exist for through."""
    caught = {"internal": bool(INTERNAL_REFERENCE.search(text)),
              "not yet": bool(_not_yet_of_honoured_flag(text)),
              "feature": _refuses_an_existing_feature(text),
              "file": any(_missing_file(m.group(1)) for m in FILE_NAME.finditer(text))}
    assert caught == {**dict.fromkeys(caught, False), problem: True}


@pytest.mark.parametrize("text", [
    "a mixture-of-experts option beyond --num-experts; not supported yet - remove it",
    "fully sharded data parallelism (Megatron-FSDP); not supported yet - remove it; "
    "--use-distributed-optimizer shards optimizer state",
    "write the plan to plan.json; see Megatron-LM's tools/preprocess_data.py",
])
def test_the_checks_pass_what_is_true(text):
    assert not INTERNAL_REFERENCE.search(text) and not _not_yet_of_honoured_flag(text)
    assert not any(_missing_file(m.group(1)) for m in FILE_NAME.finditer(text))
    assert not _refuses_an_existing_feature(text)
