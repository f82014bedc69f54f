"""hetero-launch --slurm: a plan as a Slurm heterogeneous batch job that keeps itself alive.

    hetero-launch --slurm plan.json --submit --partition gpu --time 12:00:00 \\
        --env GLOO_SOCKET_IFNAME=eth0 -- <Megatron flags, with --save DIR --save-interval N>
    hetero-launch --slurm plan.json --dry-run -- <flags>      # print the batch script only
    hetero-launch --slurm plan.json -- <flags>                # write it; submit it yourself

A plan names device classes and counts (its hosts need not be real machines). The batch
script has one heterogeneous-job component per node class of the plan: the hosts of one
device type that run the same number of ranks. A component asks for that many nodes, one
task per node (the node's torchrun), its GPUs (`--gres=gpu:N` where Slurm lists GPU GRES on
the nodes), whole nodes (`--exclusive --mem=0`), `--no-kill` (a lost node is our driver's to
handle) and where its nodes are:

- `--constraint-by feature` (default): a feature expression that every node of that device
  type in the partition has and no other node there has (`h100`, `a100&80gb`), or the one
  `--feature DEVICE=EXPR` gives. Slurm picks any such nodes; the driver binds the plan's
  hosts to them.
- `--constraint-by nodelist`: `--nodelist` of the plan's hosts (a plan made from a spec of
  `hetero-plan discover --slurm` names Slurm nodes).

Slurm 22.05 lets a failed node leave a heterogeneous job only if it is not its component's
first node (the component's batch host), so `--layout single` writes one job instead, every
class's nodes counted by feature (`--constraint=[h100*1&a100*2]`): any node but the batch
node may then fail, but all nodes get one `--gres=gpu:N`, so every node must run the same
number of ranks.

Before anything is written or submitted, the plan is checked against the cluster
(`scontrol show node/partition`): every device type of the plan is a device of the
partition's nodes (Slurm's features and GRES types, read as discover reads them, with
`--device-map`; the plan's own cluster section settles labels that name several devices),
with enough nodes of it, and a `--feature` matches nodes of its device type. Every problem
is named with its fix (`error: ...`, exit 2).

Written into the run directory (--run-dir; default hetero-runs/<plan>-<time>, which must be
on storage every node sees, as the checkpoints must): plan.json (the plan as given),
launch.json (the components, for the driver) and job.sbatch. The script's body runs the
driver, hetero.launch.slurm_driver, on the first node of component 0: the supervisor inside
the allocation (binding hosts to nodes, one srun step per node, re-planning after a lost
node, re-admitting a returned one: see its docstring and docs/slurm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hetero.errors import HeteroError
from hetero.io import write_json_atomic
from hetero.plan import Plan
from hetero.spec import discover
from hetero.spec.catalog import NIC_KINDS

PLAN_FILE = "plan.json"
LAUNCH_FILE = "launch.json"
SCRIPT_FILE = "job.sbatch"
DRIVER_MODULE = "hetero.launch.slurm_driver"
CONSTRAINT_MODES = ("feature", "nodelist")
LAYOUTS = ("het", "single")
_FEATURE = re.compile(r"[A-Za-z0-9_.+-]+$")
DEFAULT_MAX_RESTARTS = 3
DEFAULT_POLL_S = 10.0  # how often the driver looks for returned nodes (an scontrol call each)

Runner = Callable[[Sequence[str], float], subprocess.CompletedProcess]


def run_command(command: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs a Slurm command; a command that does not answer comes back as exit code 124."""
    try:
        return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(command), 124, "", f"no answer in {timeout:.0f} s")


# ----- the plan's node classes ----------------------------------------------------------


@dataclass(frozen=True)
class NodeClass:
    """The plan's hosts of one device type that run one number of ranks each (in launch order)."""

    device_type: str
    vendor: str
    ranks_per_node: int
    hosts: tuple[str, ...]


def node_classes(plan: Plan) -> list[NodeClass]:
    """The plan's node classes, in the order their first host launches (so component 0 holds
    launch rank 0: the batch script and the rendezvous start on one node)."""
    hosts: dict[tuple[str, int], list[str]] = {}
    vendors: dict[tuple[str, int], str] = {}
    for host, ranks in plan.hosts():
        types = sorted({plan.devices[r].device_type for r in ranks})
        if len(types) != 1:
            raise HeteroError(f"host {host} of the plan runs several device types ({', '.join(types)}); "
                              "a node has one kind of device: give each kind its own host in the plan")
        key = (types[0], len(ranks))
        hosts.setdefault(key, []).append(host)
        vendors[key] = plan.devices[ranks[0]].vendor
    return [NodeClass(device, vendors[(device, n)], n, tuple(h)) for (device, n), h in hosts.items()]


# ----- what Slurm has ---------------------------------------------------------------------


@dataclass
class SlurmView:
    nodes: list[discover.SlurmNode]
    partitions: list[str]
    default_partition: str | None


def read_slurm(run: Runner = run_command) -> SlurmView:
    """Nodes and partitions as `scontrol` reports them."""
    def scontrol(*what: str) -> str:
        done = run(["scontrol", "show", *what, "-o"], 60)
        if done.returncode != 0:
            raise HeteroError(f"`scontrol show {' '.join(what)}` failed: {(done.stderr or done.stdout).strip()[:400]}\n"
                              "check that slurmctld is up and that SLURM_CONF (or /etc/slurm/slurm.conf) is this "
                              "cluster's configuration")
        return done.stdout

    partitions_text = scontrol("partition")
    default = next((discover.parse_fields(line)["PartitionName"] for line in partitions_text.splitlines()
                    if line.startswith("PartitionName=") and discover.parse_fields(line).get("Default") == "YES"),
                   None)
    return SlurmView(discover.parse_nodes(scontrol("node")), discover.parse_partitions(partitions_text), default)


def feature_terms(expression: str) -> list[list[str]]:
    """A Slurm feature expression as OR-ed lists of AND-ed features (`a&b|c`: [[a, b], [c]])."""
    return [[f.strip() for f in term.split("&") if f.strip()] for term in expression.split("|") if term.strip()]


def matches_features(node: discover.SlurmNode, expression: str) -> bool:
    have = set(node.features)
    return any(set(term) <= have for term in feature_terms(expression))


def _gpu_count(node: discover.SlurmNode) -> int | None:
    """GPUs Slurm lists on the node (GRES), None when it lists none."""
    return sum(g.count for g in node.gpus) or None


# ----- launch options ---------------------------------------------------------------------


_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class EnvRule:
    """`--env [SELECTOR:]NAME=VALUE`: a variable for the nodes the selector names (none:
    every node). SELECTOR is a node name, a device type, a feature or a NIC kind (ib, roce,
    ethernet, as the plan's cluster records the node's NIC)."""

    selector: str
    name: str
    value: str

    @classmethod
    def parse(cls, text: str) -> EnvRule:
        head, equals, value = text.partition("=")
        selector, _, name = head.rpartition(":")
        if not equals or not _VARIABLE.match(name):
            raise HeteroError(f"--env {text}: expected [SELECTOR:]NAME=VALUE, e.g. --env GLOO_SOCKET_IFNAME=eth0 "
                              "or --env ib:NCCL_IB_HCA=mlx5_0,mlx5_1 (SELECTOR: a node, device type, feature or "
                              f"NIC kind: {', '.join(NIC_KINDS)})")
        return cls(selector, name, value)

    def text(self) -> str:
        return f"{self.selector + ':' if self.selector else ''}{self.name}={self.value}"

    def precedence(self, node: str, device: str, nic: str | None, features: Sequence[str]) -> int | None:
        """How specifically the rule names the node (higher wins), None when it does not."""
        selector = self.selector.lower()
        if not selector:
            return 0
        if selector == node.lower():
            return 3
        if selector == device.lower() or selector in (f.lower() for f in features):
            return 2
        if nic is not None and selector == nic.lower():
            return 1
        return None


def env_for_node(rules: Sequence[EnvRule], node: str, device: str, nic: str | None,
                 features: Sequence[str]) -> dict[str, str]:
    """The variables the rules give one node: the most specific rule of each name wins (a
    node over a device type or feature, over a NIC kind, over every node), the later of
    two equally specific ones."""
    chosen: dict[str, tuple[int, str]] = {}
    for rule in rules:
        rank = rule.precedence(node, device, nic, features)
        if rank is not None and rank >= chosen.get(rule.name, (-1, ""))[0]:
            chosen[rule.name] = (rank, rule.value)
    return {name: value for name, (_, value) in chosen.items()}


@dataclass
class LaunchOptions:
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    constraint_by: str = "feature"
    layout: str = "het"
    features: dict[str, str] = field(default_factory=dict)  # device type -> feature expression
    device_map: dict[str, str] = field(default_factory=dict)  # label (lowercase) -> catalog device
    sbatch_args: list[str] = field(default_factory=list)
    env: list[EnvRule] = field(default_factory=list)
    job_name: str | None = None
    max_restarts: int = DEFAULT_MAX_RESTARTS
    readmit: bool = True
    poll_s: float = DEFAULT_POLL_S
    master_port: int = 29500
    script: str = "pretrain_gpt.py"
    emulate_devices: bool = False
    python: str = sys.executable
    workdir: str = field(default_factory=os.getcwd)


# ----- components ---------------------------------------------------------------------------


@dataclass
class Component:
    """One component of the heterogeneous job: a node class and where its nodes come from."""

    index: int
    device_type: str
    vendor: str
    ranks_per_node: int
    hosts: list[str]  # the plan's, in launch order
    constraint: str | None = None  # feature expression (--constraint-by feature)
    nodelist: list[str] | None = None  # --constraint-by nodelist
    gpus_per_node: int = 0  # --gres=gpu:N; 0: the nodes list no GPU GRES
    sbatch: list[str] = field(default_factory=list)  # this component's sbatch options

    def describe(self) -> str:
        where = f"--constraint={self.constraint}" if self.constraint else f"--nodelist={','.join(self.nodelist or [])}"
        return (f"component {self.index}: {len(self.hosts)} x {self.device_type} node, {self.ranks_per_node} "
                f"rank{'s' if self.ranks_per_node > 1 else ''} each ({where}; plan hosts {', '.join(self.hosts)})")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Component:
        return cls(**data)


def _node_devices(nodes: Sequence[discover.SlurmNode], plan: Plan,
                  device_map: dict[str, str]) -> tuple[dict[str, str | None], dict[str, str]]:
    """(node -> catalog device or None, node -> why it is unknown). Slurm's labels first (as
    discover reads them); where they name several devices or none, the plan's recorded
    cluster settles it for the nodes it names (a spec discovered from this cluster)."""
    recorded: dict[str, str] = {}
    if plan.cluster is not None:
        for group in plan.cluster.groups:
            for node in group.nodes:
                names = [node.host] if node.host else [f"{node.host_prefix}{i}" for i in range(node.num_nodes)]
                recorded.update({name: node.device for name in names})
    devices: dict[str, str | None] = {}
    problems: dict[str, str] = {}
    for node in nodes:
        resolved = discover.resolve_device(node, None, device_map)
        if resolved.device is None and node.name in recorded:
            devices[node.name] = recorded[node.name]
            continue
        devices[node.name] = resolved.device
        if resolved.problem:
            problems[node.name] = resolved.problem
    return devices, problems


def _auto_feature(device: str, pool: list[discover.SlurmNode], devices: dict[str, str | None],
                  device_map: dict[str, str]) -> str | None:
    """The shortest feature expression that every `device` node of the pool has and that no
    other node of the pool (nor one of unknown device) has; features naming the device first."""
    members = [n for n in pool if devices[n.name] == device]
    common = [f for f in members[0].features if all(f in n.features for n in members[1:])]

    def only_device(expression: str) -> bool:
        return all(devices[n.name] == device for n in pool if matches_features(n, expression))

    def names_device(feature: str) -> bool:
        return device in discover.catalog_matches(feature) or device_map.get(feature.lower()) == device

    ordered = sorted(common, key=lambda f: (not names_device(f), common.index(f)))
    for feature in ordered:
        if only_device(feature):
            return feature
    naming = [f for f in ordered if names_device(f)]
    for expression in ("&".join(naming), "&".join(ordered)):
        if expression and only_device(expression):
            return expression
    return None


def plan_components(plan: Plan, view: SlurmView, options: LaunchOptions) -> tuple[list[Component], list[str]]:
    """The job's components for this cluster and notes for the user; every problem at once
    as one HeteroError."""
    if options.constraint_by not in CONSTRAINT_MODES:
        raise HeteroError(f"--constraint-by {options.constraint_by}: use one of {', '.join(CONSTRAINT_MODES)}")
    if options.partition and options.partition not in view.partitions:
        raise HeteroError(f"partition {options.partition} does not exist in this Slurm cluster; its partitions: "
                          f"{', '.join(view.partitions) or 'none'} (sinfo -s lists them)")
    partition = options.partition or view.default_partition
    where = f"partition {partition}" if partition else "this Slurm cluster"
    pool = [n for n in view.nodes if partition is None or partition in n.partitions]
    if not pool:
        raise HeteroError(f"{where} has no nodes; pick another with --partition ({', '.join(view.partitions)})")
    devices, unknown = _node_devices(pool, plan, options.device_map)
    by_device: dict[str, list[str]] = {}
    for node in pool:
        by_device.setdefault(devices[node.name] or "unknown device", []).append(node.name)
    inventory = "; ".join(f"{d}: {', '.join(names)}" for d, names in by_device.items())
    problems: list[str] = []
    notes: list[str] = []
    classes = node_classes(plan)
    for device in options.features:
        if device not in {c.device_type for c in classes}:
            problems.append(f"--feature {device}=...: the plan runs no {device} (its device types: "
                            f"{', '.join(dict.fromkeys(c.device_type for c in classes))})")
    components: list[Component] = []
    taken: dict[str, int] = {}  # device type -> nodes the components before took
    for index, cls in enumerate(classes):
        component = Component(index, cls.device_type, cls.vendor, cls.ranks_per_node, list(cls.hosts))
        wanted = f"{len(cls.hosts)} {cls.device_type} node{'s' if len(cls.hosts) > 1 else ''}" + \
            (f" with {cls.ranks_per_node} devices each" if cls.ranks_per_node > 1 else "")
        if options.constraint_by == "nodelist":
            eligible = _nodelist_problems(cls, pool, devices, where, problems)
            component.nodelist = list(cls.hosts)
        else:
            expression = options.features.get(cls.device_type)
            if expression is None and not any(devices[n.name] == cls.device_type for n in pool):
                ambiguous = [f"{name} ({why})" for name, why in unknown.items()]
                problems.append(
                    f"the plan runs {cls.device_type} (hosts {', '.join(cls.hosts)}) but no node of {where} is a "
                    f"{cls.device_type}: its nodes are {inventory}"
                    + (f"; unclear: {'; '.join(ambiguous)}" if ambiguous else "")
                    + ". Plan for this cluster's devices (hetero-plan discover --slurm, then hetero-plan), pick "
                      "another --partition, or, where Slurm's labels do not say the device, --device-map LABEL="
                    + cls.device_type)
                continue
            if expression is None:
                expression = _auto_feature(cls.device_type, pool, devices, options.device_map)
                if expression is None:
                    problems.append(f"no feature expression selects exactly the {cls.device_type} nodes of {where} "
                                    f"(their features: {', '.join(_features_of(pool, devices, cls.device_type))}); "
                                    f"pass --feature {cls.device_type}=EXPR or --constraint-by nodelist")
                    continue
            selected = [n for n in pool if matches_features(n, expression)]
            if not selected:
                problems.append(f"--feature {cls.device_type}={expression} matches no node of {where}; its "
                                f"features: {', '.join(sorted({f for n in pool for f in n.features})) or 'none'}")
                continue
            other = [f"{n.name} ({devices[n.name]})" for n in selected
                     if devices[n.name] not in (None, cls.device_type)]
            if other:
                problems.append(f"--feature {cls.device_type}={expression} also selects nodes of other devices: "
                                f"{', '.join(other)}; give a feature only {cls.device_type} nodes have")
                continue
            eligible = [n for n in selected if (_gpu_count(n) or cls.ranks_per_node) >= cls.ranks_per_node]
            component.constraint = expression
            have, before = len(eligible), taken.get(cls.device_type, 0)
            if len(cls.hosts) + before > have:
                listed = ", ".join(f"{n.name}" for n in eligible) or "none"
                problems.append(
                    f"the plan needs {wanted} (hosts {', '.join(cls.hosts)})"
                    + (f" besides the {before} its other components take" if before else "")
                    + f" but {where} has {have} ({listed}); plan for the nodes there (hetero-plan discover --slurm "
                      "--partition ..., then hetero-plan) or pick another --partition")
            taken[cls.device_type] = before + len(cls.hosts)
        if not eligible:
            continue
        down = [f"{n.name} ({n.state})" for n in eligible if not n.available]
        if down:
            notes.append(f"component {index}: not available now: {', '.join(down)}; the job waits for enough "
                         f"{cls.device_type} nodes")
        counts = [_gpu_count(n) for n in eligible]
        component.gpus_per_node = cls.ranks_per_node if all(c is not None for c in counts) else 0
        component.sbatch = _sbatch_options(component, partition if options.partition else None, options)
        components.append(component)
    problems += _env_problems(options.env, plan, pool, components)
    if problems:
        raise HeteroError("the plan does not fit this Slurm cluster; nothing was submitted:\n"
                          + "\n".join(f"  - {p}" for p in problems))
    if options.layout == "single":
        single_job_sbatch(components, partition if options.partition else None, options)  # its problems
    elif len(components) > 1:
        nodes = sum(len(c.hosts) for c in components)
        notes.append(f"a heterogeneous job survives a lost node only if it is not its component's first node (Slurm "
                     f"keeps that one, the component's batch host, and ends the whole job when it fails): "
                     f"{nodes - len(components)} of these {nodes} nodes can be lost. --layout single survives the "
                     "loss of any node but the batch node, where every node runs the same number of ranks "
                     "(docs/slurm.md)")
    return components, notes


def single_job_sbatch(components: list[Component], partition: str | None, options: LaunchOptions) -> list[str]:
    """--layout single: the sbatch options of one job holding every component's nodes
    (`--constraint=[h100*1&a100*2]`). Slurm lets a node other than the batch node leave such a
    job when it fails, but asks one GPU count of every node."""
    ranks = sorted({c.ranks_per_node for c in components})
    gpus = sorted({c.gpus_per_node for c in components})
    problems = []
    if len(ranks) > 1 or len(gpus) > 1:
        problems.append("--layout single asks every node for the same GPUs, but the plan runs " + ", ".join(
            f"{c.ranks_per_node} on each {c.device_type} node" for c in components) + "; use --layout het")
    if options.constraint_by == "feature":
        plain = [c for c in components if not _FEATURE.match(c.constraint or "")]
        problems += [f"--layout single counts nodes by plain features ([a*1&b*2]); {c.device_type}'s is "
                     f"{c.constraint}: give one feature with --feature {c.device_type}=FEATURE, or use "
                     "--constraint-by nodelist or --layout het" for c in plain]
    if problems:
        raise HeteroError("the plan does not fit this Slurm cluster; nothing was submitted:\n"
                          + "\n".join(f"  - {p}" for p in problems))
    result = [f"--nodes={sum(len(c.hosts) for c in components)}", "--ntasks-per-node=1"]
    if options.constraint_by == "feature":
        counts = "&".join(f"{c.constraint}*{len(c.hosts)}" for c in components)
        result.append(f"--constraint={components[0].constraint}" if len(components) == 1 else f"--constraint=[{counts}]")
    else:
        result.append(f"--nodelist={','.join(h for c in components for h in c.nodelist or [])}")
    if gpus[0]:
        result.append(f"--gres=gpu:{gpus[0]}")
    result += ["--exclusive", "--mem=0", "--no-kill"]
    for flag, value in (("--partition", partition), ("--account", options.account), ("--time", options.time)):
        if value:
            result.append(f"{flag}={value}")
    return result + list(options.sbatch_args)


def _features_of(pool: list[discover.SlurmNode], devices: dict[str, str | None], device: str) -> list[str]:
    return sorted({f for n in pool if devices[n.name] == device for f in n.features}) or ["none"]


def _nodelist_problems(cls: NodeClass, pool: list[discover.SlurmNode], devices: dict[str, str | None],
                       where: str, problems: list[str]) -> list[discover.SlurmNode]:
    names = {n.name: n for n in pool}
    eligible = []
    for host in cls.hosts:
        node = names.get(host)
        if node is None:
            problems.append(f"host {host} of the plan is not a node of {where}: --constraint-by nodelist needs a "
                            "plan whose hosts are Slurm nodes (a spec from hetero-plan discover --slurm); or use "
                            "--constraint-by feature")
        elif devices[host] not in (None, cls.device_type):
            problems.append(f"the plan runs {cls.device_type} on host {host}, but Slurm's node {host} is a "
                            f"{devices[host]}: plan for this cluster (hetero-plan discover --slurm)")
        elif (_gpu_count(node) or cls.ranks_per_node) < cls.ranks_per_node:
            problems.append(f"the plan runs {cls.ranks_per_node} ranks on {host}, which has {_gpu_count(node)} GPUs")
        else:
            eligible.append(node)
    return eligible


def _env_problems(rules: Sequence[EnvRule], plan: Plan, pool: list[discover.SlurmNode],
                  components: list[Component]) -> list[str]:
    """--env selectors that name nothing of this job (a typo would silently set nothing)."""
    known = {n.name.lower() for n in pool} | {h.lower() for h, _ in plan.hosts()} | set(NIC_KINDS)
    known |= {d.device_type.lower() for d in plan.devices}
    known |= {f.lower() for n in pool for f in n.features}
    return [f"--env {rule.text()}: {rule.selector} names no node, device type, feature or NIC kind "
            f"({', '.join(NIC_KINDS)}) of this job" for rule in rules
            if rule.selector and rule.selector.lower() not in known]


def _sbatch_options(component: Component, partition: str | None, options: LaunchOptions) -> list[str]:
    """What the component asks of Slurm. One task per node: each node runs one torchrun
    (the driver's srun step), which starts that node's ranks."""
    result = [f"--nodes={len(component.hosts)}", "--ntasks-per-node=1"]
    if component.constraint:
        result.append(f"--constraint={component.constraint}")
    if component.nodelist:
        result.append(f"--nodelist={','.join(component.nodelist)}")
    if component.gpus_per_node:
        result.append(f"--gres=gpu:{component.gpus_per_node}")
    # Whole nodes: the ranks need every core and all memory of their node; and --no-kill,
    # so that a failed node leaves the allocation to the driver instead of ending the job.
    result += ["--exclusive", "--mem=0", "--no-kill"]
    for flag, value in (("--partition", partition), ("--account", options.account), ("--time", options.time)):
        if value:
            result.append(f"{flag}={value}")
    return result + list(options.sbatch_args)


# ----- the batch script ---------------------------------------------------------------------


def driver_command(run_dir: Path, options: LaunchOptions, train_args: Sequence[str]) -> list[str]:
    command = [options.python, "-m", DRIVER_MODULE, "--run-dir", str(run_dir)]
    if options.max_restarts != DEFAULT_MAX_RESTARTS:
        command += ["--max-restarts", str(options.max_restarts)]
    if not options.readmit:
        command.append("--no-readmit")
    elif options.poll_s != DEFAULT_POLL_S:
        command += ["--poll-s", f"{options.poll_s:g}"]
    if options.master_port != 29500:
        command += ["--master-port", str(options.master_port)]
    if options.script != "pretrain_gpt.py":
        command += ["--script", options.script]
    if options.emulate_devices:
        command.append("--emulate-devices")
    for rule in options.env:
        command += ["--env", rule.text()]
    return command + ["--", *train_args]


def batch_script(plan_path: str, plan: Plan, components: list[Component], run_dir: Path,
                 options: LaunchOptions, train_args: Sequence[str]) -> str:
    """The heterogeneous batch script (one component per node class; a plain job for one class)."""
    name = options.job_name or f"hetero-{Path(plan_path).stem}"
    lines = [
        "#!/bin/bash",
        f"# Written by hetero-launch --slurm from {plan_path}: {plan.world_size} ranks on "
        f"{sum(len(c.hosts) for c in components)} nodes"
        + (" in one job." if options.layout == "single" else
           f" in {len(components)} component{'s' if len(components) > 1 else ''}."),
        "# The driver binds the plan's hosts to the allocated nodes, runs one torchrun per node (srun",
        "# steps), re-plans for the survivors after a lost node and writes driver.json here (docs/slurm.md).",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
    ]
    if options.layout == "single":
        lines += [f"# {component.describe()}" for component in components]
        lines.append("#SBATCH " + " ".join(_sbatch_word(o) for o in single_job_sbatch(components, options.partition,
                                                                                       options)))
    else:
        for component in components:
            if component.index:
                lines.append("#SBATCH hetjob")
            lines.append(f"# {component.describe()}")
            lines.append("#SBATCH " + " ".join(_sbatch_word(o) for o in component.sbatch))
    command = driver_command(run_dir, options, train_args)
    lines += [
        f"cd {shlex.quote(options.workdir)}",
        "export PYTHONUNBUFFERED=1",
        "exec " + " \\\n    ".join(_wrap(command)),
        "",
    ]
    return "\n".join(lines)


def _sbatch_word(option: str) -> str:
    """An option as an #SBATCH line takes it: no shell reads the line (`a100&80gb` stays as it
    is), and sbatch splits at whitespace outside double quotes."""
    return f'"{option}"' if any(c.isspace() for c in option) else option


def _wrap(command: list[str], width: int = 90) -> list[str]:
    """The command's words in lines of about width characters (a readable script), a flag
    and its value on one line."""
    words: list[str] = []
    for word in (shlex.quote(w) for w in command):
        if words and words[-1].startswith("-") and " " not in words[-1] and not word.startswith("-"):
            words[-1] += " " + word
        else:
            words.append(word)
    lines, current = [], ""
    for word in words:
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return lines + ([current] if current else [])


# ----- hetero-launch --slurm ---------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --slurm options of hetero-launch."""
    group = parser.add_argument_group("Slurm (with --slurm)")
    group.add_argument("--submit", action="store_true", help="submit the batch script (sbatch); prints the job id")
    group.add_argument("--dry-run", action="store_true", help="print the batch script; write and submit nothing")
    group.add_argument("--partition", default=None, help="every component's partition (default: Slurm's default)")
    group.add_argument("--account", default=None)
    group.add_argument("--time", default=None, help="time limit of every component (sbatch --time)")
    group.add_argument("--constraint-by", choices=CONSTRAINT_MODES, default="feature",
                       help="place each component by a feature expression (default) or by the plan's hosts")
    group.add_argument("--layout", choices=LAYOUTS, default=None,
                       help="het (default): one heterogeneous-job component per node class; single: one job "
                            "(--constraint=[a*1&b*2]) that survives losing any node but the batch node, where "
                            "every node runs the same number of ranks")
    group.add_argument("--feature", action="append", default=[], metavar="DEVICE=EXPR",
                       help="the feature expression of a device type's nodes (default: found from Slurm)")
    group.add_argument("--device-map", action="append", default=[], metavar="LABEL=NAME",
                       help="a Slurm feature or GRES type that names a catalog device (as discover takes it)")
    group.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                       help="an sbatch option for every component, e.g. --sbatch-arg=--qos=high")
    group.add_argument("--env", action="append", default=[], metavar="[SELECTOR:]NAME=VALUE",
                       help="a variable for the ranks of the nodes SELECTOR names (node, device type, feature, "
                            "NIC kind; none: every node), e.g. ib:NCCL_IB_HCA=mlx5_0")
    group.add_argument("--run-dir", default=None, help="where the script, plans, logs and driver.json go "
                                                       "(default hetero-runs/<plan>-<time>; on shared storage)")
    group.add_argument("--job-name", default=None)
    group.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                       help="re-plans after lost nodes before the driver gives up")
    group.add_argument("--no-readmit", action="store_true",
                       help="do not take a returned node back into the job")
    group.add_argument("--poll-s", type=float, default=DEFAULT_POLL_S,
                       help=f"how often the driver looks for returned nodes (default {DEFAULT_POLL_S:g} s)")
    group.add_argument("--python", default=sys.executable, help="the Python of the job's environment on the nodes")


def _mapping(flag: str, items: Sequence[str]) -> dict[str, str]:
    result = {}
    for text in items:
        key, value = discover.parse_mapping(flag, text)
        result[key] = value
    return result


def launch_options(options: argparse.Namespace) -> LaunchOptions:
    device_map = {label.lower(): device for label, device in _mapping("--device-map", options.device_map).items()}
    return LaunchOptions(
        partition=options.partition, account=options.account, time=options.time,
        constraint_by=options.constraint_by, layout=options.layout or "het",
        features=_mapping("--feature", options.feature),
        device_map=device_map, sbatch_args=list(options.sbatch_arg),
        env=[EnvRule.parse(text) for text in options.env], job_name=options.job_name,
        max_restarts=options.max_restarts, readmit=not options.no_readmit, poll_s=options.poll_s,
        master_port=options.master_port,
        script=options.script, emulate_devices=options.emulate_devices, python=options.python)


SLURM_ONLY = ("submit", "dry_run", "partition", "account", "time", "feature", "device_map", "sbatch_arg", "env",
              "run_dir", "job_name", "no_readmit", "layout")


def slurm_options_given(options: argparse.Namespace) -> bool:
    """Whether any option of the Slurm group is given (they mean nothing without --slurm)."""
    return any(getattr(options, name) not in (None, False, []) for name in SLURM_ONLY)


def _check_flags(options: argparse.Namespace, train_args: Sequence[str]) -> list[str]:
    """Flag mistakes, before Slurm is asked anything; notes for what is allowed but unwise."""
    if not options.slurm:
        given = [f"--{name.replace('_', '-')}" for name in SLURM_ONLY if getattr(options, name) not in (None, False, [])]
        raise HeteroError(f"{', '.join(given)} {'is a' if len(given) == 1 else 'are'} --slurm option"
                          f"{'' if len(given) == 1 else 's'}: add --slurm")
    if options.poll_s <= 0:
        raise HeteroError(f"--poll-s {options.poll_s:g}: give a positive number of seconds")
    if options.submit and options.dry_run:
        raise HeteroError("--submit and --dry-run exclude each other: --dry-run prints the script only")
    for flag, value in (("--master-addr", options.master_addr), ("--node-rank", options.node_rank)):
        if value is not None:
            raise HeteroError(f"{flag} does not go with --slurm: the driver takes the rendezvous and the node "
                              "ranks from the allocation")
    if options.run:
        raise HeteroError("--run does not go with --slurm: the batch script runs the job (--submit submits it)")
    if options.max_restarts < 0:
        raise HeteroError(f"--max-restarts {options.max_restarts}: give 0 or more")
    if any(a == "--hetero-plan" or a.startswith("--hetero-plan=") for a in train_args):
        raise HeteroError("leave --hetero-plan out of the Megatron flags: the driver passes the plan it binds "
                          "to the allocation")
    if not _flag_given(train_args, "--save") or not _flag_given(train_args, "--save-interval"):
        return ["no --save DIR --save-interval N among the Megatron flags: a lost node ends the job (there is no "
                "checkpoint to resume from)"]
    return []


def _flag_given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _run_dir(options: argparse.Namespace) -> Path:
    if options.run_dir:
        return Path(options.run_dir).absolute()
    return (Path("hetero-runs") / f"{Path(options.plan).stem}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()


def main(options: argparse.Namespace, train_args: list[str]) -> int:
    """hetero-launch --slurm (commands.main hands over the parsed options)."""
    try:
        notes = _check_flags(options, train_args)
        launch = launch_options(options)
        if options.submit and shutil.which("sbatch") is None:
            raise HeteroError("--submit needs Slurm's sbatch on PATH: run hetero-launch on a login node of the "
                              "cluster, or install the Slurm client (Debian: slurm-client) and point SLURM_CONF at "
                              "the cluster's slurm.conf; --dry-run prints the script without submitting")
        if shutil.which("scontrol") is None:
            raise HeteroError("hetero-launch --slurm checks the plan against the cluster with Slurm's scontrol, "
                              "which is not on PATH: run it on a login node of the cluster, or install the Slurm "
                              "client (Debian: slurm-client) and point SLURM_CONF at the cluster's slurm.conf")
        if not (Path(launch.workdir) / launch.script).is_file():
            raise HeteroError(f"{launch.script} is not in {launch.workdir}, where the job starts: run hetero-launch "
                              "from the Megatron-Hetero checkout (on storage every node sees), or pass --script PATH")
        plan = Plan.load(options.plan)
        components, found = plan_components(plan, read_slurm(), launch)
        notes += found
        run_dir = _run_dir(options)
        script = batch_script(str(Path(options.plan)), plan, components, run_dir, launch, train_args)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        if options.dry_run:
            print(script, end="")
            print(f"# dry run: nothing written to {run_dir} and nothing submitted", file=sys.stderr)
            return 0
        _write_run_dir(run_dir, options.plan, components, script, launch)
        if not options.submit:
            print(f"hetero-launch: wrote {run_dir / SCRIPT_FILE} ({len(components)} component"
                  f"{'s' if len(components) > 1 else ''}); submit it with: sbatch {run_dir / SCRIPT_FILE}")
            return 0
        job_id = submit(run_dir / SCRIPT_FILE)
    except HeteroError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"hetero-launch: submitted job {job_id} ({len(components)} component{'s' if len(components) > 1 else ''}: "
          + "; ".join(f"{len(c.hosts)} x {c.device_type}" for c in components)
          + f"); watch: tail -f {run_dir}/slurm-{job_id}.out; the driver's record: {run_dir}/driver.json")
    return 0


def _write_run_dir(run_dir: Path, plan_path: str, components: list[Component], script: str,
                   options: LaunchOptions) -> None:
    if (run_dir / SCRIPT_FILE).exists():
        raise HeteroError(f"{run_dir} already holds a job ({SCRIPT_FILE}); pick another --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(plan_path, run_dir / PLAN_FILE)
    except OSError as err:
        raise HeteroError(f"cannot write the run directory {run_dir}: {err}; pick another --run-dir") from None
    write_json_atomic(run_dir / LAUNCH_FILE, {
        "plan": PLAN_FILE,
        "source_plan": str(Path(plan_path).absolute()),
        "workdir": options.workdir,
        "python": options.python,
        "partition": options.partition,
        "account": options.account,
        "layout": options.layout,
        "components": [c.to_dict() for c in components],
    })
    (run_dir / SCRIPT_FILE).write_text(script)
    (run_dir / SCRIPT_FILE).chmod(0o755)


def submit(script: Path, run: Runner = run_command) -> str:
    """sbatch the script; the job id."""
    done = run(["sbatch", "--parsable", str(script)], 120)
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip()[:600]
        hint = ""
        if "Invalid feature" in reason:
            hint = "; a --constraint names a feature no node has (check --feature against sinfo -o '%N %f')"
        elif "node configuration is not available" in reason:
            hint = "; the partition cannot hold a component (too many nodes, GPUs or memory asked)"
        raise HeteroError(f"sbatch refused {script}: {reason}{hint}")
    return done.stdout.strip().split(";")[0]


def load_launch(run_dir: Path) -> tuple[dict, list[Component]]:
    """launch.json of a run directory: (its settings, the components)."""
    path = run_dir / LAUNCH_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HeteroError(f"{path} does not exist: --run-dir must be the directory hetero-launch --slurm "
                          "wrote") from None
    except json.JSONDecodeError as err:
        raise HeteroError(f"{path} is not valid JSON ({err}); write the run directory again with "
                          "hetero-launch --slurm") from None
    return data, [Component.from_dict(c) for c in data["components"]]
