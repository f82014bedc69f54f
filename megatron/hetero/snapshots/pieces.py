"""Training state kept in host memory, replicated to peers, restorable under any plan.

A snapshot is what a checkpoint holds (hetero's sharded state dict: the model's tensors and
the optimizer's in megatron-core's fully reshardable form, the scheduler and the iteration),
taken every ``--non-persistent-save-interval`` iterations into this process's host memory
instead of onto a disk, and copied to ranks on other nodes (``replicas``): a lost node loses
no piece that a survivor does not also hold, so the survivors restore from memory, with no
file read, and lose at most the iterations since the snapshot.

Each piece is one ShardedTensor's local data with the box it covers in its global tensor
(key, offset, shape). Restoring (``restore``) is re-sharding: every rank of the new world
says which boxes its freshly built model and optimizer need, every holder says which boxes it
holds, and each needed box is cut from the pieces that cover it, copied locally or sent by
its holder, in one exchange computed alike on every rank. The common state (scheduler,
iteration, counters) is the same on every rank and kept whole by each.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hetero.errors import HeteroError


@dataclass(frozen=True)
class Box:
    """Where a local tensor sits in its global tensor."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def intersect(self, other: "Box") -> "Box | None":
        if self.key != other.key or len(self.offset) != len(other.offset):
            return None
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(self.key, lo, tuple(h - l for l, h in zip(lo, hi)))

    def slices_within(self, outer: "Box") -> tuple[slice, ...]:
        """This box's place inside ``outer`` (which contains it), as slices of outer's tensor."""
        return tuple(slice(o - p, o - p + n) for o, p, n in zip(self.offset, outer.offset, self.shape))

    @property
    def numel(self) -> int:
        total = 1
        for n in self.shape:
            total *= n
        return total


def box_of(sharded_tensor) -> Box:
    """The box of a megatron-core ShardedTensor (its prepended axes included)."""
    if sharded_tensor.flattened_range is not None:
        raise HeteroError(f"{sharded_tensor.key}: a flattened shard cannot be snapshot; snapshots take the "
                          "optimizer in megatron-core's fully reshardable form")
    return Box(sharded_tensor.key, tuple(sharded_tensor.global_offset), tuple(sharded_tensor.local_shape))


@dataclass
class Snapshot:
    """One rank's state at one iteration: its pieces (host memory) and the common state."""

    iteration: int
    taken_by: int                  # the logical rank that took it, in the world it was taken in
    host: str
    pieces: dict[Box, torch.Tensor] = field(default_factory=dict)
    common: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pieces.values())


def take(sharded_state: dict, common: dict, iteration: int) -> Snapshot:
    """This rank's snapshot of a sharded state dict (hetero's checkpoint state, preprocessed
    by megatron-core's save_preprocess: factories applied, common part apart)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    snapshot = Snapshot(iteration, dist.get_rank(), socket.gethostname(), common=common)
    for value in nested_values(sharded_state):
        # Kept by one rank, as a checkpoint writes it once: the data-parallel replicas'
        # identical copies add no safety the copies on other nodes do not give.
        if isinstance(value, ShardedTensor) and value.data is not None and is_main_replica(value.replica_id):
            box = box_of(value)
            if box not in snapshot.pieces:
                snapshot.pieces[box] = value.data.detach().to("cpu", copy=True).reshape(box.shape)
    return snapshot


class SnapshotStore:
    """This process's snapshots: its own and the copies it keeps for ranks on other nodes,
    for the newest two iterations. Two, because a node lost while a snapshot is being copied
    leaves the newest one complete on some survivors and not on others; the one before it is
    complete on all (every rank finished it before any began the next: the copies' exchange
    starts with a collective over the whole job)."""

    KEPT = 2

    def __init__(self) -> None:
        self.own: dict[int, Snapshot] = {}
        self.copies: dict[int, dict[int, Snapshot]] = {}
        # What every rank's snapshot holds (boxes, dtypes), the same at every iteration of
        # one plan: exchanged at the first snapshot under each plan (None: not yet).
        self.layouts: list | None = None
        # The copies under way (their transfers overlap the next iteration): (works, iteration,
        # the receive buffers by sender, the senders' headers).
        self.in_flight: tuple | None = None

    def held(self, iteration: int | None = None) -> list[Snapshot]:
        """Every snapshot held (of ``iteration`` only, when given)."""
        found = []
        for it in sorted(set(self.own) | set(self.copies), reverse=True):
            if iteration is None or it == iteration:
                found += ([self.own[it]] if it in self.own else []) + list(self.copies.get(it, {}).values())
        return found

    @property
    def newest(self) -> int | None:
        return max(self.own) if self.own else None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.held())

    def add(self, snapshot: Snapshot) -> None:
        self.own[snapshot.iteration] = snapshot
        self.copies.pop(snapshot.iteration, None)  # copies of an earlier take of this iteration
        for old in sorted(self.own)[:-self.KEPT]:
            self.own.pop(old)
            self.copies.pop(old, None)

    def clear(self) -> None:
        self.own.clear()
        self.copies.clear()

    def settle(self, block: bool = True) -> None:
        """Keeps the copies under way once every transfer of them finished (block: waits for
        them; else only if they have)."""
        if self.in_flight is None:
            return
        arrived, failures, iteration, received, headers = self.in_flight
        if not block and not arrived.is_set():
            return
        arrived.wait()
        self.in_flight = None
        if failures:
            if block:  # a peer lost during the copies: the training loop's recovery takes over
                raise RuntimeError(f"a snapshot copy failed: {failures[0]}")
            return  # a copy that failed is no copy
        if iteration in self.own:  # not dropped meanwhile (KEPT generations)
            # The common state (iteration, scheduler, counters) is the same on every rank: this one's.
            self.copies[iteration] = {peer: Snapshot(iteration, peer, headers[peer]["host"], pieces,
                                                     self.own[iteration].common) for peer, pieces in received.items()}

    def abandon(self) -> None:
        """Drops the copies under way (a peer was lost: they may never complete)."""
        self.in_flight = None

    def replicate(self, send_to: list[int], receive_from: list[int], group=None) -> None:
        """Sends this rank's newest snapshot to ``send_to`` and receives the snapshots of
        ``receive_from`` (every rank calls this with lists that pair up), without waiting: the
        transfers overlap the next iteration, and the copies count once they all arrived
        (``settle``; a half-received generation is no copy at all). Tensors go by
        point-to-point messages in one agreed order; the metadata with them."""
        self.settle()  # the previous generation's copies first: one generation under way at a time
        own = self.own[self.newest]
        boxes = sorted(own.pieces, key=_box_order)
        header = {"host": own.host, "boxes": boxes, "dtypes": [str(own.pieces[b].dtype) for b in boxes]}
        if self.layouts is None:  # the first snapshot under this plan (every rank alike)
            self.layouts = [None] * dist.get_world_size(group)
            dist.all_gather_object(self.layouts, header, group=group)
        else:
            # Every rank finished its previous snapshot before any copies this one (what the
            # two generations kept rely on); the metadata is known.
            dist.barrier(group=group)
        headers = self.layouts
        ops = []
        received: dict[int, dict[Box, torch.Tensor]] = {}
        for peer in send_to:
            ops += [dist.P2POp(dist.isend, own.pieces[b].contiguous(), peer, group) for b in boxes]
        for peer in receive_from:
            theirs = headers[peer]
            received[peer] = {b: torch.empty(b.shape, dtype=_dtype(d)) for b, d in zip(theirs["boxes"], theirs["dtypes"])}
            ops += [dist.P2POp(dist.irecv, received[peer][b], peer, group) for b in theirs["boxes"]]
        works = dist.batch_isend_irecv(ops) if ops else []
        arrived, failures = threading.Event(), []

        def wait_for_transfers() -> None:  # gloo's point-to-point work says it is done only once waited for
            try:
                for work in works:
                    work.wait()
            except Exception as err:  # noqa: BLE001 - reported by settle()
                failures.append(err)
            finally:
                arrived.set()

        threading.Thread(target=wait_for_transfers, name="hetero-snapshot-copies", daemon=True).start()
        self.in_flight = (arrived, failures, own.iteration, received, headers)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _box_order(box: Box) -> tuple:
    return (box.key, box.offset, box.shape)


@dataclass(frozen=True)
class Transfer:
    source: int       # rank holding the piece
    piece: Box        # the piece in the holder's store
    part: Box         # the part of it sent
    target: int       # rank that needs it
    need: Box         # the box it fills


def plan_transfers(holdings: list[list[Box]], needs: list[list[Box]]) -> list[Transfer]:
    """Which piece fills which part of which need (every rank computes the same list):
    each needed box from the pieces that cover it, the needing rank's own first, then the
    lowest rank's; a part no survivor holds is named."""
    holders: dict[str, list[tuple[int, Box]]] = {}
    for rank, boxes in enumerate(holdings):
        for box in boxes:
            holders.setdefault(box.key, []).append((rank, box))
    transfers = []
    for target, boxes in enumerate(needs):
        for need in boxes:
            candidates = sorted(holders.get(need.key, []), key=lambda rb: (rb[0] != target, rb[0]))
            missing = [need]  # parts of the need not yet covered, as boxes
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
    for snapshot in store.held():
        for box, tensor in snapshot.pieces.items():
            holdings.setdefault(snapshot.iteration, {}).setdefault(box, tensor)
    world = dist.get_world_size(group)
    tables: list = [None] * world
    dist.all_gather_object(tables, ({it: sorted(boxes, key=_box_order) for it, boxes in holdings.items()},
                                    sorted(targets, key=_box_order)), group=group)
    needs = [table[1] for table in tables]
    iterations = sorted({it for table in tables for it in table[0]}, reverse=True)
    if not iterations:
        raise LostState("no surviving rank holds a snapshot")
    problems = []
    for iteration in iterations:
        try:
            transfers = plan_transfers([table[0].get(iteration, []) for table in tables], needs)
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
            ops.append(dist.P2POp(dist.isend, mine[transfer.piece][transfer.part.slices_within(transfer.piece)]
                                  .contiguous(), dist.get_global_rank(group, transfer.target) if group else transfer.target, group))
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


__all__ = ["Box", "LostState", "Snapshot", "SnapshotStore", "Transfer", "box_of", "plan_transfers", "restore",
           "take"]
