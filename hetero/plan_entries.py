"""The entries of a plan's lists: its pipeline stages (with their recomputation and
virtual stages), data-parallel replicas and launched devices; the constraints
megatron-core 0.16.1's interleaved schedule puts on them, and the devices' agreement with
the plan's cluster section. hetero/plan.py holds the plan;
docs/plan-format.md describes every field.

Unknown keys in an entry are kept and written back, as at the plan's top level.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetero.record import MAX_COUNT, Count
from hetero.spec.cluster import ClusterSpec, NodeSpec
from hetero.spec.recompute import MODULES as RECOMPUTE_MODULES, selective as selective_recompute



class _Entry(BaseModel):
    model_config = ConfigDict(extra="allow")


class RecomputeEntry(BaseModel):
    """One stage's activation recomputation (megatron-core's TransformerConfig fields)."""

    model_config = ConfigDict(extra="forbid")

    granularity: Literal["full", "selective"]
    method: Literal["uniform", "block"] | None = None
    num_layers: Count | None = None
    modules: list[str] | None = Field(default=None, description="selective: what to recompute")

    @model_validator(mode="after")
    def _check_fields(self) -> "RecomputeEntry":
        if self.granularity == "full" and (self.method is None or self.num_layers is None):
            raise ValueError('full recomputation needs "method" (uniform or block) and "num_layers"')
        if self.granularity == "selective" and (self.method is not None or self.num_layers is not None):
            raise ValueError('selective recomputation takes no "method" or "num_layers" (only "modules")')
        unknown = sorted(set(self.modules or ()) - set(RECOMPUTE_MODULES))
        if unknown:
            raise ValueError(f"modules {', '.join(unknown)}: megatron-core recomputes {', '.join(RECOMPUTE_MODULES)}")
        return self


class StageEntry(_Entry):
    num_layers: Count = Field(description="decoder layers this pipeline stage builds")
    tensor_parallel: Count | None = Field(
        default=None, description="version 3: this stage's tensor-parallel degree (default: the job's)")
    recompute: Literal["selective", "none"] | RecomputeEntry | None = Field(
        default=None, description="version 2: this stage's recomputation, overriding the flags")
    virtual_stages: list[Annotated[int, Field(strict=True, le=MAX_COUNT)]] | None = Field(
        default=None, min_length=2,
        description="version 2: decoder layers of each model chunk (virtual stage) of this rank")
    device_types: list[str] | None = Field(
        default=None, description="informational (hetero-plan): the device types that run this stage")

    def recompute_mode(self) -> str | None:
        """What the cost model needs of recompute_setting (hetero/spec/recompute.py: none,
        full, selective or selective:MODULE,...; None: the flags')."""
        setting = self.recompute_setting()
        if setting == "flags":
            return None
        if setting is None:
            return "none"
        return selective_recompute(setting.modules) if setting.granularity == "selective" else "full"

    def recompute_setting(self) -> RecomputeEntry | None | Literal["flags"]:
        """The stage's own setting: a RecomputeEntry, None (no recomputation), or "flags"."""
        if self.recompute is None:
            return "flags"
        if self.recompute == "none":
            return None
        if self.recompute == "selective":
            return RecomputeEntry(granularity="selective")
        return self.recompute


class ReplicaEntry(_Entry):
    num_micro_batches: Count = Field(description="micro-batches per iteration")
    device_types: list[str] | None = Field(
        default=None, description="informational (hetero-plan): the device types of this replica")


class TemplateEntry(_Entry):
    """One replica template (version 4): a pipeline shape and the replicas that run it. Its
    fields are those a one-template plan (versions 1-3) gives at its top level."""

    tensor_parallel: Count = Field(description="the template's tensor-parallel degree (a stage may have its own)")
    pipeline_parallel: Count = Field(description="pipeline stages of this template; stages has this many entries")
    data_parallel: Count = Field(description="replicas of this template; replicas has this many entries")
    stages: list[StageEntry] = Field(min_length=1)
    replicas: list[ReplicaEntry] = Field(min_length=1)

    @property
    def stage_tensor_parallel(self) -> tuple[int, ...]:
        """Each stage's tensor-parallel degree (its own, else the template's)."""
        return tuple(stage.tensor_parallel or self.tensor_parallel for stage in self.stages)

    @property
    def num_layers(self) -> int:
        return sum(stage.num_layers for stage in self.stages)


class DeviceEntry(_Entry):
    host: str = Field(min_length=1, description="node the launch rank runs on")
    device_type: str = Field(min_length=1, description="catalog name, e.g. A100-40GB, or cpu")
    vendor: str = Field(min_length=1, description="nvidia, amd, cpu, ...")
    nic: str | None = Field(default=None, description="network card type: ib, roce, ethernet")


def virtual_stage_problems(stages: Sequence[StageEntry], replicas: Sequence[ReplicaEntry],
                           pipeline_parallel: int) -> list[str]:
    """megatron-core 0.16.1's interleaved-schedule constraints (docs/plan-format.md):
    virtual_stages on every stage or on none, as many on each, each with a decoder layer at
    least, summing to the stage's num_layers; pipeline_parallel >= 2; and every replica
    running a positive multiple of pipeline_parallel micro-batches."""
    given = [stage.virtual_stages for stage in stages]
    if all(v is None for v in given):
        return []
    if any(v is None for v in given) or len({len(v) for v in given}) != 1:
        return ["virtual_stages must be given for every stage, with the same number of "
                "virtual stages on each (megatron-core gives every pipeline rank as many "
                f"model chunks); got {given}"]
    problems = []
    for index, stage in enumerate(stages):
        if min(stage.virtual_stages) < 1:
            problems.append(f"stages[{index}].virtual_stages {stage.virtual_stages}: every "
                            "virtual stage needs at least one decoder layer")
        if sum(stage.virtual_stages) != stage.num_layers:
            problems.append(f"stages[{index}].virtual_stages {stage.virtual_stages} sum to "
                            f"{sum(stage.virtual_stages)}, not num_layers {stage.num_layers}")
    pp = pipeline_parallel
    if pp < 2:
        problems.append("virtual_stages need pipeline_parallel >= 2 (the interleaved schedule "
                        "is a pipeline schedule)")
        return problems
    wrong = [f"replica {d}: {r.num_micro_batches}" for d, r in enumerate(replicas)
             if r.num_micro_batches < pp or r.num_micro_batches % pp]
    if wrong:
        problems.append(
            f"the interleaved schedule runs micro-batches in groups of pipeline_parallel "
            f"({pp}) and megatron-core 0.16.1 refuses a smaller last group: every replica's "
            f"num_micro_batches must be a positive multiple of {pp} ({'; '.join(wrong)}); "
            "move micro-batches between replicas or drop virtual_stages")
    return problems


def cluster_problems(devices: Sequence[DeviceEntry], spec: ClusterSpec) -> list[str]:
    """Where the plan's devices (DeviceEntry: host, device_type) disagree with the cluster
    section: a host it does not have, another device type, more ranks than devices. The
    section has passed check_cluster: its hosts are few enough to list."""
    nodes: dict[str, NodeSpec] = {}
    for group in spec.groups:
        for node in group.nodes:
            hosts = [node.host] if node.host else [f"{node.host_prefix}{i}" for i in range(node.num_nodes)]
            nodes.update((host, node) for host in hosts)
    ranks = Counter(device.host for device in devices)
    problems = []
    for host, count in ranks.items():
        node = nodes.get(host)
        if node is None:
            problems.append(f"devices place {count} rank(s) on host {host!r}, which the cluster section does not have")
        elif count > node.count:
            problems.append(f"devices place {count} ranks on host {host!r}, which has {node.count} devices")
    for r, device in enumerate(devices):
        node = nodes.get(device.host)
        if node is not None and node.device != device.device_type:
            problems.append(f"devices[{r}].device_type is {device.device_type}, but host {device.host!r} "
                            f"has {node.device} (the cluster section)")
            break  # one names the mistake; a wrong cluster would list every rank
    return problems
