"""Run a job on this machine as if it were a cluster spec's cluster.

Every node of the cluster becomes a network namespace (network.py) running its own
torchrun; every rank gets a CPU quota in proportion to its device type's peak throughput
(cpu_quota.py). Two factors scale the whole cluster down to what this machine can do, so
that the RATIOS between devices and between NICs are those of the real cluster:

    compute_scale: the fastest device type's rank gets this many cores (default: what
                   fills 3/4 of this machine's cores when every rank runs)
    net_scale:     NIC rate multiplier (default: the fastest NIC becomes 2 Gbit/s)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hetero import env as hetero_env, events
from hetero.events import Event
from hetero.launch.inprocess import CONTROL_DIR, REJOIN, report_returned, returned
from hetero.spec.cluster import Cluster
from hetero.errors import HeteroError
from hetero.plan import Plan
from tools.emulator import cpu_quota, network

REPO = Path(__file__).resolve().parents[2]
FASTEST_NIC_MBIT = 2000.0
CORES_USED = 0.75
# c10d looks up the peer's hostname for its logs; addresses inside the run's namespaces
# have none, and every connection would warn.
NAMESPACE_NOISE = "The hostname of the client socket cannot be retrieved"
KEEP_FREED_MEMORY_ENV = hetero_env.CPU_KEEP_FREED_MEMORY  # read by megatron.hetero.cpu_device


@contextlib.contextmanager
def signals_held():
    """Clean-up that a second Ctrl-C (or a SIGTERM after it) cannot cut short: it left the
    job's processes running once. The signals that arrive meanwhile are delivered after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, lambda signum, frame: arrived.append(signum)) for signum in held}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in arrived[:1]:
            os.kill(os.getpid(), signum)


def stop_on_termination_signals() -> None:
    """SIGTERM, SIGHUP and SIGINT unwind like Ctrl-C, so an EmulatedCluster's exit removes its
    namespaces, links, quotas and processes (a plain SIGTERM kills Python without it)."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)
    # A shell starts background jobs with SIGINT ignored, and Python then keeps ignoring it.
    signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass
class RankLayout:
    """Which device each launch rank stands in for, node by node (launch ranks of one host
    are consecutive, as torchrun numbers them)."""

    hosts: list[tuple[str, list[int]]]
    device_types: list[str]
    vendors: list[str]

    @classmethod
    def of_plan(cls, plan: Plan) -> "RankLayout":
        return cls(plan.hosts(), [d.device_type for d in plan.devices], [d.vendor for d in plan.devices])

    @classmethod
    def of_cluster(cls, cluster: Cluster) -> "RankLayout":
        hosts, types, vendors, rank = [], [], [], 0
        for node in cluster.nodes:
            hosts.append((node.host, list(range(rank, rank + node.count))))
            types += [node.device.name] * node.count
            vendors += [node.device.vendor] * node.count
            rank += node.count
        return cls(hosts, types, vendors)


@dataclass
class JobResult:
    returncode: int
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # Nodes whose launcher died of a signal before the emulator stopped anything (lost nodes).
    killed_hosts: set[str] = field(default_factory=set)
    # What the job recorded (hetero.events), every rank's merged in time order.
    events: list[Event] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def iteration_times_s(self) -> list[float]:
        """Every logged iteration time, in seconds (each the mean over its log interval)."""
        return events.iteration_times_s(self.events)


class EmulatedCluster:
    def __init__(self, cluster: Cluster, layout: RankLayout, *, shaped: bool = True,
                 compute_scale: float | None = None, net_scale: float | None = None,
                 reference_tflops: float | None = None, run_id: int | None = None,
                 cpu_shares: int = cpu_quota.DEFAULT_CPU_SHARES):
        """reference_tflops: the peak that gets compute_scale cores (default: the fastest
        device in this layout). Pass the full cluster's when emulating part of it, so a
        device type keeps its speed (the upper bound runs each type alone). cpu_shares: each
        rank's cgroup weight beside the machine's other processes (cpu_quota.py; 0: the
        kernel's default)."""
        self.cluster, self.layout, self.shaped = cluster, layout, shaped
        self.cpu_shares = cpu_shares
        self.run_id = run_id if run_id is not None else os.getpid() % 100000
        for host, _ in layout.hosts:
            cluster.node(host)  # a plan for another cluster fails here, by host name
        peaks = [cluster.devices[t].peak_tflops for t in layout.device_types]
        self.reference_tflops = reference_tflops or max(peaks)
        relative = [p / self.reference_tflops for p in peaks]
        self.compute_scale = compute_scale or min(1.0, CORES_USED * (os.cpu_count() or 1) / sum(relative))
        self.cpu_fractions = [r * self.compute_scale for r in relative]
        self.cpu_of_rank = balanced_cpus(self.cpu_fractions, sorted(os.sched_getaffinity(0)))
        fastest = max(cluster.node(h).nic.gbps for h, _ in layout.hosts) * 1000
        self.net_scale = net_scale or min(1.0, FASTEST_NIC_MBIT / fastest)
        self.node_links = [
            network.NodeLink(h, cluster.node(h).nic.gbps * 1000 * self.net_scale, cluster.node(h).nic.latency_us)
            for h, _ in layout.hosts
        ]
        self._network: network.EmulatedNetwork | None = None
        self._quotas: cpu_quota.CpuQuotas | None = None
        self.current: JobResult | None = None  # the running job's output so far

    @staticmethod
    def missing_prerequisites() -> list[str]:
        return network.missing_prerequisites() + cpu_quota.missing_prerequisites()

    def describe(self) -> str:
        lines = [f"emulated {self.cluster.name}: {len(self.layout.hosts)} nodes, "
                 f"{len(self.layout.device_types)} ranks" + ("" if self.shaped else " (UNSHAPED)")]
        for (host, ranks), link in zip(self.layout.hosts, self.node_links):
            cores = ", ".join(f"{self.cpu_fractions[r]:.2f} on {self.cpu_of_rank[r]}" for r in ranks)
            shaping = f"{link.mbit_per_s:.0f} Mbit/s, {link.latency_us:.0f} us" if self.shaped else "unshaped"
            lines.append(f"  {host}: ranks {ranks[0]}-{ranks[-1]} {self.layout.device_types[ranks[0]]} "
                         f"(cores {cores}), NIC {shaping}")
        return "\n".join(lines)

    # ----- lifetime -------------------------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        if self.shaped:
            missing = self.missing_prerequisites()
            if missing:
                raise HeteroError("cannot emulate the cluster here: " + "; ".join(missing)
                                  + ". Pass --unshaped to run as plain local processes.")
            try:
                self._network = network.EmulatedNetwork(self.run_id, self.node_links).__enter__()
                self._quotas = cpu_quota.CpuQuotas(self.run_id, self.cpu_fractions, self.cpu_shares).__enter__()
            except BaseException:
                self.__exit__()
                raise
        return self

    def __exit__(self, *exc) -> None:
        with signals_held():
            if self._quotas:
                self._quotas.remove()
            if self._network:
                self._network.remove()

    def cut_link(self, host: str) -> None:
        """Drops one node's link while a job runs (a fault to test against)."""
        if not self._network:
            raise HeteroError("an unshaped emulated cluster has no links to cut")
        self._network.cut(host)

    # ----- running --------------------------------------------------------------------

    def node_command(self, node_rank: int, argv: list[str], master_port: int) -> tuple[list[str], dict]:
        host, ranks = self.layout.hosts[node_rank]
        variables = {
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            # An accelerator's caching allocator keeps freed memory; returned to the OS, every
            # allocation faults its pages in again and timings swing 20-30% between runs
            # (megatron.hetero.cpu_device.configure_host_allocator). 0 returns it.
            KEEP_FREED_MEMORY_ENV: "1" if hetero_env.flag(KEEP_FREED_MEMORY_ENV, True) else "0",
            hetero_env.DEVICE: hetero_env.per_local_rank_value(
                [self.layout.device_types[r] for r in ranks], hetero_env.DEVICE),
            hetero_env.VENDOR: hetero_env.per_local_rank_value(
                [self.layout.vendors[r] for r in ranks], hetero_env.VENDOR),
            hetero_env.EMULATED_HOST: host,
        }
        master = "127.0.0.1"
        prefix: list[str] = []
        if self._network:
            node = self._network.node(host)
            master = self._network.node(self.layout.hosts[0][0]).address
            prefix = self._network.exec_prefix(host)
            variables["GLOO_SOCKET_IFNAME"] = node.device
            variables[hetero_env.EMULATOR_CGROUPS] = hetero_env.per_local_rank_value(
                [str(self._quotas.path(r)) for r in ranks], hetero_env.EMULATOR_CGROUPS)
            variables[hetero_env.EMULATOR_HOST_CGROUPS] = hetero_env.per_local_rank_value(
                [str(self._quotas.host_path(r)) for r in ranks], hetero_env.EMULATOR_HOST_CGROUPS)
            variables[hetero_env.EMULATOR_CPUS] = hetero_env.per_local_rank_value(
                [str(self.cpu_of_rank[r]) for r in ranks], hetero_env.EMULATOR_CPUS)
        command = [*prefix, sys.executable, "-m", "torch.distributed.run",
                   f"--nnodes={len(self.layout.hosts)}", f"--node-rank={node_rank}",
                   f"--nproc-per-node={len(ranks)}", f"--master-addr={master}",
                   f"--master-port={master_port}", "-m", "tools.emulator.rank_entry", *argv]
        return command, variables

    def run(self, argv: list[str], *, timeout: float = 1800, echo: bool = True,
            env: dict | None = None, master_port: int | None = None,
            events_dir: str | os.PathLike | None = None,
            supervisor=None) -> JobResult:
        """Runs `python ARGV...` as every rank (ARGV[0] a script) and waits for all nodes.

        The job records its events (hetero.events) in events_dir, which it must find empty
        (events already there would be read as this run's), or else in a temporary
        directory; either way they come back in the result's ``events``.

        In-process restart: ``supervisor`` (hetero.launch.recovery.InProcessSupervisor) is
        told when nodes' launchers die of a signal (``recover``); when it answers True the job
        goes on without them (their exit is no failure). A lost node reported back
        (hetero.launch.inprocess.report_returned; ``return_node`` here) is offered to it
        (``admit``), which has this runner start the node's processes to join the job. Once it
        says every process finished training (``done``), the launchers left waiting for lost
        peers' launchers are ended."""
        master_port = master_port or 20000 + self.run_id % 20000
        result, procs, lock = JobResult(0), [], threading.Lock()
        proc_hosts: list[str] = []  # the host of each process started (a node's launcher, a joiner)
        self.current = result
        own_events = events_dir is None
        events_dir = Path(tempfile.mkdtemp(prefix="hetero-events.")) if own_events else Path(events_dir)
        job_env = {**(env or {}), hetero_env.EVENTS_DIR: str(events_dir)}
        start = time.monotonic()

        def pump(proc: subprocess.Popen) -> None:
            for line in proc.stdout:
                if NAMESPACE_NOISE in line:
                    continue
                with lock:
                    result.lines.append(line)
                    if echo:
                        sys.stdout.write(line)
                        sys.stdout.flush()

        readers = []
        handed_over: set[int] = set()  # launchers of nodes the job went on without, or left waiting
        try:
            def launch(command: list[str], variables: dict, host: str) -> None:
                proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, **variables, **job_env},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
                procs.append(proc)
                proc_hosts.append(host)
                readers.append(threading.Thread(target=pump, args=(proc,), daemon=True))
                readers[-1].start()

            def start_node(host: str, epoch: int, plan: Plan) -> None:
                for command, variables in self.joining_commands(host, argv, epoch):
                    launch(command, variables, host)

            if supervisor is not None:
                supervisor.address_of = self.address_of
                supervisor.lost_now = lambda: self._killed_hosts(procs, proc_hosts)
                supervisor.start_node = start_node
            for node_rank in range(len(self.layout.hosts)):
                command, node_env = self.node_command(node_rank, argv, master_port)
                launch(command, node_env, self.layout.hosts[node_rank][0])
            deadline = start + timeout
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise HeteroError(f"emulated job ran past {timeout:.0f} s")
                failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0) and i not in handed_over]
                killed = {i for i in failed if procs[i].returncode < 0}
                if failed and supervisor is not None and set(failed) == killed and \
                        supervisor.recover({proc_hosts[i] for i in killed}):
                    handed_over |= killed
                    result.killed_hosts |= {proc_hosts[i] for i in killed}
                    continue
                if failed:
                    result.killed_hosts |= self._killed_hosts(procs, proc_hosts)
                    time.sleep(5)  # let the others report why, then stop them
                    break
                if supervisor is not None and (back := returned(supervisor.control_dir) & supervisor.lost):
                    supervisor.admit(back)
                    continue
                if supervisor is not None and supervisor.done():
                    # torchrun's agents wait (minutes) in their exit barrier for lost agents
                    for _ in range(40):
                        if all(p.poll() is not None for p in procs):
                            break
                        time.sleep(0.05)
                    kill_trees([p.pid for i, p in enumerate(procs) if p.poll() is None])
                    for proc in procs:
                        proc.wait()
                    handed_over |= {i for i, p in enumerate(procs) if p.returncode != 0}
                    break
                time.sleep(0.05)
            else:
                result.killed_hosts |= self._killed_hosts(procs, proc_hosts)
        finally:
            with signals_held():
                kill_trees([p.pid for p in procs if p.poll() is None])
                for proc in procs:
                    proc.wait()
            for reader in readers:
                reader.join(timeout=5)
            try:
                result.events = events.read_events(events_dir)
            finally:
                if own_events:
                    shutil.rmtree(events_dir, ignore_errors=True)
        result.returncode = next((p.returncode for i, p in enumerate(procs)
                                  if p.returncode not in (0, None) and i not in handed_over), 0)
        if any(p.returncode is None for p in procs):
            result.returncode = result.returncode or 1
        result.seconds = time.monotonic() - start
        return result

    def address_of(self, host: str) -> str:
        """The address a node's processes listen on (its namespace's, or this machine's)."""
        return self._network.node(host).address if self._network else "127.0.0.1"

    def _killed_hosts(self, procs: list[subprocess.Popen], hosts: list[str]) -> set[str]:
        return {host for host, proc in zip(hosts, procs) if proc.poll() is not None and proc.returncode < 0}

    def joining_commands(self, host: str, argv: list[str], epoch: int) -> list[tuple[list[str], dict]]:
        """The processes of a returned node, one per device, started outside torchrun: they
        join the running job at ``epoch`` and take their launch rank from its re-plan."""
        node_rank = next(i for i, (name, _) in enumerate(self.layout.hosts) if name == host)
        launcher, variables = self.node_command(node_rank, argv, 0)
        prefix = launcher[:launcher.index(sys.executable)]  # the node's network namespace
        command = [*prefix, sys.executable, "-m", "tools.emulator.rank_entry", *argv]
        return [(command, {**variables, hetero_env.LOCAL_RANK: str(local), REJOIN: str(epoch)})
                for local in range(len(self.layout.hosts[node_rank][1]))]


class ElasticRunner:
    """hetero.launch.elastic's node runner: each attempt runs its plan on an emulated copy of the
    plan's nodes, every device keeping its speed (the full cluster's fastest device is the
    reference whatever is left)."""

    def __init__(self, cluster: Cluster, *, shaped: bool = True, echo: bool = True,
                 timeout: float = 3600, run_dir: str | os.PathLike | None = None,
                 compute_scale: float | None = None):
        """run_dir: where each attempt's events go (attempt-<n>-events, emptied first: the
        supervisor reads them to find the lost hosts); None: temporary directories."""
        self.cluster, self.shaped, self.echo, self.timeout = cluster, shaped, echo, timeout
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.reference_tflops = max(d.peak_tflops for d in (n.device for n in cluster.nodes))
        # Every attempt's ranks keep the speed they have on the whole cluster: a restart on
        # fewer nodes must not run on faster emulated devices (as an attempt sized by its own
        # ranks would), or a restart from disk would be compared with in-process survivors that
        # keep their quotas on unequal terms.
        relative = sum(n.device.peak_tflops / self.reference_tflops * n.count for n in cluster.nodes)
        self.compute_scale = compute_scale or min(1.0, CORES_USED * (os.cpu_count() or 1) / relative)

    def events_dir(self, attempt: int) -> Path | None:
        if self.run_dir is None:
            return None
        directory = self.run_dir / f"attempt-{attempt}-events"
        shutil.rmtree(directory, ignore_errors=True)  # a previous run's, with the same run dir
        directory.mkdir(parents=True)
        return directory

    def run(self, plan: Plan, plan_path: str, train_args: list[str], attempt: int, supervisor=None):
        """supervisor: a hetero.launch.recovery.InProcessSupervisor for jobs that restart
        in-process, else None."""
        from hetero.launch.elastic import AttemptResult

        emulated = EmulatedCluster(self.cluster, RankLayout.of_plan(plan), shaped=self.shaped,
                                   reference_tflops=self.reference_tflops, compute_scale=self.compute_scale)
        with emulated:
            result = emulated.run(["pretrain_gpt.py", "--hetero-plan", plan_path, *train_args],
                                  timeout=self.timeout, echo=self.echo,
                                  master_port=20000 + (emulated.run_id + 7 * attempt) % 20000,
                                  events_dir=self.events_dir(attempt),
                                  env={CONTROL_DIR: str(supervisor.control_dir)} if supervisor else None,
                                  supervisor=supervisor)
        return AttemptResult(result.returncode, result.killed_hosts, result.lines, result.events)


def balanced_cpus(fractions: list[float], cpus: list[int]) -> list[int]:
    """A core for every rank, the largest quotas first onto the least-loaded core. Left to
    the scheduler, two ranks sometimes shared one core for a whole run while their quotas
    allowed more, and runs of one plan differed by 20%; pinned, by about 5%."""
    load = {cpu: 0.0 for cpu in cpus}
    placed = [cpus[0]] * len(fractions)
    for rank in sorted(range(len(fractions)), key=lambda r: -fractions[r]):
        placed[rank] = min(cpus, key=lambda c: load[c])
        load[placed[rank]] += fractions[rank]
    return placed


def descendants(pids: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            parent = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))
            children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], list(pids)
    while frontier:
        frontier = [child for pid in frontier for child in children.get(pid, [])]
        found += frontier
    return found


def kill_node(host: str) -> int:
    """SIGKILL to every process of one emulated node (its launcher and its workers), as a
    lost machine would be; returns how many there were."""
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{hetero_env.EMULATED_HOST}={host}".encode() in environ:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def return_node(control_dir: str | os.PathLike, host: str) -> None:
    """Brings a killed emulated node back (its namespace and quotas stayed): the running job's
    supervisor takes it in at an iteration boundary (in-process restart)."""
    report_returned(control_dir, host)


def kill_trees(pids: list[int]) -> None:
    """SIGKILL to the processes and all their descendants (torchrun puts every worker in a
    session of its own, so process groups do not reach them)."""
    for pid in [*pids, *descendants(pids)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
