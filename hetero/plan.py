"""The plan file (plan.json, version 3): how one training job is laid out on a cluster.

A plan fixes the parallel degrees, how many decoder layers each pipeline stage holds, how
many micro-batches each data-parallel replica runs per iteration, and which launched
process plays which Megatron rank:

- Logical ranks follow Megatron's default order (tensor fastest, then data, then
  pipeline): tensor rank t of replica d in stage s is logical rank ``t + tp*(d + dp*s)``.
  With a tensor-parallel degree per stage (version 3) stage s holds ``dp * tp_s`` ranks
  after those of the stages before it: logical rank ``offset_s + t + tp_s*d``.
- ``rank_order[i]`` is the launch rank (torchrun's RANK) that runs logical rank i.
- ``devices[r]`` says what launch rank r is (host, device type, vendor, NIC).

Version 2 adds two optional per-stage fields (a version 1 plan is a valid version 2 plan):

- ``stages[s].recompute``: this stage's activation recomputation, overriding the
  ``--recompute-*`` flags for it: ``"selective"``, ``"none"`` (keep every activation), or
  ``{"granularity": "full", "method": "uniform"|"block", "num_layers": N}`` /
  ``{"granularity": "selective", "modules": ["core_attn", ...]}``. A stage on a small
  device recomputes while one on a large device keeps its activations. With method
  "uniform", num_layers must divide the stage's layers (each virtual stage's): megatron-core
  checkpoints whole groups of that many layers.
- ``stages[s].virtual_stages``: the interleaved (virtual-pipeline) schedule. Pipeline rank s
  holds len(virtual_stages) model chunks with these decoder-layer counts, in model order:
  chunk v of rank s is virtual stage ``v*pp + s`` of the model (megatron-core's order), so
  ``[3, 2]`` on rank 0 and ``[2, 1]`` on rank 1 of a PP=2 plan builds the model as
  3 | 2 | 2 | 1 layers. ``num_layers`` is their sum. Either every stage gives it, with the
  same count of chunks (at least 2), or none does.

What megatron-core 0.16.1's interleaved schedule requires, and the planner must respect
(``forward_backward_pipelining_with_interleaving``; checked here with a clear error):

- pipeline_parallel >= 2 (the interleaved schedule is the pipelined one);
- every replica runs at least ``pipeline_parallel`` micro-batches, and a multiple of
  ``pipeline_parallel``: the schedule runs micro-batches in groups of
  ``microbatch_group_size_per_vp_stage`` (default: the pipeline size) and refuses a last
  group with fewer than ``pipeline_parallel`` micro-batches (it would stall the pipeline);
  with the default group size the remainder must therefore be 0. Replicas may still run
  different counts (e.g. 6 and 2 with PP=2);
- (this release, not megatron-core) every virtual stage holds at least one decoder layer.
Megatron-LM additionally needs PP > 2 unless pipeline communication is overlapped
(``--no-overlap-p2p-communication`` with PP=2 is refused at start-up, as Megatron-LM does).

Version 3 adds ``stages[s].tensor_parallel``: this stage's tensor-parallel degree (default:
the job's ``tensor_parallel``). Replicas of one stage share it, so the world size is
``data_parallel x sum(stage TP)``; a stage on small devices shards wider while one on large
devices runs whole. Stage-to-stage transfers between stages of different degrees are
re-sharded at run time (megatron/hetero/stage_transfer.py).

Fields this module does not know (predictions, provenance) are kept as they are.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetero.errors import PlanError
from hetero.io import describe_validation_error, write_json_atomic

PLAN_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)


class _Entry(BaseModel):
    model_config = ConfigDict(extra="allow")


class RecomputeEntry(BaseModel):
    """One stage's activation recomputation (megatron-core's TransformerConfig fields)."""

    model_config = ConfigDict(extra="forbid")

    granularity: Literal["full", "selective"]
    method: Literal["uniform", "block"] | None = None
    num_layers: int | None = Field(default=None, ge=1)
    modules: list[str] | None = Field(default=None, description="selective: what to recompute")

    @model_validator(mode="after")
    def _check_fields(self) -> "RecomputeEntry":
        if self.granularity == "full" and (self.method is None or self.num_layers is None):
            raise ValueError('full recomputation needs "method" (uniform or block) and "num_layers"')
        if self.granularity == "selective" and (self.method is not None or self.num_layers is not None):
            raise ValueError('selective recomputation takes no "method" or "num_layers" (only "modules")')
        return self


class StageEntry(_Entry):
    num_layers: int = Field(ge=1, description="decoder layers this pipeline stage builds")
    tensor_parallel: int | None = Field(
        default=None, ge=1, description="version 3: this stage's tensor-parallel degree (default: the job's)")
    recompute: Literal["selective", "none"] | RecomputeEntry | None = Field(
        default=None, description="version 2: this stage's recomputation, overriding the flags")
    virtual_stages: list[int] | None = Field(
        default=None, min_length=2,
        description="version 2: decoder layers of each model chunk (virtual stage) of this rank")

    def recompute_mode(self) -> Literal["none", "selective", "full"] | None:
        """What the cost model needs of recompute_setting: the mode (None: the flags')."""
        setting = self.recompute_setting()
        if setting == "flags":
            return None
        return "none" if setting is None else setting.granularity

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

    version: Literal[1, 2, 3]
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
        world = self.world_size
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
            grid = (f"data_parallel x sum of the stages' tensor_parallel {self.stage_tensor_parallel}"
                    if self.per_stage_tensor_parallel else "tensor_parallel x pipeline_parallel x data_parallel")
            problems.append(
                f"devices has {len(self.devices)} entries but {grid} = {world}: give one entry per launch rank"
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
        problems += self._virtual_stage_problems()
        for index, stage in enumerate(self.stages):
            entry = stage.recompute
            if isinstance(entry, RecomputeEntry) and entry.method == "uniform":
                chunks = stage.virtual_stages or [stage.num_layers]
                if any(n % entry.num_layers for n in chunks):
                    problems.append(
                        f"stages[{index}].recompute: uniform groups of {entry.num_layers} layers do "
                        f"not divide the stage's {'+'.join(map(str, chunks))} layers (megatron-core "
                        "recomputes whole groups); use a divisor or the block method")
        if self.per_stage_tensor_parallel and self.virtual_pipeline_size is not None:
            problems.append(
                f"stages give different tensor_parallel {self.stage_tensor_parallel} and virtual_stages: "
                "the interleaved schedule with a tensor-parallel degree per stage is not supported "
                "(its wrap-around transfers are not re-sharded); drop virtual_stages or use one degree")
        for needed, names in ((2, ("recompute", "virtual_stages")), (3, ("tensor_parallel",))):
            uses = [f"stages[{i}].{name}" for i, stage in enumerate(self.stages)
                    for name in names if getattr(stage, name) is not None]
            if uses and self.version < needed:
                problems.append(f"{', '.join(uses)} need plan version {needed}; set \"version\": {needed}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _virtual_stage_problems(self) -> list[str]:
        """megatron-core 0.16.1's interleaved-schedule constraints (see the module docstring)."""
        given = [stage.virtual_stages for stage in self.stages]
        if all(v is None for v in given):
            return []
        if any(v is None for v in given) or len({len(v) for v in given}) != 1:
            return ["virtual_stages must be given for every stage, with the same number of "
                    "virtual stages on each (megatron-core gives every pipeline rank as many "
                    f"model chunks); got {given}"]
        problems = []
        for index, stage in enumerate(self.stages):
            if min(stage.virtual_stages) < 1:
                problems.append(f"stages[{index}].virtual_stages {stage.virtual_stages}: every "
                                "virtual stage needs at least one decoder layer")
            if sum(stage.virtual_stages) != stage.num_layers:
                problems.append(f"stages[{index}].virtual_stages {stage.virtual_stages} sum to "
                                f"{sum(stage.virtual_stages)}, not num_layers {stage.num_layers}")
        pp = self.pipeline_parallel
        if pp < 2:
            problems.append("virtual_stages need pipeline_parallel >= 2 (the interleaved schedule "
                            "is a pipeline schedule)")
            return problems
        wrong = [f"replica {d}: {r.num_micro_batches}" for d, r in enumerate(self.replicas)
                 if r.num_micro_batches < pp or r.num_micro_batches % pp]
        if wrong:
            problems.append(
                f"the interleaved schedule runs micro-batches in groups of pipeline_parallel "
                f"({pp}) and megatron-core 0.16.1 refuses a smaller last group: every replica's "
                f"num_micro_batches must be a positive multiple of {pp} ({'; '.join(wrong)}); "
                "move micro-batches between replicas or drop virtual_stages")
        return problems

    # ----- loading and saving -------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict, source: str = "plan") -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"{source}: a plan is a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version is not None and version not in SUPPORTED_VERSIONS:
            raise PlanError(
                f"{source}: plan version {version!r} is not supported by this release "
                f"(it reads versions {', '.join(map(str, SUPPORTED_VERSIONS))}); regenerate the "
                "plan with hetero-plan"
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
    def stage_tensor_parallel(self) -> list[int]:
        """Each stage's tensor-parallel degree (its own, else the job's)."""
        return [stage.tensor_parallel or self.tensor_parallel for stage in self.stages]

    @property
    def per_stage_tensor_parallel(self) -> bool:
        """Whether stages differ in tensor-parallel degree."""
        return len(set(self.stage_tensor_parallel)) > 1

    @property
    def max_tensor_parallel(self) -> int:
        """The widest stage's degree: vocabulary padding follows it, so every plan of one model
        trains the same (padded) vocabulary."""
        return max(self.stage_tensor_parallel)

    def stage_offset(self, pp_rank: int) -> int:
        """The first logical rank of stage pp_rank."""
        return self.data_parallel * sum(self.stage_tensor_parallel[:pp_rank])

    @property
    def world_size(self) -> int:
        return self.data_parallel * sum(self.stage_tensor_parallel)

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
        if not 0 <= logical_rank < self.world_size:
            raise ValueError(f"logical rank {logical_rank} is outside 0..{self.world_size - 1}")
        pp_rank = 0
        while logical_rank >= self.stage_offset(pp_rank + 1):
            pp_rank += 1
        tp, local = self.stage_tensor_parallel[pp_rank], logical_rank - self.stage_offset(pp_rank)
        return RankCoords(tp_rank=local % tp, dp_rank=local // tp, pp_rank=pp_rank)

    def rank_at(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """The logical rank of tensor rank tp_rank of replica dp_rank in stage pp_rank."""
        degrees = self.stage_tensor_parallel
        if not (0 <= tp_rank < degrees[pp_rank] and 0 <= dp_rank < self.data_parallel):
            raise ValueError(f"stage {pp_rank} has tensor ranks 0..{degrees[pp_rank] - 1} and replicas "
                             f"0..{self.data_parallel - 1}; asked for ({tp_rank}, {dp_rank})")
        return logical_rank_at(tp_rank, dp_rank, pp_rank, degrees, self.data_parallel)

    def tensor_group(self, dp_rank: int, pp_rank: int) -> list[int]:
        """Logical ranks of one (replica, stage): its tensor-parallel group."""
        return [self.rank_at(t, dp_rank, pp_rank) for t in range(self.stage_tensor_parallel[pp_rank])]

    def data_group(self, tp_rank: int, pp_rank: int) -> list[int]:
        """Logical ranks that reduce the same gradients: one per replica."""
        return [self.rank_at(tp_rank, d, pp_rank) for d in range(self.data_parallel)]

    def pipeline_group(self, tp_rank: int, dp_rank: int) -> list[int]:
        """Logical ranks of one replica's pipeline, stage by stage: tensor rank tp_rank of
        each stage (modulo a narrower stage's degree, whose rank then serves several)."""
        return [self.rank_at(tp_rank % tp, dp_rank, s) for s, tp in enumerate(self.stage_tensor_parallel)]

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """Every logical rank of one replica (all its stages' tensor groups): its model-parallel group."""
        return [r for s in range(self.pipeline_parallel) for r in self.tensor_group(dp_rank, s)]

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

    @property
    def virtual_pipeline_size(self) -> int | None:
        """Model chunks per pipeline rank (interleaved schedule), None without virtual stages."""
        first = self.stages[0].virtual_stages
        return len(first) if first else None

    def virtual_stage_layers(self) -> list[int]:
        """Decoder layers of every virtual stage in model order (the stages without them)."""
        if self.virtual_pipeline_size is None:
            return [stage.num_layers for stage in self.stages]
        return [stage.virtual_stages[chunk] for chunk in range(self.virtual_pipeline_size)
                for stage in self.stages]

    def pipeline_layout(self) -> list[list[str]]:
        """The split in megatron-core's ``pipeline_model_parallel_layout`` form: one entry per
        (virtual) stage in model order, entry ``v*pp + s`` being chunk v of pipeline rank s."""
        layout = [["decoder"] * n for n in self.virtual_stage_layers()]
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
        stages = ",".join(
            "+".join(map(str, s.virtual_stages)) if s.virtual_stages else str(s.num_layers)
            for s in self.stages)
        replicas = ",".join(str(r.num_micro_batches) for r in self.replicas)
        tp = ("[" + ",".join(map(str, self.stage_tensor_parallel)) + "]" if self.per_stage_tensor_parallel
              else str(self.tensor_parallel))
        return (
            f"TP={tp} PP={self.pipeline_parallel} DP={self.data_parallel} "
            f"micro-batch={self.micro_batch_size} layers per stage=[{stages}] "
            f"micro-batches per replica=[{replicas}] global batch={self.global_batch_size}"
        )


def logical_rank_at(tp_rank: int, dp_rank: int, pp_rank: int, tensor_parallel: int | Sequence[int],
                    data_parallel: int) -> int:
    """Megatron's default order: tensor fastest, then data, then pipeline; with a degree per
    stage (tensor_parallel a list), stage s starts after the ranks of the stages before it.
    For code that builds a plan's rank_order before the plan exists (placement); everyone
    else asks the Plan."""
    degrees = [tensor_parallel] * (pp_rank + 1) if isinstance(tensor_parallel, int) else tensor_parallel
    return data_parallel * sum(degrees[:pp_rank]) + tp_rank + degrees[pp_rank] * dp_rank
