"""The fast estimate of a given plan: what the search ranks candidates by, applied to a plan
as it is (its layout, layers, micro-batches and recomputation), so that tests can hold it
against the exact predictor (hetero/predict/predictor.py) and the planner can judge layouts
it built itself (a plan of several templates).

A plan of one template: every replica's 1F1B closed form from the same cost blocks as a
shape's estimate (estimate.py), then its data-parallel reduction and optimizer step. A plan
of several: each template's replicas so, the slowest of all of them, then the predictor's
own cross-template reduction (hetero/predict/template_reduction.py) on the plan's hosts and
the slowest template's optimizer step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hetero.plan import Plan
from hetero.predict.costs import CostModel
from hetero.predict.expert_exchange import expert_data_group_hosts, expert_exchange_beyond_node_s, unpaired_exchange_s
from hetero.predict.moe_overlap import unpaired_share
from hetero.predict.predictor import expert_group_hosts, stage_recompute, virtual_stages_of
from hetero.predict.schedule import PipelineShape, interleaved_shape
from hetero.predict.stragglers import replica_spread, slowest_of
from hetero.predict.template_reduction import cross_template_reduction, template_layouts
from hetero.predict.tied_embedding import tied_embedding_sync_s
from hetero.search.estimate import FastEstimate, Pattern
from hetero.search.expert_parallel import expert_tensor_parallel_for
from hetero.search.options import Degrees


@dataclass
class PlanPipelines:
    """One template's replicas as the fast estimate sees them."""

    fits: bool
    degrees: Degrees
    """Each class's tensor-parallel degree (the template's where it has the class)."""
    layers: list[int]
    modes: list[str]
    at_stage: list[list[int]]
    """Each stage's classes."""
    hosts: list[list[str]]
    """hosts[d][s]: the host of tensor rank 0 of replica d's stage s."""
    replicas: list[tuple[Pattern, PipelineShape, int]]
    """(classes of each stage, 1F1B closed form, micro-batches) per replica."""

    def last_backward(self, estimate: FastEstimate, mbs: int) -> list[float]:
        """Each stage's backward of one micro-batch on its fastest class: what an overlapped
        gradient reduction hides behind (FastEstimate.reduce_and_step's)."""
        return [n * min(estimate.blocks.layer_cost(c, self.degrees, mbs, mode).backward_s for c in classes)
                for n, mode, classes in zip(self.layers, self.modes, self.at_stage)]

    def ends(self, estimate: FastEstimate, mbs: int) -> list[tuple[float, float]]:
        """(end, standard deviation) of every replica (FastEstimate.slowest_replica's terms)."""
        cv = estimate.blocks.micro_batch_cv
        return [(shape.time(m), replica_spread(cv(pattern, self.degrees, mbs) * shape.step_s, m))
                for pattern, shape, m in self.replicas]


def estimate_plan(estimate: FastEstimate, plan: Plan) -> tuple[bool, float]:
    """(fits in memory, seconds per iteration) of a plan, one template or several."""
    blocks = estimate.blocks
    # an estimate priced for the plan's expert grid (as the search would price it)
    grid = (plan.expert_parallel, expert_tensor_parallel_for(plan.expert_parallel, plan.expert_tensor_parallel))
    if estimate.model.is_moe and grid != (blocks.expert_parallel, blocks.costs_for(1).expert_tensor_parallel):
        options = dataclasses.replace(blocks.options, expert_parallel=(plan.expert_parallel,),
                                      expert_tensor_parallel=plan.expert_tensor_parallel)
        return estimate_plan(FastEstimate(blocks.cluster, estimate.model, estimate.global_batch_size, options,
                                          blocks.profiles), plan)
    if plan.num_templates > 1:
        return _several_templates(estimate, plan)
    pipes = plan_pipelines(estimate, plan)
    mbs, pp, dp = plan.micro_batch_size, plan.pipeline_parallel, plan.data_parallel
    costs, cluster = blocks.job_costs(pipes.degrees), blocks.cluster
    pipeline = slowest_of(pipes.ends(estimate, mbs))
    groups = [[plan.device_of_logical(r).host for r in plan.grid.data_group(0, s)] for s in range(pp)]
    crossing = [s for s, g in enumerate(groups) if len({cluster.node(h).group for h in g}) > 1]
    spanning = sum(plan.stage_tensor_parallel[s] for s in crossing)
    terms = [costs.allreduce_terms(tuple(g), max(1, spanning)) for g in groups]
    expert_terms = None
    if plan.expert_parallel > 1:
        expert_spanning = sum(costs.expert_parallel * costs.expert_tensor_parallel_at(plan.stage_tensor_parallel[s])
                              for s in crossing)
        expert_terms = [costs.allreduce_terms(
            expert_data_group_hosts(g, costs.expert_data_parallel_at(plan.stage_tensor_parallel[s], dp)),
            max(1, expert_spanning)) for s, g in enumerate(groups)]
    tie_s = tied_embedding_sync_s(costs, [hosts_of_stage(plan, d, 0) for d in range(dp)],
                                  [hosts_of_stage(plan, d, pp - 1) for d in range(dp)]) if pp > 1 else 0.0
    after = estimate.reduce_and_step(pipes.degrees, mbs, dp, pipes.layers, pipes.modes, pipes.at_stage, terms,
                                     tie_s, expert_terms)
    return pipes.fits, pipeline + after


def _several_templates(estimate: FastEstimate, plan: Plan) -> tuple[bool, float]:
    """Each template's replicas as a plan of its own, the slowest of them all, then the
    cross-template reduction on the plan's hosts and the slowest optimizer step."""
    mbs, grid = plan.micro_batch_size, plan.grid
    subs = [plan.template_plan(k) for k in range(plan.num_templates)]
    parts = [plan_pipelines(estimate, sub) for sub in subs]
    pipeline = slowest_of([end for part in parts for end in part.ends(estimate, mbs)])
    widest = max(max(part.degrees) for part in parts)
    costs = estimate.blocks.costs_for(widest)

    def hosts_of(holder: tuple[int, int, int]) -> list[str]:
        k, s, t = holder
        return [plan.device_of_logical(r).host for r in grid.data_group(t, s, template=k)]

    last_backward = {(k, s): backward for k, part in enumerate(parts)
                     for s, backward in enumerate(part.last_backward(estimate, mbs))}
    reduction = cross_template_reduction(costs, template_layouts(plan.templates), hosts_of, last_backward)
    optimizer = max(estimate.optimizer_step_s(part.degrees, sub.data_parallel, part.layers, part.at_stage)
                    for part, sub in zip(parts, subs))
    return all(part.fits for part in parts), pipeline + max(reduction.values()) + optimizer


def plan_pipelines(estimate: FastEstimate, plan: Plan) -> PlanPipelines:
    """A one-template plan's replicas (closed forms from the cost blocks) and whether its
    stages fit their devices' memory."""
    blocks = estimate.blocks
    pp, dp, mbs = plan.pipeline_parallel, plan.data_parallel, plan.micro_batch_size
    hosts = [[plan.stage_device(d, s).host for s in range(pp)] for d in range(dp)]
    patterns = [tuple(blocks.class_of[h] for h in row) for row in hosts]
    degrees = {c: plan.stage_tensor_parallel[s] for pattern in patterns for s, c in enumerate(pattern)}
    tp = tuple(degrees.get(c, plan.tensor_parallel) for c in range(len(blocks.classes)))
    costs = blocks.job_costs(tp)
    at_stage = [sorted({p[s] for p in patterns}) for s in range(pp)]
    layers = [stage.num_layers for stage in plan.stages]
    modes = [stage_recompute(plan, s, costs) for s in range(pp)]
    # Interleaved (predictor.virtual_stages_of): more chunks in flight; every chunk of a
    # micro-batch crosses each boundary, and each chunk but the last wraps around from the
    # last stage to the first.
    v = virtual_stages_of(plan, costs)
    fits = all(layers[s] <= estimate.memory.layer_cap(pattern[s], tp, mbs, dp, s, pp, modes[s],
                                                      plan.replicas[d].num_micro_batches, v)
               for d, pattern in enumerate(patterns) for s in range(pp))
    replicas = []
    for d, pattern in enumerate(patterns):
        sends = [0.0] * pp
        for s in range(pp - 1):
            a, b, same = pattern[s], pattern[s + 1], hosts[d][s] == hosts[d][s + 1]
            at_boundary = dp * max(tp[a], tp[b])
            sends[s] += v * blocks.send_time(a, b, tp, mbs, same, at_boundary)
            sends[s + 1] += v * blocks.send_time(b, a, tp, mbs, same, at_boundary)
        if v > 1:
            a, b, same = pattern[-1], pattern[0], hosts[d][-1] == hosts[d][0]
            at_boundary = dp * max(tp[a], tp[b])
            sends[-1] += (v - 1) * blocks.send_time(a, b, tp, mbs, same, at_boundary)
            sends[0] += (v - 1) * blocks.send_time(b, a, tp, mbs, same, at_boundary)
        if plan.expert_parallel > 1:  # the plan's own expert groups for the packed one layer_cost priced
            for s in range(pp):
                exchanging = layers[s] + (costs.mtp_exchange_layers() if s == pp - 1 else 0.0)
                sends[s] += exchanging * _expert_groups_as_placed(estimate, plan, d, s, pattern[s], tp, modes[s])
                # the pipeline's unpaired chunks with overlapped all-to-alls (the search
                # leaves them out: a replica's micro-batch count is not known there)
                alone = unpaired_share(plan.replicas[d].num_micro_batches, pp, s, costs.setup.virtual_stages)
                if alone:
                    unpaired = unpaired_exchange_s(costs, expert_group_hosts(plan, d, s),
                                                   blocks.classes[pattern[s]].device_type, tp[pattern[s]], mbs,
                                                   modes[s])
                    sends[s] += exchanging * alone * sum(unpaired)
        shape = estimate.replica_shape(pattern, layers, modes, tp, mbs, sends)
        replicas.append((pattern, interleaved_shape(shape, v), plan.replicas[d].num_micro_batches))
    return PlanPipelines(fits, tp, layers, modes, at_stage, hosts, replicas)


def _expert_groups_as_placed(estimate: FastEstimate, plan: Plan, d: int, s: int, c: int, tp: Degrees,
                             recompute: str) -> float:
    """What one layer of replica d's stage s (on class c) takes beyond blocks.layer_cost's
    estimate, forward and backward, with its expert-parallel group where the plan puts it
    (the same function prices both: predict/expert_exchange.py)."""
    blocks = estimate.blocks
    costs: CostModel = blocks.job_costs(tp)
    cl, host = blocks.classes[c], plan.stage_device(d, s).host
    placed = expert_exchange_beyond_node_s(costs, expert_group_hosts(plan, d, s), host, cl.device_type,
                                           tp[c], plan.micro_batch_size, recompute)
    packed = expert_exchange_beyond_node_s(costs, blocks.expert_group(c, tp), cl.hosts[0], cl.device_type,
                                           tp[c], plan.micro_batch_size, recompute)
    return sum(placed) - sum(packed)


def hosts_of_stage(plan: Plan, replica: int, stage: int) -> list[str]:
    """The host of each tensor-parallel rank of a replica's stage."""
    return [plan.device_of_logical(r).host for r in plan.grid.tensor_group(replica, stage)]
