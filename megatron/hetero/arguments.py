"""Command-line flags: Megatron-LM's names, defaults and meanings, plus ``--hetero-plan``.

The flags defined below are honoured (but for flags/catalog.py's DEFAULT_ONLY, which run at
Megatron-LM's default only). Every other flag of Megatron-LM's pretrain_gpt.py is known too
(megatron/hetero/flags/): a no-op where Megatron-LM ignores it, else refused by name with
the reason. A flag that is not Megatron-LM's is an error naming it, and so is a flag that
contradicts the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import os
import signal
from typing import Sequence

from hetero import env
from hetero.spec.catalog import DEVICES
from hetero.spec.cluster import Cluster
from hetero.errors import HeteroError
from hetero.spec.model import ModelSpec
from hetero.plan import Plan
from hetero.runtime_rules import model_problems, precision_problems
from megatron.hetero import flags
from megatron.hetero.flags.later_tags import fill_reference_dests
from megatron.hetero.problems import Problems

# Megatron-LM flags that only choose fused kernels: speed, not the model. On GPUs they keep
# their meaning where megatron-core's local or transformer-engine layers offer the kernel;
# on the CPU no fused kernel exists and they have no effect (the start-up note says so).
_KERNEL_TUNING_FLAGS = (
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--use-flash-attn",
)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4*hidden, or 2/3 of that (rounded down to 64) with --swiglu")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None,
                   help="default hidden-size / num-attention-heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="deprecated: only valid with --position-embedding-type rope (where it "
                        "changes nothing), as in Megatron-LM")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated alias of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="rotate interleaved pairs of channels instead of the two halves")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--apply-layernorm-1p", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--squared-relu", action="store_true",
                   help="squared ReLU activation instead of GELU (not with --swiglu)")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    flags.declare(g, ("--data-parallel-random-init",))  # a random stream per replica (training.rank_seed)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", default=None, choices=["local", "transformer_engine"],
                   help="default transformer_engine when it is installed, else local")
    for flag in _KERNEL_TUNING_FLAGS:
        g.add_argument(flag, action="store_true", help="kernel choice (no effect on the CPU)")
    flags.declare(g, ("--disable-jit-fuser",))  # megatron-core's fused functions run eagerly


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None,
                   help="train on this many samples instead of --train-iters iterations")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "RAMPUP_SAMPLES"),
                   help="grow the global batch from START by INCREMENT to --global-batch-size "
                        "over RAMPUP_SAMPLES samples; each step's batch is split across the plan's "
                        "replicas in the plan's proportions")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="learning rate of the input embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="minimum learning rate of the input embedding and output layer")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="take the learning-rate schedule from the checkpoint, not the flags")
    flags.declare(g, ("--override-opt_param-scheduler",))
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"])
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    flags.declare(g, ("--dump-param-to-param-group-map",))
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="always on: heterogeneous replicas weight gradients by tokens")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on the exit signal (any rank), finish the iteration, save and exit 0")
    g.add_argument("--exit-signal", default="SIGTERM",
                   choices=[s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)],
                   metavar="SIGNAL", help="the signal --exit-signal-handler acts on (default SIGTERM)")


def _add_run_control_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("run control")
    g.add_argument("--exit-duration-in-mins", type=int, default=None,
                   help="save (with --save) and exit after this many minutes of training")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic algorithms only (torch.use_deterministic_algorithms)")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's automatic garbage collector; collect at fixed points")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every N iterations (0: never during training)")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false",
                   dest="manual_gc_eval",
                   help="with --manual-gc: do not collect before and after each evaluation")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="release cached accelerator memory each iteration: 0 off, 1 after the "
                        "forward/backward, 2 also after the optimizer step")
    g.add_argument("--skip-train", action="store_true",
                   help="no training: evaluate on the validation and test sets and exit")
    g.add_argument("--rerun-mode", default="validate_results", choices=["validate_results", "disabled"],
                   help="what a NaN or Inf loss does: stop the run, naming the rank that found it. "
                        "validate_results (the default) says so without re-running the iteration to "
                        "tell a transient fault from a reproducible one, as Megatron-LM would first")
    # Megatron-LM's training-loop switches, declared from its facts (training.Trainer.train).
    flags.declare(g, RUN_CONTROL_FLAGS)


# Megatron-LM's run-control flags that the training loop applies as its train() does.
RUN_CONTROL_FLAGS = ("--train-sync-interval", "--no-check-for-nan-in-loss-and-grad",
                     "--distributed-timeout-seconds-after-init", "--iterations-to-skip",
                     "--check-weight-hash-across-dp-replicas-interval", "--decrease-batch-size-if-needed")


DATA_PATH_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path",
                   "--per-split-data-args-path")
_SPLIT_PATHS = ("train_data_path", "valid_data_path", "test_data_path")


def read_data_args_files(args: argparse.Namespace) -> None:
    """Megatron-LM's get_blend_and_blend_per_split, read up front: --data-args-path holds the
    --data-path arguments (whitespace-separated), --per-split-data-args-path a JSON object
    with "train", "valid" and "test" (each a list or a string of them). Afterwards only
    --data-path or --train/valid/test-data-path are set."""
    per_split_given = any(getattr(args, name) is not None for name in _SPLIT_PATHS)
    if args.data_args_path is not None:
        if args.data_path is not None:
            raise HeteroError("--data-args-path and --data-path both give the data; give one")
        args.data_path = _read_text(args.data_args_path, "--data-args-path").split()
    if args.per_split_data_args_path is not None:
        if per_split_given:
            raise HeteroError("--per-split-data-args-path and --train/valid/test-data-path both give "
                              "the data; give one")
        path = args.per_split_data_args_path
        try:
            import json

            given = json.loads(_read_text(path, "--per-split-data-args-path"))
            for split, name in zip(("train", "valid", "test"), _SPLIT_PATHS):
                value = given[split]
                setattr(args, name, value.split() if isinstance(value, str) else list(value))
        except (ValueError, KeyError, TypeError) as err:
            raise HeteroError(f"--per-split-data-args-path {path}: {err!r}; give a JSON object with "
                              "\"train\", \"valid\" and \"test\", each a list of [weight] prefix") from None
    if args.data_path is not None and any(getattr(args, name) is not None for name in _SPLIT_PATHS):
        raise HeteroError("--data-path and --train/valid/test-data-path (one dataset split by --split, or "
                          "one dataset per split): give one of them")
    if uses_split_paths(args) and args.split is not None:
        raise HeteroError("--split divides the --data-path dataset; with a dataset per split "
                          "(--train/valid/test-data-path) remove it")


def uses_split_paths(args: argparse.Namespace) -> bool:
    """A dataset per split (--train/valid/test-data-path) instead of --data-path with --split."""
    return any(getattr(args, name) for name in _SPLIT_PATHS)


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError as err:
        raise HeteroError(f"{flag} {path}: {err.strerror}; give the file holding the data paths") from None


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="*", default=None)
    # Megatron-LM's per-split datasets and files holding the data paths (read_data_args_files).
    flags.declare(g, DATA_PATH_FLAGS)
    g.add_argument("--dataloader-type", default=None, choices=["single", "cyclic"],
                   help="single: each sample once, in order (default); cyclic: round the data for "
                        "ever, each pass shuffled by --seed (the same for every plan)")
    flags.declare(g, ("--full-validation",))  # data.ReplicaBatchSampler
    g.add_argument("--split", default=None, help="default 969,30,1 (Megatron-LM's)")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="let attention build its causal mask instead of the dataloader")
    g.add_argument("--tokenizer-type", default=None,
                   choices=["NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                            "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                            "Llama2Tokenizer", "TikTokenizer"])
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"],
                   help="TikTokenizer's split pattern (default v2)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)


PROFILING_FLAGS = ("--profile", "--use-pytorch-profiler", "--profile-step-start", "--profile-step-end",
                   "--profile-ranks", "--record-memory-history", "--memory-snapshot-path",
                   "--log-device-memory-used")


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


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true",
                   help="add the TFLOP/s per device to the iteration line")
    g.add_argument("--log-memory-interval", type=int, default=None,
                   help="also print the memory line every N iterations (at a logging "
                        "iteration), not only once")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="0: iteration time only; 1: also forward-backward, gradient reduction "
                        "and optimizer times; 2: the same (finer timers need GPU events)")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard events here")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--wandb-project", default=None,
                   help="log to Weights & Biases (the wandb extra; WANDB_MODE=offline works)")
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None, help="default: SAVE/wandb")
    g.add_argument("--wandb-entity", default=None)
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    flags.declare(g, ("--log-progress",))  # progress.txt in --save (log.ProgressLog)
    # Megatron-LM's profiling window and CUDA memory history (training.ProfilingWindow).
    flags.declare(g, PROFILING_FLAGS)


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None, help="directory to load the latest checkpoint from")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="exit (after saving, with --save) when iteration %% N == 0")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only and start at iteration 0")
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist", "torch"],
                   help="torch_dist (loads under any plan) or Megatron-LM's legacy per-rank torch format")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration from --load instead of the latest")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="read the format from the checkpoint (torch_dist is the one we write)")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected",
                   choices=["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                            "raise_all", "return_unexpected", "return_all", "ignore_all"],
                   help="what loading does with keys the checkpoint and the model do not share")
    g.add_argument("--no-ckpt-fully-parallel-save", "--disable-ckpt-fully-parallel-save",
                   action="store_false", dest="ckpt_fully_parallel_save",
                   help="do not spread the writing of replicated tensors over data-parallel ranks")
    g.add_argument("--ckpt-fully-parallel-save", action="store_true",
                   dest="ckpt_fully_parallel_save_deprecated",
                   help="deprecated: the default (see --no-ckpt-fully-parallel-save)")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="spread the reading of replicated tensors over data-parallel ranks")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training goes on")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="one background checkpoint writer for the whole run")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="optimizer state re-shardable over TP/PP/DP (always the case here)")
    # Megatron-LM's save switches (checkpointing.py) and its exit when --load holds nothing.
    flags.declare(g, ("--no-save-optim", "--no-save-rng", "--exit-on-missing-checkpoint",
                      "--save-retain-interval", "--pretrained-checkpoint", "--use-checkpoint-args",
                      "--use-mp-args-from-checkpoint-args", "--no-use-tokenizer-model-from-checkpoint-args",
                      "--ckpt-assume-constant-structure", "--ckpt-convert-save", "--non-persistent-save-interval",
                      "--non-persistent-global-ckpt-dir"))
    g.add_argument("--non-persistent-ckpt-type", default=None, choices=["global", "local", "in_memory"],
                   help="global: checkpoints every --non-persistent-save-interval iterations in "
                        "--non-persistent-global-ckpt-dir (default SAVE/non_persistent), only the newest "
                        "kept; --load resumes from it when it is the newer. local, in_memory: snapshots "
                        "in host memory, copied to ranks on other nodes (--inprocess-restart restores "
                        "from them)")
    g = parser.add_argument_group("in-process restart")
    flags.declare(g, ("--inprocess-restart", "--inprocess-barrier-timeout", "--inprocess-heartbeat-timeout",
                      "--inprocess-max-iterations", "--inprocess-monitor-thread-interval",
                      "--inprocess-monitor-process-interval", "--inprocess-progress-watchdog-interval",
                      "--inprocess-heartbeat-interval", "--inprocess-soft-timeout", "--inprocess-hard-timeout",
                      "--inprocess-completion-timeout", "--inprocess-last-call-wait",
                      "--inprocess-termination-grace-time", "--inprocess-granularity",
                      "--inprocess-active-world-size", "--inprocess-empty-cuda-cache"))
    g.add_argument("--hetero-snapshot-replicas", type=int, default=1, metavar="R",
                   help="in-memory snapshots (--inprocess-restart): copies of each rank's snapshot kept "
                        "on the next R nodes")
    g.add_argument("--ckpt-convert-format", default=None, choices=["torch_dist"],
                   help="write the checkpoint --load holds again in this format, to "
                        "CKPT_CONVERT_SAVE/FORMAT, and exit")


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo", "hetero"],
                   help="default nccl on GPUs, gloo on the CPU; hetero: native library inside "
                        "each vendor of the plan's devices, a bridge across vendors")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    flags.declare(g, ("--use-tp-pp-dp-mapping",))  # the uniform plan's rank order (startup.load_plan)
    # megatron-core's tuning of the groups it creates (distributed.GROUP_OPTION_FLAGS)
    flags.declare(g, ("--use-sharp", "--sharp-enabled-group", "--nccl-communicator-config-path",
                      "--high-priority-stream-groups", "--create-all-gather-group",
                      "--disable-gloo-process-groups"))
    g.add_argument("--use-cpu-initialization", action="store_true")
    g.add_argument("--local-rank", "--local_rank", type=int, default=None,
                   help="set by old launchers; the LOCAL_RANK environment variable wins")


def _add_moe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer (default: a dense model)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="all experts of a layer in one grouped GEMM (needs a GPU build)")
    g.add_argument("--moe-permute-fusion", action="store_true",
                   help="fused token permutation (transformer-engine's kernel on GPUs; the CPU "
                        "permutes unfused, same result)")
    g.add_argument("--moe-router-fusion", action="store_true",
                   help="fused router top-k and scores (transformer-engine's kernel on GPUs; the "
                        "CPU runs them unfused, same result)")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="log each MoE layer's router losses to TensorBoard/W&B, besides their mean")
    g.add_argument("--moe-token-dispatcher-type", default="allgather",
                   choices=["allgather", "alltoall"])
    g.add_argument("--expert-model-parallel-size", type=int, default=None,
                   help="ranks that share out each MoE layer's experts (default 1; a plan's expert_parallel)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="ranks that split each expert (default: the tensor-parallel size; a plan's "
                        "expert_tensor_parallel)")


# Megatron-LM flags whose whole effect is the megatron-core config field of the same name:
# Megatron-LM's core_transformer_config_from_args copies every args attribute named like a
# TransformerConfig (or MLATransformerConfig) field, and model.transformer_config does the
# same. Declared from Megatron-LM's facts (names, dest, default, value syntax): honouring
# such a flag is listing it here.
CONFIG_FIELD_FLAGS: dict[str, tuple[str, ...]] = {
    "model shape (megatron-core config fields)": (
        "--fp32-residual-connection", "--add-qkv-bias", "--glu-linear-offset", "--activation-func-clamp-value",
        "--embedding-init-method-std", "--qk-l2-norm", "--attention-output-gate",
        "--softmax-type", "--no-rope-freq", "--mrope-section", "--window-size",
        "--window-attn-skip-freq", "--disable-bf16-reduced-precision-matmul",
        "--no-clone-scatter-output-in-embedding", "--distribute-saved-activations",
        "--test-mode", "--no-barrier-with-level-1-timing", "--config-logger-dir",
        "--mtp-num-layers", "--mtp-loss-scaling-factor", "--use-fused-weighted-squared-relu",
        "--no-initialization",
    ),
    "multi-latent attention (megatron-core MLATransformerConfig fields)": (
        "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
        "--qk-pos-emb-head-dim", "--v-head-dim", "--rope-type", "--rotary-scaling-factor",
        "--mscale", "--mscale-all-dim",
    ),
    "pipeline schedule (megatron-core config fields)": (
        "--microbatch-group-size-per-virtual-pipeline-stage", "--overlap-p2p-communication-warmup-flush",
    ),
    "optimizer (megatron-core config fields)": (
        "--apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type", "--overlap-param-gather-with-optimizer-step",
    ),
    "mixture of experts (megatron-core config fields)": (
        "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
        "--moe-shared-expert-gate", "--moe-layer-freq", "--moe-router-score-function",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
        "--moe-router-topk-scaling-factor", "--moe-router-num-groups", "--moe-router-group-topk",
        "--moe-router-pre-softmax", "--moe-router-dtype", "--moe-router-force-load-balancing",
        "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity",
        "--moe-token-drop-policy", "--moe-z-loss-coeff", "--moe-input-jitter-eps",
        "--moe-apply-probs-on-input", "--moe-layer-recompute", "--moe-enable-routing-replay",
    ),
}


# Megatron-LM flags that its pretrain_gpt.py passes unchanged to megatron-core's tokenizer
# and dataset builders (build_tokenizer(args), GPTDatasetConfig); data.py does the same.
DATA_BUILDER_FLAGS = (
    "--tokenizer-metadata", "--tokenizer-special-tokens", "--tiktoken-special-tokens",
    "--tokenizer-hf-include-special-tokens", "--tokenizer-sentencepiece-legacy",
    "--trust-remote-code", "--num-dataset-builder-threads", "--object-storage-cache-path",
    "--mid-level-dataset-surplus", "--allow-ambiguous-pad-tokens", "--dataloader-fast-cache-load",
    "--dataloader-defer-npy-index-mmap", "--per-dataset-sequences-path",
)

# Megatron-LM flags that its gpt_builders passes to megatron-core's GPTModel (or, for
# --quick-geglu, turns into the config's activation); model.py does the same.
MODEL_BUILDER_FLAGS = ("--use-rope-scaling", "--fp16-lm-cross-entropy", "--quick-geglu")
# Megatron-LM's logging switches that the runtime applies as Megatron-LM does.
LOGGING_FLAGS = ("--logging-level", "--timing-log-option")
# Megatron-LM's other names of --num-layers and --seq-length (used when those are not given).
ALIAS_FLAGS = {"--encoder-num-layers": "num_layers", "--encoder-seq-length": "seq_length"}


def _add_config_field_args(parser: argparse.ArgumentParser) -> None:
    for title, names in CONFIG_FIELD_FLAGS.items():
        flags.declare(parser.add_argument_group(title), names)
    flags.declare(parser.add_argument_group("model (megatron-core GPTModel arguments)"), MODEL_BUILDER_FLAGS)
    flags.declare(parser.add_argument_group("data and tokenizer (megatron-core builders' options)"),
                  DATA_BUILDER_FLAGS)
    flags.declare(parser.add_argument_group("model (Megatron-LM's other names)"), tuple(ALIAS_FLAGS))
    flags.declare(parser.add_argument_group("logging (Megatron-LM's switches)"), LOGGING_FLAGS)


def apply_logging_level(args: argparse.Namespace) -> None:
    """Megatron-LM's setup_logging: the root logger's level from --logging-level, else the
    MEGATRON_LOGGING_LEVEL environment variable; unchanged when neither is given."""
    level = args.logging_level
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.getLogger().setLevel(level)


def _resolve_aliases(args: argparse.Namespace) -> None:
    """--encoder-num-layers/--encoder-seq-length stand for --num-layers/--seq-length, as in
    Megatron-LM's validate_args (giving both is an error there too)."""
    for alias, dest in ALIAS_FLAGS.items():
        value = getattr(args, alias[2:].replace("-", "_"))
        if value is None:
            continue
        if getattr(args, dest) is not None:
            raise HeteroError(f"{alias} and --{dest.replace('_', '-')} name the same setting; give one")
        setattr(args, dest, value)


def _validate_config_fields(args: argparse.Namespace) -> None:
    """Megatron-LM's checks and derived defaults of the flags declared from its facts."""
    if args.quick_geglu and (args.swiglu or args.squared_relu):
        raise HeteroError("--quick-geglu is an activation, as --swiglu and --squared-relu are; pick one")
    if args.fp16_lm_cross_entropy and not args.fp16:
        raise HeteroError("--fp16-lm-cross-entropy needs --fp16 (as in Megatron-LM)")
    if args.fp32_residual_connection and not (args.fp16 or args.bf16):
        raise HeteroError("--fp32-residual-connection needs --fp16 or --bf16 (as in Megatron-LM)")
    if args.add_bias_linear:
        args.add_qkv_bias = True  # Megatron-LM keeps the two in sync
    for name, given in (("--dataloader-fast-cache-load", args.dataloader_fast_cache_load),
                        ("--dataloader-defer-npy-index-mmap", args.dataloader_defer_npy_index_mmap)):
        if given and args.data_cache_path is None:  # megatron-core's dataset config asserts it
            raise HeteroError(f"{name} needs --data-cache-path DIR (the index cache it reads)")
    if args.no_weight_decay_cond_type == "apply_wd_to_qk_layernorm":
        args.apply_wd_to_qk_layernorm = True  # its deprecated spelling, as in Megatron-LM
    if args.tiktoken_special_tokens and not args.tokenizer_special_tokens:
        args.tokenizer_special_tokens = args.tiktoken_special_tokens  # its deprecated alias
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.overlap_param_gather_with_optimizer_step and not (args.use_distributed_optimizer
                                                               and args.overlap_param_gather):
        raise HeteroError("--overlap-param-gather-with-optimizer-step gathers the distributed optimizer's "
                          "updated shards during its step: it needs --use-distributed-optimizer and "
                          "--overlap-param-gather (as in Megatron-LM)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise HeteroError("--override-opt_param-scheduler (the flags' schedule) and "
                          "--use-checkpoint-opt_param-scheduler (the checkpoint's): give one")
    if args.fp16 and not args.loss_scale:
        # As Megatron-LM: dynamic loss scaling reads NaN/Inf gradients as its signal to back off.
        args.check_for_nan_in_loss_and_grad = False
    if args.ddp_num_buckets is not None and (args.ddp_bucket_size is not None or args.ddp_num_buckets < 1):
        raise HeteroError("--ddp-num-buckets must be a positive count, and not given with --ddp-bucket-size "
                          "(both size the buckets); give one of them")
    for name in ("train_sync_interval", "distributed_timeout_seconds_after_init",
                 "check_weight_hash_across_dp_replicas_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise HeteroError(f"--{name.replace('_', '-')} must be at least 1")


def honoured_config_values(args: argparse.Namespace, fields: set[str]) -> dict:
    """Every honoured flag whose dest is one of ``fields`` (a megatron-core config's), with
    its value: what Megatron-LM's core_transformer_config_from_args copies."""
    return {dest: getattr(args, dest) for dest in sorted(honoured_dests() & fields) if hasattr(args, dest)}


def config_from_flags(config_class: type, args: argparse.Namespace, **decided):
    """``config_class`` (a megatron-core config dataclass) built as Megatron-LM builds its
    OptimizerConfig and TransformerConfig: every honoured flag whose dest is a field, then
    the ``decided`` fields, which take precedence."""
    fields = {field.name for field in dataclasses.fields(config_class)}
    return config_class(**{**honoured_config_values(args, fields), **decided})


@functools.cache
def honoured_dests() -> frozenset[str]:
    """The dests of the flags this parser honours (the same for every run)."""
    return frozenset(flags.honoured_dests(build_parser()))


def _add_hetero_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("heterogeneous plan")
    g.add_argument("--hetero-plan", default=None,
                   help="plan.json from hetero-plan; without it the job runs Megatron's "
                        "uniform plan (even stages, equal replicas, launch-order ranks)")
    g.add_argument("--hetero-adapt", action="store_true",
                   help="re-split the replicas' micro-batch counts while training when their "
                        "measured times are unbalanced (same global batch, same samples), and "
                        "write a corrected plan with a better layer split for the next restart")
    g.add_argument("--hetero-adapt-output", default=None, metavar="PATH",
                   help="where --hetero-adapt writes the corrected plan (default: "
                        "adapted_plan.json in --save, else in the working directory)")
    g.add_argument("--hetero-allow-untested-megatron-core", action="store_true",
                   help="run on a megatron-core release Megatron-Hetero is not tested with, with "
                        "a warning (as HETERO_ALLOW_UNTESTED_MEGATRON_CORE=1; the tested releases: "
                        "python -m megatron.hetero.patches)")


def _add_performance_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's performance features, switched on in megatron-core (performance.py)."""
    g = parser.add_argument_group("performance")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split layer norms, dropout and residuals along the sequence across TP")
    g.add_argument("--recompute-activations", action="store_true",
                   help="alias of --recompute-granularity selective")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="a plan's stages[s].recompute overrides this for stage s")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="*", default=None,
                   help="selective recomputation: what to recompute (default core_attn)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="interleaved 1F1B; a plan's stages[s].virtual_stages gives uneven splits")
    # Megatron-LM's uneven pipeline stages: without a plan they make the stages
    # (hetero/pipeline_layout.py), with one they must agree with it.
    flags.declare(g, ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                      "--pipeline-model-parallel-layout", "--account-for-embedding-in-pipeline-split",
                      "--account-for-loss-in-pipeline-split"))
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--no-align-grad-reduce", action="store_false", dest="align_grad_reduce")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="needs --use-distributed-optimizer and --overlap-grad-reduce")
    g.add_argument("--no-align-param-gather", action="store_false", dest="align_param_gather")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    # Megatron-LM's get_model turns these into DistributedDataParallelConfig fields (model.py).
    flags.declare(g, ("--ddp-num-buckets", "--ddp-pad-buckets-for-high-nccl-busbw",
                      "--ddp-reduce-scatter-with-fp32-accumulation"))
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"])
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "local", "flash", "fused", "unfused"],
                   help="auto: transformer-engine picks on GPUs; local on the CPU")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="needs transformer-engine and a GPU")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="splits each sequence over this many ranks (the plan's context_parallel)")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Megatron-LM compatible GPT pretraining under a heterogeneous plan.",
        usage="%(prog)s [flags of Megatron-LM's pretrain_gpt.py] [--hetero-plan PLAN.json]",
        allow_abbrev=False,
    )
    for add in (_add_model_args, _add_training_args, _add_run_control_args, _add_data_args,
                _add_logging_args, _add_checkpoint_args, _add_distributed_args, _add_moe_args,
                _add_config_field_args, _add_hetero_args, _add_performance_args):
        add(parser)
    flags.add_megatron_flags(parser)  # the rest of Megatron-LM's flags: no-op or refused
    return parser


def parse_args(argv: Sequence[str], refusals: list[HeteroError] | None = None) -> argparse.Namespace:
    """Parses flags. Every refused Megatron-LM flag and every unknown flag given is named in
    one HeteroError (appended to ``refusals`` when given, and the flags returned, so that
    start-up goes on to find the other problems); ``args.noop_flags`` lists the accepted
    no-ops for the start-up log. A value argparse cannot parse is a HeteroError too."""
    parser = build_parser()
    parser.exit_on_error = False  # reported with the other problems, not as a usage dump
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise HeteroError(f"{err}; `pretrain_gpt.py --help-all` lists every flag's values") from None
    args.noop_flags = []
    fill_reference_dests(args)  # under a later Megatron-LM tag: the dests it removed or renamed
    _resolve_aliases(args)
    try:
        flags.judge(parser, args, unknown)
    except HeteroError as err:
        if refusals is None:
            raise
        refusals.append(err)
    return args


def _require(args: argparse.Namespace, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is None]
    if missing:
        raise HeteroError(f"missing required flag(s): {', '.join(missing)}")


def apply_plan(args: argparse.Namespace, plan: Plan, template: int = 0) -> None:
    """Takes the parallel layout from the plan, checking the flags that restate it. Every
    flag that contradicts the plan is named (one error for all), raised after the plan's
    values are in place, so the checks that follow still run on the plan's layout. Under a
    plan of several templates the pipeline's degrees are those of ``template`` (this rank's),
    and a flag restating the degrees of any template agrees with the plan."""
    contradictions = []
    shapes = plan.templates
    mine = shapes[template]
    for flag, planned, allowed in (
            ("--tensor-model-parallel-size", mine.tensor_parallel, {t.tensor_parallel for t in shapes}),
            ("--pipeline-model-parallel-size", mine.pipeline_parallel, {t.pipeline_parallel for t in shapes}),
            ("--micro-batch-size", plan.micro_batch_size, {plan.micro_batch_size}),
            ("--global-batch-size", plan.global_batch_size, {plan.global_batch_size}),
            ("--num-layers", plan.num_layers, {plan.num_layers})):
        dest = flag[2:].replace("-", "_")
        given = getattr(args, dest)
        if given is not None and given not in allowed:  # absent: the plan's value
            shown = planned if len(allowed) == 1 else " or ".join(map(str, sorted(allowed)))
            contradictions.append(f"{flag} {given} contradicts the plan ({shown})")
        setattr(args, dest, planned)
    args.hetero_template = template
    args.data_parallel_size = plan.data_parallel
    for flag, planned, default in (("--expert-model-parallel-size", plan.expert_parallel, 1),
                                   ("--expert-tensor-parallel-size", plan.expert_tensor_parallel,
                                    mine.tensor_parallel)):
        dest = flag[2:].replace("-", "_")
        given = getattr(args, dest)
        # absent: the plan's value; without experts (no --num-experts) the flag shapes nothing
        if given is not None and given != (planned or default) and args.num_experts:
            contradictions.append(f"{flag} {given} contradicts the plan ({planned or default})")
        setattr(args, dest, planned)
    if args.context_parallel_size not in (1, plan.context_parallel):  # 1: the flag's default
        contradictions.append(f"--context-parallel-size {args.context_parallel_size} contradicts the plan "
                              f"({plan.context_parallel})")
    args.context_parallel_size = plan.context_parallel
    # --tensor-model-parallel-size is the job's degree; a version 3 plan may give stages their
    # own, a version 4 plan each template its own: every degree of the job (the vocabulary is
    # padded for all of them, every one must divide the heads).
    args.stage_tensor_parallel_sizes = [tp for t in shapes for tp in t.stage_tensor_parallel]
    problems = Problems()  # one problem per flag, each with its fix
    for contradiction in contradictions:
        problems.add(f"{contradiction}; drop the flag or regenerate the plan for this setting")
    problems.raise_if_any()


def check_plan_model(args: argparse.Namespace, plan: Plan) -> None:
    """A plan from hetero-plan records the model and training it was made for; the run
    must be that model (the plan's times and memory are for it) and that precision, on
    devices that support it. Every field of the model is compared after Megatron's
    defaults are filled in on both sides, except the vocabulary: the tokenizer pads it
    later, and the training start compares the padded size with the plan's."""
    wrong = []
    ours = ModelSpec.from_megatron_args(args)
    if plan.model is not None:
        wrong = [f"{name}: plan {planned_value!r}, flags {flag_value!r}"
                 for name, planned_value, flag_value in plan.model.spec().differences(ours, skip=("vocab_size",))]
    training = plan.training
    # Set before the checks below raise, so the start-up's later checks see them either way.
    if training is not None and training.distributed_optimizer:
        args.use_distributed_optimizer = True  # the plan's memory assumes it
    if training is not None and training.sequence_parallel and plan.max_tensor_parallel > 1:
        args.sequence_parallel = True  # so do its activation memory and transfers
    precision = training.precision if training is not None else None
    if precision and precision != args.params_dtype:
        flag = {"bf16": "--bf16", "fp16": "--fp16", "fp32": "neither --bf16 nor --fp16"}.get(precision, precision)
        wrong.append(f"precision: plan {precision} ({flag}), flags {args.params_dtype}")
    if wrong:
        raise HeteroError(
            "the plan was made for another model or precision (" + "; ".join(wrong) + "); run the "
            "model it was made for, or regenerate it with hetero-plan --model ... --precision ..."
        )
    check_precision_supported(args, plan)
    check_moe_sequence_parallel(args, plan)
    problems = model_problems(plan, ours)
    if problems:  # the same checks hetero-plan runs before it writes a plan
        raise HeteroError("; ".join(problems))


def check_moe_sequence_parallel(args: argparse.Namespace, plan: Plan) -> None:
    """megatron-core's MoE layer refuses to train under tensor parallelism without sequence
    parallelism (a ValueError in its first forward): said here, on every rank alike, before
    any process group exists."""
    if args.num_experts is not None and plan.max_tensor_parallel > 1 and not args.sequence_parallel:
        degrees = args.stage_tensor_parallel_sizes or [plan.max_tensor_parallel]
        stages = f" (stage degrees {degrees})" if len(set(degrees)) > 1 else ""
        raise HeteroError(f"--num-experts with tensor parallelism {plan.max_tensor_parallel}{stages} needs "
                          "--sequence-parallel: megatron-core's MoE layer does not train without it; add "
                          "--sequence-parallel")


def check_precision_supported(args: argparse.Namespace, plan: Plan) -> None:
    """--bf16 (or --fp16) on a device whose matrix units lack it: refused, naming the
    device (the plan's devices, and HETERO_DEVICE when this process stands in for one)."""
    devices = dict(DEVICES)
    if plan.cluster is not None:
        devices.update(Cluster(plan.cluster, "the plan's cluster section").devices)
    names = {d.device_type for d in plan.devices}
    standing_in = env.device()  # this local rank's entry, as the device check reads it
    if standing_in:
        names.add(standing_in)
    # The same check hetero-plan and its explain run (hetero.runtime_rules).
    problems = precision_problems(args.params_dtype, names, devices)
    if problems:
        raise HeteroError(problems[0])


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


def tensor_parallel_sizes(args: argparse.Namespace) -> list[int]:
    """The distinct tensor-parallel degrees of the job's stages (one, unless the plan gives
    stages their own)."""
    return sorted(set(getattr(args, "stage_tensor_parallel_sizes", None) or [args.tensor_model_parallel_size]))


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """Megatron-LM's rule: pad to a multiple of make-vocab-size-divisible-by x TP. With a
    degree per stage, x the least common multiple of the degrees (the largest, for powers
    of two): every stage then shards the same vocabulary evenly, so every plan of one model
    trains the same model."""
    multiple = args.make_vocab_size_divisible_by * math.lcm(*tensor_parallel_sizes(args))
    return int(math.ceil(vocab_size / multiple) * multiple)


def vocab_divisor_giving(padded: int, vocab_size: int, args: argparse.Namespace) -> int | None:
    """The --make-vocab-size-divisible-by that pads vocab_size to ``padded`` under this run's
    tensor-parallel degrees (this run's own value first, then Megatron-LM's usual ones), or
    None when none does (another tokenizer)."""
    multiple = math.lcm(*tensor_parallel_sizes(args))
    for divisor in (args.make_vocab_size_divisible_by, 128, 64, 256, 32, 512, 16, 8, 1024, 4, 2, 1):
        step = divisor * multiple
        if padded % step == 0 and padded - step < vocab_size <= padded:
            return divisor
    return None


def used_kernel_tuning_flags(args: argparse.Namespace) -> list[str]:
    return [f for f in _KERNEL_TUNING_FLAGS if getattr(args, f[2:].replace("-", "_"))]
