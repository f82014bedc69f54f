"""What a node says about itself: a POSIX-sh probe run on every node through srun (its NICs
from /sys, its GPUs from nvidia-smi/rocm-smi), parsed, and the NIC it implies."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass

# Run on every node by srun: what the node can tell of its NICs and GPUs, one fact a line.
# POSIX sh and /sys only, so that it runs on any node (no Python or venv needed there).
PROBE_SCRIPT = r"""
echo "host=$(hostname)"
for p in /sys/class/infiniband/*/ports/*; do
  [ -e "$p/rate" ] || continue
  d=${p#/sys/class/infiniband/}
  echo "rdma=${d%%/*}/${p##*/}|$(cat "$p/link_layer" 2>/dev/null)|$(cat "$p/state" 2>/dev/null)|$(cat "$p/rate" 2>/dev/null)"
done
for n in /sys/class/net/*; do
  i=${n##*/}
  [ "$i" = lo ] && continue
  kind=virtual
  [ -e "$n/device" ] && kind=physical
  [ -e "$n/bonding" ] && kind=bond
  echo "net=$i|$(cat "$n/operstate" 2>/dev/null)|$(cat "$n/speed" 2>/dev/null)|$kind"
done
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sed 's/^/gpu=/'
fi
if command -v rocm-smi >/dev/null 2>&1; then
  rocm-smi --showproductname 2>/dev/null | sed -n 's/.*Card [Ss]eries:[[:space:]]*/gpu=/p'
fi
echo "end=1"
"""


@dataclass(frozen=True)
class Probe:
    host: str = ""
    gpus: tuple[str, ...] = ()
    rdma: tuple[tuple[str, str, str, float], ...] = ()
    """(device/port, link layer, state, Gbit/s)"""
    net: tuple[tuple[str, str, float, str], ...] = ()
    """(interface, operstate, Gbit/s or 0 when unknown, physical|bond|virtual)"""
    complete: bool = False


def parse_probe(text: str) -> Probe:
    host, gpus, rdma, net, complete = "", [], [], [], False
    for line in text.splitlines():
        key, _, value = line.strip().partition("=")
        if key == "host":
            host = value
        elif key == "gpu" and value.strip():
            gpus.append(value.strip())
        elif key == "rdma":
            port, layer, state, rate = (value.split("|") + ["", "", ""])[:4]
            gbps = re.match(r"\s*([0-9.]+)\s*Gb", rate)
            rdma.append((port, layer.strip(), state.strip(), float(gbps.group(1)) if gbps else 0.0))
        elif key == "net":
            name, state, speed, kind = (value.split("|") + ["", "", ""])[:4]
            mbit = int(speed) if speed.strip().lstrip("-").isdigit() else 0
            net.append((name, state.strip(), max(mbit, 0) / 1000, kind.strip()))
        elif key == "end":
            complete = True
    return Probe(host, tuple(gpus), tuple(rdma), tuple(net), complete)


def nic_of(probe: Probe) -> tuple[str, float, str] | None:
    """(kind, Gbit/s per node, what was seen) of a probed node, or None when nothing tells."""
    active = [(port, layer, gbps) for port, layer, state, gbps in probe.rdma if "ACTIVE" in state.upper() and gbps > 0]
    for kind, layer in (("ib", "infiniband"), ("roce", "ethernet")):
        ports = [(p, g) for p, lay, g in active if lay.lower() == layer]
        if ports:
            return kind, sum(g for _, g in ports), ", ".join(f"{p} {g:g} Gb/s" for p, g in ports)
    up = [(name, gbps, kind) for name, state, gbps, kind in probe.net if state in ("up", "unknown") and gbps > 0]
    real = [i for i in up if i[2] in ("physical", "bond")]
    # A bond's speed is the sum of its members: take it rather than a member.
    bonds = [i for i in real if i[2] == "bond"]
    candidates = bonds or real or up
    if not candidates:
        return None
    name, gbps, kind = max(candidates, key=lambda i: i[1])
    return "ethernet", gbps, f"{name} {gbps:g} Gb/s ({kind})"


PROBES_AT_ONCE = 32  # srun requests in flight: enough to be quick, few enough for slurmctld


def probe_nodes(nodes: list[tuple[str, str]], timeout: float) -> dict[str, tuple[Probe | None, str]]:
    """Runs the probe on every (node, partition), PROBES_AT_ONCE at a time: node ->
    (probe, error). timeout counts from each node's srun start (it may wait for the node)."""
    waiting = list(nodes)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    results: dict[str, tuple[Probe | None, str]] = {}
    while waiting or running:
        while waiting and len(running) < PROBES_AT_ONCE:
            node, partition = waiting.pop(0)
            command = ["srun", "--quiet", "-J", "hetero-discover", "-p", partition, "-w", node, "-N1", "-n1",
                       "-t", "1", "sh", "-c", PROBE_SCRIPT]
            running[node] = (subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              stdin=subprocess.DEVNULL), time.monotonic() + timeout)
        for node, (proc, deadline) in list(running.items()):
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            del running[node]
            if proc.poll() is None:
                proc.terminate()  # srun cancels its job request on SIGTERM
                try:
                    proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate()
                results[node] = (None, (f"no answer in {timeout:.0f} s (node busy? raise --probe-timeout, "
                                        "or pass --no-probe with --nic)"))
                continue
            out, err = proc.communicate()
            probe = parse_probe(out)
            if proc.returncode != 0 or not probe.complete:
                results[node] = (None, f"srun exited with {proc.returncode}: {err.strip()[:300]}")
            else:
                results[node] = (probe, "")
        time.sleep(0.02)
    return results
