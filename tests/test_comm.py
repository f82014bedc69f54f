"""The ``hetero`` torch.distributed backend (hetero_comm, csrc/) against plain gloo.

Processes on 127.0.0.1 are labelled with vendors; gloo stands in for NCCL/RCCL inside a
vendor. Each world is started once and runs every operation, dtype and shape inside it
(tests/comm_worker.py), comparing with a gloo group over the same ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import GPT_MODEL, TRAINING, assert_same_training, make_plan, run_pretrain
from hetero.env import unused_port

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "comm_worker.py"


def run_world(scenario: str, vendors: list[str], tmp_path: Path, env: dict | None = None,
              timeout: float = 150) -> list[dict]:
    """Starts one worker per vendor label (rank order) and returns their reports."""
    port = unused_port()
    procs = []
    for rank, vendor in enumerate(vendors):
        rank_env = {
            **os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(len(vendors)),
            "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "HETERO_VENDOR": vendor, **(env or {}),
        }
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(tmp_path)], cwd=REPO, env=rank_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n" + "\n".join(o[-3000:] for o in outputs)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(vendors))]


def assert_all_passed(reports: list[dict], min_cases: int) -> None:
    for report in reports:
        assert not report["failures"], f"rank {report['rank']}:\n" + "\n".join(report["failures"])
        assert report["cases"] >= min_cases, report


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_vendors_three_plus_one(tmp_path):
    """3+1 ranks (vendor order = rank order), default 4 MiB chunks and a 6 MB tensor; a
    one-vendor subgroup is plain gloo, a subgroup of two one-member vendors is a bare bridge."""
    reports = run_world("two_vendors", ["nvidia", "nvidia", "nvidia", "amd"], tmp_path)
    assert_all_passed(reports, min_cases=300)
    modes = {g["name"]: g["mode"] for g in reports[0]["groups"]}
    assert modes == {"world": "hierarchical", "subgroup [0, 1, 2]": "native",
                     "subgroup [3, 0]": "hierarchical"}, modes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_vendors_interleaved_small_chunks(tmp_path):
    """Three vendors interleaved in rank order (2+3+1), 1 KiB chunks so that most tensors
    take several pipelined chunks, subgroups crossing vendors, and the C++ pass-through
    mode for a one-vendor subgroup."""
    vendors = ["nvidia", "amd", "nvidia", "intel", "amd", "nvidia"]
    env = {"HETERO_COMM_CHUNK_BYTES": "1024", "HETERO_COMM_WRAP_SINGLE_VENDOR": "1"}
    reports = run_world("three_vendors", vendors, tmp_path, env=env)
    assert_all_passed(reports, min_cases=300)
    modes = {g["name"]: g["mode"] for r in reports for g in r["groups"]}
    assert modes == {"world": "hierarchical", "subgroup [1, 2, 3, 5]": "hierarchical",
                     "subgroup [0, 3]": "hierarchical", "subgroup [0, 2, 5]": "pass-through"}, modes


def test_registered_and_vendor_resolution(monkeypatch):
    import hetero_comm

    assert "hetero" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["hetero"] == ["cpu", "cuda"]
    monkeypatch.setenv("HETERO_VENDOR", "NVIDIA,amd")
    monkeypatch.setenv("LOCAL_RANK", "1")
    hetero_comm.set_vendor(None)
    assert hetero_comm.get_vendor() == "amd"
    hetero_comm.set_vendor("Intel")
    try:
        assert hetero_comm.get_vendor() == "intel"  # set_vendor wins over the environment
    finally:
        hetero_comm.set_vendor(None)
    monkeypatch.setenv("HETERO_COMM_CHUNK_BYTES", "0")
    with pytest.raises(ValueError, match="HETERO_COMM_CHUNK_BYTES"):
        hetero_comm.chunk_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["ddp", "distopt"])
def test_training_parity_over_two_vendors(tmp_path, gpt_reference, optimizer):
    """The loss-parity run of test_parity.py with --distributed-backend hetero and the
    plan's devices on two vendors, placed so that both data-parallel groups and both
    pipeline groups cross vendors (launch ranks 0, 3: nvidia; 1, 2: amd; rank_order puts
    logical ranks 0-3 on launch ranks 2, 0, 3, 1). Gradients are all-reduced (DDP) or
    reduce-scattered and the parameters all-gathered (distributed optimizer) across
    vendors. The vendors come from the plan: HETERO_DEVICE=cpu without HETERO_VENDOR
    leaves the vendor check to the plan's labels."""
    labels = ["nvidia", "amd", "amd", "nvidia"]
    devices = [{"host": "localhost", "device_type": "cpu", "vendor": v} for v in labels]
    plan = make_plan(tp=1, pp=2, dp=2, stages=[3, 1], replicas=[5, 3], rank_order=[2, 0, 3, 1],
                     devices=devices)
    result = run_pretrain(GPT_MODEL + TRAINING + ["--distributed-backend", "hetero"] + optimizer,
                          nproc=4, plan=plan, tmp_path=tmp_path, env={"HETERO_DEVICE": "cpu"})
    assert_same_training(gpt_reference, result)
