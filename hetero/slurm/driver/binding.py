"""Binding: the plan names device classes and counts, not necessarily real hosts; the
driver binds its hosts to the nodes Slurm allocated, component by component (see the
driver's docstring, "Binding"), and renames them in the plan."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from hetero.errors import HeteroError
from hetero.launch.elastic import reshape_cluster_spec
from hetero.slurm.submit.components import Component
from hetero.slurm.submit.features import matches_features
from hetero.plan import Plan
from hetero.slurm import text as slurm_text


@dataclass
class Slot:
    """Where a node runs its steps: a component of the main job, or a second allocation."""

    node: str
    job_id: str  # the component's own job id, or the second allocation's
    het_group: int | None  # None: not a component of a heterogeneous job


@dataclass
class Allocation:
    """What Slurm allocated to the job, as the batch environment says."""

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
            nodes = [slurm_text.expand_hostlist(environ[f"SLURM_JOB_NODELIST_HET_GROUP_{k}"]) for k in range(size)]
            return cls(job_id, jobs, nodes, True)
        return cls(job_id, [job_id], [slurm_text.expand_hostlist(environ["SLURM_JOB_NODELIST"])], False)


def nodes_by_class(nodes: list[str], components: Sequence[Component],
                   info: dict[str, slurm_text.SlurmNode]) -> list[list[str]]:
    """--layout single: the job's nodes of each component, told apart as the job asked for
    them (the component's feature, or its node list)."""
    by_class: list[list[str]] = [[] for _ in components]
    for node in nodes:
        homes = [c.index for c in components
                 if (node in c.nodelist if c.nodelist else
                     node in info and matches_features(info[node], c.constraint or ""))]
        if len(homes) != 1:
            raise HeteroError(f"node {node} of the job belongs to {len(homes)} of the plan's node classes (by "
                              "their features or node lists); write the job again with --layout het")
        by_class[homes[0]].append(node)
    return by_class


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
    return reshape_cluster_spec(spec, lambda name, base: (
        {**base, "host": mapping[name], "count": devices_per_host[name]} if name in mapping else None))


def bound_plan(plan: Plan, mapping: dict[str, str]) -> Plan:
    """The plan with its hosts renamed to the bound nodes (launch order and rank_order kept)."""
    data = plan.to_dict()
    for device in data["devices"]:
        device["host"] = mapping[device["host"]]
    if data.get("cluster"):
        devices_per_host = {host: len(ranks) for host, ranks in plan.hosts()}
        data["cluster"] = bound_cluster_spec(data["cluster"], mapping, devices_per_host)
    return Plan.from_dict(data, "the plan bound to the allocation")
