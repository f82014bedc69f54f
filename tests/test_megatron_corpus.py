"""Megatron-LM's own GPT and MoE recipes (tests/megatron_corpus/: every functional-test
recipe at core_v0.16.1 and the example launch scripts), run under one scale-down rule at
their own parallel layout: each trains, or is refused with the runtime's reason naming a
flag - never a traceback. docs/megatron-recipes.md is the table of the recorded statuses.

Every recipe is configured in-process (where refusals are decided) on every run; a stable
sample of the recipes that train is launched by default, all of them with
MEGATRON_CORPUS=all (python -m tests.megatron_corpus.report regenerates the table).
"""

from __future__ import annotations

import os
import re

import pytest

import tiny_tokenizers
from conftest import run_pretrain
from tests.megatron_corpus import report
from tests.megatron_corpus.corpus import recipes
from tests.megatron_corpus.scale import check_divisible, layout_of, scale_down

RECIPES = recipes()
BY_NAME = {r.name: r for r in RECIPES}
RECORDED = report.load_statuses()
TRAINED = sorted((r for r in RECIPES if RECORDED.get(r.name, report.Outcome("", "")).status == "trained"),
                 key=lambda r: r.sample_key())
SAMPLE = 8  # launched by default (4-8 s each on 2 cores)
LAUNCHED = TRAINED if os.environ.get("MEGATRON_CORPUS") == "all" else TRAINED[:SAMPLE]


def test_corpus_holds_every_gpt_and_moe_recipe():
    assert len(RECIPES) == len(BY_NAME) == 187  # 184 functional tests + 3 example scripts
    assert sum(r.source.startswith("tests/functional_tests/test_cases/moe/") for r in RECIPES) == 42
    assert {r.source for r in RECIPES if r.name.startswith("examples/")} == {
        "examples/gpt3/train_gpt3_175b_distributed.sh", "examples/llama/train_llama3_8b_h100_fp8.sh",
        "examples/mixtral/train_mixtral_8x7b_distributed.sh"}
    assert set(RECORDED) == set(BY_NAME), "rerun python -m tests.megatron_corpus.report"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_scale_down_keeps_the_layout(recipe, tmp_path):
    argv = scale_down(recipe.flags, tmp_path)
    given = {p[0]: p[1] if len(p) > 1 else None for p in recipe.flags}
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--context-parallel-size", "--expert-model-parallel-size",
                 "--num-virtual-stages-per-pipeline-rank", "--sequence-parallel",
                 "--use-distributed-optimizer", "--transformer-impl", "--attention-backend"):
        if flag in given:
            index = argv.index(flag)
            assert given[flag] is None or argv[index + 1] == given[flag], flag
    check_divisible(layout_of(recipe.flags), argv)
    assert not any("$" in a for a in argv)


def test_every_recipe_configures_or_is_refused_by_name(tmp_path):
    """Every recipe, in-process: the refusal (or none) the table records, naming a flag."""
    changed = []
    for recipe in RECIPES:
        got = report.configure_outcome(recipe, tmp_path / re.sub(r"\W", "_", recipe.name))
        recorded = RECORDED[recipe.name]
        if got is None:
            if recorded.status == "refused" and recorded.reason.startswith("[launch"):
                continue
            assert recorded.status != "failed", f"{recipe.name}: {recorded.reason[-1500:]}"
            if recorded.status == "refused":
                changed.append(f"{recipe.name}: now configures (recorded refused)")
            continue
        assert "Traceback" not in got.reason
        named = report.refused_flags(got.reason)
        # A flag the recipe gives, or one it lacks (an inference recipe gives no MODEL_ARGS).
        assert set(named) & {p[0] for p in recipe.flags} or got.reason.startswith("missing --"), (
            f"{recipe.name}: the refusal names none of the recipe's flags: {got.reason}")
        if recorded.status != "refused" or recorded.reason != got.reason:
            changed.append(f"{recipe.name}: refused now with {got.reason!r}, recorded "
                           f"{recorded.status} {recorded.reason!r}")
    assert not changed, ("statuses changed; rerun python -m tests.megatron_corpus.report:\n"
                         + "\n".join(changed))


def test_no_recipe_fails_and_the_table_is_up_to_date():
    failed = {n: o.reason[-800:] for n, o in RECORDED.items() if o.status == "failed"}
    assert not failed, failed
    assert report.DOC.read_text() == report.markdown(RECIPES, RECORDED), (
        "docs/megatron-recipes.md is stale: python -m tests.megatron_corpus.report")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", LAUNCHED, ids=lambda r: r.name)
def test_recipe_trains_at_its_own_layout(recipe, tmp_path):
    got = report.launch_outcome(recipe, tmp_path)
    assert got.status == "trained", got.reason


# A typical GPU launch script: only the sizes are scaled; its GPU-only choices must run on
# the CPU as their equivalents, said in one start-up note.
GPU_SCRIPT = [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--sequence-parallel", "--use-distributed-optimizer", "--bf16",
    "--transformer-impl", "transformer_engine", "--attention-backend", "fused",
    "--distributed-backend", "nccl", "--no-gradient-accumulation-fusion",
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "1",
    "--lr", "1e-4", "--lr-decay-style", "cosine", "--log-interval", "1",
    "--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
]


@pytest.mark.slow
def test_a_gpu_launch_script_starts_on_four_cpu_processes(tmp_path):
    vocab, merges = tiny_tokenizers.gpt2_bpe_files(tmp_path / "gpt2")
    result = run_pretrain(GPU_SCRIPT + ["--vocab-file", str(vocab), "--merge-file", str(merges)],
                          nproc=4, tmp_path=tmp_path, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    assert len(result.losses()) == 2
    notes = [line for line in result.output.splitlines() if "GPU-only choices run as" in line]
    assert len(notes) == 1, notes
    for said in ("--transformer-impl transformer_engine -> local", "--attention-backend fused -> local",
                 "--distributed-backend nccl -> gloo", "--no-gradient-accumulation-fusion"):
        assert said in notes[0]
