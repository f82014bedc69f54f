"""What the training loop does around its steps besides training: the process groups'
shorter timeout, device syncs, --profile's window, memory snapshots, the parameter sync that
--overlap-param-gather defers, the weight check across replicas, freeing cached memory."""

from __future__ import annotations

import argparse
import contextlib

import torch

from hetero.errors import HeteroError
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import parallel_state
from megatron.hetero import template_reduction
from megatron.hetero.agreement import any_rank
from megatron.hetero.identity import compute_device
from megatron.hetero.log import is_last_rank, print_rank_0


def update_process_group_timeouts(seconds: int) -> None:
    """--distributed-timeout-seconds-after-init: every process group's timeout from now on
    (megatron-core's update_pg_timeout, without its CUDA synchronisation, so that the CPU's
    gloo groups take it too)."""
    from datetime import timedelta

    c10d = torch.distributed.distributed_c10d
    torch.distributed.barrier()
    groups = [None, *(getattr(parallel_state, "_global_process_group_list", None) or [])]
    for group in groups:
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def synchronize_device() -> None:
    """--train-sync-interval: the host waits for the accelerator's queued work (the CPU has
    none, so nothing to wait for)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ProfilingWindow:
    """--profile: Megatron-LM's profiling of iterations --profile-step-start to
    --profile-step-end on the ranks --profile-ranks: torch.profiler with
    --use-pytorch-profiler (its trace written to --tensorboard-dir), else CUDA's profiler API
    for an nsys capture range (GPUs only)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.active = args.profile and torch.distributed.get_rank() in args.profile_ranks
        self.profiler = None
        self.nvtx = None
        if self.active and args.use_pytorch_profiler:
            start, end = args.profile_step_start, args.profile_step_end
            self.profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                                 active=end - start, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    getattr(args, "profile_trace_dir", None) or args.tensorboard_dir),
                record_shapes=True, with_stack=True)
            self.profiler.start()

    def before_iteration(self, iteration: int) -> None:
        if not self.active:
            return
        if self.profiler is not None:
            self.profiler.step()
        elif iteration == self.args.profile_step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.nvtx.__enter__()

    def after_iteration(self, iteration: int) -> None:
        if not self.active or iteration != self.args.profile_step_end:
            return
        if self.profiler is not None:
            self.profiler.stop()
        else:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            if self.nvtx is not None:
                self.nvtx.__exit__(None, None, None)


def dump_memory_snapshot(args: argparse.Namespace) -> None:
    """--record-memory-history: the CUDA caching allocator's history, written to
    --memory-snapshot-path by the last rank at each logging iteration (as Megatron-LM)."""
    if args.record_memory_history and is_last_rank():
        import pickle

        with open(args.memory_snapshot_path, "wb") as handle:
            pickle.dump(torch.cuda.memory._snapshot(), handle)


def sync_params_now(model_chunks: list, args: argparse.Namespace) -> None:
    """With --overlap-param-gather the updated weights arrive during the next forward;
    reading them (norm, checkpoint) first waits for the gather (Megatron-LM's force_param_sync)."""
    if args.overlap_param_gather:
        for chunk in model_chunks:
            chunk.start_param_sync(force_sync=True)


def first_differing_replica(hashes_per_replica: list[torch.Tensor]) -> tuple[int, int] | None:
    """(replica, parameter index) of the first replica whose parameter hashes (one row per
    parameter) differ from replica 0's, or None when every replica holds the same weights."""
    for replica, hashes in enumerate(hashes_per_replica[1:], start=1):
        differing = (hashes != hashes_per_replica[0]).any(dim=1).nonzero()
        if len(differing):
            return replica, int(differing[0])
    return None


def check_weights_match_across_replicas(model_chunks: list, args: argparse.Namespace, iteration: int) -> None:
    """--check-weight-hash-across-dp-replicas-interval: a hash of every parameter compared
    across the data-parallel replicas (expert parameters across the expert-data-parallel
    ones), as Megatron-LM does; a replica that differs is an error naming it on every rank."""
    import hashlib

    sync_params_now(model_chunks, args)
    device = compute_device()
    named = [(name, param) for chunk in model_chunks for name, param in chunk.named_parameters()]
    for expert, group_of in ((False, parallel_state.get_data_parallel_group),
                             (True, parallel_state.get_expert_data_parallel_group)):
        params = [(name, p) for name, p in named if getattr(p, "allreduce", True) != expert]
        if not params:
            continue
        group = group_of()
        local = torch.stack([torch.frombuffer(bytearray(hashlib.sha256(
            p.detach().float().cpu().numpy().tobytes()).digest()), dtype=torch.uint8) for _, p in params]).to(device)
        gathered = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(gathered, local, group=group)
        mismatch = first_differing_replica([h.cpu() for h in gathered])
        if mismatch is not None:
            replica, index = mismatch
            kind = "expert-data-parallel" if expert else "data-parallel"
            raise HeteroError(
                f"weights differ across {kind} replicas after iteration {iteration}: replica {replica} "
                f"(rank {torch.distributed.get_global_rank(group, replica)}) holds another {params[index][0]} than "
                "replica 0; the replicas diverged (a nondeterministic kernel or a failed reduction) - resume "
                "from the last checkpoint")
    if template_reduction.active():  # and across the replica templates, cell by cell
        problem = template_reduction.reduction().check_weights_agree()
        if any_rank(problem is not None):
            raise HeteroError(f"weights differ across replica templates after iteration {iteration}: "
                              f"{problem or 'see the other ranks'}; resume from the last checkpoint")
    torch.distributed.barrier()
    print_rank_0(f">>> Weight hashes match after {iteration} iterations...")


@contextlib.contextmanager
def gathered_params(model_chunks: list, args: argparse.Namespace):
    """Evaluation without the forward pre-hooks that overlap the parameter gather, as
    Megatron-LM's evaluate does (the weights are gathered first, the hooks come back after)."""
    if not args.overlap_param_gather:
        yield
        return
    for chunk in model_chunks:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in model_chunks:
            chunk.enable_forward_pre_hook()


def empty_unused_memory() -> None:
    """--empty-unused-memory-level: return cached accelerator memory (the CPU has no cache)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
