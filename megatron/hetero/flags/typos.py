"""Unknown flags, and "did you mean" only for a real typo of a known one."""

from __future__ import annotations

import difflib
import re
from typing import Iterable, Sequence

from megatron.hetero.flags.facts import megatron_tag

# Words that name different units or opposite features: a flag differing from another only
# in one of these is another flag, never a typo of it.
_UNITS = {"iter": "iters", "iters": "iters", "iterations": "iters", "sample": "samples",
          "samples": "samples", "token": "tokens", "tokens": "tokens", "step": "steps",
          "steps": "steps", "epoch": "epochs", "epochs": "epochs", "mins": "minutes",
          "minutes": "minutes", "seconds": "seconds", "secs": "seconds", "gb": "gb", "mb": "mb"}
_DISTINCT = [{"encoder", "decoder"}, {"min", "max"}, {"enable", "disable"}, {"first", "last"},
             {"train", "valid"}, {"save", "load"}, {"fp8", "fp4"}, {"fp16", "bf16"},
             {"start", "end"}, {"input", "output"}, {"lower", "upper"}]


# Words a user may leave out or add without meaning another flag (--tensor-parallel-size).
_FILLER = {"model", "num", "size", "dir", "path", "file"}


def _words(flag: str) -> list[str]:
    return [w for w in re.split(r"[-_]+", flag.lower()) if w]


def _typo_of(word: str, other: str) -> bool:
    if _UNITS.get(word, word) != _UNITS.get(other, other) and (word in _UNITS or other in _UNITS):
        return False
    if {word, other} in _DISTINCT:
        return False
    return difflib.SequenceMatcher(None, word, other).ratio() >= 0.75


def is_typo(given: str, known: str) -> bool:
    """``given`` misspells ``known``: same words but one slightly misspelt, the same letters
    with other separators (``--hidden_size``, ``--hiddensize``), or one filler word missing
    or added (``--tensor-parallel-size``)."""
    a, b = _words(given), _words(known)
    if "".join(a) == "".join(b):
        return True
    if abs(len(a) - len(b)) == 1:
        short, long = sorted((a, b), key=len)
        return any(long[:i] + long[i + 1:] == short and long[i] in _FILLER
                   for i in range(len(long)))
    if len(a) != len(b):
        return False
    differing = [(x, y) for x, y in zip(a, b) if x != y]
    return len(differing) == 1 and _typo_of(*differing[0])


def suggest(given: str, known: Iterable[str]) -> str | None:
    """The known flag ``given`` is a typo of, if exactly one is close."""
    candidates = [k for k in known if is_typo(given, k)]
    if not candidates:
        return None
    return max(candidates, key=lambda k: difflib.SequenceMatcher(None, given, k).ratio())


def unknown_flag_messages(unknown: Sequence[str], known: Iterable[str]) -> list[str]:
    known = sorted(set(known))
    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")]
    lines = []
    for flag in flags or list(unknown):
        close = suggest(flag, known) if flag.startswith("--") else None
        hint = f" (did you mean {close}?)" if close else ""
        lines.append(f"unknown flag {flag}{hint}: not a flag of Megatron-LM's pretrain_gpt.py "
                     f"({megatron_tag()}) nor of Megatron-Hetero")
    return lines


