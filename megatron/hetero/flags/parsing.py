"""Every Megatron-LM flag known to pretrain_gpt.py's parser, and the verdict on a command line.

arguments/ defines the honoured flags; ``add_megatron_flags`` adds the rest with
Megatron-LM's value syntax, so a refused flag's value is parsed as Megatron-LM parses it and
the flag is then named with its reason (``judge``), never reported as unknown.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Sequence

from hetero.errors import HeteroError
from megatron.hetero.flags import catalog
from megatron.hetero.flags.facts import MegatronFlag, megatron_flags, megatron_tag
from megatron.hetero.flags.rules import Ruling, Status, rulings
from megatron.hetero.flags.typos import unknown_flag_messages

GIVEN = "megatron_flags_given"  # Namespace attribute the recording actions append to


def defined_options(parser: argparse.ArgumentParser) -> set[str]:
    """Option strings the parser honours (not the recording actions this module adds)."""
    return {s for a in parser._actions if not isinstance(a, _RecordFlag) for s in a.option_strings}


def honoured_dests(parser: argparse.ArgumentParser) -> set[str]:
    """The dests of the flags the parser honours."""
    return {a.dest for a in parser._actions if a.option_strings and not isinstance(a, _RecordFlag)}


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
        given = getattr(namespace, GIVEN, None) or []
        setattr(namespace, GIVEN, given + [(option_string, self.ruling, values)])


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


def group_heading(key: str) -> tuple[str, str]:
    """(title, description) of the --help group and docs/flags.md section of a status/theme."""
    if key == "noop":
        return ("no-op (accepted; Megatron-LM ignores these too)",
                "said once at start-up; they change nothing")
    theme = catalog.THEMES[key]
    return (f"refused: {theme.title}", theme.reason())


def _help(ruling: Ruling) -> str:
    """The flag's status; the reason only where it differs from its group's."""
    if ruling.status is Status.NOOP:
        text = f"no-op: {ruling.reason}"
    elif ruling.reason == group_heading(ruling.theme)[1]:
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
    recorded = [r for r in table.values() if r.status is not Status.HONOURED and not r.default_only]
    used = {_group_key(r) for r in recorded}
    order = ["noop", *catalog.THEMES]
    groups = {key: parser.add_argument_group(*group_heading(key)) for key in order if key in used}
    for ruling in table.values():
        flag = ruling.flag
        if ruling.status is Status.HONOURED or ruling.default_only:
            action = next(by_option[s] for s in flag.option_strings if s in by_option)
            for alias in flag.option_strings:
                if alias not in by_option:  # Megatron-LM's second name for the same action
                    action.option_strings.append(alias)
                    parser._option_string_actions[alias] = action
            if ruling.default_only:  # the help arguments/ gave it described a flag that runs
                at_default = f" except at Megatron-LM's default ({flag.default})" if flag.takes_value else ""
                action.help = f"refused{at_default}: {ruling.reason}".replace("%", "%%")
            _accept_megatron_values(action, flag)
            continue
        groups[_group_key(ruling)].add_argument(
            *flag.option_strings, action=_RecordFlag, ruling=ruling, dest=GIVEN,
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
    specific = catalog.REFUSED_VALUES.get(option, {}).get(value)
    return specific or f"Megatron-Hetero does not run this value; use one of {', '.join(map(str, ours))}"


def refused_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Honoured flags given a value Megatron-LM accepts and Megatron-Hetero does not run."""
    messages = []
    for action in parser._actions:
        reasons = getattr(action, "refused_values", None)
        value = getattr(args, action.dest, None)
        # A flag Megatron-LM takes several values of (core_v0.19.0's --moe-router-load-balancing-type)
        for one in value if isinstance(value, list) else [value]:
            if reasons and isinstance(one, str | int | float) and one in reasons:
                messages.append(f"{action.option_strings[0]} {one}: {reasons[one]}")
    return messages


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
    given = vars(args).pop(GIVEN, [])
    # By name, for the checks after this one: a refused flag may stand in for a required one
    # (arguments/validation.py), which is then not reported missing as well.
    args.megatron_flags_named = [option for option, _, _ in given]
    verdict = _rule(given)
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
            "`pretrain_gpt.py --help` (`--help-all`: every flag) and docs/flags.md; remove or correct the flag.")
    return HeteroError(
        f"{len(refused + unknown)} flag(s) Megatron-Hetero cannot run:\n  "
        + "\n  ".join(refused + unknown)
        + "\n(`pretrain_gpt.py --help-all` and docs/flags.md list every Megatron-LM flag with its status)")


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
