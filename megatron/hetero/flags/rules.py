"""Each Megatron-LM flag's status: honoured, no-op or refused, and why.

honoured: arguments/ defines it, with Megatron-LM's meaning and default (every value of it
runs). no-op: catalog.NOOPS, or a flag Megatron-LM's pretrain_gpt.py never reads (``reads``:
read nowhere, or only under a refused switch). refused: a theme of the catalog, or
catalog.DEFAULT_ONLY (defined by arguments/, but only Megatron-LM's default value runs).

The flags are those of the Megatron-LM tag in use (facts.megatron_tag(): the installed
megatron-core's). Every flag of the reference tag (the first of facts.FACTS_FILES) has a
ruling of its own; a later tag's flag that is neither honoured, nor a no-op by the same rules,
nor catalogued is refused under the theme "unreviewed", by name.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from megatron.hetero.flags import catalog
from megatron.hetero.flags.facts import FACTS_FILES, MegatronFlag, known_flag_names, megatron_flags, megatron_tag
from megatron.hetero.flags.reads import unread_reason


class Status(str, enum.Enum):
    HONOURED = "honoured"
    NOOP = "no-op"
    REFUSED = "refused"


@dataclass(frozen=True)
class Ruling:
    """What Megatron-Hetero does with one Megatron-LM flag."""

    flag: MegatronFlag
    status: Status
    reason: str = ""            # no-op: why it has no effect; refused: what it is, what to do
    theme: str | None = None    # key of catalog.THEMES for refused flags

    def message(self, option: str) -> str:
        return f"{option}: {self.reason}"

    @property
    def default_only(self) -> bool:
        """Refused, but defined by arguments/: its default runs, any other value is refused
        when the flags are validated (not while parsing)."""
        return self.flag.name in catalog.DEFAULT_ONLY


def rulings(honoured: set[str]) -> dict[str, Ruling]:
    """Each Megatron-LM flag's ruling, by its first option string; ``honoured`` are the
    option strings arguments/ defines."""
    return dict(_rulings(frozenset(honoured)))


@functools.cache  # every parse_args builds a parser; the registry is the same each time
def _rulings(honoured: frozenset[str]) -> dict[str, Ruling]:
    check_registry(honoured)
    flags = megatron_flags()
    themes = _themes(honoured)
    noops = {**unread_flags(honoured), **catalog.noops()}
    result = {}
    for flag in flags:
        name = flag.name
        if name in catalog.DEFAULT_ONLY:
            theme = catalog.DEFAULT_ONLY[name]
            reason = catalog.REASONS.get(name) or catalog.THEMES[theme].reason()
            result[name] = Ruling(flag, Status.REFUSED, reason, theme)
        elif honoured & set(flag.option_strings):
            result[name] = Ruling(flag, Status.HONOURED)
        elif name in noops:
            result[name] = Ruling(flag, Status.NOOP, noops[name])
        else:
            theme = themes[name]
            reason = catalog.REASONS.get(name) or catalog.THEMES[theme].reason()
            result[name] = Ruling(flag, Status.REFUSED, reason, theme)
    return result


def is_reference_tag() -> bool:
    return megatron_tag() == next(iter(FACTS_FILES))


def _themes(honoured: frozenset[str]) -> dict[str, str]:
    """Each refused flag's theme; under a later tag than the reference one, "unreviewed" for a
    flag nothing else rules on."""
    flags = megatron_flags()
    themes = catalog.theme_of_flags({f.name: f.group for f in flags})
    if not is_reference_tag():
        ruled = set(themes) | set(catalog.noops()) | set(unread_flags(honoured)) | set(catalog.DEFAULT_ONLY)
        for flag in flags:
            if flag.name not in ruled and not honoured & set(flag.option_strings):
                themes[flag.name] = "unreviewed"
    return themes


def refused_switches(honoured: set[str] | frozenset[str]) -> dict[str, str]:
    """dest -> name of the flags the catalog refuses whatever happens (listed under a theme or
    in another program's group, not honoured) that are off unless given."""
    flags = megatron_flags()
    themes = catalog.theme_of_flags({f.name: f.group for f in flags})
    noops = catalog.noops()
    return {f.dest: f.name for f in flags if f.name in themes and f.name not in noops
            and not honoured & set(f.option_strings) and not f.default}


@functools.cache
def _unread_flags(honoured: frozenset[str]) -> dict[str, str]:
    switches = refused_switches(honoured)
    found = {}
    for flag in megatron_flags():
        if honoured & set(flag.option_strings) or flag.name in catalog.DEFAULT_ONLY:
            continue
        reason = unread_reason(flag, switches, megatron_tag())
        if reason is not None:
            found[flag.name] = reason
    return found


def unread_flags(honoured: set[str] | frozenset[str]) -> dict[str, str]:
    """Flags Megatron-LM's pretrain_gpt.py never acts on (flags/reads.py): name -> why."""
    return dict(_unread_flags(frozenset(honoured)))


def check_registry(honoured: set[str]) -> None:
    """One status per flag: a flag both honoured and catalogued, or neither, is a bug."""
    flags = megatron_flags()
    unread = unread_flags(honoured)
    listed = set(catalog.theme_of_flags({})) | set(catalog.noops())
    # Flags of other programs' groups are refused whole, unless arguments/ honours one.
    catalogued = listed | set(_themes(frozenset(honoured))) | set(unread)
    defined = {f.name for f in flags if honoured & set(f.option_strings)}
    problems = []
    # Under a later tag Megatron-LM may have stopped reading a catalogued flag: a no-op there.
    themed = sorted(set(catalog.theme_of_flags({})) & set(unread)) if is_reference_tag() else []
    if themed:
        problems.append(f"listed under a theme of flags/catalog.py, but Megatron-LM's pretrain_gpt.py "
                        f"never acts on it (a no-op by flags/reads.py; delete the entry): {', '.join(themed)}")
    if duplicates := catalog.duplicate_entries():
        problems.append(f"listed twice in flags/catalog.py: {', '.join(duplicates)}")
    both = sorted(defined & listed)
    if both:
        problems.append(f"honoured by arguments/ AND listed in flags/catalog.py (delete the "
                        f"catalog entry): {', '.join(both)}")
    neither = sorted(f.name for f in flags if f.name not in defined | catalogued)
    if neither:
        problems.append(f"neither honoured nor in flags/catalog.py: {', '.join(neither)}")
    undefined = sorted(set(catalog.DEFAULT_ONLY) - defined)
    if undefined:
        problems.append(f"in flags/catalog.py's DEFAULT_ONLY but not defined by arguments/ "
                        f"(list it under a theme instead): {', '.join(undefined)}")
    unknown = sorted((catalogued | set(catalog.DEFAULT_ONLY)) - known_flag_names())
    if unknown:
        problems.append(f"in flags/catalog.py but not a Megatron-LM flag: {', '.join(unknown)}")
    if problems:
        raise RuntimeError("flag registry is inconsistent: " + "; ".join(problems))


def counts(table: dict[str, Ruling]) -> dict[Status, int]:
    return {status: sum(r.status is status for r in table.values()) for status in Status}
