"""Reading and writing the planning side's files: validation messages that name the field
and the fix, and JSON written atomically (a crash leaves the old file or the new, never a mix)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

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


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    """Writes JSON so that a crash leaves either the old file or the new one, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
