"""Tensor-parallel communication hidden under the GEMMs next to it (--tp-comm-overlap).

With transformer-engine's userbuffers, each of a layer's tensor-parallel collectives (with
sequence parallelism: the all-gather before the QKV and first MLP GEMMs, the reduce-scatter
after the attention projection and the second MLP GEMM) is split into TP chunks that move
while the GEMM works on the chunks already there. A collective stays exposed for its first
chunk, or for what its GEMM cannot cover.

The cost model counts a layer's collectives in all-reduce units (one all-gather plus one
reduce-scatter): one for the attention block, one for the MLP. Of a GPT layer's GEMM work
(12 h^2 per token) the attention block's QKV and projection are 4 h^2, the MLP's two 8 h^2:
the shares below. Backward GEMMs are twice the forward's and cover twice as much.
"""

from __future__ import annotations

BLOCK_GEMM_SHARES = (4 / 12, 8 / 12)
"""Share of a layer's GEMM time beside the attention block's and the MLP block's collectives."""


def exposed_tp_comm_s(allreduce_s: float, gemm_s: float, tensor_parallel: int) -> float:
    """Exposed seconds of one pass's two tensor-parallel all-reduce units (attention and
    MLP) when they overlap the pass's GEMMs taking gemm_s."""
    if tensor_parallel <= 1 or allreduce_s == 0.0:
        return 0.0
    return sum(max(allreduce_s / tensor_parallel, allreduce_s - share * gemm_s) for share in BLOCK_GEMM_SHARES)
