"""The models of the papers we compare with, by name, and load_model: a preset or a YAML file.

Any other shape comes from a YAML file with ModelSpec's (Megatron's) field names.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from hetero.errors import HeteroError
from hetero.io import describe_validation_error
from hetero.spec.model import ModelSpec


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
