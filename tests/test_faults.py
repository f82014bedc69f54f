"""Faults: a job that loses a process, its launcher or receives a signal stops within a
bound, leaves no process behind, and its last checkpoint continues the same training.

Every case runs the same 4-process heterogeneous plan (uneven stages, unequal replicas,
permuted ranks) with checkpoints every 2 iterations, injects the fault once a checkpoint
exists, and then resumes the last complete checkpoint in one process (re-sharded) and
compares the next iteration's loss with an uninterrupted run. The learning rate is
constant so that runs of different length share one schedule.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from conftest import GPT_MODEL, TRAINING, LiveJob, make_plan, run_pretrain
from megatron.hetero.watchdog import PEER_TIMEOUT_S, _process_exists

pytestmark = pytest.mark.slow

PLAN = make_plan(tp=1, pp=2, dp=2, stages=[3, 1], replicas=[5, 3], rank_order=[2, 0, 3, 1])
ARGS = GPT_MODEL + TRAINING + ["--lr-decay-style", "constant", "--use-distributed-optimizer"]
REFERENCE_ITERS = 24


def _losses(output: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in
            re.findall(r" iteration\s+(\d+)/\s*\d+ \|.* lm loss: ([0-9.E+-]+) \|", output)}


@pytest.fixture(scope="module")
def uninterrupted():
    result = run_pretrain(ARGS + ["--train-iters", str(REFERENCE_ITERS)])
    assert result.returncode == 0, result.output[-3000:]
    return _losses(result.stdout)


def _start(tmp_path, extra: list[str] = ()) -> tuple[LiveJob, list[int]]:
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(PLAN))
    job = LiveJob(ARGS + ["--train-iters", "400", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                          "--hetero-plan", str(plan_path), *extra], nproc=4)
    job.wait_for("successfully saved checkpoint from iteration       2")
    return job, [job.worker_pid(rank) for rank in range(4)]


def _seconds_until_gone(pids: list[int], bound: float) -> float:
    start = time.monotonic()
    while any(_process_exists(pid) for pid in pids):
        elapsed = time.monotonic() - start
        assert elapsed < bound, f"still running after {elapsed:.0f} s: " + ", ".join(
            str(pid) for pid in pids if _process_exists(pid))
        time.sleep(0.1)
    return time.monotonic() - start


def _assert_resumes_the_same_training(tmp_path, uninterrupted: dict[int, float]) -> int:
    root = tmp_path / "ckpt"
    latest = int((root / "latest_checkpointed_iteration.txt").read_text())
    assert latest + 1 <= REFERENCE_ITERS, latest
    resumed = run_pretrain(ARGS + ["--train-iters", str(latest + 1), "--load", str(root)], timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    loss = _losses(resumed.stdout)[latest + 1]
    assert abs(loss - uninterrupted[latest + 1]) <= 1e-4 * uninterrupted[latest + 1], (
        latest, loss, uninterrupted[latest + 1])
    return latest


def test_killed_launcher_stops_its_workers(tmp_path, uninterrupted):
    job, workers = _start(tmp_path)
    os.kill(job.proc.pid, signal.SIGKILL)
    stopped_after = _seconds_until_gone(workers, bound=15)
    job.finish(timeout=30)
    assert "its launcher (torchrun agent, pid" in job.output, job.output[-3000:]
    print(f"workers gone {stopped_after:.1f} s after the launcher was killed")
    _assert_resumes_the_same_training(tmp_path, uninterrupted)


def test_sigterm_to_one_worker_stops_every_rank_and_names_it(tmp_path, uninterrupted):
    job, workers = _start(tmp_path)
    os.kill(workers[1], signal.SIGTERM)
    stopped_after = _seconds_until_gone(workers, bound=15)
    code = job.finish(timeout=30)
    assert code != 0
    cause = f"launch rank 1 ({os.uname().nodename}, pid {workers[1]}) received SIGTERM"
    assert sum(cause in line for line in job.lines) == 4, job.output[-3000:]  # every rank says why
    print(f"job stopped {stopped_after:.1f} s after SIGTERM")
    _assert_resumes_the_same_training(tmp_path, uninterrupted)


def test_sigterm_with_exit_signal_handler_saves_the_iteration_and_exits_0(tmp_path, uninterrupted):
    job, workers = _start(tmp_path, ["--exit-signal-handler"])
    os.kill(workers[3], signal.SIGTERM)
    stopped_after = _seconds_until_gone(workers, bound=60)
    assert job.finish(timeout=30) == 0, job.output[-3000:]
    exited = re.search(r"exiting program after receiving SIGTERM", job.output)
    assert exited, job.output[-3000:]
    last_logged = max(_losses(job.output))
    latest = _assert_resumes_the_same_training(tmp_path, uninterrupted)
    assert latest == last_logged  # the checkpoint is of the iteration the job was in
    print(f"saved iteration {latest} and exited 0 in {stopped_after:.1f} s")


def test_frozen_worker_stops_the_job_within_the_heartbeat_bound(tmp_path, uninterrupted):
    job, workers = _start(tmp_path)
    os.kill(workers[2], signal.SIGSTOP)
    try:
        stopped_after = _seconds_until_gone(workers, bound=PEER_TIMEOUT_S + 30)
    finally:
        for pid in workers:  # never leave a stopped process behind, even on failure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert job.finish(timeout=30) != 0
    reports = [line for line in job.lines if f"pid {workers[2]}): no heartbeat for" in line]
    assert reports, job.output[-3000:]
    assert "(frozen; killed)" in job.output
    print(f"job stopped {stopped_after:.1f} s after the worker froze")
    _assert_resumes_the_same_training(tmp_path, uninterrupted)
