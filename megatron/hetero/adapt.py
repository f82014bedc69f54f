"""Self-adapting split (``--hetero-adapt``): Holmes' self-adapting partition, while training.

Each iteration every rank measures how long it was busy before the gradient reduction
(where replicas wait for the slowest one) and how long its forward and backward steps
took (``tracing.BUSY``). Every ``window`` iterations the ranks agree, in one all-reduce,
on each replica's time; when another split of the same global batch is predicted to make
the slowest replica faster by more than ``min_gain``, the replicas' micro-batch counts are
re-split between two iterations. Iteration i still trains on samples [consumed(i),
consumed(i) + G(i)) - only which replica reads which of them changes - so the losses are
those of the run without adaptation, up to the order of the sums.

Layers cannot move between stages while training (a stage holds its layers' weights and
optimizer state): the layer split the measured stage times call for goes into a corrected
plan, written when training ends, for the next restart (a resume re-shards the checkpoint).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import torch

from hetero.balance import largest_remainder
from hetero.errors import HeteroError, PlanError
from hetero.plan import Plan
from hetero.predict.schedule import equal_stages_step, equal_stages_time
from megatron.hetero.batch_schedule import BatchSchedule
from megatron.hetero.log import print_rank_0


def rebalanced_micro_batches(replica_seconds: list[float], counts: list[int], stages: int,
                             unit: int = 1) -> list[int]:
    """The split of sum(counts) micro-batches under which every replica would take the same
    time, given each replica's measured time for its current count (whole multiples of
    ``unit``, at least one unit each). A replica is taken as a pipeline of equal stages
    (the 1F1B closed form, hetero/predict/schedule.py)."""
    per_step = [equal_stages_step(t, m, stages) for t, m in zip(replica_seconds, counts)]
    # Equal times: (m_d + p - 1) * a_d = c for every d, with sum(m_d) = total.
    total = sum(counts)
    c = (total + len(counts) * (stages - 1)) / sum(1 / a for a in per_step)
    shares = [max(0.0, c / a - (stages - 1)) / unit for a in per_step]
    scale = (total // unit) / sum(shares)
    return [n * unit for n in largest_remainder([s * scale for s in shares], total // unit, 1)]


def rebalanced_layers(stage_seconds: list[float], layers: list[int]) -> list[int]:
    """Decoder layers per stage such that every stage takes the same time, given each
    stage's measured compute time for its current layers (at least one layer each)."""
    speed = [n / t for n, t in zip(layers, stage_seconds)]  # layers per second
    total = sum(layers)
    return largest_remainder([total * v / sum(speed) for v in speed], total, 1)


@dataclass
class Measurement:
    """One iteration of every rank: time to the gradient reduction, forward+backward time."""

    busy: list[float]
    compute: list[float]


class Adapter:
    """Decides, identically on every rank, when and how to re-split the replicas."""

    def __init__(self, plan: Plan, rampup_batch_size: list[int] | None, output: str,
                 window: int = 2, min_gain: float = 0.03, warmup: int = 1):
        self.plan, self.rampup = plan, rampup_batch_size
        self.output, self.window, self.min_gain, self.warmup = output, window, min_gain, warmup
        self.measurements: list[Measurement] = []
        self.history: list[str] = []
        self._skip = warmup

    def record(self, busy_seconds: float, compute_seconds: float) -> None:
        """This rank's times of the iteration just run; every rank's, after one all-reduce."""
        world = torch.distributed.get_world_size()
        times = torch.zeros(2, world, dtype=torch.float64)
        rank = torch.distributed.get_rank()
        times[0, rank], times[1, rank] = busy_seconds, compute_seconds
        torch.distributed.all_reduce(times)
        if self._skip:  # the first iterations also pay for allocation and warm-up
            self._skip -= 1
            return
        self.measurements.append(Measurement(times[0].tolist(), times[1].tolist()))
        del self.measurements[:-self.window]

    def _median(self, field: str) -> list[float]:
        rows = [getattr(m, field) for m in self.measurements]
        return [statistics.median(column) for column in zip(*rows)]

    def replica_seconds(self) -> list[float]:
        """Each replica's time to its gradient reduction: its slowest rank's (median)."""
        busy = self._median("busy")
        plan = self.plan
        return [max(busy[r] for r in plan.grid.replica_ranks(d)) for d in range(plan.data_parallel)]

    def stage_seconds(self) -> list[float]:
        """Each stage's forward+backward time per micro-batch on its slowest replica (median)."""
        compute, plan = self._median("compute"), self.plan
        return [max(compute[r] / plan.replicas[d].num_micro_batches
                    for d in range(plan.data_parallel) for r in plan.grid.tensor_group(d, p))
                for p in range(plan.pipeline_parallel)]

    def maybe_resplit(self, iteration: int) -> Plan | None:
        """A plan with re-split replicas once a full window says the split is off; else None."""
        plan = self.plan
        if plan.data_parallel < 2 or len(self.measurements) < self.window:
            return None
        seconds = self.replica_seconds()
        counts = [replica.num_micro_batches for replica in plan.replicas]
        stages = plan.pipeline_parallel
        unit = stages if plan.virtual_pipeline_size else 1  # interleaving needs multiples of pp
        proposed = rebalanced_micro_batches(seconds, counts, stages, unit)
        per_step = [equal_stages_step(t, m, stages) for t, m in zip(seconds, counts)]
        now = max(seconds)
        then = max(equal_stages_time(a, m, stages) for a, m in zip(per_step, proposed))
        if proposed == counts or then > now * (1 - self.min_gain):
            return None
        try:
            adapted = Plan.from_dict(
                {**plan.to_dict(), "replicas": [{"num_micro_batches": m} for m in proposed]})
            schedule = BatchSchedule(adapted, self.rampup)
            for size in range(schedule.start, schedule.final + 1, schedule.increment):
                schedule.micro_batches(size)  # every ramp step still gives each replica one
        except (PlanError, HeteroError) as err:
            print_rank_0(f"> hetero-adapt: keeping micro-batches {counts}: the split {proposed} "
                         f"is not a valid plan ({err})")
            self.measurements.clear()
            return None
        line = (f"> hetero-adapt after iteration {iteration}: replica times "
                f"{[round(t, 3) for t in seconds]} s -> micro-batches per replica {counts} -> "
                f"{proposed} (slowest replica predicted {now:.3f} -> {then:.3f} s)")
        print_rank_0(line)
        self.history.append(line)
        self.plan = adapted
        self.measurements.clear()
        return adapted

    def corrected_plan(self) -> Plan:
        """The current split, with the layer split the measured stage times call for."""
        plan = self.plan
        if plan.pipeline_parallel < 2 or plan.virtual_pipeline_size or not self.measurements:
            return plan
        layers = rebalanced_layers(self.stage_seconds(), [s.num_layers for s in plan.stages])
        stages = [{**stage.model_dump(mode="json", exclude_none=True), "num_layers": n}
                  for stage, n in zip(plan.stages, layers)]
        return Plan.from_dict({**plan.to_dict(), "stages": stages})

    def write_corrected_plan(self) -> None:
        plan = self.corrected_plan()
        if torch.distributed.get_rank() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(self.output)), exist_ok=True)
            plan.save(self.output)
        print_rank_0(
            f"> hetero-adapt: corrected plan written to {self.output} (layers per stage "
            f"{[s.num_layers for s in plan.stages]}, micro-batches per replica "
            f"{[r.num_micro_batches for r in plan.replicas]}); restart with --hetero-plan "
            f"{self.output} to apply its layer split")


def default_output(save_dir: str | None) -> str:
    return os.path.join(save_dir or os.getcwd(), "adapted_plan.json")
