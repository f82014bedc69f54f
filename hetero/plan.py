"""The plan file (plan.json): how one training job is laid out on a cluster.

A plan runs one or more *replica templates*. A template is a pipeline shape (how many
decoder layers each stage holds, a tensor-parallel degree per stage, recomputation and
virtual stages per stage) and the data-parallel replicas that run it, each with its number
of micro-batches per iteration; every template holds the whole model, and the global batch
is the sum over all replicas. A plan of one template (versions 1-3) gives that template's
fields at its top level; a plan of several (version 4) lists them under ``templates``.
``rank_order`` says which launched process plays which logical rank: launch rank
``rank_order[i]`` (torchrun's RANK, on ``devices[rank_order[i]]``) runs logical rank i, and
the logical ranks follow the rank grid (hetero/grid.py: templates one after another, each in
Megatron's order).

docs/plan-format.md is the reference: every field, the versions, the rank arithmetic and
megatron-core's constraints. The entries of the lists (templates, stages, replicas, devices)
are in hetero/plan_entries.py, the layout's checks in hetero/plan_checks.py. A plan written
by hetero-plan also carries the job record (``model``, ``training``, ``cluster``,
``prediction``, ``provenance``: hetero/record.py). Unknown top-level keys are kept and
written back unchanged. Counts are bounded (MAX_COUNT) and compared with the lists they size
before anything is built from them, so a malformed file gets a PlanError naming the field,
never a MemoryError.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetero.balance import split_in_proportion
from hetero.errors import PlanError
from hetero.grid import Grid, RankCoords, TemplateShape
from hetero.io import describe_validation_error, write_json_atomic
from hetero.pipeline_layout import SplitFlags, megatron_split
from hetero.plan_checks import ONE_TEMPLATE_FIELDS, expert_parallel_problems, grid_of, plan_problems, split_in_equal_blocks
from hetero.plan_entries import DeviceEntry, ReplicaEntry, StageEntry, TemplateEntry
from hetero.record import (SECTIONS, ClusterSection, Count, ModelRecord, PredictionRecord, ProvenanceRecord,
                           TrainingRecord)

PLAN_VERSION = 3
"""The version a plan of one template is written in."""
TEMPLATES_VERSION = 4
"""The version a plan of several templates is written in."""
SUPPORTED_VERSIONS = (1, 2, 3, 4)

__all__ = ["PLAN_VERSION", "TEMPLATES_VERSION", "DeviceEntry", "Plan", "RankCoords", "ReplicaEntry", "StageEntry",
           "TemplateEntry", "expert_parallel_problems"]


class Plan(BaseModel):
    """A validated plan; build it with ``Plan.load`` or ``Plan.from_dict``.

    One template's layout (versions 1-3) lives in the top-level fields (``tensor_parallel``,
    ``pipeline_parallel``, ``data_parallel``, ``stages``, ``replicas``, read by attribute); several
    (version 4) in ``templates``. ``plan.templates`` lists the templates either way. The
    attributes of one pipeline shape (``stages``, ``tensor_parallel``, ``pipeline_parallel``,
    ``stage_tensor_parallel``, ...) exist for a plan of one template; on one of several they
    raise a PlanError naming the caller's need: ask ``plan.template(k)`` instead. ``replicas``
    and ``data_parallel`` count every template's replicas (replica d of the plan is the d-th
    in template order)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    version: Literal[1, 2, 3, 4]
    top_tensor_parallel: Count | None = Field(default=None, alias="tensor_parallel")
    top_pipeline_parallel: Count | None = Field(default=None, alias="pipeline_parallel")
    top_data_parallel: Count | None = Field(default=None, alias="data_parallel")
    micro_batch_size: Count
    top_stages: list[StageEntry] | None = Field(default=None, alias="stages", min_length=1)
    top_replicas: list[ReplicaEntry] | None = Field(default=None, alias="replicas", min_length=1)
    listed_templates: list[TemplateEntry] | None = Field(default=None, alias="templates", min_length=1)
    rank_order: list[Annotated[int, Field(strict=True)]]
    devices: list[DeviceEntry]
    # Expert parallelism (MoE): experts spread over expert_parallel ranks of each stage, each
    # expert split over expert_tensor_parallel ranks (None: the stage's tensor-parallel degree,
    # megatron-core's default). Absent from plans without experts: those load with 1 and None.
    expert_parallel: Count = 1
    expert_tensor_parallel: Count | None = None
    # Context parallelism: each replica's sequences split over context_parallel ranks per
    # tensor rank (Megatron's order: tensor fastest, then context, then data, then pipeline).
    # They run the replica's micro-batches together. Absent from plans without it: 1.
    context_parallel: Count = 1
    # The job record (hetero/record.py): written by hetero-plan, absent from hand-written plans.
    model: ModelRecord | None = None
    training: TrainingRecord | None = None
    cluster: ClusterSection | None = None
    prediction: PredictionRecord | None = None
    provenance: ProvenanceRecord | None = None

    @model_validator(mode="after")
    def _check_consistency(self) -> "Plan":
        problems = plan_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ----- loading and saving -------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict, source: str = "plan") -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"{source}: a plan is a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version is not None and (isinstance(version, bool) or version not in SUPPORTED_VERSIONS):
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
                    err, source, f"hetero plan (version {version if version in SUPPORTED_VERSIONS else PLAN_VERSION})",
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
        except (OSError, UnicodeDecodeError) as err:
            raise PlanError(f"plan file {path} cannot be read as text: {err}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanError(
                f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
                "fix the file or regenerate it with hetero-plan"
            ) from None
        except (ValueError, RecursionError) as err:  # a number of 4300+ digits; nesting too deep
            raise PlanError(f"{path} cannot be read as a plan: {err}; regenerate it with hetero-plan") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def of_templates(cls, templates: list[TemplateEntry], *, micro_batch_size: int, rank_order: list[int],
                     devices: list[DeviceEntry], **fields) -> "Plan":
        """A plan of these templates: one is written at the top level (version 3), several
        under ``templates`` (version 4)."""
        if len(templates) == 1:
            template = templates[0]
            layout = {name: getattr(template, name) for name in ONE_TEMPLATE_FIELDS}
            return cls(version=PLAN_VERSION, micro_batch_size=micro_batch_size, rank_order=rank_order,
                       devices=devices, **layout, **fields)
        return cls(version=TEMPLATES_VERSION, micro_batch_size=micro_batch_size, templates=templates,
                   rank_order=rank_order, devices=devices, **fields)

    def to_dict(self) -> dict:
        """plan.json's content: layout fields without nulls, the record as given, unknown keys last."""
        data = self.model_dump(mode="json", exclude_none=True, exclude=set(SECTIONS), by_alias=True)
        for axis in ("expert_parallel", "context_parallel"):
            if data[axis] == 1:  # a plan without the axis reads as before it existed
                data.pop(axis)
        unknown = {key: data.pop(key) for key in self.model_extra or {} if key in data}
        for name in SECTIONS:
            section = getattr(self, name)
            if section is not None:
                data[name] = section.model_dump(mode="json", exclude_unset=True)
        return {**data, **unknown}

    def save(self, path: str | os.PathLike) -> None:
        """Writes the plan atomically (a reader never sees half a file)."""
        write_json_atomic(path, self.to_dict())

    # ----- templates --------------------------------------------------------------------

    @property
    def templates(self) -> list[TemplateEntry]:
        """The replica templates (one for a plan of versions 1-3)."""
        if self.listed_templates is not None:
            return self.listed_templates
        return [TemplateEntry(**{name: getattr(self, f"top_{name}") for name in ONE_TEMPLATE_FIELDS})]

    @property
    def num_templates(self) -> int:
        return len(self.listed_templates) if self.listed_templates is not None else 1

    def template(self, index: int) -> TemplateEntry:
        return self.templates[index]

    def template_of_replica(self, dp_rank: int) -> int:
        """The template replica dp_rank (counted over every template) belongs to."""
        return self.grid.template_of_replica(dp_rank)

    def _one(self, name: str):
        """Top-level field ``name`` of a one-template plan; on a plan of several, a PlanError."""
        if self.listed_templates is None:
            return getattr(self, f"top_{name}")
        if len(self.listed_templates) == 1:
            return getattr(self.listed_templates[0], name)
        raise PlanError(f"this plan has {len(self.listed_templates)} replica templates, each with its own "
                        f"{name}; what asked for one does not support several templates yet")

    @property
    def tensor_parallel(self) -> int:
        return self._one("tensor_parallel")

    @property
    def pipeline_parallel(self) -> int:
        return self._one("pipeline_parallel")

    @property
    def stages(self) -> list[StageEntry]:
        return self._one("stages")

    @property
    def data_parallel(self) -> int:
        """Replicas over every template."""
        return sum(t.data_parallel for t in self.templates)

    @property
    def replicas(self) -> list[ReplicaEntry]:
        """Every template's replicas, in template order (replica d of the plan is entry d)."""
        return [replica for t in self.templates for replica in t.replicas]

    # ----- derived facts ---------------------------------------------------------------

    @property
    def grid(self) -> Grid:
        """The rank grid (hetero/grid.py) of the templates' shapes (one per shape, shared)."""
        return grid_of(tuple(TemplateShape(t.stage_tensor_parallel, t.data_parallel) for t in self.templates),
                       self.context_parallel, self.expert_parallel, self.expert_tensor_parallel)

    @property
    def stage_tensor_parallel(self) -> list[int]:
        """Each stage's tensor-parallel degree (its own, else the job's)."""
        return [stage.tensor_parallel or self.tensor_parallel for stage in self.stages]

    @property
    def per_stage_tensor_parallel(self) -> bool:
        """Whether stages differ in tensor-parallel degree."""
        return len(set(self.stage_tensor_parallel)) > 1

    @property
    def megatron_grid(self) -> bool:
        """Whether megatron-core's own grid describes the plan: one template whose stages share
        one tensor-parallel degree (else the runtime builds the groups from the plan's grid)."""
        return self.num_templates == 1 and len(set(self.templates[0].stage_tensor_parallel)) == 1

    @property
    def max_tensor_parallel(self) -> int:
        """The widest stage's degree over every template: vocabulary padding follows it, so
        every plan of one model trains the same (padded) vocabulary."""
        return max(max(t.stage_tensor_parallel) for t in self.templates)

    @property
    def world_size(self) -> int:
        return sum(self.context_parallel * t.data_parallel * sum(t.stage_tensor_parallel) for t in self.templates)

    @property
    def num_layers(self) -> int:
        return self.templates[0].num_layers

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per iteration summed over replicas."""
        return sum(replica.num_micro_batches for replica in self.replicas)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    # ----- launch ranks (logical ranks: plan.grid, hetero/grid.py) ---------------------

    def stage_device(self, dp_rank: int, pp_rank: int) -> DeviceEntry:
        """The device of tensor rank 0 of one (replica, stage)."""
        return self.device_of_logical(self.grid.rank_at(0, dp_rank, pp_rank))

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
        blocks = self.grid.expert_replica_blocks
        if all(len(block) == 1 for block in blocks):
            counts = split_in_proportion(total, weights)
        else:
            counts = split_in_equal_blocks(total, weights, blocks, global_batch_size)
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

    def pipeline_layout(self, mtp_num_layers: int = 0) -> list[list[str]]:
        """The split in megatron-core's ``pipeline_model_parallel_layout`` form: one entry per
        (virtual) stage in model order, entry ``v*pp + s`` being chunk v of pipeline rank s;
        multi-token-prediction layers after the last stage's decoder layers, beside the loss."""
        layout = [["decoder"] * n for n in self.virtual_stage_layers()]
        layout[0].insert(0, "embedding")
        layout[-1].extend(["mtp"] * mtp_num_layers + ["loss"])
        return layout

    def hosts(self) -> list[tuple[str, list[int]]]:
        """(host, launch ranks on it) in launch order."""
        groups: list[tuple[str, list[int]]] = []
        for launch_rank, device in enumerate(self.devices):
            if not groups or groups[-1][0] != device.host:
                groups.append((device.host, []))
            groups[-1][1].append(launch_rank)
        return groups

    def template_plan(self, index: int) -> "Plan":
        """Template ``index`` as a plan of its own (version 3): its stages, its replicas, the
        devices of its ranks in launch order; the record's model and training kept (the
        prediction and the cluster are the whole plan's). For what is asked of one pipeline
        shape: a stage's recomputation, degree and layers, a template's prediction."""
        ranks = self.grid.template_ranks(index)
        launch = sorted(self.rank_order[r] for r in ranks)
        position = {rank: i for i, rank in enumerate(launch)}
        template = self.templates[index]
        return Plan.of_templates(
            [template], micro_batch_size=self.micro_batch_size,
            rank_order=[position[self.rank_order[r]] for r in ranks],
            devices=[self.devices[r] for r in launch], expert_parallel=self.expert_parallel,
            expert_tensor_parallel=self.expert_tensor_parallel, context_parallel=self.context_parallel,
            model=self.model, training=self.training)

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
        expert_parallel: int = 1,
        expert_tensor_parallel: int | None = None,
        split_flags: SplitFlags | None = None,
        context_parallel: int = 1,
    ) -> "Plan":
        """The plan stock Megatron runs: equal replicas, launch-order ranks, and the stages
        (virtual stages included) Megatron-LM builds from its split flags, even without them."""
        split = megatron_split(num_layers, pipeline_parallel, split_flags or SplitFlags())
        empty = [f"pipeline rank {s}" + (f" virtual stage {v}" if len(chunks) > 1 else "")
                 for s, chunks in enumerate(split) for v, n in enumerate(chunks) if n < 1]
        if empty:
            raise PlanError(
                f"Megatron-LM's split of {num_layers} layers {split} leaves {', '.join(empty)} without a "
                "decoder layer (only the embedding, the loss or multi-token-prediction layers), which a plan cannot hold yet; give "
                "every (virtual) stage at least one layer")
        per_replica = micro_batch_size * data_parallel
        if global_batch_size % per_replica:
            raise PlanError(
                f"global batch size ({global_batch_size}) is not divisible by micro batch size "
                f"x data parallel ({micro_batch_size} x {data_parallel}); pass a --hetero-plan "
                "with per-replica micro-batch counts"
            )
        world = tensor_parallel * context_parallel * pipeline_parallel * data_parallel
        if devices is None:
            devices = [DeviceEntry(host="localhost", device_type="cpu", vendor="cpu")] * world
        problems = expert_parallel_problems([tensor_parallel] * pipeline_parallel,
                                            [global_batch_size // per_replica] * data_parallel,
                                            expert_parallel, expert_tensor_parallel, context_parallel)
        if problems:  # in the flags' words: this layout comes from them
            raise PlanError("the expert layout of --expert-model-parallel-size / --expert-tensor-parallel-size: "
                            + "; ".join(problems))
        try:
            return cls(
                version=PLAN_VERSION,
                tensor_parallel=tensor_parallel,
                pipeline_parallel=pipeline_parallel,
                data_parallel=data_parallel,
                micro_batch_size=micro_batch_size,
                stages=[StageEntry(num_layers=sum(chunks), virtual_stages=chunks if len(chunks) > 1 else None)
                        for chunks in split],
                replicas=[ReplicaEntry(num_micro_batches=global_batch_size // per_replica)]
                * data_parallel,
                rank_order=list(range(world)),
                devices=list(devices),
                expert_parallel=expert_parallel,
                expert_tensor_parallel=expert_tensor_parallel,
                context_parallel=context_parallel,
            )
        except ValidationError as err:  # in the words of the flags this layout comes from
            raise PlanError(describe_validation_error(
                err, "Megatron-LM's layout from the flags", "uniform plan",
                "Change the flags named (or give a --hetero-plan).")) from None

    def summary(self) -> str:
        """One line: the degrees, the layers per stage and the micro-batches per replica (one
        part per template)."""
        parts = []
        for template in self.templates:
            stages = ",".join("+".join(map(str, s.virtual_stages)) if s.virtual_stages else str(s.num_layers)
                              for s in template.stages)
            replicas = ",".join(str(r.num_micro_batches) for r in template.replicas)
            degrees = template.stage_tensor_parallel
            tp = "[" + ",".join(map(str, degrees)) + "]" if len(set(degrees)) > 1 else str(template.tensor_parallel)
            if self.expert_parallel > 1 or self.expert_tensor_parallel is not None:
                tp += f" EP={self.expert_parallel} ETP={self.expert_tensor_parallel or tp}"
            if self.context_parallel > 1:
                tp += f" CP={self.context_parallel}"
            parts.append(f"TP={tp} PP={template.pipeline_parallel} DP={template.data_parallel} "
                         f"layers per stage=[{stages}] micro-batches per replica=[{replicas}]")
        if len(parts) == 1:
            layout = parts[0].split(" layers per stage")
            return (f"{layout[0]} micro-batch={self.micro_batch_size} layers per stage{layout[1]} "
                    f"global batch={self.global_batch_size}")
        return (" | ".join(f"template {k}: {part}" for k, part in enumerate(parts))
                + f" | micro-batch={self.micro_batch_size} global batch={self.global_batch_size}")

