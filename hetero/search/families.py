"""The shapes the planner searches, in three families, each judged by the fast estimate.

Megatron fixes one tensor-parallel degree per stage and one stage split for all replicas (a
data-parallel group reduces the same layers), but replicas may sit on different devices
and run different numbers of micro-batches. Three families of shapes cover the useful ones:

- cross-class pipelines (HetHub, Holmes): every replica holds k_c stages of each class c;
  faster classes' stages hold more layers; data-parallel groups stay inside one class
  (one fabric) and only pipeline boundaries cross the slow links. Enumerated by the
  data-parallel degree d, with k_c = (tensor-parallel groups of c) // d.
- class-pure replicas (Poplar, Sailor): each replica lies in one class; micro-batches go
  to replicas in proportion to their speed.
- launch order: Megatron's own placement (ranks in launch order, stage-major), which packs
  each stage's data-parallel group onto the fewest nodes, with the planner's stage split
  and micro-batch counts. Megatron's uniform plan is one point of this family.

The last two sweep the pipeline depth (StageSweep). A shape whose estimate provably cannot
reach the shortlist (a floor from the same pieces: layer times, caps, transfers) is
dropped before it is split.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator

from hetero.search.class_orders import stage_patterns
from hetero.search.cost_blocks import Memoised
from hetero.search.estimate import FastEstimate, Pattern, Shape
from hetero.search.options import FLOOR_ROUNDING, Candidate, Degrees
from hetero.search.placement import (
    ORDERS,
    GroupPart,
    class_group_part,
    launch_group_parts,
    launch_patterns,
    launch_runs,
    neighbours_share_node,
)
from hetero.search.shortlist import Leaderboard

Layout = tuple[list[tuple[GroupPart, ...]], dict[int, bool]]
"""Where each stage's data-parallel group lies, and whether a replica's neighbouring stages
of a class share a node."""


class StageSweep:
    """Pipeline depths 1, 2, ... for one family, stopping once `patience` depths in a row
    have all estimated more than `margin` above the best so far: past the smallest depth
    that fits in memory, a deeper pipeline only adds bubbles and transfers."""

    patience, margin = 4, 1.15

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.best = float("inf")
        self.worse_in_a_row = 0
        self.depth_best = float("inf")

    def __iter__(self) -> Iterator[int]:
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


class LayoutFamilies(Memoised):
    """The families' shapes for one search, estimated (FastEstimate) as they come."""

    def __init__(self, estimate: FastEstimate):
        super().__init__()
        self.estimate = estimate
        self.blocks = estimate.blocks
        self.model, self.global_batch_size = estimate.model, estimate.global_batch_size
        self.estimated = 0
        """Shapes judged so far."""
        self.leaders: Leaderboard | None = None
        """While the search keeps only contenders: the shortlist so far."""

    # ----- the three families -----------------------------------------------------------

    def cross_class(self, tp: Degrees, mbs: int, classes: list[int]) -> Iterable[Candidate]:
        groups = {c: len(self.blocks.classes[c].tp_groups(tp[c])) for c in classes}
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
            for pattern in stage_patterns(self._class_orders(classes), counts, {c: tp[c] for c in classes},
                                          self._memory_gib(classes)):
                for order in ORDERS:
                    parts, same = self._cross_class_layout(tp, pattern, d_use, order)
                    candidate = self.judge("cross-class", order, tp, mbs, [(pattern, d_use)], parts, same)
                    if candidate is not None:
                        yield candidate

    def class_orders_of(self, candidate: Candidate) -> list[Candidate]:
        """A cross-class candidate in every other class order the family tries (same degrees,
        micro-batch size, replicas and stages per class), each placement order, estimated
        whether or not it could reach the shortlist: the interleaved schedule's bubbles and
        transfers depend on where each class sits, which the 1F1B estimate does not see."""
        pattern, tp, mbs = candidate.replica_classes[0], candidate.degrees, candidate.micro_batch_size
        classes = sorted(set(pattern))
        counts = {c: pattern.count(c) for c in classes}
        leaders, self.leaders = self.leaders, None
        found = []
        try:
            for other in stage_patterns(self._class_orders(classes), counts, {c: tp[c] for c in classes},
                                        self._memory_gib(classes)):
                for order in ORDERS:
                    if other == pattern and order == candidate.order:
                        continue
                    parts, same = self._cross_class_layout(tp, other, len(candidate.replica_classes), order)
                    judged = self.judge("cross-class", order, tp, mbs, [(other, len(candidate.replica_classes))],
                                        parts, same)
                    if judged is not None:
                        found.append(judged)
        finally:
            self.leaders = leaders
        return found

    def _cross_class_layout(self, tp: Degrees, pattern: Pattern, replicas: int, order: str) -> Layout:
        """Where each stage's data-parallel group lies, and whether a replica's consecutive
        stages of a class share a node: the same for every micro-batch size."""
        per_node = self.blocks.per_node

        def compute() -> Layout:
            local = [pattern[:s].count(c) for s, c in enumerate(pattern)]  # stage index in its class
            parts = [(class_group_part(c, per_node(c, tp), replicas, pattern.count(c), j, order),)
                     for c, j in zip(pattern, local)]
            same = {c: neighbours_share_node(per_node(c, tp), replicas, pattern.count(c), order)
                    for c in sorted(set(pattern))}
            return parts, same
        return self._memo(("cross-class layout", tp, pattern, replicas, order), compute)

    def _memory_gib(self, classes: list[int]) -> dict[int, float]:
        """Each class's device memory."""
        devices = self.blocks.cluster.devices
        return {c: devices[self.blocks.classes[c].device_type].memory_gib for c in classes}

    def _class_orders(self, classes: list[int]) -> list[tuple[int, ...]]:
        """Stage orders worth trying: all of them for few classes, else grouped by fabric."""
        if len(classes) <= 3:
            return list(itertools.permutations(classes))
        by_group: dict[str, list[int]] = {}
        for c in classes:
            by_group.setdefault(self.blocks.classes[c].group, []).append(c)
        memory_gib = {c: self.blocks.cluster.devices[self.blocks.classes[c].device_type].memory_gib for c in classes}
        orders = []
        for groups in itertools.permutations(sorted(by_group)):
            order = [c for g in groups for c in sorted(by_group[g], key=lambda c: -memory_gib[c])]
            orders.append(tuple(order))
            if len(orders) >= 6:
                break
        return orders

    def class_pure(self, tp: Degrees, mbs: int, classes: list[int]) -> Iterable[Candidate]:
        groups = {c: len(self.blocks.classes[c].tp_groups(tp[c])) for c in classes}
        sweep = StageSweep(self.model.num_layers)
        for stages in sweep:
            replicas = {c: groups[c] // stages for c in sorted(classes) if groups[c] // stages}
            if not replicas:
                break
            patterns = [(tuple([c] * stages), n) for c, n in replicas.items()]
            for order in ORDERS:
                parts, same = self._class_pure_layout(tp, stages, tuple(replicas.items()), order)
                candidate = self.judge("class-pure", order, tp, mbs, patterns, parts, same, sweep)
                if candidate is not None:
                    yield candidate

    def _class_pure_layout(self, tp: Degrees, stages: int, replicas: tuple[tuple[int, int], ...],
                           order: str) -> Layout:
        """_cross_class_layout for class-pure replicas, `replicas`: (class, how many)."""
        per_node = self.blocks.per_node

        def compute() -> Layout:
            parts = [tuple(class_group_part(c, per_node(c, tp), n, stages, s, order) for c, n in replicas)
                     for s in range(stages)]
            same = {c: neighbours_share_node(per_node(c, tp), n, stages, order) for c, n in replicas}
            return parts, same
        return self._memo(("class-pure layout", tp, stages, replicas, order), compute)

    def launch_order(self, tp: Degrees, mbs: int, classes: list[int]) -> Iterable[Candidate]:
        runs = launch_runs(self.blocks.cluster, self.blocks.class_of, set(classes), max(tp))
        total = runs[-1].end_group if runs else 0
        sweep = StageSweep(self.model.num_layers)
        for stages in sweep:
            d = total // stages
            if d < 1:
                break
            patterns = launch_patterns(runs, d, stages)
            parts = [launch_group_parts(runs, s * d, d) for s in range(stages)]
            same = {c: False for c in classes}  # neighbours are d groups apart
            candidate = self.judge("launch-order", "stage-major", tp, mbs, patterns, parts, same, sweep)
            if candidate is not None:
                yield candidate

    def mixed_degrees(self, mbs: int) -> list[Degrees]:
        """Per-class degrees for cross-class pipelines (uniform ones are searched anyway):
        each class from its smallest degree whose stage holds a decoder layer (room for one
        on a pipeline as deep as the layers, the most micro-batches in flight) up to the
        widest that fits its nodes; only combinations that differ, at most 64."""
        memory = self.estimate.memory
        choices = []
        for c, cl in enumerate(self.blocks.classes):
            widths = [w for w in sorted(self.blocks.options.tensor_parallel) if cl.devices_per_node >= w]
            fitting = [w for w in widths if max(memory.stage_caps(
                c, self.blocks.uniform(w), mbs, 1, self.model.num_layers, memory.recompute_modes[-1])) >= 1]
            choices.append(fitting)
        if any(not widths for widths in choices):
            return []
        mixed = [tp for tp in itertools.product(*choices) if len(set(tp)) > 1]
        return mixed[:64]

    # ----- judging a shape --------------------------------------------------------------

    def judge(self, family: str, order: str, tp: Degrees, mbs: int, patterns: list[tuple[Pattern, int]],
              dp_parts: list[tuple[GroupPart, ...]], same_node: dict[int, bool],
              sweep: StageSweep | None = None) -> Candidate | None:
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
        allowed = self.blocks.options.pipeline_parallel
        if allowed is not None and len(patterns[0][0]) not in allowed:
            return None
        shape = Shape(tp, mbs, tuple(patterns), tuple(sorted(same_node.items())))
        # Nobody needs to hear whether the shape fits without a sweep: spare it the memory model.
        if sweep is None and not self._worth_judging(family, *self.estimate.loose_floor(shape), None):
            return None
        pipe = self.estimate.fit_pipeline(shape)
        if pipe is None or not self._worth_judging(family, pipe.floor, pipe.interleaved_floor, sweep):
            return None
        split = self.estimate.split(shape, pipe)
        if split is None:
            return None
        layers, micro, pipeline = split
        interleaved = None
        if self.leaders is None or pipe.interleaved_floor * (1 - FLOOR_ROUNDING) <= self.leaders.interleaved_bar():
            interleaved = self.estimate.interleaved(shape, pipe, layers)
        # the pipelines alone, plain and interleaved, are floors of the estimates
        if not self._worth_judging(family, pipeline, interleaved[1] if interleaved else float("inf"), sweep):
            return None
        terms = self.blocks.stage_group_terms(tp, dp_parts)
        expert_terms = self.blocks.stage_expert_group_terms(tp, dp_parts) if self.blocks.expert_parallel > 1 else None
        after = self.estimate.reduce_and_step(tp, mbs, d, layers, pipe.modes, pipe.at_stage, terms,
                                              expert_terms=expert_terms)
        given = {p: iter(micro[p]) for p in micro}
        replica_classes = list(itertools.chain.from_iterable([p] * n for p, n in patterns))
        micro_batches = list(itertools.chain.from_iterable(itertools.islice(given[p], n) for p, n in patterns))
        candidate = Candidate(family, order, tp, mbs, list(layers), replica_classes, micro_batches,
                              pipeline + after, list(pipe.modes),
                              (interleaved[0], interleaved[1] + after) if interleaved else None)
        if self.leaders is not None:
            self.leaders.add(candidate)
        if sweep is not None:
            sweep.record(candidate.estimate_s)
        return candidate

    def _worth_judging(self, family: str, floor: float, interleaved_floor: float,
                       sweep: StageSweep | None) -> bool:
        """Whether a shape whose estimate is at least `floor` (interleaved: at least
        interleaved_floor) can still matter: reach the shortlist or the interleaved one
        (while the search keeps only contenders), or change its sweep's course. A shape that
        cannot (and fits, as it does whenever a sweep is given) is reported to its sweep with
        its floor, which steers the sweep exactly as its estimate would (both lie above
        StageSweep.bar)."""
        if self.leaders is None:
            return True
        floor *= 1 - FLOOR_ROUNDING  # so that rounding never lifts it above the estimate
        if (floor <= self.leaders.bar(family) or interleaved_floor * (1 - FLOOR_ROUNDING) <= self.leaders.interleaved_bar()
                or (sweep is not None and floor <= sweep.bar())):
            return True
        if sweep is not None:
            sweep.record(floor)
        return False
