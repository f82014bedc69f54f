import pytest

from conftest import GPT_MODEL, TRAINING, make_plan
from hetero.spec.devices import device_type_matches
from hetero.errors import HeteroError
from hetero.plan import Plan
from megatron.hetero.arguments import apply_plan, padded_vocab_size, parse_args, validate_args


def _args(*extra):
    args = parse_args(GPT_MODEL + TRAINING + list(extra))
    args.tensor_model_parallel_size = args.tensor_model_parallel_size or 1
    return args


def test_megatron_defaults_are_derived():
    args = _args("--swiglu")
    validate_args(args)
    assert args.ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64
    assert args.kv_channels == 16
    assert args.num_query_groups == 4  # no --group-query-attention: one group per head
    assert args.lr_decay_iters == args.train_iters
    assert args.params_dtype == "fp32" and args.add_bias_linear


def test_gqa_and_rope_alias():
    args = _args("--group-query-attention", "--num-query-groups", "2",
                 "--use-rotary-position-embeddings")
    validate_args(args)
    assert args.num_query_groups == 2 and args.position_embedding_type == "rope"


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--bf16", "--fp16"], "mutually exclusive"),
        (["--data-path", "x"], "exactly one of --mock-data or --data-path"),
        (["--tensor-model-parallel-size", "3"], "not divisible by the tensor-parallel size 3"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "only one of --lr-warmup-fraction"),
    ],
)
def test_contradictory_flags(extra, fragment):
    with pytest.raises(HeteroError, match=fragment):
        validate_args(_args(*extra))


def test_unknown_flag_suggests_the_megatron_name():
    with pytest.raises(HeteroError, match=r"unknown flag --hiden-size \(did you mean --hidden-size\?\)"):
        parse_args(GPT_MODEL + ["--hiden-size", "8"])


def test_plan_supplies_and_checks_parallel_flags():
    plan = Plan.from_dict(make_plan(tp=2, pp=2, dp=1, stages=[3, 1], replicas=[8],
                                    rank_order=[0, 1, 2, 3]))
    args = parse_args(GPT_MODEL + TRAINING)
    apply_plan(args, plan)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    for flag, value in [("--pipeline-model-parallel-size", "4"), ("--micro-batch-size", "1"),
                        ("--num-layers", "6")]:
        args = parse_args(GPT_MODEL + TRAINING + [flag, value])
        with pytest.raises(HeteroError, match=f"{flag} {value} contradicts the plan"):
            apply_plan(args, plan)


def test_vocab_padding_follows_megatron():
    args = _args()
    assert padded_vocab_size(1001, args) == 1024
    args.tensor_model_parallel_size = 4
    assert padded_vocab_size(1001, args) == 1024
    args.make_vocab_size_divisible_by = 100
    assert padded_vocab_size(1001, args) == 1200


@pytest.mark.parametrize(
    "plan_name, driver_name, match",
    [
        ("A100-40GB", "NVIDIA A100-SXM4-40GB", True),
        ("A100-80GB", "NVIDIA A100-SXM4-40GB", False),
        ("H100-80GB", "NVIDIA H100 80GB HBM3", True),
        ("MI250X", "AMD Instinct MI250X", True),
        ("MI250X", "AMD Instinct MI210", False),
        ("RTX-4090", "NVIDIA GeForce RTX 4090", True),
    ],
)
def test_device_names(plan_name, driver_name, match):
    assert device_type_matches(plan_name, driver_name) is match
