"""Model-shape flags of Megatron-LM recipes, trained under a heterogeneous plan."""

import pytest

from conftest import GPT_MODEL, TRAINING, assert_same_training, make_plan, run_pretrain

SHAPE = ["--squared-relu", "--position-embedding-type", "rope", "--no-position-embedding",
         "--rotary-interleaved", "--rotary-base", "500000", "--rotary-percent", "0.5",
         "--qk-layernorm", "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
         "--decoupled-lr", "3e-3", "--decoupled-min-lr", "1e-4", "--eval-iters", "0",
         "--train-iters", "4"]


@pytest.mark.slow
def test_shape_flags_train_the_same_under_a_heterogeneous_plan(tmp_path):
    reference = run_pretrain(GPT_MODEL + TRAINING + SHAPE)
    assert reference.returncode == 0, reference.output[-3000:]
    plan = make_plan(tp=2, pp=2, dp=1, stages=[1, 3], replicas=[8], rank_order=[3, 1, 2, 0])
    result = run_pretrain(GPT_MODEL + TRAINING + SHAPE, nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(reference, result)
    # --apply-layernorm-1p stores every norm scale as gamma - 1: the same function at the
    # start (equal first loss), different parameters (zeros instead of ones in the norm).
    plain = run_pretrain(GPT_MODEL + TRAINING + [f for f in SHAPE if f != "--apply-layernorm-1p"])
    assert plain.returncode == 0, plain.output[-3000:]
    assert plain.losses()[0] == pytest.approx(reference.losses()[0], rel=1e-5)
    assert plain.series("params norm")[0] > reference.series("params norm")[0]
