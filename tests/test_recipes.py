"""Real Megatron-LM recipes (tests/recipes/*.args) run unchanged but for one scale-down rule
(tests/recipes/README.md), with 4 processes under a heterogeneous plan. Their GPU-only
choices stay as written: the runtime's one CPU rule runs them as their CPU equivalents
(said in one start-up note) or refuses them by name, as for Megatron-LM's whole corpus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tiny_tokenizers
from conftest import make_plan, run_pretrain
from hetero.errors import HeteroError
from hetero.events import Iteration, of_kind
from megatron.hetero import startup
from megatron.hetero.arguments import build_parser
from megatron.hetero.flags.parsing import defined_options
from megatron.hetero.flags.rules import rulings

RECIPES = Path(__file__).parent / "recipes"

SIZES = {
    "--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32",
    "--ffn-hidden-size": "128", "--kv-channels": "16", "--num-query-groups": "2",
    "--max-position-embeddings": "32", "--num-experts": "4", "--vocab-size": "1000",
    "--micro-batch-size": "2", "--global-batch-size": "16", "--rampup-batch-size": "4 4 16",
}
LENGTH = {
    "--train-iters": "3", "--train-samples": "48", "--lr-decay-iters": "3", "--lr-decay-samples": "48",
    "--lr-warmup-iters": "1", "--lr-warmup-samples": "16", "--log-interval": "1",
    "--eval-interval": "2", "--eval-iters": "1", "--save-interval": "1000", "--num-workers": "0",
}
PARALLEL_DEGREES = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                    "--expert-model-parallel-size", "--context-parallel-size")
# Megatron's nsys/torch profiler hooks and its CI harness's test mode: refused by name for a
# user; the scale-down removes them (they belong to the harness, not to the recipe).
HARNESS_FLAGS = ("--profile", "--profile-step-start", "--profile-step-end", "--profile-ranks",
                 "--use-pytorch-profiler", "--test-mode")
PLAN = make_plan(tp=1, pp=2, dp=2, stages=[3, 1], replicas=[5, 3], rank_order=[2, 0, 3, 1])


def read_recipe(path: Path) -> list[tuple[str, str | None]]:
    """(flag, value) pairs of one recipe file (lines starting with # are comments)."""
    flags = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            flag, _, value = line.partition(" ")
            flags.append((flag, value.strip() or None))
    return flags


def scale_down(path: Path, workdir: Path) -> list[str]:
    """The recipe's flags under the documented scale-down rule (tests/recipes/README.md)."""
    flags = read_recipe(path)
    known = {s for action in build_parser()._actions for s in action.option_strings}
    files = tiny_tokenizers.files_for(dict(flags).get("--tokenizer-type", "GPT2BPETokenizer"), workdir)
    paths = {"--save": workdir / "ckpt", "--load": workdir / "ckpt",
             "--tensorboard-dir": workdir / "tb", "--data-cache-path": workdir / "cache"}
    out: list[str] = []
    for flag, value in flags:
        if flag in HARNESS_FLAGS or flag in PARALLEL_DEGREES:
            continue
        if flag == "--data-path":
            out.append("--mock-data")
        elif flag in files:
            out += [flag, files[flag]]
        elif flag in paths:
            out += [flag, str(paths[flag])]
        elif flag in SIZES or flag in LENGTH:
            out += [flag, *(SIZES.get(flag) or LENGTH[flag]).split()]
        else:
            out += [flag] if value is None else [flag, *value.split()]
    unknown = sorted({f for f in out if f.startswith("--") and f not in known})
    assert not unknown, f"{path.name}: flags the parser does not know: {unknown}"
    return out


RECIPE_FILES = sorted(RECIPES.glob("*.args"))


def test_every_recipe_names_its_megatron_source():
    assert len(RECIPE_FILES) >= 12
    sources = set()
    for path in RECIPE_FILES:
        first = path.read_text().splitlines()[0]
        match = re.match(r"# Mirrors Megatron-LM core_v0\.16\.1: (\S+)", first)
        assert match, path.name
        sources.add(match.group(1))
    assert {"examples/gpt3/train_gpt3_175b_distributed.sh", "examples/llama/train_llama3_8b_h100_fp8.sh",
            "examples/mixtral/train_mixtral_8x7b_distributed.sh"} <= sources
    assert len(sources) == len(RECIPE_FILES)


# Each recipe at its own layout, without a plan and under a plan made from its flags, is
# tests/test_megatron_corpus.py's; here they run under one heterogeneous plan of 4 processes.
@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPE_FILES, ids=lambda p: p.stem)
def test_recipe_runs_under_a_heterogeneous_plan(recipe, tmp_path):
    args = scale_down(recipe, tmp_path)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(PLAN))
    try:  # in-process first: where every refusal is decided, before a process starts
        configured = startup.configure([*args, "--hetero-plan", str(plan_path)], 4)
    except HeteroError as err:
        # Refused by name: flags of the recipe's that the flag catalog refuses on any
        # device, so the refusal holds on a GPU too.
        table = rulings(defined_options(build_parser()))
        status = {o: r.status for r in table.values() for o in r.flag.option_strings}
        named = re.findall(r"^\s*(--[a-z0-9-]+):", str(err), re.MULTILINE)  # one line a flag
        given = {flag for flag, _ in read_recipe(recipe)}
        assert named and set(named) <= given, str(err)
        assert all(status.get(flag) == "refused" for flag in named), str(err)
        return
    result = run_pretrain(args, nproc=4, plan=PLAN, tmp_path=tmp_path, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    iterations = of_kind(result.events, Iteration)  # Megatron's iteration lines, 1..3 in order
    assert [e.iteration for e in iterations] == [1, 2, 3], result.output[-3000:]
    # An --fp16 run skips its first steps while the loss scale comes down from 2^32 (all 3
    # here): no loss is logged there.
    losses = [e.losses["lm loss"] for e in iterations if "lm loss" in e.losses]
    assert all(0 < loss < 10 for loss in losses), result.output[-3000:]
    assert "--fp16" in args or len(losses) == 3
    if "--num-experts" in args:
        assert len(result.series("load_balancing_loss")) == 3
    # The GPU-only choices ran as their CPU equivalents, said once at start-up.
    notes = [line for line in result.output.splitlines() if "GPU-only choices run as" in line]
    assert len(notes) == (1 if configured.args.cpu_substitutions else 0), notes
    for phrase in configured.args.cpu_substitutions:
        assert phrase in notes[0]
