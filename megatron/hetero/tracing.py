"""What one training iteration did on every rank, for the measured-vs-predicted timeline.

With HETERO_TRACE_DIR set, iteration HETERO_TRACE_ITERATION (default 3, past warm-up) is
recorded on every rank: each forward and backward of a micro-batch (megatron-core's
schedule functions, wrapped by the "schedule-trace" patch), the gradient reduction and the
optimizer step. Each rank writes trace-rank<logical rank>.json there:

    {"rank": 5, "tp_rank": 0, "pp_rank": 1, "dp_rank": 0, "host": "b0", "device_type": "...",
     "spans": [["F", 0, start_s, end_s], ["B", 0, ...], ["reduce", null, ...], ["step", null, ...]]}

Times are seconds from the iteration's start, taken right after a barrier; all ranks of an
emulated cluster share one clock (CLOCK_MONOTONIC).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path


class IterationTrace:
    def __init__(self) -> None:
        self.directory = os.environ.get("HETERO_TRACE_DIR")
        self.iteration = int(os.environ.get("HETERO_TRACE_ITERATION", "3"))
        self.recording = False
        self.origin = 0.0
        self.spans: list[list] = []
        self._counts: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.directory)

    def begin(self) -> None:
        self.recording, self.spans, self._counts = True, [], {}
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
        start = time.monotonic() - self.origin
        try:
            yield
        finally:
            self.spans.append([kind, index, start, time.monotonic() - self.origin])

    def end(self, rank: int, facts: dict) -> None:
        self.recording = False
        directory = Path(self.directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"trace-rank{rank}.json"
        path.write_text(json.dumps({"rank": rank, **facts, "spans": self.spans}))


TRACE = IterationTrace()


def wrap_schedule_functions() -> object:
    """Times every forward_step/backward_step call of megatron-core's schedules."""
    from megatron.core.pipeline_parallel import schedules

    original_forward, original_backward = schedules.forward_step, schedules.backward_step

    def forward_step(*args, **kwargs):
        with TRACE.span("F", numbered=True):
            return original_forward(*args, **kwargs)

    def backward_step(*args, **kwargs):
        with TRACE.span("B", numbered=True):
            return original_backward(*args, **kwargs)

    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    return forward_step
