"""One validation of a plan for its model and precision, shared by pretrain_gpt.py,
hetero-plan (it writes only plans the runtime runs) and hetero-plan explain."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from hetero.errors import HeteroError
from hetero.jobs import plan_job
from hetero.plan import Plan
from hetero.runtime_rules import model_problems, precision_problems, runtime_problems
from hetero.search.planner import PlannerOptions
from hetero.spec.catalog import DEVICES
from hetero.spec.cluster import Cluster
from hetero.spec.model import ModelSpec
from hetero.spec.presets import load_model

SAILOR = REPO / "examples" / "clusters" / "sailor_like_128.yaml"


@pytest.fixture(scope="module")
def sailor_plan(tmp_path_factory) -> tuple[Plan, str]:
    """A plan hetero-plan writes for A100-40GB + V100-16GB (fp16: V100 has no bf16)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    out = subprocess.run([sys.executable, "-m", "hetero", "--cluster", str(SAILOR), "--model", "opt-350m",
                          "--global-batch-size", "256", "--seq-length", "2048", "--skip-upper-bound",
                          "--quiet", "-o", str(path)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return Plan.load(path), str(path)


def _explain(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetero", "explain", str(path)], cwd=REPO,
                          capture_output=True, text=True)


def test_what_hetero_plan_writes_the_runtime_runs(sailor_plan):
    plan, path = sailor_plan
    assert plan.training.precision == "fp16"
    assert runtime_problems(plan, plan.model.spec(), plan.training.precision, Cluster.load(SAILOR).devices) == []
    assert _explain(path).returncode == 0


def test_explain_refuses_a_plan_the_runtime_refuses_with_the_runtimes_message(sailor_plan, tmp_path):
    """The plan edited to bf16 on V100s: explain exits 2 with the message pretrain_gpt.py
    gives for it (the runtime's check, called on the same plan)."""
    import argparse

    from megatron.hetero.arguments import check_precision_supported

    plan, _ = sailor_plan
    data = plan.to_dict()
    data["training"]["precision"] = "bf16"
    edited = tmp_path / "bf16.json"
    edited.write_text(json.dumps(data))
    out = _explain(edited)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "pretrain_gpt.py would refuse this plan" in out.stderr
    assert "Traceback" not in out.stderr
    with pytest.raises(HeteroError) as runtime:
        check_precision_supported(argparse.Namespace(params_dtype="bf16"), Plan.load(edited))
    assert str(runtime.value) in out.stderr
    assert "--bf16 is not supported by V100-16GB" in str(runtime.value)


def test_fp8_is_priced_but_never_written():
    problems = precision_problems("fp8", ["H100-80GB"], DEVICES)
    assert problems and "FP8" in problems[0] and "--precision bf16" in problems[0]
    cluster = Cluster.from_dict({"name": "h", "groups": [{"name": "g", "nodes": [
        {"host": "h0", "device": "H100-80GB", "count": 8, "intra_link": "nvlink4", "nic": {"kind": "ib", "gbps": 400}}]}]})
    with pytest.raises(HeteroError, match="FP8/FP4 training needs transformer-engine"):
        plan_job(cluster, load_model("gpt-1.7b").with_seq_length(2048), 64, PlannerOptions(), precision="fp8")


def test_degrees_that_do_not_divide_the_model_are_named():
    plan = Plan.uniform(tensor_parallel=4, pipeline_parallel=1, data_parallel=1, micro_batch_size=1,
                        num_layers=2, global_batch_size=4, devices=_devices(4))
    model = ModelSpec(num_layers=2, hidden_size=96, num_attention_heads=6, seq_length=128, vocab_size=1024)
    problems = model_problems(plan, model)
    assert any("--num-attention-heads 6 is not divisible by the tensor-parallel size 4" in p for p in problems)


def _devices(n: int):
    from hetero.plan_entries import DeviceEntry

    return [DeviceEntry(host="h", device_type="A100-80GB", vendor="nvidia")] * n
