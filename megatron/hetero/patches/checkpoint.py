"""Patches for saving and restoring state: the distributed optimizer's state dicts (torch's
Adam, re-shardable offsets, in-memory snapshots) and the checkpoint writer's helper processes,
which end with their rank."""

from __future__ import annotations

import functools
import os

from megatron.hetero.patches.cpu import _no_gpu


def _torch_adam_fallback() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _fresh_adam_states(optimizer) -> None:
    """The per-parameter state torch's Adam/AdamW creates lazily at the first step."""
    import torch

    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _apply_distributed_optimizer_load() -> object:
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **kwargs):
        if is_loading and not self.optimizer.state:
            # torch's Adam creates per-parameter state at its first step; give it some
            # (the way megatron-core does for its FSDP path), to be overwritten by the load.
            self._init_optimizer_states_with_dummy_values()
        elif not is_loading and not self.optimizer.state:
            # Saved before any step was taken (fp16 skips its first steps while the loss
            # scale comes down): megatron-core reads each state's "step". Give every
            # parameter the state torch's Adam would create at its first step (zeros,
            # step 0), so the saved and the continuing run are the ones without the save.
            _fresh_adam_states(self.optimizer)
        return original(self, model_sharded_state_dict or {}, is_loading=is_loading, **kwargs)

    copy_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(self, model_param, tensors):
        # A re-shardable checkpoint keeps torch Adam's "step" in the param groups (restored by
        # load_state_dict); copying per-parameter states must leave the live "step" alone.
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        live = self.optimizer.state[main_param]
        if "step" in live and "step" not in tensors:
            tensors = {**tensors, "step": live["step"]}
        return copy_states(self, model_param, tensors)

    load_state_dict = DistributedOptimizer.load_state_dict

    def load_state_dict_with_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        # It hands every parameter the same "step" tensor, which torch's Adam then increments
        # in place once per parameter: one tensor per parameter, as Adam keeps it.
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict_with_own_steps
    return sharded_state_dict


def _apply_reshardable_offsets() -> object:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_param_state_fully_reshardable

    def unpadded_index_map(buffer) -> dict:
        """param -> (start, end, bucket) in the gathered state's coordinates, which leave out
        the padding between buckets."""
        removed, shift = 0, []
        for bucket in buffer.buckets:
            shift.append(bucket.offset - removed)
            removed += bucket.numel_unpadded
        return {param: (start - shift[b], end - shift[b], b)
                for param, (start, end, b) in buffer.param_index_map.items()}

    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        padded = [buffer.param_index_map for buffer in self.buffers]
        try:
            for buffer in self.buffers:
                buffer.param_index_map = unpadded_index_map(buffer)
            return original(self, *args, **kwargs)
        finally:
            for buffer, index_map in zip(self.buffers, padded):
                buffer.param_index_map = index_map

    DistributedOptimizer.sharded_param_state_fully_reshardable = sharded_param_state_fully_reshardable
    return sharded_param_state_fully_reshardable


def _server_dies_with_rank(rank_pid: int) -> None:
    """Runs first in the checkpoint Manager's server process: it goes when its rank goes.

    A Manager's server outlives a killed parent: the ranks of a lost node or a stopped
    attempt would each leave one behind, holding the rank's inherited signal handlers and
    ignoring SIGTERM."""
    import signal

    _die_with_parent(rank_pid)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _apply_checkpoint_queue_dies_with_rank() -> object:
    from multiprocessing.managers import SyncManager

    from torch import multiprocessing as mp
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # megatron-core 0.17+ names it get_write_results_queue(mp_mode="spawn") (0.16: _get_...).
    name = ("get_write_results_queue" if hasattr(filesystem_async, "get_write_results_queue")
            else "_get_write_results_queue")

    def write_results_queue(*args, **kwargs):
        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=mp.get_context("fork" if _no_gpu() else "spawn"))
            manager.start(_server_dies_with_rank, (os.getpid(),))
            filesystem_async._results_queue = manager.Queue()
            filesystem_async._results_queue_manager = manager  # keeps the server alive
        return filesystem_async._results_queue

    setattr(filesystem_async, name, write_results_queue)
    return write_results_queue


def _die_with_parent(parent_pid: int) -> None:
    """PR_SET_PDEATHSIG: this forked helper gets SIGKILL when the thread that forked it ends
    (a rank's main thread: the rank); if the rank is already gone, it goes now."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


_writer_parent_pid: int | None = None  # set in the rank just before it forks its writers


def _checkpoint_writers_are_processes() -> bool:
    """megatron-core 0.16 forks a writer process per write bucket; 0.17+ writes with threads
    of the process that saves (write_preloaded_data_multithread), which go with it."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    return hasattr(FileSystemWriterAsync, "write_preloaded_data_multiproc")


def _apply_checkpoint_writers_die_with_rank() -> object:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    fork_writers = FileSystemWriterAsync.write_preloaded_data_multiproc
    write = FileSystemWriterAsync.write_preloaded_data

    @functools.wraps(fork_writers)
    def write_preloaded_data_multiproc(*args, **kwargs):
        global _writer_parent_pid
        _writer_parent_pid = os.getpid()  # the forked writers inherit it
        return fork_writers(*args, **kwargs)

    @functools.wraps(write)  # megatron-core reads its signature
    def write_preloaded_data(*args, **kwargs):
        if _writer_parent_pid is not None:
            _die_with_parent(_writer_parent_pid)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_preloaded_data_multiproc)
    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)
    return write_preloaded_data


_SNAPSHOT: dict = {"taking": False, "per_rank": False, "parameter_state": True, "own_shards": {}}


def snapshot_in_progress(per_rank: bool = True, parameter_state: bool = True):
    """A context in which the distributed optimizer's sharded state dict is built for an
    in-memory snapshot (restart.py): patch ``optimizer-state-for-snapshots``. Per rank, it
    yields where this rank's own optimizer shard lies in the state's flat tensors: the
    storage's address -> the [start, stop) element ranges that hold this rank's data (the
    rest is not filled), each with the live shard that fills it (snapshots.OwnShard); else
    (empty) the state is gathered as for a checkpoint. Without ``parameter_state`` the
    optimizer's state dict holds no tensors: only its param groups and step."""
    import contextlib

    @contextlib.contextmanager
    def taking():
        _SNAPSHOT.update(taking=True, per_rank=per_rank, parameter_state=parameter_state, own_shards={})
        try:
            yield _SNAPSHOT["own_shards"]
        finally:
            _SNAPSHOT.update(taking=False, per_rank=False, parameter_state=True, own_shards={})

    return taking()


_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def _own_parameter_state(optimizer) -> dict:
    """get_parameter_state_dp_zero's result (every data-parallel rank's shards concatenated,
    per grad buffer, without the padding between buckets) with only this rank's shard filled
    in: no gather. Where the shard lies is recorded for the snapshot (``own_shards``)."""
    import torch

    group = optimizer.data_parallel_group
    dp_size, dp_rank = group.size(), group.rank()
    state = {"buckets_coalesced": True}
    for buffer_index, ranges_by_dtype in enumerate(optimizer.gbuf_ranges):
        buffer = optimizer.buffers[buffer_index]
        by_dtype = {}
        for dtype, bucket_ranges in ranges_by_dtype.items():
            # Not zeroed: only the recorded ranges are read.
            world = {key: torch.empty((buffer.numel_unpadded,), dtype=torch.float32) for key in _STATE_KEYS}
            filled, bucket_start = [], 0
            for bucket_index, bucket_range in enumerate(bucket_ranges):
                bucket = buffer.buckets[bucket_index]
                shard_start = bucket_start + dp_rank * (bucket.grad_data.numel() // dp_size)
                for model_param, param_range in bucket_range["param_map"].items():
                    fetch = functools.partial(optimizer._get_main_param_and_optimizer_states, model_param)
                    tensors = fetch()
                    start = shard_start + param_range["gbuf_local"].start
                    stop = shard_start + param_range["gbuf_local"].end
                    for key in _STATE_KEYS:
                        world[key][start:stop].copy_(tensors[key].detach())
                    filled.append((start, stop, fetch))
                bucket_start += bucket.numel_unpadded
            for key in _STATE_KEYS:  # each range with the live shard that fills it (snapshots.OwnShard)
                _SNAPSHOT["own_shards"][world[key].untyped_storage().data_ptr()] = \
                    [(start, stop, fetch, key) for start, stop, fetch in filled]
            world["numel_unpadded"] = buffer.numel_unpadded
            by_dtype[dtype] = world
        state[buffer_index] = by_dtype
    return state


def _apply_optimizer_state_for_snapshots() -> object:
    import gc

    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class _Collector:
        """distrib_optimizer's ``gc``: its full collection, but a young one while a snapshot
        is taken (every iteration: a full one costs ~0.2 s with megatron-core loaded)."""

        def __getattr__(self, name):
            return getattr(gc, name)

        @staticmethod
        def collect(generation: int = 2) -> int:
            return gc.collect(0 if _SNAPSHOT["taking"] else generation)

    gathered = DistributedOptimizer.get_parameter_state_dp_zero

    def get_parameter_state_dp_zero(self, use_gloo_comm=True, empty_data=False, return_on_all_ranks=False):
        if _SNAPSHOT["per_rank"] and not empty_data:
            return _own_parameter_state(self)
        return gathered(self, use_gloo_comm=use_gloo_comm, empty_data=empty_data,
                        return_on_all_ranks=return_on_all_ranks)

    with_parameter_state = DistributedOptimizer.sharded_param_state_fully_reshardable

    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        return with_parameter_state(self, *args, **kwargs) if _SNAPSHOT["parameter_state"] else {}

    distrib_optimizer.gc = _Collector()
    DistributedOptimizer.get_parameter_state_dp_zero = get_parameter_state_dp_zero
    DistributedOptimizer.sharded_param_state_fully_reshardable = sharded_param_state_fully_reshardable
    return get_parameter_state_dp_zero
