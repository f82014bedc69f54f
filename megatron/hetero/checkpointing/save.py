"""Saving a checkpoint: atomic, with megatron-core's (a)synchronous writers.

Every rank writes into iter_N.tmp; once all have finished, rank 0 writes the manifest
(every file's size and checksum), renames the directory to iter_N and then replaces the
tracker file. A crash at any point leaves the tracker naming a complete checkpoint; a
leftover .tmp directory is never read and is removed by the next save. A save that fails
on any rank (a full or read-only disk) fails on every rank with the reason, before anything
is renamed. With --async-save the tensors are written in the background and the manifest,
rename and tracker update run as the save's finalization, once every rank's write has
completed. --ckpt-format torch writes Megatron-LM's legacy per-rank files (legacy.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hetero import env, events
from hetero.errors import HeteroError
from hetero.io import write_json_atomic
from hetero.plan import Plan
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.hetero.batch_schedule import BatchSchedule
from megatron.hetero.checkpointing import legacy as checkpoint_legacy
from megatron.hetero.checkpointing.manifest import (
    TRACKER,
    fsync_tree,
    iteration_dir,
    latest_iteration,
    write_manifest,
)
from megatron.hetero.checkpointing.state import (
    _carried,
    _content_metadata,
    _layout,
    _layout_text,
    _rng_state,
    _stage_degrees,
    _state,
    model_chunks_of,
    model_keys,
    model_shape,
)
from megatron.hetero.core_compat import async_save_options, write_common_beside
from megatron.hetero.log import print_rank_0


def _megatron_args(args: argparse.Namespace, plan: Plan, iteration: int) -> argparse.Namespace:
    """The run's arguments as Megatron-LM stores them under "args": its names, the parallel
    sizes it reads back (tensor/pipeline sizes decide whether it restores the RNG), the
    parameter dtype as a torch dtype, and the samples consumed so far, from which Megatron-LM
    resumes its data (here the iteration decides it)."""
    stored = argparse.Namespace(**vars(args))
    sizes, _ = _layout()
    stored.pipeline_model_parallel_size, stored.tensor_model_parallel_size = sizes[0], sizes[1]
    stored.data_parallel_size, stored.world_size = sizes[2], dist.get_world_size()
    stored.params_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.params_dtype, torch.float32)
    stored.use_dist_ckpt = args.ckpt_format != "torch"
    if _stage_degrees() is not None:
        # One RNG object per rank, not Megatron-LM's (pipeline, tensor) box it would ask for:
        # recorded as its --no-save-rng, so that Megatron-LM skips them instead of failing.
        stored.no_save_rng = True
    stored.consumed_train_samples = BatchSchedule(plan, args.rampup_batch_size).consumed_samples(iteration)
    stored.skipped_train_samples = 0
    evaluations = iteration // args.eval_interval if args.eval_interval else 0
    stored.consumed_valid_samples = evaluations * args.eval_iters * plan.global_batch_size
    return stored




def _failures_everywhere(failure: str | None, what: str) -> None:
    """Every rank learns whether any rank failed (one collective), and all raise together,
    naming the first failing rank; no rank is left waiting in the next collective."""
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    for rank, message in enumerate(failures):
        if message:
            raise HeteroError(f"{what} failed on rank {rank}: {message}")


# What gloo, NCCL and torch's process groups say when the other end of a collective is gone.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
              "gloo", "NCCL", "ProcessGroup", "Socket Timeout", "timed out")


def _lost_peer_error(err: BaseException) -> RuntimeError | None:
    """The communication error behind a failed save, if it is one: a torch.distributed error
    or a RuntimeError in gloo's/NCCL's words, raised here or by any rank's write (torch's
    CheckpointException carries each failed rank's). A full or read-only disk is an OSError,
    or a RuntimeError of torch's file writer that names no peer."""
    found: list[BaseException] = []
    pending: list[BaseException] = [err]
    while pending and len(found) < 32:
        error = pending.pop()
        found.append(error)
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():  # rank -> (exception, traceback)
                failure = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(failure, BaseException):
                    pending.append(failure)
        pending += [e for e in (error.__cause__, error.__context__) if e is not None and e not in found]
    for error in found:
        if isinstance(error, dist.DistError) or (
                isinstance(error, RuntimeError) and not isinstance(error, OSError)
                and any(marker in str(error) for marker in _PEER_GONE)):
            return error
    return None


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
    write_common_beside(staging)  # megatron-core 0.17+: readable by a 0.16 runtime too
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


# --ckpt-assume-constant-structure: the strategy of the first save, kept with the sharding
# plan it worked out, so later saves skip that planning and its validation (Megatron-LM's hint).
_CONSTANT_STRUCTURE_STRATEGY = None


def _save_strategy(args: argparse.Namespace):
    global _CONSTANT_STRUCTURE_STRATEGY
    if args.ckpt_assume_constant_structure and _CONSTANT_STRUCTURE_STRATEGY is not None:
        return _CONSTANT_STRUCTURE_STRATEGY
    strategy = get_default_save_sharded_strategy("torch_dist")
    if args.ckpt_assume_constant_structure:
        strategy.use_cached_ckpt_structure = True
    if args.ckpt_fully_parallel_save:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True),
            args.ckpt_assume_constant_structure)
    if args.ckpt_assume_constant_structure:
        _CONSTANT_STRUCTURE_STRATEGY = strategy
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
    legacy = args.ckpt_format == "torch"
    background = args.async_save and not legacy  # as Megatron-LM, the torch format is written in the foreground
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {root} in {args.ckpt_format} format")
    previous = latest_iteration(root) if Path(root).is_dir() else None
    kept = (f"the checkpoint of iteration {previous} and {TRACKER} are untouched" if previous is not None
            else "no earlier checkpoint exists")
    what = f"saving the checkpoint of iteration {iteration} to {root} ({kept}; free space or fix " \
           f"permissions there, or --save elsewhere)"
    _rank_0_step(lambda: _prepare_staging(root, staging), what, root)
    sizes, _ = _layout()
    metadata = _content_metadata(args)
    common = {
        "args": _megatron_args(args, plan, iteration),
        "iteration": iteration,
        "checkpoint_version": 3.0,
        "num_floating_point_operations_so_far": _carried["num_floating_point_operations_so_far"],
        "hetero": {"model_shape": model_shape(args), "layout": list(sizes),
                   "stage_tensor_parallel": _stage_degrees(), "layer_keys": "per-layer", "plan": plan.to_dict(),
                   "distributed_optimizer": bool(args.use_distributed_optimizer),
                   # --no-save-rng / --no-save-optim: Megatron-LM's checkpoints without them.
                   "rng_form": None if args.no_save_rng else "megatron-lm",
                   "optimizer_saved": not args.no_save_optim},
    }
    request = None
    try:
        if legacy:
            chunks = model_chunks_of(model)
            checkpoint_legacy.save(staging, chunks, model_keys(len(chunks)), optimizer, scheduler, common,
                                   _rng_state(), bool(args.use_distributed_optimizer),
                                   save_optimizer=not args.no_save_optim, save_rng=not args.no_save_rng)
        else:
            state = _state(model, optimizer, scheduler, loading=False, optimizer_state=not args.no_save_optim,
                           rng=not args.no_save_rng, metadata=metadata, extra=common)
            validate = not (args.ckpt_assume_constant_structure and _CONSTANT_STRUCTURE_STRATEGY is not None)
            request = dist_checkpointing.save(state, str(staging), _save_strategy(args),
                                              async_sharded_save=background, content_metadata=metadata,
                                              validate_access_integrity=validate,
                                              **(async_save_options() if background else {}))
    except (Exception, CheckpointException) as err:
        # Not always raised on every rank (the coordinator writes some files alone, while
        # the others wait in megatron-core's gather): the caller publishes it to the job.
        # torch's CheckpointException is a BaseException: megatron-core 0.17+ raises it from
        # its synchronous save when a rank's write failed (a full or read-only disk).
        peer = _lost_peer_error(err)
        if peer is not None:
            # A peer lost in the middle of the write (its process or node gone): not a disk
            # problem but a lost rank, which the job's watchdog names (training.run).
            raise peer from None
        raise HeteroError(f"{what} failed on rank {dist.get_rank()}: {_describe(err, root)}") from None
    layout = _layout_text(sizes)

    def publish() -> None:
        """After every rank's write: manifest, rename iter_N.tmp -> iter_N, then the tracker."""
        _rank_0_step(lambda: _publish(root, iteration, staging, final, plan), what, root)
        print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {root} {layout}")
        if dist.get_rank() == 0:
            events.emit(events.CheckpointSaved(iteration=iteration, directory=str(root)))

    if background:
        request.add_finalize_fn(publish)
        if _ASYNC_SAVES is None:
            # megatron-core's persistent writer binds a GPU; without one each save gets its
            # own background writer process (megatron-core's default caller).
            _ASYNC_SAVES = AsyncCallsQueue(
                persistent=args.use_persistent_ckpt_worker and torch.cuda.is_available())
        _ASYNC_SAVES.schedule_async_request(request)
        return time.perf_counter() - start
    if pause := env.fault_save_pause_s():  # a fault drill: a node lost here is lost mid-write
        time.sleep(pause)
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
