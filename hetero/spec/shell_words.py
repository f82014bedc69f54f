"""Bash text as bash splits it, before anything is expanded: logical lines, statements, words.

Comments are dropped, backslash continuations and multi-line arrays joined into logical lines;
a line splits into statements at unquoted ``;``/``&&``/``||``/``|``/``&`` and a statement into
words at unquoted white space, with ``${...}``, ``$(...)`` and ``(...)`` kept whole. Expanded
values are quoted back (quoted) so that split_words makes of them the words bash would.
Used by the launch-script reader (hetero/spec/launch_script.py) and its expansions
(hetero/spec/shell_expansion.py).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

NAME = r"[A-Za-z_][A-Za-z0-9_]*"
"""A shell variable's name."""
_EMPTY = "\x00empty\x00"  # an empty "${ARRAY[@]}": no word at all, not an empty one


class Unreadable(Exception):
    """A value the reader cannot know; raised only when the pretrain_gpt.py line needs it."""


@dataclass
class Line:
    """A logical line of the script, with the number of its first physical line."""

    text: str
    number: int


def closing_bracket(text: str, start: int, opening: str, closing: str) -> int:
    """Index of the bracket that closes the one at ``start`` (quotes respected)."""
    depth, quote, i = 0, None, start
    while i < len(text):
        char = text[i]
        if quote:
            if char == quote:
                quote = None
            elif char == "\\" and quote == '"':
                i += 1
        elif char in "'\"":
            quote = char
        elif char == "\\":
            i += 1
        elif char == opening:
            depth += 1
        elif char == closing:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise Unreadable(f"{text[start:start + 40]!r} (no closing {closing!r})")


def quoted(value: str | list[str], in_double_quotes: bool) -> str:
    """An expanded value written back as shell text that split_words splits as bash would."""
    if isinstance(value, list):
        # "${A[@]}": one word per item; ${A[@]}: each item split at white space, as bash does
        items = value if in_double_quotes else [part for item in value for part in item.split()]
        words = " ".join(shlex.quote(item) for item in items) if items else _EMPTY
        return f'"{words}"' if in_double_quotes else words  # closes and reopens the quotes
    if in_double_quotes:
        return value.replace("\\", "\\\\").replace('"', '\\"')
    return " ".join(shlex.quote(part) for part in value.split())


def split_words(text: str) -> list[str]:
    """Shell text (expanded, quoted back) as its words, quotes removed."""
    try:
        words = shlex.split(text, comments=False, posix=True)
    except ValueError as err:
        raise Unreadable(f"{text[:60]!r} ({err})") from None
    return [word.replace(_EMPTY, "") for word in words if word != _EMPTY]


def _top_level(text: str) -> list[bool]:
    """For each character of shell text: whether it stands unescaped, outside quotes and
    outside (...), ${...} and $(...), where white space splits words and ; | & end
    statements (quote, bracket and escape characters themselves are not). A backslash escapes
    the next character outside quotes and inside double quotes; single quotes escape nothing."""
    top, quote, depth, escaped = [], None, 0, False
    for char in text:
        if escaped:
            escaped = False
            top.append(False)
            continue
        if char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "({":
            depth += 1
        elif char in ")}":
            depth -= 1
        else:
            top.append(depth <= 0)
            continue
        top.append(False)
    return top


def raw_words(text: str) -> list[str]:
    """Shell words before expansion: split at unquoted white space, ${...}, $(...) and
    (...) kept whole."""
    words, current = [], []
    for char, top in zip(text, _top_level(text)):
        if top and char.isspace():
            if current:
                words.append("".join(current))
                current = []
            continue
        current.append(char)
    if current:
        words.append("".join(current))
    return words


def logical_lines(text: str) -> list[Line]:
    """The script as logical lines: comments dropped, continuations and multi-line arrays
    joined, each with its first line's number."""
    lines: list[Line] = []
    current: list[str] = []
    quote, depth, number, start, i = None, 0, 1, 1, 0
    while i < len(text):
        char = text[i]
        if char == "\n":
            number += 1
        if quote:
            if char == quote:
                quote = None
            elif char == "\\" and quote == '"' and i + 1 < len(text):
                current.append(text[i:i + 2])
                number += text[i + 1] == "\n"
                i += 2
                continue
        elif char == "\\" and i + 1 < len(text):
            if text[i + 1] == "\n":
                number += 1
                current.append(" ")
            else:
                current.append(text[i:i + 2])
            i += 2
            continue
        elif char in "'\"":
            quote = char
        elif char == "#" and (not current or current[-1].isspace() or current[-1] in "(;"):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif char == "(":  # an array assignment may span lines
            depth += 1
        elif char == ")":
            depth = max(depth - 1, 0)
        elif char == "\n" and depth == 0:
            lines.append(Line("".join(current), start))
            current, start = [], number
            i += 1
            continue
        current.append(" " if char == "\n" and not quote else char)
        i += 1
    lines.append(Line("".join(current), start))
    return [line for line in lines if line.text.strip()]


def split_statements(line: str) -> list[tuple[str, str]]:
    """A logical line split at unquoted ; && || | and & (``if``/``while`` conditions kept
    whole up to their ``then``/``do``): each statement with the joint before it."""
    pieces, current, i = [], [], 0
    top = _top_level(line)
    while i < len(line):
        char = line[i]
        if top[i] and char in ";|&" and not (char == "&" and i and line[i - 1] in "<>"):
            joint = line[i:i + 2] if line[i:i + 2] in ("&&", "||", ";;") else char
            if char == "&" and line[i + 1:i + 2] == ">":  # &> redirection
                current.append(char)
                i += 1
                continue
            pieces.append(("".join(current), joint))
            current = []
            i += len(joint)
            continue
        current.append(char)
        i += 1
    pieces.append(("".join(current), ""))
    statements: list[tuple[str, str]] = []
    condition: list[str] | None = None
    before = condition_before = ""
    for piece, joint in pieces:
        words = piece.split()
        if condition is not None:
            if words and words[0] in ("then", "do"):
                statements.append((" ".join(condition), condition_before))
                condition = None
            else:
                condition += [piece.strip(), joint] if joint in ("&&", "||") else [piece.strip()]
                before = joint
                continue
        if words and words[0] in ("if", "elif", "while", "until") and joint in ("&&", "||"):
            condition, condition_before = [piece.strip(), joint], before
            before = joint
            continue
        statements.append((piece.strip(), before))
        before = joint
    if condition is not None:
        statements.append((" ".join(condition), condition_before))
    return [(text, joint) for text, joint in statements if text]
