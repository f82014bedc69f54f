"""Megatron-LM's syntax for the values of its per-layer model flags, read without eval.

--moe-layer-freq and --window-attn-skip-freq take an integer or a Python list expression such
as "([0]*3+[1]*58)"; --window-size takes a pair such as "(128,0)". ModelSpec reads its fields
with these (hetero/spec/model.py); the runtime's flag declarations
(megatron/hetero/flags/declare.py) read per-layer patterns with layer_list_value.
"""

from __future__ import annotations

import ast

from hetero.errors import HeteroError


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
