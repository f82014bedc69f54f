"""megatron-core calls whose signature or home moved between the releases we run on.

One function per moved API, each working with 0.16.1 and 0.19.x; the rest of the runtime
calls these instead of the megatron-core function. Patches (changes to megatron-core's own
behaviour) stay in patches/; this module only adapts our calls.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any


def batch_on_this_cp_rank(batch: dict, group=None) -> dict:
    """This rank's two load-balanced chunks of every sequence (megatron-core's
    get_batch_on_this_cp_rank) over group (default: the context-parallel group). 0.17+ takes
    (batch, is_hybrid_cp, cp_group) and, without a group, splits over the whole world; 0.16
    took (batch, cp_group=None) and read parallel_state."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    if group is None:
        group = parallel_state.get_context_parallel_group()
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


def core_build_tokenizer():
    """megatron-core's tokenizer factory: megatron.core.tokenizers.utils (0.17+) or
    megatron.core.tokenizers.text.utils (0.16)."""
    try:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    except ModuleNotFoundError:
        from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer
    return build_tokenizer


def tokenizer_options(**options: Any) -> SimpleNamespace:
    """The namespace megatron-core's build_tokenizer reads, under both releases' names:
    0.17+ renamed tokenizer_special_tokens -> special_tokens, tokenizer_metadata ->
    metadata_path, and turned tokenizer_hf_use_fast / tokenizer_hf_include_special_tokens
    into their negations (tokenizer_hf_no_use_fast / ..._no_include_special_tokens); it also
    reads chat_template, pad_vocab_size and the SentencePiece whitespace option."""
    ns = SimpleNamespace(**options)
    ns.special_tokens = options.get("tokenizer_special_tokens")
    ns.metadata_path = options.get("tokenizer_metadata")
    ns.tokenizer_hf_no_use_fast = not options.get("tokenizer_hf_use_fast", True)
    ns.tokenizer_hf_no_include_special_tokens = not options.get("tokenizer_hf_include_special_tokens", False)
    ns.chat_template = options.get("chat_template")
    # Megatron-LM 0.19's default (--no-tokenizer-sentencepiece-ignore-extra-whitespaces turns it off).
    ns.tokenizer_sentencepiece_ignore_extra_whitespaces = options.get(
        "tokenizer_sentencepiece_ignore_extra_whitespaces", True)
    ns.pad_vocab_size = False  # the runtime pads the vocabulary itself (padded_vocab_size)
    return ns


def async_save_options() -> dict:
    """Keyword arguments for dist_checkpointing.save's background writes: 0.17+ defaults to
    nvidia-resiliency-ext's writer (async_strategy="nvrx"); megatron-core's own is "mcore"."""
    from megatron.core import dist_checkpointing

    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}


def write_common_beside(directory) -> None:
    """Rank 0, on a torch_dist checkpoint just written: megatron-core 0.17+ keeps the common
    (non-tensor) state inside the .distcp files, where 0.16 looks for common.pt and fails;
    the same state is also written there, so a 0.16 runtime resumes from it (0.17+ reads
    either: it prefers common.pt when present)."""
    from pathlib import Path

    import torch
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    legacy = directory / "common.pt"
    if legacy.exists() or not (directory / "metadata.json").exists():
        return  # megatron-core 0.16 wrote it, or not a torch_dist checkpoint
    torch.save(dist_checkpointing.load_common_state_dict(str(directory)), legacy)
