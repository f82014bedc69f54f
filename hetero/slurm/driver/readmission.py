"""Re-admission: nodes of the job's cluster that answer again after they were lost (or were
left out), taken back into the job - between attempts, or while one runs when a plan with
them is predicted faster (then at the job's next checkpoint). When a node counts as back,
and why an idle one goes into a second allocation of the driver's: driver.py's docstring,
"A returned node".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from hetero.errors import HeteroError
from hetero.events import CheckpointSaved, of_kind, read_events
from hetero.jobs import plan_for_recorded_job
from hetero.launch.elastic import predicted_tokens_per_s, speed_text
from hetero.slurm.driver.binding import Slot
from hetero.plan import Plan


@dataclass
class Readmission:
    """A returned node (or several) taken for the next plan, waiting for a checkpoint."""

    plan: Plan
    nodes: list[str]
    after_iteration: int  # stop at a checkpoint of a later iteration


def replannable(plan: Plan) -> bool:
    """Whether the plan records the job (cluster, model, training) to plan it again with."""
    return all(getattr(plan, name) is not None for name in ("cluster", "model", "training"))


class ReturnedNodes:
    """The re-admission methods of the driver's job (SlurmJob, job.py), which holds the state
    they read: lost nodes, slots, second allocations, the job's cluster."""

    def usable_returned(self, current: set[str]) -> tuple[list[str], list[str]]:
        """Nodes of the job's cluster outside `current` that could run again: (in the
        allocation and responding, idle in Slurm and so to be allocated)."""
        info = self._refresh_nodes()
        inside, idle = [], []
        for node in self.cluster_hosts:
            if node in current or node not in info:
                continue
            state = info[node].state.upper()
            if node in self.lost:
                lost = self.lost[node]
                lost["silent_seen"] |= not info[node].available
                restarted = self.slurm.slurmd_started.get(node, "") != lost["slurmd_started"]
                if not (info[node].available and (restarted or lost["silent_seen"])):
                    continue
            if node in self.slots and info[node].available:
                held = self.slurm.job_nodes(self.slots[node].job_id)
                if node in held:
                    inside.append(node)
                    continue
                self.slots.pop(node)
            if node not in self.slots and state.startswith("IDLE") and info[node].available:
                idle.append(node)
        return inside, idle

    def take(self, node: str) -> bool:
        """A one-node allocation of a returned idle node (the component's options)."""
        component = self.components[self.component_of[node]]
        # The component's options less its size and place (this is one named node) and the
        # batch-only ones; the time limit is what the main job has left.
        options = [o for o in component.sbatch if not o.startswith((
            "--nodes", "--constraint", "--nodelist", "--time", "--ntasks", "--output", "--error", "--open-mode",
            "--mail", "--job-name", "--array", "--dependency"))]
        left = self.slurm.time_left(self.allocation.job_id)
        if left:
            options.append(f"--time={left}")
        job_id, said = self.slurm.allocate(node, options, f"{self.record.get('job_name', 'hetero')}-readmit")
        if job_id is None:
            self.log(f"{node} is idle again but could not be allocated now ({said.splitlines()[-1] if said else '?'})")
            return False
        self.second_allocations[node] = job_id
        self.lost.pop(node, None)
        self.slots[node] = Slot(node, job_id, None)
        self.record.setdefault("second_allocations", {})[node] = job_id
        self.log(f"took {node} back in an allocation of its own (job {job_id}): Slurm does not give a node "
                 "back to a running job")
        return True

    def consider_returned(self, plan: Plan, events_dir: Path, in_process: bool = False) -> Readmission | None:
        """While an attempt runs: a returned node worth a restart (in_process: worth a re-plan
        of the running job), taken; None otherwise."""
        current = {h for h, _ in plan.hosts()}
        if not self.readmit or not replannable(plan) or set(self.cluster_hosts) <= current:
            return None
        inside, idle = self.usable_returned(current)
        candidates = [n for n in inside + idle if n not in self.declined]
        if not candidates:
            return None
        try:
            new_plan = plan_for_recorded_job(plan, self.cluster_for(current | set(candidates)))
        except HeteroError as err:
            self.log(f"{', '.join(candidates)} answer again, but planning with them failed ({err}); going on")
            self.declined |= set(candidates)
            return None
        used = [n for n in candidates if n in {h for h, _ in new_plan.hosts()}]
        old, new = predicted_tokens_per_s(plan), predicted_tokens_per_s(new_plan)
        if not used or (old is not None and new is not None and new <= old):
            self.log(f"{', '.join(candidates)} answer again; the job's plan for them "
                     f"({speed_text(old)} -> {speed_text(new)} tokens/s) is no better: not taken back")
            self.declined |= set(candidates)
            return None
        taken = [n for n in used if n in inside or self.take(n)]
        if taken != used:
            return None
        saved = [e.iteration for e in of_kind(read_events(events_dir), CheckpointSaved)]
        self.log(f"{', '.join(used)} answer again; re-planned with them: {new_plan.summary()}; predicted "
                 f"{speed_text(old)} -> {speed_text(new)} tokens/s; "
                 + ("taking them into the running job" if in_process else "restarting at the next checkpoint"))
        self.record.setdefault("readmissions", []).append({"time": time.time(), "nodes": used})
        return Readmission(new_plan, used, max(saved) if saved else 0)

    def release_unused(self, plan: Plan) -> None:
        """Releases the driver's own allocations of nodes the plan does not use."""
        used = {h for h, _ in plan.hosts()}
        for node, job_id in list(self.second_allocations.items()):
            if node not in used:
                self.slurm.cancel(job_id)
                del self.second_allocations[node]
                self.slots.pop(node, None)
