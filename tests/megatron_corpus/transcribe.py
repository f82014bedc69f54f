"""Writes corpus.json: the MODEL_ARGS of every GPT and MoE functional-test recipe of
Megatron-LM at one tag, read from a git mirror of Megatron-LM (facts: flags and values).

    python -m tests.megatron_corpus.transcribe /path/to/Megatron-LM.git [core_v0.16.1]
    python -m tests.megatron_corpus.transcribe /path/to/Megatron-LM.git core_v0.19.0

core_v0.16.1 writes corpus.json, another tag corpus.<tag>.json (corpus.corpus_file). The
example launch scripts are transcribed by hand in tests/recipes/*.args (at another tag,
tests/recipes/<tag>/*.args: bash arrays do not transcribe mechanically); corpus.py reads both.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.megatron_corpus.corpus import DEFAULT_TAG, corpus_file

ROOTS = ("tests/functional_tests/test_cases/gpt/", "tests/functional_tests/test_cases/moe/")


def _flag_list(model_args: dict) -> list[list[str]]:
    """[flag] or [flag, value] pairs. As Megatron-LM's test harness reads them: true is a
    bare switch, false leaves the flag out, a list is several values."""
    pairs: list[list[str]] = []
    for flag, value in (model_args or {}).items():
        if value is True:
            pairs.append([flag])
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            pairs.append([flag, " ".join(str(v) for v in value)])
        else:
            pairs.append([flag, str(value)])
    return pairs


def transcribe(git_dir: str, tag: str = DEFAULT_TAG) -> list[dict]:
    def git(*argv: str) -> str:
        return subprocess.run(["git", "--git-dir", git_dir, *argv], check=True,
                              capture_output=True, text=True).stdout

    paths = [p for p in git("ls-tree", "-r", "--name-only", tag, *ROOTS).splitlines()
             if p.endswith("/model_config.yaml")]
    recipes = []
    for path in sorted(paths):
        config = yaml.safe_load(git("show", f"{tag}:{path}")) or {}
        recipes.append({
            "name": f"{path.split('/')[-3]}/{path.split('/')[-2]}",
            "source": path,
            "test_type": config.get("TEST_TYPE", ""),
            "flags": _flag_list(config.get("MODEL_ARGS")),
        })
    return recipes


def main(argv: list[str]) -> None:
    git_dir, tag = argv[0], (argv[1] if len(argv) > 1 else DEFAULT_TAG)
    recipes = transcribe(git_dir, tag)
    lines = ",\n".join(json.dumps(r) for r in recipes)  # one recipe a line: diffs stay readable
    corpus_file(tag).write_text(
        f'{{"megatron_lm_tag": "{tag}",\n "recipes": [\n{lines}\n]}}\n')
    print(f"{len(recipes)} recipes -> {corpus_file(tag)}")


if __name__ == "__main__":
    main(sys.argv[1:])
