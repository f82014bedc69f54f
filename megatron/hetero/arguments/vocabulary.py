"""The job's tensor-parallel degrees and the vocabulary padding they give."""

from __future__ import annotations

import argparse
import math


def tensor_parallel_sizes(args: argparse.Namespace) -> list[int]:
    """The distinct tensor-parallel degrees of the job's stages (one, unless the plan gives
    stages their own)."""
    return sorted(set(getattr(args, "stage_tensor_parallel_sizes", None) or [args.tensor_model_parallel_size]))


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """Megatron-LM's rule: pad to a multiple of make-vocab-size-divisible-by x TP. With a
    degree per stage, x the least common multiple of the degrees (the largest, for powers
    of two): every stage then shards the same vocabulary evenly, so every plan of one model
    trains the same model."""
    multiple = args.make_vocab_size_divisible_by * math.lcm(*tensor_parallel_sizes(args))
    return int(math.ceil(vocab_size / multiple) * multiple)


def vocab_divisor_giving(padded: int, vocab_size: int, args: argparse.Namespace) -> int | None:
    """The --make-vocab-size-divisible-by that pads vocab_size to ``padded`` under this run's
    tensor-parallel degrees (this run's own value first, then Megatron-LM's usual ones), or
    None when none does (another tokenizer)."""
    multiple = math.lcm(*tensor_parallel_sizes(args))
    for divisor in (args.make_vocab_size_divisible_by, 128, 64, 256, 32, 512, 16, 8, 1024, 4, 2, 1):
        step = divisor * multiple
        if padded % step == 0 and padded - step < vocab_size <= padded:
            return divisor
    return None
