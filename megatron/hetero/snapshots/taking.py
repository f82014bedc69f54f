"""Taking this rank's snapshot: in full from the checkpoint's state dicts, then from live tensors.

The first snapshot under a plan is taken as a checkpoint's state is built (the model's and the
optimizer's sharded state dicts, megatron-core's own code: keys, factories, boxes), with the
distributed optimizer's state taken where it lives: each rank its own shard, no gather
(patch ``optimizer-state-for-snapshots``). It leaves a recipe: each piece's live source. The
second snapshot is taken both ways and compared on every rank; from the third on, a snapshot
is the recipe's one copy per dtype plus the scheduler and the optimizer's param groups, with no
state dict built. Any difference, or an optimizer state that is not a slice of its flat
shards, and snapshots stay in full (gathered, when needed) for the rest of the plan.

The model's weights are not kept beside the optimizer's main parameters that hold them (a
restore casts those to the model's dtype, as the optimizer's step does): with fp32 weights, the
rank that kept each stage's weights copied twice what the others did. The first take checks,
on every rank, that the live weights equal the main parameters it took; where they do not, it is
taken again with both, and so are the plan's later ones.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from megatron.hetero.agreement import every_rank
from megatron.hetero.log import print_rank_0
from megatron.hetero.patches import snapshot_in_progress
from megatron.hetero.snapshots.pieces import NotPerRank, Recipe, Snapshot, take, twins_agree


class SnapshotTaker:
    """One plan's way of taking this rank's snapshots (module docstring); every rank decides alike."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.per_rank: bool | None = None  # each rank its own optimizer shard (None: not yet known)
        self.recipe: Recipe | None = None
        self.recipe_checked = False
        self.template: dict | None = None  # the common state's structure, from the first snapshot
        # Model tensors left out where the optimizer's main parameters hold them (None: not yet known).
        self.without_twins: bool | None = None

    def take(self, iteration: int, model, optimizer, scheduler,
             into: dict[str, torch.Tensor] | None = None) -> Snapshot:
        """This rank's snapshot; from the live tensors (once the recipe is checked) into the
        buffers ``into``, where they fit (a dropped generation's: SnapshotStore.recycled)."""
        if self.live:
            return self.retake(iteration, optimizer, scheduler, into)
        if self.per_rank is None:
            try:
                taken, recipe, sharded = self.in_full(iteration, model, optimizer, scheduler, per_rank=True)
            except NotPerRank as err:
                taken = err
            self.per_rank = every_rank(not isinstance(taken, NotPerRank))
            if not self.per_rank:
                print_rank_0(f"> in-process restart: each snapshot gathers the optimizer state ({taken})")
                taken, recipe, sharded = self.in_full(iteration, model, optimizer, scheduler, per_rank=False)
            # A model tensor that the optimizer's main parameter holds is not kept twice, once
            # every rank found the two equal (each its own shard); else it is taken again with both.
            self.without_twins = every_rank(twins_agree(sharded, taken))
            if not self.without_twins:
                taken, recipe, _ = self.in_full(iteration, model, optimizer, scheduler, per_rank=self.per_rank)
        else:
            taken, recipe, _ = self.in_full(iteration, model, optimizer, scheduler, per_rank=self.per_rank)
        if self.template is None:
            # Only the distributed optimizer's param groups can be rebuilt without its tensors,
            # and a gathered state is no live tensor.
            self.recipe = recipe if self.args.use_distributed_optimizer and self.per_rank else None
            self.template = taken.common
        elif self.recipe is not None:
            same = _same_snapshot(self.retake(iteration, optimizer, scheduler), taken)
            self.recipe_checked = True
            if not every_rank(same):
                self.recipe = None
                print_rank_0("> in-process restart: a snapshot taken from the live tensors differed from one "
                             "taken in full; snapshots are taken in full")
        return taken

    def in_full(self, iteration: int, model, optimizer, scheduler,
                per_rank: bool) -> tuple[Snapshot, Recipe, dict]:
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
        from megatron.hetero.checkpointing import state_for_memory

        with snapshot_in_progress(per_rank) as own_shards:
            state = state_for_memory(model, optimizer, scheduler, self.args, loading=False)
            sharded, common = save_preprocess(state, validate_access_integrity=False)
            without_twins = self.without_twins is not False  # tried first, then checked
            return (*take(sharded, common, iteration, own_shards, without_twins), sharded)

    @property
    def live(self) -> bool:
        """Takes come straight from the live tensors now: no state dict, no collective."""
        return self.recipe is not None and self.recipe_checked

    def common(self, optimizer, scheduler) -> dict:
        """The common state as it is now (scheduler, param groups, step): what a take from the
        live tensors takes besides them, and what changes at the step the tensors change at."""
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
        from megatron.hetero.checkpointing import common_state_for_memory

        with snapshot_in_progress(parameter_state=False):
            _, fresh = save_preprocess(common_state_for_memory(optimizer, scheduler, self.args),
                                       validate_access_integrity=False)
        return _refreshed(self.template, fresh)

    def retake(self, iteration: int, optimizer, scheduler,
               into: dict[str, torch.Tensor] | None = None) -> Snapshot:
        return self.recipe.take(iteration, self.common(optimizer, scheduler), dist.get_rank(), into)


def _refreshed(template, fresh):
    """The template's structure with fresh's values (fresh may hold more: empty containers
    where the template's tensors were)."""
    if isinstance(template, dict):
        return {key: _refreshed(value, fresh[key]) if key in fresh else value for key, value in template.items()}
    if isinstance(template, list) and isinstance(fresh, list) and len(template) == len(fresh):
        return [_refreshed(a, b) for a, b in zip(template, fresh)]
    return fresh


def _same_snapshot(a: Snapshot, b: Snapshot) -> bool:
    return (list(a.pieces) == list(b.pieces) and all(torch.equal(a.pieces[box], b.pieces[box]) for box in a.pieces)
            and _same(a.common, b.common))


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    return a == b

