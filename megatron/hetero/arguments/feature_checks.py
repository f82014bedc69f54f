"""validate_args' checks of features: mixture of experts, logging (W&B) and checkpoints,
profiling, and the in-process wrapper's tuning flags."""

from __future__ import annotations

import argparse

from hetero.errors import HeteroError
from megatron.hetero import flags
from megatron.hetero.arguments.vocabulary import tensor_parallel_sizes


def _validate_moe(args: argparse.Namespace) -> None:
    # Megatron-LM's defaults (a plan sets both before this); expert_tensor_parallel_size None is
    # megatron-core's "the tensor-parallel size".
    args.expert_model_parallel_size = args.expert_model_parallel_size or 1
    if args.expert_model_parallel_size > 1 and (
            args.num_experts is None or args.num_experts % args.expert_model_parallel_size):
        raise HeteroError(
            f"--expert-model-parallel-size {args.expert_model_parallel_size} shares out the experts of "
            f"each MoE layer, so --num-experts ({args.num_experts}) must be a multiple of it")
    # As Megatron-LM: one value given is a plain value, several are one per balancing type.
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, name, value[0])
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    if isinstance(types, list) != isinstance(coeffs, list) or (
            isinstance(types, list) and len(types) != len(coeffs)):
        raise HeteroError("--moe-aux-loss-coeff needs one value per --moe-router-load-balancing-type")
    if args.num_experts is None:
        return
    if args.num_experts < 1 or not 1 <= args.moe_router_topk <= args.num_experts:
        raise HeteroError(f"--moe-router-topk {args.moe_router_topk} must be between 1 and "
                          f"--num-experts {args.num_experts}")
    if args.add_bias_linear and args.transformer_impl != "transformer_engine":
        raise HeteroError(
            "--num-experts with bias terms (no --disable-bias-linear): megatron-core 0.16.1's local "
            "expert MLP adds the bias in place to a tensor-parallel view and fails in autograd; "
            "add --disable-bias-linear (as MoE recipes do) or use --transformer-impl "
            "transformer_engine on GPUs")
    if args.add_bias_linear and (getattr(args, "expert_tensor_parallel_size", None)
                                 or max(tensor_parallel_sizes(args))) > 1:
        raise HeteroError("MoE with biases needs expert tensor-parallel size 1 (megatron-core); "
                          "with tensor parallelism add --disable-bias-linear or --expert-tensor-parallel-size 1")
    if args.moe_grouped_gemm and not grouped_gemm_available():  # on a GPU (the CPU substitutes)
        raise HeteroError(
            "--moe-grouped-gemm needs transformer-engine (TEGroupedMLP) or the grouped_gemm "
            "package on this GPU; neither is installed - install one, or remove the flag (the "
            "experts then run one after another, same result)")


def grouped_gemm_available() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) is not None
               for name in ("transformer_engine", "grouped_gemm"))


def _wandb_can_log() -> bool:
    """Where wandb.init finds what it needs without asking: an offline or disabled mode,
    WANDB_API_KEY, or the key `wandb login` writes to ~/.netrc."""
    import netrc
    import os

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _validate_logging_and_checkpoints(args: argparse.Namespace) -> None:
    if args.wandb_project:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise HeteroError("--wandb-project needs the wandb package: pip install wandb "
                              "(or megatron-hetero[wandb])")
        if args.wandb_save_dir is None and args.save is None:
            raise HeteroError("--wandb-project needs --wandb-save-dir DIR or --save DIR (W&B "
                              "writes to SAVE/wandb by default)")
        if not _wandb_can_log():  # else wandb.init fails on the last rank, mid-start
            raise HeteroError("--wandb-project: no Weights & Biases API key on this machine "
                              "(WANDB_API_KEY or `wandb login`); log in, set WANDB_MODE=offline to keep "
                              "the logs in the W&B folder, or drop --wandb-project")
    args.startup_notes = []
    args.startup_notes += getattr(args, "checkpoint_arg_notes", None) or []  # --use-checkpoint-args
    if getattr(args, "decreased_global_batch_size", None):
        given, decreased = args.decreased_global_batch_size
        args.startup_notes.append(f"decreasing batch size from {given} to {decreased} to keep divisibility by "
                                  "micro_batch_size * data_parallel_size (--decrease-batch-size-if-needed)")
    if args.async_save and not args.use_persistent_ckpt_worker:
        # Megatron-LM 0.16's rule, kept so a recipe behaves as it does there.
        args.async_save = False
        args.startup_notes.append("--async-save is not supported without "
                                  "--use-persistent-ckpt-worker. Disabling --async-save.")
    if args.ckpt_fully_parallel_save_deprecated:
        args.startup_notes.append("--ckpt-fully-parallel-save flag is deprecated and has no effect. "
                                  "Use --no-ckpt-fully-parallel-save to disable parallel save.")
    if args.manual_gc_interval < 0:
        raise HeteroError("--manual-gc-interval must be at least 0")
    if args.skip_train:
        args.no_load_optim = True  # as Megatron-LM: evaluation needs no optimizer state


def _validate_profiling(args: argparse.Namespace) -> None:
    if args.profile:
        if args.profile_step_end <= args.profile_step_start or args.profile_step_start < 0:
            raise HeteroError(f"--profile-step-start {args.profile_step_start} and --profile-step-end "
                              f"{args.profile_step_end}: the window needs 0 <= start < end")
        if args.use_pytorch_profiler and args.tensorboard_dir is None and not getattr(args, "profile_trace_dir", None):
            raise HeteroError("--profile --use-pytorch-profiler writes its trace to --tensorboard-dir "
                              "(as Megatron-LM); give --tensorboard-dir DIR")
    # --profile without --use-pytorch-profiler runs torch.profiler on the CPU (substitute_gpu_choices).
    if not (args.record_memory_history or args.log_device_memory_used):
        return
    import torch  # only for these flags: the rest of the validation needs no torch

    if torch.cuda.is_available():
        return
    if args.log_device_memory_used:
        raise HeteroError("--log-device-memory-used reports the GPU's memory in use (NVML), which needs "
                          "a GPU; remove it on the CPU (the memory line gives this process's memory)")
    raise HeteroError("--record-memory-history records the CUDA caching allocator's history, "
                      "which needs a GPU; remove it on the CPU")


def _wrapper_tuning_problems(args: argparse.Namespace) -> list[str]:
    """The --inprocess-* flags that tune nvidia-resiliency-ext's wrapper, given at another
    value than Megatron-LM's default (there is no such wrapper here: they would do nothing)."""
    from megatron.hetero.flags import catalog

    by_name = {flag.name: flag for flag in flags.megatron_flags()}
    found = []
    for name, theme in catalog.DEFAULT_ONLY.items():
        flag = by_name[name]
        if theme != "inprocess_wrapper" or getattr(args, flag.dest) == flag.default:
            continue
        reason = catalog.REASONS.get(name) or catalog.THEMES[theme].reason()
        found.append(f"{name} {getattr(args, flag.dest)}: {reason}")
    return found
