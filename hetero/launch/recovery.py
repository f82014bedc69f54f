"""The supervisor's side of in-process restart: a lost node re-planned while the survivors
wait in their processes (hetero/launch/inprocess.py has the protocol, megatron/hetero/
restart.py the processes' side).

    supervisor = InProcessSupervisor(control_dir, plan, run_dir)
    supervisor.recover({"node-slow"})   # a node's launcher died: True when the job goes on
    supervisor.admit({"node-slow"})     # a lost node is back: it joins at an iteration boundary
    supervisor.done()                   # every process of the current plan finished

After a loss the survivors stop at the failed iteration and say so in the control
directory; the supervisor re-plans the recorded job for the nodes left (hetero.jobs, as
every re-plan does), waits until every survivor is waiting, and writes the ``Rejoin``: the
new plan, the address of a fresh rendezvous store (hosted by the new launch rank 0), and each
survivor's new launch rank by its place (host, local rank). Processes keep their devices:
a survivor takes the new plan's rank for a device of its own host.

A node that comes back joins without a restart of the others: the supervisor re-plans the
job for the nodes it has then (from the first plan's cluster), has the runner start the
returned node's processes (``start_node``; they import and set up, then say they are ready),
and only then writes the ``Rejoin``: the running processes see it at their next iteration
boundary, snapshot there, and re-plan in place with the new processes, which receive their
state from the others' snapshots. The running job waits for no process start.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable

from hetero.errors import HeteroError
from hetero.launch.replan import predicted_tokens_per_s, replan, speed_text
from hetero.launch.inprocess import Rejoin, finished, places, ready, taken_back
from hetero.plan import Plan


def new_ranks(old: Plan, new: Plan, lost: set[str], joining: set[str] = frozenset()) -> dict[str, int]:
    """Each process's launch rank under ``new``: the new plan's ranks on a host go to that
    host's surviving processes in local-rank order (the same devices, by place); on a host
    that ``joining`` (a returned node), to its new processes, one per device."""
    survivors = [where for where in places(old) if where.rsplit(":", 1)[0] not in lost]
    by_host: dict[str, list[str]] = {}
    for where in survivors:
        by_host.setdefault(where.rsplit(":", 1)[0], []).append(where)
    for where in places(new):
        if where.rsplit(":", 1)[0] in joining:
            by_host.setdefault(where.rsplit(":", 1)[0], []).append(where)
    mapping = {}
    for where, rank in places(new).items():
        host, local = where.rsplit(":", 1)
        on_host = by_host.get(host, [])
        if int(local) >= len(on_host):
            raise HeteroError(f"the re-plan puts {int(local) + 1} processes on {host}, which has "
                              f"{len(on_host)} surviving processes")
        mapping[on_host[int(local)]] = rank
    return mapping


class InProcessSupervisor:
    """Re-plans a running job after lost nodes, without restarting its survivors."""

    def __init__(self, control_dir: str | Path, plan: Plan, run_dir: Path,
                 log: Callable[[str], None] = print, ready_timeout_s: float = 120.0) -> None:
        self.control_dir = Path(control_dir)
        self.plan, self.run_dir, self.log = plan, run_dir, log
        self.first_plan = plan  # its cluster is every node the job may use
        self.finished_before: tuple[Plan, int] | None = None  # the plan a Rejoin replaced, its epoch
        self.ready_timeout_s = ready_timeout_s
        self.epoch = 0
        self.lost: set[str] = set()
        self.recovery_seconds: list[float] = []
        # Set by the runner that starts the nodes: where a node's processes listen (the new
        # store's address), and the hosts whose launchers are gone now (a second node lost
        # while the survivors gather joins the same re-plan).
        self.address_of: Callable[[str], str] = lambda host: host
        self.lost_now: Callable[[], set[str]] = lambda: set()
        # Starts a returned node's processes for a re-plan (host, epoch, plan): they join the job.
        self.start_node: Callable[[str, int, Plan], None] | None = None
        self.join_seconds: list[float] = []

    def recover(self, lost: set[str]) -> bool:
        """Re-plans for the nodes left and tells the survivors (module docstring); False when
        the job cannot go on in its processes (every node lost, a survivor that never reports)."""
        lost = (lost & {host for host, _ in self.plan.hosts()}) - self.lost
        if not lost:
            return True
        started = time.monotonic()
        try:
            new_plan = replan(self.plan, self.lost | lost)
        except HeteroError as err:
            self.log(f"elastic: lost {', '.join(sorted(lost))}; no re-plan for the nodes left ({err})")
            return False
        epoch, plan_path = self._save_plan(new_plan)
        ranks = new_ranks(self.plan, new_plan, self.lost | lost)
        waiting = {where for where in places(self.plan) if where.rsplit(":", 1)[0] not in self.lost | lost}
        deadline = time.monotonic() + self.ready_timeout_s
        while not waiting <= {r["place"] for r in ready(self.control_dir, epoch)}:
            more = self.lost_now() - self.lost - lost
            if more:
                return self.recover(lost | more)
            if time.monotonic() > deadline:
                missing = waiting - {r["place"] for r in ready(self.control_dir, epoch)}
                self.log(f"elastic: {', '.join(sorted(missing))} did not stop for the re-plan within "
                         f"{self.ready_timeout_s:.0f} s; restarting the job instead")
                return False
            time.sleep(0.05)
        self._write_rejoin(epoch, plan_path, new_plan, ranks)
        self.recovery_seconds.append(time.monotonic() - started)
        self.log(f"elastic: lost {', '.join(sorted(lost))}; re-planned in-process for "
                 f"{', '.join(h for h, _ in new_plan.hosts())}: {new_plan.summary()}; predicted "
                 f"{speed_text(predicted_tokens_per_s(self.plan))} -> {speed_text(predicted_tokens_per_s(new_plan))} "
                 f"tokens/s; wrote {plan_path}; {len(ranks)} processes carry on in place "
                 f"({self.recovery_seconds[-1]:.1f} s from the loss seen to the re-plan)")
        self.finished_before = None
        self.plan, self.epoch = new_plan, epoch
        self.lost |= lost
        return True

    def admit(self, back: set[str], new_plan: Plan | None = None) -> bool:
        """Takes nodes that came back into the running job (module docstring), under
        ``new_plan`` when the runner planned it (default: the first plan's cluster less the
        nodes still lost); False when they were not taken (no plan with them, a runner that
        cannot start them, their processes not ready in time, a node lost meanwhile)."""
        back -= {host for host, _ in self.plan.hosts()}
        if not back or self.start_node is None:
            return False
        started = time.monotonic()
        if new_plan is None:
            try:
                new_plan = replan(self.first_plan, self.lost - back)
            except HeteroError as err:
                self.log(f"elastic: {', '.join(sorted(back))} came back; no re-plan with it ({err})")
                return False
        epoch, plan_path = self._save_plan(new_plan)
        ranks = new_ranks(self.plan, new_plan, self.lost, joining=back)
        joining = {where for where in ranks if where.rsplit(":", 1)[0] in back}
        for host in sorted(back):
            self.start_node(host, epoch, new_plan)
        deadline = time.monotonic() + self.ready_timeout_s
        while not joining <= {r["place"] for r in ready(self.control_dir, epoch)}:
            if self.lost_now() - self.lost or time.monotonic() > deadline:
                # The job goes on as it is; a Rejoin of this epoch written later (after a
                # loss) leaves the new processes out and they end.
                self.log(f"elastic: {', '.join(sorted(back))} came back, but "
                         + ("another node was lost meanwhile" if self.lost_now() - self.lost else
                            f"its processes were not ready within {self.ready_timeout_s:.0f} s")
                         + "; not taken in")
                return False
            time.sleep(0.05)
        self._write_rejoin(epoch, plan_path, new_plan, ranks)
        taken_back(self.control_dir, back)
        self.join_seconds.append(time.monotonic() - started)
        self.log(f"elastic: {', '.join(sorted(back))} came back; re-planned in-process for "
                 f"{', '.join(h for h, _ in new_plan.hosts())}: {new_plan.summary()}; predicted "
                 f"{speed_text(predicted_tokens_per_s(self.plan))} -> {speed_text(predicted_tokens_per_s(new_plan))} "
                 f"tokens/s; wrote {plan_path}; {len(joining)} processes join at the next iteration boundary "
                 f"({self.join_seconds[-1]:.1f} s to start them)")
        self.finished_before = (self.plan, self.epoch)
        self.plan, self.epoch = new_plan, epoch
        self.lost -= back
        return True

    def _save_plan(self, new_plan: Plan) -> tuple[int, Path]:
        """The next epoch and where its plan was written."""
        epoch = self.epoch + 1
        plan_path = self.run_dir / f"plan-inprocess-{epoch}.json"
        new_plan.save(plan_path)
        return epoch, plan_path

    def _write_rejoin(self, epoch: int, plan_path: Path, new_plan: Plan, ranks: dict[str, int]) -> None:
        """The re-plan every process reads: its plan, a fresh store hosted by the new rank 0."""
        store_host = self.address_of(new_plan.devices[0].host)
        Rejoin(epoch, str(plan_path), store_host, random.randint(30000, 60000), ranks).save(self.control_dir)

    def done(self) -> bool:
        """Every process of the current plan finished training (or, when a Rejoin came too
        late for the running processes to see it, every process of the plan before)."""
        if set(places(self.plan)) <= finished(self.control_dir, self.epoch):
            return True
        if self.finished_before is not None:
            plan, epoch = self.finished_before
            return set(places(plan)) <= finished(self.control_dir, epoch)
        return False
