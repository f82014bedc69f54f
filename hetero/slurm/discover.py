"""The cluster spec of a Slurm cluster, read from the cluster itself (`hetero-plan discover --slurm`).

What comes from where:
  nodes        `scontrol show node -o` (nodes of the chosen partitions that can take jobs:
               down, drained, failing and powered-down nodes are left out, with a note)
  device type  in this order: --device-map FEATURE=NAME on any of the node's labels; the
               GPU names nvidia-smi/rocm-smi report on the node; its GPU GRES types and
               features, each matched to the catalog by tokens (case-insensitive: "h100"
               names H100-80GB, "nvidia_a100-sxm4-80gb" names A100-80GB). Labels naming no
               catalog device ("ib", "skylake") are ignored; the device is the one every
               naming label agrees on ("a100" + "80gb": A100-80GB). None, several ("a100":
               A100-40GB or A100-80GB) or a conflict is an error naming the label and the
               --device-map that settles it.
  devices      the count of the node's gpu GRES (else what nvidia-smi/rocm-smi listed, else
               --gpus-per-node)
  NIC          a probe per node (`srun -w NODE -N1 -n1 sh -c ...`, all nodes at once):
               active InfiniBand ports -> ib, active RoCE ports (RDMA over an Ethernet link
               layer) -> roce, both at the sum of their ports' rates; else the fastest up
               Ethernet interface (physical or bond; virtual ones only where the node has
               nothing else, as on the emulated nodes' veth) -> ethernet at its speed.
               --nic [SELECTOR=]KIND:GBPS overrides (SELECTOR: node, partition or feature);
               with nothing found or --no-probe: ethernet 10 Gbit/s, with a note.
  intra_link   the usual board of the device (INTRA_LINKS below); --intra-link DEVICE=LINK
  groups       nodes sharing a fabric (--group-by): `topology` (Slurm's topology/tree: one
               group per tree of switches, named after its top switch), `partition` (each
               node in the smallest chosen partition holding it, so a catch-all partition
               does not swallow the per-type ones), `device` (one per device type), `one`.
               The default `auto` is topology where Slurm has one, else partition.
  inter_group  every pair of groups: ethernet at the slower node NIC of the two (a cautious
               default: Slurm does not know it), or --inter-group KIND:GBPS
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from typing import Callable

import yaml

from hetero.errors import HeteroError
from hetero.spec.catalog import DEVICES, INTRA_NODE_LINKS, NIC_KINDS
from hetero.spec.cluster import Cluster
from hetero.spec.devices import device_type_matches
from hetero.slurm.probe import Probe, nic_of, probe_nodes
from hetero.slurm.text import (Runner, SlurmNode, expand_hostlist, parse_nodes, parse_partitions,
                                    parse_topology, run_command, slurm_output)

# The intra-node link of each catalog device's usual board (SXM/OAM where it has one).
# PCIe versions of the same chip differ: --intra-link DEVICE=pcie4 for those.
INTRA_LINKS = {
    "V100-16GB": "nvlink2", "V100-32GB": "nvlink2",
    "A100-40GB": "nvlink3", "A100-80GB": "nvlink3",
    "A800-80GB": "nvlink-400", "H800": "nvlink-400",
    "H100-80GB": "nvlink4", "H200": "nvlink4", "H20": "nvlink4",
    "L40S": "pcie4", "RTX-4090": "pcie4",
    "MI210": "xgmi", "MI250X": "xgmi", "MI300X": "xgmi",
    "Ascend-910B": "hccs",
}
DEFAULT_NIC = ("ethernet", 10.0)
GROUP_RULES = ("auto", "topology", "partition", "device", "one")



# ----- labels to catalog devices -----------------------------------------------------------


def _tokens(text: str) -> set[str]:
    return {t for t in re.split(r"[^a-z0-9]+", text.lower()) if t}


def catalog_matches(label: str) -> set[str]:
    """Catalog devices a label names: every token of the catalog name in the label (a
    driver's long name) or every token of the label in the catalog name (a short feature)."""
    tokens = _tokens(label)
    if not tokens:
        return set()
    return {name for name in DEVICES
            if device_type_matches(name, label) or tokens <= _tokens(name)}


@dataclass
class DeviceResolution:
    """A node's catalog device and what named it, or the problem that keeps it unknown."""

    device: str | None = None
    problem: str | None = None
    """What is wrong, keyed so that nodes with the same problem are reported once."""
    how: str = ""


def resolve_device(node: SlurmNode, probe: Probe | None, device_map: dict[str, str]) -> DeviceResolution:
    labels = list(dict.fromkeys([g.type for g in node.gpus if g.type] + list(node.features)))
    mapped = {device_map[label.lower()] for label in [*labels, *(probe.gpus if probe else ())]
              if label.lower() in device_map}
    if len(mapped) == 1:
        return DeviceResolution(mapped.pop(), how="--device-map")
    if mapped:
        return DeviceResolution(problem=f"--device-map gives it several devices ({', '.join(sorted(mapped))}) "
                                   f"through its labels {', '.join(labels)}: map only one")
    for source, names in (("nvidia-smi/rocm-smi", probe.gpus if probe else ()), ("GRES/features", labels)):
        naming = {label: catalog_matches(label) for label in dict.fromkeys(names)}
        naming = {label: found for label, found in naming.items() if found}
        if not naming:
            continue
        agreed = set.intersection(*naming.values())
        if len(agreed) == 1:
            return DeviceResolution(agreed.pop(), how=f"{source} {', '.join(naming)}")
        said = "; ".join(f"{label!r} names {' or '.join(sorted(found))}" for label, found in naming.items())
        first = next(iter(naming))
        choices = sorted(agreed or naming[first])
        fix = f"say which with --device-map {first}={choices[0]}" + "".join(f" (or ={c})" for c in choices[1:])
        what = "ambiguous device" if agreed else "conflicting device labels"
        return DeviceResolution(problem=f"{what}: {said}; {fix}")
    shown = ", ".join(repr(label) for label in labels) or "none"
    return DeviceResolution(problem=f"cannot map its features/GRES types ({shown}) to a device of the catalog; "
                               f"pass --device-map {labels[0] if labels else 'FEATURE'}=NAME with NAME one of "
                               f"{', '.join(DEVICES)}")


# ----- options and the whole run -----------------------------------------------------------


@dataclass
class DiscoverOptions:
    partitions: list[str] = field(default_factory=list)
    device_map: dict[str, str] = field(default_factory=dict)
    """feature, GRES type or GPU name (any case) -> catalog device name"""
    nics: dict[str, tuple[str, float]] = field(default_factory=dict)
    """selector ('' for every node, else a node, partition or feature) -> (kind, Gbit/s)"""
    intra_links: dict[str, str] = field(default_factory=dict)
    inter_group: tuple[str, float] | None = None
    gpus_per_node: int | None = None
    exclude_nodes: list[str] = field(default_factory=list)
    """node names or host lists (`gpu[01-04]`) to leave out"""
    exclude_features: list[str] = field(default_factory=list)
    """nodes with any of these features are left out"""
    group_by: str = "auto"
    probe: bool = True
    probe_timeout_s: float = 120.0
    name: str | None = None


@dataclass
class Discovery:
    spec: dict
    notes: list[str]
    table: list[str]


@dataclass(frozen=True)
class DiscoveredNode:
    slurm: SlurmNode
    home_partition: str
    device: str
    count: int
    nic_kind: str
    nic_gbps: float
    device_from: str
    nic_from: str


def discover_slurm(options: DiscoverOptions, run: Runner = run_command,
                   probe: Callable[[list[tuple[str, str]], float], dict] = probe_nodes) -> Discovery:
    """The cluster spec (a dict that Cluster.from_dict accepts) of the Slurm cluster the
    Slurm commands on PATH talk to."""
    device_map = _checked_device_map(options)
    needed = ["scontrol"] + (["srun"] if options.probe else [])
    missing = [c for c in needed if shutil.which(c) is None]
    if missing:
        raise HeteroError(
            f"discover --slurm needs Slurm's {' and '.join(missing)} on PATH: run it on a node of the "
            "cluster (a login node), or install the Slurm client (Debian: slurm-client) and point "
            "SLURM_CONF at the cluster's slurm.conf" + (" (or pass --no-probe with --nic)" if missing == ["srun"] else ""))
    notes: list[str] = []
    homes = _available_nodes(options, run, notes)
    probes = probe([(n.name, home) for n, home in homes.items()], options.probe_timeout_s) if options.probe else {}
    found = _describe(homes, probes, device_map, options, notes)
    rule, islands = _groups(options.group_by, found, run, notes)
    spec = _spec(found, islands, options, _config_value(slurm_output(run, "scontrol", "show", "config"), "ClusterName"))
    if len(spec["groups"]) > 1 and not options.inter_group:
        notes.append("inter_group links are ethernet at the slower node NIC of each pair (Slurm does not know "
                     "them): pass --inter-group KIND:GBPS")
    Cluster.from_dict(spec, "the discovered cluster")  # what we write must load
    table = [f"{'node':<12} {'device':<12} {'count':>5}  {'nic':<22} {'group':<12} device from / nic from"]
    for n in found:
        nic = f"{n.nic_kind} {n.nic_gbps:g} Gb/s"
        table.append(f"{n.slurm.name:<12} {n.device:<12} {n.count:>5}  {nic:<22} {islands[n.slurm.name]:<12} "
                     f"{n.device_from} / {n.nic_from}")
    return Discovery(spec, [f"groups by {rule}", *notes], table)


def _checked_device_map(options: DiscoverOptions) -> dict[str, str]:
    """The options' mistakes, named before anything is asked of Slurm; the device map by
    lowercase label."""
    device_map = {label.lower(): device for label, device in options.device_map.items()}
    for label, device in device_map.items():
        if device not in DEVICES:
            raise HeteroError(f"--device-map {label}={device}: {device} is not a catalog device; use one of "
                              f"{', '.join(DEVICES)}")
    for device, link in options.intra_links.items():
        if device not in DEVICES or link not in INTRA_NODE_LINKS:
            raise HeteroError(f"--intra-link {device}={link}: give a catalog device ({', '.join(DEVICES)}) "
                              f"and a link ({', '.join(INTRA_NODE_LINKS)})")
    if options.group_by not in GROUP_RULES:
        raise HeteroError(f"--group-by {options.group_by}: use one of {', '.join(GROUP_RULES)}")
    return device_map


def _available_nodes(options: DiscoverOptions, run: Runner, notes: list[str]) -> dict[SlurmNode, str]:
    """The available nodes of the wanted partitions (default: all) less the excluded ones,
    each with its home: the smallest of those partitions holding it, the most specific one."""
    wanted = options.partitions
    partitions = parse_partitions(slurm_output(run, "scontrol", "show", "partition", "-o"))
    unknown = [p for p in wanted if p not in partitions]
    if unknown:
        raise HeteroError(f"partition {', '.join(unknown)} does not exist in this Slurm cluster; its partitions: "
                          f"{', '.join(partitions) or 'none'} (sinfo -s lists them)")
    chosen = list(dict.fromkeys(wanted)) or partitions
    every = parse_nodes(slurm_output(run, "scontrol", "show", "node", "-o"))
    size = {p: sum(p in n.partitions for n in every) for p in chosen}
    in_chosen = _without_excluded([n for n in every if set(n.partitions) & set(chosen)], options, chosen, notes)
    left_out = [f"{n.name} ({n.state})" for n in in_chosen if not n.available]
    if left_out:
        notes.append(f"left out, not available: {', '.join(left_out)}")
    homes = {n: min((p for p in chosen if p in n.partitions), key=lambda p: (size[p], chosen.index(p)))
             for n in in_chosen if n.available}
    if not homes:
        raise HeteroError(f"no available node in partition(s) {', '.join(chosen)}"
                          + (f" (unavailable: {', '.join(left_out)})" if left_out else ""))
    return homes


def _without_excluded(nodes: list[SlurmNode], options: DiscoverOptions, chosen: list[str],
                      notes: list[str]) -> list[SlurmNode]:
    """The nodes less those --exclude-nodes names and those with an --exclude-feature; an
    exclusion that matches none of the chosen partitions' nodes is a mistake, named."""
    names = [name for text in options.exclude_nodes for name in expand_hostlist(text)]
    features = {f.lower() for text in options.exclude_features for f in text.split(",") if f.strip()}
    where = f"partition(s) {', '.join(chosen)}"
    missing = [n for n in names if n not in {node.name for node in nodes}]
    if missing:
        raise HeteroError(f"--exclude-nodes {', '.join(missing)}: no such node in {where}; its nodes: "
                          f"{', '.join(n.name for n in nodes) or 'none'}")
    unused = sorted(f for f in features if not any(f in {x.lower() for x in n.features} for n in nodes))
    if unused:
        raise HeteroError(f"--exclude-feature {', '.join(unused)}: no node of {where} has it; their features: "
                          f"{', '.join(sorted({f for n in nodes for f in n.features})) or 'none'}")
    out = [n for n in nodes if n.name in names or features & {f.lower() for f in n.features}]
    if out:
        notes.append(f"left out by --exclude-nodes/--exclude-feature: {', '.join(n.name for n in out)}")
    return [n for n in nodes if n not in out]


def _describe(homes: dict[SlurmNode, str], probes: dict[str, tuple[Probe | None, str]],
              device_map: dict[str, str], options: DiscoverOptions, notes: list[str]) -> list[DiscoveredNode]:
    """Device type, count and NIC of every node; every node whose device is unclear named at once."""
    problems: dict[str, list[str]] = {}
    found = []
    for node, home in homes.items():
        probe, error = probes.get(node.name, (None, ""))
        if error:
            notes.append(f"{node.name}: probe failed: {error}")
        resolved = resolve_device(node, probe, device_map)
        count = sum(g.count for g in node.gpus) or (len(probe.gpus) if probe else 0) or options.gpus_per_node
        if resolved.problem or not count:
            problem = resolved.problem or ("has no gpu GRES and no GPU its probe could see; if it has GPUs that "
                                            "Slurm does not list, pass --gpus-per-node N")
            problems.setdefault(problem, []).append(node.name)
            continue
        kind, gbps, nic_from = _nic(node, probe, options)
        found.append(DiscoveredNode(node, home, resolved.device, count, kind, gbps, resolved.how, nic_from))
    if problems:
        raise HeteroError("cannot tell the device type of every node:\n" + "\n".join(
            f"  - node{'s' if len(names) > 1 else ''} {', '.join(names)}: {problem}"
            for problem, names in problems.items()) + "\n" + _exclusion_hint(
                [n for n in homes if any(n.name in names for names in problems.values())], list(homes)))
    guessed = [n.slurm.name for n in found if n.nic_from.startswith("default")]
    if guessed:
        kind, gbps = DEFAULT_NIC
        notes.append(f"NIC unknown on {', '.join(guessed)}: assumed {kind} {gbps:g} Gbit/s; pass --nic KIND:GBPS")
    return found


def _exclusion_hint(unclear: list[SlurmNode], every: list[SlurmNode]) -> str:
    """How to leave out nodes that are not for training (no GPU, another kind of machine): by
    name, or by a feature that they all have and no other node has."""
    hint = f"a node that is not for training can be left out: --exclude-nodes {','.join(n.name for n in unclear)}"
    others = [n for n in every if n not in unclear]
    shared = set.intersection(*({f.lower() for f in n.features} for n in unclear)) if unclear else set()
    own = sorted(f for f in shared if not any(f in {x.lower() for x in n.features} for n in others))
    return hint + (f" (or --exclude-feature {own[0]})" if own else "")


def _spec(found: list[DiscoveredNode], islands: dict[str, str], options: DiscoverOptions,
          slurm_name: str) -> dict:
    groups: dict[str, list[dict]] = {}
    for n in found:
        groups.setdefault(islands[n.slurm.name], []).append({
            "host": n.slurm.name, "device": n.device, "count": n.count,
            "intra_link": options.intra_links.get(n.device, INTRA_LINKS.get(n.device, "pcie4")),
            "nic": {"kind": n.nic_kind, "gbps": _number(n.nic_gbps)}})
    names = list(groups)
    inter = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            kind, gbps = options.inter_group or ("ethernet", min(n["nic"]["gbps"] for n in groups[a] + groups[b]))
            inter.append({"between": [a, b], "kind": kind, "gbps": _number(gbps)})
    spec = {"name": options.name or slurm_name or "slurm",
            "groups": [{"name": g, "nodes": nodes} for g, nodes in groups.items()]}
    if inter:
        spec["inter_group"] = inter
    return spec


def _nic(node: SlurmNode, probe: Probe | None, options: DiscoverOptions) -> tuple[str, float, str]:
    for selector in (node.name, *node.partitions, *node.features, ""):
        if selector in options.nics:
            kind, gbps = options.nics[selector]
            return kind, gbps, f"--nic {selector + '=' if selector else ''}{kind}:{gbps:g}"
    seen = nic_of(probe) if probe else None
    if seen:
        return seen[0], seen[1], f"probe: {seen[2]}"
    kind, gbps = DEFAULT_NIC
    return kind, gbps, f"default ({'the probe found none' if probe else 'no probe'})"


def _groups(rule: str, found: list[DiscoveredNode], run: Runner, notes: list[str]) -> tuple[str, dict[str, str]]:
    """(the rule used, node -> group name)."""
    if rule in ("auto", "topology"):
        topology = run(["scontrol", "show", "topology"], 60)
        islands = parse_topology(topology.stdout) if topology.returncode == 0 else {}
        if islands:
            outside = [n.slurm.name for n in found if n.slurm.name not in islands]
            if outside:
                notes.append(f"not in Slurm's topology, grouped by partition: {', '.join(outside)}")
            return "topology (top switch of each tree)", {
                n.slurm.name: islands.get(n.slurm.name) or n.home_partition for n in found}
        if rule == "topology":
            raise HeteroError("--group-by topology: this Slurm cluster has no topology (TopologyPlugin is not "
                              "topology/tree); use --group-by partition, device or one")
        rule = "partition"
    if rule == "partition":
        return "partition (the smallest chosen partition holding each node)", {
            n.slurm.name: n.home_partition for n in found}
    if rule == "device":
        return "device type", {n.slurm.name: n.device for n in found}
    return "one group", {n.slurm.name: "cluster" for n in found}


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _config_value(text: str, key: str) -> str:
    for line in text.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == key:
            return value.strip()
    return ""


# ----- argument values ---------------------------------------------------------------------


def parse_nic(text: str) -> tuple[str, tuple[str, float]]:
    """`[SELECTOR=]KIND:GBPS` -> (selector or '', (kind, gbps))."""
    selector, _, value = text.rpartition("=")
    kind, _, gbps = value.partition(":")
    try:
        rate = float(gbps)
    except ValueError:
        rate = 0.0
    if kind not in NIC_KINDS or rate <= 0:
        raise HeteroError(f"--nic {text}: expected [NODE|PARTITION|FEATURE=]KIND:GBPS with KIND one of "
                          f"{', '.join(NIC_KINDS)} and GBPS > 0, e.g. --nic ib:400")
    return selector, (kind, rate)


def parse_mapping(flag: str, text: str) -> tuple[str, str]:
    label, _, value = text.partition("=")
    if not label or not value:
        raise HeteroError(f"{flag} {text}: expected LABEL=NAME, e.g. {flag} a100=A100-80GB")
    return label, value


def spec_yaml(discovery: Discovery, command: str) -> str:
    """The spec as YAML, headed by how it was made."""
    header = [f"# Discovered from Slurm by `{command}`.",
              "# Check the NICs and inter_group links: Slurm and the probe see only part of the network."]
    header += [f"# {note}" for note in discovery.notes]
    body = yaml.safe_dump(discovery.spec, sort_keys=False, default_flow_style=None, width=120)
    return "\n".join(header) + "\n" + body

