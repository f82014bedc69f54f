"""The pretrain_gpt.py flags of a bash launch script, read the way the script writes them.

Megatron-LM's launch scripts (examples/gpt3, examples/llama, ...) keep the flags in variables
and arrays and pass them on one torchrun/python line. Read here, without running anything:

- comments, backslash continuations, ``;``/``&&``/``||``/``|`` between commands;
- assignments: ``NAME=value``, ``export``/``declare``/``local`` ones, arrays ``NAME=( ... )``
  (one item or many a line, comments between), ``NAME+=( ... )`` and ``NAME+=value``;
- expansions: ``$NAME``, ``${NAME}``, ``${NAME[@]}`` / ``"${NAME[@]}"``, ``${NAME[i]}``,
  ``${#NAME[@]}``, ``${NAME:-default}`` / ``:=`` / ``:+``, ``$((arithmetic))``, the script's
  arguments ``$1`` ... ``$@`` (what follows ``--`` on the hetero-plan line), and variables of
  the environment hetero-plan runs in;
- ``if``/``elif``/``else`` whose conditions are ``[ ]``/``[[ ]]`` tests of strings, integers
  and files (``==``, ``!=``, ``-z``, ``-n``, ``-eq`` ..., ``-f``, ``-d``, ``-e``, ``!``, ``&&``,
  ``||``), and such a test before ``&&``/``||`` (other commands are taken to succeed);
- the command whose program word expands to a path ending in ``pretrain_gpt.py``: its
  arguments, up to redirections.

Not read: ``$(command)`` and backticks, loops, ``case``, functions, ``source``d files. A
variable set there (or an unset one) is an error only when the pretrain_gpt.py line uses it,
and the error names it with the line it was set on.
"""

from __future__ import annotations

import ast
import operator
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from hetero.errors import HeteroError

PROGRAM = "pretrain_gpt.py"
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_EMPTY = "\x00empty\x00"  # an empty "${ARRAY[@]}": no word at all, not an empty one
# Commands that may name pretrain_gpt.py without running it.
_NOT_LAUNCHERS = ("echo", "printf", ":", "[", "[[", "test", "ls", "cat", "cd", "mkdir", "rm", "cp", "mv", "exit")
_UNREADABLE_BLOCKS = ("for", "while", "until", "case", "select", "function")


class _Unreadable(Exception):
    """A value the reader cannot know; raised only when the pretrain_gpt.py line needs it."""


@dataclass
class _Unknown:
    reason: str


@dataclass
class _Line:
    text: str
    number: int


@dataclass
class _Block:
    """An if/elif/else in progress: whether its branch runs (None: cannot tell)."""

    taking: bool | None
    taken: bool | None = False
    line: int = 0


@dataclass
class _Reader:
    path: str
    arguments: Sequence[str]
    environ: Mapping[str, str]
    variables: dict[str, object] = field(default_factory=dict)
    blocks: list = field(default_factory=list)
    status: bool | None = True
    """Whether the last command succeeded (a test's result; other commands are taken to succeed)."""
    lenient: bool = False
    """In conditions an unset variable is empty, as in bash (``[ -z "$X" ]`` tests that)."""
    found: list[tuple[int, list[str]]] = field(default_factory=list)

    # ----- values ------------------------------------------------------------------------

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
            if isinstance(value, _Unknown):
                raise _Unreadable(f"${name} ({value.reason})")
            return value
        return self.environ.get(name)

    def _parameter(self, inner: str) -> str | list[str]:
        match = re.fullmatch(rf"(#?)({_NAME}|\d+|[@*#])(?:\[([@*]|\d+)\])?(?:(:?[-=+?])(.*))?", inner, re.S)
        if match is None:
            raise _Unreadable(f"${{{inner}}} (a form of expansion hetero-plan does not read)")
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
                value = self._word(word)
                if kind == "=":
                    self.variables[name] = value
            elif kind == "+":
                value = "" if unset else self._word(word)
            elif kind == "?" and unset:
                raise _Unreadable(f"${name} ({word or 'not set'})")
        if value is None and self.lenient:
            value = ""
        if value is None:
            raise _Unreadable(f"${name} (not set in the script, its arguments or the environment)")
        if length:
            return str(len(value))
        return value

    def _word(self, text: str) -> str:
        """A word as the right side of an assignment or a default: expanded, unquoted, whole."""
        return " ".join(_split(self.expand(text)))

    def _arithmetic(self, text: str) -> str:
        expression = self.expand(text)
        expression = re.sub(_NAME, lambda m: str(self._integer(m.group(0))), expression)
        try:
            return str(_evaluate(ast.parse(expression.strip(), mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError, KeyError):
            raise _Unreadable(f"$(({text})) (not integer arithmetic hetero-plan reads)") from None

    def _integer(self, name: str) -> int:
        value = self._lookup(name)
        value = value[0] if isinstance(value, list) and value else value
        try:
            return int(value or 0)
        except ValueError:
            raise _Unreadable(f"${name} ({value!r} is not an integer)") from None

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
                raise _Unreadable("`command` (command substitution is not read)")
            elif char == "$" and i + 1 < len(text):
                value, i = self._expansion(text, i)
                out.append(_quoted(value, quote == '"'))
            else:
                out.append(char)
                i += 1
        return "".join(out)

    def _expansion(self, text: str, start: int) -> tuple[str | list[str], int]:
        rest = text[start + 1:]
        if rest.startswith("(("):
            end = _closing(text, start + 1, "(", ")")
            return self._arithmetic(text[start + 3:end - 1]), end + 1
        if rest.startswith("("):
            raise _Unreadable(f"$({text[start + 2:_closing(text, start + 1, '(', ')')]}) "
                              "(command substitution is not read)")
        if rest.startswith("{"):
            end = _closing(text, start + 1, "{", "}")
            return self._parameter(text[start + 2:end]), end + 1
        match = re.match(rf"{_NAME}|\d|[@*#]", rest)
        if match is None:
            return "$", start + 1
        return self._parameter(match.group(0)), start + 1 + match.end()

    # ----- statements --------------------------------------------------------------------

    def _running(self, blocks: list | None = None) -> bool | None:
        """True when the current block runs, False when it does not, None when unknown."""
        state: bool | None = True
        for block in self.blocks if blocks is None else blocks:
            if block.taking is False:
                return False
            if block.taking is None:
                state = None
        return state

    def run(self, text: str, number: int, after: str) -> None:
        """A statement, after ``&&`` or ``||`` only as the status before it decides."""
        if after in ("&&", "||") and self._running() is not False:
            runs = None if self.status is None else (self.status if after == "&&" else not self.status)
            if runs is False:
                return  # the list's status stays what decided it
            if runs is None:
                self.blocks.append(_Block(None, None, number))
                self.statement(text, number)
                self.blocks.pop()
                return
        self.statement(text, number)

    def statement(self, text: str, number: int) -> None:
        words = text.split(None, 1)
        if not words:
            return
        keyword, rest = words[0], words[1] if len(words) > 1 else ""
        if keyword in ("then", "do", "else", "{") and rest:
            if keyword == "else":
                self._else(number)
            return self.statement(rest, number)
        if keyword in ("if", "elif"):
            enclosing = self.blocks if keyword == "if" else self.blocks[:-1]
            taking = self._condition(rest) if self._running(enclosing) is not False else False
            if keyword == "if":
                self.blocks.append(_Block(taking, taking, number))
            elif self.blocks:
                block = self.blocks[-1]
                block.taking = False if block.taken else (None if block.taken is None else taking)
                block.taken = None if None in (block.taken, taking) else (block.taken or taking)
            return None
        if keyword == "else":
            return self._else(number)
        if keyword in ("fi", "done", "esac", "}"):
            if self.blocks:
                self.blocks.pop()
            return None
        if keyword in _UNREADABLE_BLOCKS or re.match(rf"{_NAME}\s*\(\)", text):
            self.blocks.append(_Block(None, None, number))
            return None
        if self._running() is False:
            return None
        self._command(text, number)

    def _else(self, number: int) -> None:
        if self.blocks:
            block = self.blocks[-1]
            block.taking = None if block.taken is None else not block.taken

    def _condition(self, text: str) -> bool | None:
        self.lenient = True
        try:
            return _test(self, text.strip())
        except _Unreadable:
            return None
        finally:
            self.lenient = False

    def _command(self, text: str, number: int) -> None:
        text = re.sub(r"^(export|declare|local|readonly|typeset)((\s+-\w+)*)\s+", "", text)
        words = _raw_words(text)
        if words and words[0] in ("[", "[[", "test"):
            self.status = self._condition(text if words[0] != "test" else f"[ {text[4:]} ]")
            return
        self.status = True
        while words:
            match = re.match(rf"({_NAME})(\+?)=(.*)", words[0], re.S)
            if match is None:
                break
            name, append, value = match.groups()
            self._assign(name, append == "+", value, number)
            words = words[1:]
        if words and words[0] not in _NOT_LAUNCHERS:
            self._maybe_pretrain(words, number)

    def _assign(self, name: str, append: bool, value: str, number: int) -> None:
        if self._running() is None:
            self.variables[name] = _Unknown(f"set on line {number} under a condition hetero-plan "
                                            "cannot evaluate")
            return
        try:
            if value.startswith("("):
                new: object = _split(self.expand(value[1:-1]))
            else:
                new = self._word(value)
        except _Unreadable as why:
            self.variables[name] = _Unknown(f"set on line {number} from {why}")
            return
        if append:
            old = self.variables.get(name, self.environ.get(name))
            if isinstance(old, _Unknown):
                return
            if isinstance(new, list):
                new = [*(old if isinstance(old, list) else [old] if old else []), *new]
            else:
                new = (old[0] if isinstance(old, list) and old else old or "") + new
        self.variables[name] = new

    def _maybe_pretrain(self, words: list[str], number: int) -> None:
        for index, word in enumerate(words):
            try:
                program = _split(self.expand(word))
            except _Unreadable:
                continue
            if program and program[-1].endswith(PROGRAM) and (program[-1] == PROGRAM or
                                                              program[-1].endswith("/" + PROGRAM)):
                self._pretrain(words[index + 1:], number)
                return

    def _pretrain(self, words: list[str], number: int) -> None:
        arguments: list[str] = []
        problems: list[str] = []
        for word in words:
            if re.fullmatch(r"\d*(>>?|<|&>)(&\d+|.*)?|\d*>&\d+", word):
                break  # redirections end the arguments
            try:
                arguments += _split(self.expand(word))
            except _Unreadable as why:
                problems.append(str(why))
        if problems:
            raise HeteroError(
                f"{self.path}:{number}: the {PROGRAM} line uses what hetero-plan cannot read: "
                f"{'; '.join(dict.fromkeys(problems))}. Export the variable, pass the script's "
                "arguments after `--`, or write the value into the script")
        if self._running() is None:
            raise HeteroError(f"{self.path}:{number}: the {PROGRAM} line runs under a condition hetero-plan "
                              "cannot evaluate (a loop, case, function or unread test); move it out")
        self.found.append((number, arguments))


def _closing(text: str, start: int, opening: str, closing: str) -> int:
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
    raise _Unreadable(f"{text[start:start + 40]!r} (no closing {closing!r})")


def _quoted(value: str | list[str], in_double_quotes: bool) -> str:
    if isinstance(value, list):
        # "${A[@]}": one word per item; ${A[@]}: each item split at white space, as bash does
        items = value if in_double_quotes else [part for item in value for part in item.split()]
        words = " ".join(shlex.quote(item) for item in items) if items else _EMPTY
        return f'"{words}"' if in_double_quotes else words  # closes and reopens the quotes
    if in_double_quotes:
        return value.replace("\\", "\\\\").replace('"', '\\"')
    return " ".join(shlex.quote(part) for part in value.split())


def _split(text: str) -> list[str]:
    try:
        words = shlex.split(text, comments=False, posix=True)
    except ValueError as err:
        raise _Unreadable(f"{text[:60]!r} ({err})") from None
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


def _raw_words(text: str) -> list[str]:
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


def _test(reader: _Reader, text: str) -> bool:
    """A condition of ``[ ]``/``[[ ]]`` tests joined by && and ||, each maybe negated."""
    parts = re.split(r"\s(\|\||&&)\s", text)
    result = _one_test(reader, parts[0])
    for joint, part in zip(parts[1::2], parts[2::2]):
        result = (result and _one_test(reader, part)) if joint == "&&" else (result or _one_test(reader, part))
    return result


def _one_test(reader: _Reader, text: str) -> bool:
    text = text.strip()
    negate = text.startswith("! ")
    if negate:
        text = text[2:].strip()
    match = re.fullmatch(r"\[\[(.*)\]\]|\[(.*)\]", text, re.S)
    if match is None:
        raise _Unreadable(f"{text!r} (a condition that is not a [ ] test)")
    words = _split(reader.expand(match.group(1) if match.group(1) is not None else match.group(2)))
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
                raise _Unreadable(f"[ {' '.join(words)} ] (not integers)") from None
    raise _Unreadable(f"[ {' '.join(words)} ] (a test hetero-plan does not read)")


def _logical_lines(text: str) -> list[_Line]:
    """The script as logical lines: comments dropped, continuations and multi-line arrays
    joined, each with its first line's number."""
    lines: list[_Line] = []
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
            lines.append(_Line("".join(current), start))
            current, start = [], number
            i += 1
            continue
        current.append(" " if char == "\n" and not quote else char)
        i += 1
    lines.append(_Line("".join(current), start))
    return [line for line in lines if line.text.strip()]


def _statements(line: str) -> list[tuple[str, str]]:
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


def pretrain_flags_of_script(path: str | os.PathLike, arguments: Sequence[str] = (),
                             environ: Mapping[str, str] | None = None) -> list[str]:
    """The arguments the launch script at ``path`` passes to pretrain_gpt.py when run with
    ``arguments`` in ``environ`` (default: this process's environment)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise HeteroError(f"--megatron-script {path}: {err.strerror or err}") from None
    reader = _Reader(str(path), list(arguments), dict(os.environ if environ is None else environ))
    for line in _logical_lines(text):
        for statement, after in _statements(line.text):
            reader.run(statement, line.number, after)
    if not reader.found:
        raise HeteroError(
            f"{path}: no command runs {PROGRAM} (hetero-plan reads the arguments of the line whose "
            f"program is .../{PROGRAM}); give the flags after `--` instead")
    if len(reader.found) > 1:
        lines = ", ".join(str(number) for number, _ in reader.found)
        raise HeteroError(f"{path}: {PROGRAM} runs on several lines ({lines}); keep one, or give the flags "
                          "after `--` instead")
    return reader.found[0][1]
