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

    def __bool__(self) -> bool:
        return bool(self.messages)

    def add(self, message: str) -> None:
        self.messages.append(message)

    def attempt(self, check: Callable[..., Any], *check_args: Any) -> tuple[bool, Any]:
        """(whether ``check`` passed, what it returned); its problems are kept."""
        try:
            return True, check(*check_args)
        except ProblemList as problems:
            self.messages += problems.messages
        except HeteroError as err:
            self.messages.append(str(err))
        return False, None

    def raise_if_any(self) -> None:
        if len(self.messages) == 1:  # one problem reads as it always did
            raise HeteroError(self.messages[0])
        if self.messages:
            raise ProblemList(self.messages)
