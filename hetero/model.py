"""Model spec: the shape of a GPT/Llama model, with Megatron's field names.

Shared by the runtime (TFLOPS in the log line) and the predictor, so both count the same
floating-point operations. Presets cover the models of the papers we compare with; any
other shape comes from YAML with the same field names.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from hetero.errors import HeteroError
from hetero.validation import describe_validation_error


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
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    max_position_embeddings: int | None = None

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    # ----- FLOPs ------------------------------------------------------------------------

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

    # ----- parameters -------------------------------------------------------------------

    def layer_params(self) -> int:
        """Parameters of one decoder layer (megatron-core's layout)."""
        h = self.hidden_size
        q = self.num_attention_heads * self.head_dim
        kv = self.query_groups * self.head_dim
        fc1_out = self.ffn * (2 if self.swiglu else 1)
        weights = h * (q + 2 * kv) + q * h + h * fc1_out + self.ffn * h
        biases = (q + 2 * kv) + h + fc1_out + h if self.add_bias_linear else 0
        norms = 2 * h * (2 if self.normalization == "LayerNorm" else 1)
        return weights + biases + norms

    def embedding_params(self) -> int:
        """Word (and learned position) embeddings: the first stage's extra parameters."""
        positions = 0
        if self.position_embedding_type == "learned_absolute":
            positions = (self.max_position_embeddings or self.seq_length) * self.hidden_size
        return self.vocab_size * self.hidden_size + positions

    def output_params(self) -> int:
        """Final norm and output layer: the last stage's extras.

        With tied embeddings the last stage of a pipeline still holds its own copy of the
        table (kept in sync by an all-reduce), so it counts in memory either way.
        """
        final_norm = self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)
        return final_norm + self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        output = self.output_params()
        if not self.untie_embeddings_and_output_weights:
            output -= self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params() + self.embedding_params() + output

    # ----- activations ------------------------------------------------------------------

    def layer_activation_bytes(
        self, micro_batch_size: int, tensor_parallel: int, bytes_per_value: int,
        fused_kernels: bool = True, dropout: bool = True,
    ) -> float:
        """Activations one layer keeps for backward, per micro-batch (no recomputation,
        no sequence parallelism), after Korthikanti et al. 2022 ("Reducing Activation
        Recomputation in Large Transformer Models"), generalised to GQA and SwiGLU.

        MHA, 4h MLP, bf16, dropout, unfused attention: s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes,
        the paper's figure. Fused kernels keep no attention score matrix (flash attention)
        and SwiGLU's input only; without dropout no masks or dropout outputs are kept.
        """
        h, s, t, v = self.hidden_size, self.seq_length, tensor_parallel, bytes_per_value
        q = self.num_attention_heads * self.head_dim
        kv = self.query_groups * self.head_dim
        masks = 2 * h if dropout else 0  # after attention and after the MLP, one byte each
        # Not split by TP: two norm inputs, QKV and fc1 inputs, dropout masks.
        replicated = 4 * v * h + masks
        # Split by TP: Q, K, V, attention output, MLP activation input(s), fc2 input.
        if self.swiglu and not fused_kernels:
            mlp = v * 4 * self.ffn  # fc1 output (2F), SiLU output and up half (F each)
        else:
            mlp = v * (2 if self.swiglu else 1) * self.ffn
        split = v * (q + kv) + v * kv + v * q + mlp + v * self.ffn
        scores = 0.0
        if not fused_kernels:  # softmax output, and with dropout its mask and output
            scores = (2 * v + 1 if dropout else v) * self.num_attention_heads * s
        per_token = replicated + (split + scores) / t
        return s * micro_batch_size * per_token

    def logits_activation_bytes(self, micro_batch_size: int, tensor_parallel: int, bytes_per_value: int) -> float:
        """The last stage's extra: logits (model dtype) and fp32 softmax for the loss."""
        tokens = self.seq_length * micro_batch_size
        return tokens * (self.vocab_size / tensor_parallel * (bytes_per_value + 4) + 2 * self.hidden_size)

    def with_seq_length(self, seq_length: int) -> "ModelSpec":
        return dataclasses.replace(self, seq_length=seq_length)

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def _gpt(layers: int, hidden: int, heads: int) -> ModelSpec:
    """GPT-3 shapes as in Megatron-LM (Narayanan et al. 2021, table 1)."""
    return ModelSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     seq_length=2048, vocab_size=51200)


def _llama(layers: int, hidden: int, heads: int, ffn: int, groups: int | None = None) -> ModelSpec:
    """Llama-2 shapes (Touvron et al. 2023): RMSNorm, SwiGLU, RoPE, untied, no biases."""
    return ModelSpec(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=4096,
        vocab_size=32000, ffn_hidden_size=ffn, num_query_groups=groups, swiglu=True,
        untie_embeddings_and_output_weights=True, add_bias_linear=False,
        normalization="RMSNorm", position_embedding_type="rope",
    )


PRESETS: dict[str, ModelSpec] = {
    "gpt-1.7b": _gpt(24, 2304, 24),
    "gpt-3.6b": _gpt(30, 3072, 32),  # Holmes' GPT-3.6B
    "gpt-7.5b": _gpt(36, 4096, 32),
    "gpt-39b": _gpt(48, 8192, 64),
    "llama2-7b": _llama(32, 4096, 32, 11008),
    "llama2-13b": _llama(40, 5120, 40, 13824),
    "llama2-70b": _llama(80, 8192, 64, 28672, groups=8),
    # HetHub's Llama-140B: Llama-2-70B's design widened to ~140B parameters.
    "llama-140b": _llama(96, 10240, 80, 40960, groups=8),
}


def load_model(name_or_path: str | os.PathLike) -> ModelSpec:
    """A preset name, or a YAML file with ModelSpec's (Megatron's) field names."""
    if str(name_or_path) in PRESETS:
        return PRESETS[str(name_or_path)]
    path = Path(name_or_path)
    if not path.exists():
        raise HeteroError(
            f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a YAML file"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise HeteroError(f"{path} is not valid YAML: {err}") from None
    data.setdefault("seq_length", 2048)
    try:
        return TypeAdapter(ModelSpec).validate_python(data, strict=False)
    except ValidationError as err:
        raise HeteroError(
            describe_validation_error(err, str(path), "model spec",
                                      "Use Megatron's field names (see hetero/model.py).")
        ) from None
