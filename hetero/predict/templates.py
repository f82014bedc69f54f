"""Predicting a plan of several replica templates (plan version 4).

Each template is predicted as a plan of its own (Plan.template_plan): its replicas run
their pipelines as a one-template plan's do (interleaved where the template has virtual
stages), its memory is its own stages' (optimizer state sharded over its own replicas), its
optimizer step its own. What they share is the end of the iteration: the gradients are
summed across templates (template_reduction.py; with --overlap-grad-reduce all but the last
bucket under each stage's last backward), then every rank steps. So

    iteration = slowest replica's pipeline + the exposed cross-template reduction + the slowest step.

The predictor (predictor.py) hands its one-template prediction in (``predict_one``), so this
module composes it without importing it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Callable

from hetero.plan import Plan
from hetero.predict.costs import CostModel
from hetero.predict.template_reduction import cross_template_reduction, template_layouts
from hetero.spec.cluster import Cluster


def predict_templates(plan: Plan, cluster: Cluster, costs: CostModel, predict_one: Callable):
    """The Prediction (predictor.py) of a plan of several templates: stage_end_s and reduce_s
    list every template's stages, template by template; timelines and reports are keyed by
    the plan's replica index (over every template)."""
    grid = plan.grid
    subs = [plan.template_plan(k) for k in range(plan.num_templates)]
    # each template with its own interleaving (its memory keeps that many chunks in flight)
    parts = [predict_one(sub, cluster, costs.with_virtual_stages(sub.virtual_pipeline_size or 1)) for sub in subs]
    pipeline_end = max(max(part.stage_end_s) for part in parts)

    def hosts_of(holder: tuple[int, int, int]) -> list[str]:
        k, s, t = holder
        return [plan.device_of_logical(r).host for r in grid.data_group(t, s, template=k)]

    last_backward: dict[tuple[int, int], float] = {}  # as predictor.gradient_reduction takes it
    for k, part in enumerate(parts):
        for report in part.reports:
            key = (k, report.slot.stage)
            last_backward[key] = min(last_backward.get(key, report.timing.backward_s), report.timing.backward_s)
    reduction = cross_template_reduction(costs, template_layouts(plan.templates), hosts_of, last_backward)
    reduce_s = [reduction[k, s] for k, t in enumerate(plan.templates) for s in range(t.pipeline_parallel)]
    optimizer_s = max(part.optimizer_s for part in parts)
    iteration = pipeline_end + max(reduce_s) + optimizer_s
    timelines, reports, peak, flops, devices = {}, [], {}, Counter(), Counter()
    for k, part in enumerate(parts):
        first = grid.replica_offsets[k]
        timelines.update({first + d: ops for d, ops in part.timelines.items()})
        reports += [dataclasses.replace(r, slot=dataclasses.replace(r.slot, replica=first + r.slot.replica))
                    for r in part.reports]
        for name, gib in part.peak_memory_gib.items():
            peak[name] = max(peak.get(name, 0.0), gib)
        used = Counter(d.device_type for d in subs[k].devices)
        for name, tflops in part.tflops_per_device.items():  # each template's work over the whole iteration
            flops[name] += tflops * used[name] * part.iteration_time_s
            devices[name] += used[name]
    problems = [f"template {k}: {problem}" for k, part in enumerate(parts) for problem in part.problems]
    return dataclasses.replace(
        parts[0], iteration_time_s=iteration,
        tokens_per_s=plan.global_batch_size * costs.model.seq_length / iteration,
        stage_end_s=[end for part in parts for end in part.stage_end_s], reduce_s=reduce_s,
        optimizer_s=optimizer_s, reports=reports,
        tflops_per_device={name: flops[name] / devices[name] / iteration for name in flops},
        peak_memory_gib=peak, memory_capacity_gib={name: cluster.devices[name].memory_gib for name in peak},
        problems=problems, timelines=timelines, reduction_start_s=pipeline_end)
