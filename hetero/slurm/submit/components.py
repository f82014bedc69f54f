"""The job's components: the plan's node classes (hosts of one device type that run one number
of ranks each), each checked against the partition's nodes and turned into the sbatch options
of one heterogeneous-job component (or, --layout single, of one job holding them all).

Node classes are not the planner's device classes (hetero/search/options.py): those group a
cluster's nodes by device, fabric, NIC and devices per node, these group a plan's hosts -
which need not be real machines nor use every device - by device and ranks per host, in
launch order, which is what Slurm is asked for."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from hetero.errors import HeteroError
from hetero.slurm.submit.env_rules import EnvRule
from hetero.slurm.submit.features import auto_feature, features_of, gpu_count, matches_features, node_devices
from hetero.slurm.client import SlurmView
from hetero.slurm.submit.options import CONSTRAINT_MODES, LaunchOptions
from hetero.plan import Plan
from hetero.slurm import text as slurm_text
from hetero.spec.catalog import NIC_KINDS

_FEATURE = re.compile(r"[A-Za-z0-9_.+-]+$")


@dataclass(frozen=True)
class NodeClass:
    """The plan's hosts of one device type that run one number of ranks each (in launch order)."""

    device_type: str
    vendor: str
    ranks_per_node: int
    hosts: tuple[str, ...]


def node_classes(plan: Plan) -> list[NodeClass]:
    """The plan's node classes, the one with the most hosts first, then in the order their
    first host launches. Component 0 runs the batch script, and while it holds more than one
    node Slurm (22.05, --no-kill) keeps the job alive through the loss of any node but the
    batch host; with a single node there, the job survives only nodes the driver can take
    out of their component first (docs/slurm.md, "When a node fails")."""
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
    classes = [NodeClass(device, vendors[(device, n)], n, tuple(h)) for (device, n), h in hosts.items()]
    return sorted(classes, key=lambda c: -len(c.hosts))  # stable: launch order among equals


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
    devices, unknown = node_devices(pool, plan, options.device_map)
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
        if options.constraint_by == "nodelist":
            eligible = _nodelist_eligible(cls, pool, devices, where, problems)
            component.nodelist = list(cls.hosts)
        else:
            component.constraint, eligible = _feature_eligible(cls, pool, devices, unknown, where, options, taken,
                                                               problems)
            if component.constraint is None:
                continue
        if not eligible:
            continue
        down = [f"{n.name} ({n.state})" for n in eligible if not n.available]
        if down:
            notes.append(f"component {index}: not available now: {', '.join(down)}; the job waits for enough "
                         f"{cls.device_type} nodes")
        counts = [gpu_count(n) for n in eligible]
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
        if len(components[0].hosts) > 1:
            notes.append(f"the job survives the loss of any of its {nodes} nodes but component 0's first, where "
                         "the driver runs (docs/slurm.md)")
        else:
            losable = nodes - len(components)
            notes.append(f"component 0 holds a single node, so Slurm ends the whole job when it declares a node of "
                         f"the job down (SlurmdTimeout) unless the driver took that node out of its component "
                         f"first, which Slurm allows for any node but a component's first: {losable} of these "
                         f"{nodes} nodes can be lost. --layout single survives the loss of any node but the batch "
                         "node, where every node runs the same number of ranks (docs/slurm.md)")
    return components, notes


def _feature_eligible(cls: NodeClass, pool: list[slurm_text.SlurmNode], devices: dict[str, str | None],
                      unknown: dict[str, str], where: str, options: LaunchOptions, taken: dict[str, int],
                      problems: list[str]) -> tuple[str | None, list[slurm_text.SlurmNode]]:
    """--constraint-by feature: (the class's feature expression, the nodes it selects that hold
    its ranks); (None, []) when there is none to use (the problem added to problems). taken:
    the nodes of each device type that the components before take (updated)."""
    expression = options.features.get(cls.device_type)
    if expression is None and not any(devices[n.name] == cls.device_type for n in pool):
        by_device: dict[str, list[str]] = {}
        for node in pool:
            by_device.setdefault(devices[node.name] or "unknown device", []).append(node.name)
        inventory = "; ".join(f"{d}: {', '.join(names)}" for d, names in by_device.items())
        ambiguous = [f"{name} ({why})" for name, why in unknown.items()]
        problems.append(
            f"the plan runs {cls.device_type} (hosts {', '.join(cls.hosts)}) but no node of {where} is a "
            f"{cls.device_type}: its nodes are {inventory}"
            + (f"; unclear: {'; '.join(ambiguous)}" if ambiguous else "")
            + ". Plan for this cluster's devices (hetero-plan discover --slurm, then hetero-plan), pick "
              "another --partition, or, where Slurm's labels do not say the device, --device-map LABEL="
            + cls.device_type)
        return None, []
    if expression is None:
        expression = auto_feature(cls.device_type, pool, devices, options.device_map)
        if expression is None:
            problems.append(f"no feature expression selects exactly the {cls.device_type} nodes of {where} "
                            f"(their features: {', '.join(features_of(pool, devices, cls.device_type))}); "
                            f"pass --feature {cls.device_type}=EXPR or --constraint-by nodelist")
            return None, []
    selected = [n for n in pool if matches_features(n, expression)]
    if not selected:
        problems.append(f"--feature {cls.device_type}={expression} matches no node of {where}; its "
                        f"features: {', '.join(sorted({f for n in pool for f in n.features})) or 'none'}")
        return None, []
    other = [f"{n.name} ({devices[n.name]})" for n in selected if devices[n.name] not in (None, cls.device_type)]
    if other:
        problems.append(f"--feature {cls.device_type}={expression} also selects nodes of other devices: "
                        f"{', '.join(other)}; give a feature only {cls.device_type} nodes have")
        return None, []
    eligible = [n for n in selected if (gpu_count(n) or cls.ranks_per_node) >= cls.ranks_per_node]
    have, before = len(eligible), taken.get(cls.device_type, 0)
    if len(cls.hosts) + before > have:
        wanted = f"{len(cls.hosts)} {cls.device_type} node{'s' if len(cls.hosts) > 1 else ''}" + \
            (f" with {cls.ranks_per_node} devices each" if cls.ranks_per_node > 1 else "")
        listed = ", ".join(f"{n.name}" for n in eligible) or "none"
        problems.append(
            f"the plan needs {wanted} (hosts {', '.join(cls.hosts)})"
            + (f" besides the {before} its other components take" if before else "")
            + f" but {where} has {have} ({listed}); plan for the nodes there (hetero-plan discover --slurm "
              "--partition ..., then hetero-plan) or pick another --partition")
    taken[cls.device_type] = before + len(cls.hosts)
    return expression, eligible


def _nodelist_eligible(cls: NodeClass, pool: list[slurm_text.SlurmNode], devices: dict[str, str | None],
                       where: str, problems: list[str]) -> list[slurm_text.SlurmNode]:
    """--constraint-by nodelist: the class's hosts as nodes of the pool that can run its
    ranks; a host that cannot, named in problems."""
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
        elif (gpu_count(node) or cls.ranks_per_node) < cls.ranks_per_node:
            problems.append(f"the plan runs {cls.ranks_per_node} ranks on {host}, which has {gpu_count(node)} GPUs")
        else:
            eligible.append(node)
    return eligible


def _env_problems(rules: Sequence[EnvRule], plan: Plan, pool: list[slurm_text.SlurmNode],
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
    return result + _job_wide_options(partition, options)


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
        result.append(f"--constraint={components[0].constraint}" if len(components) == 1
                      else f"--constraint=[{counts}]")
    else:
        result.append(f"--nodelist={','.join(h for c in components for h in c.nodelist or [])}")
    if gpus[0]:
        result.append(f"--gres=gpu:{gpus[0]}")
    return result + _job_wide_options(partition, options)


def _job_wide_options(partition: str | None, options: LaunchOptions) -> list[str]:
    """What every layout asks of Slurm beyond where the nodes are: whole nodes (the ranks need
    every core and all memory of their node), --no-kill (a failed node leaves the allocation
    to the driver instead of ending the job), and the user's partition, account, time and
    extra sbatch options."""
    result = ["--exclusive", "--mem=0", "--no-kill"]
    for flag, value in (("--partition", partition), ("--account", options.account), ("--time", options.time)):
        if value:
            result.append(f"{flag}={value}")
    return result + list(options.sbatch_args)
