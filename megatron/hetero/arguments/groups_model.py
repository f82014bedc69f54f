"""The parser's model and mixture-of-experts groups, and the kernel-choice flags."""

from __future__ import annotations

import argparse

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


def used_kernel_tuning_flags(args: argparse.Namespace) -> list[str]:
    return [f for f in _KERNEL_TUNING_FLAGS if getattr(args, f[2:].replace("-", "_"))]
