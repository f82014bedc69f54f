"""Structured records of what a job did, written by one layer and read by another.

The human log keeps Megatron-LM's format, for people and their own parsers. A program that
acts on what happened - the elastic supervisor finding the lost hosts, a bench reading
iteration times - reads these records instead, so that rewording a log message cannot
break it.

Where: the directory in HETERO_EVENTS_DIR (hetero.env); unset, nothing is written. Each
process appends one JSON object per line to its own file there, ``rank-<launch rank>.jsonl``,
so no two processes write one file; ``read_events`` merges a directory's files in time order.
A directory holds one run: whoever sets the variable gives every run (every elastic attempt)
a fresh one.

    {"kind": "iteration", "time": 1764000000.5, "launch_rank": 3, "iteration": 7, ...}

Writers: megatron.hetero.training (Iteration, Memory), megatron.hetero.checkpointing
(CheckpointSaved, CheckpointLoaded), megatron.hetero.watchdog (LostRanks, Stopped).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import ClassVar, Iterable, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hetero import env
from hetero.errors import HeteroError


class EventsError(HeteroError):
    """An events file that is not what hetero.events writes."""


class Event(BaseModel):
    """Every record: its kind, when (Unix seconds) and which launch rank wrote it."""

    # Unknown fields are ignored: a reader keeps working with records of a newer writer.
    model_config = ConfigDict(frozen=True, extra="ignore")

    kind: str
    time: float = Field(default_factory=time.time)
    launch_rank: int = Field(default_factory=lambda: env.launch_rank())

    KINDS: ClassVar[dict[str, type["Event"]]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kind = cls.model_fields["kind"].default
        if isinstance(kind, str):
            Event.KINDS[kind] = cls

    def to_json(self) -> str:
        # json, not pydantic's JSON mode: a NaN loss stays NaN (pydantic writes null).
        return json.dumps(self.model_dump(), separators=(",", ":"))


class Iteration(Event):
    """One line of the training log (the last rank's): means over the log interval that
    ends at ``iteration``."""

    kind: Literal["iteration"] = "iteration"
    iteration: int
    train_iters: int
    consumed_samples: int
    interval: int  # iterations the means cover (--log-interval, or fewer at an exit)
    elapsed_s: float  # per iteration
    tokens_per_s: float
    tflops_per_device: float | None = None
    learning_rate: float
    global_batch_size: int
    losses: dict[str, float]  # e.g. {"lm loss": 6.9}; empty when every iteration was skipped
    loss_scale: float
    grad_norm: float | None = None
    params_norm: float | None = None
    num_zeros: int | None = None
    skipped: int = 0
    nan: int = 0


class Memory(Event):
    """A rank's memory after ``iteration`` (one rank per pipeline stage): the accelerator's
    allocator figures, or on the CPU the process's peak resident memory and the mapped files
    in it."""

    kind: Literal["memory"] = "memory"
    logical_rank: int
    iteration: int
    allocated_mb: float | None = None
    max_allocated_mb: float | None = None
    reserved_mb: float | None = None
    max_reserved_mb: float | None = None
    max_rss_mb: float | None = None
    mapped_files_mb: float | None = None

    @property
    def peak_mb(self) -> float:
        """The job's own peak: max allocated, or on the CPU max rss less the mapped files
        (the libraries' pages, which depend on the page cache, not on the job)."""
        if self.max_allocated_mb is not None:
            return self.max_allocated_mb
        return (self.max_rss_mb or 0.0) - (self.mapped_files_mb or 0.0)


class CheckpointSaved(Event):
    kind: Literal["checkpoint_saved"] = "checkpoint_saved"
    iteration: int
    directory: str  # the --save root; the checkpoint is its iter_<iteration> directory


class CheckpointLoaded(Event):
    kind: Literal["checkpoint_loaded"] = "checkpoint_loaded"
    iteration: int
    directory: str


class StateRestored(Event):
    """After an in-process restart (a re-plan of the running job): where the state came
    from - ``memory`` (the survivors' snapshots, no file read), ``disk`` (every copy of some
    shard was on lost nodes: the last checkpoint) or ``none`` (no checkpoint either: from
    the start) - and of which iteration."""

    kind: Literal["state_restored"] = "state_restored"
    epoch: int
    iteration: int
    source: Literal["memory", "disk", "none"]
    seconds: float
    detail: str = ""


class SnapshotCost(Event):
    """What keeping the state in memory cost this rank (--inprocess-restart), at the end of
    its training: the time of each snapshot (taking and copying), and the host memory its
    snapshots and the copies it keeps for others held."""

    kind: Literal["snapshot_cost"] = "snapshot_cost"
    seconds: list[float]
    host_bytes: int


class LostRank(BaseModel):
    """A process of the job found gone (or frozen) by another."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    launch_rank: int
    logical_rank: int
    host: str  # as the lost process named its host (HETERO_EMULATED_HOST or the machine's)
    pid: int
    why: str


class LostRanks(Event):
    """Written by a rank that stops because others are lost (the watchdog), just before it
    exits: the ranks, by launch rank, and the reporter's host."""

    kind: Literal["lost_ranks"] = "lost_ranks"
    host: str
    lost: list[LostRank]
    cause: str  # what made the reporter look (a neighbour's silence, a library error)

    @property
    def lost_launch_ranks(self) -> list[int]:
        return [r.launch_rank for r in self.lost]


class Stopped(Event):
    """A rank stopped with no process of the job lost: a signal, another rank's error, or
    its own launcher or the job's store gone (``alone``)."""

    kind: Literal["stopped"] = "stopped"
    cause: str
    signal: str | None = None
    alone: bool = False


# ----- writing ----------------------------------------------------------------------------------

_warned: set[str] = set()


def events_file(directory: str | os.PathLike, launch_rank: int) -> Path:
    return Path(directory) / f"rank-{launch_rank}.jsonl"


def emit(event: Event, directory: str | os.PathLike | None = None) -> bool:
    """Appends event to its launch rank's file in directory (default: HETERO_EVENTS_DIR);
    False when there is none or it cannot be written (said once on stderr: a job does not
    stop for its records)."""
    directory = directory if directory is not None else env.events_dir()
    if not directory:
        return False
    path = events_file(directory, event.launch_rank)
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        # One write of one line, appended: safe to call from any thread, and from a process
        # about to os._exit (no buffer left unflushed).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (event.to_json() + "\n").encode())
        finally:
            os.close(fd)
    except OSError as err:
        if str(path) not in _warned:
            _warned.add(str(path))
            sys.stderr.write(f"WARNING: cannot write events to {path} ({err}); fix {env.EVENTS_DIR} "
                             "or its permissions\n")
        return False
    return True


# ----- reading ----------------------------------------------------------------------------------

E = TypeVar("E", bound=Event)


def parse_line(line: str, where: str = "an events line") -> Event | None:
    """One record; None for a kind this version does not know (a newer writer's)."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise EventsError(f"{where} is not JSON ({err}); an events directory holds only the "
                          "rank-*.jsonl files that hetero.events writes") from None
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
        raise EventsError(f"{where} is not an event (no \"kind\"); an events directory holds only "
                          "the rank-*.jsonl files that hetero.events writes")
    cls = Event.KINDS.get(data["kind"])
    if cls is None:
        return None
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in err.errors())
        raise EventsError(f"{where} is not a valid {data['kind']} event ({problems})") from None


def read_file(path: str | os.PathLike) -> list[Event]:
    """The records of one file. A last line without its newline (a process killed while
    writing it) is left out."""
    text = Path(path).read_text(errors="replace")
    lines = text.split("\n")
    complete = lines[:-1]  # after the last newline: nothing, or a line cut short
    found = []
    for number, line in enumerate(complete, 1):
        if line.strip():
            event = parse_line(line, f"{path}:{number}")
            if event is not None:
                found.append(event)
    return found


def read_events(directory: str | os.PathLike | None) -> list[Event]:
    """Every record of a directory's files, in time order (a rank's own in the order it
    wrote them); [] when the directory does not exist (the job wrote none)."""
    if directory is None or not Path(directory).is_dir():
        return []
    keyed = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for order, event in enumerate(read_file(path)):
            keyed.append(((event.time, event.launch_rank, order), event))
    return [event for _, event in sorted(keyed, key=lambda item: item[0])]


def of_kind(events: Iterable[Event], kind: type[E]) -> list[E]:
    return [e for e in events if isinstance(e, kind)]


def iteration_times_s(events: Iterable[Event]) -> list[float]:
    """Every logged iteration time (each the mean over its log interval), in order."""
    return [e.elapsed_s for e in of_kind(events, Iteration)]


def losses(events: Iterable[Event], name: str = "lm loss") -> dict[int, float]:
    """iteration -> the logged loss (a mean over the log interval ending there)."""
    return {e.iteration: e.losses[name] for e in of_kind(events, Iteration) if name in e.losses}
