"""The plan file (plan.json, version 3): how one training job is laid out on a cluster.

A plan fixes the parallel degrees (a tensor-parallel degree per stage from version 3), how
many decoder layers each pipeline stage holds (split into interleaved virtual stages, and
recomputed per stage, from version 2), how many micro-batches each data-parallel replica
runs per iteration, and which launched process plays which Megatron rank. Logical rank i
follows Megatron's order (tensor fastest, then context, then data, then pipeline;
``Plan.rank_at``), and launch rank ``rank_order[i]`` (torchrun's RANK, on
``devices[rank_order[i]]``) runs it.

docs/plan-format.md is the reference: every field, the versions, the rank arithmetic and
megatron-core's constraints on the interleaved schedule. The entries of the lists (stages,
replicas, devices) are in hetero/plan_entries.py. A plan written by hetero-plan also carries
the job record (``model``, ``training``, ``cluster``, ``prediction``, ``provenance``:
hetero/record.py). Unknown top-level keys are kept and written back unchanged. Counts are
bounded (MAX_COUNT) and compared with the lists they size before anything is built from
them, so a malformed file gets a PlanError naming the field, never a MemoryError.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetero.balance import split_in_proportion
from hetero.errors import PlanError
from hetero.io import describe_validation_error, write_json_atomic
from hetero.pipeline_layout import SplitFlags, megatron_split
from hetero.plan_entries import (DeviceEntry, RecomputeEntry, ReplicaEntry, StageEntry, cluster_problems,
                                 virtual_stage_problems)
from hetero.record import (SECTIONS, ClusterSection, Count, ModelRecord, PredictionRecord, ProvenanceRecord,
                           TrainingRecord)

PLAN_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)


@dataclass(frozen=True)
class RankCoords:
    """Where one logical rank sits in the (tensor, context, data, pipeline) grid."""

    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0


class Plan(BaseModel):
    """A validated plan; build it with ``Plan.load`` or ``Plan.from_dict``."""

    model_config = ConfigDict(extra="allow")

    version: Literal[1, 2, 3]
    tensor_parallel: Count
    pipeline_parallel: Count
    data_parallel: Count
    micro_batch_size: Count
    stages: list[StageEntry] = Field(min_length=1)
    replicas: list[ReplicaEntry] = Field(min_length=1)
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
            if self.context_parallel > 1:
                grid = f"context_parallel x {grid}"
            problems.append(
                f"devices has {len(self.devices)} entries but {grid} = {world}: give one entry per launch rank"
            )
        # Lengths first: range(world) is built only once the file holds world entries.
        if len(self.rank_order) != world or sorted(self.rank_order) != list(range(world)):
            shown = self.rank_order if len(self.rank_order) <= 64 else f"{len(self.rank_order)} entries"
            problems.append(
                f"rank_order must be a permutation of 0..{world - 1} (one launch rank per "
                f"logical rank, each used once); got {shown}"
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
        problems += virtual_stage_problems(self.stages, self.replicas, self.pipeline_parallel)
        if self.cluster is not None:
            problems += cluster_problems(self.devices, self.cluster)
        for index, stage in enumerate(self.stages):
            entry = stage.recompute
            if isinstance(entry, RecomputeEntry) and entry.method == "uniform":
                chunks = stage.virtual_stages or [stage.num_layers]
                if any(n % entry.num_layers for n in chunks):
                    problems.append(
                        f"stages[{index}].recompute: uniform groups of {entry.num_layers} layers do "
                        f"not divide the stage's {'+'.join(map(str, chunks))} layers (megatron-core "
                        "recomputes whole groups); use a divisor or the block method")
        problems += expert_parallel_problems(
            self.stage_tensor_parallel, [r.num_micro_batches for r in self.replicas],
            self.expert_parallel, self.expert_tensor_parallel, self.context_parallel)
        if self.expert_parallel > 1 and self.model is not None and (
                self.model.num_experts is None or self.model.num_experts % self.expert_parallel):
            problems.append(
                f"expert_parallel {self.expert_parallel} shares out each MoE layer's experts, but the "
                f"model has {self.model.num_experts or 'no'} experts: use a divisor of the expert count")
        problems += self._context_parallel_problems()
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

    def _context_parallel_problems(self) -> list[str]:
        if self.context_parallel == 1:
            return []
        problems = []
        if self.per_stage_tensor_parallel:
            problems.append(
                f"context_parallel {self.context_parallel} with a tensor_parallel per stage "
                f"{self.stage_tensor_parallel}: activations crossing stages of different degrees are "
                "re-sharded by tensor rank only, not by context rank; use one tensor_parallel degree")
        if self.model is not None and self.model.seq_length % (2 * self.context_parallel):
            problems.append(
                f"context_parallel {self.context_parallel} cuts each sequence into "
                f"{2 * self.context_parallel} equal chunks (Megatron's load-balanced causal split), "
                f"but the model's seq_length is {self.model.seq_length}: use a divisor")
        return problems

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

    def to_dict(self) -> dict:
        """plan.json's content: layout fields without nulls, the record as given, unknown keys last."""
        data = self.model_dump(mode="json", exclude_none=True, exclude=set(SECTIONS))
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
        return self.data_parallel * self.context_parallel * sum(self.stage_tensor_parallel[:pp_rank])

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.context_parallel * sum(self.stage_tensor_parallel)

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
        cp = self.context_parallel
        return RankCoords(tp_rank=local % tp, dp_rank=local // (tp * cp), pp_rank=pp_rank, cp_rank=local // tp % cp)

    def rank_at(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """The logical rank of tensor rank tp_rank, context rank cp_rank of replica dp_rank in
        stage pp_rank."""
        degrees = self.stage_tensor_parallel
        if not (0 <= tp_rank < degrees[pp_rank] and 0 <= dp_rank < self.data_parallel
                and 0 <= cp_rank < self.context_parallel):
            raise ValueError(f"stage {pp_rank} has tensor ranks 0..{degrees[pp_rank] - 1}, context ranks "
                             f"0..{self.context_parallel - 1} and replicas 0..{self.data_parallel - 1}; "
                             f"asked for ({tp_rank}, {cp_rank}, {dp_rank})")
        return logical_rank_at(tp_rank, dp_rank, pp_rank, degrees, self.data_parallel, cp_rank, self.context_parallel)

    def tensor_group(self, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> list[int]:
        """Logical ranks of one (replica, stage, context rank): its tensor-parallel group."""
        return [self.rank_at(t, dp_rank, pp_rank, cp_rank) for t in range(self.stage_tensor_parallel[pp_rank])]

    def context_group(self, tp_rank: int, dp_rank: int, pp_rank: int) -> list[int]:
        """Logical ranks that split the sequences of one replica: its context-parallel group."""
        return [self.rank_at(tp_rank, dp_rank, pp_rank, c) for c in range(self.context_parallel)]

    def data_group(self, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> list[int]:
        """Logical ranks that hold the same weights and sequence chunks: one per replica (the
        gradients reduce over these times the context group)."""
        return [self.rank_at(tp_rank, d, pp_rank, cp_rank) for d in range(self.data_parallel)]

    def pipeline_group(self, tp_rank: int, dp_rank: int, cp_rank: int = 0) -> list[int]:
        """Logical ranks of one replica's pipeline, stage by stage: tensor rank tp_rank of
        each stage (modulo a narrower stage's degree, whose rank then serves several)."""
        return [self.rank_at(tp_rank % tp, dp_rank, s, cp_rank) for s, tp in enumerate(self.stage_tensor_parallel)]

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """Every logical rank of one replica (all its stages' tensor and context groups)."""
        return [r for s in range(self.pipeline_parallel) for c in range(self.context_parallel)
                for r in self.tensor_group(dp_rank, s, c)]

    # ----- expert parallelism (megatron-core's expert grid, one per stage) -------------

    def stage_expert_tensor_parallel(self, pp_rank: int) -> int:
        """The expert tensor-parallel degree of stage pp_rank (default: the stage's degree)."""
        return self.expert_tensor_parallel or self.stage_tensor_parallel[pp_rank]

    def stage_expert_data_parallel(self, pp_rank: int) -> int:
        """How many copies of each expert shard stage pp_rank holds: its ranks over EP x ETP."""
        return (self.stage_tensor_parallel[pp_rank] * self.context_parallel * self.data_parallel
                // (self.expert_parallel * self.stage_expert_tensor_parallel(pp_rank)))

    def expert_rank_at(self, etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int) -> int:
        """The logical rank at (expert tensor, expert model, expert data) ranks of a stage."""
        return self.stage_offset(pp_rank) + expert_local_rank(
            etp_rank, ep_rank, edp_rank, self.stage_expert_tensor_parallel(pp_rank), self.expert_parallel)

    def expert_groups(self, pp_rank: int) -> list[list[int]]:
        """Stage pp_rank's expert model-parallel groups (logical ranks): the ranks that share
        out the experts and exchange tokens in an all-to-all every micro-batch."""
        etp = self.stage_expert_tensor_parallel(pp_rank)
        return [[self.expert_rank_at(t, e, d, pp_rank) for e in range(self.expert_parallel)]
                for d in range(self.stage_expert_data_parallel(pp_rank)) for t in range(etp)]

    def expert_data_groups(self, pp_rank: int) -> list[list[int]]:
        """Stage pp_rank's expert data-parallel groups: the ranks holding the same expert shard,
        which reduce its gradients (and share its distributed-optimizer state)."""
        etp = self.stage_expert_tensor_parallel(pp_rank)
        return [[self.expert_rank_at(t, e, d, pp_rank) for d in range(self.stage_expert_data_parallel(pp_rank))]
                for e in range(self.expert_parallel) for t in range(etp)]

    def expert_tensor_groups(self, pp_rank: int) -> list[list[int]]:
        """Stage pp_rank's expert tensor-parallel groups: the ranks that split one expert."""
        etp = self.stage_expert_tensor_parallel(pp_rank)
        return [[self.expert_rank_at(t, e, d, pp_rank) for t in range(etp)]
                for d in range(self.stage_expert_data_parallel(pp_rank)) for e in range(self.expert_parallel)]

    def expert_replica_blocks(self) -> list[list[int]]:
        """The replicas bound to run equal micro-batch counts: those whose ranks share an
        expert-parallel group (in any stage, transitively), as lists of replica indices."""
        block_of = list(range(self.data_parallel))

        def root(replica: int) -> int:
            while block_of[replica] != replica:
                replica = block_of[replica]
            return replica

        for pp_rank, tensor_parallel in enumerate(self.stage_tensor_parallel):
            per_replica = tensor_parallel * self.context_parallel  # a replica's ranks in the stage
            for group in self.expert_groups(pp_rank):
                replicas = [(rank - self.stage_offset(pp_rank)) // per_replica for rank in group]
                for replica in replicas[1:]:
                    block_of[root(replica)] = root(replicas[0])
        blocks: dict[int, list[int]] = {}
        for replica in range(self.data_parallel):
            blocks.setdefault(root(replica), []).append(replica)
        return list(blocks.values())

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
        blocks = self.expert_replica_blocks()
        if all(len(block) == 1 for block in blocks):
            counts = split_in_proportion(total, weights)
        else:
            counts = _split_in_equal_blocks(total, weights, blocks, global_batch_size)
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
        stages = ",".join(
            "+".join(map(str, s.virtual_stages)) if s.virtual_stages else str(s.num_layers)
            for s in self.stages)
        replicas = ",".join(str(r.num_micro_batches) for r in self.replicas)
        tp = ("[" + ",".join(map(str, self.stage_tensor_parallel)) + "]" if self.per_stage_tensor_parallel
              else str(self.tensor_parallel))
        if self.expert_parallel > 1 or self.expert_tensor_parallel is not None:
            tp += f" EP={self.expert_parallel} ETP={self.expert_tensor_parallel or tp}"
        if self.context_parallel > 1:
            tp += f" CP={self.context_parallel}"
        return (
            f"TP={tp} PP={self.pipeline_parallel} DP={self.data_parallel} "
            f"micro-batch={self.micro_batch_size} layers per stage=[{stages}] "
            f"micro-batches per replica=[{replicas}] global batch={self.global_batch_size}"
        )


def logical_rank_at(tp_rank: int, dp_rank: int, pp_rank: int, tensor_parallel: int | Sequence[int],
                    data_parallel: int, cp_rank: int = 0, context_parallel: int = 1) -> int:
    """Megatron's default order: tensor fastest, then context, then data, then pipeline; with
    a degree per stage (tensor_parallel a list), stage s starts after the ranks of the stages
    before it. For code that builds a plan's rank_order before the plan exists (placement);
    everyone else asks the Plan."""
    degrees = [tensor_parallel] * (pp_rank + 1) if isinstance(tensor_parallel, int) else tensor_parallel
    return (data_parallel * context_parallel * sum(degrees[:pp_rank])
            + tp_rank + degrees[pp_rank] * (cp_rank + context_parallel * dp_rank))


def _split_in_equal_blocks(total: int, weights: list[int], blocks: list[list[int]],
                           global_batch_size: int) -> list[int]:
    """total micro-batches in proportion to weights, equal inside each block: each block's
    replicas get the floor of their share, then whole blocks one more each by largest
    remainder (ties to the lower replica) while micro-batches are left for a whole block."""
    whole = sum(weights)
    shares = [Fraction(total * weights[block[0]], whole) for block in blocks]
    per_replica = [math.floor(share) for share in shares]
    left = total - sum(n * len(block) for n, block in zip(per_replica, blocks))
    for index in sorted(range(len(blocks)), key=lambda i: (-(shares[i] - per_replica[i]), blocks[i][0])):
        if 0 < len(blocks[index]) <= left:
            per_replica[index] += 1
            left -= len(blocks[index])
    if left:
        raise PlanError(
            f"a global batch of {global_batch_size} samples ({total} micro-batches) cannot be split "
            f"between the replicas in proportion to {weights} with equal counts inside each "
            f"expert-parallel block of replicas {blocks} (its all-to-all runs every micro-batch); "
            f"use --rampup-batch-size START and INCREMENT of multiples of "
            f"{math.lcm(*map(len, blocks))} micro-batches")
    counts = [0] * len(weights)
    for n, block in zip(per_replica, blocks):
        for replica in block:
            counts[replica] = n
    return counts


def expert_local_rank(etp_rank: int, ep_rank: int, edp_rank: int, expert_tensor_parallel: int,
                      expert_parallel: int) -> int:
    """megatron-core's expert order inside one stage (expert tensor fastest, then expert
    model, then expert data), counted from the stage's first logical rank."""
    return etp_rank + expert_tensor_parallel * (ep_rank + expert_parallel * edp_rank)


def expert_parallel_problems(stage_tensor_parallel: Sequence[int], replica_micro_batches: Sequence[int],
                             expert_parallel: int, expert_tensor_parallel: int | None = None,
                             context_parallel: int = 1) -> list[str]:
    """What is wrong with expert parallelism on this layout (empty: nothing), for Plan's
    validation and for a planner choosing replica shares before it builds a Plan.

    Each stage's TP x CP x DP ranks must split into EP x ETP blocks (megatron-core's expert grid).
    Each expert model-parallel group runs an all-to-all in every micro-batch's forward and
    backward, so the replicas its ranks belong to must run equally many micro-batches; a
    replica with more would wait forever for the others' next all-to-all.
    """
    data_parallel = len(replica_micro_batches)
    if expert_parallel == 1 and expert_tensor_parallel is None:
        return []
    problems = []
    copies = [tp * context_parallel * data_parallel // (expert_parallel * (expert_tensor_parallel or tp))
              for tp in stage_tensor_parallel]
    if len(set(copies)) > 1:
        # megatron-core's expert optimizer reduces over one expert grid through the pipeline
        # (its expert tensor-model-pipeline group): one copy of each stage's experts per group.
        problems.append(
            f"expert_tensor_parallel {expert_tensor_parallel} with tensor_parallel {list(stage_tensor_parallel)} "
            f"per stage gives the stages {copies} copies of their experts, which megatron-core's expert "
            "groups through the pipeline cannot pair; leave expert_tensor_parallel unset (each stage "
            "splits its experts as its tensor-parallel degree) or give every stage one degree")
    for pp_rank, tensor_parallel in enumerate(stage_tensor_parallel):
        etp = expert_tensor_parallel or tensor_parallel
        per_replica = tensor_parallel * context_parallel  # a replica's ranks in the stage
        ranks = per_replica * data_parallel
        if expert_parallel == 1 and etp != tensor_parallel:
            # megatron-core marks experts as expert-parallel parameters only with EP > 1; with
            # EP 1 their gradients are reduced over the data-parallel group alone, missing the
            # other tensor ranks that then hold copies of the same experts.
            problems.append(
                f"expert_tensor_parallel {etp} differs from stage {pp_rank}'s tensor_parallel "
                f"{tensor_parallel} with expert_parallel 1, which megatron-core does not train "
                "correctly; set expert_parallel above 1 or expert_tensor_parallel to the stage's degree")
            continue
        if ranks % (expert_parallel * etp):
            problems.append(
                f"expert_parallel {expert_parallel} x expert_tensor_parallel {etp} = {expert_parallel * etp} "
                f"does not divide stage {pp_rank}'s {ranks} ranks (tensor_parallel {tensor_parallel} x "
                + (f"context_parallel {context_parallel} x " if context_parallel > 1 else "")
                + f"data_parallel {data_parallel}); choose degrees whose product divides it")
            continue
        for edp_rank in range(ranks // (expert_parallel * etp)):
            for etp_rank in range(etp):
                members = [expert_local_rank(etp_rank, e, edp_rank, etp, expert_parallel)
                           for e in range(expert_parallel)]
                replicas = sorted({local // per_replica for local in members})
                counts = [replica_micro_batches[r] for r in replicas]
                if len(set(counts)) > 1:
                    return problems + [
                        f"expert_parallel {expert_parallel}: an expert-parallel group of stage {pp_rank} "
                        f"spans replicas {replicas}, which run {counts} micro-batches; its ranks exchange "
                        "tokens in every micro-batch, so the replica with fewer would leave the others "
                        "waiting forever. Give the replicas of each expert-parallel group equal "
                        "micro-batch counts (hetero-plan does), or lower expert_parallel"]
    return problems
