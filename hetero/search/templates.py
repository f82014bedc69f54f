"""Plans of several replica templates: each device class in a pipeline shape of its own.

One pipeline shape for every replica makes classes of very different memory or speed
share one stage split, or leaves a class out. A plan of several templates (plan version
4) gives each its own: the search here builds them from two kinds of template,

- a device class's own best template: class-pure replicas of one shape (TP, depth and
  interleaving chosen for that class, as if it were planned alone, with its share of the
  batch), on all of the class's nodes or on those a cross-class template leaves free;
- a one-template layout of the main search (cross-class pipelines included, interleaved as
  the main search's best plan is), on the nodes it uses;

and tries their mixes: one template per class, a layout of the main search with templates
on the nodes it leaves out, each class also left out. A template interleaves (virtual
stages) where a plan of several allows it: three stages or more, one tensor-parallel
degree. The global batch is split over all replicas by speed (estimate.
allocate_micro_batches; an interleaved template's replicas in whole groups of its depth),
and every template's gradients are summed across templates at the end of the pipelines
(hetero/predict/template_reduction.py). Each mix is estimated from the same pieces as the
plan-level fast estimate (plan_estimate.py); the best few are placed and judged by the
exact predictor.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from hetero.plan import Plan
from hetero.predict.communication_costs import overlapped_gather_s, overlapped_reduce_s
from hetero.predict.costs import CostModel
from hetero.predict.schedule import PipelineShape, interleaved_shape
from hetero.predict.stragglers import replica_spread, slowest_of
from hetero.predict.template_reduction import TemplateLayout, cross_template_reduction
from hetero.search.estimate import FastEstimate, Shape, allocate_micro_batches
from hetero.search.families import StageSweep
from hetero.search.options import Candidate, DeviceClass, plan_recompute
from hetero.search.placement import ORDERS, class_group_part, neighbours_share_node, place, place_templates
from hetero.search.plan_estimate import plan_pipelines

PER_CLASS = 3
"""Templates kept per device class (its best by its time alone), mixed with the others'."""
EXACT = 2
"""Mixes the exact predictor judges."""


@dataclass
class TemplateOption:
    """One template on given nodes: its one-template plan (placed), each replica's closed
    form, and what the cross-template reduction and the optimizer step need of it."""

    candidate: Candidate | None
    """Its shape (None: a template kept as it was placed, e.g. by a plan being re-planned)."""
    classes: list[DeviceClass]
    """The device classes (all of them, each on the nodes this template may use)."""
    plan: Plan
    replicas: list[tuple[tuple[int, ...], PipelineShape]]
    """(classes of its stages, closed form) of each replica."""
    layout: TemplateLayout
    used: frozenset[str]
    """The hosts it runs on."""
    optimizer_s: float
    last_backward: list[float]
    """Each stage's backward of one micro-batch (what an overlapped reduction hides behind)."""
    cv: list[float]
    """Each replica's micro-batch variation (coefficient)."""
    alone_s: float = 0.0
    """Its class alone on its share of the batch (the per-class ranking)."""
    virtual_stages: int = 1
    """Model chunks per stage (interleaved when > 1)."""
    _hosts: dict[tuple[int, int], tuple[str, ...]] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def granularity(self) -> int:
        """Its replicas' micro-batch counts are multiples of this: the interleaved schedule
        runs them in groups of the pipeline's depth."""
        return self.plan.pipeline_parallel if self.virtual_stages > 1 else 1

    def hosts(self, stage: int, tensor_rank: int) -> tuple[str, ...]:
        """The host of each replica's rank at (stage, tensor rank)."""
        key = (stage, tensor_rank)
        if key not in self._hosts:
            grid = self.plan.grid
            self._hosts[key] = tuple(self.plan.device_of_logical(r).host for r in grid.data_group(tensor_rank, stage))
        return self._hosts[key]


class TemplateSearch:
    """Mixes of templates for one planner (hetero/search/planner.py)."""

    def __init__(self, estimate: FastEstimate, costs: CostModel):
        self.estimate, self.blocks = estimate, estimate.blocks
        self.classes = self.blocks.classes
        self.model, self.global_batch_size = estimate.model, estimate.global_batch_size
        self.options = self.blocks.options
        self.costs = costs
        """The cost model the mixes are priced with (the job's widest degree)."""
        self.estimated = 0

    # ----- templates ------------------------------------------------------------------------

    def class_options(self, c: int, hosts: Sequence[str], mbs: int, share: float) -> list[TemplateOption]:
        """Class c's best class-pure templates on these of its hosts, each with `share`
        micro-batches of the batch: per degree, the depths of a sweep."""
        cl = self.classes[c]
        nodes = len(hosts)
        if nodes == 0:
            return []
        found: list[tuple[float, Candidate, int]] = []
        for width in self.options.tensor_parallel:
            if width > cl.devices_per_node:
                continue
            tp = self.blocks.uniform(width)
            per_node = cl.devices_per_node // width
            sweep = StageSweep(self.model.num_layers)
            for stages in sweep:
                d = min(nodes * per_node // stages, self.global_batch_size // mbs)
                if d < 1:
                    break
                allowed = self.options.pipeline_parallel
                if allowed is not None and stages not in allowed:
                    continue
                for order in ORDERS:
                    scored = self._class_template(c, tp, mbs, stages, d, order, share)
                    if scored:
                        sweep.record(scored[0][0])  # the depth sweep follows the plain pipelines
                        found += scored
        found.sort(key=lambda scored: scored[0])
        kept, seen = [], set()
        for alone_s, candidate, v in found:
            key = (candidate.degrees[c], len(candidate.layers), v)
            if key in seen or not self._fits_interleaved(c, candidate, v):
                continue
            seen.add(key)
            kept.append(self.option(candidate, self._with_hosts(c, hosts), alone_s, virtual_stages=v))
            if len(kept) == PER_CLASS:
                break
        return kept

    def _class_template(self, c: int, tp, mbs: int, stages: int, d: int, order: str,
                        share: float) -> list[tuple[float, Candidate, int]]:
        """(its time alone on `share` micro-batches, the template, its virtual stages) of
        class c's replicas of one shape, plain first, then with each interleaving of the
        options it has the stages and layers for (its memory checked once it is kept:
        _fits_interleaved); empty if it does not fit."""
        self.estimated += 1
        pattern = (c,) * stages
        per_node = self.blocks.per_node(c, tp)
        shape = Shape(tp, mbs, ((pattern, d),), ((c, neighbours_share_node(per_node, d, stages, order)),))
        pipe = self.estimate.fit_pipeline(shape)
        if pipe is None:
            return []
        split = self.estimate.split(shape, pipe)
        if split is None:
            return []
        layers = split[0]
        parts = [(class_group_part(c, per_node, d, stages, s, order),) for s in range(stages)]
        after = self._reduction_alone(c, tp, mbs, d, layers, pipe.modes, self.blocks.stage_group_terms(tp, parts))
        after += self.estimate.optimizer_step_s(tp, d, layers, pipe.at_stage)
        found = []
        for v in [1] + [v for v in self.options.virtual_stages if v > 1 and stages >= 3 and min(layers) >= v]:
            sends = [v * x for x in pipe.sends[pattern]]  # every chunk crosses every boundary
            closed = interleaved_shape(self.estimate.replica_shape(pattern, layers, pipe.modes, tp, mbs, sends), v)
            group = stages if v > 1 else 1
            alone = closed.time(group * max(1, math.ceil(share / d / group))) + after
            found.append((alone, Candidate("class-pure", order, tp, mbs, list(layers), [pattern] * d, [1] * d, alone,
                                           list(pipe.modes)), v))
        return found

    def _fits_interleaved(self, c: int, candidate: Candidate, v: int) -> bool:
        """Whether class c's template still fits with v model chunks per stage (more of them in
        flight); each v > 1 is offered only where a plan of several templates may interleave:
        three stages or more, v layers on every stage."""
        if v == 1:
            return True
        layers, d, tp = candidate.layers, len(candidate.replica_classes), candidate.degrees
        return all(layers[s] <= self.estimate.memory.layer_cap(c, tp, candidate.micro_batch_size, d, s, len(layers),
                                                               candidate.recompute[s], virtual_stages=v)
                   for s in range(len(layers)))

    def _reduction_alone(self, c: int, tp, mbs: int, d: int, layers: list[int], modes: Sequence[str],
                         terms: list[tuple[float, float]]) -> float:
        """A class-pure template's part of the cross-template reduction, its data-parallel
        groups alone: every stage's gradients all-reduced, then (distributed optimizer) its
        parameters all-gathered, the slowest stage (template_reduction.py over its own groups,
        overlapped as the setup says)."""
        setup, width = self.costs.setup, tp[c]
        slowest = 0.0
        for s, (per_byte, fixed) in enumerate(terms):
            params = self.blocks.stage_params(layers, s) / width
            backward = layers[s] * self.blocks.layer_cost(c, tp, mbs, modes[s]).backward_s
            seconds = overlapped_reduce_s(setup, 2 * (params * setup.grad_bytes * per_byte + fixed), params, d, backward)
            if setup.distributed_optimizer:
                seconds += overlapped_gather_s(setup, params * setup.value_bytes * per_byte + fixed, params, d)
            slowest = max(slowest, seconds)
        return slowest if d > 1 else 0.0

    def _with_hosts(self, c: int, hosts: Sequence[str]) -> list[DeviceClass]:
        """The classes with class c on these of its hosts (the others as they are)."""
        return [dataclasses.replace(cl, hosts=tuple(hosts)) if i == c else cl for i, cl in enumerate(self.classes)]

    def option(self, candidate: Candidate | None, classes: list[DeviceClass], alone_s: float = 0.0,
               plan: Plan | None = None, virtual_stages: int = 1) -> TemplateOption:
        """A template placed on `classes`: a candidate of the search or a class's own, or a
        one-template plan as it is (candidate None), with this many virtual stages."""
        if plan is None:
            plan = self.place(candidate, classes, virtual_stages=virtual_stages)
        else:
            virtual_stages = plan.virtual_pipeline_size or 1
        pipes = plan_pipelines(self.estimate, plan)
        layout = TemplateLayout(tuple(pipes.layers), tuple(plan.stage_tensor_parallel))
        optimizer = self.estimate.optimizer_step_s(pipes.degrees, plan.data_parallel, pipes.layers, pipes.at_stage)
        cv = [self.blocks.micro_batch_cv(pattern, pipes.degrees, plan.micro_batch_size)
              for pattern, _, _ in pipes.replicas]
        return TemplateOption(candidate, classes, plan, [(p, shape) for p, shape, _ in pipes.replicas], layout,
                              frozenset(device.host for device in plan.devices), optimizer,
                              pipes.last_backward(self.estimate, plan.micro_batch_size), cv, alone_s, virtual_stages)

    def place(self, candidate: Candidate, classes: list[DeviceClass], micro_batches: Sequence[int] | None = None,
              virtual_stages: int = 1) -> Plan:
        """The candidate on these classes' nodes (interleaved: every replica at least one
        group of micro-batches until the split is known)."""
        recompute = None
        if candidate.recompute and any(mode != "none" for mode in candidate.recompute):
            recompute = [plan_recompute(mode) for mode in candidate.recompute]
        if micro_batches is None:
            group = len(candidate.layers) if virtual_stages > 1 else 1
            micro_batches = [group * math.ceil(m / group) for m in candidate.micro_batches]
        return place(self.blocks.cluster, classes, candidate.degrees, candidate.micro_batch_size, candidate.layers,
                     candidate.replica_classes, list(micro_batches), candidate.order, recompute=recompute,
                     virtual_stages=virtual_stages)

    # ----- mixes --------------------------------------------------------------------------

    def mixes(self, bases: Sequence[tuple[Candidate, int]], sizes: Sequence[int], best_s: float,
              kept: Sequence[TemplateOption] = ()) -> list[tuple[float, list[TemplateOption], list[list[int]]]]:
        """(estimate, templates, micro-batches of each template's replicas) of the mixes worth
        judging, best first: one class-pure template per class (each class also left out),
        and each of `bases` (layouts of the main search, each with the virtual stages its best
        plan ran) with templates on the nodes it leaves out, at each micro-batch size of
        `sizes`; with `kept` templates (placed plans of that micro-batch size), also those with
        templates on the nodes they leave free. best_s: the time to beat (a mix whose pipeline
        alone is slower is dropped)."""
        found = []
        for mbs in sizes:
            if self.global_batch_size % mbs:
                continue
            found += self.around([], mbs, best_s)
            if kept and all(option.plan.micro_batch_size == mbs for option in kept):
                found += self.around(list(kept), mbs, best_s)
            for base, v in bases:
                if base.micro_batch_size == mbs and self._leaves_nodes(base):
                    v = v if len(base.layers) >= 3 and len(set(base.stage_degrees())) == 1 else 1
                    found += self.around([self.option(base, self.classes, virtual_stages=v)], mbs, best_s)
        return sorted(found, key=lambda f: f[0])[:EXACT]

    def around(self, fixed: list[TemplateOption], mbs: int, best_s: float
               ) -> list[tuple[float, list[TemplateOption], list[list[int]]]]:
        """The mixes of the `fixed` templates with each class's own templates on the hosts
        they leave free (each class also left out), estimated; those that cannot beat best_s
        left out."""
        total = self.global_batch_size // mbs
        speed = {c: self._class_speed(c, mbs) for c in range(len(self.classes))}
        fleet = sum(speed.values()) or 1.0
        taken = set().union(*(option.used for option in fixed))
        choices = []
        for c, cl in enumerate(self.classes):
            free = [h for h in cl.hosts if h not in taken]
            if free:
                share = total * speed[c] / fleet * len(free) / len(cl.hosts)
                choices.append(self.class_options(c, free, mbs, share) + [None])
        found = []
        for combo in itertools.product(*choices):
            chosen = fixed + [o for o in combo if o is not None]
            # templates all of one shape are a plan of one template (the main search's)
            if len(chosen) > 1 and len({(o.layout, o.virtual_stages) for o in chosen}) > 1:
                judged = self.judge(chosen, total, best_s)
                if judged is not None:
                    found.append(judged)
        return found

    def _leaves_nodes(self, candidate: Candidate) -> bool:
        """Whether a layout of the main search leaves a node of some class free (placement
        takes each class's tensor-parallel groups node by node)."""
        for c, cl in enumerate(self.classes):
            groups = sum(pattern.count(c) for pattern in candidate.replica_classes)
            if len(cl.hosts) > math.ceil(groups / self.blocks.per_node(c, candidate.degrees)):
                return True
        return False

    def _class_speed(self, c: int, mbs: int) -> float:
        """Micro-batches per second the class runs at its fastest layer time (perfectly
        pipelined): weights for the share of the batch its own templates are ranked on."""
        cl = self.classes[c]
        best = 0.0
        for width in self.options.tensor_parallel:
            if width <= cl.devices_per_node:
                groups = len(cl.hosts) * (cl.devices_per_node // width)
                layer = self.blocks.layer_time(c, self.blocks.uniform(width), mbs)
                best = max(best, groups / (layer * self.model.num_layers))
        return best

    def judge(self, chosen: list[TemplateOption], total: int, best_s: float
              ) -> tuple[float, list[TemplateOption], list[list[int]]] | None:
        """A mix's estimate and micro-batch split; None if it cannot beat best_s."""
        self.estimated += 1
        alike: dict[tuple[int, PipelineShape], int] = {}  # replicas of one template and closed form
        for k, option in enumerate(chosen):
            for _, shape in option.replicas:
                alike[k, shape] = alike.get((k, shape), 0) + 1
        micro = allocate_micro_batches(total, alike, {key: key[1] for key in alike},
                                       {key: chosen[key[0]].granularity for key in alike})
        if micro is None:
            return None
        given = {key: iter(counts) for key, counts in micro.items()}
        counts = [[next(given[k, shape]) for _, shape in option.replicas] for k, option in enumerate(chosen)]
        pipeline = slowest_of((shape.time(m), replica_spread(option.cv[r] * shape.step_s, m))
                              for k, option in enumerate(chosen) for r, ((_, shape), m)
                              in enumerate(zip(option.replicas, counts[k])))
        optimizer = max(option.optimizer_s for option in chosen)
        if pipeline + optimizer >= best_s:
            return None
        last_backward = {(k, s): backward for k, option in enumerate(chosen)
                         for s, backward in enumerate(option.last_backward)}
        reduction = cross_template_reduction(self.costs, [o.layout for o in chosen],
                                             lambda holder: chosen[holder[0]].hosts(holder[1], holder[2]), last_backward)
        estimate = pipeline + max(reduction.values()) + optimizer
        return (estimate, chosen, counts) if estimate < best_s else None

    def materialize(self, chosen: list[TemplateOption], counts: list[list[int]]) -> Plan:
        """The mix as a plan of several templates, each on its own nodes."""
        placed = [self.place(option.candidate, option.classes, micro, option.virtual_stages)
                  if option.candidate is not None else _with_micro_batches(option.plan, micro)
                  for option, micro in zip(chosen, counts)]
        return place_templates(self.blocks.cluster, placed)


def _with_micro_batches(plan: Plan, counts: Sequence[int]) -> Plan:
    """A one-template plan with other micro-batch counts per replica."""
    template = plan.templates[0]
    replicas = [replica.model_copy(update={"num_micro_batches": m}) for replica, m in zip(template.replicas, counts)]
    return Plan.of_templates([template.model_copy(update={"replicas": replicas})],
                             micro_batch_size=plan.micro_batch_size, rank_order=plan.rank_order, devices=plan.devices)
