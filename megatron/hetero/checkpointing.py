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

The checkpoint is also Megatron-LM's (docs/checkpoints.md maps every key): the model under
"model" ("model0", "model1", ... one per virtual stage of an interleaved run), "optimizer",
"opt_param_scheduler", "rng_state", "args", "iteration", "checkpoint_version" and
"num_floating_point_operations_so_far", with the sharding choices recorded as megatron-core
content metadata, which Megatron-LM's load_checkpoint reads back. A checkpoint Megatron-LM
wrote loads here the same way, under any plan.

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
from torch.distributed.checkpoint.api import CheckpointException

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
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model
from megatron.hetero.batch_schedule import BatchSchedule
from megatron.hetero.core_compat import async_save_options, write_common_beside
from megatron.hetero.checkpoint_manifest import (
    complete_iterations,
    fsync_tree,
    is_complete,
    verify_manifest,
    write_manifest,
)
from megatron.hetero import checkpoint_legacy, stage_tensor_parallel, template_reduction
from megatron.hetero.identity import this_rank
from megatron.hetero.arguments import vocab_divisor_giving
from megatron.hetero.log import print_rank_0
from megatron.hetero.moe import fit_optimizer_state

TRACKER = "latest_checkpointed_iteration.txt"
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
    if not is_complete(iteration_dir(root, iteration)):
        raise HeteroError(
            f"{tracker} names iteration {iteration} but {iteration_dir(root, iteration)} is not a "
            "complete checkpoint; restore it or point --load at another directory"
        )
    return iteration


def _iteration_to_load(root: str, ckpt_step: int | None) -> int | None:
    """--ckpt-step N, or the tracker's iteration."""
    if ckpt_step is None:
        return latest_iteration(root)
    if not is_complete(iteration_dir(root, ckpt_step)):
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


def _content_metadata(args: argparse.Namespace) -> dict:
    if not args.use_distributed_optimizer:
        return dict(CONTENT_METADATA)
    return {**CONTENT_METADATA, **OPTIMIZER_SHARDING, "distrib_optim_fully_reshardable_mem_efficient": False}


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


# Megatron-LM's running count, which this runtime does not keep: carried from the loaded
# checkpoint to the next save unchanged, so a run that goes back to Megatron-LM keeps it.
_carried = {"num_floating_point_operations_so_far": 0.0}


def floating_point_operations_so_far() -> float:
    """The loaded checkpoint's count (0 without one)."""
    return _carried["num_floating_point_operations_so_far"]
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


def _loaded(root: str, iteration: int, common: dict, sizes, start: float,
            args: argparse.Namespace) -> tuple[int, float]:
    """What every load ends with (either format): the carried counters, Megatron-LM's line,
    the event; the iteration to continue from (0 with --finetune) and the seconds taken."""
    _carried["num_floating_point_operations_so_far"] = common.get("num_floating_point_operations_so_far", 0.0)
    seconds = time.perf_counter() - start
    print_rank_0(f"  successfully loaded checkpoint from {root} {_layout_text(sizes)} at iteration {iteration} "
                 f"({seconds:.2f} s)")
    if dist.get_rank() == 0:
        events.emit(events.CheckpointLoaded(iteration=iteration, directory=str(root)))
    return (0 if args.finetune else common["iteration"]), seconds


def _load_legacy(root: str, directory: Path, iteration: int, model, optimizer, scheduler,
                 args: argparse.Namespace, start: float) -> tuple[int, float]:
    """Megatron-LM's legacy per-rank format (--ckpt-format torch): loaded under the layout
    that wrote it; another layout is refused with the way over (one torch_dist save)."""
    if args.ckpt_format != "torch" and not args.auto_detect_ckpt_format:
        raise HeteroError(
            f"{directory} holds a checkpoint in Megatron-LM's legacy torch format (mp_rank_* files), this "
            "run reads torch_dist: add --ckpt-format torch (checkpoints are then written in that format "
            "too) or --auto-detect-ckpt-format (written in torch_dist, which loads under any plan)")
    common = checkpoint_legacy.read_common(directory)
    saved = _saved_facts(common)
    _check_same_model(directory, saved, common, args)
    sizes, _ = _layout()
    chunks = model_chunks_of(model)
    keys = model_keys(len(chunks))
    problem = checkpoint_legacy.layout_problem(directory, common, sizes, _stage_degrees(), len(chunks), keys)
    _raise_legacy_layout(directory, common, problem)
    # As Megatron-LM: a checkpoint saved with --no-save-optim gives back the weights only.
    restore_optimizer = not args.no_load_optim and not args.finetune and saved.get("optimizer_saved", True)
    _check_optimizer_form(directory, saved, args, restore_optimizer)
    print_rank_0(f" loading checkpoint from {root} at iteration {iteration} (Megatron-LM's torch format)")
    failure, rng = None, None
    try:
        rng = checkpoint_legacy.load(directory, chunks, keys, optimizer, scheduler,
                                     restore_optimizer=restore_optimizer,
                                     restore_rng=not args.no_load_rng and not args.finetune,
                                     distributed_optimizer=bool(args.use_distributed_optimizer))
    except HeteroError as err:
        failure = str(err)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failure)
    _raise_legacy_layout(directory, common, next((f for f in gathered if f), None))
    if rng is not None:
        _set_rng_state(rng)
    return _loaded(root, iteration, common, sizes, start, args)


def _raise_legacy_layout(directory: Path, common: dict, problem: str | None) -> None:
    """The same refusal on every rank when any rank's layout does not fit the files."""
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is None:
        return
    ckpt_args = common.get("args", argparse.Namespace())
    tp = getattr(ckpt_args, "tensor_model_parallel_size", 1)
    pp = getattr(ckpt_args, "pipeline_model_parallel_size", 1)
    raise HeteroError(
        f"the checkpoint in {directory} is in Megatron-LM's legacy torch format, whose per-rank pieces "
        f"load only under the layout that wrote them: {first}. Resume it once under that layout "
        f"(--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}, Megatron-LM's even "
        f"split, no --hetero-plan) with --auto-detect-ckpt-format --ckpt-format torch_dist --save NEWDIR "
        f"--exit-interval {common.get('iteration', 0) + 1} (one iteration, then a torch_dist checkpoint), "
        "then resume --load NEWDIR under this plan: torch_dist loads under any plan")


def _shape_of_megatron_args(ckpt_args: argparse.Namespace) -> dict:
    """model_shape() of the arguments Megatron-LM stored under "args"."""
    fields = dict(vars(ckpt_args))
    dtype = fields.get("params_dtype")
    fields["params_dtype"] = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    return model_shape(argparse.Namespace(**fields))


def _saved_facts(common: dict) -> dict:
    """What the checkpoint says of itself: the "hetero" section this runtime writes, or, in
    one Megatron-LM wrote, the same facts read from its stored arguments."""
    if "hetero" in common:
        return common["hetero"]
    ckpt_args = common.get("args")
    if ckpt_args is None:
        return {}
    return {"model_shape": _shape_of_megatron_args(ckpt_args),
            "layout": [getattr(ckpt_args, "pipeline_model_parallel_size", 1),
                       getattr(ckpt_args, "tensor_model_parallel_size", 1),
                       getattr(ckpt_args, "data_parallel_size", None)],
            "stage_tensor_parallel": None,
            "distributed_optimizer": bool(getattr(ckpt_args, "use_distributed_optimizer", False)),
            "rng_form": None if getattr(ckpt_args, "no_save_rng", False) else "megatron-lm",
            "optimizer_saved": not getattr(ckpt_args, "no_save_optim", False),
            "written_by": "Megatron-LM"}


def _saved_metadata(common: dict, saved: dict) -> dict:
    """The content metadata to read the checkpoint with: as stored, or for checkpoints of
    earlier releases (none stored), what they were written with."""
    stored = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if stored is not None:
        return stored
    if "hetero" in common:
        return {**(MODEL_SHARDING if saved.get("layer_keys") == "per-layer" else {}), **OPTIMIZER_SHARDING}
    return {}


def _vocabulary_fix(theirs: dict, ours: dict, common: dict, args: argparse.Namespace) -> str | None:
    """The flag that gives this run the checkpoint's (padded) vocabulary, when that is what
    differs."""
    if theirs.get("padded_vocab_size") in (None, ours["padded_vocab_size"]):
        return None
    padded = theirs["padded_vocab_size"]
    ckpt_args = common.get("args")
    divisor = vocab_divisor_giving(padded, args.tokenizer_vocab_size, args)
    if divisor is not None:
        return (f"the checkpoint's vocabulary is padded to {padded}, this run pads its tokenizer's "
                f"{args.tokenizer_vocab_size} to {ours['padded_vocab_size']}: resume with "
                f"--make-vocab-size-divisible-by {divisor}")
    named = [f"--{name.replace('_', '-')} {getattr(ckpt_args, name)}" for name in
             ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size")
             if ckpt_args is not None and getattr(ckpt_args, name, None) is not None]
    written = f" (it was written with {' '.join(named)})" if named else ""
    return (f"the checkpoint's vocabulary is padded to {padded}, which no --make-vocab-size-divisible-by "
            f"gives this run's tokenizer ({args.tokenizer_vocab_size} tokens): resume with the tokenizer "
            f"and vocabulary file it was written with{written}")


def _check_same_model(directory: Path, saved: dict, common: dict, args: argparse.Namespace) -> None:
    theirs, ours = saved.get("model_shape", {}), model_shape(args)
    vocabulary = _vocabulary_fix(theirs, ours, common, args)
    if vocabulary:
        raise HeteroError(f"the checkpoint in {directory} has another vocabulary: {vocabulary}")
    different = [f"{k}: checkpoint {theirs.get(k)!r}, this run {ours[k]!r}"
                 for k in ours if k in theirs and theirs[k] != ours[k]]
    if different:
        raise HeteroError(
            f"the checkpoint in {directory} is of another model ({'; '.join(different)}); load it "
            "with the flags it was written with, or point --load at a checkpoint of this model"
        )


def _check_optimizer_form(directory: Path, saved: dict, args: argparse.Namespace, restore_optimizer: bool) -> None:
    saved_sharded = saved.get("distributed_optimizer")
    if restore_optimizer and saved_sharded is not None and saved_sharded != bool(args.use_distributed_optimizer):
        written = "with" if saved_sharded else "without"
        raise HeteroError(
            f"the checkpoint in {directory} was written {written} the distributed optimizer, whose "
            f"optimizer state has another form; resume {written} --use-distributed-optimizer "
            "(a plan from hetero-plan chooses it), or pass --no-load-optim to load the weights only"
        )


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


def state_for_memory(model, optimizer, scheduler, args: argparse.Namespace, loading: bool) -> dict:
    """The sharded state a snapshot holds (snapshots.py): the checkpoint's model, optimizer
    (fully reshardable) and scheduler, of every template; no RNG (a restore re-plans)."""
    return _state(model, optimizer, scheduler, loading=loading, optimizer_state=True, rng=False,
                  metadata=_content_metadata(args), every_template=True)


def load_checkpoint(root: str, model, optimizer, scheduler, args: argparse.Namespace) -> tuple[int, float]:
    """Restores the latest checkpoint under root (this runtime's or Megatron-LM's); model is
    the list of this rank's chunks (or one chunk). Returns (iteration, seconds), or (0, 0) if
    there is none.

    Under the same layout everything comes back, RNG included, so training continues as
    if never stopped. Under another layout (re-planned) the tensors are re-sharded; the
    per-rank RNG streams have no counterpart and are left as seeded.
    """
    iteration = _iteration_to_load(root, args.ckpt_step)
    if iteration is None:
        print_rank_0(f"WARNING: no checkpoint in {root} ({TRACKER} not found); starting from scratch")
        return 0, 0.0
    start = time.perf_counter()
    directory = iteration_dir(root, iteration)
    older = [i for i in complete_iterations(Path(root)) if i < iteration]
    _rank_0_step(lambda: verify_manifest(directory, iteration, older), "checking the checkpoint")
    if checkpoint_legacy.holds_legacy(directory):
        return _load_legacy(root, directory, iteration, model, optimizer, scheduler, args, start)
    common = dist_checkpointing.load_common_state_dict(str(directory))
    saved = _saved_facts(common)
    metadata = _saved_metadata(common, saved)
    _check_same_model(directory, saved, common, args)
    sizes, _ = _layout()
    same_layout = _stage_degrees() == saved.get("stage_tensor_parallel") and (
        template_reduction.active() or list(sizes) == saved.get("layout"))  # templates: every shape is in the degrees
    # None: Megatron-LM's --no-save-rng; absent: this runtime's earlier form (one per rank).
    rng_form = saved.get("rng_form", "per-rank-dict")
    restore_rng = same_layout and not args.no_load_rng and not args.finetune and rng_form is not None
    # As Megatron-LM: a checkpoint saved with --no-save-optim gives back the weights only.
    restore_optimizer = not args.no_load_optim and not args.finetune and saved.get("optimizer_saved", True)
    _check_optimizer_form(directory, saved, args, restore_optimizer)
    saved_sharded = saved.get("distributed_optimizer")
    sharding_type = metadata.get("distrib_optim_sharding_type")
    if (restore_optimizer and saved_sharded and not same_layout
            and sharding_type not in (None, *DistributedOptimizer.checkpoint_fully_reshardable_formats)):
        raise HeteroError(
            f"the checkpoint in {directory} holds its distributed-optimizer state per data-parallel "
            f"rank ({sharding_type}), which loads only under the layout it was written with (PP, TP, DP) = "
            f"{tuple(saved.get('layout', ()))}, not {sizes}: save it in Megatron-LM with "
            "--dist-ckpt-optim-fully-reshardable, resume under that layout, or pass --no-load-optim")
    print_rank_0(f" loading checkpoint from {root} at iteration {iteration}"
                 + (" (written by Megatron-LM)" if saved.get("written_by") else ""))
    stacked = not metadata.get("singleton_local_shards", False)
    state = _state(model, optimizer, scheduler, loading=True, optimizer_state=restore_optimizer,
                   metadata=metadata,
                   rng=restore_rng and ("per-rank-dict" if rng_form != "megatron-lm" else True))
    strategy = get_default_load_sharded_strategy(str(directory))
    if args.ckpt_fully_parallel_load:
        strategy = FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    # A tied table's last-stage copy is read at its own degree from the first stage's key, and
    # stacked layers are read at each stage's own degree: shardings megatron-core's regular
    # grid check would refuse, though every rank reads a rectangular piece of the saved tensor.
    irregular = stage_tensor_parallel.tied_across_degrees() or (
        stacked and stage_tensor_parallel.active_plan() is not None)
    try:
        loaded = dist_checkpointing.load(state, str(directory), strategy, strict=args.dist_ckpt_strictness,
                                         validate_access_integrity=not irregular)
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
    apply_loaded(loaded, model, optimizer, scheduler, restore_optimizer)
    if restore_rng:
        _restore_rng(loaded["rng_state"])
    elif not same_layout:
        theirs_tp, ours_tp = saved.get("stage_tensor_parallel"), _stage_degrees()
        print_rank_0(f"  the checkpoint was written under layout (PP, TP, DP) = {tuple(saved.get('layout', ()))}"
                     + (f", stage TP {theirs_tp}" if theirs_tp else "") + f"; this run is {sizes}"
                     + (f", stage TP {ours_tp}" if ours_tp else "") + ": tensors re-sharded, random streams "
                     "start from --seed")
    return _loaded(root, iteration, common, sizes, start, args)
