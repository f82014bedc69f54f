"""Declares honoured flags straight from Megatron-LM's facts: its names, dest, default and
value syntax, so a flag arguments/ honours by name cannot drift from Megatron-LM's.

Used for the flags whose whole effect is a megatron-core config field of the same name
(arguments.CONFIG_FIELD_FLAGS): Megatron-LM copies every such args attribute into its config,
and so does model.transformer_config.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

from hetero.errors import HeteroError
from hetero.spec.megatron_values import layer_list_value
from megatron.hetero.flags.facts import MegatronFlag, known_flag_names, megatron_flags


def layer_pattern(text: str | int) -> int | list[int]:
    """Megatron-LM's per-layer pattern syntax (--moe-layer-freq, --no-rope-freq, ...): an
    integer N (every N-th layer), or a list expression of 0/1 built with + and *, such as
    "([1]*3+[0])*2". Evaluated by walking the expression, never by eval."""
    if isinstance(text, int):
        return text
    if "[" not in text:
        return int(text)
    try:
        value = layer_list_value(text)
    except (SyntaxError, ValueError) as error:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a layer pattern: give an integer, or a list expression of 0 and "
            f"1 with + and * such as \"([1]*3+[0])*2\" ({error})") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of layers")
    return value


def int_tuple(text: str) -> tuple[int, ...]:
    """Megatron-LM's tuple syntax (--window-size): "a,b" or "(a,b)"."""
    try:
        return tuple(int(part) for part in text.strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a tuple of integers such as 4096,0") from None


# Megatron-LM's value types by the name its parser gives them (flags/facts).
VALUE_TYPES: dict[str, Callable[[str], Any]] = {
    "int": int, "float": float, "str": str, "moe_freq_type": layer_pattern,
    "no_rope_freq_type": layer_pattern, "la_freq_type": layer_pattern, "tuple_type": int_tuple,
}


def argparse_keywords(flag: MegatronFlag) -> dict[str, Any]:
    """add_argument keywords that give ``flag`` Megatron-LM's dest, default and syntax."""
    keywords: dict[str, Any] = {"dest": flag.dest, "default": flag.default}
    if flag.action in ("store_true", "store_false"):
        keywords["action"] = flag.action
        return keywords
    kind = flag.type or "str"  # argparse's default: the text as given
    if flag.action != "store" or kind not in VALUE_TYPES:
        raise HeteroError(f"{flag.name}: cannot declare a flag of action {flag.action} and type "
                          f"{flag.type} from the facts; define it in arguments/ by hand")
    keywords["type"] = VALUE_TYPES[kind]
    if flag.nargs is not None:
        keywords["nargs"] = flag.nargs
    if flag.choices is not None:
        keywords["choices"] = list(flag.choices)
    return keywords


def declare(group: argparse._ArgumentGroup, names: Sequence[str]) -> None:
    """Adds Megatron-LM's flags ``names`` (first option strings) to ``group``, those the
    Megatron-LM tag in use has (a flag another tag has and this one removed is left out)."""
    by_name = {flag.name: flag for flag in megatron_flags()}
    for name in names:
        flag = by_name.get(name)
        if flag is None:
            if name not in known_flag_names():
                raise KeyError(f"{name} is a flag of no Megatron-LM tag of flags/facts.py")
            continue
        group.add_argument(*flag.option_strings, **argparse_keywords(flag))
