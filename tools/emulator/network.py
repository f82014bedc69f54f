"""One network namespace per node, joined by a Linux bridge, each node's link shaped to its NIC.

    root namespace:  bridge hb<id> --- veth hv<id>r<k> ==== hv<id>n<k> (in namespace hn<id>-<k>)

Ranks of one node share its namespace, so they reach each other over its loopback (the
fast intra-node link) and everything else through the node's veth, which carries a token
bucket (tbf) at the NIC's rate in both directions (egress of each end) and half the NIC's
latency each way (netem, where the kernel has it). Addresses come from 10.<a>.<b>.0/24 picked from the run id and
exist only inside the namespaces the run creates.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from hetero.errors import HeteroError


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    if check:
        return _checked(["ip", *args])
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _checked(command: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise HeteroError(f"emulator: `{' '.join(command)}` failed: {done.stderr.strip()}")
    return done


def missing_prerequisites() -> list[str]:
    """Why namespaces cannot be made here, or [] when they can."""
    import os

    reasons = []
    if os.geteuid() != 0:
        reasons.append("network namespaces and tc need root (run as root, or pass --unshaped)")
    for tool in ("ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            reasons.append(f"`{tool}` is not installed (iproute2)")
    return reasons


@dataclass(frozen=True)
class NodeLink:
    """What the emulator needs of one node: its name, NIC rate and one-way latency."""

    host: str
    mbit_per_s: float
    latency_us: float


@dataclass(frozen=True)
class EmulatedNode:
    host: str
    namespace: str
    address: str
    device: str  # the veth end inside the namespace


class EmulatedNetwork:
    """Creates the namespaces on enter and removes everything it made on exit."""

    def __init__(self, run_id: int, nodes: list[NodeLink]):
        self.run_id = run_id
        self.links = nodes
        self.bridge = f"hb{run_id}"
        subnet = run_id % 250 + 1, (run_id // 250) % 250 + 1
        self.prefix = f"10.{200 + subnet[0] % 50}.{subnet[1]}"
        self.nodes: list[EmulatedNode] = []
        self._created_namespaces: list[str] = []
        self._created_links: list[str] = []
        self.latency_emulated = True
        if len(nodes) > 250:
            raise HeteroError(f"emulator: {len(nodes)} nodes do not fit one /24; at most 250")
        for name in (self.bridge, f"hv{run_id}r0"):
            if len(name) > 15:
                raise HeteroError(f"emulator: run id {run_id} makes interface names over 15 characters")

    def __enter__(self) -> "EmulatedNetwork":
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created_links.append(self.bridge)
        _ip("link", "set", self.bridge, "up")
        for k, link in enumerate(self.links):
            namespace, outside, inside = f"hn{self.run_id}-{k}", f"hv{self.run_id}r{k}", f"hv{self.run_id}n{k}"
            address = f"{self.prefix}.{k + 1}"
            _ip("netns", "add", namespace)
            self._created_namespaces.append(namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            self._created_links.append(outside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            in_ns = ("netns", "exec", namespace, "ip")
            _checked(["ip", *in_ns, "link", "set", "lo", "up"])
            _checked(["ip", *in_ns, "addr", "add", f"{address}/24", "dev", inside])
            _checked(["ip", *in_ns, "link", "set", inside, "up"])
            delayed = _shape(outside, link.mbit_per_s, link.latency_us / 2)
            delayed &= _shape(inside, link.mbit_per_s, link.latency_us / 2, namespace)
            self.latency_emulated = self.latency_emulated and delayed
            self.nodes.append(EmulatedNode(link.host, namespace, address, inside))

    def remove(self) -> None:
        """Deletes what this run created; safe to call twice and after a partial create."""
        for namespace in reversed(self._created_namespaces):
            _ip("netns", "del", namespace, check=False)  # takes its veth ends with it
        for link in reversed(self._created_links):
            _ip("link", "del", link, check=False)
        self._created_namespaces.clear()
        self._created_links.clear()

    def node(self, host: str) -> EmulatedNode:
        return next(n for n in self.nodes if n.host == host)

    def cut(self, host: str) -> None:
        """Drops the node's link, as a failed NIC or cable would: its packets go nowhere."""
        k = next(k for k, n in enumerate(self.nodes) if n.host == host)
        _ip("link", "set", f"hv{self.run_id}r{k}", "down")

    def exec_prefix(self, host: str) -> list[str]:
        """Runs a command in the node's namespace. nsenter, not `ip netns exec`: the latter
        remounts /sys, which hides the cgroup tree the ranks must join."""
        return ["nsenter", f"--net=/var/run/netns/{self.node(host).namespace}"]


def _shape(device: str, mbit_per_s: float, delay_us: float, namespace: str | None = None) -> bool:
    """A tbf at the rate, under a netem for the delay where the kernel has netem (the
    development machines' kernels do not: then only the rate is emulated). The bucket holds
    ~2 ms of traffic (at least 64 KiB) so that a TCP window drains smoothly at the rate.
    Returns whether the delay is emulated."""
    tc = ["ip", "netns", "exec", namespace, "tc"] if namespace else ["tc"]
    rate_bytes = mbit_per_s * 1e6 / 8
    burst = max(65536, int(rate_bytes * 0.002))
    tbf = ["tbf", "rate", f"{mbit_per_s:.3f}mbit", "burst", str(burst), "latency", "200ms"]
    netem = subprocess.run([*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem",
                            "delay", f"{max(delay_us, 1):.0f}us", "limit", "100000"],
                           capture_output=True, text=True)
    if netem.returncode == 0:
        _checked([*tc, "qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", *tbf])
        return True
    _checked([*tc, "qdisc", "add", "dev", device, "root", "handle", "10:", *tbf])
    return False
