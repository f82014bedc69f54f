"""The iteration trace (HETERO_TRACE_DIR): every span's wall time and its thread's CPU time."""

from __future__ import annotations

import json
import time

from megatron.hetero.tracing import IterationTrace


def test_each_span_records_the_cpu_time_its_thread_spent_beside_its_wall_time(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_TRACE_DIR", str(tmp_path))
    trace = IterationTrace()
    trace.begin()
    with trace.span("F", numbered=True):  # computes: 20 ms of this thread's CPU time
        start = time.thread_time()
        while time.thread_time() - start < 0.02:
            pass
    with trace.span("reduce"):  # waits: no CPU time
        time.sleep(0.05)
    trace.end(3, {"pp_rank": 0})
    written = json.loads((tmp_path / "trace-rank3.json").read_text())
    (computed, waited) = written["spans"]
    assert computed[:2] == ["F", 0] and waited[:2] == ["reduce", None]
    cpu_computed, cpu_waited = written["span_cpu_s"]
    assert 0.02 <= cpu_computed <= computed[3] - computed[2] + 0.005
    assert cpu_waited < 0.01 <= waited[3] - waited[2]
