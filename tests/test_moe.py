"""Mixture-of-experts models under heterogeneous plans, and the MoE flags refused by name."""

import re

import pytest

from conftest import GPT_MODEL, LLAMA_MODEL, TRAINING, assert_same_training, make_plan, run_pretrain
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
    (["--expert-model-parallel-size", "3"], r"--num-experts \(4\) must be a multiple of it"),
    (["--moe-token-dispatcher-type", "flex"], "flex: the flex dispatcher runs on DeepEP or HybridEP"),
    (["--moe-router-topk", "5"], "--moe-router-topk 5 must be between 1 and --num-experts 4"),
])
def test_moe_flags_refused_by_name(extra, fragment):
    with pytest.raises(HeteroError, match=fragment):
        args = parse_args(LLAMA_MODEL + TRAINING + MOE + extra)
        args.tensor_model_parallel_size = 1
        validate_args(args)


def test_moe_with_biases_is_refused_on_local_layers():
    model = [a for a in LLAMA_MODEL if a != "--disable-bias-linear"]
    args = parse_args(model + TRAINING + MOE)
    args.tensor_model_parallel_size = 1
    with pytest.raises(HeteroError, match="add --disable-bias-linear"):
        validate_args(args)


def _parameters(result) -> int:
    found = re.findall(r"number of parameters on \(tensor, pipeline\) model parallel rank \(0, 0\): (\d+)",
                       result.output)
    assert found, result.output[-3000:]
    return int(found[0])


def test_moe_shape_flags_build_megatron_cores_layers():
    """--moe-ffn-hidden-size, --moe-shared-expert-intermediate-size/-gate and --moe-layer-freq
    reach megatron-core (its decoder block spec, as Megatron-LM's gpt_builders), and
    --moe-z-loss-coeff adds the router's z-loss to the iteration line; the router variants
    (sigmoid scores, expert bias, top-k scaling, grouped routing) change the first loss."""
    hidden, vocab, positions, experts = 64, 1024, 32, 4       # GPT_MODEL, 4 layers
    norm = 2 * hidden
    attention = norm + hidden * 3 * hidden + hidden * hidden + norm
    dense_mlp = 2 * hidden * 4 * hidden
    shape = ["--disable-bias-linear", "--num-experts", str(experts), "--moe-ffn-hidden-size", "32",
             "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate",
             "--moe-layer-freq", "([0]+[1]*3)", "--moe-z-loss-coeff", "0.01",
             "--train-iters", "1", "--eval-iters", "0"]
    result = run_pretrain(GPT_MODEL + TRAINING + shape)
    assert result.returncode == 0, result.output[-3000:]
    router, routed, shared, gate = experts * hidden, experts * 2 * hidden * 32, 2 * hidden * 64, hidden
    moe_layer = attention + router + routed + shared + gate
    embeddings = vocab * hidden + positions * hidden + norm
    assert _parameters(result) == embeddings + (attention + dense_mlp) + 3 * moe_layer
    assert result.series("z_loss")[0] > 0
    routing = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
               "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "2",
               "--moe-router-group-topk", "1"]
    routed_run = run_pretrain(GPT_MODEL + TRAINING + shape + routing)
    assert routed_run.returncode == 0, routed_run.output[-3000:]
    assert _parameters(routed_run) == _parameters(result)
    assert routed_run.losses()[0] != pytest.approx(result.losses()[0], rel=1e-6)
