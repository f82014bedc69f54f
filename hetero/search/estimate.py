"""The planner's fast estimate: a shape's layer split, micro-batches and iteration time in
closed form, a reduction of the predictor's model (hetero/predict/predictor.py).

Where the predictor simulates every replica's 1F1B schedule, the estimate takes its closed
form (hetero/predict/schedule.py: fill + m * step); everything else comes from the same
CostModel and memory-model functions, through the cached blocks of cost_blocks.py and
memory_fit.py. A shape is estimated in three steps: fit its pipeline in memory (caps and
recomputation per stage, and a floor of its time), split the layers and micro-batches, and
add the gradient reduction and optimizer step. The floors let the search drop a shape that
cannot matter before it is split.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Hashable, Iterable, NamedTuple, Sequence, TypeVar

from hetero.plan import Plan
from hetero.predict.expert_exchange import expert_data_group_hosts, expert_exchange_beyond_node_s, unpaired_exchange_s
from hetero.predict.memory import stage_expert_params
from hetero.predict.moe_overlap import unpaired_share
from hetero.predict.predictor import expert_group_hosts, stage_recompute
from hetero.predict.schedule import PipelineShape, pipeline_shape
from hetero.predict.stragglers import replica_spread, slowest_of
from hetero.predict.tied_embedding import tied_embedding_sync_s
from hetero.search.cost_blocks import CostBlocks, Memoised
from hetero.search.expert_parallel import expert_tensor_parallel_for
from hetero.search.memory_fit import MemoryFit, StageClasses
from hetero.search.options import Degrees, PlannerOptions
from hetero.spec.cluster import Cluster
from hetero.spec.model import ModelSpec
from hetero.spec.profiles import Profiles

Pattern = tuple[int, ...]
"""The class of each stage of a replica."""
K = TypeVar("K", bound=Hashable)


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


def allocate_micro_batches(total: int, replicas: dict[K, int], shape: dict[K, PipelineShape]
                           ) -> dict[K, list[int]] | None:
    """Micro-batches per replica so that all finish together.

    replicas[k]: how many replicas have shape k; a replica of shape k running m micro-batches
    takes shape[k].time(m) (the 1F1B closed form). Returns {k: [m per replica]}. Replicas of
    one shape are interchangeable: start from the continuous solution (all finish at T with
    sum_k n_k (T - fill_k) / step_k = total), round down, then hand out what is left one
    shape-round at a time to whoever finishes earliest, and take back any excess from those
    finishing last.
    """
    if total < sum(replicas.values()):
        return None
    rate = sum(n / shape[k].step_s for k, n in replicas.items())
    finish = (total + sum(n * shape[k].fill_s / shape[k].step_s for k, n in replicas.items())) / rate
    per = {k: max(1, int((finish - shape[k].fill_s) / shape[k].step_s)) for k in replicas}
    given = sum(replicas[k] * per[k] for k in replicas)
    while given < total:
        k = min(replicas, key=lambda k: (shape[k].time(per[k] + 1), k))
        per[k] += 1
        given += replicas[k]
    while True:  # take back from whoever finishes last: whole rounds, then part of one
        k = max((k for k in replicas if per[k] > 1), key=lambda k: (shape[k].time(per[k]), k), default=None)
        if k is None or given - total < replicas[k]:
            break
        per[k] -= 1
        given -= replicas[k]
    lowered = {k: 0 for k in replicas}
    if given > total:
        lowered[k] = given - total
    return {k: [per[k]] * (replicas[k] - lowered[k]) + [per[k] - 1] * lowered[k] for k in replicas}


class Shape(NamedTuple):
    """A layout to estimate, before its layers and micro-batches are split. Cache keys hold
    its fields in a plain tuple: the garbage collector untracks plain tuples of untracked
    items, never a NamedTuple, and the search keeps hundreds of thousands of keys."""

    degrees: Degrees
    micro_batch_size: int
    patterns: tuple[tuple[Pattern, int], ...]
    """(class of each stage, number of replicas like that), in replica order."""
    same_node: tuple[tuple[int, bool], ...]
    """(class, whether a replica's neighbouring stages of that class share a node), sorted.
    Placement orders that move data alike share their pipeline's estimate."""


@dataclass(frozen=True)
class PipelineFit:
    """What a shape's estimate takes from its pipeline alone (FastEstimate.fit_pipeline)."""

    at_stage: StageClasses
    """Each stage's classes."""
    counts: dict[Pattern, int]
    """Replicas of each pattern."""
    sends: dict[Pattern, list[float]]
    times: dict[Pattern, list[float]]
    """One layer's time on each stage, per pattern."""
    caps: list[int]
    modes: tuple[str, ...]
    floor: float
    """No split or micro-batch allocation makes the pipeline faster."""


class FastEstimate(Memoised):
    """The fast estimate for one cluster, model, global batch and set of options, with the
    cached cost blocks (self.blocks) and memory answers (self.memory) it is made of."""

    def __init__(self, cluster: Cluster, model: ModelSpec, global_batch_size: int, options: PlannerOptions,
                 profiles: Profiles | None = None):
        super().__init__()
        self.model, self.global_batch_size = model, global_batch_size
        self.blocks = CostBlocks(cluster, model, options, profiles)
        self.memory = MemoryFit(self.blocks, global_batch_size)

    # ----- a shape, step by step --------------------------------------------------------

    def fit_pipeline(self, shape: Shape) -> PipelineFit | None:
        """The stages' caps and recomputation, and a floor of the pipeline's time; None if
        the layers cannot fit."""
        return self._memo(("pipeline",) + shape, lambda: self._fit_pipeline(shape))

    def _fit_pipeline(self, shape: Shape) -> PipelineFit | None:
        tp, mbs = shape.degrees, shape.micro_batch_size
        d = sum(n for _, n in shape.patterns)
        distinct = sorted({p for p, _ in shape.patterns})
        at_stage = self.blocks.classes_at_stages(tuple(distinct))
        fitting = self.memory.recompute_to_fit(tp, mbs, d, at_stage)
        if fitting is None:
            return None
        caps, modes = fitting
        crossings = d * max(tp)  # every replica's transfer at a boundary runs at once
        sends = {p: self.blocks.pattern_sends(p, tp, mbs, shape.same_node, crossings) for p in distinct}
        times = {p: self.blocks.stage_layer_times(p, modes, tp, mbs) for p in distinct}
        counts = _replica_counts(shape.patterns)
        floor = self.pipeline_floor(counts, sends, times, caps, tp, mbs, self.global_batch_size // mbs)
        return PipelineFit(at_stage, counts, sends, times, caps, modes, floor)

    def loose_floor(self, shape: Shape) -> float:
        """PipelineFit.floor before knowing the memory: every stage under its fastest
        recomputation, with room for all the layers."""
        def compute() -> float:
            tp, mbs = shape.degrees, shape.micro_batch_size
            counts = _replica_counts(shape.patterns)
            crossings = sum(counts.values()) * max(tp)
            sends = {p: self.blocks.pattern_sends(p, tp, mbs, shape.same_node, crossings) for p in counts}
            fastest = {c: min(self.blocks.layer_time(c, tp, mbs, mode) for mode in self.memory.recompute_modes)
                       for c in set().union(*counts)}
            times = {p: [fastest[c] for c in p] for p in counts}
            caps = [self.model.num_layers] * len(shape.patterns[0][0])
            return self.pipeline_floor(counts, sends, times, caps, tp, mbs, self.global_batch_size // mbs)
        return self._memo(("loose floor",) + shape, compute)

    def split(self, shape: Shape, pipe: PipelineFit
              ) -> tuple[list[int], dict[Pattern, list[int]], float] | None:
        """(layers per stage, micro-batches per replica of each pattern, seconds of the
        busiest replica), None if they cannot be split. pipe: fit_pipeline(shape)."""
        return self._memo(("split",) + shape, lambda: self._split(shape.degrees, shape.micro_batch_size, pipe))

    def _split(self, tp: Degrees, mbs: int, pipe: PipelineFit
               ) -> tuple[list[int], dict[Pattern, list[int]], float] | None:
        extra = list(map(max, zip(*pipe.sends.values())))
        at_first, at_last = self.blocks.end_times(pipe.at_stage[0], pipe.at_stage[-1], len(extra), tp, mbs)
        extra[0] += at_first
        extra[-1] += at_last
        per_layer = list(map(max, zip(*pipe.times.values())))  # each stage's slowest class
        layers = split_layers(self.model.num_layers, per_layer, extra, pipe.caps)
        if layers is None:
            return None
        shape = {p: self.replica_shape(p, layers, pipe.modes, tp, mbs, sends) for p, sends in pipe.sends.items()}
        micro = allocate_micro_batches(self.global_batch_size // mbs, pipe.counts, shape)
        if micro is None:
            return None
        return layers, micro, self.slowest_replica(((p, shape[p], m) for p in micro for m in micro[p]), tp, mbs)

    def pipeline_floor(self, counts: dict[Pattern, int], sends: dict[Pattern, list[float]],
                       times: dict[Pattern, list[float]], caps: list[int], tp: Degrees, mbs: int,
                       total_mb: int) -> float:
        """A lower bound on the pipeline part of a shape's estimate, whatever the layer split
        (within the stages' caps) and the micro-batch allocation. A replica of pattern p
        running m micro-batches takes fill + m * step = sum(work) + (m - 1) * max(work)
        (replica_shape): at least least_p + (m - 1) * step_p, least_p with the layers on
        the pattern's fastest stages and step_p with the layers spread perfectly over its
        stages. Every replica runs at least one micro-batch, and together they run
        total_mb: the slowest takes at least the returned time."""
        num_layers = self.model.num_layers
        rate = offset = slowest_single = 0.0
        for p, n in counts.items():
            least = (_least_layer_work(times[p], caps, num_layers) + sum(sends[p])
                     + sum(self.blocks.end_times([p[0]], [p[-1]], len(p), tp, mbs)))
            step = num_layers / sum(1 / t for t in times[p])
            rate += n / step
            offset += n * least / step
            slowest_single = max(slowest_single, least)
        return max(slowest_single, (total_mb - sum(counts.values()) + offset) / rate)

    # ----- the pieces of an estimate, shared by a shape's and a given plan's -------------

    def replica_shape(self, pattern: Pattern, layers: list[int], modes: Sequence[str], tp: Degrees,
                      mbs: int, sends: list[float]) -> PipelineShape:
        """The 1F1B closed form of a replica whose stages are on classes `pattern`: each
        stage's work per micro-batch is its layers, its sends and its ends' extra work."""
        times = self.blocks.stage_layer_times(pattern, tuple(modes), tp, mbs)
        work = [n * t + x for n, t, x in zip(layers, times, sends)]
        at_first, at_last = self.blocks.end_times([pattern[0]], [pattern[-1]], len(pattern), tp, mbs)
        work[0] += at_first
        work[-1] += at_last
        return pipeline_shape(work)

    def slowest_replica(self, replicas: Iterable[tuple[Pattern, PipelineShape, int]], tp: Degrees,
                        mbs: int) -> float:
        """Expected end of the slowest of replicas given as (pattern, shape, micro-batches):
        the predictor's stage ends (hetero/predict/stragglers.py), one step's variation for a
        micro-batch's."""
        cv = self.blocks.micro_batch_cv
        return slowest_of((shape.time(m), replica_spread(cv(pattern, tp, mbs) * shape.step_s, m))
                          for pattern, shape, m in replicas)

    def reduce_and_step(self, tp: Degrees, mbs: int, d: int, layers: list[int], modes: Sequence[str],
                        at_stage: Sequence[Sequence[int]], terms: list[tuple[float, float]],
                        tie_s: float | None = None,
                        expert_terms: list[tuple[float, float]] | None = None) -> float:
        """The slowest stage's exposed gradient synchronisation plus the slowest optimizer
        step: the same CostModel functions the predictor calls. A stage's classes share
        its degree. tie_s: the tied embedding's gradient sum on the end stages, when known
        from concrete hosts (else CostBlocks.tied_embedding_sync's). expert_terms: the terms
        of the experts' gradient reduction (default: terms)."""
        blocks, last = self.blocks, len(layers) - 1
        if tie_s is None:
            tie_s = blocks.tied_embedding_sync(at_stage[0], at_stage[-1], tp, d) if last else 0.0
        costs = blocks.job_costs(tp)
        # Stages alike (same group, classes, recomputation, ends) differ only in their
        # layer count, and the most layers take longest: the optimizer step judges one stage
        # of each kind (the reduction below also weighs when each stage ends).
        heaviest: dict[tuple, int] = {}
        for s in range(len(layers)):
            kind = (terms[s], tuple(at_stage[s]), modes[s], s == 0, s == last)
            if kind not in heaviest or layers[s] > layers[heaviest[kind]]:
                heaviest[kind] = s
        per_layer: dict[tuple, float] = {}  # a layer's fastest backward by (classes, recomputation)
        kinds = [(tuple(at_stage[s]), modes[s]) for s in range(len(layers))]
        for kind in kinds:
            if kind not in per_layer:
                per_layer[kind] = min(blocks.layer_cost(c, tp, mbs, kind[1]).backward_s for c in kind[0])
        backward = [n * per_layer[kind] for n, kind in zip(layers, kinds)]
        syncs: dict[tuple, float] = {}
        ep = costs.expert_parallel
        reduce = 0.0
        lead = 0.0  # how much earlier than the first stage stage s ends: the backwards of the stages before it
        for s in range(len(layers)):
            kind = (terms[s], tuple(at_stage[s]), modes[s], s == 0, s == last, layers[s])
            if kind not in syncs and ep > 1:  # the predictor's two buffers, the experts' over the same hosts
                dense, experts = self._rank_params(layers, s, tp[at_stage[s][0]], costs)
                syncs[kind] = (costs.gradient_sync(terms[s], dense, d, backward[s])
                               + costs.gradient_sync((expert_terms or terms)[s], experts,
                                                     costs.expert_data_parallel_at(tp[at_stage[s][0]], d))
                               + (tie_s if s in (0, last) else 0.0))
            if kind not in syncs:
                syncs[kind] = costs.gradient_sync(terms[s], blocks.stage_params(layers, s) / tp[at_stage[s][0]], d,
                                                  backward[s]) + (tie_s if s in (0, last) else 0.0)
            reduce = max(reduce, syncs[kind] - lead)
            lead += backward[s]
        share = d if blocks.options.setup.distributed_optimizer else 1
        if ep > 1:
            def rank_share(s: int, c: int) -> float:
                dense, experts = self._rank_params(layers, s, tp[c], costs)
                return dense / share + experts / (costs.expert_data_parallel_at(tp[c], d) if share > 1 else 1)
            return reduce + max(costs.optimizer_step(blocks.classes[c].device_type, rank_share(s, c))
                                for s in heaviest.values() for c in at_stage[s])
        optimizer = max(costs.optimizer_step(blocks.classes[c].device_type,
                                             blocks.stage_params(layers, s) / tp[c] / share)
                        for s in heaviest.values() for c in at_stage[s])
        return reduce + optimizer

    def _expert_groups_as_placed(self, plan: Plan, d: int, s: int, c: int, tp: Degrees, recompute: str) -> float:
        """What one layer of replica d's stage s (on class c) takes beyond blocks.layer_cost's
        estimate, forward and backward, with its expert-parallel group where the plan puts it
        (the same function prices both: predict/expert_exchange.py)."""
        blocks = self.blocks
        costs, cl, host = blocks.job_costs(tp), blocks.classes[c], plan.stage_device(d, s).host
        placed = expert_exchange_beyond_node_s(costs, expert_group_hosts(plan, d, s), host, cl.device_type,
                                               tp[c], plan.micro_batch_size, recompute)
        packed = expert_exchange_beyond_node_s(costs, blocks.expert_group(c, tp), cl.hosts[0], cl.device_type,
                                               tp[c], plan.micro_batch_size, recompute)
        return sum(placed) - sum(packed)

    def _rank_params(self, layers: list[int], s: int, tensor_parallel: int, costs) -> tuple[float, float]:
        """(dense, expert) parameters of one rank of stage s (memory.rank_params)."""
        experts = stage_expert_params(costs, layers[s], s == len(layers) - 1)
        grid = costs.expert_parallel * costs.expert_tensor_parallel_at(tensor_parallel)
        return (self.blocks.stage_params(layers, s) - experts) / tensor_parallel, experts / grid

    def of_plan(self, plan: Plan) -> tuple[bool, float]:
        """The fast estimate of a given plan (its layout, layers, micro-batches and
        recomputation as they are): (fits in memory, seconds per iteration). What the
        search ranks candidates by, applied to any plan: tests compare it with predict()."""
        blocks, cluster = self.blocks, self.blocks.cluster
        # an estimate priced for the plan's expert grid (as the search would price it)
        grid = (plan.expert_parallel, expert_tensor_parallel_for(plan.expert_parallel, plan.expert_tensor_parallel))
        if self.model.is_moe and grid != (blocks.expert_parallel, blocks.costs_for(1).expert_tensor_parallel):
            options = dataclasses.replace(blocks.options, expert_parallel=(plan.expert_parallel,),
                                          expert_tensor_parallel=plan.expert_tensor_parallel)
            return FastEstimate(cluster, self.model, self.global_batch_size, options, blocks.profiles).of_plan(plan)
        pp, dp, mbs = plan.pipeline_parallel, plan.data_parallel, plan.micro_batch_size
        hosts = [[plan.stage_device(d, s).host for s in range(pp)] for d in range(dp)]
        patterns = [tuple(blocks.class_of[h] for h in row) for row in hosts]
        degrees = {c: plan.stage_tensor_parallel[s] for pattern in patterns for s, c in enumerate(pattern)}
        tp = tuple(degrees.get(c, plan.tensor_parallel) for c in range(len(blocks.classes)))
        costs = blocks.job_costs(tp)
        at_stage = [sorted({p[s] for p in patterns}) for s in range(pp)]
        layers = [stage.num_layers for stage in plan.stages]
        modes = [stage_recompute(plan, s, costs) for s in range(pp)]
        fits = all(layers[s] <= self.memory.layer_cap(pattern[s], tp, mbs, dp, s, pp, modes[s],
                                                      plan.replicas[d].num_micro_batches)
                   for d, pattern in enumerate(patterns) for s in range(pp))
        replicas = []
        for d, pattern in enumerate(patterns):
            sends = [0.0] * pp
            for s in range(pp - 1):
                a, b, same = pattern[s], pattern[s + 1], hosts[d][s] == hosts[d][s + 1]
                at_boundary = dp * max(tp[a], tp[b])
                sends[s] += blocks.send_time(a, b, tp, mbs, same, at_boundary)
                sends[s + 1] += blocks.send_time(b, a, tp, mbs, same, at_boundary)
            if plan.expert_parallel > 1:  # the plan's own expert groups for the packed one layer_cost priced
                for s in range(pp):
                    exchanging = layers[s] + (costs.mtp_exchange_layers() if s == pp - 1 else 0.0)
                    sends[s] += exchanging * self._expert_groups_as_placed(plan, d, s, pattern[s], tp, modes[s])
                    # the pipeline's unpaired chunks with overlapped all-to-alls (the search
                    # leaves them out: a replica's micro-batch count is not known there)
                    alone = unpaired_share(plan.replicas[d].num_micro_batches, pp, s, costs.setup.virtual_stages)
                    if alone:
                        unpaired = unpaired_exchange_s(costs, expert_group_hosts(plan, d, s), blocks.classes[pattern[s]].device_type,
                                                       tp[pattern[s]], mbs, modes[s])
                        sends[s] += exchanging * alone * sum(unpaired)
            replicas.append((pattern, self.replica_shape(pattern, layers, modes, tp, mbs, sends),
                             plan.replicas[d].num_micro_batches))
        pipeline = self.slowest_replica(replicas, tp, mbs)
        groups = [[plan.device_of_logical(r).host for r in plan.data_group(0, s)] for s in range(pp)]
        crossing = [s for s, g in enumerate(groups) if len({cluster.node(h).group for h in g}) > 1]
        spanning = sum(plan.stage_tensor_parallel[s] for s in crossing)
        terms = [costs.allreduce_terms(tuple(g), max(1, spanning)) for g in groups]
        expert_terms = None
        if plan.expert_parallel > 1:
            expert_spanning = sum(costs.expert_parallel * costs.expert_tensor_parallel_at(plan.stage_tensor_parallel[s])
                                  for s in crossing)
            expert_terms = [costs.allreduce_terms(
                expert_data_group_hosts(g, costs.expert_data_parallel_at(plan.stage_tensor_parallel[s], dp)),
                max(1, expert_spanning)) for s, g in enumerate(groups)]
        tie_s = tied_embedding_sync_s(costs, [hosts_of_stage(plan, d, 0) for d in range(dp)],
                                      [hosts_of_stage(plan, d, pp - 1) for d in range(dp)]) if pp > 1 else 0.0
        return fits, pipeline + self.reduce_and_step(tp, mbs, dp, layers, modes, at_stage, terms, tie_s, expert_terms)


def hosts_of_stage(plan: Plan, replica: int, stage: int) -> list[str]:
    """The host of each tensor-parallel rank of a replica's stage."""
    return [plan.device_of_logical(r).host for r in plan.tensor_group(replica, stage)]


def _replica_counts(patterns: Iterable[tuple[Pattern, int]]) -> dict[Pattern, int]:
    """Replicas of each pattern (a pattern may come back further on in replica order)."""
    counts: dict[Pattern, int] = {}
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
