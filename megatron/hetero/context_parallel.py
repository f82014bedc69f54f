"""Context parallelism in megatron-core's local attention, without transformer-engine.

Megatron-LM splits each sequence into 2 x CP chunks and gives context-parallel rank r the
chunks r and 2CP-1-r (causal attention then costs every rank the same; megatron-core's
``get_batch_on_this_cp_rank``). Everything but attention works on those tokens alone: RoPE
takes their positions (megatron-core's ``get_pos_emb_on_this_cp_rank``), norms and MLPs are
per token, and the loss sums over them. Attention is exact when each rank's queries meet
the keys and values of the WHOLE sequence under the causal mask of the true positions: the
keys and values are all-gathered over the context-parallel group (their gradients reduce-
scattered back in backward, megatron-core's sequence-parallel gather), put back into
sequence order, and the local attention runs on them unchanged.

Transformer-engine's ring attention exchanges the same keys and values piecewise to save
memory; this gathers them whole (memory of one full sequence's K and V per layer), which is
what a machine without transformer-engine can run.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from hetero.errors import HeteroError


def chunk_positions(sequence_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The true positions of the tokens context-parallel rank cp_rank holds, in its order:
    chunk cp_rank then chunk 2*cp_size-1-cp_rank of a sequence cut into 2*cp_size chunks."""
    if sequence_length % (2 * cp_size):
        raise HeteroError(f"a sequence of {sequence_length} tokens cannot be cut into 2 x context-parallel "
                          f"size = {2 * cp_size} equal chunks; use a --seq-length divisible by {2 * cp_size}")
    chunk = sequence_length // (2 * cp_size)
    positions = torch.arange(sequence_length, device=device).view(2 * cp_size, chunk)
    return positions[[cp_rank, 2 * cp_size - 1 - cp_rank]].reshape(-1)


def gathered_positions(local_length: int, cp_size: int, device=None) -> torch.Tensor:
    """The true position of each token of the all-gathered sequence (rank 0's tokens, then
    rank 1's, ...), for a local sequence of local_length tokens per rank."""
    full = local_length * cp_size
    return torch.cat([chunk_positions(full, cp_size, r, device) for r in range(cp_size)])


def causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """[1, 1, sq, sk] boolean, True where the key lies after the query (megatron-core's
    convention: True is masked out)."""
    return (key_positions[None, :] > query_positions[:, None])[None, None]


def gather_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    """[s_local, ...] of every rank of group, concatenated in rank order; autograd sums the
    gradient over the ranks and hands each its own part (a reduce-scatter)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=True, group=group)


def full_sequence_keys_values(key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                              cp_size: int, cp_rank: int, gather: Callable[[torch.Tensor], torch.Tensor],
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole sequence's keys and values in sequence order ([s, b, ng, hn]) and the mask
    of this rank's queries against them ([b or 1, 1, s_local, s]). gather: [s_local, ...] of
    every context rank concatenated in rank order (gather_sequence over the group)."""
    local_length = key.size(0)
    order = torch.argsort(gathered_positions(local_length, cp_size, key.device))  # gathered index per position
    key = gather(key.contiguous()).index_select(0, order)
    value = gather(value.contiguous()).index_select(0, order)
    full = local_length * cp_size
    if attention_mask is None:
        queries = chunk_positions(full, cp_size, cp_rank, key.device)
        attention_mask = causal_mask(queries, torch.arange(full, device=key.device))
    elif tuple(attention_mask.shape[-2:]) != (local_length, full):
        # get_batch_on_this_cp_rank keeps the rows of this rank's queries, all columns.
        raise HeteroError(f"the attention mask of a context-parallel rank has shape "
                          f"{tuple(attention_mask.shape)}; expected [..., {local_length}, {full}] (its "
                          "queries' rows against the whole sequence): split the batch with "
                          "megatron-core's get_batch_on_this_cp_rank")
    return key, value, attention_mask


def apply_local_attention_context_parallel() -> object:
    """Patches megatron-core's DotProductAttention (see the module docstring)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    original_init, original_forward = DotProductAttention.__init__, DotProductAttention.forward

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs):
        cp_size = config.context_parallel_size
        if cp_size == 1:
            return original_init(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs)
        if attn_mask_type != AttnMaskType.causal:
            raise HeteroError(f"--context-parallel-size {cp_size} without transformer-engine supports causal "
                              f"self-attention only (this layer's mask is {attn_mask_type.name})")
        if config.window_size is not None:
            raise HeteroError(f"--context-parallel-size {cp_size} without transformer-engine does not support "
                              "sliding-window attention (--window-size); drop one of them")
        # The local class asserts CP 1 only because it has no way to see the other ranks' keys.
        config.context_parallel_size = 1
        try:
            original_init(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs)
        finally:
            config.context_parallel_size = cp_size
        pg_collection = kwargs.get("pg_collection")
        self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        # Every mask is given explicitly (the causal one of the true positions): the softmax's
        # own causal mask (and its fused upper-triangular kernel) assume queries == keys.
        self.scale_mask_softmax.attn_mask_type = AttnMaskType.padding

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        group = getattr(self, "cp_group", None)
        if group is None or group.size() == 1:
            return original_forward(self, query, key, value, attention_mask, *args, **kwargs)
        key, value, attention_mask = full_sequence_keys_values(
            key, value, attention_mask, group.size(), group.rank(), partial(gather_sequence, group=group))
        return original_forward(self, query, key, value, attention_mask, *args, **kwargs)

    DotProductAttention.__init__ = __init__
    DotProductAttention.forward = forward
    return forward
