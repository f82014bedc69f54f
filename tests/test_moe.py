"""Mixture-of-experts models under heterogeneous plans, and the MoE flags refused by name."""

import pytest

from conftest import LLAMA_MODEL, TRAINING, assert_same_training, make_plan, run_pretrain
from hetero.errors import HeteroError
from megatron.hetero.arguments import parse_args, validate_args

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall"]


@pytest.mark.slow
def test_moe_with_uneven_stages_and_unequal_replicas_trains_as_one_process(tmp_path):
    args = LLAMA_MODEL + TRAINING + MOE + ["--eval-iters", "0", "--train-iters", "4"]
    reference = run_pretrain(args)
    assert reference.returncode == 0, reference.output[-3000:]
    plan = make_plan(tp=1, pp=2, dp=2, stages=[3, 1], replicas=[5, 3], rank_order=[2, 0, 3, 1])
    result = run_pretrain(args, nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(reference, result)
    # The router's load-balancing loss is in Megatron's iteration line, and is the mean over
    # all micro-batches of the iteration whatever the split between replicas.
    ref, got = reference.series("load_balancing_loss"), result.series("load_balancing_loss")
    assert len(ref) == 4 and all(0.9 < v < 2.0 for v in ref)
    for a, b in zip(ref, got):
        assert abs(a - b) <= 1e-4 * a


@pytest.mark.parametrize("extra, fragment", [
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2: expert parallelism"),
    (["--moe-token-dispatcher-type", "flex"], "flex needs DeepEP"),
    (["--moe-router-topk", "5"], "--moe-router-topk 5 must be between 1 and --num-experts 4"),
])
def test_moe_flags_refused_by_name(extra, fragment):
    args = parse_args(LLAMA_MODEL + TRAINING + MOE + extra)
    args.tensor_model_parallel_size = 1
    with pytest.raises(HeteroError, match=fragment):
        validate_args(args)


def test_moe_with_biases_is_refused_on_local_layers():
    model = [a for a in LLAMA_MODEL if a != "--disable-bias-linear"]
    args = parse_args(model + TRAINING + MOE)
    args.tensor_model_parallel_size = 1
    with pytest.raises(HeteroError, match="add --disable-bias-linear"):
        validate_args(args)
