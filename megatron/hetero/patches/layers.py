"""Patches for model layers without transformer-engine/apex or a GPU: the MoE router and
token dispatcher, torch's norms, local attention (MLA's head sizes, context parallelism),
MLA's rotary tables, and multi-token prediction's last stage."""

from __future__ import annotations

import functools


def _moe_router_without_te() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def _apply_moe_router_without_te() -> object:
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # the name its fallback branch tests for
    return moe_utils.te_general_gemm


def _torch_norm_lacks_zero_centered_gamma() -> bool:
    from megatron.core.transformer import torch_norm

    return torch_norm.WrappedTorchNorm is not None


def _apply_zero_centered_torch_norm() -> object:
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class ZeroCenteredNorm(torch.nn.Module):
        """LayerNorm / RMSNorm with the scale stored as gamma - 1 (zeros at start), as
        Megatron-LM's --apply-layernorm-1p: weight decay pulls gamma towards 1, not 0."""

        def __init__(self, normalization: str, hidden_size: int, eps: float):
            super().__init__()
            self.normalization, self.shape, self.eps = normalization, (hidden_size,), eps
            self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
            self.bias = (torch.nn.Parameter(torch.zeros(hidden_size))
                         if normalization == "LayerNorm" else None)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.normalization == "LayerNorm":
                return F.layer_norm(x, self.shape, self.weight + 1, self.bias, self.eps)
            return F.rms_norm(x, self.shape, self.weight + 1, self.eps)

    original = WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
            zero_centered_gamma=False, normalization="LayerNorm"):
        if config.layernorm_zero_centered_gamma and config.normalization in ("LayerNorm", "RMSNorm"):
            return ZeroCenteredNorm(config.normalization, hidden_size, eps)
        return original(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                        normalization)

    WrappedTorchNorm.__new__ = staticmethod(new)
    return new


def _torch_norm_in_use() -> bool:
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return gpt_layer_specs.LNImpl is WrappedTorchNorm


def _apply_sequence_parallel_torch_norm() -> object:
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        # A norm acts on each token alone, so a sequence shard is normalised as the whole
        # would be; what sequence parallelism needs is that the weights' gradients (from
        # each rank's shard) are summed over the tensor-parallel group, which
        # finalize_model_grads does for parameters marked sequence_parallel (as apex's and
        # transformer-engine's norms mark theirs).
        unsharded = copy.copy(config)  # no __post_init__: only the flag differs
        unsharded.sequence_parallel = False
        norm = original(cls, unsharded, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", True)
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)
    return __new__


def _apply_host_split_sizes() -> object:
    from megatron.core.transformer.moe import token_dispatcher

    from megatron.hetero.moe import host_split_sizes

    token_dispatcher.maybe_move_tensor_to_cpu = host_split_sizes(token_dispatcher.maybe_move_tensor_to_cpu)
    return token_dispatcher.maybe_move_tensor_to_cpu


def _apply_local_attention_context_parallel() -> object:
    from megatron.hetero.context_parallel import apply_local_attention_context_parallel

    return apply_local_attention_context_parallel()


def _apply_local_attention_separate_value_head() -> object:
    """DotProductAttention takes MLA's k_channels/v_channels (see the patch's why)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original_init = DotProductAttention.__init__

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args,
                 k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        original_init(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs)
        heads_per_partition = self.num_attention_heads_per_partition
        if k_channels is not None:
            # Only the default softmax scale reads it; MLA passes its own (yarn mscale included).
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            # The context [sq, b, np, v_channels] is flattened to this width after attention.
            self.hidden_size_per_partition = v_channels * heads_per_partition

    DotProductAttention.__init__ = __init__
    return __init__


def _apply_yarn_rope_on_cpu() -> object:
    """YarnRotaryEmbedding builds its tables on the CPU when there is no GPU (see the why)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    original_init = YarnRotaryEmbedding.__init__

    def __init__(self, *args, **kwargs):
        kwargs["use_cpu_initialization"] = True
        original_init(self, *args, **kwargs)

    YarnRotaryEmbedding.__init__ = __init__
    return __init__


def _transformer_engine_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is None


def _apply_mla_knows_transformer_engine_missing() -> object:
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False
    return multi_latent_attention


def _apply_mtp_stage_without_output_weight() -> object:
    from megatron.core.models.gpt.gpt_model import GPTModel

    original = GPTModel.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        output = getattr(self, "output_layer", None)
        if (getattr(self, "mtp_process", False) and not self.pre_process and output is not None
                and self.share_embeddings_and_output_weights and output.weight is not None):
            output.weight = None  # the tied logits read the stage's copy of the word embeddings

    GPTModel.__init__ = __init__
    return __init__
