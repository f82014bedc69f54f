"""A checkpoint directory: the tracker, the iterations, each one's manifest.

    DIR/latest_checkpointed_iteration.txt     the last complete checkpoint's iteration
    DIR/iter_0000010/                         megatron-core dist checkpoint (torch_dist)
    DIR/iter_0000010/hetero_plan.json         the plan that wrote it
    DIR/iter_0000010/hetero_manifest.json     every file with its size and checksum, written last

megatron-core's distributed checkpoint has no way to tell a complete file from one cut
short by a full disk, a killed writer or a bad copy: loading such a file fails deep in
torch's unpickler, or worse, succeeds with garbage. The manifest is written into the
staging directory after every rank's data is on disk and before the directory is renamed
into place, so a checkpoint without one was never finished, and a file that differs from
it is damaged. CRC-32 (zlib) rather than a cryptographic hash: it catches truncation and
corruption at disk speed.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from hetero.errors import HeteroError
from hetero.io import write_json_atomic

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "hetero_manifest.json"
_CHUNK = 1 << 20


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | os.PathLike) -> int | None:
    """The iteration of the last complete checkpoint under root, or None if there is none."""
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise HeteroError(f"{tracker} should hold an iteration number, found {text!r}") from None
    if not is_complete(iteration_dir(root, iteration)):
        raise HeteroError(
            f"{tracker} names iteration {iteration} but {iteration_dir(root, iteration)} is not a "
            "complete checkpoint; restore it or point --load at another directory"
        )
    return iteration


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path) -> None:
    entries = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "crc32": _crc32(p)}
               for p in _files(directory)}
    write_json_atomic(directory / MANIFEST, {"version": 1, "files": entries})


def verify_manifest(directory: Path, iteration: int, older: list[int]) -> bool:
    """Raises a HeteroError naming the iteration and the damaged file; False when the
    checkpoint predates manifests (nothing to check against)."""
    path = directory / MANIFEST
    if not path.exists():
        return False
    hint = (f"load an older one with --ckpt-step N (complete: {', '.join(map(str, older))})"
            if older else "no older checkpoint is left in that directory")
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as err:
        raise HeteroError(f"checkpoint iteration {iteration} ({directory}): its manifest is unreadable "
                          f"({err}); {hint}") from None
    for name, expected in files.items():
        file = directory / name
        if not file.is_file():
            problem = "is missing"
        elif (size := file.stat().st_size) != expected["bytes"]:
            problem = f"has {size} bytes, {expected['bytes']} were written (truncated or overwritten)"
        elif _crc32(file) != expected["crc32"]:
            problem = "does not match its checksum (corrupted)"
        else:
            continue
        raise HeteroError(f"checkpoint iteration {iteration} in {directory.parent} is damaged: {name} "
                          f"{problem}; {hint}")
    return True


def is_complete(directory: Path) -> bool:
    """A finished save: megatron-core's metadata.json (torch_dist), or Megatron-LM's legacy
    per-rank files (--ckpt-format torch)."""
    return (directory / "metadata.json").exists() or any(directory.glob("mp_rank_*/model_optim_rng.pt"))


def complete_iterations(root: Path) -> list[int]:
    """Iterations under root that were renamed into place (finished saves), newest first."""
    found = []
    for entry in root.glob("iter_*"):
        suffix = entry.name[len("iter_"):]
        if suffix.isdigit() and is_complete(entry):
            found.append(int(suffix))
    return sorted(found, reverse=True)


def fsync_tree(directory: Path) -> None:
    """Data and directory entries on disk before the rename that publishes them."""
    for file in _files(directory) + [directory / MANIFEST]:
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
