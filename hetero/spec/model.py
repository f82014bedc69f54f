"""Model spec: the shape of a GPT/Llama model, with Megatron's field names.

Shared by the runtime (TFLOPS in the log line) and the predictor, so both count the same
floating-point operations. Presets cover the models of the papers we compare with; any
other shape comes from YAML with the same field names.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from hetero.errors import HeteroError
from hetero.io import describe_validation_error
from hetero.spec.recompute import mode as recompute_mode, modules as recomputed_modules


def megatron_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default FFN width: 4h, or with SwiGLU 2/3 of that rounded down to 64
    (megatron/training/arguments.py, validate_args)."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


def layer_list_value(text: str):
    """The value of Megatron-LM's per-layer list syntax ("([0]*3+[1]*58)": integers and
    lists joined with + and *), computed by walking the expression, never by eval. Raises
    SyntaxError or ValueError for anything else."""

    def read(node: ast.AST):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [read(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = read(node.left), read(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"unexpected {ast.unparse(node)!r}")

    return read(ast.parse(text.strip(), mode="eval").body)


def moe_layer_freq_of(value: int | str | list[int] | tuple[int, ...]) -> int | tuple[int, ...]:
    """--moe-layer-freq as Megatron-LM reads it: an integer k, or a Python list expression
    such as "([0]*3+[1]*58)" (lists of 0/1, repeated with * and joined with +), read here
    without eval."""
    if isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(value, int) or "[" not in str(value):
        return int(value)

    try:
        pattern = layer_list_value(str(value))
    except (SyntaxError, ValueError, TypeError):
        pattern = None
    if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
        raise HeteroError(f"--moe-layer-freq {value!r} is neither an integer nor a list of 0/1 per layer "
                          "such as \"([0]*3+[1]*58)\"")
    return tuple(pattern)


def window_size_of(value: str | list[int] | tuple[int, int]) -> tuple[int, int]:
    """--window-size as Megatron-LM reads it ("(128,0)": keys before, keys after)."""
    try:
        pair = tuple(value) if isinstance(value, (list, tuple)) else layer_list_value(
            str(value).replace("(", "[").replace(")", "]"))
        if len(pair) == 2 and all(isinstance(v, int) and v >= -1 for v in pair):
            return (int(pair[0]), int(pair[1]))
    except (SyntaxError, ValueError, TypeError):
        pass
    raise HeteroError(f"--window-size {value!r} is not a pair of key counts such as \"(128,0)\"")


def window_skip_freq_of(value: int | str | list[int] | tuple[int, ...]) -> int | tuple[int, ...]:
    """--window-attn-skip-freq as Megatron-LM reads it: every N-th layer attends fully, or one
    1 (window) / 0 (full) per layer such as "([1]*3+[0])*9"."""
    try:
        return moe_layer_freq_of(value)
    except HeteroError:
        raise HeteroError(f"--window-attn-skip-freq {value!r} is neither an integer nor a list of 0/1 per "
                          "layer such as \"([1]*3+[0])*9\"") from None


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
    moe_shared_expert_intermediate_size: int | None = None
    """Total FFN width of the shared experts every token passes through (None: none)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing (--moe-router-num-groups): the experts in this many groups of
    consecutive experts, a token routed within moe_router_group_topk of them (DeepSeek-V3:
    8 groups, one per node at EP 64, 4 per token). None: any expert."""
    moe_router_group_topk: int | None = None
    """Groups a token's experts are chosen from (--moe-router-group-topk)."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """Which layers are MoE, as --moe-layer-freq: every k-th layer (k=1: all), or one 0/1 per
    layer (DeepSeek-V3's first three dense layers: (0, 0, 0, 1, ..., 1))."""
    mtp_num_layers: int | None = None
    """Multi-token prediction layers after the decoder (each a layer like the last one, a
    2h -> h projection and its own output layer)."""
    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention (MLA) instead of (grouped-query) attention."""
    q_lora_rank: int | None = None
    """MLA: the query's low-rank width (None: queries projected at full rank)."""
    kv_lora_rank: int = 32
    """MLA: the compressed key/value width (Megatron-LM's default)."""
    qk_head_dim: int = 128
    """MLA: per-head query/key width without the rotary part."""
    qk_pos_emb_head_dim: int = 64
    """MLA: per-head rotary query/key width."""
    v_head_dim: int = 128
    """MLA: per-head value width."""
    window_size: tuple[int, int] | None = None
    """Sliding-window attention (--window-size "(128,0)"): the keys before and after its own
    each query attends (None: every earlier key)."""
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    """With a window, which layers attend fully (--window-attn-skip-freq): every N-th layer,
    or one 1 (window) / 0 (full) per layer; None: every layer has the window."""

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
        if isinstance(self.moe_layer_freq, list):  # a hashable spec: patterns are tuples
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        if isinstance(self.window_size, (list, str)):
            object.__setattr__(self, "window_size", window_size_of(self.window_size))
        if isinstance(self.window_attn_skip_freq, (list, str)):
            object.__setattr__(self, "window_attn_skip_freq", window_skip_freq_of(self.window_attn_skip_freq))
        skip = self.window_attn_skip_freq
        if isinstance(skip, tuple) and len(skip) != self.num_layers:
            raise HeteroError(
                f"window_attn_skip_freq gives {len(skip)} layers but the model has {self.num_layers}: "
                "give one 1 (window) / 0 (full attention) per layer, or an integer N")
        if isinstance(self.moe_layer_freq, tuple) and len(self.moe_layer_freq) != self.num_layers:
            raise HeteroError(
                f"moe_layer_freq gives {len(self.moe_layer_freq)} layers but the model has "
                f"{self.num_layers}: give one 0/1 per layer, or an integer k (every k-th layer)")

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
            moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size"),
            moe_router_num_groups=get("moe_router_num_groups"), moe_router_group_topk=get("moe_router_group_topk"),
            moe_layer_freq=moe_layer_freq_of(get("moe_layer_freq") or 1), mtp_num_layers=get("mtp_num_layers"),
            multi_latent_attention=bool(get("multi_latent_attention", False)),
            q_lora_rank=get("q_lora_rank"), kv_lora_rank=get("kv_lora_rank") or 32,
            qk_head_dim=get("qk_head_dim") or 128, qk_pos_emb_head_dim=get("qk_pos_emb_head_dim") or 64,
            v_head_dim=get("v_head_dim") or 128,
            window_size=get("window_size"), window_attn_skip_freq=get("window_attn_skip_freq"),
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

    def moe_layer_pattern(self) -> tuple[int, ...]:
        """1 for each MoE layer, 0 for each dense one (Megatron's reading of --moe-layer-freq)."""
        if not self.is_moe:
            return (0,) * self.num_layers
        if isinstance(self.moe_layer_freq, tuple):
            return self.moe_layer_freq
        return tuple(int(i % self.moe_layer_freq == 0) for i in range(self.num_layers))

    @property
    def moe_layer_fraction(self) -> float:
        """The share of decoder layers that are MoE. The cost and memory models treat every
        layer as this mix of a dense and a MoE layer, so a stage's cost stays linear in its
        layer count; the totals over the model are exact."""
        return sum(self.moe_layer_pattern()) / self.num_layers

    @property
    def shared_expert_ffn(self) -> int:
        return self.moe_shared_expert_intermediate_size or 0

    def _attention_widths(self) -> tuple[int, int, int]:
        """(query, key, value) widths over all heads (MLA: with the rotary part)."""
        if self.multi_latent_attention:
            qk = self.num_attention_heads * (self.qk_head_dim + self.qk_pos_emb_head_dim)
            return qk, qk, self.num_attention_heads * self.v_head_dim
        return self.num_attention_heads * self.head_dim, self.query_groups * self.head_dim, self.query_groups * self.head_dim

    # ----- FLOPs ------------------------------------------------------------------------

    def _mlp_weights(self, ffn: int) -> int:
        return self.hidden_size * ffn * (3 if self.swiglu else 2)

    def attention_gemm_flops_per_token(self) -> float:
        """QKV and output projections (forward, per token); MLA's down and up projections as
        Megatron-LM counts them (num_floating_point_operations)."""
        h = self.hidden_size
        if self.multi_latent_attention:
            heads = self.num_attention_heads
            qk = self.qk_head_dim + self.qk_pos_emb_head_dim
            query = h * heads * qk if self.q_lora_rank is None else self.q_lora_rank * (h + heads * qk + 1)
            key_value = self.kv_lora_rank * (h + heads * (self.qk_head_dim + self.v_head_dim) + 1)
            return 2 * (query + key_value + h * self.qk_pos_emb_head_dim + heads * self.v_head_dim * h)
        q, kv, _ = self._attention_widths()
        return 2 * h * (q + 2 * kv) + 2 * q * h

    def mla_up_projection_flops_per_token(self) -> float:
        """MLA's up projections (forward, per token): the query's from its latent (with a
        q_lora_rank) and the keys' and values' from theirs, what megatron-core's mla_up_proj
        recomputation runs again. 0 without MLA."""
        if not self.multi_latent_attention:
            return 0.0
        heads = self.num_attention_heads
        query = 0 if self.q_lora_rank is None else self.q_lora_rank * heads * (self.qk_head_dim + self.qk_pos_emb_head_dim)
        return 2 * (query + self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim))

    def window_layer_pattern(self) -> tuple[int, ...]:
        """1 for each layer with the sliding window, 0 for each attending fully (Megatron-LM's
        reading of --window-attn-skip-freq: an integer N makes every N-th layer full)."""
        if self.window_size is None:
            return (0,) * self.num_layers
        skip = self.window_attn_skip_freq
        if skip is None:
            return (1,) * self.num_layers
        if isinstance(skip, tuple):
            return skip
        return tuple(int((i + 1) % skip != 0) for i in range(self.num_layers))

    def attended_keys_per_query(self) -> float:
        """Keys a query attends, averaged over the queries and the layers: causal, so s / 2
        with full attention (as Megatron-LM counts it); a window of w earlier keys caps it at
        w + 1 (the keys after a query are masked by causality either way)."""
        s = self.seq_length
        full = s / 2
        pattern = self.window_layer_pattern()
        if not any(pattern):
            return full
        w = min(self.window_size[0], s - 1) if self.window_size[0] >= 0 else s - 1
        windowed = min(full, (w * (w + 1) / 2 + (s - w) * (w + 1)) / s)  # queries 0..w-1 see fewer
        share = sum(pattern) / len(pattern)
        return share * windowed + (1 - share) * full

    def core_attention_flops_per_token(self) -> float:
        """Scores and their product with V; causal, so half of the s x s matrix, as fused
        kernels compute it. Model FLOPs as Megatron-LM counts them, which ignores a sliding
        window (the cost model prices the attended keys: attended_keys_per_query)."""
        heads = self.num_attention_heads
        if self.multi_latent_attention:  # QK^T over the q/k width, the product with V over v's
            return 2 * self.seq_length * heads * (self.qk_head_dim + self.qk_pos_emb_head_dim + self.v_head_dim) / 2
        return 2 * 2 * self.seq_length * heads * self.head_dim / 2

    def dense_mlp_flops_per_token(self) -> float:
        return 2 * self._mlp_weights(self.ffn)

    def moe_mlp_flops_per_token(self) -> float:
        """The top-k routed experts and the shared experts (the router's h x E GEMM is not
        counted, as Megatron-LM does not)."""
        return 2 * (self.moe_router_topk * self._mlp_weights(self.moe_ffn_hidden_size)
                    + self._mlp_weights(self.shared_expert_ffn))

    def mlp_flops_per_token(self) -> float:
        """Dense MLP, or the average over the layers of dense and MoE MLPs."""
        if self.is_moe:
            share = self.moe_layer_fraction
            return share * self.moe_mlp_flops_per_token() + (1 - share) * self.dense_mlp_flops_per_token()
        return self.dense_mlp_flops_per_token()

    @functools.cache
    def layer_forward_flops_per_token(self) -> float:
        """Matrix-multiply FLOPs of one decoder layer's forward pass, per token."""
        return (self.attention_gemm_flops_per_token() + self.core_attention_flops_per_token()
                + self.mlp_flops_per_token())

    def logits_forward_flops_per_token(self) -> float:
        return 2 * self.hidden_size * self.vocab_size

    def mtp_forward_flops_per_token(self) -> float:
        """Multi-token prediction: each MTP layer is a decoder layer of the last layer's kind,
        a 2h -> h projection (with its norms) and another output layer."""
        if not self.mtp_num_layers:
            return 0.0
        h = self.hidden_size
        last_is_moe = self.moe_layer_pattern()[-1]
        mlp = self.moe_mlp_flops_per_token() if last_is_moe else self.dense_mlp_flops_per_token()
        layer = self.attention_gemm_flops_per_token() + self.core_attention_flops_per_token() + mlp
        return self.mtp_num_layers * (layer + 2 * (3 * h + 2 * h * h) + self.logits_forward_flops_per_token())

    def training_flops(self, num_samples: int) -> float:
        """Model FLOPs of forward + backward (2x forward) over num_samples sequences
        (recomputation not counted: it is the same model's work done twice)."""
        tokens = num_samples * self.seq_length
        forward = tokens * (
            self.num_layers * self.layer_forward_flops_per_token()
            + self.logits_forward_flops_per_token() + self.mtp_forward_flops_per_token()
        )
        return 3 * forward

    # ----- parameters -------------------------------------------------------------------

    @functools.cache
    def layer_params(self) -> int:
        """Parameters of one decoder layer (megatron-core's layout); a MoE layer holds
        every expert and the router."""
        h = self.hidden_size
        norms = 2 * h * (2 if self.normalization == "LayerNorm" else 1)
        return self.attention_params() + norms + self.mlp_params()

    def attention_params(self) -> int:
        h = self.hidden_size
        if self.multi_latent_attention:  # the FLOPs above are 2 x these weights, less the core
            return int((self.attention_gemm_flops_per_token()) / 2)
        q, kv, _ = self._attention_widths()
        return h * (q + 2 * kv) + q * h + ((q + 2 * kv) + h if self.add_bias_linear else 0)

    def _one_mlp_params(self, ffn: int) -> int:
        if ffn == 0:
            return 0
        fc1_out = ffn * (2 if self.swiglu else 1)
        return self._mlp_weights(ffn) + (fc1_out + self.hidden_size if self.add_bias_linear else 0)

    @functools.cache
    def expert_params(self) -> float:
        """Routed experts' parameters of the average layer: what expert parallelism shares
        out (every expert of every MoE layer, averaged over the layers)."""
        if not self.is_moe:
            return 0.0
        return self.moe_layer_fraction * self.num_experts * self._one_mlp_params(self.moe_ffn_hidden_size)

    @functools.cache
    def mlp_params(self) -> float:
        """The average layer's MLP: the dense MLP, or every expert, the shared experts and
        the router of a MoE layer, mixed as the layers are."""
        if self.is_moe:
            share = self.moe_layer_fraction
            moe = (self.num_experts * self._one_mlp_params(self.moe_ffn_hidden_size)
                   + self._one_mlp_params(self.shared_expert_ffn) + self.hidden_size * self.num_experts)
            dense = self._one_mlp_params(self.ffn)
            mixed = share * moe + (1 - share) * dense
            return int(mixed) if mixed == int(mixed) else mixed
        return self._one_mlp_params(self.ffn)

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

    def mtp_layer_model(self) -> "ModelSpec":
        """This model with every decoder layer of its last layer's kind: what one multi-token-
        prediction layer costs and keeps (megatron-core builds each from the last layer's spec)."""
        if not self.is_moe or self.moe_layer_fraction in (0.0, 1.0):
            return self
        return dataclasses.replace(self, moe_layer_freq=(self.moe_layer_pattern()[-1],) * self.num_layers)

    def mtp_params(self) -> float:
        """Multi-token prediction layers (their output layer shares the main one's weights)."""
        if not self.mtp_num_layers:
            return 0.0
        h = self.hidden_size
        return self.mtp_num_layers * (self.mtp_layer_model().layer_params() + 2 * h * h + 3 * h)

    def mtp_expert_params(self) -> float:
        """The routed experts among mtp_params (shared out by expert parallelism)."""
        if not self.mtp_num_layers:
            return 0.0
        return self.mtp_num_layers * self.mtp_layer_model().expert_params()

    def total_params(self) -> float:
        output = self.output_params()
        if not self.untie_embeddings_and_output_weights:
            output -= self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params() + self.embedding_params() + output + self.mtp_params()

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
        activations for each of the top-k experts a token visits. Selective recomputation of
        other megatron-core modules (hetero/spec/recompute.py) drops what each rebuilds.
        """
        h, s, t, v = self.hidden_size, self.seq_length, tensor_parallel, bytes_per_value
        tokens = s * micro_batch_size
        if recompute_mode(recompute) == "full":
            return tokens * v * h / (t if sequence_parallel else 1)
        again = recomputed_modules(recompute)  # selective: what is rebuilt, not kept
        q, k, value = self._attention_widths()
        masks = 2 * h if dropout else 0  # after attention and after the MLP, one byte each
        # Split by TP only with sequence parallelism: two norm inputs, QKV and fc1 inputs
        # (the norms' outputs, which layernorm recomputation discards), dropout masks.
        sequence_part = (2 if "layernorm" in again else 4) * v * h + masks

        def mlp_bytes(ffn: int, activation_recomputed: bool = False) -> float:
            # MLP activation input(s) and fc2 input (the activation's output, which moe_act
            # recomputation discards)
            fc2_input = 0 if activation_recomputed else v * ffn
            if self.swiglu and not fused_kernels:
                return v * 4 * ffn + fc2_input  # fc1 output (2F), SiLU output and up half (F each)
            return v * (2 if self.swiglu else 1) * ffn + fc2_input

        # Split by TP: Q, K, V, attention output, MLP activation input(s), fc2 input. A
        # recomputed (checkpointed) MLP, MoE layer or shared expert keeps only its input.
        mlp = 0.0 if "mlp" in again else mlp_bytes(self.ffn)
        if self.is_moe:
            share = self.moe_layer_fraction
            routed = self.moe_router_topk * mlp_bytes(self.moe_ffn_hidden_size, "moe_act" in again)
            shared = 0.0 if again & {"shared_experts", "moe"} else mlp_bytes(self.shared_expert_ffn)
            moe = 0.0 if "moe" in again else routed + shared
            mlp = share * moe + (1 - share) * mlp
        output = self.num_attention_heads * (self.v_head_dim if self.multi_latent_attention else self.head_dim)
        # mla_up_proj recomputation rebuilds queries, keys and values from their latents.
        attention_inputs = 0 if "mla_up_proj" in again and self.multi_latent_attention else v * (q + k) + v * value
        split = attention_inputs + v * output + mlp
        scores = 0.0
        if not fused_kernels and "core_attn" not in again:
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
        """The fields that are set; MoE/MLA fields only when the model uses them."""
        data = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        for name in _MLA_FIELDS if not self.multi_latent_attention else ():
            data.pop(name, None)
        if data.get("moe_layer_freq") == 1:
            data.pop("moe_layer_freq")
        for name in ("moe_layer_freq", "window_size", "window_attn_skip_freq"):
            if isinstance(data.get(name), tuple):
                data[name] = list(data[name])
        return data


# Fields that mean nothing without multi-latent attention, left out of a dense spec's dict.
_MLA_FIELDS = ("multi_latent_attention", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                        "v_head_dim")


def _gpt(layers: int, hidden: int, heads: int) -> ModelSpec:
    """GPT-3 shapes as in Megatron-LM (Narayanan et al. 2021, table 1)."""
    return ModelSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     seq_length=2048, vocab_size=51200)


def _llama(layers: int, hidden: int, heads: int, ffn: int, groups: int | None = None,
           seq_length: int = 4096, vocab_size: int = 32000) -> ModelSpec:
    """Llama-2 shapes (Touvron et al. 2023): RMSNorm, SwiGLU, RoPE, untied, no biases."""
    return ModelSpec(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq_length,
        vocab_size=vocab_size, ffn_hidden_size=ffn, num_query_groups=groups, swiglu=True,
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
    # Llama 3 / 3.1 (Grattafiori et al. 2024, table 3; 3.1 keeps the shapes, 405B is 3.1's):
    # 8 key/value heads, pre-trained at 8192 tokens, a
    # 128,256-token vocabulary (a multiple of 128: unpadded at TP 1 and 2). RoPE base 500,000
    # (--rotary-base 500000) changes neither shapes nor costs, so the spec does not hold it.
    "llama3-8b": _llama(32, 4096, 32, 14336, groups=8, seq_length=8192, vocab_size=128256),
    "llama3-70b": _llama(80, 8192, 64, 28672, groups=8, seq_length=8192, vocab_size=128256),
    "llama3-405b": _llama(126, 16384, 128, 53248, groups=8, seq_length=8192, vocab_size=128256),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", table 1; the Hugging Face card's
    # config.json): Mistral-7B's layers with 8 SwiGLU experts, top-2; 46.7B parameters.
    "mixtral-8x7b": dataclasses.replace(_llama(32, 4096, 32, 14336, groups=8), num_experts=8,
                                        moe_router_topk=2),
    # Qwen3-30B-A3B (Qwen3 technical report, Yang et al. 2025, table 2; the card's config.json):
    # 48 layers, 32 query / 4 key-value heads of 128, 128 experts of width 768, top-8, no shared
    # expert, 151,936-token vocabulary, untied; 30.5B parameters, 3.3B active. Its QK-norm
    # (2 x 128 weights per layer) is left out.
    "qwen3-30b-a3b": ModelSpec(
        num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
        seq_length=4096, vocab_size=151936, ffn_hidden_size=6144, swiglu=True,
        untie_embeddings_and_output_weights=True, add_bias_linear=False, normalization="RMSNorm",
        position_embedding_type="rope", num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768),
    # Qwen3-235B-A22B (the same report, table 2; the card's config.json): 94 layers of width
    # 4096, 64 query / 4 key-value heads of 128, 128 experts of width 1536, top-8, no shared
    # expert, untied; 235B parameters, 22B active. QK-norm left out as above.
    "qwen3-235b-a22b": ModelSpec(
        num_layers=94, hidden_size=4096, num_attention_heads=64, num_query_groups=4, kv_channels=128,
        seq_length=4096, vocab_size=151936, ffn_hidden_size=12288, swiglu=True,
        untie_embeddings_and_output_weights=True, add_bias_linear=False, normalization="RMSNorm",
        position_embedding_type="rope", num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536),
    # DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437, sections 2 and 4.2; the card's
    # config.json): 61 layers of width 7168, MLA with 128 heads (q rank 1536, kv rank 512,
    # 128 + 64 rotary query/key, 128 value), the first 3 layers dense (FFN 18432), then 256
    # routed experts of 2048 top-8 plus 1 shared expert, chosen within 4 of 8 expert groups
    # (node-limited routing, section 2.1.2), one MTP layer, 129,280 tokens; 671B parameters
    # (+14B for MTP), 37B active.
    "deepseek-v3": ModelSpec(
        num_layers=61, hidden_size=7168, num_attention_heads=128, seq_length=4096, vocab_size=129280,
        ffn_hidden_size=18432, swiglu=True, untie_embeddings_and_output_weights=True, add_bias_linear=False,
        normalization="RMSNorm", position_embedding_type="rope", num_experts=256, moe_router_topk=8,
        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
        moe_router_num_groups=8, moe_router_group_topk=4, moe_layer_freq=(0,) * 3 + (1,) * 58, mtp_num_layers=1, multi_latent_attention=True,
        q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128),
    # gpt-oss-120b (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", table 1; the card's
    # config.json): 36 layers of width 2880, 64 query / 8 key-value heads of 64, a 128-token
    # sliding window on every other layer, 128 experts of width 2880, top-4, biases, untied,
    # 201,088-token vocabulary; 117B parameters, 5.1B active. Its attention sinks (one logit
    # per head) and the clamped SwiGLU change no shapes or costs; YaRN is RoPE to the cost model.
    "gpt-oss-120b": ModelSpec(
        num_layers=36, hidden_size=2880, num_attention_heads=64, num_query_groups=8, kv_channels=64,
        seq_length=4096, vocab_size=201088, ffn_hidden_size=2880, swiglu=True,
        untie_embeddings_and_output_weights=True, add_bias_linear=True, normalization="RMSNorm",
        position_embedding_type="rope", num_experts=128, moe_router_topk=4, moe_ffn_hidden_size=2880,
        window_size=(128, 0), window_attn_skip_freq=2),
    # A DeepSeek-V3-shaped model small enough for a few GPUs or a CPU test: the same features
    # (MLA, first layer dense, routed + shared experts, MTP) at 1/7 of the width.
    "deepseek-v3-proxy": ModelSpec(
        num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=4096, vocab_size=32768,
        ffn_hidden_size=2816, swiglu=True, untie_embeddings_and_output_weights=True, add_bias_linear=False,
        normalization="RMSNorm", position_embedding_type="rope", num_experts=32, moe_router_topk=4,
        moe_ffn_hidden_size=384, moe_shared_expert_intermediate_size=384,
        moe_layer_freq=(0,) + (1,) * 7, mtp_num_layers=1, multi_latent_attention=True,
        q_lora_rank=384, kv_lora_rank=128, qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64),
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
