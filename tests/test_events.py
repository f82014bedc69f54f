"""hetero.events: the records a job writes beside its log, and their readers."""

from __future__ import annotations

import json
import math
import re
import threading

import pytest

from conftest import GPT_MODEL, TRAINING, run_pretrain
from hetero import events
from hetero.events import (CheckpointLoaded, CheckpointSaved, EventsError, Iteration, LostRank, LostRanks,
                           Memory, Stopped, emit, read_events)
from hetero.launch.elastic import AttemptResult, lost_hosts
from hetero.plan import Plan
from hetero.report import measured_against_predicted, measured_iteration_times_s


def _iteration(i: int, elapsed_s: float = 0.5, **extra) -> Iteration:
    return Iteration(iteration=i, train_iters=10, consumed_samples=16 * i, interval=1, elapsed_s=elapsed_s,
                     tokens_per_s=1024 / elapsed_s, learning_rate=1e-3, global_batch_size=16,
                     losses={"lm loss": 7.0 - i / 10}, loss_scale=1.0, **extra)


def test_each_rank_appends_to_its_own_file_and_the_reader_merges_them_in_time_order(tmp_path):
    emit(_iteration(1, launch_rank=3, time=10.0), tmp_path)
    emit(Memory(logical_rank=0, iteration=1, max_rss_mb=500.0, mapped_files_mb=100.0, launch_rank=0, time=11.0),
         tmp_path)
    emit(_iteration(2, launch_rank=3, time=12.0), tmp_path)
    emit(CheckpointSaved(iteration=2, directory="/ckpt", launch_rank=0, time=12.5), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.jsonl", "rank-3.jsonl"]
    merged = read_events(tmp_path)
    assert [type(e).__name__ for e in merged] == ["Iteration", "Memory", "Iteration", "CheckpointSaved"]
    assert events.iteration_times_s(merged) == [0.5, 0.5]
    assert events.losses(merged) == {1: 6.9, 2: 6.8}
    assert events.of_kind(merged, Memory)[0].peak_mb == 400.0
    assert read_events(tmp_path / "nowhere") == []  # a job that wrote nothing


def test_values_round_trip_exactly_nan_included(tmp_path):
    sent = _iteration(1, grad_norm=0.1 + 0.2, params_norm=None)
    sent = sent.model_copy(update={"losses": {"lm loss": float("nan"), "load_balancing_loss": 1e-7}})
    emit(sent, tmp_path)
    (got,) = read_events(tmp_path)
    assert got.grad_norm == 0.1 + 0.2 and got.params_norm is None
    assert math.isnan(got.losses["lm loss"]) and got.losses["load_balancing_loss"] == 1e-7


def test_the_writer_defaults_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HETERO_EVENTS_DIR", raising=False)
    assert emit(Stopped(cause="x", launch_rank=0)) is False  # unset: nothing is written
    monkeypatch.setenv("HETERO_EVENTS_DIR", str(tmp_path / "made"))
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert emit(Stopped(cause="SIGTERM", signal="SIGTERM"))
    (got,) = read_events(tmp_path / "made")
    assert (got.launch_rank, got.cause, got.signal, got.alone) == (2, "SIGTERM", "SIGTERM", False)
    assert (tmp_path / "made" / "rank-2.jsonl").exists()
    monkeypatch.delenv("HETERO_EVENTS_DIR")
    assert emit(Stopped(cause="x")) is False


def test_an_unwritable_directory_warns_once_and_training_goes_on(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert emit(Stopped(cause="x", launch_rank=0), blocked) is False
    assert emit(Stopped(cause="y", launch_rank=0), blocked) is False
    assert capsys.readouterr().err.count("cannot write events to") == 1


def test_threads_appending_at_once_leave_whole_lines(tmp_path):
    def write(rank: int) -> None:
        for i in range(200):
            emit(_iteration(i + 1, launch_rank=rank), tmp_path)

    threads = [threading.Thread(target=write, args=(0,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(read_events(tmp_path)) == 800


def test_a_line_cut_short_is_left_out_and_unknown_kinds_are_skipped(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    complete = _iteration(1, launch_rank=0).to_json()
    newer = json.dumps({"kind": "from_a_newer_writer", "time": 1.0, "launch_rank": 0})
    path.write_text(complete + "\n" + newer + "\n" + complete[:40])  # killed mid-write
    assert [e.iteration for e in read_events(tmp_path)] == [1]


@pytest.mark.parametrize("line, fragment", [
    ("not json", "rank-0.jsonl:1 is not JSON"),
    ('{"time": 1}', 'rank-0.jsonl:1 is not an event (no "kind")'),
    ('{"kind": "iteration", "time": 1, "launch_rank": 0, "iteration": "x"}', "is not a valid iteration event"),
])
def test_a_broken_file_is_named(tmp_path, line, fragment):
    (tmp_path / "rank-0.jsonl").write_text(line + "\n")
    with pytest.raises(EventsError, match=re.escape(fragment)):
        read_events(tmp_path)


def _three_hosts() -> Plan:
    return Plan.from_dict({"version": 1, "tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 4,
                           "micro_batch_size": 1, "stages": [{"num_layers": 2}],
                           "replicas": [{"num_micro_batches": 1}] * 4, "rank_order": [0, 1, 2, 3],
                           "devices": [{"host": h, "device_type": "cpu", "vendor": "cpu"}
                                       for h in ("a", "a", "b", "c")]})


def _lost(reporter: int, *ranks: int, plan: Plan) -> LostRanks:
    host = plan.devices[reporter].host if reporter < plan.world_size else "elsewhere"
    return LostRanks(launch_rank=reporter, host=host, cause="a neighbour stopped answering",
                     lost=[LostRank(launch_rank=r, logical_rank=r, host=f"as-the-rank-named-it-{r}", pid=100 + r,
                                    why="no heartbeat for 11 s") for r in ranks])


def test_lost_hosts_come_from_the_records_by_launch_rank():
    plan = _three_hosts()
    # Killed launchers count; a rank elsewhere names launch rank 3 (host c by the plan, whatever
    # name the lost process gave its host).
    assert lost_hosts(AttemptResult(1, {"b"}, events=[_lost(0, 3, plan=plan)]), plan) == {"b", "c"}
    # A rank reporting its own host's peer: a process lost, not the host.
    assert lost_hosts(AttemptResult(1, set(), events=[_lost(0, 1, plan=plan)]), plan) == set()
    # Other records, log lines and other runs' ranks change nothing.
    noise = [_iteration(1, launch_rank=0), Stopped(cause="SIGTERM", launch_rank=2), _lost(9, 3, plan=plan)]
    lines = ["[launch rank 0] error: the job lost launch rank 2 (logical rank 2, host b, pid 9): gone\n"]
    assert lost_hosts(AttemptResult(1, set(), lines, noise), plan) == set()


def test_explain_measured_reads_an_events_directory_or_a_log(tmp_path):
    for i, seconds in enumerate([9.0, 1.25, 1.20, 1.30], 1):
        emit(_iteration(i, elapsed_s=seconds, launch_rank=1), tmp_path / "events")
    times = measured_iteration_times_s(tmp_path / "events")
    assert times == [9.0, 1.25, 1.20, 1.30]
    assert measured_against_predicted(times, 1.0).startswith("measured   iteration 1.250 s (median of 3")
    log = tmp_path / "train.log"
    log.write_text(" [2026-11-25 10:00:01] iteration        5/      30 | consumed samples:           80 | "
                   "elapsed time per iteration (ms): 1250.0 | tokens per second: 1.0 |\n")
    assert measured_iteration_times_s(log) == [1.25]
    with pytest.raises(ValueError, match="does not exist; give a training log, or the run's events directory"):
        measured_iteration_times_s(tmp_path / "missing.log")


@pytest.mark.slow
def test_a_job_records_what_its_log_says(tmp_path):
    """Iterations, memory and checkpoints, as numbers; the log keeps Megatron's lines."""
    records = tmp_path / "events"
    save = tmp_path / "ckpt"
    result = run_pretrain(GPT_MODEL + TRAINING + ["--train-iters", "3", "--save", str(save), "--save-interval", "2"],
                          env={"HETERO_EVENTS_DIR": str(records)})
    assert result.returncode == 0, result.output[-3000:]
    recorded = read_events(records)
    iterations = events.of_kind(recorded, Iteration)
    assert [e.iteration for e in iterations] == [1, 2, 3]
    printed = re.findall(r" iteration\s+(\d+)/\s*3 \| consumed samples:\s+(\d+) \| elapsed time per iteration "
                         r"\(ms\): ([0-9.]+) \|.* lm loss: ([0-9.E+-]+) \|.* params norm: ([0-9.]+) \|", result.stdout)
    assert len(printed) == 3
    for event, (i, consumed, ms, loss, norm) in zip(iterations, printed):
        assert (event.iteration, event.consumed_samples, event.train_iters) == (int(i), int(consumed), 3)
        assert f"{event.elapsed_s * 1000:.1f}" == ms
        assert f"{event.losses['lm loss']:.6E}" == loss and f"{event.params_norm:.3f}" == norm
    (memory,) = events.of_kind(recorded, Memory)
    assert f"max rss: {memory.max_rss_mb:.1f} | mapped files: {memory.mapped_files_mb:.1f}" in result.stdout
    assert [(e.iteration, e.directory) for e in events.of_kind(recorded, CheckpointSaved)] == [(2, str(save)),
                                                                                               (3, str(save))]
    resumed = run_pretrain(GPT_MODEL + TRAINING + ["--train-iters", "4", "--load", str(save)],
                           env={"HETERO_EVENTS_DIR": str(tmp_path / "resumed")})
    assert resumed.returncode == 0, resumed.output[-3000:]
    again = read_events(tmp_path / "resumed")
    assert [(e.iteration, e.directory) for e in events.of_kind(again, CheckpointLoaded)] == [(3, str(save))]
    assert [e.iteration for e in events.of_kind(again, Iteration)] == [4]
