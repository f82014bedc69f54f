"""What the planner takes and gives: its options, the device classes it plans over, the
shapes it estimates (Candidate) and the plan it picks (PlanResult)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hetero.plan import Plan
from hetero.predict.training_setup import TrainingSetup
from hetero.predict.predictor import Prediction
from hetero.spec.cluster import Cluster
from hetero.spec.recompute import mode as recompute_mode, modules as recomputed_modules

FAMILIES = ("cross-class", "class-pure", "launch-order")
"""The layout families the search enumerates (hetero/search/families.py)."""

def plan_recompute(recompute: str) -> str | dict:
    """The cost model's recomputation (hetero/spec/recompute.py) as a plan's stage entry
    (megatron-core's settings): full recomputation of every layer is Megatron's uniform
    method with groups of one layer; selective names its modules unless they are the default."""
    if recompute_mode(recompute) == "full":
        return {"granularity": "full", "method": "uniform", "num_layers": 1}
    if recompute in ("none", "selective"):
        return recompute
    return {"granularity": "selective", "modules": sorted(recomputed_modules(recompute))}
# Relative slack taken off a lower bound before comparing it with estimates computed in
# another order of floating-point operations.
FLOOR_ROUNDING = 1e-9


Degrees = tuple[int, ...]
"""A tensor-parallel degree per device class (Planner.classes order). Every stage of a plan
takes its class's degree (plan version 3 when they differ); the job's settings follow the
widest (sequence parallelism is on when any stage shards)."""


@dataclass(frozen=True)
class PlannerOptions:
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8)
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    setup: TrainingSetup = TrainingSetup()
    """The job's settings; its recompute is the least a stage uses, its
    sequence_parallel and virtual_stages are overridden by the two options below."""
    recompute_modes: tuple[str, ...] = ("none", "selective", "full")
    """Per stage, the first of these whose activations fit (cheapest first)."""
    sequence_parallel: bool | None = None
    """None: on whenever TP > 1 (same communication volume, less memory and fewer
    element-wise passes per rank, so it never loses); True/False: forced."""
    virtual_stages: tuple[int, ...] = (1, 2)
    """Interleaving degrees tried on the best candidates (pipelines of 2+ stages of at least
    v layers each, each stage's layers in chunks as equal as they split)."""
    exact_candidates: int = 4
    """How many of the best estimates overall the exact predictor judges..."""
    exact_per_family: int = 1
    """...plus this many of each family's best."""
    expert_parallel: tuple[int, ...] | None = None
    """Expert-parallel degrees to try (mixtures of experts): None tries 1 and every divisor of
    the expert count that fits in one node (hetero/search/expert_parallel.py)."""
    expert_tensor_parallel: int | None = None
    """Ranks that split each expert (mixtures of experts): None pairs EP > 1 with 1 and EP 1
    with the stage's TP; a number (a launch script's --expert-tensor-parallel-size) is kept
    at every EP degree, and at EP 1 only stages of that TP degree are planned."""
    pipeline_parallel: tuple[int, ...] | None = None
    """Pipeline depths allowed (None: any): a launch script that fixes
    --pipeline-model-parallel-size is planned at that depth."""
    templates: bool = True
    """Also search plans of several replica templates (plan version 4): each device class in a
    pipeline shape of its own (hetero/search/templates.py)."""
    kept_templates: tuple[Plan, ...] = ()
    """One-template plans on hosts of the cluster that a plan of several templates may keep as
    they are, with templates planned on the hosts they leave free (a re-plan after a lost node
    keeps the templates it was not part of, where that is predicted best)."""
    per_stage_tensor_parallel: bool = True
    """Also give each device class of a cross-class pipeline its own degree (plan version 3):
    per class the smallest of `tensor_parallel` whose stage holds a layer, and the wider
    ones where they are faster."""


def setup_for(options: PlannerOptions, tensor_parallel: int, virtual_stages: int = 1) -> TrainingSetup:
    """The job's settings for a plan of this TP degree and interleaving: sequence
    parallelism as the options say (by default on whenever TP > 1)."""
    wanted = options.sequence_parallel
    sequence_parallel = tensor_parallel > 1 and (wanted is None or wanted)
    return dataclasses.replace(options.setup, sequence_parallel=sequence_parallel,
                               virtual_stages=virtual_stages)


@dataclass(frozen=True)
class DeviceClass:
    device_type: str
    group: str
    vendor: str
    hosts: tuple[str, ...]
    devices_per_node: int

    def tp_groups(self, tensor_parallel: int) -> list[tuple[str, int]]:
        """(host, first local device) of every tensor-parallel group, in launch order."""
        per_node = self.devices_per_node // tensor_parallel
        return [(h, i * tensor_parallel) for h in self.hosts for i in range(per_node)]


def device_classes(cluster: Cluster) -> list[DeviceClass]:
    """Nodes that are interchangeable: same device, fabric, devices per node and NIC (nodes
    of one rack with and without InfiniBand are different classes)."""
    classes: dict[tuple, list[str]] = {}
    for node in cluster.nodes:
        key = (node.device.name, node.group, node.count, node.nic.kind.name, node.nic.gbps)
        classes.setdefault(key, []).append(node.host)
    return [DeviceClass(t, g, cluster.devices[t].vendor, tuple(hosts), count)
            for (t, g, count, _, _), hosts in classes.items()]


@dataclass
class Candidate:
    family: str
    order: str
    """Placement order the estimate assumed (placement.ORDERS)."""
    degrees: Degrees
    """Tensor-parallel degree of each device class."""
    micro_batch_size: int
    layers: list[int]
    replica_classes: list[tuple[int, ...]]
    """Class index of each stage, per replica."""
    micro_batches: list[int]
    estimate_s: float
    recompute: list[str] | None = None
    """Recomputation of each stage (None: the setup's everywhere)."""
    interleaved: tuple[int, float] | None = None
    """(virtual stages, estimate) of its best interleaving by the estimate (None: none runs)."""

    @property
    def tensor_parallel(self) -> int:
        """The widest degree the candidate uses (its job settings follow it)."""
        return max(self.degrees[c] for pattern in self.replica_classes for c in pattern)

    def stage_degrees(self) -> list[int]:
        """Each stage's degree (replicas of a stage share it: their classes' degrees agree)."""
        return [self.degrees[c] for c in self.replica_classes[0]]


@dataclass
class PlanResult:
    plan: Plan
    prediction: Prediction
    family: str
    search_time_s: float
    candidates_estimated: int
    setup: TrainingSetup
    """The settings the plan was predicted with (sequence parallelism, interleaving)."""
    search_cpu_s: float = 0.0
    """The search's CPU time (this process's), steadier than its wall time on a shared machine."""
