"""Command-line flags: Megatron-LM's names, defaults and meanings, plus ``--hetero-plan``.

A recipe written for Megatron-LM's pretrain_gpt.py runs unchanged as long as it uses the
flags below. A flag we do not know is an error (never silently ignored), and so is a flag
that contradicts the plan.
"""

from __future__ import annotations

import argparse
import difflib
import math
from typing import Sequence

from hetero.errors import HeteroError
from hetero.plan import Plan

# Megatron-LM flags that only choose fused kernels: speed, not the model. On GPUs they keep
# their meaning where megatron-core's local or transformer-engine layers offer the kernel;
# on the CPU no fused kernel exists and they have no effect (the start-up log says so).
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
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated alias of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--apply-layernorm-1p", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--swiglu", action="store_true")
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
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
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
    g.add_argument("--tokenizer-type", default=None,
                   choices=["NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                            "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                            "Llama2Tokenizer", "TikTokenizer"])
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true",
                   help="accepted; throughput is always logged")
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


def _add_hetero_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("heterogeneous plan")
    g.add_argument("--hetero-plan", default=None,
                   help="plan.json from hetero-plan; without it the job runs Megatron's "
                        "uniform plan (even stages, equal replicas, launch-order ranks)")


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
        allow_abbrev=False,
    )
    for add in (_add_model_args, _add_training_args, _add_data_args, _add_logging_args,
                _add_checkpoint_args, _add_distributed_args, _add_hetero_args,
                _add_performance_args):
        add(parser)
    return parser


def _known_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parses flags; an unknown flag is a HeteroError naming it and its nearest known flag."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")]
        lines = []
        for flag in flags or unknown:
            close = difflib.get_close_matches(flag, _known_flags(parser), n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
            lines.append(f"unknown flag {flag}{hint}")
        raise HeteroError(
            "; ".join(lines) + ". Megatron-Hetero takes Megatron-LM's flags listed by "
            "`pretrain_gpt.py --help`; remove or correct the flag."
        )
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


# Plan "model" fields (Megatron's names) that must equal the run's flags once defaults
# are filled in.
_MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "num_query_groups", "kv_channels", "seq_length", "swiglu",
                 "untie_embeddings_and_output_weights", "add_bias_linear", "normalization",
                 "position_embedding_type")


def check_plan_model(args: argparse.Namespace, plan: Plan) -> None:
    """A plan from hetero-plan records the model and training it was made for; the run
    must be that model (the plan's times and memory are for it) and that precision."""
    model = plan.model_extra.get("model") or {}
    wrong = [
        f"{name.replace('_', '-')}: plan {model[name]!r}, flags {getattr(args, name)!r}"
        for name in _MODEL_FIELDS
        if model.get(name) is not None and model[name] != getattr(args, name)
    ]
    training = plan.model_extra.get("training") or {}
    precision = training.get("precision")
    if precision and precision != args.params_dtype:
        flag = {"bf16": "--bf16", "fp16": "--fp16", "fp32": "neither --bf16 nor --fp16"}[precision]
        wrong.append(f"precision: plan {precision} ({flag}), flags {args.params_dtype}")
    if wrong:
        raise HeteroError(
            "the plan was made for another model or precision (" + "; ".join(wrong) + "); run the "
            "model it was made for, or regenerate it with hetero-plan --model ... --precision ..."
        )
    if training.get("distributed_optimizer"):
        args.use_distributed_optimizer = True  # the plan's memory assumes it


def validate_args(args: argparse.Namespace) -> None:
    """Fills Megatron-LM's derived defaults and rejects contradictory combinations."""
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size", "global_batch_size", "train_iters", "lr")
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
    tp = args.tensor_model_parallel_size
    for name, value in (("--num-attention-heads", args.num_attention_heads),
                        ("--num-query-groups", args.num_query_groups),
                        ("--ffn-hidden-size", args.ffn_hidden_size)):
        if value % tp:
            raise HeteroError(f"{name} {value} is not divisible by the tensor-parallel size {tp}")
    if args.mock_data == bool(args.data_path):
        raise HeteroError("give exactly one of --mock-data or --data-path PREFIX [...]")
    if args.tokenizer_type is None:
        raise HeteroError("missing --tokenizer-type (e.g. NullTokenizer with --vocab-size N)")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise HeteroError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.split is None:
        args.split = "969, 30, 1"
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise HeteroError("give only one of --lr-warmup-fraction and --lr-warmup-iters")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None:
        raise HeteroError("--lr-decay-style WSD needs --lr-wsd-decay-iters")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    for name in ("log_interval", "eval_interval", "save_interval", "exit_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise HeteroError(f"--{name.replace('_', '-')} must be at least 1")
    if args.save_interval is not None and args.save is None:
        raise HeteroError("--save-interval needs --save DIR (where to write the checkpoints)")
    args.params_dtype = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """Megatron-LM's rule: pad to a multiple of make-vocab-size-divisible-by x TP."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def used_kernel_tuning_flags(args: argparse.Namespace) -> list[str]:
    return [f for f in _KERNEL_TUNING_FLAGS if getattr(args, f[2:].replace("-", "_"))]
