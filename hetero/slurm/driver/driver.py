"""The supervisor of a planned job inside its Slurm allocation: the body of the batch script
that `hetero-launch --slurm` writes.

    python -m hetero.slurm.driver --run-dir RUN [--max-restarts 3] [--no-readmit] \\
        [--env [SELECTOR:]NAME=VALUE ...] [--emulate-devices] -- <Megatron flags>

It runs on the first node of component 0 with only the job's Python (it starts
pretrain_gpt.py processes; it imports neither torch nor Megatron).

Binding. The plan names device classes and counts, not necessarily real hosts. Component k
of the job holds the plan's hosts of node class k (launch.json); Slurm's nodes of that
component (SLURM_JOB_NODELIST_HET_GROUP_k; with --layout single the job's nodes with the
class's feature, or in its node list) are bound to them host by host in launch order:
a plan host that is one of the component's nodes keeps it, the others take the remaining
nodes in Slurm's order. Only host names change, so the launch-rank layout and with it the
plan's NIC-aware rank_order stay as planned. The bound plan (devices and recorded cluster
renamed; the cluster cut to the allocated nodes, each with the devices the job asked for
there) is RUN/plan-0.json; the rendezvous is the NodeAddr (`scontrol show node`) of the
first host's node: Slurm's node names need not resolve.

Starting. One srun step per node (`srun --het-group=K -w NODE -N1 -n1 --overlap`), each
running torchrun for that node with its --node-rank, rather than one srun over every
component whose tasks would be the ranks:
- torchrun numbers ranks by --node-rank, which we take from the plan's host order; srun
  numbers a multi-component step's tasks component by component, which is not the plan's
  launch order when classes interleave in it (its NIC-aware order would be lost);
- nodes run different numbers of ranks, and each node gets its own environment
  (HETERO_DEVICE per local rank, the fabric variables of its NIC kind);
- a lost node ends its own step only; the others stop through the job's watchdog, and the
  driver sees which node failed by its step;
- a node taken into a second allocation (re-admission, below) is one more step, by --jobid.
--overlap lets the next attempt's steps start while Slurm still cleans up a stopped one.
Every step's environment is the driver's less what belongs to component 0 alone: device
visibility (CUDA_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES, ...: slurmstepd sets them anew for
a step with GPUs, and would otherwise leak component 0's into a component without) and
srun's per-job inputs (SLURM_CPUS_PER_TASK, SLURM_MEM_PER_NODE, ...) - plus --env rules.

A lost node. Every attempt records its events in RUN/attempt-<n>-events. When a step ends
with an error, the driver waits until the steps still running are all on lost nodes, or for
--stop-grace-s, then stops what runs (SIGTERM to srun, which passes it on; SIGKILL and
scancel of the attempt's steps after a few seconds). Lost nodes: the hosts other ranks
recorded as lost (LostRanks; hetero.launch.elastic.lost_hosts), and nodes whose step still
runs after every other has ended and whose slurmd does not run a probe step (`srun -w NODE
true`): the ranks next to a crashed node often stop on their library's error (a closed
socket) before their watchdog has named the node; when an attempt fails and no rank named a
lost peer (one stopped on another error first, e.g. in a checkpoint write), every node is
probed. It then takes each lost node out of the allocation where Slurm lets a job shrink
(`scontrol update JobId=<component> NodeList=<the rest>`: a later component's node other
than its first; the leader, component 0, cannot be resized, its id standing for the whole
job), before Slurm declares it down. Other lost nodes stay in the job, unused (every step
names its node). Once Slurm declares such a node down (SlurmdTimeout), Slurm 22.05 with
--no-kill takes it out of its component (or ends that component alone, if it was its only
node) while component 0 holds more than one node, and otherwise ends the whole job: so
hetero-launch puts the class with the most nodes first. A lost node still in the job that
answers again runs its steps there again. With --layout single (one job holding every
class's nodes) any node but the batch node can leave, and Slurm itself takes a failed
one out (--no-kill). The driver then plans the recorded job
(model, training, profiles: hetero.jobs.plan_for_recorded_job, as run_elastic does) for the
nodes it has, writes RUN/plan-<n>.json and resumes with --load from the last checkpoint.

In-process restart. With --inprocess-restart among the flags a lost node costs no attempt:
the survivors keep their processes and the state in memory (megatron/hetero/restart.py).
The driver re-plans for the nodes left as soon as a survivor reports the loss (or a step
fails and its node runs no probe), writes the re-plan into RUN/attempt-<n>-control
(hetero.launch.recovery), takes the lost node out of the allocation as above, and the
attempt goes on. A returned node worth taking joins the running attempt at an iteration
boundary: one step on it starts its processes, which take their state from the others'
snapshots. driver.json lists these re-plans under the attempt's "replans". When the job
cannot go on in its processes, the attempt stops and the next resumes from the last
checkpoint, as without the flag.

A returned node. A node of the job's cluster that is not in the current plan is usable
again when it is still in the allocation and responding, or idle in Slurm (`scontrol show
node`). Slurm does not give a node back to a running heterogeneous job (`scontrol update
JobId=<component> NodeList=<more nodes>` is refused), so an idle node is taken into a second
one-node allocation of the driver's (`salloc --no-shell --immediate -w NODE`,
the component's options, the main job's remaining time), released when the driver ends.
Between attempts every usable node goes into the next plan. While an attempt runs the
driver checks every --poll-s: when the job's plan for the bigger set of nodes uses a
returned node and is predicted faster, it takes the node and, at the next checkpoint the
job writes, stops the job and resumes it on the new plan (--no-readmit: never).

What it writes: log lines (`hetero-slurm: ...`) between the ranks' output in the job's
output file, and RUN/driver.json, rewritten at every change: the allocation, the binding,
each attempt (plan, nodes, rendezvous, times, first iteration, checkpoint loaded, exit,
lost or returned nodes) and the outcome with its reason. It exits 0 when the job finishes;
otherwise with the job's exit code (1 when it has none), saying why it could not go on: no
node left, the restarts used, a failure that lost no node, a plan that cannot be made.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from hetero.errors import HeteroError
from hetero.jobs import plan_for_recorded_job
from hetero.launch.commands import split_at_double_dash
from hetero.launch.elastic import AttemptResult, predicted_tokens_per_s, speed_text, with_load
from hetero.launch.recovery import InProcessSupervisor
from hetero.slurm.driver.attempt import SlurmRunner, Stopped
from hetero.slurm.submit.env_rules import EnvRule
from hetero.slurm.driver.job import PREFIX, SlurmJob
from hetero.slurm.submit.options import DEFAULT_MAX_RESTARTS, DEFAULT_POLL_S
from hetero.slurm.driver.readmission import replannable
from hetero.plan import Plan


class _CannotGoOn(Exception):
    """Why the job ends after a failed attempt (the driver's outcome: failed)."""


class Driver(SlurmJob):
    """The supervisor: runs attempts until the job finishes or cannot go on."""

    def run(self) -> int:
        """Runs the job to its end; the driver's exit code."""
        try:
            return self._run()
        except Stopped as stop:
            return self.finish(128 + stop.args[0], "stopped", f"stopped by signal {stop.args[0]} (scancel, the time "
                               "limit, or Slurm ending the job)")

    def _run(self) -> int:
        try:
            plan = self.start()
        except HeteroError as err:
            return self.finish(2, "failed", f"cannot start: {err}")
        in_process = "--inprocess-restart" in self.train_args
        try:
            with_load(self.train_args)
            elastic = True
        except HeteroError:
            elastic = False
            self.log("no --save DIR --save-interval N among the flags: a lost node ends the job"
                     + (" when the survivors cannot go on in their processes" if in_process else ""))
        runner = SlurmRunner(self)
        plan_path = str(self.run_dir / "plan-0.json")
        args = list(self.train_args)
        restarts = 0
        attempt = 0
        while True:
            self.log(f"attempt {attempt} on {len(plan.hosts())} nodes ({', '.join(h for h, _ in plan.hosts())}), "
                     f"plan {plan_path}" + (" (in-process restart after a lost node)" if in_process else ""))
            supervisor = None
            if in_process:
                control = self.run_dir / f"attempt-{attempt}-control"
                shutil.rmtree(control, ignore_errors=True)
                supervisor = InProcessSupervisor(control, plan, self.run_dir, log=self.log)
            result = runner.run(plan, plan_path, args, attempt, supervisor=supervisor)
            if supervisor is not None:
                plan = supervisor.plan  # the plan the job ended under
            outcome = self.record["attempts"][-1]["outcome"]
            if outcome == "finished":
                return self.finish(0, "finished", f"the job finished (attempt {attempt})")
            if outcome == "readmit":
                new_plan = runner.readmission.plan
                why = f"took {', '.join(runner.readmission.nodes)} back"
            else:
                try:
                    new_plan, why = self._plan_after_loss(plan, result, attempt, restarts, elastic)
                except _CannotGoOn as stop:
                    return self.finish(result.returncode, "failed", str(stop))
                restarts += 1
            attempt += 1
            plan_path = self._next_plan(plan, new_plan, attempt, why)
            plan, args = new_plan, with_load(self.train_args, new_plan)

    def _plan_after_loss(self, plan: Plan, result: AttemptResult, attempt: int, restarts: int,
                         elastic: bool) -> tuple[Plan, str]:
        """After a failed attempt: the lost nodes out of the allocation, and the job planned
        for the nodes left (and any returned); (the plan, why) or _CannotGoOn."""
        lost = set(self.record["attempts"][-1]["lost"])
        if not lost:
            raise _CannotGoOn(f"the job failed with exit code {result.returncode} and lost no node; "
                              "not restarting (see its errors above)")
        self.log(f"attempt {attempt} lost {', '.join(sorted(lost))}")
        self.remove_nodes(lost)
        if not elastic:
            raise _CannotGoOn("lost a node, and the job saves no checkpoint to resume from (add --save DIR "
                              "--save-interval N)")
        if restarts >= self.max_restarts:
            raise _CannotGoOn(f"lost {', '.join(sorted(lost))}, and all {self.max_restarts} restarts are used "
                              "(--max-restarts)")
        if not replannable(plan):
            raise _CannotGoOn("lost a node, but the plan records no cluster/model/training to plan again with: "
                              "write it with hetero-plan")
        survivors = {h for h, _ in plan.hosts()} - lost
        inside, idle = self.usable_returned(survivors) if self.readmit else ([], [])
        back = inside + [n for n in idle if self.take(n)]
        if back:
            self.log(f"{', '.join(back)} answer again: planning with them too")
        nodes = survivors | set(back)
        if not nodes:
            raise _CannotGoOn("no node of the allocation is left")
        try:
            new_plan = plan_for_recorded_job(plan, self.cluster_for(nodes))
        except HeteroError as err:
            raise _CannotGoOn(f"cannot plan the job for {', '.join(sorted(nodes))}: {err}") from None
        return new_plan, f"lost {', '.join(sorted(lost))}"

    def _next_plan(self, plan: Plan, new_plan: Plan, attempt: int, why: str) -> str:
        """Makes new_plan the next attempt's: its nodes no longer lost, unused own allocations
        released; written as plan-<attempt>.json (its path)."""
        self.declined.clear()
        for host, _ in new_plan.hosts():
            self.lost.pop(host, None)
        self.release_unused(new_plan)
        plan_path = str(self.run_dir / f"plan-{attempt}.json")
        new_plan.save(plan_path)
        self.log(f"{why}; re-planned for {', '.join(h for h, _ in new_plan.hosts())}: {new_plan.summary()}; "
                 f"predicted {speed_text(predicted_tokens_per_s(plan))} -> "
                 f"{speed_text(predicted_tokens_per_s(new_plan))} tokens/s; wrote {plan_path}; resuming from "
                 "the last checkpoint")
        return plan_path


def _stop_on_signals() -> None:
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main(argv: Sequence[str] | None = None) -> int:
    own, train_args = split_at_double_dash(argv)
    parser = argparse.ArgumentParser(prog="python -m hetero.slurm.driver", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="the directory hetero-launch --slurm wrote")
    parser.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS)
    parser.add_argument("--no-readmit", action="store_true")
    parser.add_argument("--master-port", type=int, default=29500, help="attempt n uses this port + n")
    parser.add_argument("--script", default="pretrain_gpt.py")
    parser.add_argument("--emulate-devices", action="store_true")
    parser.add_argument("--env", action="append", default=[], metavar="[SELECTOR:]NAME=VALUE")
    parser.add_argument("--stop-grace-s", type=float, default=20.0,
                        help="after a step fails, how long the others have to stop by themselves")
    parser.add_argument("--poll-s", type=float, default=DEFAULT_POLL_S,
                        help="how often to look for returned nodes while the job runs")
    options = parser.parse_args(own)
    try:
        driver = Driver(Path(options.run_dir), train_args, max_restarts=options.max_restarts,
                        readmit=not options.no_readmit, master_port=options.master_port, script=options.script,
                        emulate_devices=options.emulate_devices,
                        env_rules=[EnvRule.parse(text) for text in options.env],
                        stop_grace_s=options.stop_grace_s, poll_s=options.poll_s)
    except HeteroError as err:
        print(f"{PREFIX} error: {err}", file=sys.stderr)
        return 2
    _stop_on_signals()
    return driver.run()


if __name__ == "__main__":
    sys.exit(main())
