"""Which Slurm nodes are which device: their labels (features, GRES) read as discover reads
them, the feature expressions that select a device's nodes, the GPUs a node lists."""

from __future__ import annotations

from collections.abc import Sequence

from hetero.plan import Plan
from hetero.slurm import discover, text as slurm_text


def feature_terms(expression: str) -> list[list[str]]:
    """A Slurm feature expression as OR-ed lists of AND-ed features (`a&b|c`: [[a, b], [c]])."""
    return [[f.strip() for f in term.split("&") if f.strip()] for term in expression.split("|") if term.strip()]


def matches_features(node: slurm_text.SlurmNode, expression: str) -> bool:
    have = set(node.features)
    return any(set(term) <= have for term in feature_terms(expression))


def gpu_count(node: slurm_text.SlurmNode) -> int | None:
    """GPUs Slurm lists on the node (GRES), None when it lists none."""
    return sum(g.count for g in node.gpus) or None


def node_devices(nodes: Sequence[slurm_text.SlurmNode], plan: Plan,
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


def auto_feature(device: str, pool: list[slurm_text.SlurmNode], devices: dict[str, str | None],
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


def features_of(pool: list[slurm_text.SlurmNode], devices: dict[str, str | None], device: str) -> list[str]:
    """The features of the pool's `device` nodes (for a message; ["none"] when they have none)."""
    return sorted({f for n in pool if devices[n.name] == device for f in n.features}) or ["none"]
