"""Every problem of a launch at once: checks that do not depend on each other all run, and
what they find is raised as one HeteroError.

A launch script with five mistakes is told all five in one launch, not one per launch. Used by
start-up (``startup.configure``: the flags, the plan, the devices, the files) and inside a
step that holds several independent checks (``arguments.validate_args``). Torch-free.
"""

from __future__ import annotations

from typing import Any, Callable

from hetero.errors import HeteroError


class ProblemList(HeteroError):
    """Several problems, numbered, each with its fix."""

    def __init__(self, messages: list[str]):
        self.messages = list(messages)
        numbered = [f"{i}. " + m.replace("\n", "\n     ") for i, m in enumerate(self.messages, 1)]
        super().__init__(f"{len(numbered)} problems with this launch (each with its fix):\n  "
                         + "\n  ".join(numbered))


class Problems:
    """Collects the problems of independent checks; ``raise_if_any`` raises them together.

    A check that cannot run because one it needs failed is the caller's to skip (``attempt``
    says whether a check passed)."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._refusals = 0  # the first messages refuse a flag: listed before the others

    def __bool__(self) -> bool:
        return bool(self.messages)

    def add(self, message: str, refusal: bool = False) -> None:
        """Keeps a problem; a ``refusal`` (a flag or value this runtime does not run) goes
        before every problem of the layout or the plan, since it stops the launch whatever
        the layout: the first message is the one to fix first."""
        if refusal:
            self.messages.insert(self._refusals, message)
            self._refusals += 1
        else:
            self.messages.append(message)

    def attempt(self, check: Callable[..., Any], *check_args: Any, refusal: bool = False) -> tuple[bool, Any]:
        """(whether ``check`` passed, what it returned); its problems are kept (``refusal``:
        as in ``add``)."""
        try:
            return True, check(*check_args)
        except ProblemList as problems:
            for message in problems.messages:
                self.add(message, refusal)
        except HeteroError as err:
            self.add(str(err), refusal)
        return False, None

    def raise_if_any(self) -> None:
        if len(self.messages) == 1:  # one problem reads as it always did
            raise HeteroError(self.messages[0])
        if self.messages:
            raise ProblemList(self.messages)
