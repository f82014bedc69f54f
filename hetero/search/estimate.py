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

import heapq
from dataclasses import dataclass
from typing import Hashable, Iterable, NamedTuple, Sequence, TypeVar

from hetero.predict.memory import stage_expert_params
from hetero.predict.schedule import PipelineShape, interleaved_shape, pipeline_shape
from hetero.predict.stragglers import expected_slowest, replica_spread, slowest_of
from hetero.search.cost_blocks import CostBlocks, Memoised
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


def allocate_micro_batches(total: int, replicas: dict[K, int], shape: dict[K, PipelineShape],
                           granularity: dict[K, int] | None = None) -> dict[K, list[int]] | None:
    """Micro-batches per replica so that all finish together.

    replicas[k]: how many replicas have shape k; a replica of shape k running m micro-batches
    takes shape[k].time(m) (the 1F1B closed form); granularity[k] (default 1): its counts
    must be multiples of this (an interleaved pipeline runs whole groups of its depth).
    Returns {k: [m per replica]}, None if no such split exists. Replicas of one shape are
    interchangeable: start from the continuous solution (all finish at T with
    sum_k n_k (T - fill_k) / step_k = total), round down, then hand out what is left one
    shape-round at a time to whoever finishes earliest, and take back any excess from those
    finishing last.
    """
    unit = granularity or {}
    g = {k: unit.get(k, 1) for k in replicas}
    if total < sum(n * g[k] for k, n in replicas.items()):
        return None
    rate = sum(n / shape[k].step_s for k, n in replicas.items())
    finish = (total + sum(n * shape[k].fill_s / shape[k].step_s for k, n in replicas.items())) / rate
    per = {k: max(1, int((finish - shape[k].fill_s) / shape[k].step_s) // g[k]) for k in replicas}
    given = sum(replicas[k] * per[k] * g[k] for k in replicas)
    while given < total:
        k = min(replicas, key=lambda k: (shape[k].time(g[k] * (per[k] + 1)), k))
        per[k] += 1
        given += replicas[k] * g[k]
    while True:  # take back from whoever finishes last: whole rounds, then part of one
        k = max((k for k in replicas if per[k] > 1), key=lambda k: (shape[k].time(g[k] * per[k]), k), default=None)
        if k is None or given - total < replicas[k] * g[k]:
            break
        per[k] -= 1
        given -= replicas[k] * g[k]
    lowered = {k: 0 for k in replicas}
    excess = given - total
    # part of a round: one unit fewer on some replicas, those finishing last first
    for k in sorted((k for k in replicas if per[k] > 1), key=lambda k: (shape[k].time(g[k] * per[k]), k),
                    reverse=True):
        if excess == 0:
            break
        lowered[k] = min(replicas[k], excess // g[k])
        excess -= lowered[k] * g[k]
    if excess:
        return None
    return {k: [per[k] * g[k]] * (replicas[k] - lowered[k]) + [(per[k] - 1) * g[k]] * lowered[k] for k in replicas}


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
    interleaved_floor: float
    """...nor any of the options' interleavings (FastEstimate.interleaved)."""


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
        floors = self.pipeline_floor(counts, sends, times, caps, tp, mbs, self.global_batch_size // mbs,
                                     self._most_chunks(shape))
        return PipelineFit(at_stage, counts, sends, times, caps, modes, *floors)

    def _most_chunks(self, shape: Shape) -> int:
        """The most virtual stages a shape may interleave with (1: none)."""
        classes = {c for pattern, _ in shape.patterns for c in pattern}
        if len(shape.patterns[0][0]) < 2 or len({shape.degrees[c] for c in classes}) > 1:
            return 1  # one stage, or a degree per stage (no interleaving with it)
        return max(self.blocks.options.virtual_stages)

    def loose_floor(self, shape: Shape) -> tuple[float, float]:
        """PipelineFit's (floor, interleaved_floor) before knowing the memory: every stage
        under its fastest recomputation, with room for all the layers."""
        def compute() -> tuple[float, float]:
            tp, mbs = shape.degrees, shape.micro_batch_size
            counts = _replica_counts(shape.patterns)
            crossings = sum(counts.values()) * max(tp)
            sends = {p: self.blocks.pattern_sends(p, tp, mbs, shape.same_node, crossings) for p in counts}
            fastest = {c: self._memo(("fastest", c, tp[c], max(tp), mbs), lambda: min(
                self.blocks.layer_time(c, tp, mbs, mode) for mode in self.memory.recompute_modes))
                for c in set().union(*counts)}
            times = {p: [fastest[c] for c in p] for p in counts}
            caps = [self.model.num_layers] * len(shape.patterns[0][0])
            return self.pipeline_floor(counts, sends, times, caps, tp, mbs, self.global_batch_size // mbs,
                                       self._most_chunks(shape))
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
                       total_mb: int, chunks: int = 1) -> tuple[float, float]:
        """Lower bounds on the pipeline part of a shape's estimate, whatever the layer split
        (within the stages' caps) and the micro-batch allocation: plain, and with up to
        `chunks` virtual stages. A replica of pattern p running m micro-batches takes
        fill + m * step = sum(work) + (m - 1) * max(work) (replica_shape), stage s working
        n_s * t_s + x_s (its layers, then its sends and ends): at least least_p + (m - 1) *
        step_p, least_p with the layers on the pattern's fastest stages, and step_p the least
        slowest stage over every split: a split whose slowest stage takes M has n_s <= (M -
        x_s) / t_s, and the n_s sum to the layers, so M >= (layers + sum x_s / t_s) / sum 1 /
        t_s; and every stage holds a layer. Interleaved in v chunks (interleaved_shape: the
        fill over v, more sends) it takes at least least_p / v + (m - 1 / v) * step_p. Every
        replica runs at least one micro-batch, and together they run total_mb: the slowest
        takes at least the returned times."""
        num_layers = self.model.num_layers
        rate = offset = slowest_single = slowest_interleaved = 0.0
        v = chunks
        for p, n in counts.items():
            at_first, at_last = self.blocks.end_times([p[0]], [p[-1]], len(p), tp, mbs)
            extra = list(sends[p])
            extra[0] += at_first
            extra[-1] += at_last
            least = _least_layer_work(times[p], caps, num_layers) + sum(sends[p]) + at_first + at_last
            spread = (num_layers + sum(x / t for x, t in zip(extra, times[p]))) / sum(1 / t for t in times[p])
            step = max(spread, max(t + x for t, x in zip(times[p], extra)))
            rate += n / step
            offset += n * least / step
            slowest_single = max(slowest_single, least)
            slowest_interleaved = max(slowest_interleaved, least / v + (1 - 1 / v) * step)
        replicas = sum(counts.values())
        return (max(slowest_single, (total_mb - replicas + offset) / rate),
                max(slowest_interleaved, (total_mb - (replicas - offset) / v) / rate))

    def interleaved(self, shape: Shape, pipe: PipelineFit, layers: list[int]) -> tuple[int, float] | None:
        """(virtual stages, seconds of the busiest replica) of the shape's best interleaving by
        the estimate (interleaved_shape; micro-batches in whole groups of the pipeline's depth,
        as megatron-core runs them), with layers split as for 1F1B; None where none of the
        options' interleavings runs or fits."""
        return self._memo(("interleaved",) + shape, lambda: self._interleaved(shape, pipe, layers))

    def _interleaved(self, shape: Shape, pipe: PipelineFit, layers: list[int]) -> tuple[int, float] | None:
        tp, mbs, stages = shape.degrees, shape.micro_batch_size, len(layers)
        d = sum(pipe.counts.values())
        same = dict(shape.same_node)
        best = None
        for v in self.blocks.options.virtual_stages:
            if v == 1 or v > self._most_chunks(shape) or min(layers) < v:
                continue
            if any(layers[s] > self.memory.stage_caps(c, tp, mbs, d, stages, pipe.modes[s], v)[s]
                   for s, classes in enumerate(pipe.at_stage) for c in classes):
                continue  # the chunks in flight do not fit
            shapes = {}
            for p, sends in pipe.sends.items():
                sends = [v * x for x in sends]  # every chunk crosses every boundary...
                a, b = p[-1], p[0]  # ...and all but the last wrap around from the last stage to the first
                crossings = d * max(tp[a], tp[b])
                sends[-1] += (v - 1) * self.blocks.send_time(a, b, tp, mbs, a == b and same.get(a, False), crossings)
                sends[0] += (v - 1) * self.blocks.send_time(b, a, tp, mbs, a == b and same.get(a, False), crossings)
                shapes[p] = interleaved_shape(self.replica_shape(p, layers, pipe.modes, tp, mbs, sends), v)
            micro = allocate_micro_batches(self.global_batch_size // mbs, pipe.counts, shapes,
                                           {p: stages for p in shapes})
            if micro is None:
                continue
            seconds = self.slowest_replica(((p, shapes[p], m) for p in micro for m in micro[p]), tp, mbs)
            if best is None or seconds < best[1]:
                best = (v, seconds)
        return best

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
        alike: dict[tuple[Pattern, PipelineShape, int], int] = {}  # replicas alike, counted once
        for replica in replicas:
            alike[replica] = alike.get(replica, 0) + 1
        if len(alike) == 1:
            (pattern, shape, m), = alike
            if self.blocks.micro_batch_cv(pattern, tp, mbs) == 0:
                return shape.time(m)
        cv = self.blocks.micro_batch_cv
        ends: dict[tuple[float, float], int] = {}  # slowest_of's own grouping, in its order
        for (pattern, shape, m), n in alike.items():
            end = (shape.time(m), replica_spread(cv(pattern, tp, mbs) * shape.step_s, m))
            ends[end] = ends.get(end, 0) + n
        if all(sigma == 0 for _, sigma in ends):
            return max(end for end, _ in ends)
        return expected_slowest((end, sigma, n) for (end, sigma), n in ends.items())

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
        optimizer = max(blocks.optimizer_step(c, tp, blocks.stage_params(layers, s) / tp[c] / share)
                        for s in heaviest.values() for c in at_stage[s])
        return reduce + optimizer

    def optimizer_step_s(self, tp: Degrees, d: int, layers: list[int], at_stage: Sequence[Sequence[int]]) -> float:
        """The slowest rank's optimizer step of a pipeline (no experts): each stage's
        parameters over its degree, and over the d replicas with the distributed optimizer."""
        blocks = self.blocks
        share = d if blocks.options.setup.distributed_optimizer else 1
        return max(blocks.optimizer_step(c, tp, blocks.stage_params(layers, s) / tp[c] / share)
                   for s in range(len(layers)) for c in at_stage[s])

    def _rank_params(self, layers: list[int], s: int, tensor_parallel: int, costs) -> tuple[float, float]:
        """(dense, expert) parameters of one rank of stage s (memory.rank_params)."""
        experts = stage_expert_params(costs, layers[s], s == len(layers) - 1)
        grid = costs.expert_parallel * costs.expert_tensor_parallel_at(tensor_parallel)
        return (self.blocks.stage_params(layers, s) - experts) / tensor_parallel, experts / grid

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
