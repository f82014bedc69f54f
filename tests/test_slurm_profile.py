"""`hetero-plan profile --slurm`: one command that profiles a Slurm cluster for the planner.

The fast tests choose nodes and merge links from captured `scontrol` text. The slow ones
bring up a real Slurm cluster on this machine (tools/emulator/slurm.py: node0 with an H100,
node1 and node2 with an A100 each, one slurmd per network namespace), discover it, profile
it with a tiny model and plan with the profiles; a bogus model flag and a SIGTERM stop the
run with nothing written; and the cluster leaves no process, namespace or daemon behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import live_command
from hetero.errors import HeteroError
from hetero.predict.costs import CostModel
from hetero.predict.training_setup import TrainingSetup
from hetero.slurm import text as slurm_text
from hetero.spec.cluster import Cluster
from hetero.spec.model import ModelSpec
from hetero.slurm.profile import ProfileOptions, choose_nodes, compute_step, every_link, links_step
from hetero.spec.profiles import LinkProfile, Profiles
from hetero.slurm.steps import Step
from test_profilers import TINY
from test_slurm import _daemon_pids, _namespace_inodes, _need_root_and_slurm, assert_left_nothing

# ----- choosing nodes and merging links (captured Slurm text) -----------------------------------


def _node(name: str, gres: str, state: str = "IDLE") -> str:
    partitions = "all,gpu" if name.startswith("h") else "all"
    return (f"NodeName={name} Arch=x86_64 CPUTot=8 AvailableFeatures=x ActiveFeatures=x Gres={gres} "
            f"NodeAddr=10.0.0.{name[-1]} NodeHostName={name} RealMemory=2000 State={state} Partitions={partitions}")


SLURM = slurm_text.parse_nodes("\n".join([
    _node("h0", "gpu:h100:2", state="DOWN+NOT_RESPONDING"), _node("h1", "gpu:h100:2"),
    _node("a0", "gpu:a100:1"), _node("a1", "gpu:a100:1"), _node("a2", "gpu:a100:1")]))
SPEC = {"name": "t", "groups": [
    {"name": "h", "nodes": [{"host_prefix": "h", "num_nodes": 2, "device": "H100-80GB", "count": 2,
                             "intra_link": "nvlink4", "nic": {"kind": "ib", "gbps": 400}}]},
    {"name": "a", "nodes": [{"host_prefix": "a", "num_nodes": 3, "device": "A100-80GB", "count": 1,
                             "intra_link": "nvlink3", "nic": {"kind": "ib", "gbps": 200}}]}],
    "inter_group": [{"between": ["h", "a"], "kind": "ethernet", "gbps": 100}]}


def test_chooses_one_available_node_per_device_and_two_per_class_for_links():
    cluster = Cluster.from_dict(SPEC)
    notes: list[str] = []
    compute, links, classes = choose_nodes(cluster, SLURM, [], "all", notes)
    # h0 is down: h1 stands for the H100s; a class of several nodes sends two to the links step.
    assert [(n.host, n.device, n.count, n.gpus, n.address, n.partition) for n in compute] == [
        ("h1", "H100-80GB", 2, 2, "10.0.0.1", "all"), ("a0", "A100-80GB", 1, 1, "10.0.0.0", "all")]
    assert [n.host for n in links] == ["h1", "a0", "a1"] and notes == []
    options = ProfileOptions("c.yaml", "out", ["--num-layers", "2"], time="10", tensor_parallel=(1, 2, 4), python="py")
    # The first of the given partitions that holds a node is its own (h1: gpu, a0: all).
    compute, links, classes = choose_nodes(cluster, SLURM, ["nope", "gpu", "all"], "all", notes)
    assert [(n.host, n.partition) for n in compute] == [("h1", "gpu"), ("a0", "all")]
    step = compute_step(compute[0], options, Path("/x"))
    assert step.command[:10] == ["srun", "-J", "hetero-profile", "--kill-on-bad-exit=1", "-w", "h1", "-N1", "-n1",
                                 "--exclusive", "--mem=0"]
    assert "--gres=gpu:2" in step.command and "--partition=gpu" in step.command and "--time=10" in step.command
    assert step.command[step.command.index("--tensor-parallel") + 1:][:3] == ["1", "2", "--repeats"]  # 4 > 2 devices
    assert step.command[-3:] == ["--", "--num-layers", "2"] and "--nproc-per-node=2" in step.command
    het = links_step(links, options, Path("/x")).command
    assert het.count(":") == 2 and het.count("--master-addr=10.0.0.1") == 3  # h1's NodeAddr: node rank 0
    assert [het[i + 1] for i, word in enumerate(het) if word == "--host"] == ["h1", "a0", "a1"]
    with pytest.raises(HeteroError, match=r"no A100-80GB node can take a job in partition gpu: a0 \(IDLE, "
                                          r"partitions all\), .*--partition"):
        choose_nodes(cluster, SLURM, ["gpu"], "all", [])
    # A spec host that is not a Slurm node is named, with the fix.
    with pytest.raises(HeteroError, match="host x0 not a node of this Slurm cluster.*discover --slurm"):
        choose_nodes(Cluster.from_dict({**SPEC, "groups": [{"name": "x", "nodes": [
            {"host": "x0", "device": "A100-80GB", "count": 1, "intra_link": "nvlink3",
             "nic": {"kind": "ib", "gbps": 200}}]}], "inter_group": []}), SLURM, [], "all", [])


def test_every_pair_of_hosts_gets_the_link_of_its_node_classes():
    cluster = Cluster.from_dict(SPEC)
    classes = choose_nodes(cluster, SLURM, [], "all", [])[2]
    measured = LinkProfile.model_validate({"kind": "links", "measured_on": "4 ranks", "links": [
        {"hosts": ["h1", "h1"], "bandwidth_gbs": 100, "latency_us": 2},
        {"hosts": ["h1", "a0"], "bandwidth_gbs": 5, "latency_us": 20},
        {"hosts": ["h1", "a1"], "bandwidth_gbs": 6, "latency_us": 20},
        {"hosts": ["a0", "a1"], "bandwidth_gbs": 20, "latency_us": 10}]})
    profiles = Profiles(links=[LinkProfile.model_validate(every_link(measured, cluster, classes))])
    assert profiles.link("h0", "h0").bandwidth_gbs == 100  # inside a node: its class's
    assert profiles.link("h0", "a2").bandwidth_gbs == 5  # across classes: the chosen nodes'
    assert profiles.link("h1", "a1").bandwidth_gbs == 6  # measured itself
    assert profiles.link("a0", "a2").bandwidth_gbs == profiles.link("a1", "a2").bandwidth_gbs == 20
    assert profiles.link("a0", "a0") is None  # one device: nothing inside the node
    assert len(profiles.links) == 2 + 2 * 3 + 3  # inside the H100 nodes, H100 x A100, A100 pairs
    assert profiles.link("h0", "h1") is None  # the H100 class's second node was down: not measured


def test_without_slurm_or_model_flags_the_fix_is_named(tmp_path, monkeypatch, capsys):
    from hetero.cli import main

    spec = tmp_path / "c.yaml"
    spec.write_text(json.dumps(SPEC))
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun, no scontrol
    command = ["profile", "--slurm", "--cluster", str(spec), "-o", str(tmp_path / "p")]
    assert main([*command, "--", "--num-layers", "2"]) == 2
    assert "needs Slurm's srun and scontrol on PATH: run it on a login node" in capsys.readouterr().err
    (tmp_path / "srun").symlink_to("/bin/true")
    (tmp_path / "scontrol").symlink_to("/bin/true")
    assert main(command) == 2
    assert "give the model's Megatron flags after `--`" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_an_error_tail_keeps_the_ranks_error_and_drops_launcher_noise():
    step = Step("compute", "n", [])
    step.lines.extend([
        "x.py:1: UserWarning: Apex is not installed.", "  warnings.warn(\"Apex\")",
        "[W1126 16:47:15.956254010 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved.",
        "error: unknown flag --bogus-flag", "Traceback (most recent call last):",
        '  File "<frozen runpy>", line 198, in _run_module_as_main',
        '  File "/v/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>',
        "    main()", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "srun: error: node0: task 0: Exited with exit code 1"])
    assert step.tail() == ["error: unknown flag --bogus-flag", "Traceback (most recent call last):",
                           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
                           "srun: error: node0: task 0: Exited with exit code 1"]


# ----- on a real Slurm cluster ------------------------------------------------------------------

NODES = [("node0", "h100"), ("node1", "a100"), ("node2", "a100")]
TINY_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
              "max_position_embeddings": 32, "vocab_size": 256}  # TINY's vocabulary of 255, padded
FAST = ["--micro-batch-sizes", "1", "--repeats", "2", "--message-mib", "1", "--rounds", "2"]


def _other_clusters_daemons(state_dir: Path, inodes: set[int]) -> set[int]:
    """Slurm daemons of clusters that other tests on this machine brought up meanwhile (not
    ours to account for): their command line, or their parent's, names another state
    directory, or they run in a network namespace that is neither this machine's nor ours."""
    root = os.stat("/proc/self/ns/net").st_ino  # this test runs in the machine's own

    def foreign(pid: int) -> bool:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        except (OSError, IndexError, ValueError):
            return False
        commands = [live_command(pid) or "", live_command(parent) or ""]
        return (inode not in inodes and inode != root) or any(
            "hetero-slurm." in c and str(state_dir) not in c for c in commands)

    return {pid for pid in _daemon_pids() if foreign(pid)}


@pytest.fixture(scope="module")
def slurm():
    from tools.emulator.slurm import SlurmCluster, SlurmNode

    _need_root_and_slurm()
    before = _daemon_pids()
    cluster = SlurmCluster([SlurmNode(name, device) for name, device in NODES])
    with cluster:
        inodes = _namespace_inodes(cluster)
        yield cluster
    assert_left_nothing(cluster.state_dir, cluster.run_id, inodes,
                        before | _other_clusters_daemons(cluster.state_dir, inodes))


@pytest.fixture(scope="module")
def spec(slurm, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "cluster.yaml"
    found = _hetero_plan(slurm, "discover", "--slurm", "--partition", "h100", "--partition", "a100",
                         "--device-map", "a100=A100-80GB", "-o", str(path), cwd=path.parent)
    assert found.returncode == 0, found.stderr
    return path


def _env(slurm) -> dict[str, str]:
    # The nodes' names do not resolve: gloo takes the namespace's interface by name.
    return slurm.env({**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"})


def _hetero_plan(slurm, *argv: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetero", *argv], cwd=cwd, env=_env(slurm), capture_output=True,
                          text=True, timeout=timeout)


def _assert_jobs_and_ranks_gone(slurm, within_s: float = 30) -> None:
    """No job left in Slurm and no process but slurmd in the nodes' namespaces."""
    def left() -> list[str]:
        jobs = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], env=slurm.env(), capture_output=True,
                              text=True).stdout.split("\n")
        found = [f"job {j}" for j in jobs if j.strip()]
        for name, _ in NODES:
            pids = subprocess.run(["ip", "netns", "pids", slurm.namespace(name)], capture_output=True,
                                  text=True).stdout.split()
            found += [f"{name}: {pid} {live_command(int(pid))[:150]}" for pid in pids
                      if live_command(int(pid)) and not live_command(int(pid)).startswith("slurmd ")]
        return found

    deadline = time.monotonic() + within_s
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), "left behind:\n" + "\n".join(left())


def _plan(slurm, spec: Path, cwd: Path, *profiles: str) -> dict:
    (cwd / "tiny.yaml").write_text("".join(f"{k}: {v}\n" for k, v in TINY_MODEL.items()))
    done = _hetero_plan(slurm, "--cluster", str(spec), "--model", "tiny.yaml", "--global-batch-size", "12",
                        "--seq-length", "32", "--micro-batch-size", "1", "--tensor-parallel", "1",
                        "--precision", "fp32", "--no-fused-kernels", "--no-dropout", "--quiet", *profiles,
                        "-o", "plan.json", cwd=cwd, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads((cwd / "plan.json").read_text())


@pytest.mark.slow
def test_profiles_every_device_class_and_the_links_then_plans_with_them(slurm, spec, tmp_path):
    start = time.monotonic()
    done = _hetero_plan(slurm, "profile", "--slurm", "--cluster", str(spec), "-o", "profiles", *FAST, "--", *TINY,
                        cwd=tmp_path)
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-5000:]
    # Progress: each device type's profiler on its own node, then the links between all three.
    for line in ("  node0 | [profile 1/1] tp 1 mbs 1 on H100-80GB:", "  node1 | [profile 1/1] tp 1 mbs 1 on A100-80GB:",
                 "[2/2] links: one step over 3 nodes", "  links | [links 3/3] node1 <-> node2:"):
        assert line in done.stderr, done.stderr
    out = tmp_path / "profiles"
    assert sorted(p.name for p in out.iterdir()) == ["compute-A100-80GB.json", "compute-H100-80GB.json",
                                                     "links.json"]  # and no hidden staging left
    profiles = Profiles.load_dir(out)
    model = ModelSpec(**TINY_MODEL)
    assert profiles.missing(["H100-80GB", "A100-80GB"], model, "fp32") == []
    assert {frozenset(pair) for pair in profiles.links} == {
        frozenset(("node0", "node1")), frozenset(("node0", "node2")), frozenset(("node1", "node2"))}

    # The planner takes the profiles as they are (no --roofline-for-missing) and predicts with them.
    plan = _plan(slurm, spec, tmp_path, "--profiles", "profiles")
    assert plan["provenance"]["profiles"] == "profiles"
    cluster = Cluster.load(spec)
    costs = CostModel(cluster, model, TrainingSetup("fp32", fused_kernels=False, dropout=False), profiles)
    h100 = profiles.compute_profile("H100-80GB", model, "fp32").entries[0]
    assert costs.layer_times("H100-80GB", 1, 1) == (h100.layer_forward_s, h100.layer_backward_s)
    assert costs.route("node0", "node1").bandwidth == profiles.link("node0", "node1").bandwidth_gbs * 1e9
    # The emulated devices are CPU cores: far slower than the catalog's H100 and A100 (whose
    # prediction of so tiny a model is mostly the per-kernel gaps of fixed_costs.py).
    catalog = _plan(slurm, spec, tmp_path)
    assert plan["prediction"]["iteration_time_s"] > 2 * catalog["prediction"]["iteration_time_s"]
    _assert_jobs_and_ranks_gone(slurm)
    print(f"\n  hetero-plan profile --slurm (2 device types, 3 nodes): {took:.1f} s")


@pytest.mark.slow
def test_a_failing_step_is_named_and_nothing_is_written(slurm, spec, tmp_path):
    done = _hetero_plan(slurm, "profile", "--slurm", "--cluster", str(spec), "-o", "profiles", *FAST, "--", *TINY,
                        "--bogus-flag", "3", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "error: compute of " in done.stderr and "failed (srun exited with 1)" in done.stderr
    # The rank's own error is in the tail, not hidden behind torchrun's traceback.
    assert "error: unknown flag --bogus-flag" in done.stderr.split("the last lines of its output:")[1]
    assert f"nothing was written to {tmp_path / 'profiles'}" in done.stderr
    assert list((tmp_path / "profiles").iterdir()) == []
    _assert_jobs_and_ranks_gone(slurm)


@pytest.mark.slow
def test_sigterm_stops_the_steps_and_writes_nothing(slurm, spec, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "hetero", "profile", "--slurm", "--cluster", str(spec), "-o",
                             "profiles", *FAST, "--", *TINY], cwd=tmp_path, env=_env(slurm), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until a rank runs on a node
            pids = subprocess.run(["ip", "netns", "pids", slurm.namespace("node1")], capture_output=True,
                                  text=True).stdout.split()
            if any("megatron.hetero.profiling.compute" in (live_command(int(p)) or "") for p in pids):
                break
            time.sleep(0.2)
        else:
            pytest.fail("no profiler started on node1 within 60 s")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "stopped; the steps were cancelled and nothing was written" in err
    assert list((tmp_path / "profiles").iterdir()) == []
    _assert_jobs_and_ranks_gone(slurm)
