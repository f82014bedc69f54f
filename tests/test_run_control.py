"""Run control and checkpoint flags: async save keeps the atomic protocol, a checkpoint is
evaluated with --skip-train, --eval-iters 0 skips evaluation."""

import pytest

from conftest import GPT_MODEL, TRAINING, make_plan, run_pretrain
from hetero.errors import HeteroError
from megatron.hetero.arguments import parse_args, validate_args


@pytest.mark.slow
def test_async_save_then_skip_train_evaluates_the_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    train = GPT_MODEL + TRAINING + [
        "--train-iters", "3", "--save", str(ckpt), "--save-interval", "2",
        "--async-save", "--use-persistent-ckpt-worker", "--no-ckpt-fully-parallel-save",
        "--eval-iters", "0", "--deterministic-mode", "--manual-gc", "--manual-gc-interval", "1",
        "--empty-unused-memory-level", "2", "--exit-duration-in-mins", "60",
    ]
    plan = make_plan(tp=1, pp=1, dp=2, stages=[4], replicas=[5, 3], rank_order=[1, 0])
    trained = run_pretrain(train, nproc=2, plan=plan, tmp_path=tmp_path)
    assert trained.returncode == 0, trained.output[-3000:]
    assert len(trained.losses()) == 3
    assert "validation loss" not in trained.stdout  # --eval-iters 0
    # Background writes, each published (renamed, then the tracker) once complete.
    assert trained.stdout.count("successfully saved checkpoint from iteration") == 2
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

    evaluate = GPT_MODEL + TRAINING + [
        "--train-iters", "3", "--load", str(ckpt), "--skip-train", "--ckpt-fully-parallel-load",
        "--use-checkpoint-opt_param-scheduler", "--auto-detect-ckpt-format",
    ]
    evaluated = run_pretrain(evaluate + ["--dist-ckpt-strictness", "log_all"], nproc=2, plan=plan,
                             tmp_path=tmp_path)
    assert evaluated.returncode == 0, evaluated.output[-3000:]
    assert "skipping training (--skip-train)" in evaluated.stdout
    assert " iteration        1/" not in evaluated.stdout
    assert "validation loss at iteration 3 on validation set" in evaluated.stdout
    assert "validation loss at iteration 3 on test set" in evaluated.stdout
    # --skip-train loads no optimizer state; raise_all counts its tensors as unexpected.
    strict = run_pretrain(evaluate + ["--dist-ckpt-strictness", "raise_all"])
    assert strict.returncode == 2, strict.output[-3000:]
    assert "with --dist-ckpt-strictness raise_all: the checkpoint and this run do not hold" in strict.stderr


def test_async_save_needs_the_persistent_worker_as_in_megatron():
    args = parse_args(GPT_MODEL + TRAINING + ["--async-save", "--save", "/tmp/x"])
    args.tensor_model_parallel_size = 1
    validate_args(args)
    assert args.async_save is False
    assert any("Disabling --async-save" in note for note in args.startup_notes)


@pytest.mark.parametrize("extra, fragment", [
    (["--manual-gc-interval", "-1"], "--manual-gc-interval must be at least 0"),
    (["--squared-relu", "--swiglu"], "pick one"),
    (["--no-position-embedding"], "--no-position-embedding is deprecated"),
])
def test_run_control_and_shape_errors(extra, fragment):
    args = parse_args(GPT_MODEL + TRAINING + extra)
    args.tensor_model_parallel_size = 1
    with pytest.raises(HeteroError, match=fragment):
        validate_args(args)
