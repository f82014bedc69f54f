"""Model spec: the shape of a GPT/Llama model, with Megatron's field names.

Shared by the runtime (TFLOPS in the log line) and the predictor, so both count the same
floating-point operations.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    """Padded vocabulary size (the size of the embedding table)."""
    ffn_hidden_size: int | None = None
    """Defaults to 4 x hidden_size."""
    num_query_groups: int | None = None
    """Key/value heads; None means one per attention head (no grouped-query attention)."""
    kv_channels: int | None = None
    """Per-head projection size; defaults to hidden_size / num_attention_heads."""
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def layer_forward_flops_per_token(self) -> float:
        """Matrix-multiply FLOPs of one decoder layer's forward pass, per token.

        Causal attention computes half of the score matrix, as fused kernels do.
        """
        h, s = self.hidden_size, self.seq_length
        q = self.num_attention_heads * self.head_dim
        kv = self.query_groups * self.head_dim
        qkv = 2 * h * (q + 2 * kv)
        core_attention = 2 * 2 * s * q / 2
        out_proj = 2 * q * h
        mlp = 2 * h * self.ffn * (3 if self.swiglu else 2)
        return qkv + core_attention + out_proj + mlp

    def logits_forward_flops_per_token(self) -> float:
        return 2 * self.hidden_size * self.vocab_size

    def training_flops(self, num_samples: int) -> float:
        """FLOPs of forward + backward (2x forward) over num_samples sequences."""
        tokens = num_samples * self.seq_length
        forward = tokens * (
            self.num_layers * self.layer_forward_flops_per_token()
            + self.logits_forward_flops_per_token()
        )
        return 3 * forward
