"""The search's cost look-ups, cached: what one decoder layer, one stage's ends, one
pipeline send and one data-parallel group's reduction cost on a device class.

The search asks for the same few blocks millions of times (one per shape, placement order
and depth); each is computed once from the cost model (hetero/predict/costs.py) and kept.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable, TypeVar

from hetero.predict.costs import CostModel
from hetero.predict.layer_costs import LayerCost
from hetero.predict.memory import stage_params
from hetero.predict.expert_exchange import expert_data_group_hosts, expert_exchange_beyond_node_s, packed_expert_group
from hetero.predict.tied_embedding import tied_embedding_sync_s
from hetero.search.expert_parallel import expert_tensor_parallel_for
from hetero.search.options import Degrees, PlannerOptions, device_classes, setup_for
from hetero.search.placement import GroupPart, representative_hosts
from hetero.spec.cluster import Cluster
from hetero.spec.model import ModelSpec
from hetero.spec.profiles import Profiles

T = TypeVar("T")


class Memoised:
    """Results by key, each computed once (self._memo(key, compute)): the search asks for
    the same blocks over and over."""

    def __init__(self) -> None:
        self._cache: dict[tuple, object] = {}

    def _memo(self, key: tuple, compute: Callable[[], T]) -> T:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]


class CostBlocks(Memoised):
    """The cached cost blocks of one cluster, model and set of options. Classes are the
    cluster's device classes (options.device_classes), by index; a Degrees gives each
    class's tensor-parallel degree, and the job's settings follow the widest."""

    def __init__(self, cluster: Cluster, model: ModelSpec, options: PlannerOptions,
                 profiles: Profiles | None = None):
        super().__init__()
        self.cluster, self.model, self.options, self.profiles = cluster, model, options, profiles
        self._costs: dict[tuple[int, int], CostModel] = {}
        # One search prices one expert-parallel degree (the planner runs one per degree).
        chosen = options.expert_parallel
        self.expert_parallel = chosen[0] if chosen is not None and len(chosen) == 1 and model.is_moe else 1
        self.costs = self.costs_for(1)
        self.classes = device_classes(cluster)
        self.class_of = {h: c for c, cl in enumerate(self.classes) for h in cl.hosts}
        self._layer_costs: dict[tuple, LayerCost] = {}

    def costs_for(self, tensor_parallel: int, virtual_stages: int = 1) -> CostModel:
        """The cost model of the setup a plan of this TP degree runs with."""
        key = (tensor_parallel, virtual_stages)
        if key not in self._costs:
            ep = self.expert_parallel
            self._costs[key] = CostModel(self.cluster, self.model, setup_for(
                self.options, tensor_parallel, virtual_stages), self.profiles,
                expert_parallel=ep, expert_tensor_parallel=expert_tensor_parallel_for(ep, self.options.expert_tensor_parallel))
        return self._costs[key]

    def job_costs(self, tp: Degrees) -> CostModel:
        """The cost model of the job's settings: those of its widest degree."""
        return self.costs_for(max(tp))

    def uniform(self, tensor_parallel: int) -> Degrees:
        """One degree for every class."""
        return (tensor_parallel,) * len(self.classes)

    def per_node(self, c: int, tp: Degrees) -> int:
        """Tensor-parallel groups on one node of class c."""
        return self.classes[c].devices_per_node // tp[c]

    # ----- compute ----------------------------------------------------------------------

    def layer_cost(self, c: int, tp: Degrees, mbs: int, recompute: str | None = None) -> LayerCost:
        """One layer on a rank of class c, its expert-parallel group (mixtures of experts)
        packed as tightly as the class's nodes allow: spread over nodes where it holds more
        members than a node has room for (the predictor prices the plan's own groups)."""
        key = (c, tp[c], max(tp), mbs, recompute)
        if key not in self._layer_costs:  # the search asks millions of times: one lookup
            cl, costs = self.classes[c], self.job_costs(tp)
            layer = costs.layer_cost(cl.device_type, cl.hosts[0], tp[c], mbs, recompute)
            beyond = expert_exchange_beyond_node_s(costs, self.expert_group(c, tp), cl.hosts[0], cl.device_type,
                                                   tp[c], mbs, recompute)
            self._layer_costs[key] = LayerCost(layer.forward_s + beyond[0], layer.backward_s + beyond[1])
        return self._layer_costs[key]

    def expert_group(self, c: int, tp: Degrees) -> tuple[str, ...]:
        """The hosts of an expert-parallel group of a rank on class c, packed into the class's
        nodes first (then the other classes', where the class has too few)."""
        cl, costs = self.classes[c], self.job_costs(tp)
        if costs.expert_parallel <= 1:
            return (cl.hosts[0],)
        hosts = cl.hosts + tuple(h for other in self.classes if other is not cl for h in other.hosts)
        return packed_expert_group(hosts, cl.devices_per_node, costs.expert_parallel,
                                   costs.expert_tensor_parallel_at(tp[c]))

    def layer_time(self, c: int, tp: Degrees, mbs: int, recompute: str | None = None) -> float:
        return self.layer_cost(c, tp, mbs, recompute).total_s

    def stage_layer_times(self, pattern: tuple[int, ...], modes: tuple[str, ...], tp: Degrees,
                          mbs: int) -> list[float]:
        """One layer's time on each stage of a replica whose stages are on classes `pattern`."""
        return self._memo(("times", pattern, modes, tp, mbs), lambda: [
            self.layer_time(c, tp, mbs, mode) for c, mode in zip(pattern, modes)])

    def extra_time(self, c: int, tp: Degrees, mbs: int, first: bool, last: bool) -> float:
        """What a stage on class c runs beyond its layers (CostModel.stage_extra_times; the
        last stage's multi-token-prediction layers exchange tokens as layer_cost's do)."""
        def compute() -> float:
            costs, cl = self.job_costs(tp), self.classes[c]
            extra = sum(costs.stage_extra_times(cl.device_type, tp[c], mbs, first, last))
            if last and costs.mtp_exchange_layers():
                beyond = expert_exchange_beyond_node_s(costs, self.expert_group(c, tp), cl.hosts[0], cl.device_type,
                                                       tp[c], mbs, None)
                extra += costs.mtp_exchange_layers() * sum(beyond)
            return extra
        return self._memo(("extra", c, tp[c], max(tp), mbs, first, last), compute)

    def end_times(self, first: Iterable[int], last: Iterable[int], stages: int, tp: Degrees,
                  mbs: int) -> tuple[float, float]:
        """(first stage's, last stage's) work beyond layers, the slowest of the classes at
        each; a one-stage pipeline's is all the last's."""
        at_last = max(self.extra_time(c, tp, mbs, stages == 1, True) for c in last)
        at_first = max(self.extra_time(c, tp, mbs, True, False) for c in first) if stages > 1 else 0.0
        return at_first, at_last

    def micro_batch_cv(self, pattern: tuple[int, ...], tp: Degrees, mbs: int) -> float:
        """How much a micro-batch of a replica on classes `pattern` varies: its most varying class's."""
        return self._memo(("cv", pattern, tp, mbs), lambda: max(
            self.job_costs(tp).micro_batch_cv(self.classes[c].device_type, tp[c], mbs) for c in pattern))

    def optimizer_step(self, c: int, tp: Degrees, params: float) -> float:
        """The optimizer step of a rank of class c holding `params` (CostModel.optimizer_step)."""
        key = ("step", c, max(tp), params)
        if key not in self._cache:
            self._cache[key] = self.job_costs(tp).optimizer_step(self.classes[c].device_type, params)
        return self._cache[key]

    def stage_params(self, layers: list[int], s: int) -> float:
        """Parameters of stage s of a pipeline split so (memory.stage_params)."""
        first, last, stages = s == 0, s == len(layers) - 1, len(layers)
        key = ("params", layers[s], first, last, stages > 1)
        if key not in self._cache:
            self._cache[key] = stage_params(self.costs, layers[s], first, last, stages)
        return self._cache[key]

    # ----- pipeline sends ---------------------------------------------------------------

    def send_time(self, a: int, b: int, tp: Degrees, mbs: int, same_node: bool, crossings: int) -> float:
        """One activation across a pipeline boundary from class a to class b (re-sharded
        when their degrees differ)."""
        key = ("send", a, b, tp[a], tp[b], max(tp), mbs, same_node, crossings)
        if key not in self._cache:
            ca, cb = self.classes[a], self.classes[b]
            costs = self.job_costs(tp)
            if a == b:
                other = ca.hosts[0] if same_node or len(ca.hosts) == 1 else ca.hosts[1]
                self._cache[key] = costs.stage_transfer(ca.hosts[0], other, tp[a], mbs)
            else:
                self._cache[key] = costs.stage_transfer(ca.hosts[0], cb.hosts[0], tp[a], mbs, crossings, tp[b])
        return self._cache[key]

    def pattern_sends(self, pattern: tuple[int, ...], tp: Degrees, mbs: int,
                      same_node: tuple[tuple[int, bool], ...], crossings: int) -> list[float]:
        """Each stage's transfers per micro-batch (its activation out, its gradient back).
        same_node: (class, whether a replica's neighbouring stages of it share a node);
        crossings: replicas * max(tp), scaled to each boundary's wider degree (as predict()
        counts the transfers sharing a boundary's links)."""
        def compute() -> list[float]:
            same = dict(same_node)
            replicas = max(1, crossings // max(tp))
            boundary: dict[tuple[int, int], tuple[float, float]] = {}  # (forward, backward) by classes
            out = [0.0] * len(pattern)
            for s in range(len(pattern) - 1):
                a, b = pattern[s], pattern[s + 1]
                if (a, b) not in boundary:
                    at_boundary = replicas * max(tp[a], tp[b])
                    boundary[a, b] = (self.send_time(a, b, tp, mbs, same.get(a, False), at_boundary),
                                      self.send_time(b, a, tp, mbs, same.get(a, False), at_boundary))
                forward, backward = boundary[a, b]
                out[s] += forward
                out[s + 1] += backward
            return out
        return self._memo(("sends", pattern, tp, mbs, same_node, crossings), compute)

    def classes_at_stages(self, patterns: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        """Each stage's classes over replicas of these patterns."""
        return self._memo(("at stages", patterns),
                         lambda: tuple(tuple(sorted(set(classes))) for classes in zip(*patterns)))

    def tied_embedding_sync(self, first: Iterable[int], last: Iterable[int], tp: Degrees, replicas: int) -> float:
        """The tied table's gradient sum between a pipeline's first stage on classes `first`
        and its last on `last` (hetero/predict/tied_embedding.py), the slowest pair of classes:
        ranks laid on each class's nodes in launch order, the two stages on different nodes."""
        def hosts(c: int, rank_count: int, skip: int) -> list[str]:
            cl = self.classes[c]
            return [cl.hosts[(skip + i // cl.devices_per_node) % len(cl.hosts)] for i in range(rank_count)]

        def compute(a: int, b: int) -> float:
            tied = (tp[a] * replicas, tp[b] * replicas)
            first_ranks = hosts(a, tied[0], 0)
            last_ranks = hosts(b, tied[1], 1 if a == b else 0)
            per_replica = [[first_ranks[d * tp[a] + t] for t in range(tp[a])] for d in range(replicas)]
            per_replica_last = [[last_ranks[d * tp[b] + t] for t in range(tp[b])] for d in range(replicas)]
            return tied_embedding_sync_s(self.job_costs(tp), per_replica, per_replica_last)
        return max(self._memo(("tied", a, b, tp[a], tp[b], max(tp), replicas), lambda: compute(a, b))
                   for a in first for b in last)

    # ----- data-parallel groups ---------------------------------------------------------

    def spans_groups(self, parts: tuple[GroupPart, ...]) -> bool:
        """Whether a data-parallel group lying so crosses fabric groups."""
        return self._memo(("spans", parts), lambda: len({self.classes[c].group for c, *_ in parts}) > 1)

    def group_terms(self, parts: tuple[GroupPart, ...], crossings: int) -> tuple[float, float]:
        """The all-reduce terms of a data-parallel group lying so (CostModel.allreduce_terms)."""
        key = ("terms", parts, crossings)
        if key not in self._cache:
            hosts = representative_hosts(parts, self.classes)
            self._cache[key] = self.costs.allreduce_terms(hosts, crossings if self.spans_groups(parts) else 1)
        return self._cache[key]

    def stage_group_terms(self, tp: Degrees, dp_parts: list[tuple[GroupPart, ...]]) -> list[tuple[float, float]]:
        """Each stage's all-reduce terms; groups crossing fabrics share the links."""
        alike = collections.Counter(dp_parts)  # stages whose groups lie alike
        # predict() counts every tensor-parallel rank's group that crosses fabrics
        spanning = sum(n * tp[parts[0][0]] for parts, n in alike.items() if self.spans_groups(parts))
        crossings = max(1, spanning)
        terms_of = {parts: self.group_terms(parts, crossings) for parts in alike}
        return [terms_of[parts] for parts in dp_parts]

    def stage_expert_group_terms(self, tp: Degrees, dp_parts: list[tuple[GroupPart, ...]]) -> list[tuple[float, float]]:
        """Each stage's all-reduce terms for its experts' gradients, over its data-parallel
        group's hosts: a stage has EP x ETP expert data-parallel groups, each with a member in
        every expert-parallel group, so all of them cross fabrics where the stage's data-
        parallel group does (predict() counts them group by group)."""
        alike = collections.Counter(dp_parts)
        costs = self.costs_for(1)
        spanning = sum(n * costs.expert_parallel * costs.expert_tensor_parallel_at(tp[parts[0][0]])
                       for parts, n in alike.items() if self.spans_groups(parts))

        def terms(parts: tuple[GroupPart, ...]) -> tuple[float, float]:
            hosts = representative_hosts(parts, self.classes)
            group = expert_data_group_hosts(hosts, costs.expert_data_parallel_at(tp[parts[0][0]], len(hosts)))
            return self.costs.allreduce_terms(group, max(1, spanning) if self.spans_groups(parts) else 1)
        return [self._memo(("expert terms", parts, tp[parts[0][0]], spanning), lambda: terms(parts))
                for parts in dp_parts]
