"""validate_args: Megatron-LM's derived defaults and every contradiction among the parsed
flags, collected into one error; the schedule and model-shape checks."""

from __future__ import annotations

import argparse

from hetero.errors import HeteroError
from megatron.hetero.problems import Problems
from megatron.hetero.arguments.config_fields import _validate_config_fields, apply_logging_level
from megatron.hetero.arguments.feature_checks import (_validate_logging_and_checkpoints, _validate_moe,
                                                      _validate_profiling, _wrapper_tuning_problems)
from megatron.hetero.arguments.groups_data import read_data_args_files, uses_split_paths
from megatron.hetero.arguments.groups_model import used_kernel_tuning_flags
from megatron.hetero.arguments.vocabulary import tensor_parallel_sizes


def _require(args: argparse.Namespace, *names: str) -> None:
    # core_v0.19's --step-batch-size-schedule sets the batch instead (Megatron-LM then needs
    # no --global-batch-size); the schedule itself is refused by name, not as a missing flag.
    given_elsewhere = {"global_batch_size"} if "--step-batch-size-schedule" in getattr(
        args, "megatron_flags_named", ()) else set()
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is None and n not in given_elsewhere]
    if missing:
        raise HeteroError(f"missing required flag(s): {', '.join(missing)}")


def validate_args(args: argparse.Namespace) -> None:
    """Fills Megatron-LM's derived defaults and rejects contradictory combinations: every
    contradiction found in one error (the checks after the required flags are independent)."""
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size", "global_batch_size", "lr")
    from megatron.hetero.cpu_device import substitute_gpu_choices

    problems = Problems()
    # First: the checks below then see the layers, attention and experts that will run.
    _, args.cpu_substitutions = problems.attempt(substitute_gpu_choices, args, used_kernel_tuning_flags(args))
    for check in (_validate_schedule, _validate_model_shape, _validate_moe, _validate_logging_and_checkpoints,
                  _validate_profiling):
        problems.attempt(check, args)
    if args.bf16 and args.fp16:
        problems.add("--bf16 and --fp16 are mutually exclusive; pick one")
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings and args.position_embedding_type == "learned_absolute":
        problems.add(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}; raise --max-position-embeddings")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (
            int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu else 4 * args.hidden_size
        )
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads:
            problems.add(
                f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                f"{args.num_attention_heads}; set --kv-channels explicitly")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    problems.attempt(_validate_config_fields, args)  # after the FFN size: --moe-ffn-hidden-size defaults to it
    apply_logging_level(args)  # as Megatron-LM, right after its flags are read
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups:
        problems.add(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--num-query-groups {args.num_query_groups}")
    for tp in tensor_parallel_sizes(args):
        for name, value in (("--num-attention-heads", args.num_attention_heads),
                            ("--num-query-groups", args.num_query_groups),
                            ("--ffn-hidden-size", args.ffn_hidden_size)):
            if value % tp:
                problems.add(f"{name} {value} is not divisible by the tensor-parallel size {tp}"
                                  + (" of a stage of the plan" if tp != args.tensor_model_parallel_size else ""))
    problems.attempt(read_data_args_files, args)
    if args.mock_data == bool(args.data_path or uses_split_paths(args)):
        problems.add("give exactly one of --mock-data or --data-path PREFIX [...] (or a dataset per "
                     "split: --train-data-path/--valid-data-path/--test-data-path)")
    if args.tokenizer_type is None:  # pretrain_gpt.py's default in Megatron-LM
        args.tokenizer_type = "GPT2BPETokenizer"
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        problems.add("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.dataloader_type is None:  # Megatron-LM's default
        args.dataloader_type = "single"
    if args.split is None and not uses_split_paths(args):  # a dataset per split has no --split
        args.split = "969, 30, 1"
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
        problems.add("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    for name in ("log_interval", "eval_interval", "save_interval", "exit_interval",
                 "tensorboard_log_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            problems.add(f"--{name.replace('_', '-')} must be at least 1")
    if args.save_retain_interval is not None and (
            args.save_interval is None or args.save_retain_interval < 1
            or args.save_retain_interval % args.save_interval or args.async_save):
        problems.add(f"--save-retain-interval {args.save_retain_interval} keeps the checkpoints of its "
                     "multiples and deletes the others as newer ones are written: it must be a positive "
                     "multiple of --save-interval, and not with --async-save")
    in_memory = args.non_persistent_ckpt_type in ("local", "in_memory")
    if args.non_persistent_save_interval is not None and (
            (args.non_persistent_ckpt_type is None and not args.inprocess_restart)
            or args.non_persistent_save_interval < 1):
        problems.add("--non-persistent-save-interval N saves every N iterations a checkpoint of the kind "
                     "--non-persistent-ckpt-type gives: add --non-persistent-ckpt-type global (N at least 1), "
                     "or --inprocess-restart for snapshots in memory")
    if in_memory and not args.inprocess_restart:
        problems.add(f"--non-persistent-ckpt-type {args.non_persistent_ckpt_type} keeps snapshots in memory, which "
                     "only an in-process restart reads: add --inprocess-restart, or use global")
    if args.inprocess_restart and args.non_persistent_ckpt_type == "global":
        problems.add("--inprocess-restart restores from snapshots in memory: --non-persistent-ckpt-type global "
                     "would also write them to disk; use in_memory (or leave it out)")
    for problem in _wrapper_tuning_problems(args):
        problems.add(problem)
    if args.hetero_snapshot_replicas < 0:
        problems.add("--hetero-snapshot-replicas R keeps R copies of each snapshot on other nodes: give 0 or more")
    if args.ckpt_convert_format is not None and (args.load is None or args.ckpt_convert_save is None):
        problems.add("--ckpt-convert-format converts the checkpoint of --load DIR into --ckpt-convert-save DIR; "
                     "give both")
    if args.save_interval is not None and args.save is None:
        problems.add("--save-interval needs --save DIR (where to write the checkpoints)")
    args.params_dtype = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")
    problems.raise_if_any()


def _validate_schedule(args: argparse.Namespace) -> None:
    """Iteration- or sample-based training, as Megatron-LM: one unit for all schedule flags."""
    if (args.train_iters is None) == (args.train_samples is None):
        raise HeteroError("give exactly one of --train-iters and --train-samples")
    by_samples = args.train_samples is not None
    unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
    mixed = [f"--lr-{kind}-{other}" for kind in ("decay", "warmup", "wsd-decay")
             if getattr(args, f"lr_{kind.replace('-', '_')}_{other}")]
    if mixed:
        raise HeteroError(
            f"{', '.join(mixed)} with --train-{unit}: Megatron-LM counts every schedule in one "
            f"unit; use --lr-*-{unit} with --train-{unit}")
    if by_samples and args.lr_decay_samples is None:  # Megatron-LM's defaults
        args.lr_decay_samples = args.train_samples
    if not by_samples and args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    warmup = args.lr_warmup_samples if by_samples else args.lr_warmup_iters
    if args.lr_warmup_fraction is not None and warmup:
        raise HeteroError(f"give only one of --lr-warmup-fraction and --lr-warmup-{unit}")
    if args.rampup_batch_size is not None:
        start, increment, samples = args.rampup_batch_size
        if start < 1 or increment < 1 or samples < 0:
            raise HeteroError(
                f"--rampup-batch-size {start} {increment} {samples}: the start batch and the "
                "increment must be positive, the ramp-up samples non-negative")
        if start > args.global_batch_size or (args.global_batch_size - start) % increment:
            raise HeteroError(
                f"--rampup-batch-size {start} {increment} {samples}: --global-batch-size "
                f"{args.global_batch_size} must be START plus a whole number of INCREMENTs")
        steps = range(start, args.global_batch_size + 1, increment)
        uneven = [b for b in steps if b % args.micro_batch_size]
        if uneven:
            raise HeteroError(
                f"--rampup-batch-size: ramp batch sizes {uneven[:4]} are not multiples of the "
                f"micro-batch size {args.micro_batch_size}; choose START and INCREMENT as "
                "multiples of it")


def _validate_model_shape(args: argparse.Namespace) -> None:
    if args.squared_relu and args.swiglu:
        raise HeteroError("--squared-relu and --swiglu are two activations; pick one")
    if not args.add_position_embedding and args.position_embedding_type != "rope" and not (
            args.use_rotary_position_embeddings):
        raise HeteroError("--no-position-embedding is deprecated (Megatron-LM accepts it only with "
                          "--position-embedding-type rope); use --position-embedding-type none")
