"""Checkpoints: Megatron-LM's layout, megatron-core's distributed format, atomic, re-shardable.

    DIR/latest_checkpointed_iteration.txt     the last complete checkpoint's iteration
    DIR/iter_0000010/                         megatron-core dist checkpoint (torch_dist)
    DIR/iter_0000010/hetero_plan.json         the plan that wrote it

Tensors are saved by global name and offset (megatron-core ShardedTensors), so a
checkpoint loads under any other plan: another stage split, other TP/PP/DP degrees, rank
order or micro-batch split. That is what one needs after a node dies: re-plan on the
survivors and continue.

Atomic: every rank writes into iter_N.tmp; once all have finished, rank 0 writes the
manifest (every file's size and checksum), renames the directory to iter_N and then
replaces the tracker file. A crash at any point leaves the tracker naming a complete
checkpoint; a leftover .tmp directory is never read and is removed by the next save. A
save that fails on any rank (a full or read-only disk) fails on every rank with the
reason, before anything is renamed. At --load the manifest is checked, so a truncated or
corrupted file is named instead of failing deep inside torch; --ckpt-step N loads an
older iteration. With --async-save the tensors are written in the background and the
manifest, rename and tracker update run as the save's finalization, once every rank's
write has completed.

Megatron-LM's checkpoint flags are passed on to megatron-core: --ckpt-fully-parallel-save
(the default; --no-ckpt-fully-parallel-save turns it off) and --ckpt-fully-parallel-load
spread the replicated tensors over the data-parallel ranks, --dist-ckpt-strictness says
what loading does with keys only one side has.
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

from hetero import events
from hetero.errors import HeteroError
from hetero.spec.model import ModelSpec
from hetero.io import write_json_atomic
from hetero.plan import Plan
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model
from megatron.hetero.checkpoint_manifest import (
    complete_iterations,
    fsync_tree,
    verify_manifest,
    write_manifest,
)
from megatron.hetero import stage_tensor_parallel
from megatron.hetero.log import print_rank_0

TRACKER = "latest_checkpointed_iteration.txt"
# Each parameter's optimizer state stored as a slice of the whole parameter: loads under
# any TP/PP/DP layout (and without the distributed optimizer).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
# Every decoder layer under its own keys (decoder.layers.<i>.*), not stacked along a layer
# axis: one stacked tensor would be cut by each stage's tensor-parallel degree, which
# megatron-core's regular sharding grid cannot describe when stages differ (plan version 3).
# Per-layer keys hold one stage's shards each, so any plan loads any other's checkpoint.
MODEL_SHARDING = {"singleton_local_shards": True}


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


def _iteration_to_load(root: str, ckpt_step: int | None) -> int | None:
    """--ckpt-step N, or the tracker's iteration."""
    if ckpt_step is None:
        return latest_iteration(root)
    if not (iteration_dir(root, ckpt_step) / "metadata.json").exists():
        complete = complete_iterations(Path(root))
        raise HeteroError(f"--ckpt-step {ckpt_step}: {iteration_dir(root, ckpt_step)} is not a complete "
                          f"checkpoint; complete ones under {root}: {', '.join(map(str, complete)) or 'none'}")
    return ckpt_step


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


def _stage_degrees() -> list[int] | None:
    """Each stage's tensor-parallel degree under a per-stage grid, else None."""
    grid = stage_tensor_parallel.active_plan()
    return grid.stage_tensor_parallel if grid else None


def model_shape(args: argparse.Namespace) -> dict:
    """What makes two models the same shape: the ModelSpec the runtime builds (every field,
    Megatron's defaults filled in), and the parameter dtype. A checkpoint of another shape
    is refused."""
    spec = ModelSpec.from_megatron_args(args).to_dict()
    return {**spec, "padded_vocab_size": args.padded_vocab_size, "params_dtype": args.params_dtype}


def _state(model, optimizer, scheduler, *, loading: bool, optimizer_state: bool, rng: bool,
           extra: dict | None = None, model_sharding: dict = MODEL_SHARDING) -> dict:
    # The bare GPTModel: names must not depend on the DDP / mixed-precision wrappers.
    model_state = unwrap_model(model).sharded_state_dict(metadata=model_sharding)
    state = {"model": model_state, "opt_param_scheduler": scheduler.state_dict(), **(extra or {})}
    if optimizer_state:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=loading,
                                                          metadata=OPTIMIZER_SHARDING)
    if rng:
        sizes, ranks = _layout()
        if stage_tensor_parallel.active_plan() is not None:  # no (pp, tp, dp) box: one per rank
            sizes, ranks = (dist.get_world_size(),), (dist.get_rank(),)
        state["rng_state"] = ShardedObject("rng_state", _rng_state(), sizes, ranks, replica_id=0)
    return state if loading else stage_tensor_parallel.drop_tied_copy_for_save(state)


def _failures_everywhere(failure: str | None, what: str) -> None:
    """Every rank learns whether any rank failed (one collective), and all raise together,
    naming the first failing rank; no rank is left waiting in the next collective."""
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    for rank, message in enumerate(failures):
        if message:
            raise HeteroError(f"{what} failed on rank {rank}: {message}")


def _describe(err: BaseException, root: str | None = None) -> str:
    text = str(err).strip().splitlines()[-1][:300] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}{_disk_state(root) if root else ''}"


def _disk_state(root: str) -> str:
    """What the disk says, since torch's writer reports a full disk as a zip-format error."""
    path = Path(root)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return ""
    if stats.f_flag & os.ST_RDONLY:
        return f" [{path} is on a read-only file system]"
    free = stats.f_bavail * stats.f_frsize
    if free < 64 * 1024 * 1024:
        return f" [No space left on device: {free / 2**20:.1f} MiB free at {path}]"
    return ""


def _prepare_staging(root: str, staging: Path) -> None:
    Path(root).mkdir(parents=True, exist_ok=True)
    for stale in Path(root).glob("iter_*.tmp"):  # from a save that never finished
        shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir()


def _publish(root: str, iteration: int, staging: Path, final: Path, plan: Plan) -> None:
    """Rank 0, once every rank's data is in staging: manifest, rename, then the tracker."""
    write_json_atomic(staging / "hetero_plan.json", plan.to_dict())
    write_manifest(staging)
    fsync_tree(staging)
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


def _rank_0_step(step, what: str, root: str | None = None) -> None:
    failure = None
    if dist.get_rank() == 0:
        try:
            step()
        except Exception as err:
            failure = _describe(err, root)
    _failures_everywhere(failure, what)
# Background checkpoint writes (--async-save); created at the first one.
_ASYNC_SAVES: AsyncCallsQueue | None = None


def finalize_pending_saves(blocking: bool = True) -> None:
    """Completes background saves (rename + tracker); blocking waits for all of them. A
    collective: every rank calls it at the same points."""
    if _ASYNC_SAVES is None:
        return
    if blocking and _ASYNC_SAVES.get_num_unfinalized_calls():
        print_rank_0("Unfinalized async checkpoint saves. Finalizing them synchronously now.")
    _ASYNC_SAVES.maybe_finalize_async_calls(blocking=blocking)
    if blocking:
        _ASYNC_SAVES.close()


def _save_strategy(args: argparse.Namespace):
    strategy = get_default_save_sharded_strategy("torch_dist")
    if args.ckpt_fully_parallel_save:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    return strategy


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler,
                    args: argparse.Namespace, plan: Plan) -> float:
    """Writes iteration's checkpoint atomically; returns the seconds it took (until the
    background write started, with --async-save). A failure on any rank is a HeteroError
    on every rank; the previous checkpoint stays current."""
    global _ASYNC_SAVES
    start = time.perf_counter()
    final, staging = iteration_dir(root, iteration), Path(f"{iteration_dir(root, iteration)}.tmp")
    if args.async_save:
        finalize_pending_saves(blocking=False)
        if _ASYNC_SAVES is not None and _ASYNC_SAVES.get_num_unfinalized_calls():
            # One save in flight at a time: the next one may remove stale .tmp directories.
            _ASYNC_SAVES.maybe_finalize_async_calls(blocking=True)
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {root} in torch_dist format")
    previous = latest_iteration(root) if Path(root).is_dir() else None
    kept = (f"the checkpoint of iteration {previous} and {TRACKER} are untouched" if previous is not None
            else "no earlier checkpoint exists")
    what = f"saving the checkpoint of iteration {iteration} to {root} ({kept}; free space or fix " \
           f"permissions there, or --save elsewhere)"
    _rank_0_step(lambda: _prepare_staging(root, staging), what, root)
    sizes, _ = _layout()
    state = _state(model, optimizer, scheduler, loading=False, optimizer_state=True, rng=True, extra={
        "iteration": iteration,
        "checkpoint_version": 3.0,
        "hetero": {"model_shape": model_shape(args), "layout": list(sizes),
                   "stage_tensor_parallel": _stage_degrees(), "layer_keys": "per-layer", "plan": plan.to_dict(),
                   "distributed_optimizer": bool(args.use_distributed_optimizer)},
    })
    try:
        request = dist_checkpointing.save(state, str(staging), _save_strategy(args),
                                          async_sharded_save=args.async_save)
    except Exception as err:
        # Not always raised on every rank (the coordinator writes some files alone, while
        # the others wait in megatron-core's gather): the caller publishes it to the job.
        raise HeteroError(f"{what} failed on rank {dist.get_rank()}: {_describe(err, root)}") from None
    layout = f"[ t {sizes[1]}, p {sizes[0]}, d {sizes[2]} ]"

    def publish() -> None:
        """After every rank's write: manifest, rename iter_N.tmp -> iter_N, then the tracker."""
        _rank_0_step(lambda: _publish(root, iteration, staging, final, plan), what, root)
        print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {root} {layout}")
        if dist.get_rank() == 0:
            events.emit(events.CheckpointSaved(iteration=iteration, directory=str(root)))

    if args.async_save:
        request.add_finalize_fn(publish)
        if _ASYNC_SAVES is None:
            # megatron-core's persistent writer binds a GPU; without one each save gets its
            # own background writer process (megatron-core's default caller).
            _ASYNC_SAVES = AsyncCallsQueue(
                persistent=args.use_persistent_ckpt_worker and torch.cuda.is_available())
        _ASYNC_SAVES.schedule_async_request(request)
        return time.perf_counter() - start
    dist.barrier()  # every rank's files are written
    publish()
    seconds = time.perf_counter() - start
    print_rank_0(f"  checkpoint of iteration {iteration:7d} written in {seconds:.2f} s")
    return seconds


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_format(root: str, args: argparse.Namespace) -> None:
    """Only megatron-core's distributed format (torch_dist) is read; say so for the legacy
    per-rank torch format (mp_rank_* files) instead of failing inside megatron-core."""
    directory = Path(root)
    legacy = any(directory.glob("iter_*/mp_rank_*")) or any(directory.glob("release/mp_rank_*"))
    if legacy:
        raise HeteroError(
            f"{root} holds a checkpoint in Megatron-LM's legacy torch format (mp_rank_* files); "
            "Megatron-Hetero reads the distributed torch_dist format: convert it with Megatron-LM's "
            "tools/checkpoint (--ckpt-convert-format torch_dist) first")


def load_checkpoint(root: str, model, optimizer, scheduler, args: argparse.Namespace) -> tuple[int, float]:
    """Restores the latest checkpoint under root; (iteration, seconds), or (0, 0) if none.

    Under the same layout everything comes back, RNG included, so training continues as
    if never stopped. Under another layout (re-planned) the tensors are re-sharded; the
    per-rank RNG streams have no counterpart and are left as seeded.
    """
    _check_format(root, args)
    iteration = _iteration_to_load(root, args.ckpt_step)
    if iteration is None:
        print_rank_0(f"WARNING: no checkpoint in {root} ({TRACKER} not found); starting from scratch")
        return 0, 0.0
    start = time.perf_counter()
    directory = iteration_dir(root, iteration)
    older = [i for i in complete_iterations(Path(root)) if i < iteration]
    _rank_0_step(lambda: verify_manifest(directory, iteration, older), "checking the checkpoint")
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
    same_layout = list(sizes) == saved.get("layout") and _stage_degrees() == saved.get("stage_tensor_parallel")
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
    # Checkpoints of earlier releases stack the decoder layers under one key per tensor.
    stacked = saved.get("layer_keys") != "per-layer"
    if stacked and stage_tensor_parallel.active_plan() is not None:
        raise HeteroError(
            f"the checkpoint in {directory} keeps its decoder layers stacked (written by an earlier "
            "release), which a plan whose stages differ in tensor-parallel degree cannot read; resume it "
            "under a plan with one degree, save once, then switch plans")
    state = _state(model, optimizer, scheduler, loading=True, optimizer_state=restore_optimizer,
                   model_sharding={} if stacked else MODEL_SHARDING,
                   rng=restore_rng)
    strategy = get_default_load_sharded_strategy(str(directory))
    if args.ckpt_fully_parallel_load:
        strategy = FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    try:
        # A tied table's last-stage copy is read at its own degree from the first stage's key:
        # two shardings of one key, which megatron-core's tiling check would refuse.
        loaded = dist_checkpointing.load(state, str(directory), strategy, strict=args.dist_ckpt_strictness,
                                         validate_access_integrity=not stage_tensor_parallel.tied_across_degrees())
    except CheckpointingException as err:
        first = str(err).strip().splitlines()[0][:400]
        raise HeteroError(
            f"loading {directory} with --dist-ckpt-strictness {args.dist_ckpt_strictness}: the "
            f"checkpoint and this run do not hold the same tensors ({first} ...); with --no-load-optim, "
            "--finetune or --skip-train the optimizer state is not loaded, which the raise_* modes "
            "count as unexpected: use assume_ok_unexpected (the default) or log_all") from None
    if StrictHandling(args.dist_ckpt_strictness) in (StrictHandling.RETURN_UNEXPECTED,
                                                     StrictHandling.RETURN_ALL):
        loaded, missing, unexpected = loaded
        print_rank_0(f"  checkpoint keys missing from the checkpoint: {sorted(missing) or 'none'}; "
                     f"not used by the model: {sorted(unexpected) or 'none'}")
    unwrap_model(model).load_state_dict(loaded["model"])
    if restore_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()
    if restore_rng:
        _set_rng_state(loaded["rng_state"])
    elif not same_layout:
        theirs_tp, ours_tp = saved.get("stage_tensor_parallel"), _stage_degrees()
        print_rank_0(f"  the checkpoint was written under layout (PP, TP, DP) = {tuple(saved.get('layout', ()))}"
                     + (f", stage TP {theirs_tp}" if theirs_tp else "") + f"; this run is {sizes}"
                     + (f", stage TP {ours_tp}" if ours_tp else "") + ": tensors re-sharded, random streams "
                     "start from --seed")
    seconds = time.perf_counter() - start
    print_rank_0(f"  successfully loaded checkpoint from {root} [ t {sizes[1]}, p {sizes[0]}, "
                 f"d {sizes[2]} ] at iteration {iteration} ({seconds:.2f} s)")
    if dist.get_rank() == 0:
        events.emit(events.CheckpointLoaded(iteration=iteration, directory=str(root)))
    return (0 if args.finetune else iteration), seconds
