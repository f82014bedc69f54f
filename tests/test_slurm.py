"""`hetero-plan discover --slurm` and the emulated Slurm cluster it is tested on.

The parsing tests read captured `scontrol`/probe text (fast). The slow ones bring up a real
Slurm cluster on this machine once (tools/emulator/slurm.py: slurmctld, one slurmd per node
in its own network namespace; root; the Debian packages are installed when missing) and
check that it leaves no process, namespace or bridge behind.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, live_command, processes_mentioning
from hetero.cli import main
from hetero.errors import HeteroError
from hetero.slurm import discover
from hetero.slurm import probe as node_probe, text as slurm_text
from hetero.spec.cluster import Cluster

# ----- captured text (Slurm 22.05) ----------------------------------------------------------

NODES_TEXT = """\
NodeName=node0 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=4.60 AvailableFeatures=h100 ActiveFeatures=h100 Gres=gpu:h100:1 NodeAddr=10.77.249.10 NodeHostName=node0 Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2000 AllocMem=0 FreeMem=18177 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu,h100  BootTime=2026-11-26T15:25:42 SlurmdStartTime=2026-11-26T15:39:49 LastBusyTime=2026-11-26T15:39:49 CfgTRES=cpu=2,mem=2000M,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
NodeName=gpu-a07 Arch=x86_64 CoresPerSocket=32  CPUAlloc=64 CPUEfctv=128 CPUTot=128 CPULoad=41.02 AvailableFeatures=ib,a100,80gb,rome ActiveFeatures=ib,a100,80gb,rome Gres=gpu:a100:8(S:0-1),nic:mlx5:4 NodeAddr=gpu-a07 NodeHostName=gpu-a07 Version=22.05.8 OS=Linux 5.15.0-91-generic #101-Ubuntu SMP Tue Nov 14 13:30:08 UTC 2023  RealMemory=1000000 AllocMem=0 FreeMem=980000 Sockets=2 Boards=1 State=MIXED ThreadsPerCore=2 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu,a100-80  BootTime=2026-11-01T08:00:00 SlurmdStartTime=2026-11-01T08:01:00 LastBusyTime=2026-11-26T15:00:00 CfgTRES=cpu=128,mem=1000000M,billing=128,gres/gpu=8 AllocTRES=cpu=64,gres/gpu=4 CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
NodeName=gpu-a08 Arch=x86_64 CoresPerSocket=32  CPUAlloc=0 CPUEfctv=128 CPUTot=128 CPULoad=0.00 AvailableFeatures=ib,a100,80gb,rome ActiveFeatures=ib,a100,80gb,rome Gres=gpu:a100:8(S:0-1) NodeAddr=gpu-a08 NodeHostName=gpu-a08 Version=22.05.8 OS=Linux 5.15.0-91-generic #101-Ubuntu SMP  RealMemory=1000000 AllocMem=0 FreeMem=N/A Sockets=2 Boards=1 State=DOWN+DRAIN+NOT_RESPONDING ThreadsPerCore=2 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu,a100-80  BootTime=None SlurmdStartTime=None LastBusyTime=2026-11-20T10:00:00 CfgTRES=cpu=128,mem=1000000M,billing=128,gres/gpu=8 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s Reason=bad DIMM in slot 3 [root@2026-11-20T10:00:00]
NodeName=mi0 Arch=x86_64 CoresPerSocket=64  CPUAlloc=0 CPUEfctv=128 CPUTot=128 CPULoad=0.10 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:8 NodeAddr=mi0 NodeHostName=mi0 Version=22.05.8 OS=Linux 5.15.0 #1 SMP  RealMemory=500000 AllocMem=0 FreeMem=499000 Sockets=1 Boards=1 State=IDLE ThreadsPerCore=2 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=amd  BootTime=None SlurmdStartTime=None LastBusyTime=None CfgTRES=cpu=128 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
"""

PARTITIONS_TEXT = """\
PartitionName=gpu AllowGroups=ALL AllowAccounts=ALL Default=YES QoS=N/A Nodes=gpu-a[07-08],node0 State=UP TotalCPUs=258 TotalNodes=3
PartitionName=a100-80 AllowGroups=ALL AllowAccounts=ALL Default=NO QoS=N/A Nodes=gpu-a[07-08] State=UP TotalCPUs=256 TotalNodes=2
PartitionName=all AllowGroups=ALL Default=NO Nodes=node0 State=UP
PartitionName=h100 AllowGroups=ALL Default=NO Nodes=node0 State=UP
PartitionName=amd AllowGroups=ALL Default=NO Nodes=mi0 State=UP
"""

TOPOLOGY_TEXT = """\
SwitchName=leaf0 Level=0 LinkSpeed=1 Nodes=gpu-a[07-08]
SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=node0
SwitchName=spine0 Level=1 LinkSpeed=1 Nodes=gpu-a[07-08],node0 Switches=leaf[0-1]
SwitchName=leaf9 Level=0 LinkSpeed=1 Nodes=mi0
"""

PROBE_IB = """host=gpu-a07
rdma=mlx5_0/1|InfiniBand|4: ACTIVE|200 Gb/sec (4X HDR)
rdma=mlx5_1/1|InfiniBand|4: ACTIVE|200 Gb/sec (4X HDR)
rdma=mlx5_2/1|InfiniBand|1: DOWN|10 Gb/sec (4X SDR)
rdma=mlx5_3/1|Ethernet|4: ACTIVE|25 Gb/sec (1X EDR)
net=eno1|up|25000|physical
net=ib0|up||physical
net=docker0|down|-1|virtual
gpu=NVIDIA A100-SXM4-80GB
gpu=NVIDIA A100-SXM4-80GB
end=1
"""


def test_parses_scontrol_show_node():
    nodes = {n.name: n for n in slurm_text.parse_nodes(NODES_TEXT)}
    assert list(nodes) == ["node0", "gpu-a07", "gpu-a08", "mi0"]
    h100 = nodes["node0"]
    assert h100.features == ("h100",) and h100.gpus == (slurm_text.Gres("gpu", "h100", 1),)
    assert h100.partitions == ("gpu", "h100") and h100.address == "10.77.249.10" and h100.available
    a07 = nodes["gpu-a07"]
    assert a07.features == ("ib", "a100", "80gb", "rome")
    assert a07.gres == (slurm_text.Gres("gpu", "a100", 8), slurm_text.Gres("nic", "mlx5", 4))
    assert a07.state == "MIXED" and a07.available
    assert not nodes["gpu-a08"].available  # DOWN+DRAIN+NOT_RESPONDING
    assert nodes["mi0"].features == () and nodes["mi0"].gpus == (slurm_text.Gres("gpu", None, 8),)
    assert slurm_text.parse_fields(NODES_TEXT.splitlines()[2])["Reason"].startswith("bad DIMM in slot 3")


def test_parses_partitions_host_lists_and_topology():
    assert slurm_text.parse_partitions(PARTITIONS_TEXT) == ["gpu", "a100-80", "all", "h100", "amd"]
    assert slurm_text.expand_hostlist("gpu-a[07-08],node0") == ["gpu-a07", "gpu-a08", "node0"]
    assert slurm_text.expand_hostlist("r[1-2]n[0,2]") == ["r1n0", "r1n2", "r2n0", "r2n2"]
    # leaf0 and leaf1 hang under spine0: one fabric; leaf9 is an island of its own.
    assert slurm_text.parse_topology(TOPOLOGY_TEXT) == {
        "gpu-a07": "spine0", "gpu-a08": "spine0", "node0": "spine0", "mi0": "leaf9"}


def test_reads_nics_from_the_probe():
    probe = node_probe.parse_probe(PROBE_IB)
    assert probe.complete and probe.host == "gpu-a07" and len(probe.gpus) == 2
    # Active InfiniBand ports, summed; the down one and the RoCE port do not count.
    assert node_probe.nic_of(probe)[:2] == ("ib", 400.0)
    roce = node_probe.parse_probe("rdma=mlx5_0/1|Ethernet|4: ACTIVE|100 Gb/sec (4X EDR)\nend=1\n")
    assert node_probe.nic_of(roce)[:2] == ("roce", 100.0)
    # A bond beats its members; virtual interfaces only where nothing else is up.
    ethernet = node_probe.parse_probe("net=eno1|up|25000|physical\nnet=bond0|up|50000|bond\n"
                                    "net=veth9|up|10000|virtual\nend=1\n")
    assert node_probe.nic_of(ethernet)[:2] == ("ethernet", 50.0)
    veth_only = node_probe.parse_probe("host=node1\nnet=eth0|up|10000|virtual\nend=1\n")
    assert node_probe.nic_of(veth_only)[:2] == ("ethernet", 10.0)
    assert node_probe.nic_of(node_probe.parse_probe("net=eth0|down||physical\nend=1\n")) is None
    assert not node_probe.parse_probe("host=x\n").complete  # cut short: not trusted


def test_maps_labels_to_catalog_devices():
    assert discover.catalog_matches("h100") == {"H100-80GB"}
    assert discover.catalog_matches("H100") == {"H100-80GB"}
    assert discover.catalog_matches("nvidia_a100-sxm4-80gb") == {"A100-80GB"}
    assert discover.catalog_matches("a100") == {"A100-40GB", "A100-80GB"}
    assert discover.catalog_matches("ib") == set()
    nodes = {n.name: n for n in slurm_text.parse_nodes(NODES_TEXT)}
    # "a100" and "80gb" agree on one device; "ib" and "rome" name none and are ignored.
    assert discover.resolve_device(nodes["gpu-a07"], None, {}).device == "A100-80GB"
    # What the node's driver reports wins over labels; --device-map over both.
    h20 = node_probe.Probe(gpus=("NVIDIA H20",), complete=True)
    assert discover.resolve_device(nodes["node0"], h20, {}).device == "H20"
    assert discover.resolve_device(nodes["node0"], h20, {"h100": "H800"}).device == "H800"
    a100 = slurm_text.SlurmNode("n", "IDLE", ("a100",), (slurm_text.Gres("gpu", "a100", 4),), ("p",))
    problem = discover.resolve_device(a100, None, {}).problem
    assert "ambiguous" in problem and "A100-40GB or A100-80GB" in problem and "--device-map a100=" in problem
    l4 = slurm_text.SlurmNode("n", "IDLE", ("l4",), (slurm_text.Gres("gpu", "l4", 1),), ("p",))
    problem = discover.resolve_device(l4, None, {}).problem
    assert "'l4'" in problem and "--device-map l4=NAME" in problem and "H100-80GB" in problem
    # Nothing names a device here: the AMD node is resolved by the GPU name its probe saw.
    mi = discover.resolve_device(nodes["mi0"], node_probe.Probe(gpus=("AMD Instinct MI250X",)), {})
    assert mi.device == "MI250X"


def _fake_slurm(tmp_path: Path) -> Path:
    """scontrol and srun on PATH answering with the captured text."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("partitions", PARTITIONS_TEXT), ("nodes", NODES_TEXT), ("topology", TOPOLOGY_TEXT)):
        (tmp_path / name).write_text(text)
    (bin_dir / "scontrol").write_text(f"""#!/bin/sh
case "$2" in
  partition) cat {tmp_path}/partitions ;;
  node) cat {tmp_path}/nodes ;;
  topology) cat {tmp_path}/topology ;;
  config) echo "ClusterName             = fake" ;;
esac
""")
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def test_discovers_a_spec_from_slurm_text(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_slurm(tmp_path)}:{os.environ['PATH']}")

    def probe(nodes, timeout):
        seen = {"node0": "net=eth0|up|10000|virtual\nend=1\n", "gpu-a07": PROBE_IB,
                "mi0": "gpu=AMD Instinct MI250X\nend=1\n"}
        return {node: (node_probe.parse_probe(seen[node]), "") for node, _ in nodes}

    found = discover.discover_slurm(discover.DiscoverOptions(nics={"amd": ("roce", 200.0)}), probe=probe)
    cluster = Cluster.from_dict(found.spec)
    assert cluster.name == "fake"
    assert [(n.host, n.device.name, n.count, n.nic.kind.name, n.nic.gbps, n.group) for n in cluster.nodes] == [
        ("node0", "H100-80GB", 1, "ethernet", 10, "spine0"),
        ("gpu-a07", "A100-80GB", 8, "ib", 400, "spine0"),
        ("mi0", "MI250X", 8, "roce", 200, "leaf9"),  # --nic amd=roce:200 over what the probe saw
    ]
    assert cluster.node("mi0").intra.name == "xgmi"
    assert any("gpu-a08 (DOWN+DRAIN+NOT_RESPONDING)" in note for note in found.notes)
    # Without topology: the smallest chosen partition of each node.
    by_partition = discover.discover_slurm(discover.DiscoverOptions(group_by="partition", probe=False,
                                                                    partitions=["gpu", "a100-80", "h100"]))
    assert [(g["name"], [n["host"] for n in g["nodes"]]) for g in by_partition.spec["groups"]] == [
        ("h100", ["node0"]), ("a100-80", ["gpu-a07"])]
    with pytest.raises(HeteroError, match="partition nope does not exist.*gpu, a100-80, all, h100, amd"):
        discover.discover_slurm(discover.DiscoverOptions(partitions=["nope"], probe=False))


def test_a_node_without_gpus_is_left_out_by_name_or_feature(tmp_path, monkeypatch):
    """A CPU node in the partition: the error names the node and the options that leave it
    out; --exclude-nodes and --exclude-feature do."""
    monkeypatch.setenv("PATH", f"{_fake_slurm(tmp_path)}:{os.environ['PATH']}")
    cpu_node = ("NodeName=cpu0 CPUTot=64 AvailableFeatures=cpu,rome ActiveFeatures=cpu,rome Gres=(null) "
                "NodeAddr=cpu0 State=IDLE Partitions=gpu,h100 SlurmdStartTime=2026-11-26T15:39:49\n")
    with open(tmp_path / "nodes", "a") as nodes:
        nodes.write(cpu_node)
    options = dict(partitions=["h100"], probe=False)
    with pytest.raises(HeteroError) as refused:
        discover.discover_slurm(discover.DiscoverOptions(**options))
    message = str(refused.value)
    assert "node cpu0: cannot map its features/GRES types ('cpu', 'rome')" in message
    assert "left out: --exclude-nodes cpu0 (or --exclude-feature cpu)" in message
    for exclusion in (dict(exclude_nodes=["cpu0"]), dict(exclude_features=["cpu"])):
        found = discover.discover_slurm(discover.DiscoverOptions(**options, **exclusion))
        assert [n["host"] for g in found.spec["groups"] for n in g["nodes"]] == ["node0"]
        assert "left out by --exclude-nodes/--exclude-feature: cpu0" in found.notes
    for exclusion, fragment in ((dict(exclude_nodes=["cpu9"]), "--exclude-nodes cpu9: no such node in partition(s) h100"),
                                (dict(exclude_features=["arm"]), "--exclude-feature arm: no node of partition(s) h100 has it")):
        with pytest.raises(HeteroError, match=re.escape(fragment)):
            discover.discover_slurm(discover.DiscoverOptions(**options, **exclusion))


def test_no_slurm_on_path_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["discover", "--slurm"]) == 2
    err = capsys.readouterr().err
    assert "needs Slurm's scontrol and srun on PATH" in err and "SLURM_CONF" in err and "login node" in err


def test_bad_flags_are_named(capsys):
    for argv, fragment in ((["--nic", "fast:10"], "KIND one of ib, roce, ethernet"),
                           (["--device-map", "a100"], "expected LABEL=NAME"),
                           (["--device-map", "a100=A100"], "A100 is not a catalog device")):
        assert main(["discover", "--slurm", "--no-probe", *argv]) == 2
        assert fragment in capsys.readouterr().err


# ----- a real Slurm cluster on this machine -----------------------------------------------

# Two device classes the catalog knows (h100: Features + GRES; a100: ambiguous between the
# 40 and 80 GB catalog devices) and one it does not (l4).
CLUSTER_NODES = [("node0", "h100"), ("node1", "a100"), ("node2", "a100"), ("node3", "l4")]
DAEMONS = ("slurmctld", "slurmscriptd", "slurmd", "munged", "slurmstepd")


def _daemon_pids() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if name in DAEMONS and live_command(int(entry.name)) is not None:
                pids.add(int(entry.name))
    return pids


def _in_namespaces(inodes: set[int]) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                inode = os.stat(entry / "ns" / "net").st_ino
            except OSError:
                continue
            if inode in inodes and live_command(int(entry.name)) is not None:
                found.append(f"{entry.name} {live_command(int(entry.name))[:120]}")
    return found


def _leftovers(state_dir: Path, run_id: int, inodes: set[int], before: set[int]) -> list[str]:
    left = processes_mentioning(str(state_dir)) + _in_namespaces(inodes)
    left += [f"{pid} {live_command(pid)}" for pid in _daemon_pids() - before]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left += [f"namespace {ns}" for ns in re.findall(rf"^(hsn{run_id}-\d+)", names, re.MULTILINE)]
    if subprocess.run(["ip", "link", "show", f"hsb{run_id}"], capture_output=True).returncode == 0:
        left.append(f"bridge hsb{run_id}")
    if state_dir.exists():
        left.append(f"state directory {state_dir}")
    return left


def assert_left_nothing(state_dir: Path, run_id: int, inodes: set[int], before: set[int],
                        within_s: float = 10) -> None:
    """No daemon, slurmstepd or task, namespace, bridge or state directory of the cluster is
    left (zombies excepted: this machine's PID 1 reaps orphans slowly)."""
    deadline = time.monotonic() + within_s
    while _leftovers(state_dir, run_id, inodes, before) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _leftovers(state_dir, run_id, inodes, before)
    assert not left, "the Slurm cluster left behind:\n" + "\n".join(left)


def _namespace_inodes(cluster) -> set[int]:
    return {os.stat(f"/run/netns/{cluster.namespace(n.name)}").st_ino for n in cluster.nodes}


def _need_root_and_slurm() -> None:
    from tools.emulator.slurm import ensure_installed, missing_prerequisites

    missing = missing_prerequisites()
    if missing:
        pytest.skip("no Slurm cluster on this machine: " + "; ".join(missing))
    ensure_installed()  # apt-get on a fresh machine (CI); not counted in the cluster's up time


@pytest.fixture(scope="module")
def slurm():
    from tools.emulator.slurm import SlurmCluster, SlurmNode

    _need_root_and_slurm()
    before = _daemon_pids()
    cluster = SlurmCluster([SlurmNode(name, device) for name, device in CLUSTER_NODES])
    start = time.monotonic()
    with cluster:
        cluster.up_s = time.monotonic() - start
        inodes = _namespace_inodes(cluster)
        yield cluster
    assert_left_nothing(cluster.state_dir, cluster.run_id, inodes, before)


def _hetero_plan(slurm, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetero", *argv], cwd=cwd, env=slurm.env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_discover_writes_a_spec_that_plans(slurm, tmp_path):
    assert slurm.up_s < 10, f"the Slurm cluster took {slurm.up_s:.1f} s to come up"
    spec = tmp_path / "spec.yaml"
    found = _hetero_plan(slurm, "discover", "--slurm", "--partition", "h100", "--partition", "a100",
                         "--device-map", "a100=A100-80GB", "-o", str(spec), cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    cluster = Cluster.load(spec)
    assert cluster.name == "emu"
    assert [(n.host, n.device.name, n.count, n.group) for n in cluster.nodes] == [
        ("node0", "H100-80GB", 1, "h100"), ("node1", "A100-80GB", 1, "a100"), ("node2", "A100-80GB", 1, "a100")]
    # Each node's probe ran on that node and saw its namespace's veth (eth0), not this machine's NICs.
    assert all(n.nic.kind.name == "ethernet" and n.nic.gbps > 0 for n in cluster.nodes)
    assert found.stderr.count("probe: eth0") == 3, found.stderr
    assert yaml.safe_load(spec.read_text())["inter_group"] == [
        {"between": ["h100", "a100"], "kind": "ethernet", "gbps": cluster.node("node0").nic.gbps}]
    planned = _hetero_plan(slurm, "--cluster", str(spec), "--model", str(REPO / "examples/models/llama_tiny.yaml"),
                           "--global-batch-size", "16", "--seq-length", "128", "--micro-batch-size", "2",
                           "--tensor-parallel", "1", "--precision", "fp32", "--no-fused-kernels", "--no-dropout",
                           "-o", "plan.json", "--quiet", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert (tmp_path / "plan.json").exists() and "hetero-plan: wrote plan.json" in planned.stdout


@pytest.mark.slow
def test_discover_names_every_device_it_cannot_map(slurm, tmp_path):
    failed = _hetero_plan(slurm, "discover", "--slurm", "--no-probe", cwd=tmp_path)
    assert failed.returncode == 2
    assert "node node3: cannot map its features/GRES types ('l4')" in failed.stderr
    assert "--device-map l4=NAME" in failed.stderr
    assert "nodes node1, node2: ambiguous device: 'a100' names A100-40GB or A100-80GB" in failed.stderr
    mapped = _hetero_plan(slurm, "discover", "--slurm", "--no-probe", "--device-map", "l4=L40S",
                          "--device-map", "A100=A100-40GB", "--group-by", "device", "--nic", "ib:200", cwd=tmp_path)
    assert mapped.returncode == 0, mapped.stderr
    spec = yaml.safe_load(mapped.stdout)
    assert [(g["name"], [n["host"] for n in g["nodes"]]) for g in spec["groups"]] == [
        ("H100-80GB", ["node0"]), ("A100-40GB", ["node1", "node2"]), ("L40S", ["node3"])]
    assert {n["nic"]["kind"] for g in spec["groups"] for n in g["nodes"]} == {"ib"}


@pytest.mark.slow
def test_discover_names_a_missing_partition(slurm, tmp_path):
    failed = _hetero_plan(slurm, "discover", "--slurm", "--partition", "h200", cwd=tmp_path)
    assert failed.returncode == 2
    assert "partition h200 does not exist in this Slurm cluster; its partitions: all, h100, a100, l4" in failed.stderr


@pytest.mark.slow
def test_a_killed_node_is_left_out_and_comes_back(slurm, tmp_path):
    slurm.kill_node("node2", mark_down=True)
    assert subprocess.run(["ip", "netns", "pids", slurm.namespace("node2")], capture_output=True,
                          text=True).stdout.split() == []
    assert slurm.node_states()["node2"].startswith("down")
    found = _hetero_plan(slurm, "discover", "--slurm", "--partition", "a100", "--device-map", "a100=A100-80GB",
                         "--no-probe", cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert [n["host"] for g in yaml.safe_load(found.stdout)["groups"] for n in g["nodes"]] == ["node1"]
    assert "left out, not available: node2 (DOWN" in found.stderr
    slurm.restart_node("node2")
    assert slurm.node_states()["node2"] == "idle"


@pytest.mark.slow
def test_a_failed_start_removes_what_it_made():
    from tools.emulator.slurm import SlurmCluster, SlurmNode

    _need_root_and_slurm()

    class Failing(SlurmCluster):
        def wait_idle(self, names=None, timeout=None):
            self.inodes = _namespace_inodes(self)
            raise HeteroError("no node came up")

    before = _daemon_pids()
    cluster = Failing([SlurmNode("x0", "h100"), SlurmNode("x1", "a100")])
    with pytest.raises(HeteroError, match="no node came up"):
        with cluster:
            pass
    assert cluster.state_dir is not None and cluster.inodes
    assert_left_nothing(cluster.state_dir, cluster.run_id, cluster.inodes, before)


@pytest.mark.slow
def test_ctrl_c_brings_the_cluster_down():
    _need_root_and_slurm()
    before = _daemon_pids()
    proc = subprocess.Popen([sys.executable, "-m", "tools.emulator.slurm", "--node", "c0:h100", "--node", "c1:a100"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert select.select([proc.stdout], [], [], 60)[0], "python -m tools.emulator.slurm: not up in 60 s"
        line = proc.stdout.readline()
        assert line.startswith("export SLURM_CONF="), line + proc.stderr.read()
        conf = Path(line.strip().split("=", 1)[1])
        state_dir = conf.parent.parent
        run_id = int(state_dir.name.split(".")[1])
        inodes = {os.stat(f"/run/netns/hsn{run_id}-{k}").st_ino for k in range(2)}
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env={**os.environ, "SLURM_CONF": str(conf)},
                                capture_output=True, text=True).stdout.splitlines()
        assert set(states) == {"c0 idle", "c1 idle"}, states
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.terminate()  # unwinds like Ctrl-C: the cluster comes down
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert_left_nothing(state_dir, run_id, inodes, before)
