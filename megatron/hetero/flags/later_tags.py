"""The runtime's reading of the flags under a later Megatron-LM tag than the reference one.

The runtime reads the flags by the reference tag's dests (core_v0.16.1's). A later tag
removed some (Megatron-LM then runs as their default did) and renamed a few into their
negations; after parsing, each reference dest a later tag lacks is set from the flag that
replaced it, or to the reference default.
"""

from __future__ import annotations

import argparse

from megatron.hetero.flags.facts import FACTS_FILES, megatron_flags

# Reference dest -> (later dest, whether the later flag is its negation).
RENAMED: dict[str, tuple[str, bool]] = {
    "tokenizer_hf_use_fast": ("tokenizer_hf_no_use_fast", True),
    "tokenizer_hf_include_special_tokens": ("tokenizer_hf_no_include_special_tokens", True),
}


def fill_reference_dests(args: argparse.Namespace) -> None:
    """Sets every dest of the reference tag that ``args`` (parsed under a later tag) lacks."""
    reference = next(iter(FACTS_FILES))
    for flag in megatron_flags(reference):
        if hasattr(args, flag.dest):
            continue
        later, negated = RENAMED.get(flag.dest, (None, False))
        if later is not None and hasattr(args, later):
            value = getattr(args, later)
            setattr(args, flag.dest, (not value) if negated else value)
        else:
            setattr(args, flag.dest, flag.default)
