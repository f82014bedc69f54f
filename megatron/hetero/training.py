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
import random
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import numpy as np
import torch

from hetero import events
from hetero.errors import HeteroError
from hetero.plan import Plan
from megatron.hetero.patches import import_megatron_core

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
from megatron.hetero import adapt, data, distributed, startup
from megatron.core.timers import Timers
from megatron.hetero.cpu_device import substitution_note
from megatron.hetero.batch_schedule import BatchSchedule
from megatron.hetero.checkpointing import (
    finalize_pending_saves,
    iteration_dir,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
)
from megatron.hetero.distributed import Launch, RankContext
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
)
from megatron.hetero.metrics import MetricsWriter
from megatron.hetero.model import (
    count_parameters,
    model_spec,
    resolve_transformer_impl,
)
from megatron.hetero.moe import MoEMetrics
from megatron.hetero.performance import startup_lines as performance_startup_lines
from megatron.hetero.tracing import BUSY, TRACE
from megatron.hetero.watchdog import Watchdog


def set_random_seed(seed: int) -> None:
    """Megatron-LM's seeding: a different stream per pipeline stage, RNG tracker for TP."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
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
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if v is not None}
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
        OptimizerConfig(
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
        # Here the checkpoint's schedule is resumed in both cases (no traceback).
        use_checkpoint_opt_param_scheduler=True,
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

    def __init__(self, args, plan: Plan, ctx: RankContext, model_chunks: list, optimizer, scheduler,
                 schedule: BatchSchedule, timers: Timers, metrics: MetricsWriter,
                 moe: MoEMetrics | None = None, start_time: float | None = None,
                 exit_requested: Callable[[], bool] | None = None, adapter: adapt.Adapter | None = None):
        self.args, self.plan, self.ctx = args, plan, ctx
        self.adapter = adapter  # --hetero-adapt: re-splits self.plan's replicas while training
        self.eval_plan = plan  # evaluation keeps the split its data iterators were made with
        self.exit_requested = exit_requested  # --exit-signal-handler: agreed by all ranks
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.model = model_chunks[0]  # checkpoints: one chunk (virtual stages are refused there)
        self.schedule, self.timers, self.metrics, self.moe = schedule, timers, metrics, moe
        self.spec = model_spec(args)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.forward_backward = get_forward_backward_func()
        self.start_time = start_time or time.time()

    def _reduce_losses(self, losses_per_micro_batch: list[dict]) -> dict[str, float]:
        """Token-weighted mean over every replica's micro-batches (known on the last stage)."""
        if not parallel_state.is_pipeline_last_stage():
            return {}
        reduced = {}
        for key in losses_per_micro_batch[0]:
            totals = torch.stack([m[key].view(-1) for m in losses_per_micro_batch]).sum(dim=0)
            torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
            reduced[key] = (totals[0] / totals[1].clamp(min=1)).item()
        return reduced

    def _run_schedule(self, data_iterator, num_micro_batches: int, forward_only: bool) -> dict[str, float]:
        losses = self.forward_backward(
            forward_step_func=forward_step,
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
    def evaluate(self, data_iterator) -> dict[str, float]:
        """--eval-iters iterations of the plan's global batch, forward only."""
        args = self.args
        if args.manual_gc and args.manual_gc_eval:
            gc.collect()
        totals: dict[str, float] = {}
        num_micro_batches = self.eval_plan.replicas[self.dp_rank].num_micro_batches
        with gathered_params(self.model_chunks, args):
            for chunk in self.model_chunks:
                chunk.eval()
            for _ in range(args.eval_iters):
                for key, value in self._run_schedule(data_iterator, num_micro_batches,
                                                     forward_only=True).items():
                    totals[key] = totals.get(key, 0.0) + value
                if args.empty_unused_memory_level >= 1:
                    empty_unused_memory()
            for chunk in self.model_chunks:
                chunk.train()
        if args.manual_gc and args.manual_gc_eval:
            gc.collect()
        return {k: v / args.eval_iters for k, v in totals.items()}

    def evaluate_and_print(self, data_iterator, iteration: int, consumed_samples: int,
                           split: str = "validation") -> None:
        losses = self.evaluate(data_iterator)
        print_rank_last(evaluation_block(f"iteration {iteration} on {split} set", losses))
        if split == "validation":
            self.metrics.validation(iteration, consumed_samples, losses)

    def _params_norm(self) -> float:
        """L2 norm of the whole model: each parameter counted once across TP and PP."""
        squares = torch.zeros(1, dtype=torch.float64)
        sync_params_now(self.model_chunks, self.args)
        for param in (p for chunk in self.model_chunks for p in chunk.parameters()):
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                squares += param.detach().double().pow(2).sum().cpu()
        torch.distributed.all_reduce(squares, group=parallel_state.get_model_parallel_group())
        return squares.sqrt().item()

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
        while iteration < args.train_iters:
            tracing = TRACE.enabled and iteration + 1 == TRACE.iteration
            if tracing:
                torch.distributed.barrier()
                TRACE.begin()
            if args.async_save:  # as Megatron-LM: publish background saves that finished
                finalize_pending_saves(blocking=False)
            start = time.perf_counter()
            global_batch_size = self.schedule.global_batch_size(consumed)
            losses, grad_norm, skipped, num_zeros = self.train_step(train_iterator, global_batch_size)
            iteration += 1
            consumed += global_batch_size
            if tracing:
                TRACE.end(self.ctx.logical_rank, self._trace_facts())
            saved = False
            stats.elapsed += time.perf_counter() - start
            if self.moe is not None:
                losses = {**losses, **self.moe.collect(
                    iteration, self.plan.data_parallel, global_batch_size // self.plan.micro_batch_size,
                    self.metrics.tensorboard, self.metrics.wandb)}
            stats.iterations += 1
            stats.skipped += int(skipped)
            if not skipped:
                stats.add_losses(losses)
                stats.nan += int(any(v != v for v in losses.values()))
            logging_now = iteration % args.log_interval == 0
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
                        print_all(memory_line(memory))
                        events.emit(memory)
            if evaluate and iteration % args.eval_interval == 0:
                self.evaluate_and_print(valid_iterator, iteration, consumed)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                self.save(iteration)
                saved = True
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
        return iteration, saved

    def _trace_facts(self) -> dict:
        device = self.plan.devices[self.ctx.launch.rank]
        return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "dp_rank": parallel_state.get_data_parallel_rank(),
                "host": device.host, "device_type": device.device_type}

    def save(self, iteration: int) -> None:
        sync_params_now(self.model_chunks, self.args)
        save_checkpoint(self.args.save, iteration, self.model, self.optimizer, self.scheduler,
                        self.args, self.plan)


# ----- the run ----------------------------------------------------------------------------


def _print_setup(args: argparse.Namespace, plan: Plan, plan_source: str | None, patches: list[str],
                 schedule: BatchSchedule) -> None:
    print_rank_0(arguments_block(args))
    print_rank_0(
        f"using world size: {plan.world_size}, data-parallel size: {plan.data_parallel}, "
        f"context-parallel size: 1, tensor-model-parallel size: "
        f"{'/'.join(map(str, plan.stage_tensor_parallel)) if plan.per_stage_tensor_parallel else plan.tensor_parallel}, "
        f"pipeline-model-parallel size: {plan.pipeline_parallel}"
    )
    print_rank_0(f"> hetero plan: {plan_source or 'none (uniform Megatron plan)'}: {plan.summary()}")
    if plan_source:
        for logical in range(plan.world_size):
            c, d = plan.coords(logical), plan.device_of_logical(logical)
            print_rank_0(
                f"    logical rank {logical:4d} (tp {c.tp_rank}, dp {c.dp_rank}, pp {c.pp_rank}) "
                f"-> launch rank {plan.launch_rank(logical):4d} on {d.host} ({d.device_type}, {d.vendor})"
            )
    if schedule.ramps:
        print_rank_0("> batch-size ramp-up (--rampup-batch-size), each step split over the replicas "
                     "in the plan's proportions (largest remainder):")
        for line in schedule.describe():
            print_rank_0(line)
    print_rank_0(f"> megatron-core patches applied: {', '.join(patches) or 'none'}")
    for note in getattr(args, "noop_flags", ()):  # said once, as Megatron-LM's own warnings
        print_rank_0(f"> {note}")
    for note in args.startup_notes:
        print_rank_0(f"WARNING: {note}")
    for line in performance_startup_lines(args, plan, resolve_transformer_impl(args)):
        print_rank_0(line)
    note = substitution_note(getattr(args, "cpu_substitutions", []))
    if note:  # one line for every GPU-only choice the CPU replaced (cpu_device.py)
        print_rank_0(f"> {note}")


def run(args: argparse.Namespace, plan: Plan, plan_source: str | None, launch: Launch) -> None:
    start_time = time.time()  # --exit-duration-in-mins counts from here, as in Megatron-LM
    data.check_data_paths(args)
    patches = startup.start_megatron_core()
    ctx = startup.init_distributed(args, plan, plan_source)
    watchdog = Watchdog(distributed.job_store(), launch.rank, plan, lambda: _resume_hint(args),
                        exit_signal=signal.Signals[args.exit_signal] if args.exit_signal_handler else None).start()
    try:
        _train(args, plan, plan_source, ctx, patches, start_time,
               watchdog.exit_requested if args.exit_signal_handler else None)
    except HeteroError as err:  # reported here; ranks still waiting for this one stop too
        if launch.world_size > 1:
            watchdog.defer_to_published_stop()
        watchdog.finish()
        watchdog.publish_stop(str(err))
        raise
    except RuntimeError as err:  # gloo/NCCL errors; a lost peer ends the process in handle()
        if launch.world_size > 1:
            watchdog.handle(f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
        raise  # no process was lost: keep the real error and its traceback
    watchdog.finish()
    torch.distributed.destroy_process_group()


def _resume_hint(args: argparse.Namespace) -> str:
    root = args.save or args.load
    latest = latest_iteration(root) if root else None
    if latest is None:
        return " No checkpoint was written (use --save DIR --save-interval N)."
    return (f" The last complete checkpoint is {iteration_dir(root, latest)}; resume with "
            f"--load {root} (re-plan with hetero-plan first if the cluster changed).")


def _train(args: argparse.Namespace, plan: Plan, plan_source: str | None, ctx: RankContext,
           patches: list[str], start_time: float,
           exit_requested: Callable[[], bool] | None) -> None:
    schedule = BatchSchedule(plan, args.rampup_batch_size)
    _print_setup(args, plan, plan_source, patches, schedule)
    set_random_seed(args.seed)
    if args.deterministic_mode:
        torch.use_deterministic_algorithms(True)
    timers = Timers(args.timing_log_level, "minmax")

    print_rank_0(f"> building {args.tokenizer_type} tokenizer ...")
    tokenizer = startup.build_tokenizer(args, plan)  # pads the vocabulary, checks the plan's
    print_rank_0(
        f" > padded vocab (size: {tokenizer.vocab_size}) with "
        f"{args.padded_vocab_size - tokenizer.vocab_size} dummy tokens "
        f"(new size: {args.padded_vocab_size})"
    )

    print_rank_0("building GPT model ...")
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
    start_iteration = 0
    if args.load:
        start_iteration, _ = load_checkpoint(args.load, model_chunks[0], optimizer, scheduler, args)
    do_valid = args.eval_iters > 0 and valid_ds is not None
    # The data position follows from the iteration: iteration i reads the i-th global batch.
    valid_iterator = data.micro_batch_iterator(
        valid_ds, plan, args.num_workers, start_iteration=(start_iteration // args.eval_interval) * args.eval_iters)
    if args.skip_train:
        print_rank_0("skipping training (--skip-train) ...")
        iteration, saved, exited_early = start_iteration, True, False
    else:
        iteration, saved = trainer.train(
            start_iteration,
            lambda start, current: data.micro_batch_iterator(
                train_ds, current.plan, args.num_workers, start_iteration=start, schedule=current),
            valid_iterator,
            do_valid,
        )
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
            trainer.evaluate_and_print(data.micro_batch_iterator(test_ds, plan, args.num_workers),
                                       iteration, consumed, split="test")
    metrics.close()
