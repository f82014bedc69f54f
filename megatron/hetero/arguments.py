"""Command-line flags: Megatron-LM's names, defaults and meanings, plus ``--hetero-plan``.

The flags defined below are honoured (but for flags/catalog.py's DEFAULT_ONLY, which run at
Megatron-LM's default only). Every other flag of Megatron-LM's pretrain_gpt.py is known too
(megatron/hetero/flags/): a no-op where Megatron-LM ignores it, else refused by name with
the reason. A flag that is not Megatron-LM's is an error naming it, and so is a flag that
contradicts the plan.
"""

from __future__ import annotations

import argparse
import math
import signal
from typing import Sequence

from hetero import env
from hetero.spec.catalog import DEVICES
from hetero.spec.cluster import Cluster
from hetero.errors import HeteroError
from hetero.spec.model import ModelSpec
from hetero.plan import Plan
from hetero.runtime_rules import precision_problems
from megatron.hetero import flags

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
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", default=None, choices=["local", "transformer_engine"],
                   help="default transformer_engine when it is installed, else local")
    for flag in _KERNEL_TUNING_FLAGS:
        g.add_argument(flag, action="store_true", help="kernel choice (no effect on the CPU)")


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


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="*", default=None)
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
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist"])
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


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo", "hetero"],
                   help="default nccl on GPUs, gloo on the CPU; hetero: native library inside "
                        "each vendor of the plan's devices, a bridge across vendors")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
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
    g.add_argument("--moe-token-dispatcher-type", default="allgather",
                   choices=["allgather", "alltoall", "flex"])
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="only 1 for now (experts replicated in every data-parallel replica)")


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
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--no-align-grad-reduce", action="store_false", dest="align_grad_reduce")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="needs --use-distributed-optimizer and --overlap-grad-reduce")
    g.add_argument("--no-align-param-gather", action="store_false", dest="align_param_gather")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"])
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "local", "flash", "fused", "unfused"],
                   help="auto: transformer-engine picks on GPUs; local on the CPU")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="needs transformer-engine and a GPU")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="needs transformer-engine and a GPU")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Megatron-LM compatible GPT pretraining under a heterogeneous plan.",
        usage="%(prog)s [flags of Megatron-LM's pretrain_gpt.py] [--hetero-plan PLAN.json]",
        allow_abbrev=False,
    )
    for add in (_add_model_args, _add_training_args, _add_run_control_args, _add_data_args,
                _add_logging_args, _add_checkpoint_args, _add_distributed_args, _add_moe_args,
                _add_hetero_args, _add_performance_args):
        add(parser)
    flags.add_megatron_flags(parser)  # the rest of Megatron-LM's flags: no-op or refused
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parses flags. Every refused Megatron-LM flag and every unknown flag given is named in
    one HeteroError; ``args.noop_flags`` lists the accepted no-ops for the start-up log."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    flags.judge(parser, args, unknown)
    return args


def _require(args: argparse.Namespace, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is None]
    if missing:
        raise HeteroError(f"missing required flag(s): {', '.join(missing)}")


def _agree(flag: str, given: int | None, planned: int) -> int:
    """A flag the plan also fixes: absent -> the plan's value; present -> must agree."""
    if given is not None and given != planned:
        raise HeteroError(
            f"{flag} {given} contradicts the plan ({planned}); drop the flag or "
            "regenerate the plan for this setting"
        )
    return planned


def apply_plan(args: argparse.Namespace, plan: Plan) -> None:
    """Takes the parallel layout from the plan, checking the flags that restate it."""
    args.tensor_model_parallel_size = _agree(
        "--tensor-model-parallel-size", args.tensor_model_parallel_size, plan.tensor_parallel)
    args.pipeline_model_parallel_size = _agree(
        "--pipeline-model-parallel-size", args.pipeline_model_parallel_size,
        plan.pipeline_parallel)
    args.micro_batch_size = _agree("--micro-batch-size", args.micro_batch_size,
                                   plan.micro_batch_size)
    args.global_batch_size = _agree("--global-batch-size", args.global_batch_size,
                                    plan.global_batch_size)
    args.num_layers = _agree("--num-layers", args.num_layers, plan.num_layers)
    args.data_parallel_size = plan.data_parallel
    # --tensor-model-parallel-size is the job's degree; a version 3 plan may give stages their own.
    args.stage_tensor_parallel_sizes = plan.stage_tensor_parallel


def check_plan_model(args: argparse.Namespace, plan: Plan) -> None:
    """A plan from hetero-plan records the model and training it was made for; the run
    must be that model (the plan's times and memory are for it) and that precision, on
    devices that support it. Every field of the model is compared after Megatron's
    defaults are filled in on both sides, except the vocabulary: the tokenizer pads it
    later, and the training start compares the padded size with the plan's."""
    wrong = []
    if plan.model is not None:
        ours = ModelSpec.from_megatron_args(args)
        wrong = [f"{name}: plan {planned_value!r}, flags {flag_value!r}"
                 for name, planned_value, flag_value in plan.model.spec().differences(ours, skip=("vocab_size",))]
    training = plan.training
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
    check_per_stage_tensor_parallel(args, plan)
    if training is not None and training.distributed_optimizer:
        args.use_distributed_optimizer = True  # the plan's memory assumes it
    if training is not None and training.sequence_parallel and plan.max_tensor_parallel > 1:
        args.sequence_parallel = True  # so do its activation memory and transfers


def check_per_stage_tensor_parallel(args: argparse.Namespace, plan: Plan) -> None:
    """What a plan whose stages differ in tensor-parallel degree cannot do (yet), refused on
    every rank alike before any process group exists."""
    if not plan.per_stage_tensor_parallel:
        return
    if args.num_experts is not None:
        raise HeteroError("--num-experts with a tensor-parallel degree per stage: expert groups are built "
                          "from one grid in megatron-core; give every stage the same degree")


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
    """Fills Megatron-LM's derived defaults and rejects contradictory combinations."""
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size", "global_batch_size", "lr")
    from megatron.hetero.cpu_device import substitute_gpu_choices

    # First: the checks below then see the layers, attention and experts that will run.
    args.cpu_substitutions = substitute_gpu_choices(args, used_kernel_tuning_flags(args))
    _validate_schedule(args)
    _validate_model_shape(args)
    _validate_moe(args)
    _validate_logging_and_checkpoints(args)
    if args.bf16 and args.fp16:
        raise HeteroError("--bf16 and --fp16 are mutually exclusive; pick one")
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings and args.position_embedding_type == "learned_absolute":
        raise HeteroError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}; raise --max-position-embeddings")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (
            int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu else 4 * args.hidden_size
        )
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads:
            raise HeteroError(
                f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                f"{args.num_attention_heads}; set --kv-channels explicitly")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups:
        raise HeteroError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--num-query-groups {args.num_query_groups}")
    for tp in tensor_parallel_sizes(args):
        for name, value in (("--num-attention-heads", args.num_attention_heads),
                            ("--num-query-groups", args.num_query_groups),
                            ("--ffn-hidden-size", args.ffn_hidden_size)):
            if value % tp:
                raise HeteroError(f"{name} {value} is not divisible by the tensor-parallel size {tp}"
                                  + (" of a stage of the plan" if tp != args.tensor_model_parallel_size else ""))
    if args.mock_data == bool(args.data_path):
        raise HeteroError("give exactly one of --mock-data or --data-path PREFIX [...]")
    if args.tokenizer_type is None:  # pretrain_gpt.py's default in Megatron-LM
        args.tokenizer_type = "GPT2BPETokenizer"
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise HeteroError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.split is None:
        args.split = "969, 30, 1"
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
        raise HeteroError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    for name in ("log_interval", "eval_interval", "save_interval", "exit_interval",
                 "tensorboard_log_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise HeteroError(f"--{name.replace('_', '-')} must be at least 1")
    if args.save_interval is not None and args.save is None:
        raise HeteroError("--save-interval needs --save DIR (where to write the checkpoints)")
    args.params_dtype = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")


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
    if args.expert_model_parallel_size != 1:
        raise HeteroError(
            f"--expert-model-parallel-size {args.expert_model_parallel_size}: expert parallelism "
            "(experts spread over ranks) is not supported by heterogeneous plans yet; every "
            "replica holds all experts with --expert-model-parallel-size 1")
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
    if args.add_bias_linear and max(tensor_parallel_sizes(args)) > 1:
        raise HeteroError("MoE with biases needs expert tensor-parallel size 1 (megatron-core); "
                          "with tensor parallelism add --disable-bias-linear")
    if args.moe_token_dispatcher_type == "flex":
        raise HeteroError("--moe-token-dispatcher-type flex needs DeepEP on NVIDIA GPUs; use "
                          "alltoall or allgather")
    if args.moe_grouped_gemm and not grouped_gemm_available():  # on a GPU (the CPU substitutes)
        raise HeteroError(
            "--moe-grouped-gemm needs transformer-engine (TEGroupedMLP) or the grouped_gemm "
            "package on this GPU; neither is installed - install one, or remove the flag (the "
            "experts then run one after another, same result)")


def grouped_gemm_available() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) is not None
               for name in ("transformer_engine", "grouped_gemm"))


def _validate_logging_and_checkpoints(args: argparse.Namespace) -> None:
    if args.wandb_project:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise HeteroError("--wandb-project needs the wandb package: pip install wandb "
                              "(or megatron-hetero[wandb])")
        if args.wandb_save_dir is None and args.save is None:
            raise HeteroError("--wandb-project needs --wandb-save-dir DIR or --save DIR (W&B "
                              "writes to SAVE/wandb by default)")
    args.startup_notes = []
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


def used_kernel_tuning_flags(args: argparse.Namespace) -> list[str]:
    return [f for f in _KERNEL_TUNING_FLAGS if getattr(args, f[2:].replace("-", "_"))]
