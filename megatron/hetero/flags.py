"""Every flag of Megatron-LM's pretrain_gpt.py, and what Megatron-Hetero does with it.

The facts (names, defaults, value kinds, groups) come from Megatron-LM's own parser at the
pinned tag (megatron_lm_flags.json, written by tools/extract_megatron_flags.py). Each flag
has exactly one status:

- honoured: arguments.py defines it, with Megatron-LM's meaning and default;
- no-op: accepted and reported once at start-up, where Megatron-LM ignores it too;
- refused: parsed with Megatron-LM's value syntax, then rejected BY NAME with what the
  feature is and what to do (flag_catalog.py holds the reasons).

A refused flag given with Megatron-LM's default value asks for nothing Megatron-LM would do
differently without it (``--context-parallel-size 1``), so it is accepted as a no-op.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from hetero.errors import HeteroError
from megatron.hetero import flag_catalog

FACTS_FILE = Path(__file__).with_name("megatron_lm_flags.json")
# Flags of ours that Megatron-LM does not have.
HETERO_FLAGS = ("--hetero-plan", "--hetero-adapt", "--hetero-adapt-output", "--local_rank")
_GIVEN = "megatron_flags_given"  # Namespace attribute the recording actions append to


class Status(str, enum.Enum):
    HONOURED = "honoured"
    NOOP = "no-op"
    REFUSED = "refused"


@dataclass(frozen=True)
class MegatronFlag:
    """One argparse action of Megatron-LM's parser (all its option strings)."""

    option_strings: tuple[str, ...]
    dest: str
    action: str
    default: Any
    nargs: Any
    type: str | None
    choices: tuple | None
    group: str
    source: str

    @property
    def name(self) -> str:
        return self.option_strings[0]

    @property
    def takes_value(self) -> bool:
        return self.action in ("store", "append")


@dataclass(frozen=True)
class Ruling:
    """What Megatron-Hetero does with one Megatron-LM flag."""

    flag: MegatronFlag
    status: Status
    reason: str = ""            # no-op: why it has no effect; refused: what it is, what to do
    theme: str | None = None    # key of flag_catalog.THEMES for refused flags

    def message(self, option: str) -> str:
        return f"{option}: {self.reason}"


@functools.cache
def megatron_flags() -> tuple[MegatronFlag, ...]:
    document = json.loads(FACTS_FILE.read_text())
    return tuple(
        MegatronFlag(
            option_strings=tuple(f["option_strings"]), dest=f["dest"], action=f["action"],
            default=f["default"], nargs=f["nargs"], type=f["type"],
            choices=tuple(f["choices"]) if f["choices"] is not None else None,
            group=f["group"], source=f["source"],
        )
        for f in document["flags"]
    )


@functools.cache
def megatron_tag() -> str:
    return json.loads(FACTS_FILE.read_text())["megatron_lm_tag"]


def defined_options(parser: argparse.ArgumentParser) -> set[str]:
    """Option strings the parser honours (not the recording actions this module adds)."""
    return {s for a in parser._actions if not isinstance(a, _RecordFlag) for s in a.option_strings}


def rulings(honoured: set[str]) -> dict[str, Ruling]:
    """Each Megatron-LM flag's ruling, by its first option string; ``honoured`` are the
    option strings arguments.py defines."""
    return dict(_rulings(frozenset(honoured)))


@functools.cache  # every parse_args builds a parser; the registry is the same each time
def _rulings(honoured: frozenset[str]) -> dict[str, Ruling]:
    check_registry(honoured)
    flags = megatron_flags()
    themes = flag_catalog.theme_of_flags({f.name: f.group for f in flags})
    noops = flag_catalog.noops()
    result = {}
    for flag in flags:
        name = flag.name
        if honoured & set(flag.option_strings):
            result[name] = Ruling(flag, Status.HONOURED)
        elif name in noops:
            result[name] = Ruling(flag, Status.NOOP, noops[name])
        else:
            theme = themes[name]
            reason = flag_catalog.REASONS.get(name) or flag_catalog.THEMES[theme].reason()
            result[name] = Ruling(flag, Status.REFUSED, reason, theme)
    return result


def check_registry(honoured: set[str]) -> None:
    """One status per flag: a flag both honoured and catalogued, or neither, is a bug."""
    flags = megatron_flags()
    listed = set(flag_catalog.theme_of_flags({})) | set(flag_catalog.noops())
    # Flags of other programs' groups are refused whole, unless arguments.py honours one.
    catalogued = listed | set(flag_catalog.theme_of_flags({f.name: f.group for f in flags}))
    problems = []
    if duplicates := flag_catalog.duplicate_entries():
        problems.append(f"listed twice in flag_catalog.py: {', '.join(duplicates)}")
    both = sorted(f.name for f in flags if honoured & set(f.option_strings) and f.name in listed)
    if both:
        problems.append(f"honoured by arguments.py AND listed in flag_catalog.py (delete the "
                        f"catalog entry): {', '.join(both)}")
    neither = sorted(f.name for f in flags
                     if not honoured & set(f.option_strings) and f.name not in catalogued)
    if neither:
        problems.append(f"neither honoured nor in flag_catalog.py: {', '.join(neither)}")
    unknown = sorted(catalogued - {f.name for f in flags})
    if unknown:
        problems.append(f"in flag_catalog.py but not a Megatron-LM flag: {', '.join(unknown)}")
    if problems:
        raise RuntimeError("flag registry is inconsistent: " + "; ".join(problems))


class _RecordFlag(argparse.Action):
    """Parses a non-honoured flag with Megatron-LM's syntax and records that it was given."""

    def __init__(self, option_strings: Sequence[str], dest: str, ruling: Ruling, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.ruling = ruling

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        kind = self.ruling.flag.action
        if kind == "BooleanOptionalAction":
            values = not option_string.startswith("--no-")
        elif kind in ("store_true", "store_false", "store_const", "count"):
            values = None  # never Megatron-LM's default: giving it changes the value
        given = getattr(namespace, _GIVEN, None) or []
        setattr(namespace, _GIVEN, given + [(option_string, self.ruling, values)])


_TYPES = {"int": int, "float": float}


def _value_syntax(flag: MegatronFlag) -> dict[str, Any]:
    """argparse keywords that parse the flag's values as Megatron-LM does."""
    if not flag.takes_value:
        return {"nargs": 0}
    kind = _TYPES.get(flag.type or "", str)
    syntax: dict[str, Any] = {"type": kind, "metavar": flag.dest.upper()}
    if flag.nargs is not None:
        syntax["nargs"] = flag.nargs
    if flag.choices is not None:
        syntax["choices"] = list(flag.choices) if kind is not str else [str(c) for c in flag.choices]
        del syntax["metavar"]
    return syntax


def _help(ruling: Ruling) -> str:
    """The flag's status; the reason only where it differs from its group's."""
    if ruling.status is Status.NOOP:
        text = f"no-op: {ruling.reason}"
    elif ruling.reason == _group_heading(ruling.theme)[1]:
        text = "refused"
    else:
        text = f"refused: {ruling.reason}"
    return text.replace("%", "%%")


def _group_key(ruling: Ruling) -> str:
    return "noop" if ruling.status is Status.NOOP else ruling.theme


def add_megatron_flags(parser: argparse.ArgumentParser) -> dict[str, Ruling]:
    """Makes every Megatron-LM flag known to ``parser``: aliases of honoured flags join
    their action; the rest parse with Megatron-LM's syntax into groups by status/theme."""
    by_option = {s: a for a in parser._actions for s in a.option_strings}
    for group in parser._action_groups:
        if group.title not in ("positional arguments", "options") and not group.description:
            group.description = f"honoured: Megatron-LM's meaning and default ({megatron_tag()})"
    table = rulings(defined_options(parser))
    used = {_group_key(r) for r in table.values() if r.status is not Status.HONOURED}
    order = ["noop", *flag_catalog.THEMES]
    groups = {key: parser.add_argument_group(*_group_heading(key)) for key in order if key in used}
    for ruling in table.values():
        flag = ruling.flag
        if ruling.status is Status.HONOURED:
            action = next(by_option[s] for s in flag.option_strings if s in by_option)
            for alias in flag.option_strings:
                if alias not in by_option:  # Megatron-LM's second name for the same action
                    action.option_strings.append(alias)
                    parser._option_string_actions[alias] = action
            _accept_megatron_values(action, flag)
            continue
        groups[_group_key(ruling)].add_argument(
            *flag.option_strings, action=_RecordFlag, ruling=ruling, dest=_GIVEN,
            default=argparse.SUPPRESS, help=_help(ruling), **_value_syntax(flag))
    return table


def _accept_megatron_values(action: argparse.Action, flag: MegatronFlag) -> None:
    """An honoured flag parses every value Megatron-LM's does; the values we do not run are
    refused by name after parsing (``judge``), not as an argparse "invalid choice"."""
    if not action.choices or not flag.choices:
        return
    extra = [c for c in flag.choices if c not in action.choices]
    if extra:
        action.refused_values = {value: _value_reason(flag.name, value, action.choices)
                                 for value in extra}
        action.choices = [*action.choices, *extra]
        note = f"(Megatron-LM's {', '.join(map(str, extra))}: refused)"
        action.help = f"{action.help} {note}" if action.help else note


def _value_reason(option: str, value: Any, ours: Sequence[Any]) -> str:
    specific = flag_catalog.REFUSED_VALUES.get(option, {}).get(value)
    return specific or f"not supported yet; use one of {', '.join(map(str, ours))}"


def refused_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Honoured flags given a value Megatron-LM accepts and Megatron-Hetero does not run."""
    messages = []
    for action in parser._actions:
        reasons = getattr(action, "refused_values", None)
        value = getattr(args, action.dest, None)
        if reasons and value in reasons:
            messages.append(f"{action.option_strings[0]} {value}: {reasons[value]}")
    return messages


def _group_heading(key: str) -> tuple[str, str]:
    if key == "noop":
        return ("no-op (accepted; Megatron-LM ignores these too)",
                "said once at start-up; they change nothing")
    theme = flag_catalog.THEMES[key]
    return (f"refused: {theme.title}", theme.reason())


@dataclass
class Verdict:
    """The non-honoured flags one command line gave."""

    refused: list[str]       # messages, each naming its flag
    noops: list[str]         # messages for the start-up log


def _is_megatron_default(ruling: Ruling, value: Any) -> bool:
    default = ruling.flag.default
    if value is None:
        return False
    if isinstance(value, list) and not isinstance(default, list):
        return value == [default]
    return value == default


def _rule(given: list[tuple[str, Ruling, Any]]) -> Verdict:
    verdict = Verdict([], [])
    seen = set()
    for option, ruling, value in given:
        if option in seen:
            continue
        seen.add(option)
        if ruling.status is Status.REFUSED and _is_megatron_default(ruling, value):
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            named = f"{option} {shown}" if ruling.flag.takes_value else option
            verdict.noops.append(f"{named}: Megatron-LM's default value; no effect")
        elif ruling.status is Status.NOOP:
            verdict.noops.append(f"{option}: no-op, {ruling.reason}")
        else:
            verdict.refused.append(ruling.message(option))
    return verdict


def judge(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: Sequence[str]) -> None:
    """Rules on the flags ``parser.parse_known_args`` left: raises one HeteroError naming
    every refused and unknown flag; else sets ``args.noop_flags`` for the start-up log."""
    verdict = _rule(vars(args).pop(_GIVEN, []))
    verdict.refused += refused_values(parser, args)
    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    unknown_lines = unknown_flag_messages(unknown, known) if unknown else []
    if verdict.refused or unknown_lines:
        raise refusal_error(verdict.refused, unknown_lines)
    args.noop_flags = verdict.noops


def refusal_error(refused: list[str], unknown: list[str]) -> HeteroError:
    """One error for everything a command line gave that cannot run, each flag named."""
    if not refused:
        return HeteroError(
            "; ".join(unknown) + ". Megatron-Hetero takes the flags listed by "
            "`pretrain_gpt.py --help` and docs/flags.md; remove or correct the flag.")
    return HeteroError(
        f"{len(refused + unknown)} flag(s) Megatron-Hetero cannot run:\n  "
        + "\n  ".join(refused + unknown)
        + "\n(`pretrain_gpt.py --help` and docs/flags.md list every Megatron-LM flag with its status)")


# ---- "did you mean": only for a real typo ------------------------------------------------
# Words that name different units or opposite features: a flag differing from another only
# in one of these is another flag, never a typo of it.
_UNITS = {"iter": "iters", "iters": "iters", "iterations": "iters", "sample": "samples",
          "samples": "samples", "token": "tokens", "tokens": "tokens", "step": "steps",
          "steps": "steps", "epoch": "epochs", "epochs": "epochs", "mins": "minutes",
          "minutes": "minutes", "seconds": "seconds", "secs": "seconds", "gb": "gb", "mb": "mb"}
_DISTINCT = [{"encoder", "decoder"}, {"min", "max"}, {"enable", "disable"}, {"first", "last"},
             {"train", "valid"}, {"save", "load"}, {"fp8", "fp4"}, {"fp16", "bf16"},
             {"start", "end"}, {"input", "output"}, {"lower", "upper"}]


# Words a user may leave out or add without meaning another flag (--tensor-parallel-size).
_FILLER = {"model", "num", "size", "dir", "path", "file"}


def _words(flag: str) -> list[str]:
    return [w for w in re.split(r"[-_]+", flag.lower()) if w]


def _typo_of(word: str, other: str) -> bool:
    if _UNITS.get(word, word) != _UNITS.get(other, other) and (word in _UNITS or other in _UNITS):
        return False
    if {word, other} in _DISTINCT:
        return False
    return difflib.SequenceMatcher(None, word, other).ratio() >= 0.75


def is_typo(given: str, known: str) -> bool:
    """``given`` misspells ``known``: same words but one slightly misspelt, the same letters
    with other separators (``--hidden_size``, ``--hiddensize``), or one filler word missing
    or added (``--tensor-parallel-size``)."""
    a, b = _words(given), _words(known)
    if "".join(a) == "".join(b):
        return True
    if abs(len(a) - len(b)) == 1:
        short, long = sorted((a, b), key=len)
        return any(long[:i] + long[i + 1:] == short and long[i] in _FILLER
                   for i in range(len(long)))
    if len(a) != len(b):
        return False
    differing = [(x, y) for x, y in zip(a, b) if x != y]
    return len(differing) == 1 and _typo_of(*differing[0])


def suggest(given: str, known: Iterable[str]) -> str | None:
    """The known flag ``given`` is a typo of, if exactly one is close."""
    candidates = [k for k in known if is_typo(given, k)]
    if not candidates:
        return None
    return max(candidates, key=lambda k: difflib.SequenceMatcher(None, given, k).ratio())


def unknown_flag_messages(unknown: Sequence[str], known: Iterable[str]) -> list[str]:
    known = sorted(set(known))
    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")]
    lines = []
    for flag in flags or list(unknown):
        close = suggest(flag, known) if flag.startswith("--") else None
        hint = f" (did you mean {close}?)" if close else ""
        lines.append(f"unknown flag {flag}{hint}: not a flag of Megatron-LM's pretrain_gpt.py "
                     f"({megatron_tag()}) nor of Megatron-Hetero")
    return lines


# ---- honoured flags whose default is not Megatron-LM's (tests check this list) ----------
DEFAULT_DIFFERENCES: dict[str, str] = {
    "--tensor-model-parallel-size": "none given: the plan decides (1 without a plan, as Megatron-LM)",
    "--pipeline-model-parallel-size": "none given: the plan decides (1 without a plan, as Megatron-LM)",
    "--transformer-impl": "none given: transformer_engine when it is installed (Megatron-LM's "
                          "default), else local",
    "--distributed-backend": "none given: nccl on GPUs (Megatron-LM's default), gloo on the CPU",
    "--local-rank": "none given: the LOCAL_RANK environment variable, as torchrun sets it",
    "--tokenizer-type": "none given: an error asking for one (Megatron-LM's pretrain_gpt.py "
                        "defaults to GPT2BPETokenizer)",
    "--eval-interval": "1000 (Megatron-LM core_v0.16.1 has no default and fails without it "
                       "when training by iterations; 1000 was its earlier default)",
}


def _same_default(ours: argparse.Action, flag: MegatronFlag) -> bool:
    """Our action's default means what Megatron-LM's does (None and False are both 'off'; a
    store_true ``--no-x`` of ours is Megatron-LM's store_false ``--no-x``)."""
    if flag.action == "store_false" and isinstance(ours, argparse._StoreTrueAction):
        return ours.default is False and flag.default is True
    if flag.default in (None, False) and ours.default in (None, False):
        return flag.default == ours.default or flag.action == "store_true"
    return ours.default == flag.default


def default_differences(parser: argparse.ArgumentParser) -> dict[str, tuple[Any, Any]]:
    """Honoured flags whose default is not Megatron-LM's: flag -> (ours, Megatron-LM's)."""
    by_option = {s: a for a in parser._actions if not isinstance(a, _RecordFlag)
                 for s in a.option_strings}
    differences = {}
    for flag in megatron_flags():
        ours = next((by_option[s] for s in flag.option_strings if s in by_option), None)
        if ours is not None and not _same_default(ours, flag):
            differences[flag.name] = (ours.default, flag.default)
    return differences


# ---- docs/flags.md -----------------------------------------------------------------------
DROP_IN = """\
## What "drop-in" means

A launch script written for Megatron-LM's `pretrain_gpt.py` at `{tag}` runs with
Megatron-Hetero's `pretrain_gpt.py` unchanged when every flag it gives is honoured or a
no-op below; adding `--hetero-plan plan.json` runs it under a heterogeneous plan. Precisely:

- All {total} flags of Megatron-LM's `pretrain_gpt.py` are known. {honoured} are honoured
  (Megatron-LM's name, value syntax, meaning and default; the few default differences are
  listed below). {noop} are accepted as no-ops, exactly where Megatron-LM ignores them too,
  and named once at start-up. {refused} are refused at start-up BY NAME - all of a command
  line's refused flags in one error, each with what it is and what to do - before any
  process group exists. Removing the refused flags is the only edit a script needs,
  apart from the default differences listed under "Honoured".
- A refused flag given with Megatron-LM's default value (`--context-parallel-size 1`)
  asks for nothing and is accepted as a no-op.
- A flag that is not Megatron-LM's is an error; "did you mean" is offered only for a real
  typo (`--hiden-size`, `--tensor-parallel-size`), never for a flag of another unit or
  feature (`--lr-warmup-tokens` suggests nothing).
- GPU-only values on a CPU machine (tests, the emulated cluster) need one substitution
  each: `--transformer-impl local` for `transformer_engine`, `--distributed-backend gloo`
  for `nccl`; leaving those flags out picks them automatically.
- Flags the plan also fixes (`--tensor-model-parallel-size`,
  `--pipeline-model-parallel-size`, `--micro-batch-size`, `--global-batch-size`,
  `--num-layers`) may stay in the script; each must agree with the plan.
"""


def _code(options: Sequence[str]) -> str:
    return ", ".join(f"`{o}`" for o in options)


def counts(table: dict[str, Ruling]) -> dict[Status, int]:
    return {status: sum(r.status is status for r in table.values()) for status in Status}


def markdown(parser: argparse.ArgumentParser) -> str:
    """docs/flags.md: every Megatron-LM flag with its status, generated from the registry."""
    table = rulings(defined_options(parser))
    number = counts(table)
    tag = megatron_tag()
    modelopt = sum("modelopt" in r.flag.source for r in table.values())
    lines = [
        "# Flags of pretrain_gpt.py",
        "",
        "<!-- Generated by `python -m tools.flags_doc > docs/flags.md` from "
        "megatron/hetero/flags.py and flag_catalog.py; do not edit. -->",
        "",
        f"Megatron-LM's `pretrain_gpt.py` at `{tag}` defines {len(table)} flags ({modelopt} of "
        "them are nvidia-modelopt's, added when that package is installed); counted as "
        "argparse actions, so `--no-x`/`--disable-x` aliases of one flag count once.",
        "",
        "| status | flags |",
        "|---|---|",
        *(f"| {status.value} | {number[status]} |" for status in Status),
        f"| total | {len(table)} |",
        "",
        DROP_IN.format(tag=tag, total=len(table), honoured=number[Status.HONOURED],
                       noop=number[Status.NOOP], refused=number[Status.REFUSED]),
        "## Honoured",
        "",
        "Megatron-LM's meaning and default; the note gives ours where it differs.",
        "",
        "| flag | Megatron-LM group | Megatron-LM default | note |",
        "|---|---|---|---|",
    ]
    for ruling in table.values():
        if ruling.status is Status.HONOURED:
            flag = ruling.flag
            default = f"`{flag.default!r}`" if flag.takes_value else "switch, off"
            note = DEFAULT_DIFFERENCES.get(flag.name, "")
            lines.append(f"| {_code(flag.option_strings)} | {flag.group} | {default} | {note} |")
    lines += ["", "Values Megatron-LM accepts for honoured flags that Megatron-Hetero refuses, by name:", ""]
    for action in parser._actions:
        for value, reason in getattr(action, "refused_values", {}).items():
            lines.append(f"- `{action.option_strings[0]} {value}`: {reason}")
    lines += ["", "## No-ops", "", "Accepted and named once at start-up.", "",
              "| flag | why it has no effect |", "|---|---|"]
    for ruling in table.values():
        if ruling.status is Status.NOOP:
            lines.append(f"| {_code(ruling.flag.option_strings)} | {ruling.reason} |")
    lines += ["", "## Refused", "",
              "Each refused flag given is named at start-up with the reason of its theme.", ""]
    for key in flag_catalog.THEMES:
        members = [r for r in table.values() if r.status is Status.REFUSED and r.theme == key]
        if not members:
            continue
        title, reason = _group_heading(key)
        lines += [f"### {title.removeprefix('refused: ')}", "", f"{reason}.", ""]
        for ruling in members:
            own = "" if ruling.reason == reason else ruling.reason
            lines.append(f"- {_code(ruling.flag.option_strings)}" + (f": {own}" if own else ""))
        lines.append("")
    lines += ["## Megatron-Hetero's own flags", "",
              "- `--hetero-plan PLAN.json`: the heterogeneous plan (from `hetero-plan`); without "
              "it the job runs Megatron-LM's uniform plan.",
              "- `--hetero-adapt`: re-splits the replicas' micro-batches while training when "
              "their measured times are unbalanced (same global batch and sample order), and "
              "writes a corrected plan with the layer split the measured stage times call for.",
              "- `--hetero-adapt-output PATH`: where that plan goes (default: "
              "`adapted_plan.json` in `--save`, else in the working directory).",
              "- `--local_rank`: the underscore spelling old launchers pass.", ""]
    return "\n".join(lines)
