"""Megatron-LM's flags as its own parser defines them, at the tag of the installed megatron-core.

One file per Megatron-LM tag (hetero/spec/megatron_lm_flags*.json, shared with hetero-plan),
written by tools/extract_megatron_flags.py from Megatron-LM's parser: names, defaults, value
kinds, groups; never help texts or code. Which tag a process uses: hetero/spec/megatron_tags.py.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from hetero.spec.megatron_tags import FACTS_FILES, TAG_VARIABLE, TAGS, megatron_tag

FACTS_FILE = FACTS_FILES["core_v0.16.1"]
__all__ = ["FACTS_FILE", "FACTS_FILES", "TAGS", "TAG_VARIABLE", "MegatronFlag", "known_flag_names",
           "megatron_flags", "megatron_tag"]


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


@functools.cache
def megatron_flags(tag: str | None = None) -> tuple[MegatronFlag, ...]:
    """Megatron-LM's flags at ``tag`` (default: megatron_tag())."""
    document = json.loads(FACTS_FILES[tag or megatron_tag()].read_text())
    return tuple(
        MegatronFlag(
            option_strings=tuple(f["option_strings"]), dest=f["dest"], action=f["action"],
            default=f["default"], nargs=f["nargs"], type=f["type"],
            choices=tuple(f["choices"]) if f["choices"] is not None else None,
            group=f["group"], source=f["source"],
        )
        for f in document["flags"]
    )


def known_flag_names() -> set[str]:
    """The first option strings of every tag's flags (the catalog may rule on any of them)."""
    return {flag.name for tag in FACTS_FILES for flag in megatron_flags(tag)}
