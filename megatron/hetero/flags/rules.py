"""Each Megatron-LM flag's status: honoured, no-op or refused, and why.

honoured: arguments.py defines it, with Megatron-LM's meaning and default (every value of it
runs). no-op: catalog.NOOPS. refused: a theme of the catalog, or catalog.DEFAULT_ONLY (defined
by arguments.py, but only Megatron-LM's default value runs).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from megatron.hetero.flags import catalog
from megatron.hetero.flags.facts import MegatronFlag, megatron_flags


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
        """Refused, but defined by arguments.py: its default runs, any other value is refused
        when the flags are validated (not while parsing)."""
        return self.flag.name in catalog.DEFAULT_ONLY


def rulings(honoured: set[str]) -> dict[str, Ruling]:
    """Each Megatron-LM flag's ruling, by its first option string; ``honoured`` are the
    option strings arguments.py defines."""
    return dict(_rulings(frozenset(honoured)))


@functools.cache  # every parse_args builds a parser; the registry is the same each time
def _rulings(honoured: frozenset[str]) -> dict[str, Ruling]:
    check_registry(honoured)
    flags = megatron_flags()
    themes = catalog.theme_of_flags({f.name: f.group for f in flags})
    noops = catalog.noops()
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


def check_registry(honoured: set[str]) -> None:
    """One status per flag: a flag both honoured and catalogued, or neither, is a bug."""
    flags = megatron_flags()
    listed = set(catalog.theme_of_flags({})) | set(catalog.noops())
    # Flags of other programs' groups are refused whole, unless arguments.py honours one.
    catalogued = listed | set(catalog.theme_of_flags({f.name: f.group for f in flags}))
    defined = {f.name for f in flags if honoured & set(f.option_strings)}
    problems = []
    if duplicates := catalog.duplicate_entries():
        problems.append(f"listed twice in flags/catalog.py: {', '.join(duplicates)}")
    both = sorted(defined & listed)
    if both:
        problems.append(f"honoured by arguments.py AND listed in flags/catalog.py (delete the "
                        f"catalog entry): {', '.join(both)}")
    neither = sorted(f.name for f in flags if f.name not in defined | catalogued)
    if neither:
        problems.append(f"neither honoured nor in flags/catalog.py: {', '.join(neither)}")
    undefined = sorted(set(catalog.DEFAULT_ONLY) - defined)
    if undefined:
        problems.append(f"in flags/catalog.py's DEFAULT_ONLY but not defined by arguments.py "
                        f"(list it under a theme instead): {', '.join(undefined)}")
    unknown = sorted((catalogued | set(catalog.DEFAULT_ONLY)) - {f.name for f in flags})
    if unknown:
        problems.append(f"in flags/catalog.py but not a Megatron-LM flag: {', '.join(unknown)}")
    if problems:
        raise RuntimeError("flag registry is inconsistent: " + "; ".join(problems))


def counts(table: dict[str, Ruling]) -> dict[Status, int]:
    return {status: sum(r.status is status for r in table.values()) for status in Status}
