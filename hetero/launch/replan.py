"""A job planned again for the nodes it has left: the same model, precision, global batch
and search space (the plan records them), on the one job planner (hetero.jobs). Used by
every re-plan of a running job: the elastic supervisor, in-process restart and the Slurm
driver."""

from __future__ import annotations

from typing import Callable

from hetero.errors import HeteroError
from hetero.jobs import plan_for_recorded_job
from hetero.plan import Plan
from hetero.spec.cluster import Cluster


def reshape_cluster_spec(spec: dict, node_for: Callable[[str, dict], dict | None]) -> dict:
    """A cluster spec (its dict) host by host: each host's entry (a host_prefix entry counts
    as its hosts) becomes node_for(host name, the entry's other settings), a one-host node,
    or goes when that is None. Groups left empty and their links go too."""
    groups = []
    for group in spec["groups"]:
        nodes = []
        for node in group["nodes"]:
            names = ([node["host"]] if node.get("host") else
                     [f"{node['host_prefix']}{i}" for i in range(node.get("num_nodes", 1))])
            base = {k: v for k, v in node.items() if k not in ("host", "host_prefix", "num_nodes")}
            nodes += [entry for entry in (node_for(name, base) for name in names) if entry is not None]
        if nodes:
            groups.append({**group, "nodes": nodes})
    kept = {g["name"] for g in groups}
    links = [link for link in spec.get("inter_group", []) if set(link["between"]) <= kept]
    return {**spec, "groups": groups, "inter_group": links}


def cluster_without(cluster: Cluster, hosts: set[str]) -> Cluster:
    """The cluster less some nodes (groups left empty and their links go too)."""
    spec = reshape_cluster_spec(cluster.to_dict(),
                                lambda name, base: None if name in hosts else {**base, "host": name})
    if not spec["groups"]:
        raise HeteroError("every node of the cluster is lost; nothing to re-plan on")
    return Cluster.from_dict(spec, f"{cluster.source} without {', '.join(sorted(hosts))}")


def replan(plan: Plan, lost: set[str]) -> Plan:
    """The same job (model, precision, global batch, search space) on the surviving nodes."""
    missing = [name for name in ("cluster", "model", "training") if getattr(plan, name) is None]
    if missing:
        raise HeteroError(f"the plan has no {', '.join(missing)} section; --elastic needs a plan "
                          "written by hetero-plan (it re-plans the same job on the survivors)")
    cluster = cluster_without(Cluster(plan.cluster, "the plan's cluster"), lost)
    return plan_for_recorded_job(plan, cluster)


def predicted_tokens_per_s(plan: Plan) -> float | None:
    return plan.prediction.tokens_per_s if plan.prediction is not None else None


def speed_text(value: float | None) -> str:
    """A predicted speed for a log line (tokens/s; `?` when the plan has no prediction)."""
    return f"{value:,.0f}" if value is not None else "?"
