"""Megatron's non-interleaved 1F1B schedule, simulated op by op for uneven stages.

Stage s of P runs min(P-s-1, m) warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards. A forward of micro-batch i needs the
previous stage's forward of i; a backward needs the next stage's backward of i. Sends are
blocking, as megatron-core's p2p is: a stage is busy until its output has crossed the
link, and the receiver can start once it has arrived.

No closed form is used: stages of different speed shift the bubbles, and the slowest
stage is not always where they pile up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


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
    num_stages, m = len(stages), num_micro_batches
    orders = [op_order(s, num_stages, m) for s in range(num_stages)]
    # forward_ready[s][i] / backward_ready[s][i]: when micro-batch i's input / gradient
    # reaches stage s (None: not yet).
    forward_ready = [[0.0] * m] + [[None] * m for _ in range(num_stages - 1)]
    backward_ready = [[None] * m for _ in range(num_stages)]
    done: list[list[Op]] = [[] for _ in range(num_stages)]
    clock = [0.0] * num_stages
    position = [0] * num_stages
    last = num_stages - 1
    waiting = list(range(num_stages))  # stages that may be able to run their next op
    while waiting:
        s = waiting.pop()
        order, timing, ops = orders[s], stages[s], done[s]
        forward_cost = timing.forward_s + timing.send_forward_s
        backward_cost = timing.backward_s + timing.send_backward_s
        t, k = clock[s], position[s]
        while k < len(order):
            kind, i = order[k]
            ready = forward_ready[s][i] if kind == "F" else backward_ready[s][i]
            if ready is None:
                break  # blocked until a neighbour delivers; it will put s back
            start = t if t > ready else ready
            if kind == "F":
                t = start + forward_cost
                if s < last:
                    forward_ready[s + 1][i] = t
                    waiting.append(s + 1)
                else:  # the last stage's backward of i follows its own forward of i
                    backward_ready[s][i] = t
            else:
                t = start + backward_cost
                if s > 0:
                    backward_ready[s - 1][i] = t
                    waiting.append(s - 1)
            ops.append(Op(s, kind, i, start, t))
            k += 1
        clock[s], position[s] = t, k
    if any(position[s] < len(orders[s]) for s in range(num_stages)):
        raise RuntimeError("1F1B simulation deadlocked; the op order is inconsistent")
    return done


def makespan(ops: list[list[Op]]) -> float:
    return max(stage[-1].end for stage in ops if stage)
