"""The snapshots a process holds (its own and its copies of peers'), and their replication."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from megatron.hetero.snapshots.pieces import Snapshot, buffer_from, pack, unpack


class SnapshotStore:
    """This process's snapshots: its own and the copies it keeps for ranks on other nodes,
    for the newest three iterations snapshot. A node lost while a snapshot is being copied
    leaves the newest one complete on some survivors and not on others, and the one before it
    may still be arriving at a rank that has not reached the newest; the one before that is
    complete on every rank. Each rank settles (waits for) its copies of a snapshot before it
    posts the next one, and the all-reduce after each snapshot (restart.py: the look for a
    re-plan, at the boundary or on the snapshot's thread after it posted) is passed by no rank
    before every rank posted: so when any rank takes snapshot N+1, every rank
    has settled N-1."""

    KEPT = 3

    def __init__(self) -> None:
        self.own: dict[int, Snapshot] = {}
        self.copies: dict[int, dict[int, Snapshot]] = {}
        # What every rank's snapshot holds (boxes, dtypes), the same at every iteration of
        # one plan: exchanged at the first snapshot under each plan (None: not yet).
        self.layouts: list | None = None
        self._receive_sizes: dict[int, dict[str, int]] = {}  # elements per dtype each peer sends
        # The copies under way (their transfers overlap the next iteration): (works, iteration,
        # the receive buffers by sender, the senders' headers).
        self.in_flight: tuple | None = None
        # The buffers of the generation dropped last, its own and its copies' by sender: the
        # next snapshot is taken, and the next copies received, into them (``recycled``).
        self._spare_own: dict[str, torch.Tensor] | None = None
        self._spare_copies: dict[int, dict[str, torch.Tensor]] = {}

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
            # A dropped generation's transfers ended long ago (each rank settles a
            # generation's copies before it posts the next): its memory can be reused.
            self._spare_own = self.own.pop(old).packed
            self._spare_copies = {peer: copy.packed for peer, copy in self.copies.pop(old, {}).items()
                                  if copy.packed is not None}

    def recycled(self) -> dict[str, torch.Tensor] | None:
        """The buffers of this rank's own snapshot dropped last, for the next one to be taken
        into (given out once): a snapshot every iteration would otherwise fault in fresh
        memory for each, page by page, which cost 80% of a take on a CPU."""
        spare, self._spare_own = self._spare_own, None
        return spare

    def clear(self) -> None:
        self.own.clear()
        self.copies.clear()
        self._spare_own, self._spare_copies = None, {}

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
            self.copies[iteration] = {
                peer: Snapshot(iteration, peer, headers[peer]["host"],
                               unpack(buffers, headers[peer]["boxes"], headers[peer]["dtypes"]),
                               self.own[iteration].common, buffers, self.own[iteration].without_twins)
                for peer, buffers in received.items()}

    def abandon(self) -> None:
        """Drops the copies under way (a peer was lost: they may never complete)."""
        self.in_flight = None

    def replicate(self, send_to: list[int], receive_from: list[int], group=None) -> None:
        """Sends this rank's newest snapshot to ``send_to`` and receives the snapshots of
        ``receive_from`` (every rank calls this with lists that pair up), without waiting: the
        transfers overlap the next iteration, and the copies count once they all arrived
        (``settle``; a half-received generation is no copy at all). The pieces go packed, one
        point-to-point message per dtype; what they are (boxes, dtypes) is exchanged once per plan."""
        self.settle()  # the previous generation's copies first: one generation under way at a time
        own = self.own[self.newest]
        boxes = list(own.pieces)  # in the packed buffers' order
        if self.layouts is None:  # the first snapshot under this plan (every rank alike)
            header = {"host": own.host, "boxes": boxes, "dtypes": [str(own.pieces[b].dtype) for b in boxes]}
            self.layouts = [None] * dist.get_world_size(group)
            dist.all_gather_object(self.layouts, header, group=group)
            self._receive_sizes = {}
        headers = self.layouts
        packed = own.packed if own.packed is not None else pack(own.pieces, boxes)
        ops = []
        received: dict[int, dict[str, torch.Tensor]] = {}
        for peer in send_to:  # one message per dtype
            ops += [dist.P2POp(dist.isend, packed[dtype], peer, group) for dtype in sorted(packed)]
        for peer in receive_from:
            if peer not in self._receive_sizes:  # what a peer sends is the same all plan long
                sizes: dict[str, int] = {}
                for box, dtype in zip(headers[peer]["boxes"], headers[peer]["dtypes"]):
                    sizes[dtype] = sizes.get(dtype, 0) + box.numel
                self._receive_sizes[peer] = sizes
            sizes, spare = self._receive_sizes[peer], self._spare_copies.pop(peer, {})
            received[peer] = {dtype: buffer_from(spare, _dtype(dtype), sizes[dtype]) for dtype in sorted(sizes)}
            ops += [dist.P2POp(dist.irecv, received[peer][dtype], peer, group) for dtype in sorted(sizes)]
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
