"""hetero-plan end to end: inputs, plan.json, explain, and the plan running under pretrain_gpt.py."""

import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import GPT_MODEL, TRAINING, assert_same_training, run_pretrain
from hetero.cli import main
from hetero.spec.cluster import Cluster
from hetero.errors import HeteroError
from hetero.spec.launch_script import pretrain_flags_of_script
from hetero.spec.presets import load_model
from hetero.predict.training_setup import TrainingSetup
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
def test_the_plan_of_a_launch_script_trains_the_same_model(tmp_path, gpt_reference):
    # The parity suite's test model and training, as a launch script; planned for the CPU
    # demo cluster from the script, then run with the flags the script passes.
    flags = GPT_MODEL + TRAINING + ["--use-distributed-optimizer"]
    script = tmp_path / "train.sh"
    script.write_text(f"MODEL_ARGS=({shlex.join(GPT_MODEL)})\nTRAINING_ARGS=(\n  {shlex.join(TRAINING)}\n)\n"
                      'torchrun --nproc-per-node 4 pretrain_gpt.py "${MODEL_ARGS[@]}" \\\n'
                      '    "${TRAINING_ARGS[@]}" --use-distributed-optimizer "$@"\n')
    assert pretrain_flags_of_script(script) == flags
    out = tmp_path / "plan.json"
    assert main(["--cluster", CPU_CLUSTER, "--megatron-script", str(script), "--no-fused-kernels", "-o", str(out),
                 "--quiet"]) == 0
    plan = Plan.load(out)
    assert (plan.micro_batch_size, plan.global_batch_size, plan.training.precision) == (2, 16, "fp32")
    env = {"HETERO_DEVICE": ",".join(d.device_type for d in plan.devices),
           "HETERO_VENDOR": ",".join(d.vendor for d in plan.devices)}
    result = run_pretrain(flags + ["--hetero-plan", str(out)], nproc=plan.world_size, env=env)
    assert_same_training(gpt_reference, result)
    assert re.search(r"use_distributed_optimizer \.+ True", result.stdout)


MEGATRON_FLAGS = GPT_MODEL + ["--global-batch-size", "16", "--train-iters", "2", "--lr", "1e-3", "--mock-data",
                              "--tokenizer-type", "NullTokenizer", "--vocab-size", "1100"]


@pytest.mark.parametrize("own,flags,layout", [
    ([], ["--tensor-model-parallel-size", "2", "--micro-batch-size", "1"], (2, 1, 1280)),
    # planned at TP 1 and 2: the padding of both degrees first, then again at the chosen one
    (["--tensor-parallel", "1,2", "--micro-batch-size", "2"], [], (1, 2, 1152)),
])
def test_a_plan_from_megatron_flags_is_what_the_run_accepts(own, flags, layout, tmp_path, monkeypatch):
    from megatron.hetero.startup import build_tokenizer, configure

    out = tmp_path / "plan.json"
    assert main(["--cluster", CPU_CLUSTER, "-o", str(out), "--quiet", "--skip-baseline", "--skip-upper-bound",
                 *own, "--", *MEGATRON_FLAGS, *flags]) == 0
    plan = Plan.load(out)
    assert (plan.tensor_parallel, plan.micro_batch_size, plan.model.vocab_size) == layout
    # pretrain_gpt.py's own start-up checks, with the flags the plan was made from
    monkeypatch.setenv("HETERO_DEVICE", plan.devices[0].device_type)
    configured = configure([*MEGATRON_FLAGS, *flags, "--hetero-plan", str(out)], plan.world_size)
    build_tokenizer(configured.args, configured.plan)
    assert configured.args.padded_vocab_size == layout[2]


def test_profiles_taken_at_another_padding_of_the_flags_vocabulary_are_used(tmp_path):
    """The profiler pads the vocabulary for the degrees it measured (TP 1: 1152), the run for
    the plan's (TP 2: 1280): the same model, so its profiles stand."""
    from hetero.spec.megatron_args import job_of_flags
    from hetero.spec.profiles import model_shape

    flags = MEGATRON_FLAGS + ["--tensor-model-parallel-size", "2", "--micro-batch-size", "1"]
    profiled = job_of_flags(flags).model_for((1,))
    for device in ("cpu-fast", "cpu-slow"):
        (tmp_path / f"{device}.json").write_text(json.dumps({
            "kind": "compute", "device_type": device, "precision": "fp32", "model": model_shape(profiled),
            "entries": [{"tensor_parallel": 2, "micro_batch_size": 1, "layer_forward_s": 0.01,
                         "layer_backward_s": 0.02}]}))
    out = tmp_path / "plan.json"
    argv = ["--cluster", CPU_CLUSTER, "-o", str(out), "--quiet", "--skip-baseline", "--skip-upper-bound",
            "--profiles", str(tmp_path), "--", *flags]
    assert main(argv) == 0
    plan = Plan.load(out)
    assert (profiled.vocab_size, plan.model.vocab_size) == (1152, 1280)
    # as profiled: 4 layers of 0.03 s per micro-batch, 16 micro-batches over two replicas, so at
    # least 8 x 0.12 s; these devices' stated speeds (the roofline) predict 0.09 s
    assert plan.prediction.iteration_time_s >= 8 * 4 * 0.03
    other = MEGATRON_FLAGS[:-1] + ["1300", "--tensor-model-parallel-size", "2"]  # another tokenizer
    assert main(argv[:-len(flags)] + other) == 2


@pytest.mark.parametrize("own,flags,fragment", [
    (["--model", "llama2-7b"], MEGATRON_FLAGS, "give the model once"),
    (["--precision", "bf16", "--no-dropout"], MEGATRON_FLAGS, "--precision (--bf16 / --fp16), --no-dropout"),
    (["--micro-batch-size", "4"], MEGATRON_FLAGS + ["--micro-batch-size", "2"],
     "--micro-batch-size 4 contradicts the flags' --micro-batch-size 2"),
    (["--global-batch-size", "32"], MEGATRON_FLAGS, "--global-batch-size 32 contradicts the flags'"),
    ([], [f for f in MEGATRON_FLAGS if f not in ("--global-batch-size", "16")], "leave out --global-batch-size"),
    ([], MEGATRON_FLAGS + ["--num-layer", "4"], "--num-layer (did you mean --num-layers?)"),
    ([], [], "no model: give --model"),
])
def test_flags_and_hetero_plans_own_options_must_agree(own, flags, fragment, capsys):
    argv = ["--cluster", CPU_CLUSTER, "-o", "unused.json", "--quiet", "--skip-baseline", "--skip-upper-bound", *own]
    assert main([*argv, "--", *flags] if flags else argv) == 2
    assert fragment in capsys.readouterr().err


def test_a_pipeline_depth_the_flags_fix_is_the_plans(tmp_path):
    """The search keeps to the flags' --pipeline-model-parallel-size (the run would refuse
    another depth), even where it would rather choose another."""
    out = tmp_path / "plan.json"
    for depth in (1, 3):
        assert main(["--cluster", CPU_CLUSTER, "-o", str(out), "--quiet", "--skip-upper-bound", "--",
                     *MEGATRON_FLAGS, "--pipeline-model-parallel-size", str(depth)]) == 0
        assert Plan.load(out).pipeline_parallel == depth


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
