"""Model spec: the shape of a GPT/Llama/MoE model, with Megatron's field names and defaults.

One ModelSpec owns Megatron-LM's defaults (the FFN width, query groups, head width, position
table), so two specs of the same model compare equal however they were written: a YAML, a
preset (hetero/spec/presets.py), or pretrain_gpt.py's flags (ModelSpec.from_megatron_args).
What the shape costs (FLOPs, parameters, activation bytes) is counted in
hetero/spec/model_costs.py, shared by the runtime (TFLOPS in the log line) and the predictor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hetero.errors import HeteroError
from hetero.spec.megatron_values import moe_layer_freq_of, window_size_of, window_skip_freq_of
from hetero.spec.model_costs import ModelCosts


def megatron_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default FFN width: 4h, or with SwiGLU 2/3 of that rounded down to 64
    (megatron/training/arguments.py, validate_args)."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


@dataclass(frozen=True)
class ModelSpec(ModelCosts):
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

    def mtp_layer_model(self) -> "ModelSpec":
        """This model with every decoder layer of its last layer's kind: what one multi-token-
        prediction layer costs and keeps (megatron-core builds each from the last layer's spec)."""
        if not self.is_moe or self.moe_layer_fraction in (0.0, 1.0):
            return self
        return dataclasses.replace(self, moe_layer_freq=(self.moe_layer_pattern()[-1],) * self.num_layers)

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
