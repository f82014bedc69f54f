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


def test_megatron_config_dataclasses_take_every_honoured_field():
    """Megatron-LM's rule for OptimizerConfig (and TransformerConfig): every honoured flag
    named like a field is copied; the fields the caller decides win."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.hetero.arguments import config_from_flags

    plain = config_from_flags(OptimizerConfig, parse_args(GPT_MODEL + TRAINING), lr=5.0)
    assert plain.lr == 5.0 and plain.barrier_with_L1_time and not plain.apply_wd_to_qk_layernorm
    given = parse_args(GPT_MODEL + TRAINING + ["--apply-wd-to-qk-layernorm", "--no-barrier-with-level-1-timing"])
    config = config_from_flags(OptimizerConfig, given)
    assert config.apply_wd_to_qk_layernorm and not config.barrier_with_L1_time
    # Megatron-LM's deprecated spelling of the same switch.
    old = parse_args(GPT_MODEL + TRAINING + ["--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"])
    old.tensor_model_parallel_size = 1
    validate_args(old)
    assert old.apply_wd_to_qk_layernorm


def test_megatrons_other_names_of_num_layers_and_seq_length():
    without = [a for a in GPT_MODEL]
    for flag in ("--num-layers", "--seq-length"):
        index = without.index(flag)
        del without[index:index + 2]
    args = parse_args(without + TRAINING + ["--encoder-num-layers", "3", "--encoder-seq-length", "16"])
    assert (args.num_layers, args.seq_length) == (3, 16)
    with pytest.raises(HeteroError, match="--encoder-num-layers and --num-layers name the same setting"):
        parse_args(GPT_MODEL + TRAINING + ["--encoder-num-layers", "3"])


def test_dataset_flags_reach_megatron_cores_dataset_config(tmp_path):
    from megatron.hetero import data

    args = parse_args(GPT_MODEL + TRAINING + ["--num-dataset-builder-threads", "2",
                                              "--mid-level-dataset-surplus", "0.01",
                                              "--allow-ambiguous-pad-tokens"])
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = args.data_parallel_size = 1
    validate_args(args)
    config = data.build_datasets(args, data.build_tokenizer(args), 64)[0].config
    assert (config.num_dataset_builder_threads, config.mid_level_dataset_surplus,
            config.allow_ambiguous_pad_tokens) == (2, 0.01, True)
    args.per_dataset_sequences_path = str(tmp_path / "missing.json")
    with pytest.raises(HeteroError, match="--per-dataset-sequences-path .*missing.json"):
        data.build_datasets(args, data.build_tokenizer(args), 64)
    with pytest.raises(HeteroError, match="--dataloader-defer-npy-index-mmap needs --data-cache-path"):
        _validated("--dataloader-defer-npy-index-mmap")


def _validated(*extra):
    args = _args(*extra)
    validate_args(args)
    return args


def test_logging_level_sets_the_root_logger_as_megatron_does():
    import logging

    root = logging.getLogger()
    before = root.level
    try:
        _validated("--logging-level", "40")
        assert root.level == 40
    finally:
        root.setLevel(before)
