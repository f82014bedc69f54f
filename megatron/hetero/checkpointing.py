"""Checkpoints: Megatron-LM's layout, megatron-core's distributed format, atomic, re-shardable.

    DIR/latest_checkpointed_iteration.txt     the last complete checkpoint's iteration
    DIR/iter_0000010/                         megatron-core dist checkpoint (torch_dist)
    DIR/iter_0000010/hetero_plan.json         the plan that wrote it

Tensors are saved by global name and offset (megatron-core ShardedTensors), so a
checkpoint loads under any other plan: another stage split, other TP/PP/DP degrees, rank
order or micro-batch split. That is what one needs after a node dies: re-plan on the
survivors and continue.

Atomic: every rank writes into iter_N.tmp; once all have finished, rank 0 renames it to
iter_N and then replaces the tracker file. A crash at any point leaves the tracker naming
a complete checkpoint; a leftover .tmp directory is never read and is removed by the next
save.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hetero.errors import HeteroError
from hetero.model import ModelSpec
from hetero.plan import Plan, write_json_atomic
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model
from megatron.hetero.log import print_rank_0

TRACKER = "latest_checkpointed_iteration.txt"
# Each parameter's optimizer state stored as a slice of the whole parameter: loads under
# any TP/PP/DP layout (and without the distributed optimizer).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | os.PathLike) -> int | None:
    """The iteration of the last complete checkpoint under root, or None if there is none."""
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise HeteroError(f"{tracker} should hold an iteration number, found {text!r}") from None
    if not (iteration_dir(root, iteration) / "metadata.json").exists():
        raise HeteroError(
            f"{tracker} names iteration {iteration} but {iteration_dir(root, iteration)} is not a "
            "complete checkpoint; restore it or point --load at another directory"
        )
    return iteration


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


def _layout() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """((pp, tp, dp) sizes, this rank's (pp, tp, dp) ranks)."""
    ps = parallel_state
    sizes = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    ranks = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
             ps.get_data_parallel_rank())
    return sizes, ranks


def model_shape(args: argparse.Namespace) -> dict:
    """What makes two models the same shape: the ModelSpec the runtime builds (every field,
    Megatron's defaults filled in), and the parameter dtype. A checkpoint of another shape
    is refused."""
    spec = ModelSpec.from_megatron_args(args).to_dict()
    return {**spec, "padded_vocab_size": args.padded_vocab_size, "params_dtype": args.params_dtype}


def _state(model, optimizer, scheduler, *, loading: bool, optimizer_state: bool, rng: bool,
           extra: dict | None = None) -> dict:
    # The bare GPTModel: names must not depend on the DDP / mixed-precision wrappers.
    model_state = unwrap_model(model).sharded_state_dict()
    state = {"model": model_state, "opt_param_scheduler": scheduler.state_dict(), **(extra or {})}
    if optimizer_state:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=loading,
                                                          metadata=OPTIMIZER_SHARDING)
    if rng:
        sizes, ranks = _layout()
        state["rng_state"] = ShardedObject("rng_state", _rng_state(), sizes, ranks, replica_id=0)
    return state


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler,
                    args: argparse.Namespace, plan: Plan) -> float:
    """Writes iteration's checkpoint atomically; returns the seconds it took."""
    start = time.perf_counter()
    final, staging = iteration_dir(root, iteration), Path(f"{iteration_dir(root, iteration)}.tmp")
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {root} in torch_dist format")
    if dist.get_rank() == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        for stale in Path(root).glob("iter_*.tmp"):  # from a save that never finished
            shutil.rmtree(stale, ignore_errors=True)
        staging.mkdir()
    dist.barrier()
    sizes, _ = _layout()
    state = _state(model, optimizer, scheduler, loading=False, optimizer_state=True, rng=True, extra={
        "iteration": iteration,
        "checkpoint_version": 3.0,
        "hetero": {"model_shape": model_shape(args), "layout": list(sizes), "plan": plan.to_dict(),
                   "distributed_optimizer": bool(args.use_distributed_optimizer)},
    })
    dist_checkpointing.save(state, str(staging))
    dist.barrier()
    if dist.get_rank() == 0:
        write_json_atomic(staging / "hetero_plan.json", plan.to_dict())
        if final.exists():  # saving the same iteration again: the new one wins
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(Path(root))
        tracker = Path(root) / TRACKER
        tmp = tracker.with_name(f".{TRACKER}.tmp")
        tmp.write_text(f"{iteration}\n")
        with open(tmp) as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, tracker)
        _fsync_dir(Path(root))
    dist.barrier()
    seconds = time.perf_counter() - start
    print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {root} "
                 f"[ t {sizes[1]}, p {sizes[0]}, d {sizes[2]} ] ({seconds:.2f} s)")
    return seconds


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(root: str, model, optimizer, scheduler, args: argparse.Namespace) -> tuple[int, float]:
    """Restores the latest checkpoint under root; (iteration, seconds), or (0, 0) if none.

    Under the same layout everything comes back, RNG included, so training continues as
    if never stopped. Under another layout (re-planned) the tensors are re-sharded; the
    per-rank RNG streams have no counterpart and are left as seeded.
    """
    iteration = latest_iteration(root)
    if iteration is None:
        print_rank_0(f"WARNING: no checkpoint in {root} ({TRACKER} not found); starting from scratch")
        return 0, 0.0
    start = time.perf_counter()
    directory = iteration_dir(root, iteration)
    common = dist_checkpointing.load_common_state_dict(str(directory))
    saved = common.get("hetero", {})
    theirs, ours = saved.get("model_shape", {}), model_shape(args)
    different = [f"{k}: checkpoint {theirs.get(k)!r}, this run {ours[k]!r}"
                 for k in ours if k in theirs and theirs[k] != ours[k]]
    if different:
        raise HeteroError(
            f"the checkpoint in {directory} is of another model ({'; '.join(different)}); load it "
            "with the flags it was written with, or point --load at a checkpoint of this model"
        )
    sizes, _ = _layout()
    same_layout = list(sizes) == saved.get("layout")
    restore_rng = same_layout and not args.no_load_rng and not args.finetune
    restore_optimizer = not args.no_load_optim and not args.finetune
    saved_sharded = saved.get("distributed_optimizer")
    if restore_optimizer and saved_sharded is not None and saved_sharded != bool(args.use_distributed_optimizer):
        written = "with" if saved_sharded else "without"
        raise HeteroError(
            f"the checkpoint in {directory} was written {written} the distributed optimizer, whose "
            f"optimizer state has another form; resume {written} --use-distributed-optimizer "
            "(a plan from hetero-plan chooses it), or pass --no-load-optim to load the weights only"
        )
    print_rank_0(f" loading checkpoint from {root} at iteration {iteration}")
    state = _state(model, optimizer, scheduler, loading=True, optimizer_state=restore_optimizer,
                   rng=restore_rng)
    loaded = dist_checkpointing.load(state, str(directory))
    unwrap_model(model).load_state_dict(loaded["model"])
    if restore_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()
    if restore_rng:
        _set_rng_state(loaded["rng_state"])
    elif not same_layout:
        print_rank_0(f"  the checkpoint was written under layout (PP, TP, DP) = {tuple(saved.get('layout', ()))}; "
                     f"this run is {sizes}: tensors re-sharded, random streams start from --seed")
    seconds = time.perf_counter() - start
    print_rank_0(f"  successfully loaded checkpoint from {root} [ t {sizes[1]}, p {sizes[0]}, "
                 f"d {sizes[2]} ] at iteration {iteration} ({seconds:.2f} s)")
    return (0 if args.finetune else iteration), seconds
