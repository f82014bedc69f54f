"""How many samples each iteration trains on, and how they are split over the replicas.

Without ``--rampup-batch-size`` every iteration takes the plan's global batch, split as
the plan says. With it, Megatron-LM's ramp (megatron-core's own calculator) decides the
global batch from the samples consumed so far, and ``Plan.split_micro_batches`` splits
each ramp step in the plan's proportions. Iteration ``i`` always trains on the next
global batch of samples: samples ``[consumed(i), consumed(i) + G(i))``, whatever the plan.
"""

from __future__ import annotations

import argparse
from functools import lru_cache

from hetero.errors import HeteroError, PlanError
from hetero.plan import Plan


class BatchSchedule:
    """Global batch size per iteration (constant or ramped) and its split over replicas."""

    def __init__(self, plan: Plan, rampup_batch_size: list[int] | None = None):
        self.plan = plan
        self.final = plan.global_batch_size
        self.start, self.increment, self.rampup_samples = rampup_batch_size or (self.final, 1, 0)
        num_increments = (self.final - self.start) // self.increment
        # Megatron-LM's ramp (megatron-core's RampupBatchsizeNumMicroBatchesCalculator): the
        # batch grows by one increment every rampup_samples / num_increments samples.
        self._samples_per_increment = self.rampup_samples / num_increments if num_increments else None
        self.micro_batches = lru_cache(maxsize=None)(self._split)

    @property
    def ramps(self) -> bool:
        return self._samples_per_increment is not None

    def global_batch_size(self, consumed_samples: int) -> int:
        if not self.ramps or consumed_samples > self.rampup_samples:
            return self.final
        steps = int(consumed_samples / self._samples_per_increment)
        return self.start + steps * self.increment

    def _split(self, global_batch_size: int) -> tuple[int, ...]:
        try:
            return tuple(self.plan.split_micro_batches(global_batch_size))
        except PlanError as err:
            raise HeteroError(f"--rampup-batch-size: {err}") from None

    def micro_batches_at(self, consumed_samples: int) -> tuple[int, ...]:
        """Micro-batches of every replica in the iteration that starts after consumed_samples."""
        return self.micro_batches(self.global_batch_size(consumed_samples))

    def consumed_samples(self, iterations: int) -> int:
        """Samples trained on by the first `iterations` iterations."""
        consumed = 0
        for done in range(iterations):
            if not self.ramps or consumed > self.rampup_samples:
                return consumed + (iterations - done) * self.plan.global_batch_size
            consumed += self.global_batch_size(consumed)
        return consumed

    def train_iters_for_samples(self, train_samples: int) -> int:
        """Megatron-LM's iteration count for --train-samples: ramp steps while the consumed
        samples are within the ramp, then whole global batches (a partial last one dropped)."""
        if not self.ramps:
            return train_samples // self.plan.global_batch_size
        iterations = consumed = 0
        while consumed <= self.rampup_samples and consumed <= train_samples:
            consumed += self.global_batch_size(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.plan.global_batch_size
        return iterations

    def describe(self) -> list[str]:
        """One line per ramp step: its global batch and micro-batches per replica."""
        if not self.ramps:
            return []
        lines, consumed, last = [], 0, None
        while consumed <= self.rampup_samples:
            size = self.global_batch_size(consumed)
            if size != last:
                lines.append(f"    from sample {consumed:>10d}: global batch {size:5d} -> "
                             f"micro-batches per replica {list(self.micro_batches(size))}")
                last = size
            consumed += size
        lines.append(f"    from sample {consumed:>10d}: global batch {self.plan.global_batch_size:5d} -> "
                     f"micro-batches per replica {list(self.micro_batches(self.plan.global_batch_size))}")
        return lines


def batch_schedule(args: argparse.Namespace, plan: Plan) -> BatchSchedule:
    """The run's schedule; also fills --train-iters from --train-samples (Megatron's rule),
    and checks that every ramp step gives every replica at least one micro-batch."""
    schedule = BatchSchedule(plan, args.rampup_batch_size)
    if args.train_samples is not None:
        args.train_iters = schedule.train_iters_for_samples(args.train_samples)
    for size in range(schedule.start, schedule.final + 1, schedule.increment):
        schedule.micro_batches(size)
    return schedule
