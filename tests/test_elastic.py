"""Elastic runs: a job that loses a node re-plans for the survivors and finishes without a
person, and what it trains after the loss is what a resume by hand would train.

The job runs on the emulated cpu_demo cluster (a fast node and a slow node, one torchrun
each in its own network namespace); the slow node is killed - launcher and workers -
once a checkpoint exists.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import GPT_MODEL, REPO, TRAINING, assert_nothing_left, run_pretrain
from hetero.spec.cluster import Cluster
from hetero.events import CheckpointLoaded, LostRank, LostRanks, losses, of_kind, read_events
from hetero.launch.elastic import (AttemptResult, cluster_without, lost_hosts, predicted_tokens_per_s, replan,
                                   with_load)
from hetero.errors import HeteroError
from hetero.plan import Plan
from tools.emulator import EmulatedCluster
from tools.emulator.cluster import kill_node

CLUSTER = REPO / "examples" / "clusters" / "cpu_demo.yaml"
TINY_GPT = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
            "num_query_groups": 4, "seq_length": 32, "vocab_size": 1024, "swiglu": False,
            "untie_embeddings_and_output_weights": False, "add_bias_linear": True,
            "normalization": "LayerNorm", "position_embedding_type": "learned_absolute"}


def _plan(tmp_path: Path) -> Path:
    model = tmp_path / "tiny_gpt.yaml"
    model.write_text(yaml.safe_dump(TINY_GPT))
    plan = tmp_path / "plan.json"
    subprocess.run([sys.executable, "-m", "hetero.cli", "--cluster", str(CLUSTER), "--model", str(model),
                    "--global-batch-size", "16", "--seq-length", "32", "--micro-batch-size", "2",
                    "--precision", "fp32", "--no-fused-kernels", "--no-dropout", "--skip-baseline",
                    "--skip-upper-bound", "--quiet", "-o", str(plan)], cwd=REPO, check=True,
                   capture_output=True)
    return plan


def supervise(tmp_path: Path, cluster: Path, plan: Path, train: list[str], kill: list[str], when: str,
              settle_s: float = 0.0) -> tuple[list[str], float]:
    """Runs the job under the emulator's elastic supervisor, kills the nodes ``kill`` (launcher
    and workers) settle_s after a line containing ``when``, and waits for the supervisor to
    finish (exit 0) with nothing left behind. Returns the output and the time of the kill."""
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "tools.emulator", "--cluster", str(cluster), "--plan", str(plan), "--elastic",
         "--run-dir", str(tmp_path / "runs"), "--", "pretrain_gpt.py", *train],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        for line in supervisor.stdout:
            lines.append(line)
            if when in line:
                break
        time.sleep(settle_s)
        killed_at = time.time()
        for host in kill:
            assert kill_node(host) > 0, "".join(lines)[-3000:]
        lines += supervisor.stdout.readlines()
        assert supervisor.wait(timeout=600) == 0, "".join(lines)[-5000:]
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
    assert_nothing_left(str(tmp_path))  # the lost attempt's ranks on the surviving node too
    return lines, killed_at


# ----- the pieces, without processes ------------------------------------------------------


def test_lost_hosts_are_killed_launchers_and_hosts_others_report():
    plan = Plan.from_dict({"version": 1, "tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 3,
                           "micro_batch_size": 1, "stages": [{"num_layers": 2}],
                           "replicas": [{"num_micro_batches": 1}] * 3, "rank_order": [0, 1, 2],
                           "devices": [{"host": h, "device_type": "cpu", "vendor": "cpu"}
                                       for h in ("a", "b", "c")]})
    report = LostRanks(launch_rank=0, host="a", cause="a neighbour stopped answering",
                       lost=[LostRank(launch_rank=2, logical_rank=2, host="c", pid=9, why="no heartbeat for 11 s")])
    assert lost_hosts(AttemptResult(1, {"b"}, events=[report]), plan) == {"b", "c"}
    # Nothing recorded -> nothing lost, whatever the log says (more cases: test_events.py).
    assert lost_hosts(AttemptResult(2, set(), ["[launch rank 0] error: the job lost launch rank 2 "
                                                "(logical rank 2, host c, pid 9): gone\n"]), plan) == set()


def test_cluster_without_drops_nodes_groups_and_their_links():
    cluster = Cluster.load(REPO / "examples" / "clusters" / "holmes_like.yaml")
    gone = {cluster.nodes[0].host, cluster.nodes[1].host}
    smaller = cluster_without(cluster, gone)
    assert [n.host for n in smaller.nodes] == [n.host for n in cluster.nodes if n.host not in gone]
    with pytest.raises(HeteroError, match="every node of the cluster is lost"):
        cluster_without(cluster, {n.host for n in cluster.nodes})


def test_replan_plans_the_recorded_job_on_the_survivors(tmp_path):
    plan = Plan.load(_plan(tmp_path))
    again = replan(plan, {"node-slow"})
    assert {h for h, _ in again.hosts()} == {"node-fast"}
    assert again.global_batch_size == plan.global_batch_size and again.micro_batch_size == plan.micro_batch_size
    assert again.model == plan.model and again.training == plan.training
    assert [n.host for g in again.cluster.groups for n in g.nodes] == ["node-fast"]
    assert 0 < predicted_tokens_per_s(again) < predicted_tokens_per_s(plan)
    hand_written = Plan.from_dict({k: v for k, v in plan.to_dict().items() if k not in ("model", "cluster")})
    assert predicted_tokens_per_s(hand_written) == predicted_tokens_per_s(plan)
    with pytest.raises(HeteroError, match="the plan has no cluster, model section"):
        replan(Plan.from_dict({**hand_written.to_dict(), "prediction": None}), {"node-slow"})


def test_elastic_needs_save():
    with pytest.raises(HeteroError, match="--elastic needs --save DIR"):
        with_load(["--train-iters", "5"])
    assert with_load(["--save", "d"]) == ["--save", "d", "--load", "d"]


# ----- a real job -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(bool(EmulatedCluster.missing_prerequisites()),
                    reason="emulator unavailable: " + "; ".join(EmulatedCluster.missing_prerequisites()))
def test_a_job_that_loses_a_node_finishes_on_the_other_as_a_hand_resume_would(tmp_path):
    plan = _plan(tmp_path)
    assert {h for h, _ in Plan.load(plan).hosts()} == {"node-fast", "node-slow"}
    save = tmp_path / "ckpt"
    train = GPT_MODEL + TRAINING + ["--lr-decay-style", "constant", "--train-iters", "10",
                                    "--save", str(save), "--save-interval", "2"]
    lines, _ = supervise(tmp_path, CLUSTER, plan, train, ["node-slow"],
                         when="successfully saved checkpoint from iteration       2")
    output = "".join(lines)
    replanned = re.search(r"elastic: lost node-slow; re-planned for node-fast: (.*); predicted "
                          r"([0-9,]+) -> ([0-9,]+) tokens/s; wrote (\S+);", output)
    assert replanned, output[-4000:]
    assert "elastic: the job finished (attempt 1)" in output
    # What the second attempt recorded (hetero.events), in its own directory of the run dir.
    second = read_events(tmp_path / "runs" / "attempt-1-events")
    (loaded,) = of_kind(second, CheckpointLoaded)
    resumed_at = loaded.iteration
    after_loss = losses(second)
    assert sorted(after_loss) == list(range(resumed_at + 1, 11))

    # By hand: the same checkpoint under the new plan, on the fast node's two devices.
    by_hand = run_pretrain(train[:-4] + ["--load", str(save), "--ckpt-step", str(resumed_at),
                                         "--hetero-plan", replanned.group(4)],
                           nproc=2, env={"HETERO_DEVICE": "cpu-fast", "HETERO_VENDOR": "cpu"}, timeout=300)
    assert by_hand.returncode == 0, by_hand.output[-3000:]
    assert by_hand.iteration_losses() == after_loss  # bit for bit


@pytest.mark.slow
def test_a_re_plan_at_another_tensor_parallel_degree_keeps_the_trained_vocabulary(tmp_path):
    """A tokenizer of 1,101 tokens pads to 1,152 at TP 1 and to 1,280 at TP 2. Planned at TP 1,
    trained and saved; planned again at TP 2 (as a re-plan after a lost node may choose), the
    plan keeps the trained 1,152 rows (--make-vocab-size-divisible-by 64 gives them at TP 2,
    and the restart passes it); the run resumes as one process continues the same training."""
    import dataclasses
    import json

    from hetero.cli import main
    from hetero.job import Job
    from hetero.jobs import plan_for

    flags = [*GPT_MODEL, *TRAINING, "--train-iters", "6"]
    flags[flags.index("--vocab-size") + 1] = "1100"
    fast_node = tmp_path / "fast_node.yaml"
    spec = yaml.safe_load(CLUSTER.read_text())
    spec["groups"][0]["nodes"] = spec["groups"][0]["nodes"][:1]
    fast_node.write_text(yaml.safe_dump(spec))
    first = tmp_path / "plan.json"
    assert main(["--cluster", str(fast_node), "--tensor-parallel", "1", "--skip-baseline", "--skip-upper-bound",
                 "--quiet", "-o", str(first), "--", *flags]) == 0
    trained = Plan.load(first)
    assert trained.max_tensor_parallel == 1 and trained.model.vocab_size == 1152
    job = Job.of_record(trained)
    again = plan_for(dataclasses.replace(job, options=dataclasses.replace(job.options, tensor_parallel=(2,))),
                     with_baseline=False, with_upper_bound=False).plan
    assert again.max_tensor_parallel == 2 and again.model.vocab_size == 1152
    assert again.training.make_vocab_size_divisible_by == 64

    device = {"HETERO_DEVICE": "cpu-fast", "HETERO_VENDOR": "cpu"}
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    saved = run_pretrain(flags + save + ["--exit-interval", "3"], nproc=2, plan=json.loads(first.read_text()),
                         tmp_path=tmp_path, env=device)
    assert saved.returncode == 0, saved.output[-3000:]
    resumed = run_pretrain(with_load(flags + save, again), nproc=2, plan=again.to_dict(), tmp_path=tmp_path,
                           env=device)
    assert resumed.returncode == 0, resumed.output[-3000:]
    reference = run_pretrain(flags).losses()
    got = resumed.iteration_losses()
    assert sorted(got) == [4, 5, 6]
    for iteration, loss in got.items():
        assert abs(loss - reference[iteration - 1]) <= 1e-4 * reference[iteration - 1], (iteration, loss, reference)
