"""Megatron's non-interleaved 1F1B schedule: the one timing model of a pipeline replica.

Stage s of P runs min(P-s-1, m) warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards. A forward of micro-batch i needs the
previous stage's forward of i; a backward needs the next stage's backward of i. Sends are
blocking, as megatron-core's p2p is: a stage is busy until its output has crossed the
link, and the receiver can start once it has arrived.

Two views of that one model:
- the simulation (simulate_1f1b, stage_ends_1f1b), op by op: what the predictor uses,
  since stages of different speed shift the bubbles, and the slowest stage is not always
  where they pile up;
- the closed form (PipelineShape): m micro-batches take fill + m * step, step being the
  slowest stage's work on one micro-batch and fill the other stages' (filling and draining
  the pipeline). What the planner's fast estimate, the baseline's floors and the runtime's
  self-adapting split use. It equals the simulation for one micro-batch, for one stage,
  and whenever no stage works less per micro-batch than the stage before it (equal stages
  included); elsewhere it is an estimate. m * step, the slowest stage's own busy time, is a
  lower bound of the simulation whatever the stages (PipelineShape.busiest_stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence


@dataclass(frozen=True)
class StageTiming:
    forward_s: float
    """Compute of one micro-batch's forward on this stage."""
    backward_s: float
    send_forward_s: float = 0.0
    """Sending one activation to the next stage (0 on the last stage)."""
    send_backward_s: float = 0.0
    """Sending one gradient to the previous stage (0 on the first stage)."""


class Op(NamedTuple):
    stage: int
    kind: str  # "F" or "B"
    micro_batch: int
    start: float
    end: float
    chunk: int = 0
    """The model chunk (virtual stage of this rank) under the interleaved schedule."""


class PipelineShape(NamedTuple):
    """A replica's 1F1B time in closed form: m micro-batches take fill_s + m * step_s."""

    fill_s: float
    """Filling and draining the pipeline: every stage's work on one micro-batch but the slowest's."""
    step_s: float
    """The slowest stage's work on one micro-batch: it paces the pipeline."""

    def time(self, micro_batches: int) -> float:
        """Seconds to run this many micro-batches."""
        return self.fill_s + micro_batches * self.step_s

    def busiest_stage(self, micro_batches: int) -> float:
        """Seconds the slowest stage alone is busy: the simulation never takes less."""
        return micro_batches * self.step_s


def pipeline_shape(work: Sequence[float]) -> PipelineShape:
    """The closed form of a replica whose stage s works work[s] seconds per micro-batch
    (its forward, its backward and its sends; stage_work)."""
    step = max(work)
    return PipelineShape(sum(work) - step, step)


def interleaved_shape(shape: PipelineShape, virtual_stages: int) -> PipelineShape:
    """The closed form of megatron-core's interleaved 1F1B (interleaved_schedule.py) on
    stages that work as `shape`'s do per micro-batch, their v-fold transfers included: the
    pipeline fills and drains one model chunk, 1/v of a stage, at a time, so the fill is 1/v
    of plain 1F1B's (Narayanan et al., SC21), and the slowest stage still paces every
    micro-batch. Equal to the simulation on equal stages with free transfers."""
    return PipelineShape(shape.fill_s / virtual_stages, shape.step_s)


def stage_work(timing: StageTiming) -> float:
    """A stage's busy time per micro-batch: compute and blocking sends, both directions."""
    return timing.forward_s + timing.backward_s + timing.send_forward_s + timing.send_backward_s


def timing_shape(stages: Sequence[StageTiming]) -> PipelineShape:
    """pipeline_shape of the stages simulate_1f1b takes."""
    return pipeline_shape([stage_work(timing) for timing in stages])


def equal_stages_time(step_s: float, micro_batches: int, stages: int) -> float:
    """The closed form on `stages` equal stages of step_s each: m micro-batches pass in
    (m + p - 1) steps (PipelineShape((p - 1) * step_s, step_s), in one product)."""
    return step_s * (micro_batches + stages - 1)


def equal_stages_step(replica_s: float, micro_batches: int, stages: int) -> float:
    """The inverse of equal_stages_time: one stage's step of a replica of equal stages that
    took replica_s for this many micro-batches."""
    return replica_s / (micro_batches + stages - 1)


def op_order(stage: int, num_stages: int, num_micro_batches: int) -> list[tuple[str, int]]:
    """The order in which one stage runs its forwards and backwards."""
    warmup = min(num_stages - stage - 1, num_micro_batches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_micro_batches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]
    return order


def simulate_1f1b(stages: list[StageTiming], num_micro_batches: int) -> list[list[Op]]:
    """Every op of one pipeline with its start and end time; ops[s] is stage s's list."""
    return _simulate(stages, num_micro_batches, record=True)[1]


def stage_ends_1f1b(stages: list[StageTiming], num_micro_batches: int) -> list[float]:
    """When each stage of simulate_1f1b's pipeline ends its last op (0 with no ops),
    without keeping the ops."""
    return _simulate(stages, num_micro_batches, record=False)[0]


def _simulate(stages: list[StageTiming], num_micro_batches: int,
              record: bool) -> tuple[list[float], list[list[Op]]]:
    """(each stage's clock at the end, each stage's ops if recorded). Each op starts once
    its stage is free and its input has arrived, so the times follow from the dependencies
    alone, whatever order the stages are visited in: a stage runs as far as its inputs
    allow, then waits until a neighbour delivers."""
    num_stages, m = len(stages), num_micro_batches
    # forward_ready[s][i] / backward_ready[s][i]: when micro-batch i's input / gradient
    # reaches stage s (None: not yet). The last stage's gradient of i is its own forward's end.
    forward_ready = [[0.0] * m] + [[None] * m for _ in range(num_stages - 1)]
    backward_ready = [[None] * m for _ in range(num_stages)]
    done: list[list[Op]] = [[] for _ in range(num_stages)]
    clock = [0.0] * num_stages
    position = [0] * num_stages
    orders = [op_order(s, num_stages, m) for s in range(num_stages)]
    waiting = list(range(num_stages))  # stages that may be able to run their next op
    while waiting:
        s = waiting.pop()
        _run_stage(s, stages[s], orders[s], forward_ready, backward_ready, done[s] if record else None,
                   clock, position, waiting)
    if any(position[s] < len(orders[s]) for s in range(num_stages)):
        raise RuntimeError("1F1B simulation deadlocked; the op order is inconsistent")
    return clock, done


def _run_stage(s: int, timing: StageTiming, order: list[tuple[str, int]], forward_ready: list[list],
               backward_ready: list[list], ops: list[Op] | None, clock: list[float], position: list[int],
               waiting: list[int]) -> None:
    """Stage s's ops from where it stopped until one waits for an input (appended to `ops`
    unless None); the neighbours it delivers to go back on `waiting`."""
    last = len(forward_ready) - 1
    own_forward, own_backward = forward_ready[s], backward_ready[s]
    # Where this stage's outputs go: the next stage's inputs, the previous stage's gradients
    # (the last stage feeds its own backward).
    sends_to = forward_ready[s + 1] if s < last else own_backward
    returns_to = backward_ready[s - 1] if s > 0 else None
    forward_cost = timing.forward_s + timing.send_forward_s
    backward_cost = timing.backward_s + timing.send_backward_s
    new_op = tuple.__new__  # Op(...) without NamedTuple's argument handling: it runs per op
    t, k, end = clock[s], position[s], len(order)
    sent_forward = sent_backward = False
    while k < end:
        kind, i = order[k]
        if kind == "F":
            ready = own_forward[i]
            if ready is None:
                break  # blocked until a neighbour delivers; it will put s back
            start = t if t > ready else ready
            t = start + forward_cost
            sends_to[i] = t
            sent_forward = True
        else:
            ready = own_backward[i]
            if ready is None:
                break
            start = t if t > ready else ready
            t = start + backward_cost
            if returns_to is not None:
                returns_to[i] = t
                sent_backward = True
        if ops is not None:
            ops.append(new_op(Op, (s, kind, i, start, t, 0)))
        k += 1
    clock[s], position[s] = t, k
    if sent_forward and s < last:
        waiting.append(s + 1)
    if sent_backward:
        waiting.append(s - 1)


def makespan(ops: list[list[Op]]) -> float:
    return max(stage[-1].end for stage in ops if stage)
