"""Bad input stops the job on every rank with a message that names the problem and the fix.

Each case is a real launch; the timeout proves no rank waits in a collective.
"""

import pytest

from conftest import GPT_MODEL, TRAINING, make_plan, run_pretrain

ARGS = GPT_MODEL + TRAINING
QUICK = 120  # seconds; a hang would run into the distributed timeout (minutes)


def _every_rank_says(result, nproc: int, *fragments: str) -> None:
    assert result.returncode != 0
    for rank in range(nproc):
        lines = [l for l in result.stderr.splitlines() if l.startswith(f"[launch rank {rank}] error:")]
        assert lines, f"launch rank {rank} printed no error:\n{result.output[-3000:]}"
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stdout


@pytest.mark.slow
def test_malformed_plan(tmp_path):
    plan = make_plan(tp=1, pp=2, dp=1, stages=[4, 0], replicas=[8], rank_order=[0, 1])
    result = run_pretrain(ARGS, nproc=2, plan=plan, tmp_path=tmp_path, timeout=QUICK)
    _every_rank_says(result, 2, "not a valid hetero plan", "stages[1].num_layers",
                     "regenerate the plan")


@pytest.mark.slow
def test_plan_for_another_world_size(tmp_path):
    plan = make_plan(tp=1, pp=2, dp=2, stages=[2, 2], replicas=[4, 4], rank_order=[0, 1, 2, 3])
    result = run_pretrain(ARGS, nproc=2, plan=plan, tmp_path=tmp_path, timeout=QUICK)
    _every_rank_says(result, 2, "is for 4 processes", "launched with 2")


@pytest.mark.slow
def test_device_mismatch_is_reported_by_every_rank(tmp_path):
    devices = [
        {"host": "node0", "device_type": "cpu", "vendor": "cpu"},
        {"host": "node0", "device_type": "A100-40GB", "vendor": "nvidia"},
    ]
    plan = make_plan(tp=1, pp=2, dp=1, stages=[2, 2], replicas=[8], rank_order=[1, 0], devices=devices)
    result = run_pretrain(ARGS, nproc=2, plan=plan, tmp_path=tmp_path, timeout=QUICK)
    _every_rank_says(
        result, 2,
        "launch rank 1 (logical rank 0, host node0): the plan expects A100-40GB (nvidia), found cpu",
        "HETERO_DEVICE=A100-40GB",
    )
    assert "launch rank 0 (logical" not in result.stderr  # the matching rank is not blamed


@pytest.mark.slow
def test_emulated_devices_pass_the_check_and_train(tmp_path):
    devices = [
        {"host": "node0", "device_type": "H100-80GB", "vendor": "nvidia"},
        {"host": "node0", "device_type": "MI250X", "vendor": "amd"},
    ]
    plan = make_plan(tp=1, pp=2, dp=1, stages=[3, 1], replicas=[8], rank_order=[1, 0], devices=devices)
    result = run_pretrain(
        GPT_MODEL + TRAINING + ["--train-iters", "2", "--eval-iters", "0"],
        nproc=2, plan=plan, tmp_path=tmp_path,
        env={"HETERO_DEVICE": "H100-80GB,MI250X", "HETERO_VENDOR": "nvidia,amd"},
    )
    assert result.returncode == 0, result.output[-3000:]
    assert len(result.losses()) == 2
    assert "-> launch rank    1 on node0 (MI250X, amd)" in result.stdout


def test_unknown_flag():
    result = run_pretrain(ARGS + ["--tensor-parallel-size", "2"], timeout=QUICK)
    _every_rank_says(result, 1, "unknown flag --tensor-parallel-size",
                     "did you mean --tensor-model-parallel-size?")


def test_flag_contradicting_the_plan(tmp_path):
    plan = make_plan(tp=1, pp=1, dp=1, stages=[4], replicas=[8], rank_order=[0])
    # TRAINING says 16; the last occurrence of a flag wins, as in Megatron-LM.
    result = run_pretrain(ARGS + ["--global-batch-size", "32"], plan=plan, tmp_path=tmp_path,
                          timeout=QUICK)
    _every_rank_says(result, 1, "--global-batch-size 32 contradicts the plan (16)")


def test_missing_plan_file():
    result = run_pretrain(ARGS + ["--hetero-plan", "/nonexistent/plan.json"], timeout=QUICK)
    _every_rank_says(result, 1, "plan file /nonexistent/plan.json does not exist")
