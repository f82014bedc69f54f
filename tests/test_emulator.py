"""The emulated cluster itself (tools/emulator): shaped links, CPU quotas, clean-up.

Needs root, iproute2 and a cgroup v1 cpu controller; skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetero.spec.cluster import Cluster
from tools.emulator import EmulatedCluster, RankLayout
from tools.emulator.cluster import balanced_cpus
from tools.emulator.cpu_quota import CPU_CGROUP, CpuQuotas, period_us
from tools.emulator.network import EmulatedNetwork, NodeLink

REPO = Path(__file__).resolve().parent.parent
MISSING = EmulatedCluster.missing_prerequisites()
pytestmark = pytest.mark.skipif(bool(MISSING), reason="emulator unavailable: " + "; ".join(MISSING))

RECEIVER = """
import socket, sys, time
server = socket.socket(); server.bind(("0.0.0.0", 45678)); server.listen(1)
print("ready", flush=True)
connection, _ = server.accept()
total, start = 0, None
while True:
    chunk = connection.recv(1 << 20)
    if not chunk:
        break
    if start is None:
        start = time.perf_counter()
    total += len(chunk)
print(total / (time.perf_counter() - start), flush=True)
"""
SENDER = """
import socket, sys, time
client = socket.create_connection((sys.argv[1], 45678))
block, deadline = b"x" * (1 << 20), time.perf_counter() + float(sys.argv[2])
while time.perf_counter() < deadline:
    client.sendall(block)
client.close()
"""


def _leftovers(run_id: int) -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [line.split()[0] for line in namespaces.splitlines() if line.startswith(f"hn{run_id}-")]
    found += [word for word in links.split() if word.startswith(f"hb{run_id}") or word.startswith(f"hv{run_id}")]
    found += [p.name for p in CPU_CGROUP.glob(f"hetero-{run_id}-r*")]
    return found


def test_a_shaped_link_carries_its_set_rate():
    rate_mbit = 400.0
    run_id = 90000 + os.getpid() % 9000
    with EmulatedNetwork(run_id, [NodeLink("a", rate_mbit, 30), NodeLink("b", 4 * rate_mbit, 30)]) as net:
        receiver = subprocess.Popen([*net.exec_prefix("b"), sys.executable, "-c", RECEIVER],
                                    stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "ready"
        subprocess.run([*net.exec_prefix("a"), sys.executable, "-c", SENDER, net.node("b").address, "3"],
                       check=True, timeout=60)
        measured_mbit = float(receiver.stdout.readline()) * 8 / 1e6
        receiver.wait(timeout=30)
    assert not _leftovers(run_id)
    # TCP/IP headers take ~3% of what the token bucket lets through.
    assert abs(measured_mbit / rate_mbit - 1) <= 0.15, f"set {rate_mbit} Mbit/s, measured {measured_mbit:.0f}"


def test_a_capped_rank_is_slower_by_its_quota():
    work = ("import time\nstart, cpu = time.perf_counter(), time.process_time()\nx = 0\n"
            "for i in range(3_000_000): x += i\n"
            "print(time.perf_counter() - start, time.process_time() - cpu, flush=True)")
    run_id = 90000 + os.getpid() % 9000
    with CpuQuotas(run_id, [0.25]) as quotas:
        capped = subprocess.run([sys.executable, "-m", "tools.emulator.rank_entry", "-c", work], cwd=REPO,
                                env={**os.environ, "LOCAL_RANK": "0", "HETERO_EMULATOR_CGROUPS": str(quotas.path(0))},
                                capture_output=True, text=True, check=True)
    assert not _leftovers(run_id)
    wall, cpu = map(float, capped.stdout.split())
    # Wall time over CPU time is 1/quota when the quota binds (4x at 25%); other load on
    # the machine can only add to it, so the lower bound is tight and the upper one loose.
    assert 3.4 <= wall / cpu <= 6.0, f"wall {wall:.2f} s for {cpu:.2f} s of CPU at a 25% quota"


HOST_WORK = """
import os, threading
from megatron.hetero.cpu_device import host_work
from tools.emulator.cpu_quota import join

join(os.environ["HETERO_EMULATOR_CGROUPS"])  # after the imports: they take seconds at a tenth of a core

def cpu_cgroup(tid):
    with open(f"/proc/self/task/{tid}/cgroup") as lines:
        return next(line.split(":")[2].strip() for line in lines if line.split(":")[1] == "cpu")

def throttled():
    with open(os.environ["HETERO_EMULATOR_CGROUPS"] + "/cpu.stat") as stat:
        return int(dict(line.split() for line in stat)["nr_throttled"])

me = threading.get_native_id()
before = cpu_cgroup(me)
with host_work():
    inside, started = cpu_cgroup(me), []
    thread = threading.Thread(target=lambda: started.append(cpu_cgroup(threading.get_native_id())))
    thread.start(); thread.join()
    periods = throttled()
    x = 0
    for i in range(2_000_000): x += i
    throttled_inside = throttled() - periods
print(before, inside, started[0], cpu_cgroup(me), throttled_inside, flush=True)
"""


def test_host_work_runs_beside_the_ranks_quota_and_the_threads_it_starts_stay_there():
    run_id = 90000 + os.getpid() % 9000
    with CpuQuotas(run_id, [0.1]) as quotas:
        device, host = quotas.path(0), quotas.host_path(0)
        env = {**os.environ, "LOCAL_RANK": "0", "HETERO_EMULATOR_CGROUPS": str(device),
               "HETERO_EMULATOR_HOST_CGROUPS": str(host)}
        result = subprocess.run([sys.executable, "-c", HOST_WORK], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
    assert not _leftovers(run_id)
    before, inside, started, after, throttled_inside = result.stdout.split()
    assert (before, inside, started, after) == (f"/{device.name}", f"/{host.name}", f"/{host.name}", f"/{device.name}")
    # The work inside ran where no quota applies: the rank's quota never bound meanwhile.
    assert throttled_inside == "0"


@pytest.mark.slow
def test_a_job_runs_across_namespaces_and_everything_is_removed():
    cluster = Cluster.load(REPO / "examples" / "clusters" / "cpu_demo.yaml")
    script = ("import os, torch, torch.distributed as d\nd.init_process_group('gloo')\n"
              "t = torch.ones(4); d.all_reduce(t)\n"
              "line = f\"rank {d.get_rank()} {os.environ['HETERO_EMULATED_HOST']} {os.environ['HETERO_DEVICE']} {t.sum().item()} "
              "cores {sorted(os.sched_getaffinity(0))}\\n\"\n"
              # One write per line: under PYTHONUNBUFFERED print() writes each piece on its
              # own, and pieces of ranks sharing the pipe interleave.
              "os.write(1, line.encode())\n"
              # Leaving without it, a rank can exit while a peer's gloo thread still reads
              # the pair: that peer aborted (SIGABRT) in 2 of 18 runs.
              "d.barrier(); d.destroy_process_group()\n")
    emulated = EmulatedCluster(cluster, RankLayout.of_cluster(cluster), run_id=80000 + os.getpid() % 9000)
    with emulated:
        result = emulated.run(["-c", script], echo=False, timeout=120)
    # On failure, the start of every node's report (the first error decides, and the tail is
    # usually the other node's torchrun losing the store of the one that stopped).
    assert result.returncode == 0, "\n".join(
        line for line in result.output.splitlines() if "rank " in line or "rror" in line or "exitcode" in line)[:6000]
    lines = sorted(line for line in result.output.splitlines() if line.startswith("rank "))
    cores = [f"cores [{c}]" for c in emulated.cpu_of_rank]
    assert lines == [f"rank 0 node-fast cpu-fast,cpu-fast 16.0 {cores[0]}", f"rank 1 node-fast cpu-fast,cpu-fast 16.0 {cores[1]}",
                     f"rank 2 node-slow cpu-slow,cpu-slow 16.0 {cores[2]}", f"rank 3 node-slow cpu-slow,cpu-slow 16.0 {cores[3]}"]
    assert not _leftovers(emulated.run_id)


def test_the_quota_period_is_as_short_as_the_smallest_quota_allows():
    assert period_us([0.5, 0.5, 0.25, 0.25]) == 5_000  # quotas of 2.5 and 1.25 ms
    assert period_us([0.43, 0.43, 0.43, 0.21]) == 5_000  # 1.05 ms, the floor is 1 ms
    assert period_us([0.8, 0.15]) == 6_667  # 1 ms for the slowest
    assert period_us([0.05]) == 10_000  # the slowest is held at the floor: 10% instead of 5%


def test_ranks_are_pinned_so_that_every_core_carries_a_like_share():
    assert balanced_cpus([0.5, 0.5, 0.25, 0.25], [0, 1]) == [0, 1, 0, 1]
    assert balanced_cpus([0.43, 0.43, 0.43, 0.21], [2, 5]) == [2, 5, 2, 5]
    assert balanced_cpus([0.2, 0.9, 0.3], [0, 1]) == [1, 0, 1]
    assert balanced_cpus([0.3] * 3, [7]) == [7, 7, 7]


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_removes_everything(tmp_path, presses):
    """Also when Ctrl-C comes twice: the second lands in the clean-up of the first."""
    script = tmp_path / "wait.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "tools.emulator", "--cluster",
                                 str(REPO / "examples" / "clusters" / "cpu_demo.yaml"), "--", str(script)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in launcher.stdout:
        seen.append(line)
        if "started" in line:
            break
    run_id = launcher.pid % 100000
    assert _leftovers(run_id), "the emulator made no namespaces"
    for _ in range(presses):
        launcher.send_signal(signal.SIGINT)
        time.sleep(0.05)
    output = launcher.communicate(timeout=60)[0]
    assert launcher.returncode == 130, "".join(seen) + output
    assert "removed everything it created" in output
    time.sleep(0.5)
    assert not _leftovers(run_id)
    assert "wait.py" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_without_root_it_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert any("need root" in reason for reason in EmulatedCluster.missing_prerequisites())
    cluster = Cluster.load(REPO / "examples" / "clusters" / "cpu_demo.yaml")
    from hetero.errors import HeteroError

    with pytest.raises(HeteroError, match="--unshaped"):
        EmulatedCluster(cluster, RankLayout.of_cluster(cluster)).__enter__()
