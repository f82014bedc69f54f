"""megatron-core's interleaved 1F1B schedule (forward_backward_pipelining_with_interleaving),
simulated op by op: what the predictor times a pipeline with virtual stages by.

Each of the p pipeline ranks holds v model chunks; chunk c of rank s is virtual stage
c * p + s of the model. A micro-batch's forward runs chunk 0 on ranks 0..p-1, then wraps
around from the last rank to the first for chunk 1, and so on; its backward runs the same
path in reverse. So every chunk boundary is a transfer, the wrap-around included, and the
first rank waits on the last one in forward (the last on the first in backward): a
micro-batch costs a rank v messages each way where plain 1F1B costs one.

Every rank runs the same table of (micro-batch, chunk) pairs (get_schedule_table): the
micro-batches in groups of g (megatron-core's microbatch_group_size_per_vp_stage, by default
p), each group through chunk 0, then chunk 1, ...; backward k runs the k-th pair's micro-
batch on chunk v-1-c. Rank s first runs (p-s-1)*2 + (v-1)*g warm-up forwards
(get_pp_rank_microbatches), then pairs forward w+k with backward k, then drains the
remaining backwards.

Sends keep their rank busy until the output has crossed, as in plain 1F1B (schedule.py).
megatron-core waits for them right after the op in the warm-up and the cool-down, and in the
steady 1F1B posts them to overlap the next op; but a send completes only when its receiver
takes it (gloo and NCCL match each send with its receive) and the next send waits for it,
and measured, little overlaps: charging the sender only the message's latency there put
published H100 runs with 4-24 virtual stages 0.6-8.4 points further below their times
(docs/results.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hetero.errors import PlanError
from hetero.predict.schedule import Op


@dataclass(frozen=True)
class ChunkTiming:
    """One model chunk of one pipeline rank, for one micro-batch."""

    forward_s: float
    backward_s: float
    send_forward_s: float = 0.0
    """Its output to the next virtual stage (the next rank's chunk, or from the last rank
    the first rank's next chunk); 0 from the model's last virtual stage."""
    send_backward_s: float = 0.0
    """Its input's gradient to the previous virtual stage; 0 from the model's first."""


def schedule_table(num_micro_batches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each forward, in order: megatron-core's get_schedule_table."""
    table = []
    for first in range(0, num_micro_batches, group_size):
        last = num_micro_batches if first + group_size >= num_micro_batches else first + group_size
        table += [(i, c) for c in range(num_chunks) for i in range(first, last)]
    return table


def warmup_forwards(stage: int, num_stages: int, num_chunks: int, num_micro_batches: int,
                    group_size: int) -> int:
    """Forwards rank `stage` runs before its first backward (get_pp_rank_microbatches)."""
    warmup = (num_stages - stage - 1) * 2 + (num_chunks - 1) * group_size
    return min(warmup, num_micro_batches * num_chunks)


def interleaved_op_order(stage: int, num_stages: int, num_chunks: int, num_micro_batches: int,
                         group_size: int | None = None) -> list[tuple[str, int, int]]:
    """Rank `stage`'s ops as megatron-core runs them: (kind, micro-batch, chunk)."""
    group = group_size or num_stages
    table = schedule_table(num_micro_batches, num_chunks, group)
    total = len(table)
    warmup = warmup_forwards(stage, num_stages, num_chunks, num_micro_batches, group)
    forwards = [("F", i, c) for i, c in table]
    backwards = [("B", i, num_chunks - 1 - c) for i, c in table]
    steady = [op for k in range(total - warmup) for op in (forwards[warmup + k], backwards[k])]
    return forwards[:warmup] + steady + backwards[total - warmup:]


def check_micro_batch_groups(num_micro_batches: int, num_stages: int, group_size: int | None = None) -> None:
    """megatron-core's conditions on a replica's micro-batches, which it raises on when it runs."""
    group = group_size or num_stages
    if not num_stages <= group <= num_micro_batches:
        raise PlanError(f"the interleaved schedule needs {num_stages} <= micro-batch group {group} <= "
                        f"micro-batches {num_micro_batches}: give every replica at least {num_stages} micro-batches")
    if 0 < num_micro_batches % group < num_stages:
        raise PlanError(f"the interleaved schedule's last group of {num_micro_batches % group} micro-batches is "
                        f"shorter than the {num_stages} pipeline stages: give every replica a multiple of {group}")


def simulate_interleaved(chunks: list[list[ChunkTiming]], num_micro_batches: int,
                         group_size: int | None = None) -> list[list[Op]]:
    """Every op of one interleaved pipeline with its start and end (its send included);
    chunks[s][c] is rank s's chunk c, ops[s] rank s's ops in order (Op.micro_batch the
    micro-batch, Op.chunk the chunk). An op starts once its rank is free and its input has
    arrived: the previous virtual stage's output (rank 0's chunk 0 reads the data), or the
    next one's gradient (the last virtual stage's backward follows its own forward). A rank
    runs as far as its inputs allow, then waits until a neighbour delivers."""
    p, v, m = len(chunks), len(chunks[0]), num_micro_batches
    check_micro_batch_groups(m, p, group_size)
    # arrival[kind][s][c][i]: when op (kind, i, c) of rank s has its input (None: not yet)
    arrival = {kind: [[[None] * m for _ in range(v)] for _ in range(p)] for kind in "FB"}
    arrival["F"][0][0][:] = [0.0] * m
    # Per (rank, kind, chunk): its busy time, where its input arrives, where its output goes.
    routes = {}
    for s in range(p):
        for c in range(v):
            timing = chunks[s][c]
            for kind in "FB":
                target = _receiver(kind, s, c, p, v)
                if target == OWN_BACKWARD:
                    outputs, to_rank = arrival["B"][s][c], s
                elif target == NOWHERE:
                    outputs, to_rank = None, s
                else:
                    outputs, to_rank = arrival[kind][target[0]][target[1]], target[0]
                busy = (timing.forward_s + timing.send_forward_s if kind == "F"
                        else timing.backward_s + timing.send_backward_s)
                routes[s, kind, c] = (busy, arrival[kind][s][c], outputs, to_rank)
    steps = [[(i, c, kind, routes[s, kind, c]) for kind, i, c in _op_order(s, p, v, m, group_size)]
             for s in range(p)]
    ops: list[list[Op]] = [[] for _ in range(p)]
    clock, position = [0.0] * p, [0] * p
    new_op = tuple.__new__  # Op(...) without NamedTuple's argument handling: it runs per op
    waiting = list(range(p))
    while waiting:
        s = waiting.pop()
        t, k, own, done = clock[s], position[s], steps[s], ops[s]
        while k < len(own):
            i, c, kind, (busy, inputs, outputs, to_rank) = own[k]
            ready = inputs[i]
            if ready is None:
                break  # a neighbour delivers it later and puts s back
            start = t if t > ready else ready
            t = start + busy
            if outputs is not None:
                outputs[i] = t
                if to_rank != s:
                    waiting.append(to_rank)
            done.append(new_op(Op, (s, kind, i, start, t, c)))
            k += 1
        clock[s], position[s] = t, k
    if any(position[s] < len(steps[s]) for s in range(p)):
        raise RuntimeError("interleaved simulation deadlocked; the op order is inconsistent")
    return ops


@functools.lru_cache(maxsize=1024)
def _op_order(stage: int, num_stages: int, num_chunks: int, num_micro_batches: int,
              group_size: int | None) -> tuple[tuple[str, int, int], ...]:
    return tuple(interleaved_op_order(stage, num_stages, num_chunks, num_micro_batches, group_size))


OWN_BACKWARD, NOWHERE = (-1, -1), (-2, -2)


def _receiver(kind: str, s: int, c: int, p: int, v: int) -> tuple[int, int]:
    """(rank, chunk) an op's output goes to: OWN_BACKWARD for the model's last forward (its
    loss starts the backward on the same rank), NOWHERE for the model's first backward."""
    if kind == "F":
        if s < p - 1:
            return s + 1, c
        return (0, c + 1) if c < v - 1 else OWN_BACKWARD
    if s > 0:
        return s - 1, c
    return (p - 1, c - 1) if c > 0 else NOWHERE
