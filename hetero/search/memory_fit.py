"""How many decoder layers each stage of a shape can hold, and the recomputation that makes
the layers fit: the memory model's answers (hetero/predict/memory.py), cached for the search.
"""

from __future__ import annotations

import dataclasses
import heapq

from hetero.predict.memory import (END_STAGES, MemoryEstimate, StageMemoryTerms, layer_capacity,
                                   micro_batches_in_flight, optimizer_state_bytes, rank_memory, rank_params)
from hetero.search.cost_blocks import CostBlocks, Memoised
from hetero.search.options import Degrees

StageClasses = tuple[tuple[int, ...], ...]
"""Each stage's device classes (over all replicas)."""


class MemoryFit(Memoised):
    """Layer caps and recomputation for one cluster, model, global batch and set of options."""

    def __init__(self, blocks: CostBlocks, global_batch_size: int):
        super().__init__()
        self.blocks = blocks
        self.global_batch_size = global_batch_size
        self.setup = blocks.options.setup
        # With fused (flash) attention no score matrix is kept: recomputing the attention core
        # alone saves no memory there, only costs time.
        self.recompute_modes = tuple(m for m in blocks.options.recompute_modes
                                     if not (m == "selective" and self.setup.fused_kernels)) or ("none",)
        """The recomputation modes a stage may take, cheapest first."""

    def layer_cap(self, c: int, tp: Degrees, mbs: int, dp: int, stage: int, stages: int,
                  recompute: str | None = None, num_micro_batches: int | None = None,
                  virtual_stages: int | None = None) -> int:
        """Most decoder layers stage `stage` can hold on a device of class c: the memory
        model's own answer (memory.layer_capacity), for the most micro-batches a replica
        runs (by default: could run), with this many model chunks per stage (by default the
        setup's)."""
        total_mb = num_micro_batches or self.global_batch_size // mbs
        v = virtual_stages or self.setup.virtual_stages
        in_flight_key = min(stages - stage, total_mb) if v == 1 else (stages - stage, total_mb, v)
        key = ("cap", c, tp[c], max(tp), mbs, dp, in_flight_key, stage == 0, stage == stages - 1, stages > 1,
               recompute, virtual_stages)
        cl = self.blocks.classes[c]
        return self._memo(key, lambda: layer_capacity(
            self.blocks.costs_for(max(tp), virtual_stages) if virtual_stages else self.blocks.job_costs(tp),
            self.blocks.cluster.devices[cl.device_type].memory_gib, vendor=cl.vendor,
            tensor_parallel=tp[c], data_parallel=dp, micro_batch_size=mbs, stage=stage,
            num_stages=stages, num_micro_batches=total_mb, recompute=recompute))

    def stage_caps(self, c: int, tp: Degrees, mbs: int, dp: int, stages: int, recompute: str,
                   virtual_stages: int | None = None) -> list[int]:
        """layer_cap of every stage of a pipeline this deep: the memory model's bilinear
        terms per kind of stage (memory.stage_memory_terms), evaluated at each stage's
        micro-batches in flight (with virtual_stages model chunks per stage, by default the
        setup's). The memory model sees a class only through its vendor and memory size:
        classes alike share the answer."""
        vendor = self.blocks.classes[c].vendor
        memory_gib = self.blocks.cluster.devices[self.blocks.classes[c].device_type].memory_gib

        def compute() -> list[int]:
            total_mb = self.global_batch_size // mbs
            v = virtual_stages or self.setup.virtual_stages
            ends = [(s == 0, s == stages - 1) for s in range(stages)]
            terms = {(first, last): self._memo(
                ("terms", vendor, tp[c], max(tp), mbs, dp, recompute, first, last),
                lambda: self._stage_terms(vendor, tp[c], max(tp), mbs, dp, recompute, first, last))
                for first, last in set(ends)}
            return [terms[end].capacity(memory_gib, micro_batches_in_flight(s, stages, total_mb, v))
                    for s, end in enumerate(ends)]
        return self._memo(("caps", vendor, memory_gib, tp[c], max(tp), mbs, dp, stages, recompute, virtual_stages),
                          compute)

    def _stage_terms(self, vendor: str, tensor_parallel: int, widest: int, mbs: int, dp: int, recompute: str,
                     first: bool, last: bool) -> StageMemoryTerms:
        """memory.stage_memory_terms of a stage of this kind: the memory model's rank estimates
        without the optimizer state computed once for every data-parallel size (only the
        state depends on it), the state for this one (memory.optimizer_state_bytes)."""
        costs = self.blocks.costs_for(widest)
        stage, stages = END_STAGES[first, last]

        def estimates() -> dict[tuple[int, int], tuple[MemoryEstimate, tuple[float, float]]]:
            return {(n, f): (rank_memory(costs, vendor=vendor, tensor_parallel=tensor_parallel, data_parallel=1,
                                         micro_batch_size=mbs, num_layers=n, stage=stage, num_stages=stages,
                                         num_micro_batches=f, recompute=recompute, in_flight=f),
                             rank_params(costs, n, first, last, stages, tensor_parallel))
                    for n in (0, 1) for f in (1, 2)}
        at_one = self._memo(("rank memory", vendor, tensor_parallel, widest, mbs, recompute, first, last), estimates)
        distributed = costs.setup.distributed_optimizer

        def total(n: int, f: int) -> float:
            memory, (dense, experts) = at_one[n, f]
            state = optimizer_state_bytes(costs, dense, experts, tensor_parallel, dp, distributed)
            return dataclasses.replace(memory, optimizer=state).total
        return StageMemoryTerms.of(total)

    def recompute_to_fit(self, tp: Degrees, mbs: int, d: int, at_stage: StageClasses
                         ) -> tuple[list[int], tuple[str, ...]] | None:
        """Each stage's layer cap and recomputation, None if no choice holds the layers:
        every stage starts with the cheapest mode; while the stages cannot hold the layers
        (split_layers fails only then: a stage with room for none, or too little room in
        all), the stage with the least room moves to the next mode (its activations shrink,
        its backward grows). The same for every placement order of a shape: memoised."""
        return self._memo(("fit", tp, mbs, d, at_stage), lambda: self._escalate_recompute(tp, mbs, d, at_stage))

    def _escalate_recompute(self, tp: Degrees, mbs: int, d: int, at_stage: StageClasses
                            ) -> tuple[list[int], tuple[str, ...]] | None:
        stages, modes_tried, num_layers = len(at_stage), self.recompute_modes, self.blocks.model.num_layers
        by_mode: dict[str, list[int]] = {}

        def caps_of(mode: str) -> list[int]:  # per stage, the least over its classes
            if mode not in by_mode:
                per_class = {c: self.stage_caps(c, tp, mbs, d, stages, mode) for c in set().union(*at_stage)}
                by_mode[mode] = _least_per_stage(per_class, at_stage)
            return by_mode[mode]

        level = [0] * stages
        caps = list(caps_of(modes_tried[0]))
        total, least = sum(caps), min(caps)
        if total < num_layers or least < 1:
            if len(modes_tried) == 1:
                return None
            heap = [(cap, s) for s, cap in enumerate(caps)]  # the stage with the least room first
            heapq.heapify(heap)
            while heap and (total < num_layers or least < 1):
                _, s = heapq.heappop(heap)
                level[s] += 1
                new = caps_of(modes_tried[level[s]])[s]
                total += new - caps[s]
                caps[s] = new
                if level[s] + 1 < len(modes_tried):
                    heapq.heappush(heap, (new, s))
                least = min(caps) if caps[s] >= 1 > least else least
            if total < num_layers or min(caps) < 1:
                return None
        return caps, tuple(modes_tried[i] for i in level)


def _least_per_stage(per_class: dict[int, list[int]], at_stage: StageClasses) -> list[int]:
    """Each stage's least value over the classes at that stage."""
    if len(set(at_stage)) == 1:  # the same classes at every stage (class-pure shapes): column-wise
        return list(map(min, zip(*(per_class[c] for c in at_stage[0]))))
    return [min(per_class[c][s] for c in classes) for s, classes in enumerate(at_stage)]
