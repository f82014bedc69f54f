"""hetero-plan end to end: inputs, plan.json, explain, and the plan running under pretrain_gpt.py."""

import json
import re
from pathlib import Path

import pytest

from conftest import GPT_MODEL, TRAINING, assert_same_training, run_pretrain
from hetero.cli import main
from hetero.spec.cluster import Cluster
from hetero.errors import HeteroError
from hetero.spec.model import load_model
from hetero.predict.costs import TrainingSetup
from hetero.plan import Plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CPU_CLUSTER = str(EXAMPLES / "clusters" / "cpu_demo.yaml")


def _plan(tmp_path, *extra) -> tuple[int, Path]:
    out = tmp_path / "plan.json"
    code = main(["--cluster", str(EXAMPLES / "clusters" / "sailor_like_128.yaml"), "--model", "llama2-7b",
                 "--global-batch-size", "256", "--seq-length", "2048", "-o", str(out), "--quiet", *extra])
    return code, out


def test_writes_a_plan_with_its_prediction_and_explains_it(tmp_path, capsys):
    code, out = _plan(tmp_path, "--timeline", str(tmp_path / "plan.png"))
    assert code == 0
    printed = capsys.readouterr().out
    for fragment in ("layout     TP=", "predicted  iteration", "of the upper bound", "baseline   Megatron",
                     "speed-up", "devices    type"):
        assert fragment in printed
    data = json.loads(out.read_text())
    prediction = data["prediction"]
    for key in ("iteration_time_s", "tokens_per_s", "upper_bound", "fraction_of_upper_bound", "baseline",
                "speedup_over_baseline", "peak_memory_gib", "tflops_per_device"):
        assert key in prediction
    assert prediction["speedup_over_baseline"] >= 1.0
    training = data["training"]
    assert {k: training[k] for k in ("global_batch_size", "seq_length", "precision", "distributed_optimizer",
                                     "fused_kernels", "dropout")} == {
        "global_batch_size": 256, "seq_length": 2048, "precision": "fp16", "distributed_optimizer": True,
        "fused_kernels": True, "dropout": True}
    # V100s have no bf16: the planner chose fp16 on every device over bf16 on the A100s alone
    assert training["precision_reason"] == "fp16 on all devices (V100-16GB has no bf16)"
    assert "precision  fp16 on all devices (V100-16GB has no bf16)" in printed
    assert TrainingSetup.from_dict(training).recompute in ("none", "selective", "full")
    plan = Plan.load(out)
    assert plan.global_batch_size == 256 and plan.world_size <= 128
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["explain", str(out), "--timeline", str(tmp_path / "again.png"), "--memory"]) == 0
    explained = capsys.readouterr().out
    assert f"iteration {prediction['iteration_time_s']:.3f} s" in explained
    assert "weights  grads  optim" in explained
    assert (tmp_path / "again.png").stat().st_size > 10_000

    # A training log of the plan: its median logged iteration after the first line, against it.
    predicted = prediction["iteration_time_s"]
    log = tmp_path / "train.log"
    log.write_text("".join(
        f" [2026-11-25 10:00:0{i}] iteration {5 * i:8d}/      30 | consumed samples: {80 * i:12d} | "
        f"elapsed time per iteration (ms): {ms:.1f} | tokens per second: 1.0 |\n"
        for i, ms in enumerate([9999.0, predicted * 1e3 * 1.25, predicted * 1e3 * 1.20, predicted * 1e3 * 1.30], 1)))
    assert main(["explain", str(out), "--measured", str(log)]) == 0
    compared = capsys.readouterr().out.splitlines()[-1]
    assert compared.startswith(f"measured   iteration {predicted * 1.25:.3f} s (median of 3 logged intervals")
    assert compared.endswith(f"prediction {1 / 1.25 - 1:+.1%}")


@pytest.mark.parametrize("change, fragment", [
    (lambda c: c["groups"][0]["nodes"][0].update(device="B200"), "unknown device 'B200'"),
    (lambda c: c["groups"][0]["nodes"][0].update(count=0), "groups[0].nodes[0].count: Input should be greater than or equal to 1"),
    (lambda c: c["groups"][0]["nodes"][0].update(intra_link="nvlink9"), "unknown intra_link 'nvlink9'"),
    (lambda c: c["groups"].append({"name": "other", "nodes": [dict(c["groups"][0]["nodes"][0], host="x")]}),
     "have no inter_group link"),
])
def test_bad_cluster_specs(change, fragment):
    import yaml

    data = yaml.safe_load(Path(CPU_CLUSTER).read_text())
    change(data)
    with pytest.raises(HeteroError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        Cluster.from_dict(data, "c.yaml")


def test_bad_model_and_missing_profiles(tmp_path, capsys):
    with pytest.raises(HeteroError, match="neither a preset"):
        load_model("llama9-1t")
    (tmp_path / "profiles").mkdir()
    code, _ = _plan(tmp_path, "--profiles", str(tmp_path / "profiles"))
    assert code == 2
    err = capsys.readouterr().err
    assert "no bf16 compute profile of this model shape for A100-40GB, V100-16GB" in err
    assert "--roofline-for-missing" in err


@pytest.mark.slow
def test_the_plan_it_writes_trains_the_same_model(tmp_path, gpt_reference):
    # The test model of the parity suite, planned for the CPU demo cluster.
    (tmp_path / "model.yaml").write_text(
        "num_layers: 4\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\nvocab_size: 1024\n"
        "max_position_embeddings: 32\n")
    out = tmp_path / "plan.json"
    assert main(["--cluster", CPU_CLUSTER, "--model", str(tmp_path / "model.yaml"),
                 "--global-batch-size", "16", "--seq-length", "32", "--micro-batch-size", "2",
                 "--precision", "fp32", "--no-fused-kernels", "--no-dropout", "-o", str(out), "--quiet"]) == 0
    plan = Plan.load(out)
    env = {"HETERO_DEVICE": ",".join(d.device_type for d in plan.devices),
           "HETERO_VENDOR": ",".join(d.vendor for d in plan.devices)}
    result = run_pretrain(GPT_MODEL + TRAINING + ["--hetero-plan", str(out)], nproc=plan.world_size, env=env)
    assert_same_training(gpt_reference, result)
    # The plan chose the distributed optimizer; the run took it from the plan.
    assert re.search(r"use_distributed_optimizer \.+ True", result.stdout)


def test_a_plan_for_another_model_is_refused(tmp_path):
    (tmp_path / "model.yaml").write_text(
        "num_layers: 4\nhidden_size: 128\nnum_attention_heads: 4\nseq_length: 32\nvocab_size: 1024\n")
    out = tmp_path / "plan.json"
    assert main(["--cluster", CPU_CLUSTER, "--model", str(tmp_path / "model.yaml"), "--global-batch-size", "16",
                 "--seq-length", "32", "--micro-batch-size", "2", "--precision", "fp32", "-o", str(out),
                 "--quiet", "--skip-baseline", "--skip-upper-bound"]) == 0
    result = run_pretrain(GPT_MODEL + TRAINING + ["--hetero-plan", str(out)], timeout=120)
    assert result.returncode == 2
    assert "the plan was made for another model or precision (hidden-size: plan 128, flags 64;" in result.stderr
    # every field is compared after Megatron's defaults, the derived ones too
    assert "ffn-hidden-size: plan 512, flags 256" in result.stderr
