"""The plan file (plan.json, version 1): how one training job is laid out on a cluster.

A plan fixes the parallel degrees, how many decoder layers each pipeline stage holds, how
many micro-batches each data-parallel replica runs per iteration, and which launched
process plays which Megatron rank:

- Logical ranks follow Megatron's default order (tensor fastest, then data, then
  pipeline): tensor rank t of replica d in stage s is logical rank ``t + tp*(d + dp*s)``.
- ``rank_order[i]`` is the launch rank (torchrun's RANK) that runs logical rank i.
- ``devices[r]`` says what launch rank r is (host, device type, vendor, NIC).

Fields this module does not know (predictions, provenance) are kept as they are.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetero.errors import PlanError
from hetero.validation import describe_validation_error

PLAN_VERSION = 1


class _Entry(BaseModel):
    model_config = ConfigDict(extra="allow")


class StageEntry(_Entry):
    num_layers: int = Field(ge=1, description="decoder layers this pipeline stage builds")


class ReplicaEntry(_Entry):
    num_micro_batches: int = Field(ge=1, description="micro-batches per iteration")


class DeviceEntry(_Entry):
    host: str = Field(min_length=1, description="node the launch rank runs on")
    device_type: str = Field(min_length=1, description="catalog name, e.g. A100-40GB, or cpu")
    vendor: str = Field(min_length=1, description="nvidia, amd, cpu, ...")
    nic: str | None = Field(default=None, description="network card type: ib, roce, ethernet")


@dataclass(frozen=True)
class RankCoords:
    """Where one logical rank sits in the (tensor, data, pipeline) grid."""

    tp_rank: int
    dp_rank: int
    pp_rank: int


class Plan(BaseModel):
    """A validated plan; build it with ``Plan.load`` or ``Plan.from_dict``."""

    model_config = ConfigDict(extra="allow")

    version: Literal[1]
    tensor_parallel: int = Field(ge=1)
    pipeline_parallel: int = Field(ge=1)
    data_parallel: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    stages: list[StageEntry] = Field(min_length=1)
    replicas: list[ReplicaEntry] = Field(min_length=1)
    rank_order: list[int]
    devices: list[DeviceEntry]

    @model_validator(mode="after")
    def _check_consistency(self) -> "Plan":
        problems = []
        world = self.tensor_parallel * self.pipeline_parallel * self.data_parallel
        if len(self.stages) != self.pipeline_parallel:
            problems.append(
                f"stages has {len(self.stages)} entries but pipeline_parallel is "
                f"{self.pipeline_parallel}: give one entry per pipeline stage"
            )
        if len(self.replicas) != self.data_parallel:
            problems.append(
                f"replicas has {len(self.replicas)} entries but data_parallel is "
                f"{self.data_parallel}: give one entry per data-parallel replica"
            )
        if len(self.devices) != world:
            problems.append(
                f"devices has {len(self.devices)} entries but tensor_parallel x "
                f"pipeline_parallel x data_parallel = {world}: give one entry per launch rank"
            )
        if sorted(self.rank_order) != list(range(world)):
            problems.append(
                f"rank_order must be a permutation of 0..{world - 1} (one launch rank per "
                f"logical rank, each used once); got {self.rank_order}"
            )
        hosts_seen: list[str] = []
        for device in self.devices:
            if not hosts_seen or hosts_seen[-1] != device.host:
                if device.host in hosts_seen:
                    problems.append(
                        f"devices of host {device.host!r} are not contiguous in launch order; "
                        "torchrun numbers the ranks of one node consecutively, so list each "
                        "host's devices together"
                    )
                    break
                hosts_seen.append(device.host)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ----- loading and saving -------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict, source: str = "plan") -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"{source}: a plan is a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version is not None and version != PLAN_VERSION:
            raise PlanError(
                f"{source}: plan version {version!r} is not supported by this release "
                f"(it reads version {PLAN_VERSION}); regenerate the plan with hetero-plan"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise PlanError(
                describe_validation_error(
                    err, source, f"hetero plan (version {PLAN_VERSION})",
                    "Fix these fields, or regenerate the plan with hetero-plan.",
                )
            ) from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise PlanError(f"plan file {path} does not exist; pass the path hetero-plan wrote") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanError(
                f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
                "fix the file or regenerate it with hetero-plan"
            ) from None
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict:
        return self.model_dump(mode="json", exclude_none=True)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the plan atomically (a reader never sees half a file)."""
        write_json_atomic(path, self.to_dict())

    # ----- derived facts ---------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def num_layers(self) -> int:
        return sum(stage.num_layers for stage in self.stages)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per iteration summed over replicas."""
        return sum(replica.num_micro_batches for replica in self.replicas)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    # ----- logical-rank arithmetic (the one place that knows Megatron's rank order) -----

    def coords(self, logical_rank: int) -> RankCoords:
        tp, dp = self.tensor_parallel, self.data_parallel
        return RankCoords(
            tp_rank=logical_rank % tp,
            dp_rank=(logical_rank // tp) % dp,
            pp_rank=logical_rank // (tp * dp),
        )

    def rank_at(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """The logical rank of tensor rank tp_rank of replica dp_rank in stage pp_rank."""
        return logical_rank_at(tp_rank, dp_rank, pp_rank, self.tensor_parallel, self.data_parallel)

    def tensor_group(self, dp_rank: int, pp_rank: int) -> list[int]:
        """Logical ranks of one (replica, stage): its tensor-parallel group."""
        return [self.rank_at(t, dp_rank, pp_rank) for t in range(self.tensor_parallel)]

    def data_group(self, tp_rank: int, pp_rank: int) -> list[int]:
        """Logical ranks that reduce the same gradients: one per replica."""
        return [self.rank_at(tp_rank, d, pp_rank) for d in range(self.data_parallel)]

    def pipeline_group(self, tp_rank: int, dp_rank: int) -> list[int]:
        """Logical ranks of one replica's pipeline, stage by stage."""
        return [self.rank_at(tp_rank, dp_rank, s) for s in range(self.pipeline_parallel)]

    def stage_device(self, dp_rank: int, pp_rank: int) -> "DeviceEntry":
        """The device of tensor rank 0 of one (replica, stage)."""
        return self.device_of_logical(self.rank_at(0, dp_rank, pp_rank))

    def logical_rank(self, launch_rank: int) -> int:
        return self.rank_order.index(launch_rank)

    def launch_rank(self, logical_rank: int) -> int:
        return self.rank_order[logical_rank]

    def device_of_logical(self, logical_rank: int) -> DeviceEntry:
        return self.devices[self.rank_order[logical_rank]]

    def first_micro_batch(self, dp_rank: int) -> int:
        """Index, within an iteration's global batch, of replica dp_rank's first micro-batch."""
        return sum(replica.num_micro_batches for replica in self.replicas[:dp_rank])

    def split_micro_batches(self, global_batch_size: int) -> list[int]:
        """Micro-batches per replica for an iteration of global_batch_size samples (a ramp
        step of --rampup-batch-size): the plan's proportions, rounded to whole micro-batches
        by the largest-remainder rule (ties to the lower replica index). The plan's own global
        batch gives back the plan's counts exactly."""
        if global_batch_size % self.micro_batch_size:
            raise PlanError(
                f"a global batch of {global_batch_size} samples is not a whole number of "
                f"micro-batches of {self.micro_batch_size}"
            )
        total = global_batch_size // self.micro_batch_size
        weights = [replica.num_micro_batches for replica in self.replicas]
        quotas = [total * w for w in weights]  # in units of 1/sum(weights)
        counts = [q // self.num_micro_batches for q in quotas]
        by_remainder = sorted(range(len(weights)),
                              key=lambda d: (-(quotas[d] % self.num_micro_batches), d))
        for d in by_remainder[: total - sum(counts)]:
            counts[d] += 1
        if min(counts) == 0:
            raise PlanError(
                f"a global batch of {global_batch_size} samples ({total} micro-batches) leaves "
                f"replica {counts.index(0)} without a micro-batch under the plan's split "
                f"{weights}; every replica must run at least one: start the batch-size ramp "
                "higher (--rampup-batch-size START ...)"
            )
        return counts

    def pipeline_layout(self) -> list[list[str]]:
        """The stage split in megatron-core's ``pipeline_model_parallel_layout`` form."""
        layout = [["decoder"] * stage.num_layers for stage in self.stages]
        layout[0].insert(0, "embedding")
        layout[-1].append("loss")
        return layout

    def hosts(self) -> list[tuple[str, list[int]]]:
        """(host, launch ranks on it) in launch order."""
        groups: list[tuple[str, list[int]]] = []
        for launch_rank, device in enumerate(self.devices):
            if not groups or groups[-1][0] != device.host:
                groups.append((device.host, []))
            groups[-1][1].append(launch_rank)
        return groups

    @classmethod
    def uniform(
        cls,
        *,
        tensor_parallel: int,
        pipeline_parallel: int,
        data_parallel: int,
        micro_batch_size: int,
        num_layers: int,
        global_batch_size: int,
        devices: list[DeviceEntry] | None = None,
    ) -> "Plan":
        """The plan stock Megatron runs: even stages, equal replicas, launch-order ranks."""
        if num_layers % pipeline_parallel:
            raise PlanError(
                f"num_layers ({num_layers}) is not divisible by pipeline_parallel "
                f"({pipeline_parallel}); pass a --hetero-plan with an uneven stage split"
            )
        per_replica = micro_batch_size * data_parallel
        if global_batch_size % per_replica:
            raise PlanError(
                f"global batch size ({global_batch_size}) is not divisible by micro batch size "
                f"x data parallel ({micro_batch_size} x {data_parallel}); pass a --hetero-plan "
                "with per-replica micro-batch counts"
            )
        world = tensor_parallel * pipeline_parallel * data_parallel
        if devices is None:
            devices = [DeviceEntry(host="localhost", device_type="cpu", vendor="cpu")] * world
        return cls(
            version=PLAN_VERSION,
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            data_parallel=data_parallel,
            micro_batch_size=micro_batch_size,
            stages=[StageEntry(num_layers=num_layers // pipeline_parallel)] * pipeline_parallel,
            replicas=[ReplicaEntry(num_micro_batches=global_batch_size // per_replica)]
            * data_parallel,
            rank_order=list(range(world)),
            devices=list(devices),
        )

    def summary(self) -> str:
        stages = ",".join(str(s.num_layers) for s in self.stages)
        replicas = ",".join(str(r.num_micro_batches) for r in self.replicas)
        return (
            f"TP={self.tensor_parallel} PP={self.pipeline_parallel} DP={self.data_parallel} "
            f"micro-batch={self.micro_batch_size} layers per stage=[{stages}] "
            f"micro-batches per replica=[{replicas}] global batch={self.global_batch_size}"
        )


def logical_rank_at(tp_rank: int, dp_rank: int, pp_rank: int, tensor_parallel: int,
                    data_parallel: int) -> int:
    """Megatron's default order: tensor fastest, then data, then pipeline. For code that
    builds a plan's rank_order before the plan exists (placement); everyone else asks the
    Plan."""
    return tp_rank + tensor_parallel * (dp_rank + data_parallel * pp_rank)


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    """Writes JSON so that a crash leaves either the old file or the new one, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


if __name__ == "__main__":  # `python -m hetero.plan ...` is hetero-plan
    import sys

    from hetero.cli import main

    sys.exit(main())
