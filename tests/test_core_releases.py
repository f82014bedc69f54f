"""Checkpoints across the tested megatron-core releases: ours saved under 0.16.1 resume
under 0.19.2 (and the other way) under a heterogeneous plan, continuing the same training.
The runs tokenize with GPT-2's BPE, which both releases' Megatron-LM read alike (their
NullTokenizers count --vocab-size differently: the mock data would differ).

Each side runs in a fresh interpreter on its release: 0.19.2 with the folder `make test`
installs it into (.core019) first on PYTHONPATH, 0.16.1 with that folder taken off.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_tokenizers  # noqa: E402
from conftest import GPT_MODEL, REPO, TRAINING, make_plan, run_pretrain  # noqa: E402

SIX = GPT_MODEL + TRAINING + ["--train-iters", "6"]
# Uneven stages at their own tensor-parallel degrees, ranks permuted; unequal replicas.
STAGE_TP_PLAN = make_plan(tp=1, pp=2, dp=1, stages=[3, 1], replicas=[8], rank_order=[2, 0, 1], stage_tp=[2, 1])
UNEVEN = make_plan(tp=1, pp=2, dp=2, stages=[1, 3], replicas=[5, 3], rank_order=[1, 3, 0, 2])

CORE019 = REPO / ".core019"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CORE019 / "megatron" / "core").is_dir(),
                       reason="megatron-core 0.19.2 is not installed in .core019 (make test installs it)"),
]


def _environment(release: str) -> dict:
    """PYTHONPATH for a run on ``release``: .core019 first for 0.19.2; without any folder that
    holds megatron-core for 0.16.1 (.venv's)."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not (Path(p) / "megatron" / "core").is_dir()]
    if release == "0.19.2":
        kept.insert(0, str(CORE019))
    return {"PYTHONPATH": os.pathsep.join(kept)}


def _run(args, release, tokenizer_dir, **kwargs):
    # a fresh interpreter on the release: the suite's job server runs the release it was started on
    vocab, merges = tiny_tokenizers.gpt2_bpe_files(tokenizer_dir)
    args = args + ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges)]
    result = run_pretrain(args, launcher="torchrun", env=_environment(release), **kwargs)
    assert result.returncode == 0, result.output[-3000:]
    assert f"> megatron-core {release} patches applied" in result.stdout, result.stdout[-3000:]
    return result


def _assert_continues(resumed, reference):
    got, want = resumed.iteration_losses(), reference.iteration_losses()
    assert sorted(got) == [4, 5, 6], resumed.output[-3000:]
    for i in (4, 5, 6):  # re-sharded: reductions in another order, so equal to rounding
        assert math.isclose(got[i], want[i], rel_tol=1e-5), (i, got[i], want[i])


@pytest.mark.parametrize("saved_by, resumed_by, plan, nproc", [
    ("0.16.1", "0.19.2", STAGE_TP_PLAN, 3),
    ("0.19.2", "0.16.1", UNEVEN, 4),
], ids=["0.16.1-to-0.19.2", "0.19.2-to-0.16.1"])
def test_a_checkpoint_resumes_under_the_other_release_and_another_plan(saved_by, resumed_by, plan, nproc, tmp_path):
    root = tmp_path / "ckpt"
    reference = _run(SIX + ["--save", str(root), "--save-interval", "3"], saved_by, tmp_path / "gpt2")
    resumed = _run(SIX + ["--load", str(root), "--ckpt-step", "3"], resumed_by, tmp_path / "gpt2", nproc=nproc,
                   plan=plan, tmp_path=tmp_path)
    assert "tensors re-sharded" in resumed.stdout
    _assert_continues(resumed, reference)
