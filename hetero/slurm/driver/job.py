"""The job in its allocation, as the driver sees it: binding the plan to the allocated nodes
at the start, where each node runs its steps (slots), lost nodes taken out of the
allocation, the cluster left for re-planning, and the record (driver.json, log lines)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hetero.errors import HeteroError
from hetero.io import write_json_atomic
from hetero.launch.elastic import cluster_without
from hetero.slurm.driver.binding import Allocation, Slot, bind_hosts, bound_plan, nodes_by_class
from hetero.slurm.client import Slurm
from hetero.slurm.submit.env_rules import EnvRule
from hetero.slurm.submit.options import DEFAULT_MAX_RESTARTS, DEFAULT_POLL_S
from hetero.slurm.driver.readmission import ReturnedNodes
from hetero.slurm.submit.run_dir import load_launch
from hetero.slurm.driver.steps import NodeSteps
from hetero.plan import Plan
from hetero.slurm import text as slurm_text
from hetero.spec.cluster import Cluster

PREFIX = "hetero-slurm:"
RECORD_FILE = "driver.json"


class SlurmJob(NodeSteps, ReturnedNodes):
    """The driver's state and its bookkeeping; the attempt loop is Driver's (driver.py)."""

    def __init__(self, run_dir: Path, train_args: list[str], *, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 readmit: bool = True, master_port: int = 29500, script: str = "pretrain_gpt.py",
                 emulate_devices: bool = False, env_rules: Sequence[EnvRule] = (), stop_grace_s: float = 20.0,
                 poll_s: float = DEFAULT_POLL_S, slurm: Slurm | None = None, environ: dict[str, str] | None = None):
        self.run_dir = run_dir.absolute()
        self.train_args = list(train_args)
        self.max_restarts, self.readmit = max_restarts, readmit
        self.master_port, self.script, self.emulate_devices = master_port, script, emulate_devices
        self.env_rules = list(env_rules)
        self.stop_grace_s, self.poll_s = stop_grace_s, poll_s
        self.slurm = slurm or Slurm(workdir=str(self.run_dir))
        self.environ = dict(os.environ if environ is None else environ)
        self.settings, self.components = load_launch(self.run_dir)
        self.python = sys.executable
        self.workdir = os.getcwd()
        self.slots: dict[str, Slot] = {}
        self.second_allocations: dict[str, str] = {}  # node -> job id of the driver's own allocation
        self.declined: set[str] = set()  # returned nodes the current plan's re-plan leaves out
        # Lost nodes: their slurmd's start time when lost, and whether Slurm has seen them
        # silent since. Slurm notices a dead node only after SlurmdTimeout (minutes on a real
        # cluster) and shows it idle or allocated meanwhile: it is back only once its slurmd
        # restarted or it answered again after Slurm had marked it silent.
        self.lost: dict[str, dict] = {}
        self._addresses: dict[str, str] = {}
        self._node_info: dict[str, slurm_text.SlurmNode] = {}
        self.record: dict = {"run_dir": str(self.run_dir), "attempts": [], "log": []}

    # ----- output -------------------------------------------------------------------------

    def log(self, message: str) -> None:
        print(f"{PREFIX} {message}", flush=True)
        self.record["log"].append({"time": time.time(), "message": message})
        self.save()

    def save(self) -> None:
        write_json_atomic(self.run_dir / RECORD_FILE, self.record)

    # ----- Slurm ---------------------------------------------------------------------------

    def address(self, node: str) -> str:
        """The node's NodeAddr (node names need not resolve inside the cluster)."""
        if node not in self._addresses:
            info = self._refresh_nodes().get(node)
            self._addresses[node] = (info.address if info is not None and info.address else node)
        return self._addresses[node]

    def _refresh_nodes(self) -> dict[str, slurm_text.SlurmNode]:
        self._node_info = self.slurm.nodes()
        return self._node_info

    def remove_nodes(self, lost: set[str]) -> None:
        """Takes lost nodes out of the allocation where Slurm lets a job shrink, before Slurm
        declares them down; the others stay in the job, unused (driver.py's docstring, "A
        lost node", says what Slurm does with them and why)."""
        self._refresh_nodes()
        for node in sorted(lost):
            self.lost[node] = {"slurmd_started": self.slurm.slurmd_started.get(node, ""), "silent_seen": False,
                               "time": time.time()}
            slot = self.slots.get(node)
            if slot is None:
                continue
            if node in self.second_allocations:
                self.slots.pop(node)
                self.slurm.cancel(self.second_allocations.pop(node))
                self.log(f"released {node}'s own allocation (job {slot.job_id})")
                continue
            job = self.slurm.job(slot.job_id)
            if node not in job.nodes:
                self.slots.pop(node)
                continue
            keep = [n for n in job.nodes if n != node]
            where = f"job {slot.job_id}" + (f" (component {slot.het_group})" if slot.het_group is not None else "")
            # A heterogeneous job's leader (component 0) cannot be resized ("not supported for
            # job arrays"), nor can any job lose its batch host or its last node.
            if keep and node != job.batch_host and slot.het_group != 0:
                try:
                    self.slurm.shrink(slot.job_id, keep)
                    self.slots.pop(node)
                    self.log(f"took {node} out of the allocation ({where} keeps {', '.join(keep)})")
                    continue
                except HeteroError as err:
                    self.log(f"could not take {node} out of the allocation ({err})")
            self.log(f"{node} stays in {where}, unused: {self._fate(node, slot, keep)}")

    def _fate(self, node: str, slot: Slot, keep: list[str]) -> str:
        """What Slurm does with a lost node left in the job once it declares it down (after
        SlurmdTimeout), as Slurm 22.05 does it with --no-kill (docs/slurm.md)."""
        back = "; it is taken back if it answers again before then"
        if not self.allocation.heterogeneous:
            return ("Slurm takes it out of the job once it declares the node down (SlurmdTimeout)" + back
                    if keep else "Slurm ends the job once it declares the node down (SlurmdTimeout)")
        leader = self.slurm.job_nodes(self.allocation.component_jobs[0])
        if len(leader) > 1:
            what = "takes it out of its component" if keep else "ends its component (the others go on)"
            return f"once Slurm declares the node down (SlurmdTimeout) it {what}" + back
        return ("Slurm ends the whole job once it declares the node down (SlurmdTimeout): component 0 holds "
                "a single node; going on until then" + back)

    def cluster_for(self, nodes: set[str]) -> Cluster:
        full = Cluster.from_dict(self.full_cluster, "the job's allocated cluster")
        return cluster_without(full, set(self.cluster_hosts) - nodes)

    def start(self) -> Plan:
        """Binds the plan to the allocation; the bound plan (plan-0.json)."""
        self.allocation = Allocation.from_environment(self.environ)
        allocated, jobs = self.allocation.nodes, self.allocation.component_jobs
        if self.settings.get("layout") == "single":  # one job holds every class's nodes
            allocated = nodes_by_class(allocated[0], self.components, self._refresh_nodes())
            jobs = jobs * len(self.components)
        self.record.update(job_id=self.allocation.job_id, started=time.time(),
                           components=[{"index": c.index, "job_id": j, "device_type": c.device_type,
                                        "ranks_per_node": c.ranks_per_node, "nodes": n}
                                       for c, j, n in zip(self.components, jobs, allocated)])
        plan = Plan.load(self.run_dir / self.settings["plan"])
        mapping = bind_hosts(self.components, allocated)
        bound = bound_plan(plan, mapping)
        self.component_of = {mapping[h]: c.index for c in self.components for h in c.hosts}
        for component, job_id in zip(self.components, jobs):
            for host in component.hosts:
                self.slots[mapping[host]] = Slot(mapping[host], job_id,
                                                 component.index if self.allocation.heterogeneous else None)
        self.cluster_hosts = [h for h, _ in bound.hosts()]
        self.device_of = {h: bound.devices[ranks[0]].device_type for h, ranks in bound.hosts()}
        self.nic_of = {}
        self.full_cluster = bound.cluster.model_dump(exclude_none=True) if bound.cluster is not None else None
        if self.full_cluster is not None:
            for node in Cluster.from_dict(self.full_cluster, "the job's allocated cluster").nodes:
                self.nic_of[node.host] = node.nic.kind.name
        self.record["binding"] = mapping
        self.record["job_name"] = self.environ.get("SLURM_JOB_NAME", "hetero")
        path = self.run_dir / "plan-0.json"
        bound.save(path)
        self.log(f"job {self.allocation.job_id}: bound the plan's hosts to the allocation: "
                 + ", ".join(f"{h} -> {n}" for h, n in mapping.items()) + f"; wrote {path}")
        return bound

    def finish(self, code: int, outcome: str, reason: str) -> int:
        self.log(reason)
        if self.second_allocations:
            self.slurm.cancel(*self.second_allocations.values())
            self.second_allocations.clear()
        self.record.update(outcome=outcome, reason=reason, exit_code=code, ended=time.time())
        self.save()
        return code
