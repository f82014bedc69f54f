"""The corpus: Megatron-LM's GPT and MoE functional-test recipes (corpus.json, written by
transcribe.py) and its GPT/Llama/Mixtral example launch scripts (tests/recipes/*.args,
transcribed by hand), each as its name, its source path at the tag and its flags."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
ARGS_DIR = HERE.parent / "recipes"
EXAMPLES = ("gpt3_175b", "llama3_8b_fp8", "mixtral_8x7b")


@dataclass(frozen=True)
class Recipe:
    name: str
    source: str
    flags: list[list[str]]  # [flag] or [flag, value], in the recipe's order

    def sample_key(self) -> str:
        """A stable hash: the default suite runs the recipes whose key sorts first."""
        return hashlib.sha256(self.name.encode()).hexdigest()


def _example(stem: str) -> Recipe:
    lines = (ARGS_DIR / f"{stem}.args").read_text().splitlines()
    source = re.match(r"# Mirrors Megatron-LM core_v0\.16\.1: (\S+)", lines[0]).group(1)
    flags = []
    for line in lines:
        if line.strip() and not line.startswith("#"):
            flag, _, value = line.partition(" ")
            flags.append([flag] if not value.strip() else [flag, value.strip()])
    return Recipe(f"examples/{stem}", source, flags)


def recipes() -> list[Recipe]:
    data = json.loads((HERE / "corpus.json").read_text())
    found = [Recipe(r["name"], r["source"], r["flags"]) for r in data["recipes"]]
    return found + [_example(stem) for stem in EXAMPLES]


def sample(count: int) -> list[Recipe]:
    """The default suite's stable sample: the first ``count`` recipes by hash."""
    return sorted(recipes(), key=Recipe.sample_key)[:count]
