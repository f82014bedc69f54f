"""Turning pydantic's validation errors into messages that name the field and the fix."""

from __future__ import annotations

from pydantic import ValidationError


def describe_validation_error(err: ValidationError, source: str, what: str, fix: str) -> str:
    lines = [f"{source} is not a valid {what}:"]
    for problem in err.errors():
        where = "".join(
            f"[{part}]" if isinstance(part, int) else (f".{part}" if i else str(part))
            for i, part in enumerate(problem["loc"])
        )
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "missing":
            message = "required field is missing"
        lines.append(f"  - {where or 'top level'}: {message}")
    lines.append(fix)
    return "\n".join(lines)
