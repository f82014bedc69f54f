"""The planned job the Slurm tests and bench run on tools/emulator/slurm.py's cluster of node0
(two H100s), node1 and node2 (one A100 each): discover -> hetero-plan -> the same job by hand.

    plan = heterogeneous_plan(workdir, slurm)    # PP=2, stages of 3 and 1 layers, ...
    wait("the first checkpoint", lambda: ..., timeout=120, output=slurm_out)

One home for it, so that what tests/test_slurm_launch.py checks is what
bench/slurm_recovery_bench.py measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import yaml

REPO = Path(__file__).resolve().parent.parent.parent
TINY_GPT = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
            "num_query_groups": 4, "seq_length": 32, "vocab_size": 1024, "swiglu": False,
            "untie_embeddings_and_output_weights": False, "add_bias_linear": True,
            "normalization": "LayerNorm", "position_embedding_type": "learned_absolute"}
GLOBAL_BATCH = 64  # the planner uses every device for it (for 16 it leaves the A100s out)
HOSTS = ["node0", "node0", "node1", "node2"]  # the planner's placement the hand-made plan keeps

T = TypeVar("T")


def cli(slurm, *argv: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m ARGV` against the cluster (SLURM_CONF set); an error when it fails."""
    env = slurm.env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"`python -m {' '.join(argv)}` failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done


def heterogeneous_plan(workdir: Path, slurm) -> Path:
    """discover -> hetero-plan -> the same job by hand: PP=2 with stages of 3 and 1 layers,
    replicas of 18 and 14 micro-batches, logical ranks swapped within each stage. The recorded
    model, training and cluster stay, so that the driver can plan the job again."""
    from hetero.jobs import explain
    from hetero.plan import Plan

    cli(slurm, "hetero", "discover", "--slurm", "--partition", "h100", "--partition", "a100",
        "--device-map", "a100=A100-80GB", "--nic", "ib:3200", "--inter-group", "ib:3200", "-o", "cluster.yaml",
        cwd=workdir)
    (workdir / "tiny_gpt.yaml").write_text(yaml.safe_dump(TINY_GPT))
    cli(slurm, "hetero", "--cluster", "cluster.yaml", "--model", "tiny_gpt.yaml", "--global-batch-size",
        str(GLOBAL_BATCH), "--seq-length", "32", "--micro-batch-size", "2", "--precision", "fp32",
        "--no-fused-kernels", "--no-dropout", "--skip-baseline", "--skip-upper-bound", "--quiet",
        "-o", "planned.json", cwd=workdir)
    plan = json.loads((workdir / "planned.json").read_text())
    hosts = [d["host"] for d in plan["devices"]]
    if hosts != HOSTS:
        raise RuntimeError(f"the planner placed the job on {hosts}, not {HOSTS}")
    plan.update(pipeline_parallel=2, data_parallel=2, stages=[{"num_layers": 3}, {"num_layers": 1}],
                replicas=[{"num_micro_batches": 18}, {"num_micro_batches": 14}], rank_order=[1, 0, 3, 2])
    plan["prediction"] = explain(Plan.from_dict(plan), "the hand-made plan")[0].to_dict()
    path = workdir / "plan.json"
    path.write_text(json.dumps(plan, indent=1))
    return path


def wait(what: str, ready: Callable[[], T], timeout: float, output: Path | None = None) -> T:
    """ready()'s first true answer; TimeoutError after timeout seconds, with the tail of the
    job's output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = ready()
        if found:
            return found
        time.sleep(0.2)
    tail = output.read_text()[-6000:] if output is not None and output.exists() else ""
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")
