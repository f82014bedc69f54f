"""Loss parity: a heterogeneous plan trains the same model on the same data as one process.

The planned runs differ from the reference in everything a plan can change: uneven
stages, unequal micro-batch counts per replica (so gradient weighting matters from the
second iteration on), a permuted rank order, and tensor parallelism.
"""

import pytest

from conftest import (
    GPT_MODEL,
    LLAMA_MODEL,
    TRAINING,
    assert_same_training,
    make_plan,
    run_pretrain,
)

pytestmark = pytest.mark.slow


@pytest.mark.core019
def test_uneven_stages_unequal_replicas_permuted_ranks(tmp_path, gpt_reference):
    plan = make_plan(
        tp=1, pp=2, dp=2, stages=[3, 1], replicas=[5, 3], rank_order=[2, 0, 3, 1]
    )
    result = run_pretrain(GPT_MODEL + TRAINING, nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(gpt_reference, result)
    assert "logical rank    0 (tp 0, dp 0, pp 0) -> launch rank    2" in result.stdout


def test_tensor_parallel_with_unequal_replicas(tmp_path, llama_reference):
    plan = make_plan(tp=2, pp=1, dp=2, stages=[4], replicas=[6, 2], rank_order=[1, 3, 0, 2])
    result = run_pretrain(LLAMA_MODEL + TRAINING, nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(llama_reference, result)


def test_tensor_and_pipeline_parallel_one_layer_stage(tmp_path, llama_reference):
    plan = make_plan(tp=2, pp=2, dp=1, stages=[1, 3], replicas=[8], rank_order=[3, 1, 2, 0])
    result = run_pretrain(LLAMA_MODEL + TRAINING, nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(llama_reference, result)
