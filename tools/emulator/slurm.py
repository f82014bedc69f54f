"""A real Slurm cluster on this machine: one slurmctld, one slurmd per emulated node.

    with SlurmCluster([SlurmNode("node0", "h100"), SlurmNode("node1", "a100")]) as slurm:
        subprocess.run(["sinfo"], env=slurm.env())      # SLURM_CONF points at this cluster
        slurm.kill_node("node1"); slurm.restart_node("node1")

    python -m tools.emulator.slurm                       # up until Ctrl-C (prints SLURM_CONF)
    python -m tools.emulator.slurm -- sinfo -N           # up, run the command, down

Debian's slurmctld/slurmd/slurm-client and munge (installed when missing). Everything
lives under one state directory: munge's key and socket, slurm.conf, gres.conf, logs and
spool. Every node is a network namespace on a bridge (addresses 10.77.K.0/24, K picked
free), its slurmd runs there under a UTS namespace whose host name is the node's name, so
that jobs see the node they run on. Each node has Features=<device> and fake GPU GRES
(character devices under the state directory) of its device type. Leaving the context,
also on error and Ctrl-C, stops the daemons, kills every process left in the namespaces
(slurmstepd, tasks), stops munged and removes the namespaces, bridge and state directory.
Needs root. How to use it, and why it is configured as it is: docs/slurm.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hetero.errors import HeteroError
from tools.emulator.cluster import signals_held, stop_on_termination_signals
from tools.emulator.network import _checked, _ip

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
COMMANDS = ("slurmctld", "slurmd", "sinfo", "scontrol", "srun", "sbatch", "munged")
CONTROLLER_NAME = "slurmctl"
# The emulator's own networks are 10.200-249.x (network.py); this one cannot meet them.
SUBNET_PREFIX = "10.77"


@dataclass(frozen=True)
class SlurmNode:
    """One emulated node: its Slurm name, device class (its feature and GRES type), GPUs
    (fake GRES), CPUs and memory as Slurm sees them (slurmd is told to trust these, not
    this machine's hardware)."""

    name: str
    device: str
    gpus: int = 1
    cpus: int = 2
    memory_mb: int = 2000
    features: tuple[str, ...] = ()
    """Node features; default (device,)."""

    @property
    def all_features(self) -> tuple[str, ...]:
        return self.features or (self.device,)


DEFAULT_NODES = (SlurmNode("node0", "h100"), SlurmNode("node1", "a100"), SlurmNode("node2", "a100"))


@dataclass
class _Node:
    spec: SlurmNode
    namespace: str
    address: str
    outside: str  # veth end on the bridge
    slurmd: subprocess.Popen | None = None


@dataclass
class SlurmCluster:
    """Brings the cluster up on enter and removes everything it made on exit.

    partitions: name -> node names, in order; the first is the default. Default: `all`
    (every node, the default partition) and one per device class named after it.
    switches: leaf switch -> node names (and spine -> switch names under `spines`) for
    Slurm's topology/tree plugin; none by default.
    state_dir: default a new temporary directory, removed on exit; one given is kept (its
    logs), its old Slurm state wiped at start.
    """

    nodes: tuple[SlurmNode, ...] | list[SlurmNode] = DEFAULT_NODES
    partitions: dict[str, list[str]] | None = None
    switches: dict[str, list[str]] | None = None
    spines: dict[str, list[str]] | None = None
    name: str = "emu"
    run_id: int = field(default_factory=lambda: _next_run_id())
    state_dir: Path | None = None
    up_timeout_s: float = 30.0
    slurmd_timeout_s: int = 10
    """SlurmdTimeout: how long a silent node stays up in Slurm's view. Short, so that tests of
    Slurm's own node-failure handling are quick; real clusters use minutes (Slurm's default is
    300 s), and a test of what a job does before Slurm notices may want that."""

    def __post_init__(self) -> None:
        self.nodes = list(self.nodes)
        names = [n.name for n in self.nodes]
        if not names:
            raise HeteroError("SlurmCluster needs at least one node")
        if len(set(names)) != len(names):
            raise HeteroError(f"SlurmCluster: node names must be unique, got {names}")
        if len(names) > 240:
            raise HeteroError(f"SlurmCluster: {len(names)} nodes do not fit one /24; at most 240")
        if self.partitions is None:
            self.partitions = {"all": names}
            for n in self.nodes:
                self.partitions.setdefault(n.device, []).append(n.name)
        for partition, members in self.partitions.items():
            unknown = sorted(set(members) - set(names))
            if unknown:
                raise HeteroError(f"SlurmCluster: partition {partition} names unknown nodes {unknown}")
        self.bridge = f"hsb{self.run_id}"
        self.prefix = ""
        self.port = 0
        self._nodes: dict[str, _Node] = {}
        self._made_dir = False
        self._created_namespaces: list[str] = []
        self._created_links: list[str] = []
        self._daemons: list[subprocess.Popen] = []
        self._munged: subprocess.Popen | None = None
        self._slurmctld: subprocess.Popen | None = None

    # ----- paths and environment -------------------------------------------------------

    @property
    def conf(self) -> Path:
        """slurm.conf of this cluster (what SLURM_CONF names)."""
        return self.state_dir / "etc" / "slurm.conf"

    def env(self, base: dict | None = None) -> dict[str, str]:
        """An environment whose Slurm commands talk to this cluster."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def node_address(self, name: str) -> str:
        return self._node(name).address

    def namespace(self, name: str) -> str:
        """The node's network namespace (under /run/netns)."""
        return self._node(name).namespace

    def _node(self, name: str) -> _Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise HeteroError(f"no node {name!r} in this Slurm cluster; nodes: {', '.join(self._nodes)}") from None

    # ----- lifetime ----------------------------------------------------------------------

    def __enter__(self) -> "SlurmCluster":
        missing = missing_prerequisites()
        if missing:
            raise HeteroError("cannot bring up a Slurm cluster here: " + "; ".join(missing))
        ensure_installed()
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def _up(self) -> None:
        if self.state_dir is None:
            self.state_dir = Path(tempfile.mkdtemp(prefix=f"hetero-slurm.{self.run_id}."))
            self._made_dir = True
        self.state_dir = Path(self.state_dir)
        # slurmctld recovers the jobs of an old state directory: start from nothing.
        for old in ("state", "spool", "run"):
            shutil.rmtree(self.state_dir / old, ignore_errors=True)
        # munged refuses a socket directory that others cannot enter.
        self.state_dir.chmod(0o755)
        for sub in ("etc", "state", "log", "run", "fakedev", "munge", "spool"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        self.prefix = _free_subnet(self.run_id)
        self.port = _free_port(17000 + self.run_id % 1000)
        self._write_config()
        self._start_munged()
        self._make_network()
        self._start_slurmctld()
        for node in self._nodes.values():
            self._start_slurmd(node)
        self.wait_idle()

    def down(self) -> None:
        """Stops and removes everything this cluster made; safe to call twice and after a
        failed start."""
        with signals_held():
            _stop(list(self._daemons), grace_s=1.0)
            _kill_namespaces(self._created_namespaces)
            if self._munged is not None:
                _stop([self._munged], grace_s=1.0)
            for namespace in reversed(self._created_namespaces):
                _ip("netns", "del", namespace, check=False)  # takes the veth ends with it
            for link in reversed(self._created_links):
                _ip("link", "del", link, check=False)
            self._created_namespaces.clear()
            self._created_links.clear()
            self._daemons.clear()
            self._munged = self._slurmctld = None
            if self._made_dir and self.state_dir is not None:
                shutil.rmtree(self.state_dir, ignore_errors=True)
                self._made_dir = False

    # ----- configuration ---------------------------------------------------------------

    def _write_config(self) -> None:
        d = self.state_dir
        controller = f"{self.prefix}.1"
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={CONTROLLER_NAME}({controller})",
            f"SlurmctldPort={self.port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d}/munge/munge.socket.2",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={d}/log/jobcomp.txt",
            "MailProg=/bin/true",
            # Only backfill starts het jobs; its default 30 s interval made them wait.
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_min_interval=0",
            "SelectType=select/cons_tres",
            # Without CR_CPU_Memory and DefMemPerCPU a job takes a node's whole memory.
            "SelectTypeParameters=CR_CPU_Memory",
            "DefMemPerCPU=500",
            # The emulated nodes share this machine's cores: trust the configured sizes.
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "ReturnToService=2",
            # Requeueing after a node failure is our supervisor's decision, not Slurm's.
            "JobRequeue=0",
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            "MessageTimeout=5",
            "InactiveLimit=0",
            "KillWait=3",
            "MinJobAge=600",
            "GresTypes=gpu",
        ]
        if self.switches:
            lines.append("TopologyPlugin=topology/tree")
        gres = ["AutoDetect=off"]
        for k, node in enumerate(self.nodes):
            spec = f"NodeName={node.name} NodeAddr={self.prefix}.{10 + k} CPUs={node.cpus} " \
                   f"RealMemory={node.memory_mb} Features={','.join(node.all_features)}"
            if node.gpus:
                spec += f" Gres=gpu:{node.device}:{node.gpus}"
                # A GPU GRES without File= is dropped and the node goes INVAL: character
                # devices with /dev/null's numbers stand in for the GPUs.
                for i in range(node.gpus):
                    dev = d / "fakedev" / f"{node.name}-gpu{i}"
                    if not dev.exists():
                        os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))
                    gres.append(f"NodeName={node.name} Name=gpu Type={node.device} File={dev}")
            lines.append(spec)
        for i, (partition, members) in enumerate(self.partitions.items()):
            lines.append(f"PartitionName={partition} Nodes={','.join(members)} "
                         f"Default={'YES' if i == 0 else 'NO'} MaxTime=INFINITE State=UP")
        (d / "etc" / "slurm.conf").write_text("\n".join(lines) + "\n")
        (d / "etc" / "gres.conf").write_text("\n".join(gres) + "\n")
        if self.switches:
            topo = [f"SwitchName={s} Nodes={','.join(m)}" for s, m in self.switches.items()]
            topo += [f"SwitchName={s} Switches={','.join(m)}" for s, m in (self.spines or {}).items()]
            (d / "etc" / "topology.conf").write_text("\n".join(topo) + "\n")

    # ----- daemons -----------------------------------------------------------------------

    def _spawn(self, command: list[str], log: str) -> subprocess.Popen:
        out = open(self.state_dir / "log" / log, "ab")
        try:
            # A session of their own: Ctrl-C in the terminal reaches us, and we stop them.
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env(), start_new_session=True)
        finally:
            out.close()
        self._daemons.append(proc)
        return proc

    def _start_munged(self) -> None:
        m = self.state_dir / "munge"
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        m.chmod(0o755)
        self._munged = self._spawn(["munged", "--foreground", f"--key-file={key}",
                                    f"--socket={m}/munge.socket.2", f"--log-file={m}/munged.log",
                                    f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed"],
                                   "munged.out")
        self._daemons.remove(self._munged)  # stopped after the nodes' processes
        self._wait(lambda: (m / "munge.socket.2").exists(), "munged to open its socket", "munged.out")

    def _start_slurmctld(self) -> None:
        # slurmctld checks its own host name against SlurmctldHost.
        self._slurmctld = self._spawn(
            ["unshare", "--uts", "sh", "-c", f'hostname {CONTROLLER_NAME} && exec slurmctld -D -f "$SLURM_CONF"'],
            "slurmctld.out")
        self._wait(lambda: _run(["scontrol", "ping"], self.env()).returncode == 0,
                   "slurmctld to answer", "slurmctld.out")

    def _start_slurmd(self, node: _Node) -> None:
        # nsenter, not `ip netns exec`: the latter remounts /sys, which hides the cgroup
        # tree, and slurmd 22.05 then fails to start. A /sys of the node's own network
        # namespace matters too (jobs that read /sys/class/net must see the node's eth0,
        # not this machine's): mount one in a mount namespace of the node's and move the
        # cgroup tree onto it.
        keep = self.state_dir / "run" / f"cgroup-{node.spec.name}"
        keep.mkdir(exist_ok=True)
        script = (f"hostname {node.spec.name} && mount --rbind /sys/fs/cgroup {keep} && "
                  f"mount -t sysfs sysfs /sys && mount --move {keep} /sys/fs/cgroup && "
                  'exec slurmd -D -f "$SLURM_CONF"')
        if not os.path.ismount("/sys/fs/cgroup"):
            script = f'hostname {node.spec.name} && mount -t sysfs sysfs /sys && exec slurmd -D -f "$SLURM_CONF"'
        node.slurmd = self._spawn(
            ["nsenter", f"--net=/run/netns/{node.namespace}", "unshare", "--uts", "--mount", "sh", "-c", script],
            f"slurmd-{node.spec.name}.out")

    def _wait(self, ready, what: str, log: str, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.up_timeout_s)
        while not ready():
            if time.monotonic() > deadline:
                raise HeteroError(f"Slurm cluster: timed out waiting for {what}; its log:\n{self._tail(log)}")
            dead = [p for p in [*self._daemons, self._munged] if p is not None and _exited(p)]
            if dead:
                raise HeteroError(f"Slurm cluster: `{' '.join(dead[0].args)[:200]}` exited while waiting "
                                  f"for {what}; logs:\n{self._tail(log)}")
            time.sleep(0.05)

    def _tail(self, *logs: str) -> str:
        text = []
        for log in [*logs, "slurmctld.log"]:
            path = self.state_dir / "log" / log
            if path.exists():
                text.append(f"--- {path}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(text)

    def node_states(self) -> dict[str, str]:
        """Slurm's state of every node ("idle", "down*", "alloc", ...)."""
        done = _run(["sinfo", "-h", "-N", "-o", "%N|%T"], self.env())
        states = {}
        for line in done.stdout.splitlines():
            name, _, state = line.partition("|")
            states[name.strip()] = state.strip()
        return states

    def wait_idle(self, names: list[str] | None = None, timeout: float | None = None) -> None:
        """Waits until the nodes (default: all) are idle."""
        names = names or [n.name for n in self.nodes]

        def ready() -> bool:
            states = self.node_states()
            return all(states.get(n) == "idle" for n in names)

        try:
            self._wait(ready, f"nodes {', '.join(names)} to be idle", "slurmctld.out", timeout)
        except HeteroError as err:
            raise HeteroError(f"{err}\nnode states: {self.node_states()}\n"
                              + self._tail(*[f"slurmd-{n}.out" for n in names])) from None

    # ----- faults ------------------------------------------------------------------------

    def kill_node(self, name: str, mark_down: bool = False) -> None:
        """SIGKILL to the node's slurmd and every process in its namespace (slurmstepd, the
        job's tasks), as a crashed machine. Slurm notices after SlurmdTimeout (about 16 s);
        mark_down tells it at once (`scontrol update state=down`)."""
        self.kill_nodes([name], mark_down)

    def kill_nodes(self, names: list[str], mark_down: bool = False) -> None:
        """kill_node for several nodes at the same moment (one SIGKILL pass over all their
        namespaces), as machines lost together: one after the other, a node's processes
        could see the first loss and act on it before their own."""
        nodes = {name: self._node(name) for name in names}
        _kill_namespaces([node.namespace for node in nodes.values()])
        for name, node in nodes.items():
            if node.slurmd is not None:
                node.slurmd.wait()
                self._daemons.remove(node.slurmd)
                node.slurmd = None
            if mark_down:
                _checked(["env", f"SLURM_CONF={self.conf}", "scontrol", "update", f"nodename={name}",
                          "state=down", "reason=killed by the emulator"])

    def cut_link(self, name: str) -> None:
        """Takes the node's link down, as a failed NIC or cable: Slurm sees NODE_FAIL after
        SlurmdTimeout while the node's processes run on."""
        _ip("link", "set", self._node(name).outside, "down")

    def restore_link(self, name: str) -> None:
        """Brings the link back: the node re-registers (and slurmctld kills an orphaned task)."""
        _ip("link", "set", self._node(name).outside, "up")

    def restart_node(self, name: str, wait: bool = True) -> None:
        """Starts the node's slurmd again (after kill_node); with ReturnToService=2 it is idle
        again within a second. wait: until Slurm reports it idle."""
        node = self._node(name)
        if node.slurmd is not None and not _exited(node.slurmd):
            raise HeteroError(f"node {name}'s slurmd is running; kill_node({name!r}) first")
        self._start_slurmd(node)
        if wait:
            self.wait_idle([name])

    # ----- network -----------------------------------------------------------------------

    def _make_network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created_links.append(self.bridge)
        _ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for k, spec in enumerate(self.nodes):
            namespace, outside, inside = f"hsn{self.run_id}-{k}", f"hsv{self.run_id}r{k}", f"hsv{self.run_id}n{k}"
            _ip("netns", "add", namespace)
            self._created_namespaces.append(namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            self._created_links.append(outside)
            # Named eth0 inside, as on a real node (GLOO_SOCKET_IFNAME=eth0 works everywhere).
            _ip("link", "set", inside, "netns", namespace, "name", "eth0")
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            address = f"{self.prefix}.{10 + k}"
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            self._nodes[spec.name] = _Node(spec, namespace, address, outside)


# ----- helpers -------------------------------------------------------------------------


_instances = itertools.count()


def _next_run_id() -> int:
    """This process's pid and a count, so that two clusters (of one process or two) do not
    collide on names; the subnet and port are checked free besides."""
    return os.getpid() % 100000 * 10 + next(_instances) % 10


def _run(command: list[str], env: dict, timeout: float = 10) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(command, 124, "", "timed out")


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the process has exited, without reaping it: while it is unreaped its pid, and
    so its process group's id, cannot be taken by another process."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """TERM to each daemon's process group, up to grace_s to exit, then KILL to the group
    (slurmctld's slurmscriptd is a child in its group); every one reaped."""
    def signal_group(proc: subprocess.Popen, signum: int) -> None:
        if proc.returncode is None:  # unreaped: the group id is still ours
            try:
                os.killpg(proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    for proc in procs:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while not all(_exited(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
        proc.wait()


def _kill_namespaces(namespaces: list[str], within_s: float = 5.0) -> None:
    """SIGKILL to every process in the network namespaces until none is left (a dying
    slurmstepd may fork once more)."""
    deadline = time.monotonic() + within_s
    while True:
        pids = []
        for namespace in namespaces:
            done = _ip("netns", "pids", namespace, check=False)
            pids += [int(p) for p in done.stdout.split()] if done.returncode == 0 else []
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            return  # ip netns del still removes the name; the processes are dying
        time.sleep(0.05)


def _free_subnet(run_id: int) -> str:
    """10.77.K with K free on this machine (no address or route of that /24)."""
    used = _ip("-o", "addr").stdout + _ip("route").stdout
    for step in range(250):
        k = (run_id + step) % 250 + 1
        prefix = f"{SUBNET_PREFIX}.{k}"
        if f"{prefix}." not in used:
            return prefix
    raise HeteroError(f"no free /24 under {SUBNET_PREFIX}.0.0/16 on this machine")


def _free_port(first: int) -> int:
    """A TCP port for slurmctld that nothing listens on (slurmctld runs in this namespace,
    where another cluster or a real slurmctld on 6817 may be)."""
    for port in range(first, first + 1000):
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    raise HeteroError(f"no free TCP port in {first}-{first + 999} for slurmctld")


def missing_prerequisites() -> list[str]:
    """Why a Slurm cluster cannot be made here, or [] when it can."""
    reasons = []
    if os.geteuid() != 0:
        reasons.append("network namespaces and Slurm's daemons need root (run as root)")
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            reasons.append(f"`{tool}` is not installed (iproute2, util-linux)")
    if not all(shutil.which(c) for c in COMMANDS) and shutil.which("apt-get") is None:
        reasons.append("Slurm and munge are not installed and there is no apt-get to install them: "
                       f"install {', '.join(PACKAGES)}")
    return reasons


def ensure_installed() -> None:
    """Installs Debian's Slurm and munge when a command is missing (apt-get update once)."""
    if all(shutil.which(c) for c in COMMANDS):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise HeteroError(f"`{' '.join(command)}` failed ({done.returncode}): "
                              f"{done.stderr.strip()[-1500:]}\ninstall {', '.join(PACKAGES)} by hand")
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise HeteroError(f"installed {', '.join(PACKAGES)} but {', '.join(missing)} is still not on PATH")


# ----- python -m tools.emulator.slurm ---------------------------------------------------


def _node_arg(text: str) -> SlurmNode:
    parts = text.split(":")
    try:
        if not 2 <= len(parts) <= 5 or not all(parts[:2]):
            raise ValueError
        numbers = [int(p) for p in parts[2:]]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected NAME:DEVICE[:GPUS[:CPUS[:MEMORY_MB]]], e.g. node0:h100:2, got {text!r}") from None
    return SlurmNode(parts[0], parts[1], *numbers)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        command = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = argparse.ArgumentParser(prog="python -m tools.emulator.slurm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--node", type=_node_arg, action="append", default=None,
                        metavar="NAME:DEVICE[:GPUS[:CPUS[:MEMORY_MB]]]",
                        help="a node (repeat); default node0:h100, node1:a100, node2:a100")
    options = parser.parse_args(argv)
    stop_on_termination_signals()
    start = time.monotonic()
    try:
        with SlurmCluster(options.node or DEFAULT_NODES) as slurm:
            print(f"Slurm cluster up in {time.monotonic() - start:.1f} s: "
                  f"{', '.join(f'{n.name} ({n.device} x{n.gpus})' for n in slurm.nodes)}; "
                  f"partitions {', '.join(slurm.partitions)}", file=sys.stderr)
            if command:
                return subprocess.run(command, env=slurm.env()).returncode
            print(f"export SLURM_CONF={slurm.conf}", flush=True)
            print("Ctrl-C (or SIGTERM) brings it down", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
    except HeteroError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("Slurm cluster: down, everything it made removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
