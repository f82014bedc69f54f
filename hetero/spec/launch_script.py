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
variable set there is an error only when the pretrain_gpt.py line uses it, and the error names
it with the line it was set on. A variable or array set nowhere expands to nothing, as bash
expands it, and is noted (``notes`` of pretrain_flags_of_script).

This module runs the statements (if/elif/else blocks, ``&&``/``||``, assignments) and finds the
pretrain_gpt.py line; the script's text is split into lines, statements and words by
hetero/spec/shell_words.py, and its words are expanded by hetero/spec/shell_expansion.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from hetero.errors import HeteroError
from hetero.spec.shell_expansion import Expander, Unknown
from hetero.spec.shell_words import NAME, Unreadable, logical_lines, raw_words, split_statements, split_words

PROGRAM = "pretrain_gpt.py"
# Commands that may name pretrain_gpt.py without running it.
_NOT_LAUNCHERS = ("echo", "printf", ":", "[", "[[", "test", "ls", "cat", "cd", "mkdir", "rm", "cp", "mv", "exit")
_UNREADABLE_BLOCKS = ("for", "while", "until", "case", "select", "function")


@dataclass
class _Block:
    """An if/elif/else in progress: whether its branch runs (None: cannot tell)."""

    taking: bool | None
    taken: bool | None = False
    line: int = 0


@dataclass
class _Reader(Expander):
    """The script run statement by statement, without running any command."""

    blocks: list = field(default_factory=list)
    status: bool | None = True
    """Whether the last command succeeded (a test's result; other commands are taken to succeed)."""
    found: list[tuple[int, list[str]]] = field(default_factory=list)

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
        self.line = number
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
            taking = self.condition(rest) if self._running(enclosing) is not False else False
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
        if keyword in _UNREADABLE_BLOCKS or re.match(rf"{NAME}\s*\(\)", text):
            self.blocks.append(_Block(None, None, number))
            return None
        if self._running() is False:
            return None
        self._command(text, number)

    def _else(self, number: int) -> None:
        if self.blocks:
            block = self.blocks[-1]
            block.taking = None if block.taken is None else not block.taken

    def _command(self, text: str, number: int) -> None:
        text = re.sub(r"^(export|declare|local|readonly|typeset)((\s+-\w+)*)\s+", "", text)
        words = raw_words(text)
        if words and words[0] in ("[", "[[", "test"):
            self.status = self.condition(text if words[0] != "test" else f"[ {text[4:]} ]")
            return
        self.status = True
        while words:
            match = re.match(rf"({NAME})(\+?)=(.*)", words[0], re.S)
            if match is None:
                break
            name, append, value = match.groups()
            self._assign(name, append == "+", value, number)
            words = words[1:]
        if words and words[0] not in _NOT_LAUNCHERS:
            self._maybe_pretrain(words, number)

    def _assign(self, name: str, append: bool, value: str, number: int) -> None:
        if self._running() is None:
            self.variables[name] = Unknown(f"set on line {number} under a condition hetero-plan "
                                           "cannot evaluate")
            return
        try:
            if value.startswith("("):
                new: object = split_words(self.expand(value[1:-1]))
            else:
                new = self.word_value(value)
        except Unreadable as why:
            self.variables[name] = Unknown(f"set on line {number} from {why}")
            return
        if append:
            old = self.variables.get(name, self.environ.get(name))
            if isinstance(old, Unknown):
                return
            if isinstance(new, list):
                new = [*(old if isinstance(old, list) else [old] if old else []), *new]
            else:
                new = (old[0] if isinstance(old, list) and old else old or "") + new
        self.variables[name] = new

    def _maybe_pretrain(self, words: list[str], number: int) -> None:
        for index, word in enumerate(words):
            try:
                program = split_words(self.expand(word))
            except Unreadable:
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
                arguments += split_words(self.expand(word))
            except Unreadable as why:
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


def pretrain_flags_of_script(path: str | os.PathLike, arguments: Sequence[str] = (),
                             environ: Mapping[str, str] | None = None,
                             notes: list[str] | None = None) -> list[str]:
    """The arguments the launch script at ``path`` passes to pretrain_gpt.py when run with
    ``arguments`` in ``environ`` (default: this process's environment). ``notes``, when given,
    receives what the user should know ('PATH:LINE: $NAME is set nowhere ...')."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise HeteroError(f"--megatron-script {path}: {err.strerror or err}") from None
    reader = _Reader(str(path), list(arguments), dict(os.environ if environ is None else environ))
    for line in logical_lines(text):
        for statement, after in split_statements(line.text):
            reader.run(statement, line.number, after)
    if not reader.found:
        raise HeteroError(
            f"{path}: no command runs {PROGRAM} (hetero-plan reads the arguments of the line whose "
            f"program is .../{PROGRAM}); give the flags after `--` instead")
    if len(reader.found) > 1:
        lines = ", ".join(str(number) for number, _ in reader.found)
        raise HeteroError(f"{path}: {PROGRAM} runs on several lines ({lines}); keep one, or give the flags "
                          "after `--` instead")
    if notes is not None:
        notes.extend(f"{path}:{note.removeprefix('line ')}" for note in reader.notes)
    return reader.found[0][1]
