"""The training run: Megatron-LM's pretrain() reduced to what a GPT run needs, plan-aware.

Each data-parallel replica runs the 1F1B schedule over its own number of micro-batches;
megatron-core's per-token loss mode sums gradients and divides by the global token count,
so replicas of different size contribute exactly by the tokens they processed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from hetero import events
from hetero.errors import HeteroError
from hetero.plan import Plan
from megatron.hetero.patches import disable_jit_fuser, import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import (
    OptimizerParamScheduler,
    get_canonical_lr_for_logging,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import (
    model_parallel_cuda_manual_seed,
    param_is_not_tensor_parallel_duplicate,
)
from megatron.core.transformer.module import param_is_not_shared
from megatron.hetero import adapt, data, distributed, startup, template_reduction
from megatron.hetero.arguments import config_from_flags
from megatron.core.timers import Timers
from megatron.hetero.cpu_device import substitution_note
from megatron.hetero.batch_schedule import BatchSchedule
from megatron.hetero.core_compat import batch_on_this_cp_rank
from megatron.hetero.core_version import installed_megatron_core
from megatron.hetero.checkpointing import (
    finalize_pending_saves,
    floating_point_operations_so_far,
    iteration_dir,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
)
from megatron.hetero.distributed import Launch
from megatron.hetero.identity import RankIdentity, compute_device, this_rank
from megatron.hetero.log import (
    arguments_block,
    evaluation_block,
    is_last_rank,
    iteration_line,
    memory_line,
    memory_stats,
    print_all,
    print_rank_0,
    print_rank_last,
    ProgressLog,
)
from megatron.hetero.metrics import MetricsWriter
from megatron.hetero.model import (
    count_parameters,
    model_spec,
    resolve_transformer_impl,
)
from megatron.hetero.moe import MoEMetrics
from megatron.hetero.mtp import MTPMetrics
from megatron.hetero.performance import startup_lines as performance_startup_lines
from megatron.hetero.tracing import BUSY, TRACE
from megatron.hetero.watchdog import Watchdog
from megatron.hetero.restart import InProcessRestart, Outcome, launch_environment, said_lost_state, teardown
from megatron.hetero.snapshots import LostState
from hetero.launch.inprocess import report_finished, Rejoin, place, wait_for_rejoin


def rank_seed(seed: int, pp_rank: int, dp_rank: int, data_parallel_random_init: bool = False) -> int:
    """Megatron-LM's seed of a rank: a stream per pipeline stage, and with
    --data-parallel-random-init one per data-parallel replica too (their dropout differs;
    their weights stay replica 0's)."""
    return seed + 100 * pp_rank + (10 * dp_rank if data_parallel_random_init else 0)


def set_random_seed(seed: int, data_parallel_random_init: bool = False) -> None:
    """Megatron-LM's seeding: a different stream per pipeline stage, RNG tracker for TP."""
    seed = rank_seed(seed, parallel_state.get_pipeline_model_parallel_rank(),
                     parallel_state.get_data_parallel_rank(), data_parallel_random_init)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


# ----- one micro-batch -----------------------------------------------------------------


def get_batch(data_iterator: Iterator[dict] | None):
    """(tokens, labels, loss_mask, attention_mask, position_ids); Nones on middle stages."""
    if data_iterator is None:
        return None, None, None, None, None
    batch = next(data_iterator)
    batch = {k: v.to(this_rank().device, non_blocking=True) for k, v in batch.items() if v is not None}
    # Context parallelism: this rank's two load-balanced chunks of every sequence (the
    # attention mask keeps all its columns: context_parallel.py), as Megatron-LM's get_batch.
    batch = batch_on_this_cp_rank(batch)
    return (
        batch["tokens"],
        batch["labels"],
        batch["loss_mask"],
        batch.get("attention_mask"),
        batch["position_ids"],
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed loss and token count; the schedule and finalize_model_grads do the division."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])}
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask)


def checked_forward_step(data_iterator, model, rerun_mode: str = "disabled"):
    """forward_step whose loss function stops the run on a NaN or Inf loss before the data-
    parallel reduction, as Megatron-LM's loss_func does unless --no-check-for-nan-in-loss-and-grad."""
    output, loss_of = forward_step(data_iterator, model)
    return output, partial(_finite_loss, loss_of, rerun_mode)


def forward_step_for(args: argparse.Namespace) -> Callable:
    """The forward step the schedule runs: loss-checked unless --no-check-for-nan-in-loss-and-grad."""
    if not args.check_for_nan_in_loss_and_grad:
        return forward_step
    return partial(checked_forward_step, rerun_mode=args.rerun_mode)


def _finite_loss(loss_of: Callable, rerun_mode: str, output_tensor: torch.Tensor):
    loss, num_tokens, report = loss_of(output_tensor)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for kind, bad in (("NaN", torch.isnan), ("Inf", torch.isinf)):
        if bad(loss).any():
            unchecked = (" The iteration was not re-run to tell a transient fault from a reproducible one "
                         "(Megatron-LM's --rerun-mode validate_results would)." if rerun_mode == "validate_results" else "")
            raise HeteroError(
                f"found {kind} in local forward loss calculation on rank {rank}; "
                f"lower --lr or check the data (--no-check-for-nan-in-loss-and-grad trains on).{unchecked}")
    return loss, num_tokens, report


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


def chunk_data_iterators(data_iterator, num_chunks: int):
    """The schedule's data: one iterator, or with virtual stages one per model chunk, where
    only the chunk holding the model's first (embedding) or last (loss) layers reads."""
    if num_chunks == 1:
        return data_iterator
    reading = 0 if parallel_state.is_pipeline_first_stage() else num_chunks - 1
    return [data_iterator if chunk == reading else None for chunk in range(num_chunks)]


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
        found = torch.tensor([problem is not None], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        if found.item():
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


# ----- optimizer --------------------------------------------------------------------------


def build_optimizer(
    args: argparse.Namespace, plan: Plan, model_chunks: list, params_dtype: torch.dtype,
    timers: Timers | None = None
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    optimizer = get_megatron_optimizer(
        config_from_flags(  # every honoured OptimizerConfig flag, as Megatron-LM; these win
            OptimizerConfig, args,
            optimizer=args.optimizer,
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            fp16=args.fp16,
            bf16=args.bf16,
            params_dtype=params_dtype,
            loss_scale=args.loss_scale,
            initial_loss_scale=args.initial_loss_scale,
            min_loss_scale=args.min_loss_scale,
            loss_scale_window=args.loss_scale_window,
            hysteresis=args.hysteresis,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            sgd_momentum=args.sgd_momentum,
            use_distributed_optimizer=args.use_distributed_optimizer,
            clip_grad=args.clip_grad,
            log_num_zeros_in_grad=args.log_num_zeros_in_grad,
            decoupled_lr=args.decoupled_lr,
            decoupled_min_lr=args.decoupled_min_lr,
            timers=timers,
        ),
        model_chunks,
        # --dump-param-to-param-group-map: megatron-core writes each parameter's group there.
        dump_param_to_param_group_map=args.dump_param_to_param_group_map,
    )
    return optimizer, build_scheduler(args, plan, optimizer)


def scheduler_steps(args: argparse.Namespace, global_batch_size: int) -> dict:
    """Megatron-LM's schedule lengths, in samples: from --*-iters times the global batch, or
    the --*-samples flags as given."""
    if args.train_samples is None:
        decay = (args.lr_decay_iters or args.train_iters) * global_batch_size
        warmup = args.lr_warmup_iters * global_batch_size
        wsd = args.lr_wsd_decay_iters * global_batch_size if args.lr_wsd_decay_iters else None
        wd_incr = args.train_iters * global_batch_size
    else:
        decay = args.lr_decay_samples or args.train_samples
        warmup = args.lr_warmup_samples
        wsd = args.lr_wsd_decay_samples
        wd_incr = args.train_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wsd_decay_steps": wsd,
            "wd_incr_steps": wd_incr}


def build_scheduler(args: argparse.Namespace, plan: Plan, optimizer) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_style=args.weight_decay_incr_style,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        # With --use-checkpoint-opt_param-scheduler Megatron-LM resumes the checkpoint's
        # schedule; without it, it stops on an assertion when the flags' schedule differs.
        # Here the checkpoint's schedule is resumed in both cases (no traceback), unless
        # --override-opt_param-scheduler: then the flags' schedule wins, as in Megatron-LM.
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        **scheduler_steps(args, plan.global_batch_size),
    )


# ----- the loop ---------------------------------------------------------------------------


@dataclass
class _IntervalStats:
    """What Megatron-LM accumulates between two log lines."""

    iterations: int = 0
    skipped: int = 0
    nan: int = 0
    elapsed: float = 0.0
    losses: dict[str, float] = field(default_factory=dict)

    def add_losses(self, losses: dict[str, float]) -> None:
        for key, value in losses.items():
            self.losses[key] = self.losses.get(key, 0.0) + value


# Megatron-LM's timers per --timing-log-level (those megatron-core starts itself included).
TIMERS_TO_LOG = {
    1: ["forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
        "all-grads-sync", "params-all-gather", "optimizer-copy-to-main-grad",
        "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad", "optimizer-count-zeros",
        "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer"],
    2: ["batch-generator", "forward-compute", "backward-compute", "forward-recv", "forward-send",
        "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
        "backward-send-forward-recv", "backward-send-backward-recv",
        "forward-backward-send-forward-backward-recv"],
}


def timers_to_log(level: int) -> list[str]:
    return [name for lvl in sorted(TIMERS_TO_LOG) if lvl <= level for name in TIMERS_TO_LOG[lvl]]


def _number(value):
    """A logged figure as a plain number: the optimizer may give a 0-dimensional tensor."""
    if value is None:
        return None
    return value.item() if hasattr(value, "item") else value


def empty_unused_memory() -> None:
    """--empty-unused-memory-level: return cached accelerator memory (the CPU has no cache)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Trainer:
    """One rank's share of the job: its stage, its replica's micro-batches."""

    def __init__(self, args, plan: Plan, ctx: RankIdentity, model_chunks: list, optimizer, scheduler,
                 schedule: BatchSchedule, timers: Timers, metrics: MetricsWriter,
                 moe: MoEMetrics | None = None, start_time: float | None = None,
                 exit_requested: Callable[[], bool] | None = None, adapter: adapt.Adapter | None = None):
        self.args, self.plan, self.ctx = args, plan, ctx
        self.adapter = adapter  # --hetero-adapt: re-splits self.plan's replicas while training
        self.eval_plan = plan  # evaluation keeps the split its data iterators were made with
        self.exit_requested = exit_requested  # --exit-signal-handler: agreed by all ranks
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.schedule, self.timers, self.metrics, self.moe = schedule, timers, metrics, moe
        self.mtp = MTPMetrics(args) if args.mtp_num_layers is not None else None
        self.spec = model_spec(args)
        self.dp_rank = ctx.replica  # the plan's replica index (over every template)
        self.forward_backward = get_forward_backward_func()
        self.forward_step = forward_step_for(args)
        self.start_time = start_time or time.time()
        self.progress: ProgressLog | None = None  # --log-progress
        self.operations_this_job = 0.0  # floating-point operations trained since the start
        self.valid_iters: int | None = None  # --full-validation: the whole split's iterations
        self.restart: InProcessRestart | None = None  # --inprocess-restart: snapshots, re-plans
        self.rejoin: Rejoin | None = None  # the re-plan the loop stopped for

    def _reduce_losses(self, losses_per_micro_batch: list[dict]) -> dict[str, float]:
        """Token-weighted mean over every replica's micro-batches (known on the last stage)."""
        if not parallel_state.is_pipeline_last_stage():
            return {}
        reduced = {}
        for key in losses_per_micro_batch[0]:
            totals = torch.stack([m[key].view(-1) for m in losses_per_micro_batch]).sum(dim=0)
            if template_reduction.active():  # every template's last stages
                totals = template_reduction.sum_over_last_stages(totals)
            else:  # context ranks hold different tokens of the same sequences: their sums add up too
                torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group(
                    with_context_parallel=True))
            reduced[key] = (totals[0] / totals[1].clamp(min=1)).item()
        return reduced

    def _run_schedule(self, data_iterator, num_micro_batches: int, forward_only: bool) -> dict[str, float]:
        losses = self.forward_backward(
            forward_step_func=self.forward_step,
            data_iterator=chunk_data_iterators(data_iterator, len(self.model_chunks)),
            model=self.model_chunks,
            num_microbatches=num_micro_batches,
            seq_length=self.args.seq_length,
            micro_batch_size=self.plan.micro_batch_size,
            forward_only=forward_only,
        )
        return self._reduce_losses(losses)

    def train_step(self, data_iterator, global_batch_size: int):
        """One iteration over global_batch_size samples (this replica's share of them)."""
        args, timers = self.args, self.timers
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        num_micro_batches = self.schedule.micro_batches(global_batch_size)[self.dp_rank]
        template_reduction.begin_iteration(num_micro_batches)  # several templates: when gradients are final
        # (megatron-core's schedule times itself as 'forward-backward')
        BUSY.begin()
        losses = self._run_schedule(data_iterator, num_micro_batches, forward_only=False)
        busy_seconds, compute_seconds = BUSY.busy, BUSY.compute
        if args.empty_unused_memory_level >= 1:
            empty_unused_memory()
        timers("optimizer", log_level=1).start(barrier=True)
        with TRACE.span("step"):
            update_successful, grad_norm, num_zeros = self.optimizer.step()
        timers("optimizer").stop()
        if update_successful:
            self.scheduler.step(increment=global_batch_size)
        if args.empty_unused_memory_level >= 2:
            empty_unused_memory()
        if self.adapter is not None:
            self.adapter.record(busy_seconds, compute_seconds)
        return losses, grad_norm, not update_successful, num_zeros

    @torch.no_grad()
    def evaluate(self, data_iterator, iterations: int | None = None) -> dict[str, float]:
        """--eval-iters (or ``iterations``) iterations of the plan's global batch, forward only."""
        args = self.args
        iterations = iterations or args.eval_iters
        if args.manual_gc and args.manual_gc_eval:
            gc.collect()
        totals: dict[str, float] = {}
        num_micro_batches = self.eval_plan.replicas[self.dp_rank].num_micro_batches
        with gathered_params(self.model_chunks, args):
            for chunk in self.model_chunks:
                chunk.eval()
            for _ in range(iterations):
                for key, value in self._run_schedule(data_iterator, num_micro_batches,
                                                     forward_only=True).items():
                    totals[key] = totals.get(key, 0.0) + value
                if args.empty_unused_memory_level >= 1:
                    empty_unused_memory()
            for chunk in self.model_chunks:
                chunk.train()
        if args.manual_gc and args.manual_gc_eval:
            gc.collect()
        return {k: v / iterations for k, v in totals.items()}

    def evaluate_and_print(self, data_iterator, iteration: int, consumed_samples: int,
                           split: str = "validation") -> None:
        losses = self.evaluate(data_iterator, self.valid_iters if split == "validation" else None)
        print_rank_last(evaluation_block(f"iteration {iteration} on {split} set", losses))
        if split == "validation":
            self.metrics.validation(iteration, consumed_samples, losses)

    def _params_norm(self) -> float:
        """L2 norm of the whole model: each parameter counted once across TP and PP, and each
        expert once across the expert-parallel ranks that share them out (as Megatron-LM:
        expert parameters, marked allreduce=False, are summed over the expert tensor, model
        and pipeline ranks, the others over the tensor and pipeline ranks)."""
        dense, experts = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        sync_params_now(self.model_chunks, self.args)
        for param in (p for chunk in self.model_chunks for p in chunk.parameters()):
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                squares = experts if not getattr(param, "allreduce", True) else dense
                squares += param.detach().double().pow(2).sum().cpu()
        torch.distributed.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        if self.args.num_experts is not None:
            torch.distributed.all_reduce(
                experts, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        return (dense + experts).sqrt().item()

    def learning_rate(self) -> float:
        """The lr of the default parameter groups (not --decoupled-lr's), as Megatron-LM logs it."""
        groups = self.optimizer.param_groups
        lr = get_canonical_lr_for_logging(groups)
        return groups[0]["lr"] if lr is None else lr

    def _log(self, iteration: int, stats: _IntervalStats, grad_norm, num_zeros,
             global_batch_size: int, consumed_samples: int) -> None:
        args, plan = self.args, self.plan
        seconds = stats.elapsed / stats.iterations
        advanced = max(1, stats.iterations - stats.skipped)
        params_norm = self._params_norm() if args.log_params_norm else None
        tflops = self.spec.training_flops(global_batch_size) / (seconds * 1e12 * plan.world_size)
        tokens_per_second = global_batch_size * args.seq_length / seconds
        learning_rate = self.learning_rate()
        losses = {k: v / advanced for k, v in stats.losses.items()}
        loss_scale = float(self.optimizer.get_loss_scale().item())
        zeros = num_zeros if args.log_num_zeros_in_grad else None
        print_rank_last(
            iteration_line(
                iteration=iteration,
                train_iters=args.train_iters,
                consumed_samples=consumed_samples,
                elapsed_ms=seconds * 1000.0,
                tflops_per_device=tflops if args.log_throughput else None,
                tokens_per_second=tokens_per_second,
                learning_rate=learning_rate,
                global_batch_size=global_batch_size,
                losses=losses,
                loss_scale=loss_scale,
                grad_norm=grad_norm,
                params_norm=params_norm,
                num_zeros_in_grad=zeros,
                skipped_iterations=stats.skipped,
                nan_iterations=stats.nan,
            )
        )
        if is_last_rank():  # the rank that prints the line, and knows the losses
            events.emit(events.Iteration(
                iteration=iteration, train_iters=args.train_iters, consumed_samples=consumed_samples,
                interval=stats.iterations, elapsed_s=seconds, tokens_per_s=tokens_per_second,
                tflops_per_device=tflops, learning_rate=learning_rate, global_batch_size=global_batch_size,
                losses=losses, loss_scale=loss_scale, grad_norm=_number(grad_norm), params_norm=params_norm,
                num_zeros=_number(zeros), skipped=stats.skipped, nan=stats.nan))
        if args.log_timers_to_tensorboard:
            self.metrics.scalar("iteration-time", seconds, iteration)
            if args.log_throughput:
                self.metrics.scalar("throughput", tflops, iteration)
        names = timers_to_log(args.timing_log_level)
        if names:  # a collective: every rank takes part, the last one prints
            if args.log_timers_to_tensorboard:
                self.timers.write(names, self.metrics.tensorboard, iteration,
                                  normalizer=args.log_interval, reset=False)
            text = self.timers.get_all_timers_string(names, normalizer=args.log_interval, reset=True)
            if text:
                print_rank_last(text)
        return params_norm

    def _write_metrics(self, iteration: int, consumed_samples: int, global_batch_size: int,
                       losses: dict[str, float], grad_norm, num_zeros, params_norm) -> None:
        self.metrics.training(
            iteration, consumed_samples, learning_rate=self.learning_rate(),
            batch_size=global_batch_size, losses=losses,
            loss_scale=float(self.optimizer.get_loss_scale().item()), grad_norm=grad_norm,
            num_zeros=num_zeros if self.args.log_num_zeros_in_grad else None,
            params_norm=params_norm, world_size=self.plan.world_size)

    def _time_is_up(self) -> bool:
        """--exit-duration-in-mins, agreed by all ranks (the slowest clock decides)."""
        minutes = (time.time() - self.start_time) / 60.0
        done = torch.tensor([int(minutes > self.args.exit_duration_in_mins)], dtype=torch.int)
        torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MAX)
        return bool(done.item())

    def train(self, start_iteration: int, train_data: Callable[[int, BatchSchedule], Iterator | None],
              valid_iterator, evaluate: bool) -> tuple[int, bool]:
        """Runs from start_iteration to --train-iters (or an exit condition); returns the
        last iteration and whether a checkpoint of it was just saved. ``train_data(i, schedule)``
        gives the training micro-batches from iteration i on."""
        args = self.args
        stats = _IntervalStats()
        reported_memory = False
        saved = False
        if args.manual_gc:  # as Megatron-LM: collect at the same points on every rank
            gc.disable()
            gc.collect()
        print_rank_0("training ...")
        iteration = start_iteration
        consumed = self.schedule.consumed_samples(start_iteration)
        train_iterator = train_data(start_iteration, self.schedule)
        timeouts_updated = False
        profiling = ProfilingWindow(args)
        while iteration < args.train_iters:
            profiling.before_iteration(iteration)
            tracing = TRACE.enabled and iteration + 1 == TRACE.iteration
            if tracing:
                torch.distributed.barrier()
                TRACE.begin()
            if args.async_save:  # as Megatron-LM: publish background saves that finished
                finalize_pending_saves(blocking=False)
            start = time.perf_counter()
            global_batch_size = self.schedule.global_batch_size(consumed)
            if iteration in args.iterations_to_skip:
                # As Megatron-LM: the batch is read past, no update, no log; the next
                # iteration reads the batch after it.
                print_rank_0(f"skipping iteration {iteration + 1} (--iterations-to-skip)")
                iteration += 1
                consumed += global_batch_size
                train_iterator = train_data(iteration, self.schedule)
                continue
            losses, grad_norm, skipped, num_zeros = self.train_step(train_iterator, global_batch_size)
            self.operations_this_job += self.spec.training_flops(global_batch_size)
            iteration += 1
            profiling.after_iteration(iteration)
            consumed += global_batch_size
            if args.distributed_timeout_seconds_after_init is not None and not timeouts_updated:
                # As Megatron-LM: after the first iteration, which runs longest (compilation,
                # allocation), the shorter timeout catches a hang sooner.
                update_process_group_timeouts(args.distributed_timeout_seconds_after_init)
                timeouts_updated = True
            if args.train_sync_interval and iteration % args.train_sync_interval == 0:
                synchronize_device()
            interval = args.check_weight_hash_across_dp_replicas_interval
            if interval is not None and iteration % interval == 0:
                check_weights_match_across_replicas(self.model_chunks, args, iteration)
            if tracing:
                TRACE.end(self.ctx.logical_rank, self._trace_facts())
            saved = False
            stats.elapsed += time.perf_counter() - start
            for auxiliary in (self.moe, self.mtp):  # router and multi-token-prediction losses
                if auxiliary is not None:
                    losses = {**losses, **auxiliary.collect(
                        iteration, self.plan.data_parallel, global_batch_size // self.plan.micro_batch_size,
                        self.metrics.tensorboard, self.metrics.wandb)}
            stats.iterations += 1
            stats.skipped += int(skipped)
            if not skipped:
                stats.add_losses(losses)
                stats.nan += int(any(v != v for v in losses.values()))
            logging_now = iteration % args.log_interval == 0
            if logging_now or iteration == start_iteration + 1:
                dump_memory_snapshot(args)
            params_norm = None
            if logging_now:
                params_norm = self._log(iteration, stats, grad_norm, num_zeros, global_batch_size, consumed)
            if self.metrics.active:
                self._write_metrics(iteration, consumed, global_batch_size, losses, grad_norm,
                                    num_zeros, params_norm)
            if logging_now:
                stats = _IntervalStats()
                # As Megatron-LM: one line per stage, once, and every --log-memory-interval.
                memory_interval = args.log_memory_interval
                if not reported_memory or (memory_interval and iteration % memory_interval == 0):
                    reported_memory = True
                    if parallel_state.get_data_parallel_rank() == 0 and (
                        parallel_state.get_tensor_model_parallel_rank() == 0
                    ):
                        memory = memory_stats(self.ctx.logical_rank, iteration)
                        line = memory_line(memory)
                        if args.log_device_memory_used:  # as Megatron-LM: every process's use of the GPU
                            line += f" | total device memory used: {torch.cuda.device_memory_used() / 2**20:.2f}"
                        print_all(line)
                        events.emit(memory)
            if evaluate and iteration % args.eval_interval == 0:
                self.evaluate_and_print(valid_iterator, iteration, consumed)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                self.save(iteration)
                saved = True
            elif args.save and args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0:
                self.save_non_persistent(iteration)
            if self.exit_requested is not None and self.exit_requested():
                if args.save and not saved:
                    self.save(iteration)
                    saved = True
                print_rank_0(f"exiting program after receiving {args.exit_signal}.")
                break
            if args.exit_duration_in_mins and self._time_is_up():
                if args.save and not saved:
                    self.save(iteration)
                    saved = True
                print_rank_0(f"exiting program after {(time.time() - self.start_time) / 60.0} minutes")
                break
            if args.exit_interval and iteration % args.exit_interval == 0:
                if args.save and not saved:
                    self.save(iteration)
                    saved = True
                print_rank_0(f"exiting program at iteration {iteration}")
                break
            if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
                gc.collect()
            if self.adapter is not None and (adapted := self.adapter.maybe_resplit(iteration)):
                # The sampler reads ahead: a new one starts at the next iteration's samples.
                self.plan = adapted
                self.schedule = BatchSchedule(adapted, args.rampup_batch_size)
                train_iterator = train_data(iteration, self.schedule)
            if self.restart is not None:  # --inprocess-restart: a snapshot; a node taken back
                self.restart.after_iteration(iteration, self.model_chunks, self.optimizer, self.scheduler, self.plan)
                self.rejoin = self.restart.planned_rejoin()
                if self.rejoin is not None:
                    if iteration % self.restart.interval:  # nothing done since the snapshot is lost
                        self.restart.snapshot(iteration, self.model_chunks, self.optimizer, self.scheduler, self.plan)
                    print_rank_0(f"> in-process restart: re-planning at iteration {iteration} (epoch "
                                 f"{self.rejoin.epoch}, {self.rejoin.world_size} processes)")
                    break
        return iteration, saved

    def _trace_facts(self) -> dict:
        device = self.plan.devices[self.ctx.launch.rank]
        return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "dp_rank": parallel_state.get_data_parallel_rank(),
                "host": device.host, "device_type": device.device_type}

    def save_non_persistent(self, iteration: int) -> None:
        """--non-persistent-save-interval: Megatron-LM's global non-persistent checkpoint, in
        --non-persistent-global-ckpt-dir (default SAVE/non_persistent), where only the newest stays."""
        root = non_persistent_dir(self.args, self.args.save)
        self.save(iteration, root, progress=False)
        if torch.distributed.get_rank() == 0:
            for older in Path(root).glob("iter_*"):
                if older.name != iteration_dir(root, iteration).name and older.name[len("iter_"):].isdigit():
                    shutil.rmtree(older, ignore_errors=True)

    def save(self, iteration: int, root: str | None = None, progress: bool = True) -> None:
        sync_params_now(self.model_chunks, self.args)
        root, retain = root or self.args.save, self.args.save_retain_interval
        previous = latest_iteration(root) if retain is not None and Path(root).is_dir() else None
        save_checkpoint(root, iteration, self.model_chunks, self.optimizer, self.scheduler,
                        self.args, self.plan)
        if previous and previous != iteration and previous % retain and torch.distributed.get_rank() == 0:
            # --save-retain-interval, as Megatron-LM: the checkpoint this one replaces goes unless
            # it falls on the interval (a symbolic link is kept: someone put it there).
            old = iteration_dir(root, previous)
            if not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
                print_rank_0(f"  deleted checkpoint from iteration {previous:7d} at {root} (--save-retain-interval)")
        if self.progress is not None and progress:
            self.progress.checkpoint_saved(iteration, self.progress.operations_at_start + self.operations_this_job,
                                           self.schedule.consumed_samples(iteration) * self.args.seq_length)


# ----- the run ----------------------------------------------------------------------------


def _print_setup(args: argparse.Namespace, plan: Plan, plan_source: str | None, patches: list[str],
                 schedule: BatchSchedule, again: bool = False) -> None:
    if not again:  # an in-process restart's flags are the job's: printed once
        print_rank_0(arguments_block(args))
    print_rank_0(
        f"using world size: {plan.world_size}, data-parallel size: {plan.data_parallel}, "
        f"context-parallel size: {plan.context_parallel}, " + _model_parallel_sizes(plan))
    print_rank_0(f"> hetero plan: {plan_source or 'none (uniform Megatron plan)'}: {plan.summary()}")
    if plan_source:
        for logical in range(plan.world_size):
            c, d = plan.grid.coords(logical), plan.device_of_logical(logical)
            print_rank_0(
                f"    logical rank {logical:4d} (tp {c.tp_rank}, "
                + (f"cp {c.cp_rank}, " if plan.context_parallel > 1 else "")
                + (f"template {c.template}, " if plan.num_templates > 1 else "")
                + f"dp {c.dp_rank}, pp {c.pp_rank}) "
                f"-> launch rank {plan.launch_rank(logical):4d} on {d.host} ({d.device_type}, {d.vendor})"
            )
    if schedule.ramps:
        print_rank_0("> batch-size ramp-up (--rampup-batch-size), each step split over the replicas "
                     "in the plan's proportions (largest remainder):")
        for line in schedule.describe():
            print_rank_0(line)
    print_rank_0(f"> megatron-core {installed_megatron_core()} patches applied: {', '.join(patches) or 'none'}")
    for note in getattr(args, "noop_flags", ()):  # said once, as Megatron-LM's own warnings
        print_rank_0(f"> {note}")
    for note in args.startup_notes:
        print_rank_0(f"WARNING: {note}")
    for line in performance_startup_lines(args, plan, resolve_transformer_impl(args)):
        print_rank_0(line)
    note = substitution_note(getattr(args, "cpu_substitutions", []))
    if note:  # one line for every GPU-only choice the CPU replaced (cpu_device.py)
        print_rank_0(f"> {note}")


def _model_parallel_sizes(plan: Plan) -> str:
    """Megatron-LM's sizes line, a pipeline of each template."""
    parts = []
    for template in plan.templates:
        degrees = template.stage_tensor_parallel
        tp = "/".join(map(str, degrees)) if len(set(degrees)) > 1 else str(template.tensor_parallel)
        parts.append(f"tensor-model-parallel size: {tp}, pipeline-model-parallel size: {template.pipeline_parallel}")
    if len(parts) == 1:
        return parts[0]
    return "; ".join(f"template {k}: {part}" for k, part in enumerate(parts))


def run(args: argparse.Namespace, plan: Plan, plan_source: str | None, launch: Launch,
        argv: Sequence[str] = ()) -> None:
    """Steps 3-6 of start-up, then training. With --inprocess-restart the process lives on
    through lost and returned nodes: each re-plan of the job is a new incarnation (process
    groups, model, optimizer) built in this process, its state restored from memory."""
    start_time = time.time()  # --exit-duration-in-mins counts from here, as in Megatron-LM
    data.check_data_paths(args)
    patches = startup.start_megatron_core(args.hetero_allow_untested_megatron_core)
    restart = InProcessRestart.of(args)
    rejoin = None
    if restart is not None and restart.joining:  # a returned node's process: the job restores it
        rejoin = wait_for_rejoin(restart.control_dir, restart.epoch, timeout_s=args.inprocess_barrier_timeout)
    while True:
        if restart is not None:
            restart.store.layouts = None  # under a new plan the ranks' snapshots hold other boxes
        ctx = startup.init_distributed(args, plan, plan_source)
        watchdog = Watchdog(distributed.job_store(), launch.rank, plan, lambda: _resume_hint(args),
                            exit_signal=signal.Signals[args.exit_signal] if args.exit_signal_handler else None,
                            recover=restart is not None,
                            peer_timeout_s=args.inprocess_heartbeat_timeout if restart is not None else None).start()
        try:
            outcome = _train(args, plan, plan_source, ctx, patches, start_time,
                             watchdog.exit_requested if args.exit_signal_handler else None, restart, rejoin)
        except HeteroError as err:  # reported here; ranks still waiting for this one stop too
            if launch.world_size > 1:
                watchdog.defer_to_published_stop()
            watchdog.finish()
            watchdog.publish_stop(str(err))
            raise
        except RuntimeError as err:  # gloo/NCCL errors; a lost peer ends the process in handle()
            if launch.world_size > 1:
                watchdog.handle(f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
            if restart is None or not watchdog.recovering:
                raise  # no process was lost: keep the real error and its traceback
            outcome = Outcome(lost=True)
        where = place(plan.devices[launch.rank].host,
                      [r for r, d in enumerate(plan.devices) if d.host == plan.devices[launch.rank].host].index(launch.rank))
        if outcome.rejoin is None and not outcome.lost:
            watchdog.finish()
            torch.distributed.destroy_process_group()
            if restart is not None:
                events.emit(events.SnapshotCost(seconds=restart.snapshot_seconds, host_bytes=restart.store.nbytes))
                report_finished(restart.control_dir, restart.epoch, where)
            return
        watchdog.stop()
        if outcome.lost:
            watchdog.publish_recovering()
        if not outcome.lost:
            finalize_pending_saves()  # (after a loss a save in flight cannot finish: it stays incomplete)
        teardown()  # closes this rank's connections: peers still waiting on it fail and follow
        rejoin = outcome.rejoin or restart.after_loss(plan, launch.rank, where,
                                                      timeout_s=args.inprocess_barrier_timeout)
        restart.epoch = rejoin.epoch
        variables = launch_environment(rejoin, where)
        if variables is None:
            print(f"[{where}] the job's re-plan (epoch {rejoin.epoch}) leaves this process out; it ends", flush=True)
            return
        os.environ.update(variables)
        launch = distributed.read_launch()
        job = startup.configure(_with_plan(argv, rejoin.plan), launch.world_size, launch)
        args, plan, plan_source = job.args, job.plan, job.plan_source


def _with_plan(argv: Sequence[str], plan_path: str) -> list[str]:
    """The command line with --hetero-plan pointing at plan_path."""
    argv = list(argv)
    for index, arg in enumerate(argv):
        if arg == "--hetero-plan" and index + 1 < len(argv):
            argv[index + 1] = plan_path
            return argv
        if arg.startswith("--hetero-plan="):
            argv[index] = f"--hetero-plan={plan_path}"
            return argv
    return argv + ["--hetero-plan", plan_path]


def _resume_hint(args: argparse.Namespace) -> str:
    root = args.save or args.load
    latest = latest_iteration(root) if root else None
    if latest is None:
        return " No checkpoint was written (use --save DIR --save-interval N)."
    return (f" The last complete checkpoint is {iteration_dir(root, latest)}; resume with "
            f"--load {root} (re-plan with hetero-plan first if the cluster changed).")


def non_persistent_dir(args: argparse.Namespace, root: str | None) -> str | None:
    """Where global non-persistent checkpoints go: --non-persistent-global-ckpt-dir, else
    non_persistent under root (--save when saving, --load when loading), as Megatron-LM."""
    if args.non_persistent_global_ckpt_dir or root is None:
        return args.non_persistent_global_ckpt_dir
    return os.path.join(root, "non_persistent")


def checkpoint_to_load(args: argparse.Namespace) -> str | None:
    """--load (or its non-persistent checkpoint, where that one is at least as new), or
    --pretrained-checkpoint while --load holds no checkpoint: then the weights are fine-tuned
    from it (--finetune), as Megatron-LM does."""
    persistent = latest_iteration(args.load) if args.load else None
    transient_dir = non_persistent_dir(args, args.load) if args.non_persistent_ckpt_type else None
    if transient_dir and args.ckpt_step is None and Path(transient_dir).is_dir():
        transient = latest_iteration(transient_dir)
        if transient is not None and (persistent is None or transient >= persistent):
            print_rank_0(f"loading the non-persistent checkpoint of iteration {transient} from {transient_dir}")
            return transient_dir
    if args.pretrained_checkpoint is None or persistent is not None:
        return args.load
    if latest_iteration(args.pretrained_checkpoint) is None:
        raise HeteroError(f"--pretrained-checkpoint {args.pretrained_checkpoint}: no checkpoint there"
                          + (f" (nor in --load {args.load})" if args.load else "")
                          + "; give the --save directory of the run to start from")
    print_rank_0(f"no checkpoint in --load {args.load}: fine-tuning from --pretrained-checkpoint "
                 f"{args.pretrained_checkpoint}")
    args.finetune = True
    return args.pretrained_checkpoint


def _train(args: argparse.Namespace, plan: Plan, plan_source: str | None, ctx: RankIdentity,
           patches: list[str], start_time: float, exit_requested: Callable[[], bool] | None,
           restart: InProcessRestart | None = None, rejoin: Rejoin | None = None) -> Outcome:
    schedule = BatchSchedule(plan, args.rampup_batch_size)
    _print_setup(args, plan, plan_source, patches, schedule, again=rejoin is not None)
    if args.disable_jit_fuser:
        disable_jit_fuser()
    load_dir = checkpoint_to_load(args)
    if load_dir and (args.exit_on_missing_checkpoint or args.ckpt_convert_format) and latest_iteration(load_dir) is None:
        # As Megatron-LM: a job meant to resume ends (successfully) instead of starting afresh.
        print_rank_0(f">> '--exit-on-missing-checkpoint' set ... no checkpoint in {load_dir}, exiting.")
        return Outcome()
    set_random_seed(args.seed, args.data_parallel_random_init)
    if args.deterministic_mode:
        torch.use_deterministic_algorithms(True)
    timers = Timers(args.timing_log_level, args.timing_log_option)

    print_rank_0(f"> building {args.tokenizer_type} tokenizer ...")
    tokenizer = startup.build_tokenizer(args, plan)  # pads the vocabulary, checks the plan's
    print_rank_0(
        f" > padded vocab (size: {tokenizer.vocab_size}) with "
        f"{args.padded_vocab_size - tokenizer.vocab_size} dummy tokens "
        f"(new size: {args.padded_vocab_size})"
    )

    print_rank_0("building GPT model ...")
    if args.record_memory_history:  # as Megatron-LM's model provider: from before the model on
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    config, model_chunks = startup.build_model(args, plan, timers)
    if parallel_state.get_data_parallel_rank() == 0:
        print_all(
            " > number of parameters on (tensor, pipeline) model parallel rank "
            f"({parallel_state.get_tensor_model_parallel_rank()}, "
            f"{parallel_state.get_pipeline_model_parallel_rank()}): {count_parameters(model_chunks)}"
        )
    optimizer, scheduler = build_optimizer(args, plan, model_chunks, config.params_dtype, timers)
    config.grad_scale_func = optimizer.scale_loss

    print_rank_0("> building train, validation, and test datasets ...")
    if args.mock_data:  # mock data has no index cache to save; megatron-core warns per split
        logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)
    train_ds, valid_ds, test_ds = data.build_datasets(
        args, tokenizer, schedule.consumed_samples(args.train_iters))

    metrics = MetricsWriter(args)
    moe = MoEMetrics(args) if args.num_experts is not None else None
    adapter = None
    if args.hetero_adapt:
        adapter = adapt.Adapter(plan, args.rampup_batch_size,
                          args.hetero_adapt_output or adapt.default_output(args.save))
    trainer = Trainer(args, plan, ctx, model_chunks, optimizer, scheduler, schedule, timers, metrics,
                      moe, start_time, exit_requested, adapter)
    trainer.restart = restart
    start_iteration = 0
    if rejoin is not None:  # in-process restart: the state from the ranks' snapshots
        started = time.perf_counter()
        try:
            start_iteration = restart.restore(model_chunks, optimizer, scheduler)
            source, detail = "memory", ""
            print_rank_0(f"> in-process restart: state of iteration {start_iteration} restored from memory "
                         f"under the new plan in {time.perf_counter() - started:.2f} s (no file read)")
        except LostState as err:
            fallback = checkpoint_to_load(args) or (args.save if args.save and latest_iteration(args.save) else None)
            said_lost_state(err, fallback)
            restart.store.clear()  # of another course of training than the one resumed
            source, detail = ("disk", f"{err}; loaded {fallback}") if fallback else ("none", str(err))
            if fallback:
                start_iteration, _ = load_checkpoint(fallback, model_chunks, optimizer, scheduler, args)
        if torch.distributed.get_rank() == 0:
            events.emit(events.StateRestored(epoch=restart.epoch, iteration=start_iteration, source=source,
                                             seconds=time.perf_counter() - started, detail=detail))
    elif load_dir:
        start_iteration, _ = load_checkpoint(load_dir, model_chunks, optimizer, scheduler, args)
    if args.ckpt_convert_format is not None:
        # As Megatron-LM: the loaded checkpoint written again in the format asked for, then exit.
        target = os.path.join(args.ckpt_convert_save, args.ckpt_convert_format)
        trainer.save(start_iteration, target)
        print_rank_0(f"> converted checkpoint: {load_dir} -> {target} ({args.ckpt_convert_format}).")
        return Outcome()
    if args.check_weight_hash_across_dp_replicas_interval is not None:  # as Megatron-LM, before training
        check_weights_match_across_replicas(model_chunks, args, start_iteration)
    if args.log_progress and args.save:
        trainer.progress = ProgressLog(args.save, plan.world_size, floating_point_operations_so_far())
        trainer.progress.job_started()
    do_valid = (args.full_validation or args.eval_iters > 0) and valid_ds is not None
    repeat_after = None
    if args.full_validation and valid_ds is not None:
        trainer.valid_iters = data.full_validation_iters(args, len(valid_ds))
        repeat_after = trainer.valid_iters * plan.global_batch_size
        print_rank_0(f"> full validation: {repeat_after} samples of the validation split, "
                     f"{trainer.valid_iters} iterations per evaluation")
    # The data position follows from the iteration: iteration i reads the i-th global batch.
    # --dataloader-type cyclic: every split's samples go round in a new order each pass.
    cyclic_seed = args.seed if args.dataloader_type == "cyclic" else None
    valid_iterator = data.micro_batch_iterator(
        valid_ds, plan, args.num_workers, start_iteration=(start_iteration // args.eval_interval) * args.eval_iters,
        cyclic_seed=None if repeat_after else cyclic_seed, repeat_after=repeat_after)
    if args.skip_train:
        print_rank_0("skipping training (--skip-train) ...")
        iteration, saved, exited_early = start_iteration, True, False
    else:
        iteration, saved = trainer.train(
            start_iteration,
            lambda start, current: data.micro_batch_iterator(
                train_ds, current.plan, args.num_workers, start_iteration=start, schedule=current,
                cyclic_seed=cyclic_seed),
            valid_iterator,
            do_valid,
        )
        if trainer.rejoin is not None:  # a node taken back: the loop goes on under a new plan
            metrics.close()
            return Outcome(rejoin=trainer.rejoin)
        if adapter is not None:
            adapter.write_corrected_plan()
        print_rank_0(f"[after training is done] iterations: {iteration}")
        exited_early = iteration < args.train_iters
    if args.save and not saved and iteration > start_iteration:
        trainer.save(iteration)
    finalize_pending_saves()
    consumed = schedule.consumed_samples(iteration)
    if not exited_early:
        if do_valid and (args.skip_train or iteration % args.eval_interval):
            trainer.evaluate_and_print(valid_iterator, iteration, consumed)
        if args.eval_iters > 0 and test_ds is not None:
            trainer.evaluate_and_print(data.micro_batch_iterator(test_ds, plan, args.num_workers,
                                                                 cyclic_seed=cyclic_seed),
                                       iteration, consumed, split="test")
    metrics.close()
    return Outcome()
