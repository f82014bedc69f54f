"""Putting a candidate's (replica, stage) slots on concrete devices, and what that implies.

A class's tensor-parallel groups are taken in launch order (node by node) in one of two
orders:
- replica-major: a replica's stages in the class take consecutive groups, so pipeline
  neighbours share a node and a stage's data-parallel group spreads over nodes;
- stage-major: a stage's replicas take consecutive groups, so a data-parallel group packs
  onto the fewest nodes and pipeline neighbours sit on different nodes. Applied to the
  whole cluster at once this is Megatron's own launch order.

The planner needs, for thousands of candidates, only a summary of a data-parallel group:
per class (number of hosts, fewest and most members on one host), and whether pipeline
neighbours of one class share a node. Those follow from the order by arithmetic, without
placing every slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from hetero.spec.cluster import Cluster
from hetero.grid import TemplateShape
from hetero.plan import PLAN_VERSION, DeviceEntry, Plan, ReplicaEntry, StageEntry
from hetero.plan_checks import grid_of

ORDERS = ("replica-major", "stage-major")

# One class's part of a data-parallel group: (class, hosts, fewest members on a host,
# most members on a host).
GroupPart = tuple[int, int, int, int]


class ClassInfo(Protocol):
    device_type: str
    hosts: tuple[str, ...]
    devices_per_node: int

    def tp_groups(self, tensor_parallel: int) -> list[tuple[str, int]]: ...


def _contiguous(c: int, first: int, count: int, per_node: int) -> GroupPart:
    """`count` consecutive TP groups from index `first`, `per_node` groups per node."""
    last = first + count - 1
    hosts = last // per_node - first // per_node + 1
    if hosts == 1:
        return (c, 1, count, count)
    head, tail = per_node - first % per_node, last % per_node + 1
    most = per_node if hosts > 2 else max(head, tail)
    return (c, hosts, min(head, tail), most)


def class_group_part(c: int, per_node: int, replicas: int, stages_in_class: int, stage: int,
                     order: str) -> GroupPart:
    """Where the data-parallel group of one of a class's stages lies."""
    if order == "stage-major":  # group of replica r at this stage: stage * replicas + r
        return _contiguous(c, stage * replicas, replicas, per_node)
    # replica-major: group of replica r at this stage: r * stages_in_class + stage
    if stages_in_class >= per_node:
        return (c, replicas, 1, 1)
    low, high = per_node // stages_in_class, -(-per_node // stages_in_class)
    hosts = -(-(replicas * stages_in_class) // per_node)
    return (c, hosts, max(1, min(low, replicas)), min(high, replicas))


def neighbours_share_node(per_node: int, replicas: int, stages_in_class: int, order: str) -> bool:
    """Whether every replica's consecutive stages of one class sit on one node."""
    if stages_in_class <= 1:
        return True
    if order == "replica-major":
        return stages_in_class <= per_node and per_node % stages_in_class == 0
    span = replicas * stages_in_class
    return span <= per_node and per_node % span == 0


@dataclass(frozen=True)
class Run:
    """Consecutive nodes of one class in launch order."""

    cls: int
    first_group: int
    nodes: int
    per_node: int

    @property
    def end_group(self) -> int:
        return self.first_group + self.nodes * self.per_node


def launch_runs(cluster: Cluster, class_of: dict[str, int], usable: set[int], tp: int) -> list[Run]:
    runs: list[Run] = []
    next_group = 0
    for node in cluster.nodes:
        c = class_of[node.host]
        if c not in usable:
            continue
        per_node = node.count // tp
        if runs and runs[-1].cls == c and runs[-1].per_node == per_node:
            last = runs[-1]
            runs[-1] = Run(c, last.first_group, last.nodes + 1, per_node)
        else:
            runs.append(Run(c, next_group, 1, per_node))
        next_group += per_node
    return runs


def launch_group_parts(runs: list[Run], first: int, count: int) -> tuple[GroupPart, ...]:
    """The groups [first, first + count) of the launch order, summarised per run."""
    end = first + count
    parts = []
    for run in runs:
        a, b = max(first, run.first_group), min(end, run.end_group)
        if a < b:
            parts.append(_contiguous(run.cls, a - run.first_group, b - a, run.per_node))
    return tuple(parts)


def launch_patterns(runs: list[Run], replicas: int, stages: int) -> list[tuple[tuple[int, ...], int]]:
    """(class of each stage, how many consecutive replicas) in launch order: replica r's
    stage s is launch group s * replicas + r."""
    cuts = {0, replicas}
    for s in range(stages):
        for run in runs:
            for edge in (run.first_group, run.end_group):
                r = edge - s * replicas
                if 0 < r < replicas:
                    cuts.add(r)
    bounds = sorted(cuts)

    def class_at(group: int) -> int:
        return next(run.cls for run in runs if run.first_group <= group < run.end_group)

    return [(tuple(class_at(s * replicas + a) for s in range(stages)), b - a)
            for a, b in zip(bounds, bounds[1:])]


def representative_hosts(parts: Iterable[GroupPart], classes: list[ClassInfo]) -> tuple[str, ...]:
    """A member-per-entry host list with the same shape as a summarised group (for the
    all-reduce cost): each part's hosts, one of them with the fewest members."""
    cursor: dict[int, int] = {}
    hosts: list[str] = []
    for c, count, fewest, most in parts:
        start = cursor.get(c, 0)
        names = classes[c].hosts[start:start + count]
        cursor[c] = start + count
        for i, name in enumerate(names):
            hosts += [name] * (fewest if i == len(names) - 1 else most)
    return tuple(hosts)


# ----- concrete placement ---------------------------------------------------------------


def place(cluster: Cluster, classes: list[ClassInfo], tensor_parallel: int | Sequence[int],
          micro_batch_size: int, layers: list[int], replica_classes: list[tuple[int, ...]],
          micro_batches: list[int], order: str, recompute: Sequence[str | dict] | None = None,
          virtual_stages: int = 1) -> Plan:
    """The plan with every (replica, stage) on a concrete tensor-parallel group.

    tensor_parallel: one degree, or one per class (a stage takes its class's: replicas of
    a stage must then be of classes of one degree); different stage degrees make a plan
    version 3. recompute: each stage's recomputation entry (StageEntry.recompute), None for
    the job's flags everywhere; virtual_stages > 1: the interleaved schedule, every stage's
    layers in that many chunks as equal as they split (the first ones a layer more). The
    plan's validation rejects what megatron-core cannot run (pydantic.ValidationError)."""
    degrees = [tensor_parallel] * len(classes) if isinstance(tensor_parallel, int) else list(tensor_parallel)
    dp, pp = len(replica_classes), len(layers)
    stage_tp = []
    for s in range(pp):
        widths = {degrees[r[s]] for r in replica_classes}
        if len(widths) > 1:
            raise ValueError(f"stage {s}'s replicas are on classes of degrees {sorted(widths)}; "
                             "a stage has one tensor-parallel degree")
        stage_tp.append(widths.pop())
    key = (lambda ds: (ds[1], ds[0])) if order == "stage-major" else (lambda ds: ds)
    slots = sorted(((d, s) for d in range(dp) for s in range(pp)), key=key)
    pools = {c: iter(classes[c].tp_groups(degrees[c])) for c in {c for r in replica_classes for c in r}}
    where = {(d, s): next(pools[replica_classes[d][s]]) for d, s in slots}
    used: dict[str, set[int]] = {}  # local devices used on each host
    for (d, s), (host, first) in where.items():
        used.setdefault(host, set()).update(range(first, first + stage_tp[s]))
    devices, launch_index = [], {}
    for node in cluster.nodes:  # launch order: node by node, local rank order
        if node.host not in used:
            continue
        entry = DeviceEntry(host=node.host, device_type=node.device.name, vendor=node.device.vendor,
                            nic=node.nic.kind.name)  # validated once per node, copied per device
        for local in sorted(used[node.host]):
            launch_index[(node.host, local)] = len(devices)
            devices.append(entry.model_copy())
    grid = grid_of((TemplateShape(tuple(stage_tp), dp),))  # the grid the plan builds: shared, built once
    rank_order = [0] * grid.world_size
    for (d, s), (host, first) in where.items():
        for t in range(stage_tp[s]):
            rank_order[grid.rank_at(t, d, s)] = launch_index[(host, first + t)]

    def types(members: Iterable[int]) -> list[str]:
        return sorted({classes[c].device_type for c in members})

    per_stage = len(set(stage_tp)) > 1
    return Plan(
        version=PLAN_VERSION,
        tensor_parallel=max(stage_tp) if per_stage else stage_tp[0],
        pipeline_parallel=pp,
        data_parallel=dp,
        micro_batch_size=micro_batch_size,
        stages=[StageEntry(num_layers=n, device_types=types(r[s] for r in replica_classes),
                           tensor_parallel=stage_tp[s] if per_stage else None,
                           recompute=recompute[s] if recompute else None,
                           virtual_stages=even_chunks(n, virtual_stages) if virtual_stages > 1 else None)
                for s, n in enumerate(layers)],
        replicas=[ReplicaEntry(num_micro_batches=m, device_types=types(r))
                  for r, m in zip(replica_classes, micro_batches)],
        rank_order=rank_order,
        devices=devices,
    )


def even_chunks(layers: int, chunks: int) -> list[int]:
    """A stage's layers in `chunks` model chunks as equal as they split, the first ones a
    layer more (the interleaved schedule's virtual stages; megatron-core builds any split)."""
    return [layers // chunks + (1 if i < layers % chunks else 0) for i in range(chunks)]


def place_templates(cluster: Cluster, placed: Sequence[Plan]) -> Plan:
    """One plan of several templates from one-template plans on disjoint devices (each from
    place(), on its own part of the classes' nodes): the devices in the cluster's launch
    order (a host's devices together, template by template), each template's logical ranks
    after the previous template's (hetero/grid.py)."""
    if len(placed) == 1:
        return placed[0]
    order = {node.host: i for i, node in enumerate(cluster.nodes)}
    ranks = sorted(((order[device.host], k, r) for k, plan in enumerate(placed) for r, device in enumerate(plan.devices)))
    launch = {(k, r): index for index, (_, k, r) in enumerate(ranks)}
    devices = [placed[k].devices[r] for _, k, r in ranks]
    rank_order = [launch[k, r] for k, plan in enumerate(placed) for r in plan.rank_order]
    return Plan.of_templates([plan.templates[0] for plan in placed], micro_batch_size=placed[0].micro_batch_size,
                             rank_order=rank_order, devices=devices)
