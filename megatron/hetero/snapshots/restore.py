"""Restoring is re-sharding: each needed box cut from the snapshot pieces that cover it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetero.errors import HeteroError
from megatron.hetero.snapshots.pieces import OPTIMIZER_PARAM, Box, box_order
from megatron.hetero.snapshots.store import SnapshotStore


@dataclass(frozen=True)
class Transfer:
    source: int       # rank holding the piece
    piece: Box        # the piece in the holder's store
    part: Box         # the part of it sent
    target: int       # rank that needs it
    need: Box         # the box it fills


def plan_transfers(holdings: list[list[Box]], needs: list[list[Box]],
                   without_twins: bool = False) -> list[Transfer]:
    """Which piece fills which part of which need (every rank computes the same list):
    each needed box from the pieces that cover it, the needing rank's own first, then the
    lowest rank's; a part no survivor holds is named. In snapshots ``without_twins``, a model
    tensor that the optimizer's main parameter holds is filled from that (pieces.twins)."""
    holders: dict[str, list[tuple[int, Box]]] = {}
    for rank, boxes in enumerate(holdings):
        for box in boxes:
            holders.setdefault(box.key, []).append((rank, box))
    transfers = []
    for target, boxes in enumerate(needs):
        for need in boxes:
            twin = OPTIMIZER_PARAM + need.key
            key = twin if without_twins and twin in holders else need.key
            candidates = sorted(holders.get(key, []), key=lambda rb: (rb[0] != target, rb[0]))
            missing = [Box(key, need.offset, need.shape)]  # parts of the need not yet covered, as boxes
            for rank, piece in candidates:
                if not missing:
                    break
                remaining = []
                for hole in missing:
                    part = hole.intersect(piece)
                    if part is None:
                        remaining.append(hole)
                        continue
                    transfers.append(Transfer(rank, piece, part, target, need))
                    remaining += _subtract(hole, part)
                missing = remaining
            if missing:
                raise LostState(f"{need.key}: rows {missing[0].offset}+{missing[0].shape} are held by no surviving "
                                "rank (every copy of that shard was on lost nodes)")
    return transfers


class LostState(HeteroError):
    """A part of the state that no survivor's snapshot holds."""


def _subtract(box: Box, part: Box) -> list[Box]:
    """box minus part (part inside box), as disjoint boxes."""
    pieces, lo, shape = [], list(box.offset), list(box.shape)
    for axis in range(len(shape)):
        start, stop = part.offset[axis], part.offset[axis] + part.shape[axis]
        if start > lo[axis]:
            pieces.append(Box(box.key, tuple(lo), tuple(shape[:axis] + [start - lo[axis]] + shape[axis + 1:])))
        end = lo[axis] + shape[axis]
        if stop < end:
            after = list(lo)
            after[axis] = stop
            pieces.append(Box(box.key, tuple(after), tuple(shape[:axis] + [end - stop] + shape[axis + 1:])))
        lo[axis], shape[axis] = start, stop - start
    return pieces


def restore(store: SnapshotStore, targets: dict[Box, torch.Tensor], group=None) -> tuple[int, dict]:
    """Fills every target tensor (this rank's needs: box -> tensor of the box's shape) from
    the snapshots the ranks of ``group`` hold, of the newest iteration whose pieces cover
    every need; returns that iteration and its common state. Collective; raises LostState
    on every rank alike when no iteration is covered."""
    holdings: dict[int, dict[Box, torch.Tensor]] = {}
    without_twins: dict[int, bool] = {}  # every snapshot of an iteration alike (taking.py)
    for snapshot in store.held():
        without_twins[snapshot.iteration] = snapshot.without_twins
        for box, tensor in snapshot.pieces.items():
            holdings.setdefault(snapshot.iteration, {}).setdefault(box, tensor)
    world = dist.get_world_size(group)
    tables: list = [None] * world
    dist.all_gather_object(tables, ({it: sorted(boxes, key=box_order) for it, boxes in holdings.items()}, without_twins,
                                    [(box, targets[box].dtype) for box in sorted(targets, key=box_order)]),
                           group=group)
    needs = [[box for box, _ in table[2]] for table in tables]
    dtypes = {(rank, box): dtype for rank, table in enumerate(tables) for box, dtype in table[2]}
    iterations = sorted({it for table in tables for it in table[0]}, reverse=True)
    if not iterations:
        raise LostState("no surviving rank holds a snapshot")
    problems = []
    for iteration in iterations:
        try:
            transfers = plan_transfers([table[0].get(iteration, []) for table in tables], needs,
                                       any(table[1].get(iteration, False) for table in tables))
            break
        except LostState as err:
            problems.append(f"iteration {iteration}: {err}")
    else:
        raise LostState("; ".join(problems))
    holder = next(rank for rank, table in enumerate(tables) if iteration in table[0])
    common = [next(s.common for s in store.held(iteration)) if dist.get_rank(group) == holder else None]
    dist.broadcast_object_list(common, src=dist.get_global_rank(group, holder) if group else holder, group=group)
    mine = holdings.get(iteration, {})
    me = dist.get_rank(group)
    ops, landing = [], []
    for transfer in transfers:
        if transfer.source == me and transfer.target == me:
            targets[transfer.need][transfer.part.slices_within(transfer.need)] = \
                mine[transfer.piece][transfer.part.slices_within(transfer.piece)]
        elif transfer.source == me:
            part = mine[transfer.piece][transfer.part.slices_within(transfer.piece)]
            ops.append(dist.P2POp(dist.isend, part.to(dtypes[transfer.target, transfer.need]).contiguous(),
                                  dist.get_global_rank(group, transfer.target) if group else transfer.target, group))
        elif transfer.target == me:
            buffer = torch.empty(transfer.part.shape, dtype=targets[transfer.need].dtype)
            ops.append(dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, transfer.source)
                                  if group else transfer.source, group))
            landing.append((transfer, buffer))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    for transfer, buffer in landing:
        targets[transfer.need][transfer.part.slices_within(transfer.need)] = buffer.to(targets[transfer.need].device)
    return iteration, common[0]
