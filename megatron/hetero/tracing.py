"""What a training iteration did on every rank: its timeline, and how busy each rank was.

With HETERO_TRACE_DIR set, iteration HETERO_TRACE_ITERATION (default 3, past warm-up) is
recorded on every rank: each forward and backward of a micro-batch (megatron-core's
schedule functions, wrapped by the "schedule-step-timing" patch), the gradient reduction and the
optimizer step. Each rank writes trace-rank<logical rank>.json there:

    {"rank": 5, "tp_rank": 0, "pp_rank": 1, "dp_rank": 0, "host": "b0", "device_type": "...",
     "spans": [["F", 0, start_s, end_s], ["B", 0, ...], ["reduce", null, ...], ["step", null, ...]],
     "span_cpu_s": [0.081, 0.122, ...]}

Times are seconds from the iteration's start, taken right after a barrier; all ranks of an
emulated cluster share one clock (CLOCK_MONOTONIC). ``span_cpu_s`` is the CPU time the rank's
own thread spent in each span: a step that took longer than its profile, on the same CPU
time, waited (for its CPU quota, a core, a peer); on more, it did more work.

``BUSY`` measures every training iteration on every rank, for ``--hetero-adapt``: the time
from the schedule's start to the gradient reduction, and the forward and backward steps'
total within it.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

from hetero import env


class IterationTrace:
    def __init__(self) -> None:
        self.recording = False
        self.origin = 0.0
        self.spans: list[list] = []
        self.span_cpu: list[float] = []
        self._counts: dict[str, int] = {}

    # Read when asked, not at import: a process forked from one that imported this module
    # (the test suite's launcher) has its own environment.
    @property
    def directory(self) -> str | None:
        return env.trace_dir()

    @property
    def iteration(self) -> int:
        return env.trace_iteration()

    @property
    def enabled(self) -> bool:
        return bool(self.directory)

    def begin(self) -> None:
        self.recording, self.spans, self.span_cpu, self._counts = True, [], [], {}
        self.origin = time.monotonic()

    @contextmanager
    def span(self, kind: str, numbered: bool = False):
        if not self.recording:
            yield
            return
        index = None
        if numbered:
            index = self._counts.get(kind, 0)
            self._counts[kind] = index + 1
        start, cpu = time.monotonic() - self.origin, time.thread_time()
        try:
            yield
        finally:
            self.spans.append([kind, index, start, time.monotonic() - self.origin])
            self.span_cpu.append(time.thread_time() - cpu)

    def end(self, rank: int, facts: dict) -> None:
        self.recording = False
        directory = Path(self.directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"trace-rank{rank}.json"
        path.write_text(json.dumps({"rank": rank, **facts, "spans": self.spans, "span_cpu_s": self.span_cpu}))


TRACE = IterationTrace()


class BusyClock:
    def __init__(self) -> None:
        self.started = self.compute = 0.0
        self.reduction_at: float | None = None

    def begin(self) -> None:
        self.started, self.compute, self.reduction_at = time.perf_counter(), 0.0, None

    def reduction_starts(self) -> None:
        if self.reduction_at is None:
            self.reduction_at = time.perf_counter()

    @property
    def busy(self) -> float:
        """Seconds from begin() to the gradient reduction (where replicas wait for each other)."""
        return (self.reduction_at or time.perf_counter()) - self.started


BUSY = BusyClock()


@contextmanager
def _step(kind: str):
    start = time.perf_counter()
    with TRACE.span(kind, numbered=True):
        yield
    BUSY.compute += time.perf_counter() - start


def wrap_schedule_functions() -> object:
    """Times every forward_step/backward_step call of megatron-core's schedules."""
    from megatron.core.pipeline_parallel import schedules

    original_forward, original_backward = schedules.forward_step, schedules.backward_step

    def forward_step(*args, **kwargs):
        with _step("F"):
            return original_forward(*args, **kwargs)

    def backward_step(*args, **kwargs):
        with _step("B"):
            return original_backward(*args, **kwargs)

    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    return forward_step
