"""The supervisor of a planned job inside its Slurm allocation: the body of the batch script
that `hetero-launch --slurm` writes.

    python -m hetero.launch.slurm_driver --run-dir RUN [--max-restarts 3] [--no-readmit] \\
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
socket) before their watchdog has named the node. It then takes each lost node out of the
allocation (`scontrol update JobId=<component> NodeList=<the rest>`) before Slurm declares
it down: Slurm 22.05 ends a whole heterogeneous job when a node of any component fails,
--no-kill or not, unless the node has left the job first. A component's first node (Slurm
keeps it as the component's batch host) and the only node of a component cannot leave
(cancelling a component leaves it holding the node while it completes): the job runs on
until Slurm declares the node down (SlurmdTimeout), then Slurm ends it. With --layout
single (one job holding every class's nodes) any node but the batch node can leave, and
Slurm itself takes a failed one out (--no-kill). The driver then plans the recorded job
(model, training, profiles: hetero.jobs.plan_for_recorded_job, as run_elastic does) for the
nodes it has, writes RUN/plan-<n>.json and resumes with --load from the last checkpoint.

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
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hetero import env as hetero_env
from hetero.errors import HeteroError
from hetero.events import (
    CheckpointLoaded,
    CheckpointSaved,
    Iteration,
    of_kind,
    read_events,
)
from hetero.io import write_json_atomic
from hetero.jobs import plan_for_recorded_job
from hetero.launch.commands import node_commands, split_at_double_dash
from hetero.launch.elastic import (
    AttemptResult,
    cluster_without,
    lost_hosts,
    predicted_tokens_per_s,
    with_load,
)
from hetero.launch.slurm import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_POLL_S,
    Component,
    EnvRule,
    env_for_node,
    load_launch,
    matches_features,
    run_command,
)
from hetero.plan import Plan
from hetero.spec import discover
from hetero.spec.cluster import Cluster

PREFIX = "hetero-slurm:"
RECORD_FILE = "driver.json"
# Device visibility and srun's per-job inputs: what the batch environment holds for
# component 0 alone (docstring: "Starting").
LEAKED = {
    "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",
    "ZE_AFFINITY_MASK", "ASCEND_RT_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE",
    "SLURM_CPUS_PER_TASK", "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU",
    "SLURM_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_SOCKET", "SLURM_TRES_PER_TASK",
    "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_DISTRIBUTION",
    "SLURM_CPU_BIND", "SLURM_CPU_BIND_LIST", "SLURM_CPU_BIND_TYPE", "SLURM_CPU_BIND_VERBOSE", "SLURM_GRES",
}
STOP_WAIT_S = 5.0  # after SIGTERM to the steps, before SIGKILL and scancel
QUIET_S = 2.0  # no step ended for this long after a failure: probe the nodes still running
PROBE_TIMEOUT_S = 10.0


def step_environment(environ: dict[str, str], own_allocation: bool = False) -> dict[str, str]:
    """What a step's srun gets of the driver's environment: not what belongs to component 0
    alone (LEAKED); for a step of the driver's own allocation none of the main job's Slurm
    variables either (srun would take SLURM_HET_SIZE and the rest for that job's)."""
    return {k: v for k, v in environ.items()
            if k not in LEAKED and not (own_allocation and k.startswith("SLURM") and k != "SLURM_CONF")}


class Stopped(Exception):
    """The driver got SIGTERM (scancel, the time limit, Slurm ending the job) or SIGINT."""


# ----- binding ------------------------------------------------------------------------------


def bind_hosts(components: Sequence[Component], allocated: Sequence[Sequence[str]]) -> dict[str, str]:
    """plan host -> Slurm node, component by component: a host that is one of its
    component's nodes keeps it; the others take the rest in Slurm's order."""
    if len(components) != len(allocated):
        raise HeteroError(f"the job has {len(allocated)} components but launch.json describes {len(components)}: "
                          "run the batch script hetero-launch --slurm wrote, unedited")
    mapping: dict[str, str] = {}
    for component, nodes in zip(components, allocated):
        if len(nodes) < len(component.hosts):
            raise HeteroError(f"component {component.index} got {len(nodes)} nodes ({', '.join(nodes)}) for the "
                              f"plan's {len(component.hosts)} {component.device_type} hosts")
        free = [n for n in nodes if n not in component.hosts]
        for host in component.hosts:
            mapping[host] = host if host in nodes else free.pop(0)
    return mapping


def bound_cluster_spec(spec: dict, mapping: dict[str, str], devices_per_host: dict[str, int]) -> dict:
    """The plan's recorded cluster on the bound nodes: only hosts the plan uses, renamed,
    each with the devices the plan runs there (what the job asked Slurm for)."""
    groups = []
    for group in spec["groups"]:
        nodes = []
        for node in group["nodes"]:
            names = ([node["host"]] if node.get("host") else
                     [f"{node['host_prefix']}{i}" for i in range(node.get("num_nodes", 1))])
            base = {k: v for k, v in node.items() if k not in ("host", "host_prefix", "num_nodes")}
            nodes += [{**base, "host": mapping[name], "count": devices_per_host[name]}
                      for name in names if name in mapping]
        if nodes:
            groups.append({**group, "nodes": nodes})
    kept = {g["name"] for g in groups}
    links = [link for link in spec.get("inter_group", []) if set(link["between"]) <= kept]
    return {**spec, "groups": groups, "inter_group": links}


def bound_plan(plan: Plan, mapping: dict[str, str]) -> Plan:
    """The plan with its hosts renamed to the bound nodes (launch order and rank_order kept)."""
    data = plan.to_dict()
    for device in data["devices"]:
        device["host"] = mapping[device["host"]]
    if data.get("cluster"):
        devices_per_host = {host: len(ranks) for host, ranks in plan.hosts()}
        data["cluster"] = bound_cluster_spec(data["cluster"], mapping, devices_per_host)
    return Plan.from_dict(data, "the plan bound to the allocation")


# ----- the allocation -----------------------------------------------------------------------


@dataclass
class Slot:
    """Where a node runs its steps: a component of the main job, or a second allocation."""

    node: str
    job_id: str  # the component's own job id, or the second allocation's
    het_group: int | None  # None: not a component of a heterogeneous job


@dataclass
class Allocation:
    job_id: str
    component_jobs: list[str]
    nodes: list[list[str]]  # per component, in Slurm's order
    heterogeneous: bool

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> Allocation:
        environ = dict(os.environ if environ is None else environ)
        job_id = environ.get("SLURM_JOB_ID")
        if not job_id:
            raise HeteroError("the driver runs inside a Slurm job (no SLURM_JOB_ID here): submit the batch script "
                              "hetero-launch --slurm wrote (sbatch RUN/job.sbatch)")
        size = int(environ.get("SLURM_HET_SIZE", "0") or 0)
        if size:
            jobs = [environ[f"SLURM_JOB_ID_HET_GROUP_{k}"] for k in range(size)]
            nodes = [discover.expand_hostlist(environ[f"SLURM_JOB_NODELIST_HET_GROUP_{k}"]) for k in range(size)]
            return cls(job_id, jobs, nodes, True)
        return cls(job_id, [job_id], [discover.expand_hostlist(environ["SLURM_JOB_NODELIST"])], False)


class Slurm:
    """The Slurm commands the driver uses (one place, so that a test can stand in for them)."""

    def __init__(self, run=run_command):
        self.run = run
        self.slurmd_started: dict[str, str] = {}

    def _checked(self, command: list[str], what: str, timeout: float = 60) -> str:
        done = self.run(command, timeout)
        if done.returncode != 0:
            raise HeteroError(f"{what}: `{' '.join(command)}` failed: {(done.stderr or done.stdout).strip()[:300]}")
        return done.stdout

    def nodes(self) -> dict[str, discover.SlurmNode]:
        """Every node as `scontrol show node` reports it; slurmd_started: when each node's
        slurmd started (a node restarted since it was lost has a new one)."""
        text = self._checked(["scontrol", "show", "node", "-o"], "reading the nodes")
        self.slurmd_started = {fields["NodeName"]: fields.get("SlurmdStartTime", "")
                               for fields in map(discover.parse_fields, text.splitlines()) if "NodeName" in fields}
        return {n.name: n for n in discover.parse_nodes(text)}

    def job_nodes(self, job_id: str) -> list[str]:
        """The nodes a job (one component's job id) holds now."""
        return self.job(job_id)[0]

    def job(self, job_id: str) -> tuple[list[str], str]:
        """(the nodes a job - one component's job id - holds now, its batch host)."""
        text = self._checked(["scontrol", "show", "job", "-o", job_id], f"reading job {job_id}")
        for line in text.splitlines():
            fields = discover.parse_fields(line)
            if fields.get("JobId") == job_id:
                node_list = fields.get("NodeList", "")
                nodes = [] if node_list in ("", "(null)") else discover.expand_hostlist(node_list)
                return nodes, fields.get("BatchHost", "")
        return [], ""

    def shrink(self, job_id: str, keep: list[str]) -> None:
        self._checked(["scontrol", "update", f"JobId={job_id}", f"NodeList={','.join(keep)}"],
                      f"taking lost nodes out of job {job_id}")

    def cancel(self, *ids: str) -> None:
        if ids:
            self.run(["scancel", *ids], 30)

    def steps(self, job_ids: Sequence[str]) -> list[tuple[str, str]]:
        """(step id, step name) of the jobs' running steps."""
        done = self.run(["squeue", "--steps", "-h", "-o", "%i|%j", "-j", ",".join(job_ids)], 30)
        return [tuple(line.split("|", 1)) for line in done.stdout.splitlines() if "|" in line]

    def time_left(self, job_id: str) -> str | None:
        """The job's remaining time as sbatch --time takes it; None when unlimited or unknown."""
        done = self.run(["squeue", "-h", "-j", job_id, "-o", "%L"], 30)
        left = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
        return left if left and left not in ("UNLIMITED", "INVALID", "NOT_SET") else None

    def allocate(self, node: str, options: list[str], name: str) -> tuple[str | None, str]:
        """A one-node allocation of node now (no waiting): (job id or None, what salloc said)."""
        done = self.run(["salloc", "--no-shell", "--immediate=10", "-J", name, "-N1", "-w", node, *options], 60)
        said = (done.stderr + done.stdout).strip()
        for line in said.splitlines():
            if "Granted job allocation" in line:
                return line.rsplit(" ", 1)[-1], said
        return None, said


# ----- the runner ---------------------------------------------------------------------------


@dataclass
class Readmission:
    """A returned node (or several) taken for the next plan, waiting for a checkpoint."""

    plan: Plan
    nodes: list[str]
    after_iteration: int  # stop at a checkpoint of a later iteration


@dataclass
class AttemptRecord:
    attempt: int
    plan: str
    nodes: list[str]
    master: str
    started: float
    ended: float | None = None
    returncode: int | None = None
    outcome: str | None = None
    lost: list[str] = field(default_factory=list)
    first_iteration: int | None = None
    first_iteration_time: float | None = None
    checkpoint_loaded: int | None = None
    last_iteration: int | None = None


class SlurmRunner:
    """hetero.launch.elastic's NodeRunner on a Slurm allocation: one srun step per node."""

    def __init__(self, driver: Driver):
        self.driver = driver
        self.readmission: Readmission | None = None

    def run(self, plan: Plan, plan_path: str, train_args: list[str], attempt: int) -> AttemptResult:
        driver = self.driver
        events_dir = driver.run_dir / f"attempt-{attempt}-events"
        if events_dir.exists():
            for old in events_dir.iterdir():
                old.unlink()  # a file here would be read as this attempt's
        events_dir.mkdir(parents=True, exist_ok=True)
        hosts = [h for h, _ in plan.hosts()]
        master = driver.address(hosts[0])
        port = driver.master_port + attempt
        record = AttemptRecord(attempt, plan_path, hosts, f"{master}:{port}", time.time())
        driver.record["attempts"].append(record.__dict__)
        driver.save()
        commands = node_commands(plan, plan_path, train_args, master, port, driver.script, driver.emulate_devices)
        lines: deque[str] = deque(maxlen=2000)
        procs: dict[str, subprocess.Popen] = {}
        readers = []
        self.readmission = None
        outcome = "finished"
        dead: set[str] = set()  # nodes whose slurmd did not answer a probe step
        try:
            for command in commands:
                argv = [driver.python, "-m", "torch.distributed.run", *command.argv[1:]]
                proc = subprocess.Popen(driver.srun(command.host, f"hetero-{attempt}") + argv, cwd=driver.workdir,
                                        env=driver.step_env(command.host, command.env, events_dir),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
                procs[command.host] = proc
                readers.append(threading.Thread(target=_pump, args=(proc, command.host, lines), daemon=True))
                readers[-1].start()
            first_failure: float | None = None
            next_check = time.monotonic() + driver.poll_s
            last_change, previous, probed = time.monotonic(), set(procs), set()
            while True:
                codes = {host: proc.poll() for host, proc in procs.items()}
                running = {h for h, c in codes.items() if c is None}
                if not running:
                    break
                now = time.monotonic()
                if running != previous:
                    last_change, previous = now, running
                failed = sorted(h for h, c in codes.items() if c not in (None, 0))
                if failed and first_failure is None:
                    first_failure = now
                    driver.log(f"attempt {attempt}: the step on {', '.join(failed)} exited with "
                               f"{codes[failed[0]]}; stopping the attempt")
                if first_failure is not None:
                    reported = lost_hosts(AttemptResult(1, events=read_events(events_dir)), plan)
                    # The ranks of a crashed node's peers may stop on their library's error
                    # before the watchdog names it: once the others have exited and the rest
                    # has been quiet a moment, ask the rest's slurmd directly.
                    if now - last_change > QUIET_S and len(running) < len(procs):
                        for host in sorted(running - reported - probed):
                            probed.add(host)
                            if not driver.node_answers(host):
                                dead.add(host)
                    if running <= reported | dead or now - first_failure > driver.stop_grace_s:
                        break
                elif self.readmission is not None or now >= next_check:
                    # Looking for returned nodes: every poll_s; once one is taken, for the
                    # next checkpoint at every turn (a late stop loses what came after it).
                    if self.readmission is None:
                        next_check = now + driver.poll_s
                    if self._readmit_now(plan, events_dir):
                        outcome = "readmit"
                        break
                time.sleep(0.2)
        except Stopped:
            record.__dict__.update(ended=time.time(), outcome="stopped")
            raise
        finally:
            still = [h for h, p in procs.items() if p.poll() is None]
            if still:
                driver.stop_steps({h: procs[h] for h in still}, attempt, dead)
            for reader in readers:
                reader.join(timeout=5)
        codes = {h: p.returncode for h, p in procs.items()}
        returncode = next((c for c in codes.values() if c not in (0, None)), 0)
        if outcome == "readmit":
            returncode = returncode or 1
        elif returncode != 0:
            outcome = "failed"
        events = read_events(events_dir)
        result = AttemptResult(returncode, dead, list(lines), events)
        lost = sorted(lost_hosts(result, plan)) if outcome == "failed" else []
        iterations = of_kind(events, Iteration)
        loaded = of_kind(events, CheckpointLoaded)
        record.__dict__.update(
            ended=time.time(), returncode=returncode, outcome=outcome, lost=lost,
            first_iteration=iterations[0].iteration if iterations else None,
            first_iteration_time=iterations[0].time if iterations else None,
            last_iteration=iterations[-1].iteration if iterations else None,
            checkpoint_loaded=loaded[0].iteration if loaded else None)
        driver.save()
        return result

    def _readmit_now(self, plan: Plan, events_dir: Path) -> bool:
        """Whether to stop now for a returned node: once one is taken (self.readmission), at
        the first checkpoint the job writes after that."""
        if self.readmission is None:
            self.readmission = self.driver.consider_returned(plan, events_dir)
            return False
        saved = [e.iteration for e in of_kind(read_events(events_dir), CheckpointSaved)]
        if saved and max(saved) > self.readmission.after_iteration:
            self.driver.log(f"checkpoint of iteration {max(saved)} written: stopping the job to take in "
                            f"{', '.join(self.readmission.nodes)}")
            return True
        return False


def _pump(proc: subprocess.Popen, host: str, lines: deque) -> None:
    for line in proc.stdout:
        lines.append(line)
        sys.stdout.write(f"[{host}] {line}")
        sys.stdout.flush()


# ----- the driver ---------------------------------------------------------------------------


class Driver:
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
        self.slurm = slurm or Slurm()
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
        self._node_info: dict[str, discover.SlurmNode] = {}
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

    def _refresh_nodes(self) -> dict[str, discover.SlurmNode]:
        self._node_info = self.slurm.nodes()
        return self._node_info

    def srun(self, node: str, name: str) -> list[str]:
        slot = self.slots[node]
        where = (["--het-group", str(slot.het_group)] if slot.het_group is not None else
                 [f"--jobid={slot.job_id}"] if slot.job_id != self.allocation.job_id else [])
        return ["srun", *where, "-w", node, "-N1", "-n1", "--overlap", "--kill-on-bad-exit=0",
                "-J", name, f"--chdir={self.workdir}"]

    def _base_env(self, node: str) -> dict[str, str]:
        return step_environment(self.environ, self.slots[node].job_id in self.second_allocations.values())

    def node_answers(self, node: str) -> bool:
        """Whether the node's slurmd runs a step now (a crashed node's does not)."""
        try:
            done = subprocess.run(self.srun(node, "hetero-probe") + ["true"], env=self._base_env(node),
                                  capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def step_env(self, node: str, node_env: dict[str, str], events_dir: Path) -> dict[str, str]:
        env = self._base_env(node)
        info = self._node_info.get(node)
        device = self.device_of.get(node, "")
        env.update(env_for_node(self.env_rules, node, device, self.nic_of.get(node),
                                info.features if info is not None else ()))
        env.update(node_env)
        env[hetero_env.EVENTS_DIR] = str(events_dir)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def stop_steps(self, procs: dict[str, subprocess.Popen], attempt: int, dead: set[str] = frozenset()) -> None:
        """SIGTERM to the srun processes (srun passes it to the node's torchrun and ranks);
        what is left after STOP_WAIT_S: SIGKILL, and scancel of the attempt's steps. A dead
        node's srun gets SIGKILL at once: there is nothing left to pass a signal to."""
        for host, proc in procs.items():
            _signal(proc, signal.SIGKILL if host in dead else signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [h for h, p in procs.items() if p.poll() is None]
        for host in left:
            _signal(procs[host], signal.SIGKILL)
        for proc in procs.values():
            proc.wait()
        if left:
            jobs = sorted({self.slots[h].job_id for h in left if h in self.slots} | {self.allocation.job_id})
            names = {f"hetero-{attempt}"}
            self.slurm.cancel(*[step for step, name in self.slurm.steps(jobs) if name in names])

    def remove_nodes(self, lost: set[str]) -> None:
        """Takes lost nodes out of the allocation before Slurm declares them down (which would
        end the whole heterogeneous job)."""
        self._refresh_nodes()
        for node in sorted(lost):
            self.lost[node] = {"slurmd_started": self.slurm.slurmd_started.get(node, ""), "silent_seen": False,
                               "time": time.time()}
            slot = self.slots.pop(node, None)
            if slot is None:
                continue
            if node in self.second_allocations:
                self.slurm.cancel(self.second_allocations.pop(node))
                self.log(f"released {node}'s own allocation (job {slot.job_id})")
                continue
            held, batch_host = self.slurm.job(slot.job_id)
            keep = [n for n in held if n != node]
            if node not in held:
                continue
            if not keep or node == batch_host:
                what = "only node" if not keep else "first node, which Slurm keeps as its batch host"
                self.log(f"{node} is the {what} of job {slot.job_id}"
                         + (f" (component {slot.het_group})" if slot.het_group is not None else "")
                         + ": it cannot leave the job, and Slurm ends the whole job once it declares the node "
                           "down (SlurmdTimeout); going on until then")
                self.slots[node] = slot  # still ours; if it answers again, it comes back
                continue
            try:
                self.slurm.shrink(slot.job_id, keep)
                self.log(f"took {node} out of the allocation (job {slot.job_id} keeps {', '.join(keep)})")
            except HeteroError as err:
                self.log(f"could not take {node} out of the allocation ({err}); Slurm may end the job when it "
                         "declares the node down")

    # ----- returned nodes ------------------------------------------------------------------

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

    def consider_returned(self, plan: Plan, events_dir: Path) -> Readmission | None:
        """While an attempt runs: a returned node worth a restart, taken; None otherwise."""
        current = {h for h, _ in plan.hosts()}
        if not self.readmit or not _replannable(plan) or set(self.cluster_hosts) <= current:
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
                     f"({_speed(old)} -> {_speed(new)} tokens/s) is no better: not taken back")
            self.declined |= set(candidates)
            return None
        taken = [n for n in used if n in inside or self.take(n)]
        if taken != used:
            return None
        saved = [e.iteration for e in of_kind(read_events(events_dir), CheckpointSaved)]
        self.log(f"{', '.join(used)} answer again; re-planned with them: {new_plan.summary()}; predicted "
                 f"{_speed(old)} -> {_speed(new)} tokens/s; restarting at the next checkpoint")
        self.record.setdefault("readmissions", []).append({"time": time.time(), "nodes": used})
        return Readmission(new_plan, used, max(saved) if saved else 0)

    # ----- plans ---------------------------------------------------------------------------

    def cluster_for(self, nodes: set[str]) -> Cluster:
        full = Cluster.from_dict(self.full_cluster, "the job's allocated cluster")
        return cluster_without(full, set(self.cluster_hosts) - nodes)

    def _nodes_by_class(self, nodes: list[str]) -> list[list[str]]:
        """--layout single: the job's nodes of each component, told apart as the job asked for
        them (the component's feature, or its node list)."""
        info = self._refresh_nodes()
        by_class: list[list[str]] = [[] for _ in self.components]
        for node in nodes:
            homes = [c.index for c in self.components
                     if (node in c.nodelist if c.nodelist else
                         node in info and matches_features(info[node], c.constraint or ""))]
            if len(homes) != 1:
                raise HeteroError(f"node {node} of the job belongs to {len(homes)} of the plan's node classes (by "
                                  "their features or node lists); write the job again with --layout het")
            by_class[homes[0]].append(node)
        return by_class

    # ----- the run ---------------------------------------------------------------------------

    def start(self) -> Plan:
        """Binds the plan to the allocation; the bound plan (plan-0.json)."""
        self.allocation = Allocation.from_environment(self.environ)
        allocated, jobs = self.allocation.nodes, self.allocation.component_jobs
        if self.settings.get("layout") == "single":  # one job holds every class's nodes
            allocated, jobs = self._nodes_by_class(allocated[0]), jobs * len(self.components)
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
        try:
            with_load(self.train_args)
            elastic = True
        except HeteroError:
            elastic = False
            self.log("no --save DIR --save-interval N among the flags: a lost node ends the job")
        runner = SlurmRunner(self)
        plan_path = str(self.run_dir / "plan-0.json")
        args = list(self.train_args)
        restarts = 0
        attempt = 0
        while True:
            self.log(f"attempt {attempt} on {len(plan.hosts())} nodes ({', '.join(h for h, _ in plan.hosts())}), "
                     f"plan {plan_path}")
            result = runner.run(plan, plan_path, args, attempt)
            outcome = self.record["attempts"][-1]["outcome"]
            if outcome == "finished":
                return self.finish(0, "finished", f"the job finished (attempt {attempt})")
            if outcome == "readmit":
                new_plan = runner.readmission.plan
                why = f"took {', '.join(runner.readmission.nodes)} back"
            else:
                lost = set(self.record["attempts"][-1]["lost"])
                if not lost:
                    return self.finish(result.returncode, "failed",
                                       f"the job failed with exit code {result.returncode} and lost no node; "
                                       "not restarting (see its errors above)")
                self.log(f"attempt {attempt} lost {', '.join(sorted(lost))}")
                self.remove_nodes(lost)
                if not elastic:
                    return self.finish(result.returncode, "failed", "lost a node, and the job saves no "
                                       "checkpoint to resume from (add --save DIR --save-interval N)")
                if restarts >= self.max_restarts:
                    return self.finish(result.returncode, "failed",
                                       f"lost {', '.join(sorted(lost))}, and all {self.max_restarts} restarts "
                                       "are used (--max-restarts)")
                if not _replannable(plan):
                    return self.finish(result.returncode, "failed", "lost a node, but the plan records no "
                                       "cluster/model/training to plan again with: write it with hetero-plan")
                restarts += 1
                survivors = {h for h, _ in plan.hosts()} - lost
                inside, idle = self.usable_returned(survivors) if self.readmit else ([], [])
                back = inside + [n for n in idle if self.take(n)]
                if back:
                    self.log(f"{', '.join(back)} answer again: planning with them too")
                nodes = survivors | set(back)
                if not nodes:
                    return self.finish(result.returncode, "failed", "no node of the allocation is left")
                try:
                    new_plan = plan_for_recorded_job(plan, self.cluster_for(nodes))
                except HeteroError as err:
                    return self.finish(result.returncode, "failed",
                                       f"cannot plan the job for {', '.join(sorted(nodes))}: {err}")
                why = f"lost {', '.join(sorted(lost))}"
            attempt += 1
            self.declined.clear()
            for host, _ in new_plan.hosts():
                self.lost.pop(host, None)
            self._release_unused(new_plan)
            plan_path = str(self.run_dir / f"plan-{attempt}.json")
            new_plan.save(plan_path)
            self.log(f"{why}; re-planned for {', '.join(h for h, _ in new_plan.hosts())}: {new_plan.summary()}; "
                     f"predicted {_speed(predicted_tokens_per_s(plan))} -> "
                     f"{_speed(predicted_tokens_per_s(new_plan))} tokens/s; wrote {plan_path}; resuming from "
                     "the last checkpoint")
            plan, args = new_plan, with_load(self.train_args)

    def _release_unused(self, plan: Plan) -> None:
        used = {h for h, _ in plan.hosts()}
        for node, job_id in list(self.second_allocations.items()):
            if node not in used:
                self.slurm.cancel(job_id)
                del self.second_allocations[node]
                self.slots.pop(node, None)

    def finish(self, code: int, outcome: str, reason: str) -> int:
        self.log(reason)
        if self.second_allocations:
            self.slurm.cancel(*self.second_allocations.values())
            self.second_allocations.clear()
        self.record.update(outcome=outcome, reason=reason, exit_code=code, ended=time.time())
        self.save()
        return code


def _replannable(plan: Plan) -> bool:
    return all(getattr(plan, name) is not None for name in ("cluster", "model", "training"))


def _speed(value: float | None) -> str:
    return f"{value:,.0f}" if value is not None else "?"


def _signal(proc: subprocess.Popen, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except ProcessLookupError:
        pass


def _stop_on_signals() -> None:
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main(argv: Sequence[str] | None = None) -> int:
    own, train_args = split_at_double_dash(argv)
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.split("\n\n")[0])
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
