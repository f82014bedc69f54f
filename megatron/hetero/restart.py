"""In-process restart (--inprocess-restart): the state in memory, and a lost node survived
without restarting a process.

Every --non-persistent-save-interval iterations (by default every iteration, unless the plan's
first iterations show that to cost more than SNAPSHOT_BUDGET of the time; then as often as
keeps within it) each rank snapshots its part of the model, optimizer and scheduler
state into host memory (its own shard of the distributed optimizer's state, no gather; after
the plan's first two snapshots, straight from the live tensors) and sends a copy to ranks on
other nodes (``--hetero-snapshot-replicas``, default 1; snapshots/). From the live tensors on the
CPU, the copy and its messages run on a thread beside the next iteration's forward and backward,
as a GPU's copies to host memory run beside its compute; the optimizer's step, which changes
what it copies, waits for it. When a node is lost, the survivors'
collectives fail; each survivor records where it stands (hetero/launch/inprocess.py:
``report_ready``) and waits for the job's supervisor to re-plan for the nodes left
(``Rejoin``). Then, in the same process: the process groups and megatron-core's parallel
state are torn down, the flags and the new plan are checked as at start-up, the groups and
this rank's stage of the new plan are built, and the state is restored from the snapshots the
survivors hold, re-sharded to the new layout (no file read). Training goes on from the
snapshot's iteration. When some shard's every copy was on lost nodes, the job falls back to
the last disk checkpoint and says so. A node that comes back is taken in the same way at an
iteration boundary: every rank takes a snapshot there and re-plans in place with the
returned node's new processes, which receive their state from the others.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import threading
import time
from dataclasses import dataclass
from statistics import median

import torch
import torch.distributed as dist

from hetero import env, events
from hetero.errors import HeteroError
from hetero.launch.inprocess import (CONTROL_DIR, REJOIN, Rejoin, launch_environment, report_ready,  # noqa: F401
                                     wait_for_rejoin)
from hetero.plan import Plan
from megatron.hetero import snapshots
from megatron.hetero.agreement import every_rank
from megatron.hetero.cpu_device import host_work
from megatron.hetero.identity import compute_device
from megatron.hetero.log import print_rank_0
from megatron.hetero.snapshots import LostState, SnapshotStore, box_of
from megatron.hetero.snapshots.taking import SnapshotTaker


SNAPSHOT_BUDGET = 0.03  # of the iteration time, for the default interval between snapshots
REJOIN_CHECK_EVERY = 10  # iterations, at most, between two looks for a re-plan (a returned node)
MEASURED_ITERATIONS = 16  # a plan's first iterations, timed with and without a snapshot before them


@dataclass
class Outcome:
    """How a run of the training loop ended: done, or to carry on under ``rejoin``."""

    rejoin: Rejoin | None = None
    lost: bool = False


class InProcessRestart:
    """One process's side of in-process restart (module docstring)."""

    def __init__(self, args: argparse.Namespace, control_dir: str) -> None:
        self.args = args
        self.control_dir = control_dir
        self.epoch = int(os.environ.get(REJOIN, "0"))
        self.replicas = args.hetero_snapshot_replicas
        self.store = SnapshotStore()
        self._buddies: tuple = (None, ([], []))  # (the plan, what buddies() gives under it)
        self.snapshot_seconds: list[float] = []
        self.begin_plan()

    def begin_plan(self) -> None:
        """A new plan (the first, or a re-plan): the interval between snapshots is
        --non-persistent-save-interval, or measured afresh by every rank of the plan alike."""
        self.store.layouts = None  # under a new plan the ranks' snapshots hold other boxes
        self._copies_group = None  # made with the plan's other groups (copies_group)
        self._taking: _Background | None = None  # a snapshot being taken beside training
        self._looked_beside = False  # the snapshot just taken looks for a re-plan beside training
        self._agreed: Rejoin | None = None  # a re-plan every rank saw, found beside training
        self.taker = SnapshotTaker(self.args)  # how this plan's snapshots are taken
        self.interval = self.args.non_persistent_save_interval or 1
        self.interval_measured = self.args.non_persistent_save_interval is None
        self._boundaries = 0  # iteration boundaries passed under this plan
        # Each iteration's time (wall, from the end of one boundary to the next) and whether a
        # snapshot came right before it (its copies travel while it computes).
        self._gaps: list[tuple[float, bool]] = []
        self._since: float | None = None
        self._snapshotted_last = False
        self._first_of_plan = len(self.snapshot_seconds)

    @classmethod
    def of(cls, args: argparse.Namespace) -> "InProcessRestart | None":
        if not args.inprocess_restart:
            return None
        control_dir = env.get(CONTROL_DIR)
        if not control_dir:
            raise HeteroError(f"--inprocess-restart needs a supervisor that re-plans the job ({CONTROL_DIR} "
                              "unset): start the job with the emulator's --elastic, hetero-launch --slurm or "
                              "the elastic runner, or drop --inprocess-restart")
        return cls(args, control_dir)

    @property
    def joining(self) -> bool:
        """This process belongs to a returned node: it joins a running job."""
        return REJOIN in os.environ and not self.store.held()

    # ----- snapshots ------------------------------------------------------------------

    def after_iteration(self, iteration: int, model, optimizer, scheduler, plan: Plan) -> None:
        self.store.settle(block=False)  # the last snapshot's copies, if they arrived meanwhile
        now = time.perf_counter()
        self._boundaries += 1
        if self._since is not None:
            self._gaps.append((now - self._since, self._snapshotted_last))
        if self.interval_measured and self._boundaries == MEASURED_ITERATIONS:
            self.interval = self.chosen_interval()
            self.interval_measured = False
        if self.interval_measured:
            # The first two snapshots are taken in full (snapshots/taking.py); then one at every
            # other boundary, so that iterations after a snapshot and iterations after none are
            # timed alike.
            due = self._boundaries <= 2 or self._boundaries % 2 == 0
        else:
            due = iteration % self.interval == 0
        if due:
            self.snapshot(iteration, model, optimizer, scheduler, plan)
        self._snapshotted_last = due
        self._since = now  # the next gap holds this boundary's snapshot, if any, and the iteration after it

    def chosen_interval(self) -> int:
        """The default interval: every iteration, unless the plan's first iterations show a
        snapshot to cost more than SNAPSHOT_BUDGET of an iteration; then the fewest
        iterations between snapshots that keep it within. A snapshot costs what it adds to
        the time from one iteration boundary to the next: its own time, where no other rank
        waits on this one anyway, and what its copies, travelling meanwhile, take from the
        iteration after it. Measured as the difference between the median gap with a snapshot
        and without (past the two snapshots taken in full), the ranks' mean: every rank times
        the same iterations of one job. A difference within twice its standard error is no
        evidence of a cost: iteration times vary by more than the budget, and a few samples'
        noise would otherwise raise the interval as often as a cost does."""
        taken = self.snapshot_seconds[self._first_of_plan:][2:] or [0.0]
        timed = self._gaps[2:]  # the gaps holding the full snapshots left out
        after = [gap for gap, snapshotted in timed if snapshotted] or [0.0]
        plain = [gap for gap, snapshotted in timed if not snapshotted] or after
        device = compute_device()  # NCCL reduces GPU tensors only
        slowest = torch.tensor([median(taken), median(plain)], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        mean = torch.tensor([median(after) - median(plain), _standard_error(after, plain)], dtype=torch.float64,
                            device=device)
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        snapshot_s, iteration_s = slowest.tolist()
        cost_s, error_s = (value / dist.get_world_size() for value in mean.tolist())
        shown_s = max(cost_s - 2 * error_s, 0.0)  # the cost the measurement shows beyond its noise
        interval = max(1, math.ceil(shown_s / (SNAPSHOT_BUDGET * iteration_s)))
        print_rank_0(f"> in-process restart: a snapshot takes {snapshot_s * 1e3:.0f} ms and adds {cost_s * 1e3:.0f} "
                     f"+- {error_s * 1e3:.0f} ms to the time between iteration boundaries, an iteration takes "
                     f"{iteration_s * 1e3:.0f} ms: a snapshot every {interval} iteration{'s' if interval > 1 else ''}, "
                     f"within {SNAPSHOT_BUDGET:.0%} of the time (--non-persistent-save-interval N to choose)")
        return interval

    def snapshot(self, iteration: int, model, optimizer, scheduler, plan: Plan) -> None:
        """This rank's state into host memory, and a copy to ranks on other nodes. Taken from
        the live tensors on the CPU, the copy runs beside the next iteration (module docstring)."""
        start = time.perf_counter()
        self.finish_snapshot()  # one at a time: the store is the taking thread's meanwhile
        if self._buddies[0] is not plan:  # the ranks a snapshot goes to are the plan's
            self._buddies = (plan, buddies(plan, dist.get_rank(), self.replicas))
        send_to, receive_from = self._buddies[1]
        group = self.copies_group()
        if self.taker.live and _device_of(model).type == "cpu":
            # The tensors it copies change only at the next optimizer step, which waits for it
            # (finish_snapshot); what else changes there (the scheduler, the param groups) is
            # taken now. On a GPU the copy to host memory is synchronous today.
            common, into, rank = self.taker.common(optimizer, scheduler), self.store.recycled(), dist.get_rank()
            seen = Rejoin.load(self.control_dir, self.epoch + 1)

            def take_and_send() -> None:
                with host_work():  # a GPU's host copies and sends while the device computes
                    self.store.add(self.taker.recipe.take(iteration, common, rank, into))
                    self.store.replicate(send_to, receive_from, group)
                    # The look for a re-plan that follows each snapshot (at_boundary), here
                    # beside training too: its answer is read at the next boundary.
                    if every_rank(seen is not None, group):
                        self._agreed = seen

            self._taking = _Background(take_and_send)
            self._looked_beside = True
        else:
            with host_work():
                self.store.add(self.taker.take(iteration, model, optimizer, scheduler, into=self.store.recycled()))
                self.store.replicate(send_to, receive_from, group)
        self.snapshot_seconds.append(time.perf_counter() - start)

    def finish_snapshot(self, raise_error: bool = True) -> None:
        """Waits for a snapshot being taken beside training (before the state it copies
        changes, or the store is read); the wait counts to the snapshot's time. Its error (a
        peer lost while its copies were posted) is raised here, in the training loop."""
        if self._taking is None:
            return
        start, taking = time.perf_counter(), self._taking
        self._taking = None
        error = taking.wait()
        if self.snapshot_seconds:
            self.snapshot_seconds[-1] += time.perf_counter() - start
        if error is not None and raise_error:
            raise error

    def end_snapshots(self, block: bool) -> None:
        """Where this plan's training ends: the snapshot being taken beside it is waited for,
        and its copies under way (block: waited for too; else kept only if they arrived)."""
        self.finish_snapshot(raise_error=False)
        self.store.settle(block=block)
        self.store.abandon()

    def copies_group(self):
        """The process group snapshots travel in (the plan's every rank, made by all alike
        right after the plan's other groups, training/run.py): gloo, as they are host memory
        whatever the job's backend (NCCL sends device memory only), and apart from the
        training's groups, so its threads can do host work (cpu_device.host_work) and its
        messages do not queue behind theirs."""
        if self._copies_group is None:
            with host_work():  # its threads stay where they were started
                self._copies_group = dist.new_group(backend="gloo")
        return self._copies_group

    def restore(self, model, optimizer, scheduler) -> int:
        """Every rank's state from the snapshots the ranks hold (collective); returns the
        iteration restored, or raises LostState (every rank alike)."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge, nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factory_merges
        from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
        from megatron.core.dist_checkpointing.utils import extract_sharded_base
        from megatron.hetero.checkpointing import apply_loaded, state_for_memory

        sharded, nonpersistent, factories = load_preprocess(
            state_for_memory(model, optimizer, scheduler, self.args, loading=True))
        sharded, _ = extract_sharded_base(sharded)
        wanted = [t for t in nested_values(sharded) if isinstance(t, ShardedTensor)]
        targets = {box_of(t): torch.empty(box_of(t).shape, dtype=t.dtype) for t in wanted}
        iteration, common = snapshots.restore(self.store, targets, self.copies_group())
        device = _device_of(model)

        def filled(value):
            if not isinstance(value, ShardedTensor):
                return value
            tensor = targets[box_of(value)]
            return tensor.reshape(value.data.shape if value.data is not None else tensor.shape).to(device)

        dict_list_map_inplace(filled, sharded)
        loaded = copy.deepcopy(common)  # the holder's own stays as taken
        merge(loaded, nonpersistent)
        merge(loaded, sharded)
        loaded = apply_factory_merges(loaded, factories)
        apply_loaded(loaded, model, optimizer, scheduler)
        return iteration

    # ----- re-plans ---------------------------------------------------------------------

    def at_boundary(self, iteration: int, model, optimizer, scheduler, plan: Plan) -> Rejoin | None:
        """After each iteration: the snapshot when one is due; the supervisor's re-plan when
        one is written (every rank then snapshots this iteration, if it has not, and stops).
        A re-plan is looked for after each snapshot (the generations the store keeps rely on
        that collective) and every REJOIN_CHECK_EVERY iterations, not after every iteration:
        one collective over the whole job fewer per iteration. A snapshot taken beside
        training looks beside it too (an all-reduce that would hold every rank up at the
        boundary, a throttled peer's period per step on the emulator), and a re-plan it finds
        is taken at the next boundary."""
        self.finish_snapshot()  # the last one's look for a re-plan included
        agreed, self._agreed, self._looked_beside = self._agreed, None, False
        self.after_iteration(iteration, model, optimizer, scheduler, plan)
        if agreed is not None:
            rejoin = agreed
        elif self._looked_beside or (not self._snapshotted_last and iteration % REJOIN_CHECK_EVERY):
            return None
        else:
            rejoin = self.planned_rejoin()
        if rejoin is not None:
            if not self._snapshotted_last:  # nothing done since the last snapshot may be lost
                self.snapshot(iteration, model, optimizer, scheduler, plan)
            print_rank_0(f"> in-process restart: re-planning at iteration {iteration} (epoch "
                         f"{rejoin.epoch}, {rejoin.world_size} processes)")
        return rejoin

    def planned_rejoin(self) -> Rejoin | None:
        """A re-plan the supervisor wrote while the job runs (a node came back), agreed by
        every rank at this iteration boundary (one scalar all-reduce over the job)."""
        rejoin = Rejoin.load(self.control_dir, self.epoch + 1)
        return rejoin if every_rank(rejoin is not None) else None  # every rank must see it: a file may lag

    def after_loss(self, plan: Plan, launch_rank: int, where: str, timeout_s: float,
                   named_peers: set[str] = frozenset()) -> Rejoin:
        """A node was lost: say where this process stands (and the peer addresses its
        library's error named), wait for the supervisor's re-plan."""
        newest = self.store.newest
        report_ready(self.control_dir, self.epoch + 1, where,
                     {"snapshot_iteration": newest, "named_peers": sorted(named_peers)})
        print(f"[{where}] in-process restart: a node of the job was lost; waiting for the job's re-plan "
              f"(epoch {self.epoch + 1}), newest snapshot of iteration {newest}", flush=True)
        return wait_for_rejoin(self.control_dir, self.epoch + 1, timeout_s)


def buddies(plan: Plan, logical_rank: int, replicas: int) -> tuple[list[int], list[int]]:
    """(ranks this rank sends its snapshot to, ranks it keeps copies for): the rank at the same
    place on each of the next ``replicas`` hosts in launch order (fewer with fewer hosts)."""
    hosts = [host for host, _ in plan.hosts()]
    on_host: dict[str, list[int]] = {host: [] for host in hosts}
    for rank in range(plan.world_size):
        on_host[plan.device_of_logical(rank).host].append(rank)

    def targets(rank: int) -> list[int]:
        host = plan.device_of_logical(rank).host
        index, position = hosts.index(host), on_host[host].index(rank)
        chosen = []
        for step in range(1, min(replicas, len(hosts) - 1) + 1):
            other = on_host[hosts[(index + step) % len(hosts)]]
            chosen.append(other[position % len(other)])
        return chosen

    return targets(logical_rank), [r for r in range(plan.world_size) if logical_rank in targets(r)]


class _Background:
    """A function run on a thread of its own; ``wait`` returns the exception it raised, if any."""

    def __init__(self, function) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            try:
                function()
            except BaseException as err:  # noqa: BLE001 - handed to the training loop by wait()
                self.error = err

        self.thread = threading.Thread(target=run, name="hetero-snapshot", daemon=True)
        self.thread.start()

    def wait(self) -> BaseException | None:
        self.thread.join()
        return self.error


def _standard_error(after: list[float], plain: list[float]) -> float:
    """The standard error of the difference of the two samples' medians, from their median
    absolute deviations (robust: a throttled or interrupted iteration is one outlier)."""
    def error(sample: list[float]) -> float:
        centre = median(sample)
        deviation = median(abs(x - centre) for x in sample) * 1.4826  # as a standard deviation
        return 1.2533 * deviation / math.sqrt(len(sample))  # a median's, of a normal sample

    return math.hypot(error(after), error(plain))


def _device_of(model) -> torch.device:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return next(chunks[0].parameters()).device


def teardown() -> None:
    """Everything one plan built in this process, undone: megatron-core's parallel state and
    RNG tracker, every process group, the plan's grid and reductions, this rank's identity."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron.hetero import distributed, stage_tensor_parallel, template_reduction
    from megatron.hetero.identity import set_this_rank
    from megatron.hetero.model import release_models

    shut_connections()
    release_models()
    stage_tensor_parallel.use_plan_grid(None)
    template_reduction.forget()
    set_this_rank(None)
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    distributed.forget_rendezvous()
    get_cuda_rng_tracker().reset()
    gc.collect()


def shut_connections() -> None:
    """Shuts every TCP connection of this process (gloo's and the old store's): a peer still
    blocked on one in a collective of the old plan fails at once and follows into the
    recovery. gloo has no abort, and its sockets stay open while anything still refers to a
    process group (megatron-core's buffers keep some alive until collected)."""
    import socket

    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        try:
            copy = os.dup(int(name))
        except OSError:
            continue  # closed meanwhile
        try:
            duplicate = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)  # not a socket
            continue
        try:
            if duplicate.family in (socket.AF_INET, socket.AF_INET6) and duplicate.type == socket.SOCK_STREAM \
                    and not duplicate.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                duplicate.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected
        finally:
            duplicate.close()


def said_lost_state(err: LostState, fallback: str | None) -> None:
    """The disk-checkpoint fallback, in the log and as an event the supervisor records."""
    print_rank_0(f"> in-process restart: {err}; falling back to the last disk checkpoint"
                 + (f" in {fallback}" if fallback else " (none: training starts over)"))
    if dist.get_rank() == 0:
        events.emit(events.Stopped(launch_rank=0, cause=f"snapshots lost: {err}; disk checkpoint {fallback}"))


__all__ = ["InProcessRestart", "Outcome", "buddies", "launch_environment", "said_lost_state", "teardown"]
