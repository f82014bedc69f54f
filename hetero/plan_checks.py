"""What a plan's layout must satisfy before anything is built from it: each template's counts
against its lists, the interleaved schedule's and recomputation's constraints, the expert
grid, context parallelism, what several templates do not support yet, and the version each
field needs. Plan's validation (hetero/plan.py) calls ``layout_problems``; a planner choosing
replica shares before it builds a plan calls ``expert_parallel_problems``.

Every check returns problems as sentences that name the field and the fix; an empty list
means the layout is fine.
"""

from __future__ import annotations

import math
from functools import lru_cache
from fractions import Fraction
from typing import Sequence

from hetero.errors import PlanError
from hetero.grid import Grid, TemplateShape, expert_local_rank
from hetero.plan_entries import DeviceEntry, RecomputeEntry, TemplateEntry, cluster_problems, virtual_stage_problems

ONE_TEMPLATE_FIELDS = ("tensor_parallel", "pipeline_parallel", "data_parallel", "stages", "replicas")
"""The fields a plan of one template (versions 1-3) gives at its top level."""


def plan_problems(plan) -> list[str]:
    """Everything wrong with a plan's layout (hetero/plan.Plan, validated field by field
    already): its form, each template's counts, then what is built from them."""
    problems = _form_problems(plan)
    if problems:  # without one whole form nothing below can be counted
        return problems
    templates, several = plan.templates, len(plan.templates) > 1
    for index, template in enumerate(templates):
        problems += template_problems(template, f"templates[{index}]." if plan.listed_templates else "")
    if problems:  # counts first: the grid is built only from lists of the sizes they give
        return problems
    world = sum(plan.context_parallel * t.data_parallel * sum(t.stage_tensor_parallel) for t in templates)
    if len(plan.devices) != world:
        problems.append(f"devices has {len(plan.devices)} entries but {_world_formula(plan)} = {world}: "
                        "give one entry per launch rank")
    # Lengths first: range(world) is built only once the file holds world entries.
    if len(plan.rank_order) != world or sorted(plan.rank_order) != list(range(world)):
        shown = plan.rank_order if len(plan.rank_order) <= 64 else f"{len(plan.rank_order)} entries"
        problems.append(
            f"rank_order must be a permutation of 0..{world - 1} (one launch rank per "
            f"logical rank, each used once); got {shown}")
    problems += _host_problems(plan.devices)
    if plan.cluster is not None:
        problems += cluster_problems(plan.devices, plan.cluster)
    problems += version_problems(plan.version, templates, several)
    if several:
        problems += several_template_problems(templates, plan.expert_parallel, plan.expert_tensor_parallel,
                                              plan.context_parallel)
    else:
        template = templates[0]
        problems += expert_parallel_problems(
            template.stage_tensor_parallel, [r.num_micro_batches for r in template.replicas],
            plan.expert_parallel, plan.expert_tensor_parallel, plan.context_parallel)
        problems += context_parallel_problems(template.stage_tensor_parallel, plan.context_parallel,
                                              plan.model.seq_length if plan.model else None)
    if plan.expert_parallel > 1 and plan.model is not None and (
            plan.model.num_experts is None or plan.model.num_experts % plan.expert_parallel):
        problems.append(
            f"expert_parallel {plan.expert_parallel} shares out each MoE layer's experts, but the "
            f"model has {plan.model.num_experts or 'no'} experts: use a divisor of the expert count")
    return problems


def _form_problems(plan) -> list[str]:
    """One template's fields at the top level, or templates, not both."""
    given = [name for name in ONE_TEMPLATE_FIELDS if getattr(plan, f"top_{name}") is not None]
    if plan.listed_templates is not None:
        if given:
            return [f"{', '.join(given)} and templates both given: a plan lists its layout either at the "
                    "top level (one template) or under templates (version 4), not both"]
        if plan.version < 4:
            return [f"templates need plan version 4; set \"version\": 4 (got version {plan.version})"]
        return []
    if plan.version == 4:
        return ["version 4 lists the layout under templates; this plan gives it at the top level: "
                "set \"version\": 3, or move its fields into \"templates\": [{...}]"]
    missing = [name for name in ONE_TEMPLATE_FIELDS if name not in given]
    return [f"{name}: required field is missing" for name in missing]


def _world_formula(plan) -> str:
    """How the rank count is made, in the fields' names."""
    parts = []
    for t in plan.templates:
        degrees = t.stage_tensor_parallel
        grid = (f"data_parallel x sum of the stages' tensor_parallel {list(degrees)}" if len(set(degrees)) > 1
                else "tensor_parallel x pipeline_parallel x data_parallel")
        parts.append(f"context_parallel x {grid}" if plan.context_parallel > 1 else grid)
    if len(parts) == 1:
        return parts[0]
    return " + ".join(f"templates[{k}]: {part}" for k, part in enumerate(parts))


def _host_problems(devices: list[DeviceEntry]) -> list[str]:
    """torchrun numbers the ranks of one node consecutively: each host's devices together."""
    hosts_seen: list[str] = []
    for device in devices:
        if not hosts_seen or hosts_seen[-1] != device.host:
            if device.host in hosts_seen:
                return [f"devices of host {device.host!r} are not contiguous in launch order; "
                        "torchrun numbers the ranks of one node consecutively, so list each "
                        "host's devices together"]
            hosts_seen.append(device.host)
    return []


def template_problems(template: TemplateEntry, where: str) -> list[str]:
    """One template's counts against its lists, its virtual stages and recomputation.
    ``where`` prefixes field names ("" at the top level, "templates[1]." inside a list)."""
    problems = []
    if len(template.stages) != template.pipeline_parallel:
        problems.append(
            f"{where}stages has {len(template.stages)} entries but {where}pipeline_parallel is "
            f"{template.pipeline_parallel}: give one entry per pipeline stage")
    if len(template.replicas) != template.data_parallel:
        problems.append(
            f"{where}replicas has {len(template.replicas)} entries but {where}data_parallel is "
            f"{template.data_parallel}: give one entry per data-parallel replica")
    problems += [f"{where}{p}" if where else p
                 for p in virtual_stage_problems(template.stages, template.replicas, template.pipeline_parallel)]
    if len(set(template.stage_tensor_parallel)) > 1 and template.stages[0].virtual_stages:
        problems.append(
            f"{where}stages give different tensor_parallel {list(template.stage_tensor_parallel)} and "
            "virtual_stages: the interleaved schedule with a tensor-parallel degree per stage is not "
            "supported (its wrap-around transfers are not re-sharded); drop virtual_stages or use one degree")
    for index, stage in enumerate(template.stages):
        entry = stage.recompute
        if isinstance(entry, RecomputeEntry) and entry.method == "uniform":
            chunks = stage.virtual_stages or [stage.num_layers]
            if any(n % entry.num_layers for n in chunks):
                problems.append(
                    f"{where}stages[{index}].recompute: uniform groups of {entry.num_layers} layers do "
                    f"not divide the stage's {'+'.join(map(str, chunks))} layers (megatron-core "
                    "recomputes whole groups); use a divisor or the block method")
    return problems


def several_template_problems(templates: Sequence[TemplateEntry], expert_parallel: int,
                              expert_tensor_parallel: int | None, context_parallel: int) -> list[str]:
    """What several templates need: the same model in each, and none of the features their
    cross-template reduction does not cover yet."""
    problems = []
    layers = [t.num_layers for t in templates]
    if len(set(layers)) > 1:
        problems.append(f"the templates hold {layers} decoder layers: every template is a whole copy of "
                        "the model, so give each the same number of layers")
    unsupported = []
    if expert_parallel > 1 or expert_tensor_parallel is not None:
        unsupported.append("expert_parallel/expert_tensor_parallel (expert parallelism)")
    if context_parallel > 1:
        unsupported.append("context_parallel (context parallelism)")
    if any(t.stages[0].virtual_stages and t.pipeline_parallel == 2 for t in templates):
        unsupported.append("virtual_stages on a pipeline of 2 stages (its two neighbours are one rank; give the "
                           "interleaved template 3 stages or more)")
    if unsupported:
        problems.append(f"a plan of {len(templates)} templates does not support {', '.join(unsupported)} yet; "
                        "drop it, or use one template")
    return problems


def version_problems(version: int, templates: Sequence[TemplateEntry], several: bool) -> list[str]:
    """The version each used field needs."""
    if several and version < 4:
        return ["templates (several pipeline shapes) need plan version 4; set \"version\": 4"]
    problems = []
    where = (lambda k: f"templates[{k}].") if several else (lambda k: "")
    for needed, names in ((2, ("recompute", "virtual_stages")), (3, ("tensor_parallel",))):
        uses = [f"{where(k)}stages[{i}].{name}" for k, t in enumerate(templates) for i, stage in enumerate(t.stages)
                for name in names if getattr(stage, name) is not None]
        if uses and version < needed:
            problems.append(f"{', '.join(uses)} need plan version {needed}; set \"version\": {needed}")
    return problems


def context_parallel_problems(stage_tensor_parallel: Sequence[int], context_parallel: int,
                              seq_length: int | None) -> list[str]:
    if context_parallel == 1:
        return []
    problems = []
    if len(set(stage_tensor_parallel)) > 1:
        problems.append(
            f"context_parallel {context_parallel} with a tensor_parallel per stage "
            f"{list(stage_tensor_parallel)}: activations crossing stages of different degrees are "
            "re-sharded by tensor rank only, not by context rank; use one tensor_parallel degree")
    if seq_length is not None and seq_length % (2 * context_parallel):
        problems.append(
            f"context_parallel {context_parallel} cuts each sequence into "
            f"{2 * context_parallel} equal chunks (Megatron's load-balanced causal split), "
            f"but the model's seq_length is {seq_length}: use a divisor")
    return problems


def expert_parallel_problems(stage_tensor_parallel: Sequence[int], replica_micro_batches: Sequence[int],
                             expert_parallel: int, expert_tensor_parallel: int | None = None,
                             context_parallel: int = 1) -> list[str]:
    """What is wrong with expert parallelism on this (one-template) layout (empty: nothing),
    for Plan's validation and for a planner choosing replica shares before it builds a Plan.

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


def split_in_equal_blocks(total: int, weights: list[int], blocks: list[list[int]],
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


@lru_cache(maxsize=64)
def grid_of(shapes: tuple[TemplateShape, ...], context_parallel: int = 1, expert_parallel: int = 1,
            expert_tensor_parallel: int | None = None) -> Grid:
    """The rank grid of these template shapes (built once per shape: plans of one shape share it)."""
    return Grid(shapes, context_parallel, expert_parallel, expert_tensor_parallel)
