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

from megatron.hetero.snapshots.pieces import (Box, NotPerRank, Recipe, Snapshot, box_of, flat_range_boxes,
                                              own_shard_pieces, take)
from megatron.hetero.snapshots.restore import LostState, Transfer, plan_transfers, restore
from megatron.hetero.snapshots.store import SnapshotStore

__all__ = ["Box", "LostState", "NotPerRank", "Recipe", "Snapshot", "SnapshotStore", "Transfer", "box_of", "flat_range_boxes",
           "own_shard_pieces", "plan_transfers", "restore", "take"]
