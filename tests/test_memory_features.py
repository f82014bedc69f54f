"""What recomputation and sequence parallelism save, measured as peak resident memory.

The measurement side of "the memory model learns both": each test runs the same model with
and without the feature and reports the drop of the peak RSS per process (the runtime makes
glibc return freed tensors, see tests/test_memory.py). The model is large enough for
activations to dominate (hidden 512, sequence 512, micro-batch 4: a few hundred MB per
layer in fp32, against run-to-run noise of a few MB). ``measured_drops`` is what the
memory model's predictions (hetero/memory.py) are to be compared with, within 10%.
"""

from __future__ import annotations

import re

import pytest

from conftest import make_plan, run_pretrain

pytestmark = pytest.mark.slow

NUM_LAYERS = 4
MODEL = ["--num-layers", str(NUM_LAYERS), "--hidden-size", "512", "--num-attention-heads", "8",
         "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "4",
         "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "8000", "--log-interval", "2", "--eval-iters", "0", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--num-workers", "0"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]

_MEMORY = re.compile(r"\[Rank (\d+)\] \(after \d+ iterations\) memory \(MB\) \| max rss: ([0-9.]+)")


def peak_rss_mb(stdout: str) -> dict[int, float]:
    """Peak resident memory (MB) of every rank that reports it (one per stage)."""
    return {int(rank): float(mb) for rank, mb in _MEMORY.findall(stdout)}


def _peak(args: list[str], nproc: int = 1, plan: dict | None = None, tmp_path=None) -> float:
    result = run_pretrain(args, nproc=nproc, plan=plan, tmp_path=tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    peaks = peak_rss_mb(result.stdout)
    assert peaks, result.stdout[-2000:]
    return max(peaks.values())


def measured_drops(tmp_path) -> dict[str, float]:
    """MB saved per process by full recomputation (1 process) and by sequence parallelism
    (TP=2, 2 processes), same model and data."""
    single = MODEL + ["--global-batch-size", "4"]
    plain = _peak(single)
    recomputed = _peak(single + FULL_RECOMPUTE)
    tp2 = make_plan(tp=2, pp=1, dp=1, stages=[NUM_LAYERS], replicas=[1], rank_order=[0, 1], mbs=4)
    tensor_parallel = _peak(MODEL, nproc=2, plan=tp2, tmp_path=tmp_path)
    sequence_parallel = _peak(MODEL + ["--sequence-parallel"], nproc=2, plan=tp2, tmp_path=tmp_path)
    return {"plain": plain, "full recompute": recomputed, "recompute drop": plain - recomputed,
            "tp2": tensor_parallel, "tp2 + sp": sequence_parallel,
            "sequence parallel drop": tensor_parallel - sequence_parallel}


MB = 2**20
TOKENS_X_HIDDEN = 4 * 512 * 512  # micro-batch x sequence x hidden
ATTENTION_SCORES = 4 * 8 * 512 * 512  # micro-batch x heads x sequence x sequence


def test_recomputation_and_sequence_parallelism_lower_peak_memory(tmp_path):
    """Lower bounds from tensors each feature provably stops keeping (fp32): full
    recomputation keeps each layer's input only, so at least the softmax output of every
    layer but the one being recomputed goes; sequence parallelism halves (TP=2) at least the
    two norm inputs per layer. Seen here: 284 MB and 26 MB (bounds 96 and 16)."""
    drops = measured_drops(tmp_path)
    print("measured peak RSS (MB):", {k: round(v, 1) for k, v in drops.items()})
    assert drops["recompute drop"] >= (NUM_LAYERS - 1) * ATTENTION_SCORES * 4 / MB, drops
    assert drops["sequence parallel drop"] >= NUM_LAYERS * 2 * TOKENS_X_HIDDEN * 4 / 2 / MB, drops
