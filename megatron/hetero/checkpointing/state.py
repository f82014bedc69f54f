"""The sharded state dict of a checkpoint, laid out as Megatron-LM's generate_state_dict.

The model under "model" ("model0", "model1", ... per virtual stage), "optimizer",
"opt_param_scheduler" and "rng_state", with the content metadata megatron-core's
sharded_state_dict methods are told (per-layer keys, a fully reshardable optimizer state);
this run's parallel layout, the model's shape, and the state a snapshot holds in memory.
Used by the save path (save.py), the load path (load.py) and snapshots (restart.py).
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch
import torch.distributed as dist

from hetero.spec.model import ModelSpec
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model
from megatron.hetero import stage_tensor_parallel, template_reduction
from megatron.hetero.identity import this_rank
from megatron.hetero.moe import fit_optimizer_state

# Each parameter's optimizer state stored as a slice of the whole parameter: loads under
# any TP/PP/DP layout (and without the distributed optimizer).
# chained_optim_avoid_prefix, as Megatron-LM: under expert parallelism the optimizer is two
# chained ones (dense, experts); unprefixed keys let a run with one optimizer load their state.
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
# Every decoder layer under its own keys (decoder.layers.<i>.*), not stacked along a layer
# axis: one stacked tensor would be cut by each stage's tensor-parallel degree, which
# megatron-core's regular sharding grid cannot describe when stages differ (plan version 3).
# Per-layer keys hold one stage's shards each, so any plan loads any other's checkpoint.
MODEL_SHARDING = {"singleton_local_shards": True}
# What megatron-core's sharded_state_dict methods were told, stored in the checkpoint as its
# content metadata: Megatron-LM's load_checkpoint builds its state dict from it, so it reads
# the per-layer keys and the optimizer state as written (its own saves record the same).
CONTENT_METADATA = {**MODEL_SHARDING, "chained_optim_avoid_prefix": True}
# The content-metadata fields that shape the model's / the optimizer's keys.
_MODEL_METADATA_KEYS = ("singleton_local_shards",)
_OPTIMIZER_METADATA_KEYS = ("distrib_optim_sharding_type", "distrib_optim_fully_reshardable_mem_efficient",
                            "chained_optim_avoid_prefix")


def _rng_state() -> dict:
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _rng_sharded_object(saving: bool) -> ShardedObject:
    """Megatron-LM's "rng_state": per (pipeline, tensor) rank a list of the data-parallel
    ranks' states (its --data-parallel-random-init form: replicas that run different numbers
    of micro-batches leave different streams, and each gets its own back). Under a per-stage
    tensor-parallel grid, which has no (pipeline, tensor) box, one object per rank."""
    states = None
    if saving:
        group = parallel_state.get_data_parallel_group()
        states = [None] * dist.get_world_size(group)
        dist.all_gather_object(states, _rng_state(), group=group)
    if stage_tensor_parallel.active_plan() is not None:
        return ShardedObject("rng_state", states, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)
    (pp, tp, _), (pp_rank, tp_rank, _) = _layout()
    # Context ranks of a replica hold the same states: replicas of one another (as Megatron-LM).
    replica = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    return ShardedObject("rng_state", states, (pp, tp), (pp_rank, tp_rank), replica_id=replica)


def _restore_rng(saved_rng) -> None:
    """Megatron-LM's list of data-parallel states (this replica's, else the first), or the
    single state of checkpoints from earlier releases."""
    if isinstance(saved_rng, list):
        rank = parallel_state.get_data_parallel_rank()
        saved_rng = saved_rng[rank] if rank < len(saved_rng) else saved_rng[0]
    _set_rng_state(saved_rng)


def _layout() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """((pp, tp, dp) sizes, this rank's (pp, tp, dp) ranks); tp is the widest stage's
    under a per-stage grid (_stage_degrees says which)."""
    ps = parallel_state
    grid = stage_tensor_parallel.active_plan()
    sizes = (ps.get_pipeline_model_parallel_world_size(),
             grid.max_tensor_parallel if grid else ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    ranks = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
             ps.get_data_parallel_rank())
    return sizes, ranks


def _layout_text(sizes: tuple[int, int, int]) -> str:
    """Megatron-LM's "[ t T, p P, d D ]"; under several templates one bracket per template."""
    shapes = _stage_degrees() if template_reduction.active() else None
    if shapes is None:
        return f"[ t {sizes[1]}, p {sizes[0]}, d {sizes[2]} ]"
    return " ".join(f"[ t {'/'.join(map(str, degrees))}, p {len(degrees)}, d {dp} ]" for degrees, dp in shapes)


def _stage_degrees() -> list | None:
    """Each stage's tensor-parallel degree under a per-stage grid; under several replica
    templates, each template's list of them with its replica count ([[degrees...], dp] per
    template); else None."""
    grid = stage_tensor_parallel.active_plan()
    if grid is None:
        return None
    if grid.num_templates > 1:
        return [[list(t.stage_tensor_parallel), t.data_parallel] for t in grid.templates]
    return grid.stage_tensor_parallel


def _saves_model_state() -> bool:
    """Whether this rank writes model and optimizer state: under several replica templates
    only template 0's ranks do (every template holds every parameter, and the templates' copies
    are equal), so each tensor is written once."""
    return not template_reduction.active() or this_rank().template == 0


def model_shape(args: argparse.Namespace) -> dict:
    """What makes two models the same shape: the ModelSpec the runtime builds (every field,
    Megatron's defaults filled in), and the parameter dtype. A checkpoint of another shape
    is refused."""
    spec = ModelSpec.from_megatron_args(args).to_dict()
    return {**spec, "padded_vocab_size": args.padded_vocab_size, "params_dtype": args.params_dtype}


def model_chunks_of(model) -> list:
    """The model chunks: one per virtual stage of an interleaved run, else one."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def model_keys(num_chunks: int) -> list[str]:
    """Megatron-LM's top-level key of each chunk: "model", or "model0", "model1", ... when an
    interleaved run holds several (its generate_state_dict)."""
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def _state(model, optimizer, scheduler, *, loading: bool, optimizer_state: bool, rng: bool | str,
           extra: dict | None = None, metadata: dict = CONTENT_METADATA, every_template: bool = False) -> dict:
    """The sharded state dict, laid out as Megatron-LM's generate_state_dict lays it out;
    metadata is the content metadata the checkpoint was (or is being) written with. rng is
    False, True (Megatron-LM's form) or "per-rank-dict" (the form of earlier releases)."""
    chunks = model_chunks_of(model)
    model_metadata = {k: metadata[k] for k in _MODEL_METADATA_KEYS if k in metadata}
    # The bare GPTModel: names must not depend on the DDP / mixed-precision wrappers.
    # Virtual stages name their layers by global layer number, so any split reads them.
    saving_here = loading or every_template or _saves_model_state()
    models = {key: unwrap_model(chunk).sharded_state_dict(metadata=model_metadata)
              for key, chunk in zip(model_keys(len(chunks)), chunks)} if saving_here else {}
    state = {**models, "opt_param_scheduler": scheduler.state_dict(), **(extra or {})}
    if optimizer_state and saving_here:
        optimizer_metadata = {k: metadata[k] for k in _OPTIMIZER_METADATA_KEYS if k in metadata}
        state["optimizer"] = optimizer.sharded_state_dict(models, is_loading=loading, metadata=optimizer_metadata)
    if rng == "per-rank-dict":
        sizes, ranks = _layout()
        if stage_tensor_parallel.active_plan() is not None:  # no (pp, tp, dp) box: one per rank
            sizes, ranks = (dist.get_world_size(),), (dist.get_rank(),)
        state["rng_state"] = ShardedObject("rng_state", None, sizes, ranks, replica_id=0)
    elif rng:
        state["rng_state"] = _rng_sharded_object(saving=not loading)
    return state if loading else stage_tensor_parallel.drop_tied_copy_for_save(state)


def _content_metadata(args: argparse.Namespace) -> dict:
    if not args.use_distributed_optimizer:
        return dict(CONTENT_METADATA)
    return {**CONTENT_METADATA, **OPTIMIZER_SHARDING, "distrib_optim_fully_reshardable_mem_efficient": False}



# Megatron-LM's running count, which this runtime does not keep: carried from the loaded
# checkpoint to the next save unchanged, so a run that goes back to Megatron-LM keeps it.
_carried = {"num_floating_point_operations_so_far": 0.0}


def floating_point_operations_so_far() -> float:
    """The loaded checkpoint's count (0 without one)."""
    return _carried["num_floating_point_operations_so_far"]


def apply_loaded(loaded: dict, model, optimizer, scheduler, restore_optimizer: bool = True) -> None:
    """A loaded state (a checkpoint's or a snapshot's: hetero's sharded state dict, filled)
    into the model chunks, the optimizer and the scheduler."""
    chunks = model_chunks_of(model)
    for key, chunk in zip(model_keys(len(chunks)), chunks):
        unwrap_model(chunk).load_state_dict(loaded[key])
    if restore_optimizer:
        saved_optimizer = loaded["optimizer"]
        # its param groups fitted to this run's chaining (moe.py), or a clear refusal
        saved_optimizer = fit_optimizer_state(saved_optimizer, optimizer)
        optimizer.load_state_dict(saved_optimizer)
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()


def common_state_for_memory(optimizer, scheduler, args: argparse.Namespace) -> dict:
    """The parts of state_for_memory's state that are not tensors and change as training goes:
    the scheduler, and the distributed optimizer's param groups and step (its state dict
    without the parameter state, which patches.snapshot_in_progress(parameter_state=False)
    leaves out). What a snapshot taken again from live tensors (snapshots.Recipe) takes afresh."""
    metadata = _content_metadata(args)
    optimizer_metadata = {k: metadata[k] for k in _OPTIMIZER_METADATA_KEYS if k in metadata}
    return {"opt_param_scheduler": scheduler.state_dict(),
            "optimizer": optimizer.sharded_state_dict({}, is_loading=False, metadata=optimizer_metadata)}


def state_for_memory(model, optimizer, scheduler, args: argparse.Namespace, loading: bool) -> dict:
    """The sharded state a snapshot holds (snapshots/): the checkpoint's model, optimizer
    (fully reshardable) and scheduler, of every template; no RNG (a restore re-plans)."""
    return _state(model, optimizer, scheduler, loading=loading, optimizer_state=True, rng=False,
                  metadata=_content_metadata(args), every_template=True)
