"""Helpers that launch real pretrain_gpt.py jobs (torchrun on 127.0.0.1, gloo) and read their logs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A GPT-2 style model (tied embeddings, LayerNorm, learned positions, GELU) ...
GPT_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
]
# ... and a Llama style one (SwiGLU, RMSNorm, RoPE, grouped-query attention, untied).
LLAMA_MODEL = GPT_MODEL + [
    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--group-query-attention", "--num-query-groups", "2",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]
TRAINING = [
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "5",
    "--lr", "1e-3", "--lr-decay-style", "cosine",  # no warm-up: every step updates
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
    "--seed", "1234", "--log-params-norm",
]

_ITERATION = re.compile(r"^ \[[^]]+\] iteration\s+(\d+)/\s*\d+ \|(.*)$", re.MULTILINE)


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def series(self, field: str) -> list[float]:
        """One field of every iteration line (log interval 1), in order."""
        lines = _ITERATION.findall(self.stdout)
        assert [int(i) for i, _ in lines] == list(range(1, len(lines) + 1)), self.output[-3000:]
        return [float(re.search(rf" {field}: ([0-9.E+-]+) \|", rest).group(1)) for _, rest in lines]

    def losses(self) -> list[float]:
        return self.series("lm loss")


def cpu_devices(n: int, host: str = "localhost") -> list[dict]:
    return [{"host": host, "device_type": "cpu", "vendor": "cpu", "nic": "loopback"}] * n


def make_plan(tp: int, pp: int, dp: int, stages, replicas, rank_order, devices=None, mbs: int = 2) -> dict:
    return {
        "version": 1,
        "tensor_parallel": tp,
        "pipeline_parallel": pp,
        "data_parallel": dp,
        "micro_batch_size": mbs,
        "stages": [{"num_layers": n} for n in stages],
        "replicas": [{"num_micro_batches": n} for n in replicas],
        "rank_order": rank_order,
        "devices": devices or cpu_devices(tp * pp * dp),
    }


def run_pretrain(
    args: list[str],
    nproc: int = 1,
    plan: dict | None = None,
    tmp_path: Path | None = None,
    env: dict | None = None,
    timeout: float = 600,
) -> RunResult:
    """Runs pretrain_gpt.py: plain python for one process, torchrun for several."""
    args = list(args)
    if plan is not None:
        assert tmp_path is not None
        plan_path = tmp_path / f"plan_{len(list(tmp_path.glob('plan_*.json')))}.json"
        plan_path.write_text(json.dumps(plan))
        args += ["--hetero-plan", str(plan_path)]
    script = str(REPO / "pretrain_gpt.py")
    if nproc == 1:
        command = [sys.executable, script, *args]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", script, *args,
        ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(variable, None)
    proc = subprocess.run(
        command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    return RunResult(proc.returncode, proc.stdout, proc.stderr)


def assert_same_training(reference: RunResult, candidate: RunResult, rtol: float = 1e-4) -> None:
    """Same lm loss and params norm at every iteration, up to rtol (relative)."""
    assert candidate.returncode == 0, candidate.output[-3000:]
    for field in ("lm loss", "params norm"):
        ref, got = reference.series(field), candidate.series(field)
        assert len(ref) == len(got) > 0, (field, ref, got)
        for i, (a, b) in enumerate(zip(ref, got), start=1):
            assert abs(a - b) <= rtol * abs(a), f"{field} at iteration {i}: {a} vs {b} ({ref} vs {got})"


def _reference(model: list[str]) -> RunResult:
    result = run_pretrain(model + TRAINING)
    assert result.returncode == 0, result.output[-3000:]
    return result


@pytest.fixture(scope="session")
def gpt_reference() -> RunResult:
    """The GPT model trained by one process without a plan, fp32."""
    return _reference(GPT_MODEL)


@pytest.fixture(scope="session")
def llama_reference() -> RunResult:
    return _reference(LLAMA_MODEL)
