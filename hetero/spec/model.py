"""Model spec: the shape of a GPT/Llama model, with Megatron's field names.

Shared by the runtime (TFLOPS in the log line) and the predictor, so both count the same
floating-point operations. Presets cover the models of the papers we compare with; any
other shape comes from YAML with the same field names.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from hetero.errors import HeteroError
from hetero.io import describe_validation_error


def megatron_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default FFN width: 4h, or with SwiGLU 2/3 of that rounded down to 64
    (megatron/training/arguments.py, validate_args)."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


@dataclass(frozen=True)
class ModelSpec:
    """A model's shape with Megatron's field names. Fields left out take Megatron-LM's
    defaults when the spec is built, so two specs of the same model compare equal however
    they were written (a YAML, a preset, pretrain_gpt.py's flags)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    """Padded vocabulary size (the size of the embedding table)."""
    ffn_hidden_size: int | None = None
    """Defaults to megatron_ffn_hidden_size (4h, or 2/3 of it rounded to 64 with SwiGLU)."""
    num_query_groups: int | None = None
    """Key/value heads; defaults to one per attention head (no grouped-query attention)."""
    kv_channels: int | None = None
    """Per-head projection size; defaults to hidden_size / num_attention_heads."""
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    max_position_embeddings: int | None = None
    """Defaults to seq_length (only learned absolute positions have a table)."""
    num_experts: int | None = None
    """Mixture of experts: experts per MoE layer (None: a dense MLP)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's FFN width; defaults to ffn_hidden_size."""

    def __post_init__(self) -> None:
        defaults = {
            "ffn_hidden_size": megatron_ffn_hidden_size(self.hidden_size, self.swiglu),
            "num_query_groups": self.num_attention_heads,
            "kv_channels": self.hidden_size // self.num_attention_heads,
            "max_position_embeddings": self.seq_length,
        }
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)

    @classmethod
    def from_megatron_args(cls, args) -> "ModelSpec":
        """The model pretrain_gpt.py builds from these flags (an argparse Namespace or a
        dict with Megatron's names). The vocabulary is the padded one when known
        (padded_vocab_size), else vocab_size; 0 when neither is set yet."""
        get = args.get if isinstance(args, dict) else (lambda name, default=None: getattr(args, name, default))
        position = get("position_embedding_type") or "learned_absolute"
        if get("use_rotary_position_embeddings"):
            position = "rope"
        groups = get("num_query_groups") if get("group_query_attention", True) else None
        vocab = get("padded_vocab_size") or get("vocab_size") or 0
        return cls(
            num_layers=get("num_layers"), hidden_size=get("hidden_size"),
            num_attention_heads=get("num_attention_heads"), seq_length=get("seq_length"),
            vocab_size=vocab, ffn_hidden_size=get("ffn_hidden_size"), num_query_groups=groups,
            kv_channels=get("kv_channels"), swiglu=bool(get("swiglu", False)),
            untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights", False)),
            add_bias_linear=bool(get("add_bias_linear", True)),
            normalization=get("normalization") or "LayerNorm", position_embedding_type=position,
            max_position_embeddings=get("max_position_embeddings"), num_experts=get("num_experts"),
            moe_router_topk=get("moe_router_topk") or 2, moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
        )

    def differences(self, other: "ModelSpec", skip: tuple[str, ...] = ()) -> list[tuple[str, object, object]]:
        """(flag name, ours, theirs) for every field (after defaults) where the specs differ."""
        return [(f.name.replace("_", "-"), getattr(self, f.name), getattr(other, f.name))
                for f in dataclasses.fields(self)
                if f.name not in skip and getattr(self, f.name) != getattr(other, f.name)]

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups

    @property
    def head_dim(self) -> int:
        return self.kv_channels

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    # ----- FLOPs ------------------------------------------------------------------------

    def _mlp_weights(self, ffn: int) -> int:
        return self.hidden_size * ffn * (3 if self.swiglu else 2)

    def attention_gemm_flops_per_token(self) -> float:
        """QKV and output projections (forward, per token)."""
        h = self.hidden_size
        q = self.num_attention_heads * self.head_dim
        kv = self.query_groups * self.head_dim
        return 2 * h * (q + 2 * kv) + 2 * q * h

    def core_attention_flops_per_token(self) -> float:
        """Scores and their product with V; causal, so half of the s x s matrix, as fused
        kernels compute it."""
        return 2 * 2 * self.seq_length * self.num_attention_heads * self.head_dim / 2

    def mlp_flops_per_token(self) -> float:
        """Dense MLP, or the top-k experts a token is routed to plus the router."""
        if self.is_moe:
            return 2 * (self.moe_router_topk * self._mlp_weights(self.moe_ffn_hidden_size)
                        + self.hidden_size * self.num_experts)
        return 2 * self._mlp_weights(self.ffn)

    @functools.cache
    def layer_forward_flops_per_token(self) -> float:
        """Matrix-multiply FLOPs of one decoder layer's forward pass, per token."""
        return (self.attention_gemm_flops_per_token() + self.core_attention_flops_per_token()
                + self.mlp_flops_per_token())

    def logits_forward_flops_per_token(self) -> float:
        return 2 * self.hidden_size * self.vocab_size

    def training_flops(self, num_samples: int) -> float:
        """Model FLOPs of forward + backward (2x forward) over num_samples sequences
        (recomputation not counted: it is the same model's work done twice)."""
        tokens = num_samples * self.seq_length
        forward = tokens * (
            self.num_layers * self.layer_forward_flops_per_token()
            + self.logits_forward_flops_per_token()
        )
        return 3 * forward

    # ----- parameters -------------------------------------------------------------------

    @functools.cache
    def layer_params(self) -> int:
        """Parameters of one decoder layer (megatron-core's layout); a MoE layer holds
        every expert and the router."""
        h = self.hidden_size
        q = self.num_attention_heads * self.head_dim
        kv = self.query_groups * self.head_dim
        attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) + h if self.add_bias_linear else 0)
        norms = 2 * h * (2 if self.normalization == "LayerNorm" else 1)
        return attention + norms + self.mlp_params()

    @functools.cache
    def mlp_params(self) -> int:
        def one(ffn: int) -> int:
            fc1_out = ffn * (2 if self.swiglu else 1)
            return self._mlp_weights(ffn) + (fc1_out + self.hidden_size if self.add_bias_linear else 0)
        if self.is_moe:
            return self.num_experts * one(self.moe_ffn_hidden_size) + self.hidden_size * self.num_experts
        return one(self.ffn)

    @functools.cache
    def embedding_params(self) -> int:
        """Word (and learned position) embeddings: the first stage's extra parameters."""
        positions = 0
        if self.position_embedding_type == "learned_absolute":
            positions = self.max_position_embeddings * self.hidden_size
        return self.vocab_size * self.hidden_size + positions

    @functools.cache
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
        fused_kernels: bool = True, dropout: bool = True, recompute: str = "none",
        sequence_parallel: bool = False,
    ) -> float:
        """Activations one layer keeps for backward, per micro-batch, after Korthikanti et
        al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section
        4, table 2), generalised to GQA, SwiGLU and MoE.

        MHA, 4h MLP, 16-bit values, dropout, unfused attention, no recomputation:
        s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes; sequence parallelism splits the 10 by t as
        well (34*s*b*h/t + 5*a*s^2*b/t); selective recomputation drops the attention score
        terms (as fused/flash attention does: no s x s matrix kept); full recomputation
        keeps only each layer's input, 2*s*b*h (/t with sequence parallelism). Without
        dropout no masks or dropout outputs are kept. A MoE layer keeps its MLP
        activations for each of the top-k experts a token visits.
        """
        h, s, t, v = self.hidden_size, self.seq_length, tensor_parallel, bytes_per_value
        tokens = s * micro_batch_size
        if recompute == "full":
            return tokens * v * h / (t if sequence_parallel else 1)
        q = self.num_attention_heads * self.head_dim
        kv = self.query_groups * self.head_dim
        masks = 2 * h if dropout else 0  # after attention and after the MLP, one byte each
        # Split by TP only with sequence parallelism: two norm inputs, QKV and fc1 inputs,
        # dropout masks.
        sequence_part = 4 * v * h + masks
        # Split by TP: Q, K, V, attention output, MLP activation input(s), fc2 input.
        ffn, routed = (self.moe_ffn_hidden_size, self.moe_router_topk) if self.is_moe else (self.ffn, 1)
        if self.swiglu and not fused_kernels:
            mlp = v * 4 * ffn  # fc1 output (2F), SiLU output and up half (F each)
        else:
            mlp = v * (2 if self.swiglu else 1) * ffn
        split = v * (q + kv) + v * kv + v * q + routed * (mlp + v * ffn)
        scores = 0.0
        if not fused_kernels and recompute != "selective":
            # softmax output, and with dropout its mask and output
            scores = (2 * v + 1 if dropout else v) * self.num_attention_heads * s
        per_token = sequence_part / (t if sequence_parallel else 1) + (split + scores) / t
        return tokens * per_token

    def logits_activation_bytes(self, micro_batch_size: int, tensor_parallel: int, bytes_per_value: int) -> float:
        """The last stage's extra: logits (model dtype) and fp32 softmax for the loss."""
        tokens = self.seq_length * micro_batch_size
        return tokens * (self.vocab_size / tensor_parallel * (bytes_per_value + 4) + 2 * self.hidden_size)

    def with_seq_length(self, seq_length: int) -> "ModelSpec":
        """The same model at another sequence length (a position table that was defaulted
        to the old length follows it)."""
        positions = self.max_position_embeddings
        if positions == self.seq_length or positions < seq_length:
            positions = seq_length
        return dataclasses.replace(self, seq_length=seq_length, max_position_embeddings=positions)

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
    # Sailor's models (Strati et al. 2025), as GPT shapes: OPT-350M (Zhang et al. 2022; its
    # 512-wide embedding projection left out) and GPT-Neo-2.7B (Black et al. 2021).
    "opt-350m": _gpt(24, 1024, 16),
    "gpt-neo-2.7b": _gpt(32, 2560, 20),
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
                                      "Use Megatron's field names (see hetero/spec/model.py).")
        ) from None
