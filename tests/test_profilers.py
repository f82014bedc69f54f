"""The profilers write what the predictor reads, measured on this machine (and the
network profiler inside the emulated cluster, where it can be made)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.spec.cluster import Cluster
from hetero.predict.costs import CostModel
from hetero.predict.training_setup import TrainingSetup
from hetero.spec.model import ModelSpec
from hetero.spec.profiles import Profiles
from tools.emulator import EmulatedCluster, RankLayout

REPO = Path(__file__).resolve().parent.parent
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--vocab-size", "255"]


@pytest.mark.slow
@pytest.mark.parametrize("order", [[], ["--one-size-at-a-time"]], ids=["sizes-in-turns", "one-size-at-a-time"])
def test_compute_profile_feeds_the_predictor(tmp_path, order):
    done = subprocess.run([sys.executable, "-m", "megatron.hetero.profiling.compute", "-o", str(tmp_path), "--device-type",
                           "cpu-fast", "--micro-batch-sizes", "1", "4", "--repeats", "3", *order, "--", *TINY],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "[profile 2/2] tp 1 mbs 4 on cpu-fast" in done.stdout  # progress
    profiles = Profiles.load_dir(tmp_path)
    cluster = Cluster.load(REPO / "examples" / "clusters" / "cpu_demo.yaml")
    spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
                     max_position_embeddings=32)
    assert profiles.missing(["cpu-fast", "cpu-slow"], spec, "fp32") == ["cpu-slow"]
    entries = {e.micro_batch_size: e for e in profiles.compute[0].entries}
    assert entries[4].layer_activation_bytes > 2 * entries[1].layer_activation_bytes  # grows with the batch
    costs = CostModel(cluster, spec, TrainingSetup("fp32", fused_kernels=False, dropout=False), profiles)
    assert costs.layer_times("cpu-fast", 1, 4) == (entries[4].layer_forward_s, entries[4].layer_backward_s)
    # Timed rounds never take exactly the same time (how much they vary depends on the load).
    assert all(e.micro_batch_cv > 0 for e in entries.values())
    assert costs.micro_batch_cv("cpu-fast", 1, 4) == entries[4].micro_batch_cv
    one = entries[1]  # the first stage's share of what is not a layer, timed by hooks
    assert one.batch_s > 0 and one.embedding_forward_s > 0 and one.embedding_backward_s > 0
    assert costs.stage_extra_times("cpu-fast", 1, 1, first=True, last=True) == (
        one.logits_forward_s, one.logits_backward_s)
    assert costs.stage_extra_times("cpu-fast", 1, 1, first=True, last=False) == pytest.approx(
        (one.batch_s + one.embedding_forward_s, one.embedding_backward_s))


@pytest.mark.slow
@pytest.mark.skipif(bool(EmulatedCluster.missing_prerequisites()),
                    reason="emulator unavailable: " + "; ".join(EmulatedCluster.missing_prerequisites()))
def test_network_profile_inside_the_emulated_cluster(tmp_path):
    cluster = Cluster.load(REPO / "examples" / "clusters" / "cpu_demo.yaml")
    emulated = EmulatedCluster(cluster, RankLayout.of_cluster(cluster), net_scale=0.05,  # 400 Mbit/s NICs
                               run_id=70000 + os.getpid() % 9000)
    with emulated:
        result = emulated.run(["-m", "megatron.hetero.profiling.network", "-o", str(tmp_path), "--message-mib", "2",
                               "--rounds", "3", "--allreduce-mib", "1"], echo=False, timeout=180)
    assert result.returncode == 0, result.output[-3000:]
    assert "[links 3/3] node-fast <-> node-slow" in result.output
    profiles = Profiles.load_dir(tmp_path)
    across = profiles.link("node-fast", "node-slow")
    inside = profiles.link("node-fast", "node-fast")
    nic_share = 400e6 / 8 / 2 / 1e9  # GB/s per device: two devices share each node's NIC
    assert 0.7 * nic_share <= across.bandwidth_gbs <= 1.15 * nic_share, across
    assert inside.bandwidth_gbs > 2 * across.bandwidth_gbs  # loopback is the fast link
