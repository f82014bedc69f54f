"""Megatron-LM's flags as its own parser defines them at the pinned tag.

hetero/spec/megatron_lm_flags.json is written by tools/extract_megatron_flags.py
from Megatron-LM's parser: names, defaults, value kinds, groups; never help texts or code.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FACTS_FILE = Path(__file__).parents[3] / "hetero" / "spec" / "megatron_lm_flags.json"  # shared with hetero-plan


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
