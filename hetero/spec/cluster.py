"""Cluster spec (YAML): nodes, their devices, intra-node links, NICs, and fabrics.

    name: two-islands
    devices:                       # optional: add to or override the catalog
      my-gpu: {vendor: nvidia, memory_gib: 24, peak_tflops: 150, memory_bandwidth_gbs: 900}
    groups:                        # nodes in a group share one fabric (an RDMA island)
      - name: ib-island
        nodes:
          - {host: a0, device: A100-40GB, count: 8, intra_link: nvlink3, nic: {kind: ib, gbps: 800}}
          - {host_prefix: b, num_nodes: 4, device: H100-80GB, count: 8, intra_link: nvlink4,
             nic: {kind: ib, gbps: 3200}}            # hosts b0..b3
      - name: eth-island
        nodes: [...]
    inter_group:                   # fabric between groups (aggregate, shared by all flows)
      - {between: [ib-island, eth-island], kind: ethernet, gbps: 100}
    prices_per_hour: {A100-40GB: 1.1, H100-80GB: 2.5}   # optional: $ per device-hour
    board_power_w: {A100-40GB: 400}                      # optional: override the catalog's

Launch order (torchrun's ranks) is node by node in the order written, devices of a node
consecutive. NIC bandwidth is per node; when every device communicates at once (as in
training) each gets an equal share.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetero.spec.catalog import DEVICES, INTRA_NODE_LINKS, NIC_KINDS, VENDOR_BRIDGE, DeviceType, LinkType
from hetero.errors import HeteroError
from hetero.io import describe_validation_error


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeviceSpec(_Spec):
    vendor: str
    memory_gib: float = Field(gt=0)
    peak_tflops: float = Field(gt=0)
    memory_bandwidth_gbs: float = Field(gt=0)
    precisions: tuple[Literal["bf16", "fp16", "fp8"], ...] = Field(
        default=("bf16", "fp16"), description="low precisions it runs (fp32 always runs)")
    board_power_w: float | None = Field(default=None, gt=0, description="board power (TDP), W")
    price_per_hour: float | None = Field(default=None, ge=0, description="$ per device-hour")


class NicSpec(_Spec):
    kind: Literal["ib", "roce", "ethernet"]
    gbps: float = Field(gt=0, description="per node, Gbit/s")
    latency_us: float | None = Field(default=None, gt=0)


class NodeSpec(_Spec):
    host: str | None = None
    host_prefix: str | None = None
    num_nodes: int = Field(default=1, ge=1)
    device: str
    count: int = Field(ge=1, description="devices in the node")
    intra_link: str = Field(description=f"one of {', '.join(INTRA_NODE_LINKS)}")
    nic: NicSpec

    @model_validator(mode="after")
    def _one_naming(self) -> "NodeSpec":
        if (self.host is None) == (self.host_prefix is None):
            raise ValueError("give either host (one node) or host_prefix with num_nodes")
        if self.host is not None and self.num_nodes != 1:
            raise ValueError("num_nodes needs host_prefix (hosts are named PREFIX0, PREFIX1, ...)")
        if self.intra_link not in INTRA_NODE_LINKS:
            raise ValueError(
                f"unknown intra_link {self.intra_link!r}; use one of {', '.join(INTRA_NODE_LINKS)}"
            )
        return self


class GroupSpec(_Spec):
    name: str
    nodes: list[NodeSpec] = Field(min_length=1)


class InterGroupSpec(_Spec):
    between: tuple[str, str]
    kind: Literal["ib", "roce", "ethernet"]
    gbps: float = Field(gt=0, description="aggregate between the two groups, Gbit/s")
    latency_us: float | None = Field(default=None, gt=0)


class ClusterSpec(_Spec):
    name: str
    devices: dict[str, DeviceSpec] = {}
    groups: list[GroupSpec] = Field(min_length=1)
    inter_group: list[InterGroupSpec] = []
    prices_per_hour: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default={}, description="$ per device-hour by device type: your rents (the cost objective)")
    board_power_w: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default={}, description="board power by device type, W (the energy objective)")


# ----- the resolved cluster ----------------------------------------------------------


@dataclass(frozen=True)
class Nic:
    kind: LinkType
    gbps: float
    latency_us: float


@dataclass(frozen=True)
class Node:
    host: str
    device: DeviceType
    count: int
    intra: LinkType
    nic: Nic
    group: str

    def nic_share_bytes_per_s(self) -> float:
        """What one device gets from the node's NICs when all devices send at once."""
        return self.nic.gbps * 1e9 / 8 / self.count * self.nic.kind.efficiency


@dataclass(frozen=True)
class Route:
    """A point-to-point route's achievable bandwidth (bytes/s) and latency (s)."""

    bandwidth: float
    latency: float
    rdma: bool


class Cluster:
    """A validated cluster: nodes in launch order and how any two of them connect."""

    def __init__(self, spec: ClusterSpec, source: str = "cluster"):
        self.spec = spec
        self.name = spec.name
        self.source = source
        self.devices: dict[str, DeviceType] = dict(DEVICES)
        for name, d in spec.devices.items():
            self.devices[name] = DeviceType(name, d.vendor, d.memory_gib, d.peak_tflops,
                                            d.memory_bandwidth_gbs, tuple(d.precisions),
                                            d.board_power_w, d.price_per_hour)
        for field, given in (("price_per_hour", spec.prices_per_hour), ("board_power_w", spec.board_power_w)):
            section = "prices_per_hour" if field == "price_per_hour" else "board_power_w"
            for name, value in given.items():
                if name not in self.devices:
                    raise HeteroError(f"{source}: {section} names unknown device {name!r}; use a catalog "
                                      f"name or one defined under devices:")
                self.devices[name] = dataclasses.replace(self.devices[name], **{field: value})
        self.nodes: list[Node] = []
        for group in spec.groups:
            for node in group.nodes:
                if node.device not in self.devices:
                    raise HeteroError(
                        f"{source}: group {group.name}: unknown device {node.device!r}; use a "
                        f"catalog name ({', '.join(sorted(DEVICES))}) or define it under devices:"
                    )
                hosts = [node.host] if node.host else [f"{node.host_prefix}{i}" for i in range(node.num_nodes)]
                kind = NIC_KINDS[node.nic.kind]
                nic = Nic(kind, node.nic.gbps, node.nic.latency_us or kind.latency_us)
                for host in hosts:
                    self.nodes.append(Node(host, self.devices[node.device], node.count,
                                           INTRA_NODE_LINKS[node.intra_link], nic, group.name))
        hosts = [n.host for n in self.nodes]
        duplicates = sorted({h for h in hosts if hosts.count(h) > 1})
        if duplicates:
            raise HeteroError(f"{source}: host names must be unique; repeated: {', '.join(duplicates)}")
        self._node = {n.host: n for n in self.nodes}
        group_names = [g.name for g in spec.groups]
        if len(set(group_names)) != len(group_names):
            raise HeteroError(f"{source}: group names must be unique")
        self._inter: dict[frozenset, tuple[LinkType, float, float]] = {}
        for link in spec.inter_group:
            unknown = [g for g in link.between if g not in group_names]
            if unknown:
                raise HeteroError(f"{source}: inter_group names unknown groups {unknown}")
            kind = NIC_KINDS[link.kind]
            self._inter[frozenset(link.between)] = (kind, link.gbps, link.latency_us or kind.latency_us)
        for i, a in enumerate(group_names):
            for b in group_names[i + 1:]:
                if frozenset((a, b)) not in self._inter:
                    raise HeteroError(
                        f"{source}: groups {a} and {b} have no inter_group link; add "
                        f"{{between: [{a}, {b}], kind: ethernet, gbps: ...}}"
                    )

    # ----- loading ------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict, source: str = "cluster") -> "Cluster":
        try:
            spec = ClusterSpec.model_validate(data)
        except ValidationError as err:
            raise HeteroError(
                describe_validation_error(err, source, "cluster spec",
                                          "See hetero/spec/cluster.py for the format.")
            ) from None
        return cls(spec, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Cluster":
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise HeteroError(f"cluster spec {path} does not exist") from None
        except yaml.YAMLError as err:
            raise HeteroError(f"{path} is not valid YAML: {err}") from None
        return cls.from_dict(data, str(path))

    def to_dict(self) -> dict:
        return self.spec.model_dump(mode="json", exclude_defaults=True)

    # ----- facts ----------------------------------------------------------------------

    def node(self, host: str) -> Node:
        return self._node[host]

    @property
    def num_devices(self) -> int:
        return sum(n.count for n in self.nodes)

    def device_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.device.name] = counts.get(n.device.name, 0) + n.count
        return counts

    def describe(self) -> str:
        counts = ", ".join(f"{c} {t}" for t, c in self.device_counts().items())
        return f"{self.name}: {self.num_devices} devices ({counts}) on {len(self.nodes)} nodes"

    def path(self, host_a: str, host_b: str, concurrent_crossings: int = 1,
             parallel_flows: int = 1) -> Route:
        """Route between devices on host_a and host_b while every device is busy.

        parallel_flows: devices of each host moving one transfer together (each brings its
        NIC share); concurrent_crossings: transfers sharing an inter-group link at once.
        """
        a, b = self._node[host_a], self._node[host_b]
        if host_a == host_b:
            link = a.intra
            return Route(link.bandwidth_gbs * 1e9 * link.efficiency, link.latency_us * 1e-6, link.rdma)
        flows_a, flows_b = min(parallel_flows, a.count), min(parallel_flows, b.count)
        bandwidth = min(flows_a * a.nic_share_bytes_per_s(), flows_b * b.nic_share_bytes_per_s())
        latency = max(a.nic.latency_us, b.nic.latency_us) * 1e-6
        rdma = a.nic.kind.rdma and b.nic.kind.rdma
        if a.group != b.group:
            kind, gbps, latency_us = self._inter[frozenset((a.group, b.group))]
            bandwidth = min(bandwidth, gbps * 1e9 / 8 * kind.efficiency / max(1, concurrent_crossings))
            latency = max(latency, latency_us * 1e-6)
            rdma = rdma and kind.rdma
        if a.device.vendor != b.device.vendor:
            bridge = VENDOR_BRIDGE
            bandwidth = min(bandwidth, bridge.bandwidth_gbs * 1e9 * bridge.efficiency * parallel_flows)
            latency += bridge.latency_us * 1e-6
            rdma = False
        return Route(bandwidth, latency, rdma)

    # ----- derived clusters (for the upper bound) --------------------------------------

    def only(self, device_type: str) -> "Cluster":
        """The nodes of one device type, with their fabrics."""
        return self.keep([device_type], f"{self.name}[{device_type}]")

    def keep(self, device_types: list[str], name: str | None = None) -> "Cluster":
        """The nodes of these device types, with their fabrics."""
        groups = []
        for group in self.spec.groups:
            nodes = [n for n in group.nodes if n.device in device_types]
            if nodes:
                groups.append(group.model_copy(update={"nodes": nodes}))
        names = {g.name for g in groups}
        inter = [link for link in self.spec.inter_group if set(link.between) <= names]
        spec = self.spec.model_copy(update={"name": name or f"{self.name}[{'+'.join(device_types)}]", "groups": groups,
                                            "inter_group": inter})
        return Cluster(spec, self.source)

    def keep_nodes(self, counts: dict[str, int], name: str | None = None) -> "Cluster":
        """The first counts[t] nodes (in launch order) of each device type t named, with
        their fabrics: a device type used in part. Hosts keep their names."""
        left = dict(counts)
        groups = []
        for group in self.spec.groups:
            nodes = []
            for n in group.nodes:
                if left.get(n.device, 0) <= 0:
                    continue
                taken = 1 if n.host else min(n.num_nodes, left[n.device])
                left[n.device] -= taken
                nodes.append(n if n.host or taken == n.num_nodes else n.model_copy(update={"num_nodes": taken}))
            if nodes:
                groups.append(group.model_copy(update={"nodes": nodes}))
        names = {g.name for g in groups}
        inter = [link for link in self.spec.inter_group if set(link.between) <= names]
        label = "+".join(f"{t}x{n}" for t, n in counts.items())
        spec = self.spec.model_copy(update={"name": name or f"{self.name}[{label}]", "groups": groups,
                                            "inter_group": inter})
        return Cluster(spec, self.source)

    def nodes_of(self, device_type: str) -> int:
        """How many nodes hold this device type."""
        return sum(1 for n in self.nodes if n.device.name == device_type)

    def scaled(self, factor: int) -> "Cluster":
        """Every node repeated `factor` times (hosts renamed), same fabrics."""
        groups = []
        for group in self.spec.groups:
            nodes = []
            for n in group.nodes:
                prefix = n.host_prefix if n.host_prefix is not None else f"{n.host}-"
                nodes.append(n.model_copy(update={"host": None, "host_prefix": prefix,
                                                  "num_nodes": n.num_nodes * factor}))
            groups.append(group.model_copy(update={"nodes": nodes}))
        spec = self.spec.model_copy(update={"name": f"{self.name}x{factor}", "groups": groups})
        return Cluster(spec, self.source)
