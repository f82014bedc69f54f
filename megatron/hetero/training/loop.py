"""The training loop: one rank's Trainer, its train step, its log lines and metrics,
evaluation, and the checkpoints it saves while training."""

from __future__ import annotations

import gc
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from hetero import events
from hetero.plan import Plan
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.timers import Timers
from megatron.core.transformer.module import param_is_not_shared
from megatron.hetero import adapt, template_reduction
from megatron.hetero.agreement import any_rank
from megatron.hetero.batch_schedule import BatchSchedule
from megatron.hetero.checkpointing import finalize_pending_saves, iteration_dir, latest_iteration, save_checkpoint
from megatron.hetero.identity import RankIdentity
from megatron.hetero.log import (evaluation_block, is_last_rank, iteration_line, memory_line, memory_stats,
                                 print_all, print_rank_0, print_rank_last, ProgressLog)
from megatron.hetero.metrics import MetricsWriter
from megatron.hetero.model import model_spec
from megatron.hetero.moe import MoEMetrics
from megatron.hetero.mtp import MTPMetrics
from megatron.hetero.restart import InProcessRestart
from megatron.hetero.tracing import BUSY, TRACE
from megatron.hetero.training.housekeeping import (check_weights_match_across_replicas, dump_memory_snapshot,
                                                    empty_unused_memory, gathered_params, ProfilingWindow,
                                                    sync_params_now, synchronize_device, update_process_group_timeouts)
from megatron.hetero.training.resume import non_persistent_dir
from megatron.hetero.training.step import chunk_data_iterators, forward_step_for
from hetero.launch.inprocess import Rejoin


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
        if self.restart is not None:  # a snapshot taken beside this iteration copies what the step changes
            self.restart.finish_snapshot()
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
        return any_rank(minutes > self.args.exit_duration_in_mins)

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
            if self.restart is not None:  # the last snapshot's copies, arrived during the step
                self.restart.store.settle(block=False)
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
            elif args.save and args.non_persistent_ckpt_type == "global" and args.non_persistent_save_interval \
                    and iteration % args.non_persistent_save_interval == 0:  # (in_memory, local: snapshots)
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
                self.rejoin = self.restart.at_boundary(iteration, self.model_chunks, self.optimizer,
                                                       self.scheduler, self.plan)
                if self.rejoin is not None:
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
