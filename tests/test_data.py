"""The sample order under a plan, and training from a real indexed dataset."""

import numpy as np
import pytest
import torch

from conftest import GPT_MODEL, TRAINING, make_plan, run_pretrain
from hetero.plan import Plan
from megatron.hetero.data import ReplicaBatchSampler


@pytest.mark.parametrize("replicas", [[8], [5, 3], [1, 6, 1], [2, 2, 2, 2]])
def test_every_plan_trains_on_the_same_global_batches(replicas):
    plan = Plan.from_dict(make_plan(tp=1, pp=1, dp=len(replicas), stages=[4], replicas=replicas,
                                    rank_order=list(range(len(replicas))), mbs=2))
    iterations = 3
    streams = [iter(ReplicaBatchSampler(10_000, plan, d)) for d in range(len(replicas))]
    for it in range(iterations):
        seen = []
        for d, stream in enumerate(streams):
            for _ in range(replicas[d]):
                seen.extend(next(stream))
        assert seen == list(range(it * 16, (it + 1) * 16))


def test_sampler_stops_at_the_end_of_the_dataset():
    plan = Plan.from_dict(make_plan(tp=1, pp=1, dp=2, stages=[4], replicas=[3, 1],
                                    rank_order=[0, 1], mbs=2))
    # global batch 8: samples 0..15 make two whole iterations, 16..22 are not enough for a third
    assert list(ReplicaBatchSampler(23, plan, 1)) == [[6, 7], [14, 15]]
    assert list(ReplicaBatchSampler(23, plan, 0, start_iteration=1)) == [[8, 9], [10, 11], [12, 13]]


@pytest.fixture()
def indexed_dataset(tmp_path):
    """A small megatron-core .bin/.idx pair of random documents."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "tiny_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(400):
        length = int(rng.integers(20, 120))
        builder.add_item(torch.from_numpy(rng.integers(0, 999, length).astype(np.int32)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


@pytest.mark.slow
def test_trains_from_an_indexed_dataset(tmp_path, indexed_dataset):
    args = GPT_MODEL + [a for a in TRAINING if a != "--mock-data"] + [
        "--data-path", str(indexed_dataset), "--split", "90,8,2", "--train-iters", "3",
        "--data-cache-path", str(tmp_path / "cache"), "--eval-iters", "1",
    ]
    plan = make_plan(tp=1, pp=2, dp=1, stages=[1, 3], replicas=[8], rank_order=[1, 0])
    result = run_pretrain(args, nproc=2, plan=plan, tmp_path=tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    losses = result.losses()
    assert len(losses) == 3 and all(5.0 < loss < 8.0 for loss in losses)
    assert "validation loss at iteration 3 on validation set" in result.stdout
    assert any((tmp_path / "cache").iterdir())  # megatron-core wrote its index cache


def test_missing_dataset_is_a_clear_error(tmp_path):
    args = GPT_MODEL + [a for a in TRAINING if a != "--mock-data"] + [
        "--data-path", str(tmp_path / "nothing_here"),
    ]
    result = run_pretrain(args, timeout=120)
    assert result.returncode == 2
    assert "[launch rank 0] error: --data-path" in result.stderr


@pytest.mark.parametrize("split, eval_iters, seq_length, problem", [
    ("969,30,1", "1", "32", "the test split gets documents [400, 400) of 400 (0 tokens)"),
    ("1,999,0", "0", "32", "the train split gets documents [0, 0) of 400 (0 tokens)"),
    ("98,2,0", "1", "4096", "the validation split gets documents [392, 400) of 400"),
])
def test_a_split_that_cannot_serve_its_samples_is_an_error_before_training(
        tmp_path, indexed_dataset, split, eval_iters, seq_length, problem):
    args = [a for a in GPT_MODEL + TRAINING if a != "--mock-data"] + [
        "--data-path", str(indexed_dataset), "--split", split, "--eval-iters", eval_iters,
        "--seq-length", seq_length, "--max-position-embeddings", seq_length,
    ]
    result = run_pretrain(args, timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert problem in result.stderr, result.stderr[-2000:]
    assert "training ..." not in result.stdout


class _SignalState(torch.utils.data.Dataset):
    """Each item is how the DataLoader worker that loads it handles signals."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        import signal

        wakeup_fd = signal.set_wakeup_fd(-1)
        return int(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL), wakeup_fd


def test_dataloader_workers_do_not_inherit_the_watchdogs_signal_handling():
    import signal
    import socket

    from megatron.hetero.data import reset_signals_in_worker

    receive, send = socket.socketpair()
    send.setblocking(False)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    signal.set_wakeup_fd(send.fileno())
    try:
        loader = torch.utils.data.DataLoader(_SignalState(), batch_size=None, num_workers=1,
                                             worker_init_fn=reset_signals_in_worker)
        assert [tuple(map(int, item)) for item in loader] == [(1, -1), (1, -1)]
        inherited = torch.utils.data.DataLoader(_SignalState(), batch_size=None, num_workers=1)
        assert [tuple(map(int, item)) for item in inherited][0] == (0, send.fileno())  # what we undo
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, previous)
        receive.close()
        send.close()
