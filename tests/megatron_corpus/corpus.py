"""The corpus: Megatron-LM's GPT and MoE functional-test recipes (corpus.json, written by
transcribe.py) and its GPT/Llama/Mixtral example launch scripts (tests/recipes/*.args,
transcribed by hand), each as its name, its source path at the tag and its flags.

One corpus a Megatron-LM tag: core_v0.16.1 (the default: corpus.json, tests/recipes/*.args)
and core_v0.19.0 (corpus.core_v0.19.0.json, tests/recipes/core_v0.19.0/*.args)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
ARGS_DIR = HERE.parent / "recipes"
EXAMPLES = ("gpt3_175b", "llama3_8b_fp8", "mixtral_8x7b")
DEFAULT_TAG = "core_v0.16.1"
TAGS = (DEFAULT_TAG, "core_v0.19.0")


def corpus_file(tag: str = DEFAULT_TAG) -> Path:
    """The functional-test recipes transcribed at the tag (transcribe.py writes it)."""
    return HERE / ("corpus.json" if tag == DEFAULT_TAG else f"corpus.{tag}.json")


def args_dir(tag: str = DEFAULT_TAG) -> Path:
    """The example launch scripts transcribed by hand at the tag."""
    return ARGS_DIR if tag == DEFAULT_TAG else ARGS_DIR / tag


@dataclass(frozen=True)
class Recipe:
    name: str
    source: str
    flags: list[list[str]]  # [flag] or [flag, value], in the recipe's order

    def sample_key(self) -> str:
        """A stable hash: the default suite runs the recipes whose key sorts first."""
        return hashlib.sha256(self.name.encode()).hexdigest()


def _example(stem: str, tag: str = DEFAULT_TAG) -> Recipe:
    lines = (args_dir(tag) / f"{stem}.args").read_text().splitlines()
    source = re.match(rf"# Mirrors Megatron-LM {re.escape(tag)}: (\S+)", lines[0]).group(1)
    flags = []
    for line in lines:
        if line.strip() and not line.startswith("#"):
            flag, _, value = line.partition(" ")
            flags.append([flag] if not value.strip() else [flag, value.strip()])
    return Recipe(f"examples/{stem}", source, flags)


def recipes(tag: str = DEFAULT_TAG) -> list[Recipe]:
    if tag not in TAGS:
        raise ValueError(f"no corpus for {tag}: one of {', '.join(TAGS)}")
    data = json.loads(corpus_file(tag).read_text())
    assert data["megatron_lm_tag"] == tag, (corpus_file(tag), data["megatron_lm_tag"])
    found = [Recipe(r["name"], r["source"], r["flags"]) for r in data["recipes"]]
    return found + [_example(stem, tag) for stem in EXAMPLES]


def sample(count: int, tag: str = DEFAULT_TAG) -> list[Recipe]:
    """The default suite's stable sample: the first ``count`` recipes by hash."""
    return sorted(recipes(tag), key=Recipe.sample_key)[:count]
