"""Checkpoints: exact resume, resume under another plan, atomic saves, a rank that dies.

Every job is real: ranks on 127.0.0.1 (forked by tests/forkrun.py, or torchrun where a rank
dies), gloo, megatron-core's distributed optimizer and distributed checkpoint format.
"""

import json
import time

import pytest

from conftest import GPT_MODEL, TRAINING, LiveJob, RunResult, assert_same_training, make_plan, run_pretrain
from hetero import events
from hetero.events import LostRanks

pytestmark = pytest.mark.slow

SIX = GPT_MODEL + TRAINING + ["--train-iters", "6", "--use-distributed-optimizer"]
# Plan A: two pipelines of two uneven stages, unequal replicas, permuted ranks.
PLAN_A = make_plan(tp=1, pp=2, dp=2, stages=[3, 1], replicas=[5, 3], rank_order=[2, 0, 3, 1])
# Plan B, for the re-planned resume: no pipeline, tensor parallel, another split and order.
PLAN_B = make_plan(tp=2, pp=1, dp=2, stages=[4], replicas=[2, 6], rank_order=[3, 1, 2, 0])


def _iterations(result: RunResult) -> dict[int, float]:
    """iteration -> the logged lm loss, as the job recorded it (hetero.events)."""
    return result.iteration_losses()


@pytest.fixture(scope="module")
def reference_six():
    """One process, no plan, no checkpoint: the run every other one must reproduce."""
    result = run_pretrain(GPT_MODEL + TRAINING + ["--train-iters", "6"])
    assert result.returncode == 0, result.output[-3000:]
    return result


@pytest.fixture(scope="module")
def checkpoint_at_3(tmp_path_factory):
    """Plan A trains 3 iterations and saves (--exit-interval 3)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    result = run_pretrain(SIX + ["--save", str(tmp / "ckpt"), "--exit-interval", "3"],
                          nproc=4, plan=PLAN_A, tmp_path=tmp)
    assert result.returncode == 0, result.output[-3000:]
    assert "exiting program at iteration 3" in result.stdout
    return tmp / "ckpt", result


def test_distributed_optimizer_over_unequal_replicas_matches_one_process(tmp_path, reference_six):
    straight = run_pretrain(SIX, nproc=4, plan=PLAN_A, tmp_path=tmp_path)
    assert_same_training(reference_six, straight)


def test_layout_and_contents(checkpoint_at_3):
    root, _ = checkpoint_at_3
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    iteration = root / "iter_0000003"
    assert (iteration / "metadata.json").exists() and (iteration / "common.pt").exists()
    assert json.loads((iteration / "hetero_plan.json").read_text())["rank_order"] == PLAN_A["rank_order"]
    assert not list(root.glob("*.tmp"))


def test_resume_under_the_same_plan_is_exact(tmp_path, checkpoint_at_3):
    root, first = checkpoint_at_3
    straight = run_pretrain(SIX, nproc=4, plan=PLAN_A, tmp_path=tmp_path)
    resumed = run_pretrain(SIX + ["--load", str(root)], nproc=4, plan=PLAN_A, tmp_path=tmp_path)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "successfully loaded checkpoint" in resumed.stdout
    joined = {**_iterations(first), **_iterations(resumed)}
    assert sorted(_iterations(resumed)) == [4, 5, 6]
    assert joined == _iterations(straight)  # identical, bit for bit


def test_resume_under_another_plan_continues_the_same_training(tmp_path, checkpoint_at_3, reference_six):
    root, _ = checkpoint_at_3
    resumed = run_pretrain(SIX + ["--load", str(root)], nproc=4, plan=PLAN_B, tmp_path=tmp_path)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "tensors re-sharded" in resumed.stdout
    reference, got = _iterations(reference_six), _iterations(resumed)
    assert sorted(got) == [4, 5, 6]
    for i, loss in got.items():
        assert abs(loss - reference[i]) <= 1e-4 * reference[i], (i, loss, reference[i])


def test_a_checkpoint_of_another_model_or_optimizer_is_refused(checkpoint_at_3):
    root, _ = checkpoint_at_3
    wrong_shape = [a if a != "64" else "128" for a in SIX]  # --hidden-size 128
    result = run_pretrain(wrong_shape + ["--load", str(root)], timeout=180)
    assert result.returncode == 2
    assert "is of another model (" in result.stderr
    assert "hidden_size: checkpoint 64, this run 128" in result.stderr
    # found at start-up, before any process group, with the flags that build the checkpoint's model
    assert "give the flags that build its model: --hidden-size 64, --ffn-hidden-size 256" in result.stderr
    plain = [a for a in SIX if a != "--use-distributed-optimizer"]
    result = run_pretrain(plain + ["--load", str(root)], timeout=180)
    assert result.returncode == 2
    assert "was written with the distributed optimizer" in result.stderr
    weights_only = run_pretrain(plain + ["--load", str(root), "--no-load-optim", "--train-iters", "4"],
                                timeout=180)
    assert weights_only.returncode == 0, weights_only.output[-3000:]
    assert sorted(_iterations(weights_only)) == [4]


def test_a_save_cut_short_leaves_the_previous_checkpoint(tmp_path):
    # A larger model so that writing a checkpoint takes a while; kill the job mid-save.
    bigger = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
              "--seq-length", "32", "--max-position-embeddings", "32"]
    args = bigger + TRAINING + ["--train-iters", "50", "--use-distributed-optimizer",
                                "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    job = LiveJob(args, nproc=2)
    job.wait_for("successfully saved checkpoint from iteration       2")
    job.wait_for("saving checkpoint at iteration       4")
    job.kill_everything()  # the launcher and every rank, while they write iteration 4
    job.finish(timeout=60)
    root = tmp_path / "ckpt"
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2", job.output[-2000:]
    assert not (root / "iter_0000004" / "metadata.json").exists()
    resumed = run_pretrain(bigger + TRAINING + ["--train-iters", "4", "--use-distributed-optimizer",
                                                "--load", str(root), "--save", str(root)], timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "successfully loaded checkpoint from" in resumed.stdout and "at iteration 2" in resumed.stdout
    assert sorted(_iterations(resumed)) == [3, 4]
    assert not list(root.glob("*.tmp"))  # the next save removed the remains
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def test_a_rank_that_dies_stops_the_job_and_names_it(tmp_path):
    args = SIX[:-1] + ["--use-distributed-optimizer", "--train-iters", "400",
                       "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(PLAN_A))
    job = LiveJob(args + ["--hetero-plan", str(plan_path)], nproc=4)
    job.wait_for("successfully saved checkpoint from iteration       2")
    victim = job.worker_pid(launch_rank=2)
    killed_at = time.monotonic()
    import os
    import signal

    os.kill(victim, signal.SIGKILL)
    code = job.finish(timeout=120)
    stopped_after = time.monotonic() - killed_at
    assert code != 0
    assert stopped_after < 60, stopped_after  # well within --distributed-timeout-minutes
    reports = [l for l in job.lines if "error: the job lost launch rank 2 (logical rank 0" in l]
    assert reports, job.output[-3000:]
    assert f"pid {victim}): its process is gone" in reports[0]
    recorded = [lost for report in events.of_kind(job.events(), LostRanks) for lost in report.lost]
    assert any((lost.launch_rank, lost.logical_rank, lost.pid, lost.why) == (2, 0, victim, "its process is gone")
               for lost in recorded), recorded
    assert "resume with --load" in reports[0]
    root = tmp_path / "ckpt"
    latest = int((root / "latest_checkpointed_iteration.txt").read_text())
    # The last checkpoint is intact: one process picks it up (re-sharded) and goes on.
    resumed = run_pretrain(SIX[:-1] + ["--use-distributed-optimizer", "--train-iters", str(latest + 1),
                                       "--load", str(root)], timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert sorted(_iterations(resumed)) == [latest + 1]
