"""What the words of a bash script stand for, read without running anything.

Expander holds the script's variables, its arguments and the environment, and expands
``$NAME``, ``${NAME}``, arrays (``${NAME[@]}``, ``${NAME[i]}``, ``${#NAME[@]}``), defaults
(``${NAME:-default}`` / ``:=`` / ``:+`` / ``:?``) and ``$((arithmetic))``; it evaluates the
``[ ]``/``[[ ]]`` tests of ``if`` conditions. ``$(command)`` and backticks are not read: a value
that cannot be known raises Unreadable (hetero/spec/shell_words.py). A variable or array set
nowhere (not in the script, its arguments or the environment) expands to nothing, as in bash,
and is noted (``notes``).
"""

from __future__ import annotations

import ast
import operator
import os
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from hetero.spec.shell_words import NAME, Unreadable, closing_bracket, quoted, split_words


@dataclass
class Unknown:
    """A variable set where the reader cannot tell its value (why, and on which line)."""

    reason: str


@dataclass
class Expander:
    """A script's variables and the expansions of its words."""

    path: str
    arguments: Sequence[str]
    environ: Mapping[str, str]
    variables: dict[str, object] = field(default_factory=dict)
    lenient: bool = False
    """In conditions an unset variable is empty, as in bash (``[ -z "$X" ]`` tests that)."""
    line: int = 0
    """The line being read (for the notes)."""
    notes: list[str] = field(default_factory=list)
    """The unset variables expanded outside conditions: 'line N: $NAME ...', each once."""

    def _lookup(self, name: str) -> object:
        if name.isdigit():
            index = int(name)
            if index == 0:
                return self.path
            return self.arguments[index - 1] if index <= len(self.arguments) else None
        if name in ("@", "*"):
            return list(self.arguments)
        if name == "#":
            return str(len(self.arguments))
        if name in self.variables:
            value = self.variables[name]
            if isinstance(value, Unknown):
                raise Unreadable(f"${name} ({value.reason})")
            return value
        return self.environ.get(name)

    def _parameter(self, inner: str) -> str | list[str]:
        match = re.fullmatch(rf"(#?)({NAME}|\d+|[@*#])(?:\[([@*]|\d+)\])?(?:(:?[-=+?])(.*))?", inner, re.S)
        if match is None:
            raise Unreadable(f"${{{inner}}} (a form of expansion hetero-plan does not read)")
        length, name, index, operation, word = match.groups()
        value = self._lookup(name)
        if index is not None and value is not None:
            items = value if isinstance(value, list) else [value]
            if index in "@*":
                value = list(items)
            else:
                value = items[int(index)] if int(index) < len(items) else None
        elif isinstance(value, list) and name not in "@*":
            value = value[0] if value else ""
        if operation:
            unset = value is None or (operation.startswith(":") and value in ("", []))
            kind = operation[-1]
            if kind in "-=" and unset:
                value = self.word_value(word)
                if kind == "=":
                    self.variables[name] = value
            elif kind == "+":
                value = "" if unset else self.word_value(word)
            elif kind == "?" and unset:
                raise Unreadable(f"${name} ({word or 'not set'})")
        if value is None:
            if not self.lenient:
                shown = f"${{{name}[{index}]}}" if index is not None else f"${name}"
                note = (f"line {self.line}: {shown} is set nowhere (not in the script, its arguments or "
                        "the environment): it expands to nothing, as in bash")
                if note not in self.notes:
                    self.notes.append(note)
            value = [] if index is not None and index in "@*" else ""
        if length:
            return str(len(value))
        return value

    def word_value(self, text: str) -> str:
        """A word as the right side of an assignment or a default: expanded, unquoted, whole."""
        return " ".join(split_words(self.expand(text)))

    def _arithmetic(self, text: str) -> str:
        expression = self.expand(text)
        expression = re.sub(NAME, lambda m: str(self._integer(m.group(0))), expression)
        try:
            return str(_evaluate(ast.parse(expression.strip(), mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError, KeyError):
            raise Unreadable(f"$(({text})) (not integer arithmetic hetero-plan reads)") from None

    def _integer(self, name: str) -> int:
        value = self._lookup(name)
        value = value[0] if isinstance(value, list) and value else value
        try:
            return int(value or 0)
        except ValueError:
            raise Unreadable(f"${name} ({value!r} is not an integer)") from None

    def expand(self, text: str) -> str:
        """Shell text with its expansions replaced, quoted so that shlex splits it into the
        words bash would (an unquoted value split at white space, an array's items kept)."""
        out: list[str] = []
        quote = None
        i = 0
        while i < len(text):
            char = text[i]
            if quote == "'":
                quote = None if char == "'" else quote
                out.append(char)
                i += 1
            elif char == "\\" and i + 1 < len(text):
                out.append(text[i:i + 2])
                i += 2
            elif char in "'\"":
                if quote is None:
                    quote = char
                elif quote == char:
                    quote = None
                out.append(char)
                i += 1
            elif char == "`":
                raise Unreadable("`command` (command substitution is not read)")
            elif char == "$" and i + 1 < len(text):
                value, i = self._expansion(text, i)
                out.append(quoted(value, quote == '"'))
            else:
                out.append(char)
                i += 1
        return "".join(out)

    def _expansion(self, text: str, start: int) -> tuple[str | list[str], int]:
        rest = text[start + 1:]
        if rest.startswith("(("):
            end = closing_bracket(text, start + 1, "(", ")")
            return self._arithmetic(text[start + 3:end - 1]), end + 1
        if rest.startswith("("):
            raise Unreadable(f"$({text[start + 2:closing_bracket(text, start + 1, '(', ')')]}) "
                             "(command substitution is not read)")
        if rest.startswith("{"):
            end = closing_bracket(text, start + 1, "{", "}")
            return self._parameter(text[start + 2:end]), end + 1
        match = re.match(rf"{NAME}|\d|[@*#]", rest)
        if match is None:
            return "$", start + 1
        return self._parameter(match.group(0)), start + 1 + match.end()

    def condition(self, text: str) -> bool | None:
        """An ``if`` condition or a test command: its result, None when it cannot be read."""
        self.lenient = True
        try:
            return _test(self, text.strip())
        except Unreadable:
            return None
        finally:
            self.lenient = False


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod,
              ast.Pow: operator.pow, ast.FloorDiv: operator.floordiv}


def _evaluate(node: ast.AST) -> int:
    """bash's integer arithmetic (``/`` truncates) over + - * / % ** and parentheses."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div):
            return int(left / right) if right else left // right
        if type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](left, right)
    raise ValueError("not integer arithmetic")


def _test(reader: Expander, text: str) -> bool:
    """A condition of ``[ ]``/``[[ ]]`` tests joined by && and ||, each maybe negated."""
    parts = re.split(r"\s(\|\||&&)\s", text)
    result = _one_test(reader, parts[0])
    for joint, part in zip(parts[1::2], parts[2::2]):
        result = (result and _one_test(reader, part)) if joint == "&&" else (result or _one_test(reader, part))
    return result


def _one_test(reader: Expander, text: str) -> bool:
    text = text.strip()
    negate = text.startswith("! ")
    if negate:
        text = text[2:].strip()
    match = re.fullmatch(r"\[\[(.*)\]\]|\[(.*)\]", text, re.S)
    if match is None:
        raise Unreadable(f"{text!r} (a condition that is not a [ ] test)")
    words = split_words(reader.expand(match.group(1) if match.group(1) is not None else match.group(2)))
    if words and words[0] == "!":
        negate, words = not negate, words[1:]
    return _evaluate_test(words) != negate


def _evaluate_test(words: list[str]) -> bool:
    if len(words) == 1:
        return words[0] != ""
    if len(words) == 2:
        flag, value = words
        checks = {"-z": lambda: value == "", "-n": lambda: value != "", "-f": lambda: os.path.isfile(value),
                  "-d": lambda: os.path.isdir(value), "-e": lambda: os.path.exists(value)}
        if flag in checks:
            return checks[flag]()
    if len(words) == 3:
        left, op, right = words
        if op in ("==", "="):
            return left == right
        if op == "!=":
            return left != right
        integers = {"-eq": operator.eq, "-ne": operator.ne, "-lt": operator.lt, "-le": operator.le,
                    "-gt": operator.gt, "-ge": operator.ge}
        if op in integers:
            try:
                return integers[op](int(left), int(right))
            except ValueError:
                raise Unreadable(f"[ {' '.join(words)} ] (not integers)") from None
    raise Unreadable(f"[ {' '.join(words)} ] (a test hetero-plan does not read)")
