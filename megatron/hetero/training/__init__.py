"""The training run: Megatron-LM's pretrain() reduced to what a GPT run needs, plan-aware.

Each data-parallel replica runs the 1F1B schedule over its own number of micro-batches;
megatron-core's per-token loss mode sums gradients and divides by the global token count,
so replicas of different size contribute exactly by the tokens they processed.

The package, by concept: step.py (one micro-batch: seeds, the batch, the forward step and
its loss), optimizer.py (the optimizer and its schedule), loop.py (the Trainer: train step,
logging, evaluation, saving), housekeeping.py (what the loop does around its steps: profiling,
timeouts, the weight check across replicas), resume.py (which checkpoint a run loads),
setup_report.py (what a run prints at start-up) and run.py (run(): start-up, the in-process
restart loop, _train). Everything is importable from here, as from the one module it was.
"""

from __future__ import annotations

from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
# (the imports below import megatron-core: after the call above)
from megatron.hetero.training.step import (
    _finite_loss,
    checked_forward_step,
    chunk_data_iterators,
    forward_step,
    forward_step_for,
    get_batch,
    loss_func,
    rank_seed,
    set_random_seed,
)
from megatron.hetero.training.housekeeping import (
    check_weights_match_across_replicas,
    dump_memory_snapshot,
    empty_unused_memory,
    first_differing_replica,
    gathered_params,
    ProfilingWindow,
    sync_params_now,
    synchronize_device,
    update_process_group_timeouts,
)
from megatron.hetero.training.optimizer import build_optimizer, build_scheduler, scheduler_steps
from megatron.hetero.training.resume import _resume_hint, checkpoint_to_load, non_persistent_dir
from megatron.hetero.training.loop import _IntervalStats, _number, TIMERS_TO_LOG, timers_to_log, Trainer
from megatron.hetero.training.setup_report import _model_parallel_sizes, _print_setup
from megatron.hetero.training.run import _train, _with_plan, run

__all__ = [
    "build_optimizer", "build_scheduler", "check_weights_match_across_replicas", "checked_forward_step",
    "checkpoint_to_load", "chunk_data_iterators", "dump_memory_snapshot", "empty_unused_memory",
    "first_differing_replica", "forward_step", "forward_step_for", "gathered_params", "get_batch", "loss_func",
    "non_persistent_dir", "ProfilingWindow", "rank_seed", "run", "scheduler_steps", "set_random_seed",
    "sync_params_now", "synchronize_device", "TIMERS_TO_LOG", "timers_to_log", "Trainer",
    "update_process_group_timeouts",
]
