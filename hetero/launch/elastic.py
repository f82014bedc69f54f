"""Elastic runs: a job that loses a node re-plans for the devices left and carries on.

    python -m tools.emulator --cluster C.yaml --plan plan.json --elastic -- pretrain_gpt.py <flags> \\
        --save DIR --save-interval N

The supervisor starts every node's launcher (a runner: local processes, or the emulated
cluster of tools/emulator) and waits. When the job fails because nodes were lost - a
node's launcher died, or ranks on other hosts record the lost ranks (LostRanks events,
hetero.events, in the attempt's own events directory) - it plans again
for the surviving nodes with the same planner, model, precision and global batch (the
plan records them), logs the old and the new plan's predicted speed, and restarts the
survivors with the new plan and ``--load DIR``: the last complete checkpoint re-shards
onto the new layout. Any other failure (bad input, a crash on every node) ends the run
with its exit code, as does running out of --max-restarts.

With ``--inprocess-restart`` among the training flags the survivors are not restarted: they
wait in their processes while the supervisor re-plans, then rebuild their groups and stage
and restore the state from the snapshots they hold in memory (hetero.launch.recovery; no
--save needed, and no file read). A restart from the last checkpoint remains the fallback.

Under in-process restart a node that comes back joins the running job at an iteration
boundary (hetero.launch.recovery: ``admit``). After a restart from the last checkpoint,
restart the supervisor with the full cluster's plan to use it again.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

from hetero.events import Event, LostRanks, of_kind
from hetero.errors import HeteroError
from hetero.launch.recovery import InProcessSupervisor
from hetero.launch.replan import (cluster_without, predicted_tokens_per_s, replan, reshape_cluster_spec,  # noqa: F401
                                  speed_text)
from hetero.plan import Plan


@dataclass
class AttemptResult:
    """How one launch of the job ended."""

    returncode: int
    # Hosts whose launcher died of a signal before the runner stopped anything itself.
    killed_hosts: set[str] = field(default_factory=set)
    lines: list[str] = field(default_factory=list)  # the job's output, for people
    events: list[Event] = field(default_factory=list)  # what its ranks recorded (hetero.events)


class NodeRunner(Protocol):
    def run(self, plan: Plan, plan_path: str, train_args: list[str], attempt: int,
            supervisor: InProcessSupervisor | None = None) -> AttemptResult:
        """Runs every node of the plan and waits for the job to end. supervisor (in-process
        restart): the runner tells it how to find its nodes' addresses and lost launchers
        (``address_of``, ``lost_now``), calls it when nodes are lost and asks it whether the
        job is done."""


def lost_hosts(result: AttemptResult, plan: Plan) -> set[str]:
    """Hosts lost in this attempt: killed launchers, and the hosts of ranks that ranks on other
    hosts record as lost (a rank lost on the reporter's own host is a process, not a node).
    Hosts are the plan's, found by launch rank."""
    lost = set(result.killed_hosts)
    for report in of_kind(result.events, LostRanks):
        if not 0 <= report.launch_rank < plan.world_size:
            continue  # not a rank of this plan: another run's events
        reporter_host = plan.devices[report.launch_rank].host
        lost |= {plan.devices[r].host for r in report.lost_launch_ranks
                 if 0 <= r < plan.world_size} - {reporter_host}
    return lost & {host for host, _ in plan.hosts()}


def with_load(train_args: Sequence[str], plan: Plan | None = None) -> list[str]:
    """The flags of a resumed attempt: --load the directory the job saves to; with the plan
    it resumes under, the --make-vocab-size-divisible-by that keeps the trained vocabulary at
    the plan's tensor-parallel degrees (the re-plan records it; the last flag given wins)."""
    args = list(train_args)
    save = _flag_value(args, "--save")
    if save is None:
        raise HeteroError("--elastic needs --save DIR --save-interval N among the training flags: "
                          "a restarted job resumes from the last checkpoint")
    if _flag_value(args, "--load") is None:
        args += ["--load", save]
    divisor = plan.training.make_vocab_size_divisible_by if plan is not None and plan.training else None
    if divisor is not None and _flag_value(args, "--make-vocab-size-divisible-by") != str(divisor):
        args += ["--make-vocab-size-divisible-by", str(divisor)]
    return args


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def run_elastic(plan_path: str, train_args: Sequence[str], runner: NodeRunner, run_dir: Path,
                max_restarts: int = 3, log: Callable[[str], None] = print) -> int:
    """Runs the job, re-planning after every lost node; returns the final exit code. With
    --inprocess-restart among the training flags the survivors carry on in their processes
    (hetero.launch.recovery); a restart from the last checkpoint is the fallback."""
    plan = Plan.load(plan_path)
    in_process = "--inprocess-restart" in train_args
    if not in_process:
        with_load(train_args)  # checks --save before anything starts
    run_dir.mkdir(parents=True, exist_ok=True)
    args = list(train_args)
    for attempt in range(max_restarts + 1):
        log(f"elastic: attempt {attempt} on {len(plan.hosts())} nodes "
            f"({', '.join(h for h, _ in plan.hosts())}), plan {plan_path}"
            + (" (in-process restart after a lost node)" if in_process else ""))
        supervisor = None
        if in_process:
            control = run_dir / f"attempt-{attempt}-control"
            shutil.rmtree(control, ignore_errors=True)
            supervisor = InProcessSupervisor(control, plan, run_dir, log=log)
        result = runner.run(plan, plan_path, args, attempt, supervisor=supervisor)
        if supervisor is not None:
            plan = supervisor.plan  # the plan the job ended under
        if result.returncode == 0:
            log(f"elastic: the job finished (attempt {attempt})")
            return 0
        lost = lost_hosts(result, plan)
        if not lost:
            log(f"elastic: the job failed with exit code {result.returncode} and lost no node; "
                "not restarting (see its errors above)")
            return result.returncode
        if attempt == max_restarts:
            log(f"elastic: lost {', '.join(sorted(lost))}, and all {max_restarts} restarts are used")
            return result.returncode
        if in_process and _flag_value(list(train_args), "--save") is None:
            log(f"elastic: lost {', '.join(sorted(lost))}; the job could not go on in its processes and has "
                "no --save DIR to restart from")
            return result.returncode
        new_plan = replan(plan, lost)
        plan_path = str(run_dir / f"plan-{attempt + 1}.json")
        new_plan.save(plan_path)
        old_speed, new_speed = predicted_tokens_per_s(plan), predicted_tokens_per_s(new_plan)
        log(f"elastic: lost {', '.join(sorted(lost))}; re-planned for "
            f"{', '.join(h for h, _ in new_plan.hosts())}: {new_plan.summary()}; predicted "
            f"{speed_text(old_speed)} -> {speed_text(new_speed)} tokens/s; wrote {plan_path}; resuming from "
            "the last checkpoint")
        plan, args = new_plan, with_load(train_args, new_plan)
    return 1

