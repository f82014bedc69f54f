"""The planner: the fastest plan that fits in memory, found without launching anything.

Devices fall into classes: one device type inside one fabric group. Megatron fixes one
tensor-parallel degree for the job and one stage split for all replicas (a data-parallel
group reduces the same layers), but replicas may sit on different devices and run
different numbers of micro-batches. Three families of plans cover the useful shapes:

- cross-class pipelines (HetHub, Holmes): every replica holds k_c stages of each class c;
  faster classes' stages hold more layers; data-parallel groups stay inside one class
  (one fabric) and only pipeline boundaries cross the slow links. Enumerated by the
  data-parallel degree d, with k_c = (tensor-parallel groups of c) // d.
- class-pure replicas (Poplar, Sailor): each replica lies in one class; micro-batches go
  to replicas in proportion to their speed.
- launch order: Megatron's own placement (ranks in launch order, stage-major), which packs
  each stage's data-parallel group onto the fewest nodes, with the planner's stage split
  and micro-batch counts. Megatron's uniform plan is one point of this family.

For every tensor-parallel degree and micro-batch size each candidate gets a fast estimate
(per-stage times, memory caps, the min-max layer split, micro-batches by replica speed);
the best of each family and overall are placed on concrete devices (for the first two
families in two orders: a replica's stages side by side, or a stage's replicas side by
side) and judged by the exact predictor. A shape whose estimate provably cannot reach
those (a lower bound from the same pieces: layer times, caps, transfers) is dropped before
it is split. Deterministic for the same input.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from hetero.spec.cluster import Cluster
from hetero.predict.costs import CostModel, LayerCost, TrainingSetup
from hetero.errors import HeteroError
from hetero.predict.memory import layer_capacity, micro_batches_in_flight, stage_memory_terms, stage_params
from hetero.spec.model import ModelSpec
from hetero.search.placement import (
    ORDERS,
    GroupPart,
    class_group_part,
    launch_group_parts,
    launch_patterns,
    launch_runs,
    neighbours_share_node,
    place,
    representative_hosts,
)
from hetero.plan import Plan
from hetero.predict.predictor import Prediction, predict, stage_recompute
from hetero.spec.profiles import Profiles
from hetero.predict.stragglers import replica_spread, slowest_of

FAMILIES = ("cross-class", "class-pure", "launch-order")

# The cost model's recompute modes as a plan's stage entry (megatron-core's settings): full
# recomputation of every layer is Megatron's uniform method with groups of one layer.
PLAN_RECOMPUTE = {"none": "none", "selective": "selective",
                  "full": {"granularity": "full", "method": "uniform", "num_layers": 1}}
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
    """Interleaving degrees tried on the best candidates (pipelines of 2+ stages whose
    stages' layers divide evenly)."""
    exact_candidates: int = 4
    """How many of the best estimates overall the exact predictor judges..."""
    exact_per_family: int = 1
    """...plus this many of each family's best."""
    per_stage_tensor_parallel: bool = True
    """Also give each device class of a cross-class pipeline its own degree (plan version 3):
    per class the smallest of `tensor_parallel` whose stage holds a layer, and the wider
    ones where they are faster."""


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

    @property
    def tensor_parallel(self) -> int:
        """The widest degree the candidate uses (its job settings follow it)."""
        return max(self.degrees[c] for pattern in self.replica_classes for c in pattern)

    def stage_degrees(self) -> list[int]:
        """Each stage's degree (replicas of a stage share it: their classes' degrees agree)."""
        return [self.degrees[c] for c in self.replica_classes[0]]


@dataclass(frozen=True)
class _Pipeline:
    """What a shape's estimate takes from its pipeline alone (Planner._fit_pipeline)."""

    at_stage: tuple[tuple[int, ...], ...]
    """Each stage's classes."""
    counts: dict[tuple[int, ...], int]
    """Replicas of each pattern."""
    sends: dict[tuple[int, ...], list[float]]
    times: dict[tuple[int, ...], list[float]]
    """One layer's time on each stage, per pattern."""
    caps: list[int]
    modes: tuple[str, ...]
    floor: float
    """No split or micro-batch allocation makes the pipeline faster."""


@dataclass
class PlanResult:
    plan: Plan
    prediction: Prediction
    family: str
    search_time_s: float
    candidates_estimated: int
    setup: TrainingSetup
    """The settings the plan was predicted with (sequence parallelism, interleaving)."""


def device_classes(cluster: Cluster) -> list[DeviceClass]:
    """Nodes that are interchangeable: same device, fabric, devices per node and NIC (nodes
    of one rack with and without InfiniBand are different classes)."""
    classes: dict[tuple, list[str]] = {}
    for node in cluster.nodes:
        key = (node.device.name, node.group, node.count, node.nic.kind.name, node.nic.gbps)
        classes.setdefault(key, []).append(node.host)
    return [DeviceClass(t, g, cluster.devices[t].vendor, tuple(hosts), count)
            for (t, g, count, _, _), hosts in classes.items()]


def split_layers(num_layers: int, per_layer: list[float], extra: list[float],
                 caps: list[int]) -> list[int] | None:
    """Integer layers per stage minimising the slowest stage, within memory caps.

    Stage s takes layers[s] * per_layer[s] + extra[s]. Each layer goes where the resulting
    stage time is smallest, which is optimal for this separable min-max problem. None if
    the caps cannot hold num_layers with at least one layer per stage.
    """
    stages = len(per_layer)
    if stages > num_layers or min(caps) < 1 or sum(caps) < num_layers:
        return None
    layers = [1] * stages
    heap = [(2 * per_layer[s] + extra[s], s) for s in range(stages) if caps[s] > 1]
    heapq.heapify(heap)
    for _ in range(num_layers - stages):
        _, s = heapq.heappop(heap)
        layers[s] += 1
        if layers[s] < caps[s]:
            heapq.heappush(heap, ((layers[s] + 1) * per_layer[s] + extra[s], s))
    return layers


def allocate_micro_batches(total: int, replicas: dict, shape: dict) -> dict | None:
    """Micro-batches per replica so that all finish together.

    replicas[k]: how many replicas have shape k; shape[k] = (fill, step): a replica of that
    shape running m micro-batches takes fill + m * step. Returns {k: [m per replica]}.
    Replicas of one shape are interchangeable: start from the continuous solution (all
    finish at T with sum_k n_k (T - fill_k) / step_k = total), round down, then hand out
    what is left one shape-round at a time to whoever finishes earliest, and take back
    any excess from those finishing last.
    """
    if total < sum(replicas.values()):
        return None
    rate = sum(n / shape[k][1] for k, n in replicas.items())
    finish = (total + sum(n * shape[k][0] / shape[k][1] for k, n in replicas.items())) / rate
    per = {k: max(1, int((finish - shape[k][0]) / shape[k][1])) for k in replicas}
    given = sum(replicas[k] * per[k] for k in replicas)
    while given < total:
        k = min(replicas, key=lambda k: (shape[k][0] + (per[k] + 1) * shape[k][1], k))
        per[k] += 1
        given += replicas[k]
    while True:  # take back from whoever finishes last: whole rounds, then part of one
        k = max((k for k in replicas if per[k] > 1), key=lambda k: (shape[k][0] + per[k] * shape[k][1], k),
                default=None)
        if k is None or given - total < replicas[k]:
            break
        per[k] -= 1
        given -= replicas[k]
    lowered = {k: 0 for k in replicas}
    if given > total:
        lowered[k] = given - total
    return {k: [per[k]] * (replicas[k] - lowered[k]) + [per[k] - 1] * lowered[k] for k in replicas}


class Planner:
    def __init__(self, cluster: Cluster, model: ModelSpec, global_batch_size: int,
                 options: PlannerOptions = PlannerOptions(), profiles: Profiles | None = None):
        self.cluster, self.model, self.options = cluster, model, options
        self.global_batch_size = global_batch_size
        self.setup = options.setup
        self.profiles = profiles
        self._costs: dict[tuple[int, int], CostModel] = {}
        # With fused (flash) attention no score matrix is kept: selective recomputation
        # saves no memory there, only costs time.
        self._recompute_modes = tuple(m for m in options.recompute_modes
                                      if not (m == "selective" and options.setup.fused_kernels)) or ("none",)
        self.costs = self.costs_for(1)
        self.classes = device_classes(cluster)
        self._class_of = {h: c for c, cl in enumerate(self.classes) for h in cl.hosts}
        self.estimated = 0
        self._cache: dict[tuple, object] = {}
        self._layer_costs: dict[tuple, LayerCost] = {}
        self._leaders: _Leaderboard | None = None
        """While the search keeps only contenders: the shortlist so far."""

    def costs_for(self, tensor_parallel: int, virtual_stages: int = 1) -> CostModel:
        """The cost model of the setup a plan of this TP degree runs with."""
        key = (tensor_parallel, virtual_stages)
        if key not in self._costs:
            self._costs[key] = CostModel(self.cluster, self.model, setup_for(
                self.options, tensor_parallel, virtual_stages), self.profiles)
        return self._costs[key]

    def _memo(self, key: tuple, compute: Callable[[], object]):
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    # ----- per-class building blocks ------------------------------------------------------

    def _job_costs(self, tp: Degrees) -> CostModel:
        """The cost model of the job's settings: those of its widest degree."""
        return self.costs_for(max(tp))

    def uniform(self, tensor_parallel: int) -> Degrees:
        return (tensor_parallel,) * len(self.classes)

    def _layer_cost(self, c: int, tp: Degrees, mbs: int, recompute: str | None = None) -> LayerCost:
        key = (c, tp[c], max(tp), mbs, recompute)
        if key not in self._layer_costs:  # the search asks millions of times: one lookup
            cl = self.classes[c]
            self._layer_costs[key] = self._job_costs(tp).layer_cost(cl.device_type, cl.hosts[0], tp[c], mbs,
                                                                    recompute)
        return self._layer_costs[key]

    def _layer_time(self, c: int, tp: Degrees, mbs: int, recompute: str | None = None) -> float:
        return self._layer_cost(c, tp, mbs, recompute).total_s

    def _stage_layer_times(self, pattern: tuple[int, ...], modes: tuple[str, ...], tp: Degrees,
                           mbs: int) -> list[float]:
        """One layer's time on each stage of a replica whose stages are on classes `pattern`."""
        return self._memo(("times", pattern, modes, tp, mbs), lambda: [
            self._layer_time(c, tp, mbs, mode) for c, mode in zip(pattern, modes)])

    def _extra_time(self, c: int, tp: Degrees, mbs: int, first: bool, last: bool) -> float:
        """What a stage on class c runs beyond its layers (CostModel.stage_extra_times)."""
        return self._memo(("extra", c, tp[c], max(tp), mbs, first, last), lambda: sum(
            self._job_costs(tp).stage_extra_times(self.classes[c].device_type, tp[c], mbs, first, last)))

    def _micro_batch_cv(self, pattern: tuple[int, ...], tp: Degrees, mbs: int) -> float:
        """How much a micro-batch of a replica on classes `pattern` varies: its most varying class's."""
        return self._memo(("cv", pattern, tp, mbs), lambda: max(
            self._job_costs(tp).micro_batch_cv(self.classes[c].device_type, tp[c], mbs) for c in pattern))

    def _slowest_replica(self, replicas: Iterable[tuple[tuple[int, ...], float, float, int]], tp: Degrees,
                         mbs: int) -> float:
        """Expected end of the slowest of replicas given as (pattern, fill, step, micro-batches):
        the predictor's stage ends (hetero/stragglers.py), one step's variation for a micro-batch's."""
        return slowest_of((fill + m * step, replica_spread(self._micro_batch_cv(pattern, tp, mbs) * step, m))
                          for pattern, fill, step, m in replicas)

    def _end_times(self, first: Iterable[int], last: Iterable[int], stages: int, tp: Degrees,
                   mbs: int) -> tuple[float, float]:
        """(first stage's, last stage's) work beyond layers, the slowest of the classes at
        each; a one-stage pipeline's is all the last's."""
        at_last = max(self._extra_time(c, tp, mbs, stages == 1, True) for c in last)
        at_first = max(self._extra_time(c, tp, mbs, True, False) for c in first) if stages > 1 else 0.0
        return at_first, at_last

    def _layer_cap(self, c: int, tp: Degrees, mbs: int, dp: int, stage: int, stages: int,
                   recompute: str | None = None, num_micro_batches: int | None = None) -> int:
        """Most decoder layers stage `stage` can hold on a device of class c: the memory
        model's own answer (memory.layer_capacity), for the most micro-batches a replica
        runs (by default: could run)."""
        total_mb = num_micro_batches or self.global_batch_size // mbs
        in_flight_key = min(stages - stage, total_mb) if self.setup.virtual_stages == 1 else (stages - stage, total_mb)
        key = ("cap", c, tp[c], max(tp), mbs, dp, in_flight_key, stage == 0, stage == stages - 1, stages > 1,
               recompute)
        cl = self.classes[c]
        return self._memo(key, lambda: layer_capacity(
            self._job_costs(tp), self.cluster.devices[cl.device_type].memory_gib, vendor=cl.vendor,
            tensor_parallel=tp[c], data_parallel=dp, micro_batch_size=mbs, stage=stage,
            num_stages=stages, num_micro_batches=total_mb, recompute=recompute))

    def _stage_caps(self, c: int, tp: Degrees, mbs: int, dp: int, stages: int, recompute: str) -> list[int]:
        """_layer_cap of every stage of a pipeline this deep: the memory model's bilinear
        terms per kind of stage (memory.stage_memory_terms), evaluated at each stage's
        micro-batches in flight. The memory model sees a class only through its vendor and
        memory size: classes alike share the answer."""
        vendor = self.classes[c].vendor
        memory_gib = self.cluster.devices[self.classes[c].device_type].memory_gib

        def compute() -> list[int]:
            total_mb = self.global_batch_size // mbs
            v = self.setup.virtual_stages
            ends = [(s == 0, s == stages - 1) for s in range(stages)]
            terms = {(first, last): self._memo(
                ("terms", vendor, tp[c], max(tp), mbs, dp, recompute, first, last), lambda: stage_memory_terms(
                    self._job_costs(tp), first=first, last=last, vendor=vendor, tensor_parallel=tp[c],
                    data_parallel=dp, micro_batch_size=mbs, recompute=recompute)) for first, last in set(ends)}
            return [terms[end].capacity(memory_gib, micro_batches_in_flight(s, stages, total_mb, v))
                    for s, end in enumerate(ends)]
        return self._memo(("caps", vendor, memory_gib, tp[c], max(tp), mbs, dp, stages, recompute), compute)

    def _send_time(self, a: int, b: int, tp: Degrees, mbs: int, same_node: bool, crossings: int) -> float:
        """One activation across a pipeline boundary from class a to class b (re-sharded
        when their degrees differ)."""
        key = ("send", a, b, tp[a], tp[b], max(tp), mbs, same_node, crossings)
        if key not in self._cache:
            ca, cb = self.classes[a], self.classes[b]
            costs = self._job_costs(tp)
            if a == b:
                other = ca.hosts[0] if same_node or len(ca.hosts) == 1 else ca.hosts[1]
                self._cache[key] = costs.stage_transfer(ca.hosts[0], other, tp[a], mbs)
            else:
                self._cache[key] = costs.stage_transfer(ca.hosts[0], cb.hosts[0], tp[a], mbs, crossings, tp[b])
        return self._cache[key]

    def _classes_at_stages(self, patterns: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        """Each stage's classes over replicas of these patterns."""
        return self._memo(("at stages", patterns),
                          lambda: tuple(tuple(sorted(set(classes))) for classes in zip(*patterns)))

    def _spans_groups(self, parts: tuple[GroupPart, ...]) -> bool:
        """Whether a data-parallel group lying so crosses fabric groups."""
        return self._memo(("spans", parts), lambda: len({self.classes[c].group for c, *_ in parts}) > 1)

    def _group_terms(self, parts: tuple[GroupPart, ...], crossings: int) -> tuple[float, float]:
        key = ("terms", parts, crossings)
        if key not in self._cache:
            hosts = representative_hosts(parts, self.classes)
            self._cache[key] = self.costs.allreduce_terms(hosts, crossings if self._spans_groups(parts) else 1)
        return self._cache[key]

    def _stage_params(self, layers: list[int], s: int) -> float:
        first, last, stages = s == 0, s == len(layers) - 1, len(layers)
        key = ("params", layers[s], first, last, stages > 1)
        if key not in self._cache:
            self._cache[key] = stage_params(self.costs, layers[s], first, last, stages)
        return self._cache[key]

    # ----- judging a shape --------------------------------------------------------------

    def _judge(self, family: str, order: str, tp: Degrees, mbs: int,
               patterns: list[tuple[tuple[int, ...], int]], dp_parts: list[tuple[GroupPart, ...]],
               same_node: dict[int, bool], sweep: "_StageSweep | None" = None) -> Candidate | None:
        """Stage split, micro-batches and an estimated iteration time.

        patterns: (class of each stage, number of replicas like that), in replica order;
        dp_parts[s]: where stage s's data-parallel group lies; same_node[c]: whether a
        replica's consecutive stages of class c share a node in this order; sweep: the
        family's pipeline-depth sweep, told what this shape achieves. None also when the
        shape fits but provably cannot matter (_worth_judging).
        """
        self.estimated += 1
        d = sum(n for _, n in patterns)
        if self.global_batch_size // mbs < d or len(patterns[0][0]) > self.model.num_layers:
            return None
        # Placement orders that move data alike share the pipeline; only the groups differ.
        same_key = tuple(sorted(same_node.items()))
        key = (tp, mbs, tuple(patterns), same_key)
        if sweep is None:  # nobody needs to hear whether the shape fits: spare it the memory model
            loose = self._memo(("loose floor",) + key, lambda: self._loose_floor(tp, mbs, patterns, same_key))
            if not self._worth_judging(family, loose, None):
                return None
        pipe = self._memo(("pipeline",) + key, lambda: self._fit_pipeline(tp, mbs, patterns, same_key))
        if pipe is None or not self._worth_judging(family, pipe.floor, sweep):
            return None
        split = self._memo(("split",) + key, lambda: self._split_pipeline(tp, mbs, pipe))
        if split is None:
            return None
        layers, micro, pipeline = split
        terms = self._stage_group_terms(tp, dp_parts)
        after = self._reduce_and_step(tp, mbs, d, layers, pipe.modes, pipe.at_stage, terms)
        given = {p: iter(micro[p]) for p in micro}
        replica_classes = list(itertools.chain.from_iterable([p] * n for p, n in patterns))
        micro_batches = list(itertools.chain.from_iterable(itertools.islice(given[p], n) for p, n in patterns))
        candidate = Candidate(family, order, tp, mbs, list(layers), replica_classes, micro_batches,
                              pipeline + after, list(pipe.modes))
        if self._leaders is not None:
            self._leaders.add(candidate)
        if sweep is not None:
            sweep.record(candidate.estimate_s)
        return candidate

    def _fit_pipeline(self, tp: Degrees, mbs: int, patterns: list[tuple[tuple[int, ...], int]],
                      same_node: tuple[tuple[int, bool], ...]) -> "_Pipeline | None":
        """The stages' caps and recomputation, and a floor of the pipeline's time; None if
        the layers cannot fit. same_node: _judge's, as sorted (class, shares) pairs."""
        d = sum(n for _, n in patterns)
        distinct = sorted({p for p, _ in patterns})
        at_stage = self._classes_at_stages(tuple(distinct))
        fitting = self._recompute_to_fit(tp, mbs, d, at_stage)
        if fitting is None:
            return None
        caps, modes = fitting
        crossings = d * max(tp)  # every replica's transfer at a boundary runs at once
        sends = {p: self._pattern_sends(p, tp, mbs, same_node, crossings) for p in distinct}
        times = {p: self._stage_layer_times(p, modes, tp, mbs) for p in distinct}
        counts = _replica_counts(patterns)
        floor = self._pipeline_floor(counts, sends, times, caps, tp, mbs, self.global_batch_size // mbs)
        return _Pipeline(at_stage, counts, sends, times, caps, modes, floor)

    def _loose_floor(self, tp: Degrees, mbs: int, patterns: list[tuple[tuple[int, ...], int]],
                     same_node: tuple[tuple[int, bool], ...]) -> float:
        """_Pipeline.floor before knowing the memory: every stage under its fastest
        recomputation, with room for all the layers."""
        counts = _replica_counts(patterns)
        sends = {p: self._pattern_sends(p, tp, mbs, same_node, sum(counts.values()) * max(tp)) for p in counts}
        fastest = {c: min(self._layer_time(c, tp, mbs, mode) for mode in self._recompute_modes)
                   for c in set().union(*counts)}
        times = {p: [fastest[c] for c in p] for p in counts}
        caps = [self.model.num_layers] * len(patterns[0][0])
        return self._pipeline_floor(counts, sends, times, caps, tp, mbs, self.global_batch_size // mbs)

    def _split_pipeline(self, tp: Degrees, mbs: int, pipe: "_Pipeline"
                        ) -> tuple[list[int], dict[tuple[int, ...], list[int]], float] | None:
        """(layers per stage, micro-batches per replica of each pattern, seconds of the
        busiest replica), None if they cannot be split."""
        extra = list(map(max, zip(*pipe.sends.values())))
        at_first, at_last = self._end_times(pipe.at_stage[0], pipe.at_stage[-1], len(extra), tp, mbs)
        extra[0] += at_first
        extra[-1] += at_last
        per_layer = list(map(max, zip(*pipe.times.values())))  # each stage's slowest class
        layers = split_layers(self.model.num_layers, per_layer, extra, pipe.caps)
        if layers is None:
            return None
        shape = {p: self._replica_shape(p, layers, pipe.modes, tp, mbs, sends) for p, sends in pipe.sends.items()}
        micro = allocate_micro_batches(self.global_batch_size // mbs, pipe.counts, shape)
        if micro is None:
            return None
        return layers, micro, self._slowest_replica(
            ((p, *shape[p], m) for p in micro for m in micro[p]), tp, mbs)

    def _stage_group_terms(self, tp: Degrees, dp_parts: list[tuple[GroupPart, ...]]) -> list[tuple[float, float]]:
        """Each stage's all-reduce terms; groups crossing fabrics share the links."""
        alike = collections.Counter(dp_parts)  # stages whose groups lie alike
        spanning = sum(n for parts, n in alike.items() if self._spans_groups(parts))
        crossings = max(1, max(tp) * spanning)
        terms_of = {parts: self._group_terms(parts, crossings) for parts in alike}
        return [terms_of[parts] for parts in dp_parts]

    def _pattern_sends(self, pattern: tuple[int, ...], tp: Degrees, mbs: int,
                       same_node: tuple[tuple[int, bool], ...], crossings: int) -> list[float]:
        """Each stage's transfers per micro-batch (its activation out, its gradient back)."""
        def compute() -> list[float]:
            same = dict(same_node)
            boundary: dict[tuple[int, int], tuple[float, float]] = {}  # (forward, backward) by classes
            out = [0.0] * len(pattern)
            for s in range(len(pattern) - 1):
                a, b = pattern[s], pattern[s + 1]
                if (a, b) not in boundary:
                    boundary[a, b] = (self._send_time(a, b, tp, mbs, same.get(a, False), crossings),
                                      self._send_time(b, a, tp, mbs, same.get(a, False), crossings))
                forward, backward = boundary[a, b]
                out[s] += forward
                out[s + 1] += backward
            return out
        return self._memo(("sends", pattern, tp, mbs, same_node, crossings), compute)

    def _pipeline_floor(self, counts: dict[tuple[int, ...], int], sends: dict[tuple[int, ...], list[float]],
                        times: dict[tuple[int, ...], list[float]], caps: list[int], tp: Degrees, mbs: int,
                        total_mb: int) -> float:
        """A lower bound on the pipeline part of _judge's estimate, whatever the layer split
        (within the stages' caps) and the micro-batch allocation. A replica of pattern p
        running m micro-batches takes fill + m * step = sum(work) + (m - 1) * max(work)
        (_replica_shape): at least least_p + (m - 1) * step_p, least_p with the layers on
        the pattern's fastest stages and step_p with the layers spread perfectly over its
        stages. Every replica runs at least one micro-batch, and together they run
        total_mb: the slowest takes at least the returned time."""
        num_layers = self.model.num_layers
        rate = offset = slowest_single = 0.0
        for p, n in counts.items():
            least = (_least_layer_work(times[p], caps, num_layers) + sum(sends[p])
                     + sum(self._end_times([p[0]], [p[-1]], len(p), tp, mbs)))
            step = num_layers / sum(1 / t for t in times[p])
            rate += n / step
            offset += n * least / step
            slowest_single = max(slowest_single, least)
        return max(slowest_single, (total_mb - sum(counts.values()) + offset) / rate)

    def _worth_judging(self, family: str, floor: float, sweep: "_StageSweep | None") -> bool:
        """Whether a shape whose estimate is at least `floor` can still matter: reach the
        shortlist (while the search keeps only contenders), or change its sweep's course. A
        shape that cannot (and fits, as it does whenever a sweep is given) is reported to its
        sweep with its floor, which steers the sweep exactly as its estimate would (both lie
        above _StageSweep.bar)."""
        if self._leaders is None:
            return True
        floor *= 1 - FLOOR_ROUNDING  # so that rounding never lifts it above the estimate
        if floor <= self._leaders.bar(family) or (sweep is not None and floor <= sweep.bar()):
            return True
        if sweep is not None:
            sweep.record(floor)
        return False

    # The pieces of an estimate, shared by _judge (which also chooses the layout) and
    # estimate (a given plan).

    def _replica_shape(self, pattern: tuple[int, ...], layers: list[int], modes: Sequence[str], tp: Degrees,
                       mbs: int, sends: list[float]) -> tuple[float, float]:
        """(fill, step) of a replica whose stages are on classes `pattern`: running m
        micro-batches takes about fill + m * step (the slowest stage paces the pipeline,
        the others fill and drain it)."""
        times = self._stage_layer_times(pattern, tuple(modes), tp, mbs)
        work = [n * t + x for n, t, x in zip(layers, times, sends)]
        at_first, at_last = self._end_times([pattern[0]], [pattern[-1]], len(pattern), tp, mbs)
        work[0] += at_first
        work[-1] += at_last
        return sum(work) - max(work), max(work)

    def _reduce_and_step(self, tp: Degrees, mbs: int, d: int, layers: list[int], modes: list[str],
                         at_stage: list[list[int]], terms: list[tuple[float, float]]) -> float:
        """The slowest stage's exposed gradient synchronisation plus the slowest optimizer
        step: the same CostModel functions the predictor calls. A stage's classes share
        its degree."""
        costs, last = self._job_costs(tp), len(layers) - 1
        # Stages alike (same group, classes, recomputation, ends) differ only in their
        # layer count, and the most layers take longest: judge one stage of each kind.
        heaviest: dict[tuple, int] = {}
        for s in range(len(layers)):
            kind = (terms[s], tuple(at_stage[s]), modes[s], s == 0, s == last)
            if kind not in heaviest or layers[s] > layers[heaviest[kind]]:
                heaviest[kind] = s
        reduce = max(costs.gradient_sync(
            terms[s], self._stage_params(layers, s) / tp[at_stage[s][0]], d,
            layers[s] * min(self._layer_cost(c, tp, mbs, modes[s]).backward_s for c in at_stage[s]))
            for s in heaviest.values())
        share = d if self.setup.distributed_optimizer else 1
        optimizer = max(costs.optimizer_step(self.classes[c].device_type, self._stage_params(layers, s) / tp[c] / share)
                        for s in heaviest.values() for c in at_stage[s])
        return reduce + optimizer

    def estimate(self, plan: Plan) -> tuple[bool, float]:
        """The fast estimate of a given plan (its layout, layers, micro-batches and
        recomputation as they are): (fits in memory, seconds per iteration). What the
        search ranks candidates by, applied to any plan: tests compare it with predict()."""
        pp, dp, mbs = plan.pipeline_parallel, plan.data_parallel, plan.micro_batch_size
        hosts = [[plan.stage_device(d, s).host for s in range(pp)] for d in range(dp)]
        patterns = [tuple(self._class_of[h] for h in row) for row in hosts]
        degrees = {c: plan.stage_tensor_parallel[s] for pattern in patterns for s, c in enumerate(pattern)}
        tp = tuple(degrees.get(c, plan.tensor_parallel) for c in range(len(self.classes)))
        costs = self._job_costs(tp)
        at_stage = [sorted({p[s] for p in patterns}) for s in range(pp)]
        layers = [stage.num_layers for stage in plan.stages]
        modes = [stage_recompute(plan, s, costs) for s in range(pp)]
        fits = all(layers[s] <= self._layer_cap(pattern[s], tp, mbs, dp, s, pp, modes[s],
                                                plan.replicas[d].num_micro_batches)
                   for d, pattern in enumerate(patterns) for s in range(pp))
        crossings = dp * max(tp)
        replicas = []
        for d, pattern in enumerate(patterns):
            sends = [0.0] * pp
            for s in range(pp - 1):
                a, b, same = pattern[s], pattern[s + 1], hosts[d][s] == hosts[d][s + 1]
                sends[s] += self._send_time(a, b, tp, mbs, same, crossings)
                sends[s + 1] += self._send_time(b, a, tp, mbs, same, crossings)
            replicas.append((pattern, *self._replica_shape(pattern, layers, modes, tp, mbs, sends),
                             plan.replicas[d].num_micro_batches))
        pipeline = self._slowest_replica(replicas, tp, mbs)
        groups = [[plan.device_of_logical(r).host for r in plan.data_group(0, s)] for s in range(pp)]
        spanning = sum(len({self.cluster.node(h).group for h in g}) > 1 for g in groups)
        terms = [costs.allreduce_terms(tuple(g), max(1, max(tp) * spanning)) for g in groups]
        return fits, pipeline + self._reduce_and_step(tp, mbs, dp, layers, modes, at_stage, terms)

    def _recompute_to_fit(self, tp: Degrees, mbs: int, d: int, at_stage: tuple[tuple[int, ...], ...]
                          ) -> tuple[list[int], tuple[str, ...]] | None:
        """Each stage's layer cap and recomputation, None if no choice holds the layers:
        every stage starts with the cheapest mode; while the stages cannot hold the layers
        (split_layers fails only then: a stage with room for none, or too little room in
        all), the stage with the least room moves to the next mode (its activations shrink,
        its backward grows). The same for every placement order of a shape: memoised."""
        return self._memo(("fit", tp, mbs, d, at_stage), lambda: self._escalate_recompute(tp, mbs, d, at_stage))

    def _escalate_recompute(self, tp: Degrees, mbs: int, d: int, at_stage: tuple[tuple[int, ...], ...]
                            ) -> tuple[list[int], tuple[str, ...]] | None:
        stages, modes_tried = len(at_stage), self._recompute_modes
        by_mode: dict[str, list[int]] = {}

        def caps_of(mode: str) -> list[int]:  # per stage, the least over its classes
            if mode not in by_mode:
                per_class = {c: self._stage_caps(c, tp, mbs, d, stages, mode) for c in set().union(*at_stage)}
                by_mode[mode] = _least_per_stage(per_class, at_stage)
            return by_mode[mode]

        level = [0] * stages
        caps = list(caps_of(modes_tried[0]))
        total, least = sum(caps), min(caps)
        if total < self.model.num_layers or least < 1:
            if len(modes_tried) == 1:
                return None
            heap = [(cap, s) for s, cap in enumerate(caps)]  # the stage with the least room first
            heapq.heapify(heap)
            while heap and (total < self.model.num_layers or least < 1):
                _, s = heapq.heappop(heap)
                level[s] += 1
                new = caps_of(modes_tried[level[s]])[s]
                total += new - caps[s]
                caps[s] = new
                if level[s] + 1 < len(modes_tried):
                    heapq.heappush(heap, (new, s))
                least = min(caps) if caps[s] >= 1 > least else least
            if total < self.model.num_layers or min(caps) < 1:
                return None
        return caps, tuple(modes_tried[i] for i in level)

    # ----- the three families -----------------------------------------------------------

    def _per_node(self, c: int, tp: Degrees) -> int:
        return self.classes[c].devices_per_node // tp[c]

    def _cross_class(self, tp: Degrees, mbs: int, classes: list[int]) -> Iterable[Candidate]:
        groups = {c: len(self.classes[c].tp_groups(tp[c])) for c in classes}
        seen: set[tuple[int, ...]] = set()
        for d in range(1, max(groups.values()) + 1):
            k = tuple(groups[c] // d for c in classes)
            if 0 in k or k in seen:
                continue
            seen.add(k)
            d_use = min(min(groups[c] // kc for c, kc in zip(classes, k)), self.global_batch_size // mbs)
            if sum(k) > self.model.num_layers or d_use < 1:
                continue
            counts = dict(zip(classes, k))
            for class_order in self._class_orders(classes):
                pattern = tuple(c for c in class_order for _ in range(counts[c]))
                if tp[pattern[0]] != tp[pattern[-1]] and not self.model.untie_embeddings_and_output_weights:
                    continue  # a tied embedding needs first and last stage of one degree (the runtime's rule)
                for order in ORDERS:
                    parts, same = self._cross_class_layout(tp, pattern, d_use, order)
                    candidate = self._judge("cross-class", order, tp, mbs, [(pattern, d_use)], parts, same)
                    if candidate is not None:
                        yield candidate

    def _cross_class_layout(self, tp: Degrees, pattern: tuple[int, ...], replicas: int, order: str
                            ) -> tuple[list[tuple[GroupPart, ...]], dict[int, bool]]:
        """Where each stage's data-parallel group lies, and whether a replica's consecutive
        stages of a class share a node: the same for every micro-batch size."""
        def compute() -> tuple[list[tuple[GroupPart, ...]], dict[int, bool]]:
            local = [pattern[:s].count(c) for s, c in enumerate(pattern)]  # stage index in its class
            parts = [(class_group_part(c, self._per_node(c, tp), replicas, pattern.count(c), j, order),)
                     for c, j in zip(pattern, local)]
            same = {c: neighbours_share_node(self._per_node(c, tp), replicas, pattern.count(c), order)
                    for c in sorted(set(pattern))}
            return parts, same
        return self._memo(("cross-class layout", tp, pattern, replicas, order), compute)

    def _class_orders(self, classes: list[int]) -> list[tuple[int, ...]]:
        """Stage orders worth trying: all of them for few classes, else grouped by fabric."""
        if len(classes) <= 3:
            return list(itertools.permutations(classes))
        by_group: dict[str, list[int]] = {}
        for c in classes:
            by_group.setdefault(self.classes[c].group, []).append(c)
        orders = []
        for groups in itertools.permutations(sorted(by_group)):
            order = [c for g in groups for c in sorted(
                by_group[g], key=lambda c: -self.cluster.devices[self.classes[c].device_type].memory_gib)]
            orders.append(tuple(order))
            if len(orders) >= 6:
                break
        return orders

    def _stage_counts(self) -> "_StageSweep":
        return _StageSweep(self.model.num_layers)

    def _class_pure(self, tp: Degrees, mbs: int, classes: list[int]) -> Iterable[Candidate]:
        groups = {c: len(self.classes[c].tp_groups(tp[c])) for c in classes}
        sweep = self._stage_counts()
        for stages in sweep:
            replicas = {c: groups[c] // stages for c in sorted(classes) if groups[c] // stages}
            if not replicas:
                break
            patterns = [(tuple([c] * stages), n) for c, n in replicas.items()]
            for order in ORDERS:
                parts, same = self._class_pure_layout(tp, stages, tuple(replicas.items()), order)
                candidate = self._judge("class-pure", order, tp, mbs, patterns, parts, same, sweep)
                if candidate is not None:
                    yield candidate

    def _class_pure_layout(self, tp: Degrees, stages: int, replicas: tuple[tuple[int, int], ...], order: str
                           ) -> tuple[list[tuple[GroupPart, ...]], dict[int, bool]]:
        """_cross_class_layout for class-pure replicas, `replicas`: (class, how many)."""
        def compute() -> tuple[list[tuple[GroupPart, ...]], dict[int, bool]]:
            parts = [tuple(class_group_part(c, self._per_node(c, tp), n, stages, s, order) for c, n in replicas)
                     for s in range(stages)]
            same = {c: neighbours_share_node(self._per_node(c, tp), n, stages, order) for c, n in replicas}
            return parts, same
        return self._memo(("class-pure layout", tp, stages, replicas, order), compute)

    def _launch_order(self, tp: Degrees, mbs: int, classes: list[int]) -> Iterable[Candidate]:
        runs = launch_runs(self.cluster, self._class_of, set(classes), max(tp))
        total = runs[-1].end_group if runs else 0
        sweep = self._stage_counts()
        for stages in sweep:
            d = total // stages
            if d < 1:
                break
            patterns = launch_patterns(runs, d, stages)
            parts = [launch_group_parts(runs, s * d, d) for s in range(stages)]
            same = {c: False for c in classes}  # neighbours are d groups apart
            candidate = self._judge("launch-order", "stage-major", tp, mbs, patterns, parts, same, sweep)
            if candidate is not None:
                yield candidate

    # ----- from a candidate to a plan -----------------------------------------------------

    def materialize(self, candidate: Candidate, order: str) -> Plan:
        plan = place(self.cluster, self.classes, candidate.degrees, candidate.micro_batch_size,
                     candidate.layers, candidate.replica_classes, candidate.micro_batches, order)
        if candidate.recompute and any(mode != "none" for mode in candidate.recompute):
            data = plan.to_dict()
            for stage, mode in zip(data["stages"], candidate.recompute):
                stage["recompute"] = PLAN_RECOMPUTE[mode]
            plan = Plan.from_dict(data)
        return plan

    # ----- search -------------------------------------------------------------------------

    def candidates(self, progress: Callable[[str], None] | None = None,
                   only_contenders: bool = False) -> list[Candidate]:
        """Every shape that fits, estimated; with only_contenders, those that may still reach
        the shortlist (the others are dropped once a lower bound of their estimate shows
        they cannot: the shortlist is the same, the search faster)."""
        self._leaders = _Leaderboard(self.options.exact_candidates, self.options.exact_per_family) \
            if only_contenders else None
        sizes = self.options.micro_batch_sizes
        if not any(self.global_batch_size % mbs == 0 for mbs in sizes):
            raise HeteroError(
                f"global batch size {self.global_batch_size} is not divisible by any micro-batch "
                f"size tried ({', '.join(map(str, sizes))}); choose a global batch that is"
            )
        found: list[Candidate] = []
        everyone = list(range(len(self.classes)))
        subsets = [everyone] + ([[c for c in everyone if c != drop] for drop in everyone]
                                if len(everyone) > 1 else [])
        for width in self.options.tensor_parallel:
            tp = self.uniform(width)
            for mbs in self.options.micro_batch_sizes:
                if self.global_batch_size % mbs:
                    continue
                if progress:
                    progress(f"TP={width} micro-batch={mbs}")
                for subset in subsets:
                    usable = [c for c in subset if self.classes[c].devices_per_node >= width]
                    if not usable or (subset is not everyone and len(usable) == len(everyone)):
                        continue
                    found.extend(self._class_pure(tp, mbs, usable))
                    if len(usable) > 1:  # on one class the other families are the same plans
                        found.extend(self._cross_class(tp, mbs, usable))
                        found.extend(self._launch_order(tp, mbs, usable))
        if self.options.per_stage_tensor_parallel and len(everyone) > 1:
            for mbs in self.options.micro_batch_sizes:
                if self.global_batch_size % mbs:
                    continue
                for tp in self._mixed_degrees(mbs):
                    if progress:
                        progress(f"TP per class {tp} micro-batch={mbs}")
                    found.extend(self._cross_class(tp, mbs, everyone))
        return found

    def _mixed_degrees(self, mbs: int) -> list[Degrees]:
        """Per-class degrees for cross-class pipelines (uniform ones are searched anyway):
        each class from its smallest degree whose stage holds a decoder layer (room for one
        on a pipeline as deep as the layers, the most micro-batches in flight) up to the
        widest that fits its nodes; only combinations that differ, at most 64."""
        choices = []
        for c, cl in enumerate(self.classes):
            widths = [w for w in sorted(self.options.tensor_parallel) if cl.devices_per_node >= w]
            fitting = [w for w in widths if max(self._stage_caps(
                c, self.uniform(w), mbs, 1, self.model.num_layers, self._recompute_modes[-1])) >= 1]
            choices.append(fitting)
        if any(not widths for widths in choices):
            return []
        mixed = [tp for tp in itertools.product(*choices) if len(set(tp)) > 1]
        return mixed[:64]

    def _shortlist(self, found: list[Candidate]) -> list[Candidate]:
        """The best estimates overall, plus each family's best: estimates are rough, and
        the exact predictor is the judge."""
        found = sorted(found, key=lambda c: (c.estimate_s, c.family, c.degrees, c.micro_batch_size))
        chosen = _distinct(found)[: self.options.exact_candidates]
        for family in FAMILIES:
            chosen += _distinct([c for c in found if c.family == family])[: self.options.exact_per_family]
        unique, seen = [], set()
        for c in chosen:
            if id(c) not in seen:
                seen.add(id(c))
                unique.append(c)
        return unique

    def plan(self, progress: Callable[[str], None] | None = None) -> PlanResult:
        if self.global_batch_size < 1:
            raise HeteroError("global batch size must be at least 1")
        start = time.perf_counter()
        found = self.candidates(progress, only_contenders=True)
        best: tuple[float, Plan, Prediction, str, TrainingSetup] | None = None
        shortlist = self._shortlist(found)
        trials = [(c, c.order) for c in shortlist]
        trials += [(c, o) for c in shortlist[:1] if c.family != "launch-order" for o in ORDERS if o != c.order]
        for candidate, order in trials:
            for v, plan in self._interleavings(self.materialize(candidate, order)):
                costs = self.costs_for(candidate.tensor_parallel, v)
                prediction = predict(plan, self.cluster, costs)
                if prediction.fits and (best is None or prediction.iteration_time_s < best[0]):
                    best = (prediction.iteration_time_s, plan, prediction, candidate.family, costs.setup)
        if best is None:
            raise HeteroError(self._why_nothing_fits())
        return PlanResult(best[1], best[2], best[3], time.perf_counter() - start, self.estimated, best[4])

    def _interleavings(self, plan: Plan) -> list[tuple[int, Plan]]:
        """The plan with each virtual-stage count megatron-core can run it with: every
        stage's layers split into v equal chunks (stages[s].virtual_stages), kept only when
        the plan's validation accepts it (its micro-batch counts against the pipeline)."""
        found = []
        for v in self.options.virtual_stages:
            if v == 1:
                found.append((1, plan))
                continue
            if plan.pipeline_parallel < 2 or any(st.num_layers % v for st in plan.stages):
                continue
            data = plan.to_dict()
            for stage in data["stages"]:
                stage["virtual_stages"] = [stage["num_layers"] // v] * v
            try:
                found.append((v, Plan.from_dict(data)))
            except HeteroError:
                continue
        return found

    def _why_nothing_fits(self) -> str:
        largest = max(self.cluster.devices[c.device_type].memory_gib for c in self.classes)
        return (
            f"no plan fits: {self.model.total_params() / 1e9:.1f}B parameters at global batch "
            f"{self.global_batch_size} do not fit the memory of cluster {self.cluster.name} "
            f"({self.cluster.num_devices} devices, largest {largest:g} GiB) under any TP "
            f"{self.options.tensor_parallel} x PP x DP split; add devices, lower the micro-batch "
            "size or sequence length, or use the distributed optimizer"
        )


def setup_for(options: PlannerOptions, tensor_parallel: int, virtual_stages: int = 1) -> TrainingSetup:
    """The job's settings for a plan of this TP degree and interleaving: sequence
    parallelism as the options say (by default on whenever TP > 1)."""
    wanted = options.sequence_parallel
    sequence_parallel = tensor_parallel > 1 and (wanted is None or wanted)
    return dataclasses.replace(options.setup, sequence_parallel=sequence_parallel,
                               virtual_stages=virtual_stages)


class _StageSweep:
    """Pipeline depths 1, 2, ... for one family, stopping once `patience` depths in a row
    have all estimated more than `margin` above the best so far: past the smallest depth
    that fits in memory, a deeper pipeline only adds bubbles and transfers."""

    patience, margin = 4, 1.15

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.best = float("inf")
        self.worse_in_a_row = 0
        self.depth_best = float("inf")

    def __iter__(self):
        for stages in range(1, self.num_layers + 1):
            self.depth_best = float("inf")
            yield stages
            if self.depth_best < float("inf"):
                self.best = min(self.best, self.depth_best)
                self.worse_in_a_row = self.worse_in_a_row + 1 if self.depth_best > self.margin * self.best else 0
                if self.worse_in_a_row >= self.patience:
                    return

    def record(self, estimate_s: float) -> None:
        """A shape at the current depth that fits, with its estimate (or a floor of it above bar())."""
        self.depth_best = min(self.depth_best, estimate_s)

    def bar(self) -> float:
        """A depth's estimates above this cannot change the sweep's course: they do not lower
        the depth's best so far, or they neither lower the overall best nor break a run of
        depths worse than it by the margin (a floor recorded instead keeps both so)."""
        return min(self.depth_best, self.margin * self.best)


def _replica_counts(patterns: list[tuple[tuple[int, ...], int]]) -> dict[tuple[int, ...], int]:
    """Replicas of each pattern (a pattern may come back further on in replica order)."""
    counts: dict[tuple[int, ...], int] = {}
    for p, n in patterns:
        counts[p] = counts.get(p, 0) + n
    return counts


def _least_layer_work(times: list[float], caps: list[int], num_layers: int) -> float:
    """The least sum of layers[s] * times[s] over splits with 1 <= layers[s] <= caps[s]:
    a layer on every stage, the others on the fastest stages first."""
    work, left = sum(times), num_layers - len(times)
    for time_s, cap in sorted(zip(times, caps)):
        if left <= 0:
            break
        extra = min(left, cap - 1)
        work += extra * time_s
        left -= extra
    return work


def _least_per_stage(per_class: dict[int, list[int]], at_stage: tuple[tuple[int, ...], ...]) -> list[int]:
    """Each stage's least value over the classes at that stage."""
    if len(set(at_stage)) == 1:  # the same classes at every stage (class-pure shapes): column-wise
        return list(map(min, zip(*(per_class[c] for c in at_stage[0]))))
    return [min(per_class[c][s] for c in classes) for s, classes in enumerate(at_stage)]


def _shape_key(c: Candidate) -> tuple:
    return (c.family, c.order, c.degrees, c.micro_batch_size, len(c.layers), len(c.replica_classes))


def _distinct(candidates: list[Candidate]) -> list[Candidate]:
    """One per (family, TP, micro-batch, stages, replicas), best first, so the exact
    predictor sees different shapes rather than near copies of one."""
    seen, out = set(), []
    for c in candidates:
        key = _shape_key(c)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


class _BestDistinct:
    """The `size` best estimates among distinct shapes (_shape_key), each shape at its best."""

    def __init__(self, size: int):
        self.size = size
        self.best: dict[tuple, float] = {}

    def add(self, key: tuple, estimate_s: float) -> None:
        if key in self.best:
            self.best[key] = min(self.best[key], estimate_s)
        elif len(self.best) < self.size:
            self.best[key] = estimate_s
        elif self.size:
            worst = max(self.best, key=self.best.__getitem__)
            if estimate_s < self.best[worst]:
                del self.best[worst]
                self.best[key] = estimate_s

    def bar(self) -> float:
        """An estimate above this cannot be among the `size` best: it only falls as shapes come."""
        if len(self.best) < self.size:
            return float("inf")
        return max(self.best.values(), default=float("-inf"))


class _Leaderboard:
    """What a candidate has to beat to reach Planner._shortlist: the best distinct shapes
    overall, or its family's."""

    def __init__(self, overall: int, per_family: int):
        self.overall = _BestDistinct(overall)
        self.families = {family: _BestDistinct(per_family) for family in FAMILIES}

    def add(self, candidate: Candidate) -> None:
        key = _shape_key(candidate)
        self.overall.add(key, candidate.estimate_s)
        self.families[candidate.family].add(key, candidate.estimate_s)

    def bar(self, family: str) -> float:
        return max(self.overall.bar(), self.families[family].bar())
