"""TensorBoard events (read back with tensorboard's own reader), W&B offline, timers."""

import os

import pytest

from conftest import GPT_MODEL, TRAINING, make_plan, run_pretrain
from hetero.errors import HeteroError
from megatron.hetero.arguments import parse_args, validate_args


def _scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_and_wandb_get_megatrons_scalars_from_the_last_rank(tmp_path):
    """2 processes (PP=2, so only the last rank knows the loss), every logging flag."""
    tensorboard, wandb_dir = tmp_path / "tb", tmp_path / "wandb"
    args = GPT_MODEL + TRAINING + [
        "--tensorboard-dir", str(tensorboard), "--log-timers-to-tensorboard",
        "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard",
        "--timing-log-level", "2", "--log-throughput", "--log-num-zeros-in-grad",
        "--eval-interval", "2", "--train-iters", "4",
        "--wandb-project", "hetero-test", "--wandb-exp-name", "tb-test", "--wandb-save-dir", str(wandb_dir),
    ]
    plan = make_plan(tp=1, pp=2, dp=1, stages=[3, 1], replicas=[8], rank_order=[1, 0])
    result = run_pretrain(args, nproc=2, plan=plan, tmp_path=tmp_path, env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.output[-3000:]
    scalars = _scalars(tensorboard)
    # The loss read back equals the logged one (the log prints 7 significant digits).
    logged = result.losses()
    assert [step for step, _ in scalars["lm loss"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["lm loss"]] == pytest.approx(logged, rel=1e-6)
    assert [v for _, v in scalars["learning-rate"]] == pytest.approx(result.series("learning rate"), rel=1e-6)
    assert [step for step, _ in scalars["lm loss vs samples"]] == [16, 32, 48, 64]
    for tag in ("batch-size", "grad-norm", "params-norm", "num-zeros", "loss-scale", "iteration-time",
                "throughput", "forward-backward-time", "lm loss validation",
                "lm loss validation ppl", "mem-max-rss-bytes"):
        assert tag in scalars, (tag, sorted(scalars))
    assert [step for step, _ in scalars["lm loss validation"]] == [2, 4]
    # The timers of --timing-log-level 2 are printed after the iteration line.
    assert "(min, max) time across ranks (ms):" in result.stdout
    assert "forward-compute" in result.stdout and "optimizer" in result.stdout
    assert "throughput per GPU (TFLOP/s/GPU)" in result.stdout
    # One writer: the last rank's (Megatron-LM's rule).
    assert len([f for f in os.listdir(tensorboard) if f.startswith("events.out")]) == 1
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_wandb_missing_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    args = parse_args(GPT_MODEL + TRAINING + ["--wandb-project", "p", "--save", "/tmp/x"])
    args.tensor_model_parallel_size = 1
    with pytest.raises(HeteroError, match=r"--wandb-project needs the wandb package: pip install wandb"):
        validate_args(args)
