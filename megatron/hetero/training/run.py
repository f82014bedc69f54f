"""The run: steps 3-6 of start-up, then training (``_train``); with --inprocess-restart,
the loop that carries the process on through lost and returned nodes (restart.py is its
state-in-memory side)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch

from hetero import events
from hetero.errors import HeteroError
from hetero.plan import Plan
from megatron.hetero.patches import disable_jit_fuser, import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import parallel_state
from megatron.core.timers import Timers
from megatron.hetero import adapt, data, distributed, startup
from megatron.hetero.batch_schedule import BatchSchedule
from megatron.hetero.checkpointing import (
    finalize_pending_saves,
    floating_point_operations_so_far,
    latest_iteration,
    load_checkpoint,
)
from megatron.hetero.distributed import Launch
from megatron.hetero.identity import RankIdentity
from megatron.hetero.log import print_all, print_rank_0, ProgressLog
from megatron.hetero.metrics import MetricsWriter
from megatron.hetero.model import count_parameters
from megatron.hetero.moe import MoEMetrics
from megatron.hetero.watchdog import Watchdog
from megatron.hetero.restart import (InProcessRestart, Outcome, launch_environment, said_lost_state, shut_connections,
                                    teardown)
from megatron.hetero.snapshots import LostState
from megatron.hetero.training.housekeeping import check_weights_match_across_replicas
from megatron.hetero.training.loop import Trainer
from megatron.hetero.training.optimizer import build_optimizer
from megatron.hetero.training.resume import _resume_hint, checkpoint_to_load
from megatron.hetero.training.setup_report import _print_setup
from megatron.hetero.training.step import set_random_seed
from hetero.launch.inprocess import Rejoin, places, report_finished, wait_for_rejoin


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
            restart.begin_plan()
        if rejoin is None:
            ctx = startup.init_distributed(args, plan, plan_source)
            if restart is not None:
                restart.copies_group()  # with the plan's other groups (see _set_up_replan)
        else:
            ctx, failed = _set_up_replan(args, plan, plan_source, launch, restart)
            if ctx is None:  # a member of the re-plan was lost after it was written: the next one
                where = next(at for at, rank in places(plan).items() if rank == launch.rank)
                print(f"[{where}] in-process restart: {failed} (re-plan of epoch {rejoin.epoch}); one of its "
                      "processes was lost after the re-plan", flush=True)
                rejoin = restart.after_loss(plan, launch.rank, where, timeout_s=args.inprocess_barrier_timeout)
                entered = _enter(rejoin, where, argv, restart)
                if entered is None:
                    return
                launch, args, plan, plan_source = entered
                continue
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
                watchdog.handle(f"{type(err).__name__}: {str(err).splitlines()[0][:120]}", error_text=str(err))
            if restart is None or not watchdog.recovering:
                raise  # no process was lost: keep the real error and its traceback
            outcome = Outcome(lost=True)
        where = next(at for at, rank in places(plan).items() if rank == launch.rank)
        if restart is not None and not outcome.lost:
            # The snapshot being taken, and its copies under way: waited for while every peer
            # is there (after a loss, once this rank's connections are shut, below).
            restart.end_snapshots(block=True)
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
        if outcome.lost:
            # A snapshot being taken beside training may wait on the lost peer: with this
            # rank's connections shut it ends at once. Its copies count only if they arrived.
            restart.end_snapshots(block=False)
        rejoin = outcome.rejoin or restart.after_loss(plan, launch.rank, where,
                                                      timeout_s=args.inprocess_barrier_timeout,
                                                      named_peers=watchdog.named_peers)
        entered = _enter(rejoin, where, argv, restart)
        if entered is None:
            return
        launch, args, plan, plan_source = entered


def _enter(rejoin: Rejoin, where: str, argv: Sequence[str], restart: InProcessRestart):
    """This process's launch, flags and plan under the re-plan ``rejoin``; None when the
    re-plan leaves it out."""
    restart.epoch = rejoin.epoch
    variables = launch_environment(rejoin, where)
    if variables is None:
        print(f"[{where}] the job's re-plan (epoch {rejoin.epoch}) leaves this process out; it ends", flush=True)
        return None
    os.environ.update(variables)
    launch = distributed.read_launch()
    job = startup.configure(_with_plan(argv, rejoin.plan), launch.world_size, launch)
    return launch, job.args, job.plan, job.plan_source


STUCK_SET_UP_GRACE_S = 10.0
STUCK_SET_UP_EXIT_CODE = 75  # EX_TEMPFAIL: the job goes on from its checkpoint


def _set_up_replan(args: argparse.Namespace, plan: Plan, plan_source: str | None,
                   launch: Launch, restart: InProcessRestart | None = None) -> tuple[RankIdentity | None, str]:
    """This process's groups under a re-plan (the snapshots' copies group with them), its
    processes met and its groups set up each within the heartbeat timeout; (None, what
    failed) when they were not. The bounds matter when a member dies between saying it
    waits and the set-up (two nodes killed moments apart): without them the others waited
    in the process groups' rendezvous for --distributed-timeout-minutes. A set-up still
    blocked at the bound has its connections shut, so that the store wait or the library
    call under way fails at once. One wait cannot be ended that way: gloo waiting for a
    member that published its address and died before connecting to it (no connection
    exists yet to shut, and gloo's own timeout does not end that wait). A set-up still
    blocked STUCK_SET_UP_GRACE_S later ends the process (_end_stuck_set_up): the job then
    resumes from its last checkpoint instead of waiting without end."""
    bound_s = args.inprocess_heartbeat_timeout
    missing = _meet_the_replan(launch, bound_s)
    if missing:
        return None, f"its processes did not all meet ({missing})"
    timer = threading.Timer(bound_s, shut_connections)
    stuck = threading.Timer(bound_s + STUCK_SET_UP_GRACE_S, _end_stuck_set_up, args=(bound_s + STUCK_SET_UP_GRACE_S,))
    timer.daemon = stuck.daemon = True
    timer.start()
    stuck.start()
    try:
        ctx = startup.init_distributed(args, plan, plan_source)
        if restart is not None:
            restart.copies_group()  # made here, within the bounds, not at the restore
        return ctx, ""
    except (RuntimeError, TimeoutError) as err:  # the library's or the store's error
        teardown()
        return None, f"its process groups were not set up within {bound_s:.0f} s ({_first_line(err)})"
    finally:
        timer.cancel()
        stuck.cancel()


def _end_stuck_set_up(waited_s: float) -> None:
    """Ends a process whose re-plan set-up outlived its bounds (_set_up_replan): the job
    resumes from its last checkpoint (the launcher's restart from disk) instead of hanging."""
    print(f"in-process restart (launch rank {os.environ.get('RANK', '?')}, pid {os.getpid()}): the re-plan's "
          f"process groups are still not set up after {waited_s:.0f} s: a member was lost while they "
          "connected, and gloo cannot give up that wait; this process ends, and the job resumes from "
          "its last checkpoint", flush=True)
    os._exit(STUCK_SET_UP_EXIT_CODE)


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0][:160] if str(err) else type(err).__name__


def _meet_the_replan(launch: Launch, timeout_s: float) -> str | None:
    """Whether every process of a re-plan reaches its rendezvous within ``timeout_s`` (the
    heartbeat timeout: they were all alive when the re-plan was written); None when they do,
    else what failed. Without this bound a member lost in between (two nodes killed moments
    apart, the second after it said it waits) held the others in the process groups' set-up
    for --distributed-timeout-minutes."""
    try:
        distributed.wait_for_every_rank(launch, timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError) as err:  # the store's host gone, or a member never came
        distributed.forget_rendezvous()
        return _first_line(err)
    return None


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
