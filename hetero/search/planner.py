"""The planner: the fastest plan that fits in memory, found without launching anything.

Devices fall into classes: one device type inside one fabric group (options.device_classes).
For every tensor-parallel degree and micro-batch size, each shape of the three layout
families (families.py) gets a fast estimate (estimate.py: per-stage times, memory caps, the
min-max layer split, micro-batches by replica speed). The best of each family and overall
(shortlist.py) are placed on concrete devices (placement.py; for the first two families in
two orders: a replica's stages side by side, or a stage's replicas side by side), with each
interleaving megatron-core can run, and judged by the exact predictor
(hetero/predict/predictor.py). The shapes best by their interleaved estimate are judged
interleaved too, and the shortlisted cross-class pipelines of one degree in their other
class orders estimated nearly as fast (where each class sits moves an interleaved
pipeline's bubbles and transfers more than the closed forms see). Then plans of several
replica templates (templates.py). Deterministic for the same input.

    candidates -> shortlist -> materialize -> exact predict
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from pydantic import ValidationError

from hetero.errors import HeteroError
from hetero.plan import Plan
from hetero.predict.costs import CostModel
from hetero.predict.training_setup import TrainingSetup
from hetero.predict.predictor import Prediction, predict
from hetero.search.estimate import FastEstimate
from hetero.search.plan_estimate import estimate_plan
from hetero.search.expert_parallel import expert_parallel_choices, with_expert_parallel
from hetero.search.families import LayoutFamilies
from hetero.search.options import Candidate, PlannerOptions, PlanResult, plan_recompute
from hetero.search.placement import ORDERS, place
from hetero.search.shortlist import Leaderboard, interleaved_shortlist, shortlist
from hetero.search.templates import TemplateSearch
from hetero.spec.cluster import Cluster
from hetero.spec.model import ModelSpec
from hetero.spec.profiles import Profiles


ORDER_MARGIN = 1.03
"""Other class orders of a shortlisted cross-class pipeline estimated up to this much slower
are predicted interleaved (Planner._other_class_orders)."""
ORDERS_TRIED = 8
"""...at most this many per shortlisted pipeline."""
TEMPLATE_MARGIN = 1.05
"""Mixes of templates estimated up to this much slower than the best plan so far are still
predicted (the estimate is a closed form of what the predictor simulates)."""
TEMPLATE_GAIN = 0.01
"""A plan of several templates replaces the best plan of one only when predicted this much
faster: it runs more process groups, and its gradient reduction spans every template."""


class Planner:
    def __init__(self, cluster: Cluster, model: ModelSpec, global_batch_size: int,
                 options: PlannerOptions = PlannerOptions(), profiles: Profiles | None = None):
        self.cluster, self.model, self.options = cluster, model, options
        self.global_batch_size = global_batch_size
        self.setup = options.setup
        self.profiles = profiles
        self.estimator = FastEstimate(cluster, model, global_batch_size, options, profiles)
        self.families = LayoutFamilies(self.estimator)
        self.classes = self.estimator.blocks.classes
        self.costs = self.estimator.blocks.costs
        self.expert_parallel_degrees = expert_parallel_choices(model, self.classes, options)
        # The expert-parallel degree this search's plans run with (one per search).
        self.expert_parallel = self.expert_parallel_degrees[0] if len(self.expert_parallel_degrees) == 1 else 1
        self.templates_estimated = 0

    def costs_for(self, tensor_parallel: int, virtual_stages: int = 1) -> CostModel:
        """The cost model of the setup a plan of this TP degree runs with."""
        return self.estimator.blocks.costs_for(tensor_parallel, virtual_stages)

    @property
    def estimated(self) -> int:
        """Shapes (and mixes of templates) the search has estimated so far."""
        return self.families.estimated + self.templates_estimated

    def estimate(self, plan: Plan) -> tuple[bool, float]:
        """The fast estimate of a given plan: (fits in memory, seconds per iteration)
        (plan_estimate.estimate_plan)."""
        return estimate_plan(self.estimator, plan)

    # ----- search -------------------------------------------------------------------------

    def candidates(self, progress: Callable[[str], None] | None = None,
                   only_contenders: bool = False) -> list[Candidate]:
        """Every shape that fits, estimated; with only_contenders, those that may still reach
        the shortlist (the others are dropped once a lower bound of their estimate shows
        they cannot: the shortlist is the same, the search faster)."""
        families, options = self.families, self.options
        families.leaders = Leaderboard(options.exact_candidates, options.exact_per_family) \
            if only_contenders else None
        sizes = options.micro_batch_sizes
        if not any(self.global_batch_size % mbs == 0 for mbs in sizes):
            raise HeteroError(
                f"global batch size {self.global_batch_size} is not divisible by any micro-batch "
                f"size tried ({', '.join(map(str, sizes))}); choose a global batch that is"
            )
        found: list[Candidate] = []
        everyone = list(range(len(self.classes)))
        subsets = [everyone] + ([[c for c in everyone if c != drop] for drop in everyone]
                                if len(everyone) > 1 else [])
        for width in options.tensor_parallel:
            tp = self.estimator.blocks.uniform(width)
            for mbs in sizes:
                if self.global_batch_size % mbs:
                    continue
                if progress:
                    progress(f"TP={width} micro-batch={mbs}")
                for subset in subsets:
                    usable = [c for c in subset if self.classes[c].devices_per_node >= width]
                    if not usable or (subset is not everyone and len(usable) == len(everyone)):
                        continue
                    found.extend(families.class_pure(tp, mbs, usable))
                    if len(usable) > 1:  # on one class the other families are the same plans
                        found.extend(families.cross_class(tp, mbs, usable))
                        found.extend(families.launch_order(tp, mbs, usable))
        # A mixture of experts takes one degree for every stage: the runtime trains a degree per
        # stage only where every stage holds as many copies of its experts (expert TP following
        # each stage's degree), which the search's expert grid (expert TP 1 at EP > 1) is not.
        if options.per_stage_tensor_parallel and len(everyone) > 1 and not self.model.is_moe:
            for mbs in sizes:
                if self.global_batch_size % mbs:
                    continue
                for tp in families.mixed_degrees(mbs):
                    if progress:
                        progress(f"TP per class {tp} micro-batch={mbs}")
                    found.extend(families.cross_class(tp, mbs, everyone))
        return found

    def plan(self, progress: Callable[[str], None] | None = None) -> PlanResult:
        if self.global_batch_size < 1:
            raise HeteroError("global batch size must be at least 1")
        if len(self.expert_parallel_degrees) > 1:
            return self._plan_each_expert_parallel(progress)
        start, cpu_start = time.perf_counter(), time.process_time()
        found = self.candidates(progress, only_contenders=True)
        best: tuple[float, Plan, Prediction, str, TrainingSetup] | None = None
        leader: tuple[Candidate, int] | None = None  # the best plan's candidate and virtual stages
        chosen = shortlist(found, self.options.exact_candidates, self.options.exact_per_family)
        interleaved = interleaved_shortlist(found, self.options.exact_candidates, chosen)
        trials = [(c, c.order, False) for c in chosen]
        trials += [(c, o, False) for c in chosen[:1] if c.family != "launch-order" for o in ORDERS if o != c.order]
        trials += [(c, c.order, True) for c in interleaved]
        trials += [(c, c.order, True) for c in self._other_class_orders(chosen + interleaved)]
        for candidate, order, interleaved_only in trials:
            for v, plan in self._interleavings(candidate, order, plain=not interleaved_only):
                plan = with_expert_parallel(plan, self.expert_parallel,
                                            self.options.expert_tensor_parallel if self.model.is_moe else None)
                if plan is None:  # its stages' ranks do not split into expert groups
                    continue
                costs = self.costs_for(candidate.tensor_parallel, v)
                prediction = predict(plan, self.cluster, costs)
                if prediction.fits and (best is None or prediction.iteration_time_s < best[0]):
                    best = (prediction.iteration_time_s, plan, prediction, candidate.family, costs.setup)
                    leader = (candidate, v)
        if self._searches_templates():
            if progress:
                progress("replica templates")
            # the best plan's layout (with its interleaving) and the best estimate's
            bases = list({id(c): (c, v) for c, v in [(c, 1) for c in chosen[:1]] + ([leader] if leader else [])}.values())
            best = self._best_templates(bases, best) or best
        if best is None:
            raise HeteroError(self._why_nothing_fits())
        return PlanResult(best[1], best[2], best[3], time.perf_counter() - start, self.estimated, best[4],
                          time.process_time() - cpu_start)

    def _other_class_orders(self, chosen: list[Candidate]) -> list[Candidate]:
        """The shortlisted cross-class pipelines of one degree in their other class orders
        (LayoutFamilies.class_orders_of), those estimated (plain or interleaved) within
        ORDER_MARGIN of the shortlisted one, at most ORDERS_TRIED each: under the interleaved
        schedule the order moves the bubbles and transfers by more than the closed forms
        separate them."""
        if max(self.options.virtual_stages) == 1:
            return []

        def key(c: Candidate) -> tuple:
            return c.replica_classes[0], c.order, c.degrees, c.micro_batch_size, len(c.replica_classes)

        seen = {key(c) for c in chosen}
        found = []
        for candidate in chosen:
            if (candidate.family != "cross-class" or len(candidate.layers) < 2 or len(set(candidate.stage_degrees())) > 1):
                continue
            others = sorted(self.families.class_orders_of(candidate), key=_best_estimate)
            bar = _best_estimate(candidate) * ORDER_MARGIN
            for other in [c for c in others if _best_estimate(c) <= bar][:ORDERS_TRIED]:
                if key(other) not in seen:
                    seen.add(key(other))
                    found.append(other)
        return found

    def _searches_templates(self) -> bool:
        """Plans of several templates are searched where the runtime trains them: two device
        classes or more, no experts, no multi-token prediction, no fixed interleaving."""
        return (self.options.templates and (len(self.classes) > 1 or bool(self.options.kept_templates))
                and not self.model.is_moe and not self.model.mtp_num_layers and 1 in self.options.virtual_stages)

    def _best_templates(self, bases: list[tuple[Candidate, int]], best: tuple | None) -> tuple | None:
        """The best plan of several templates (templates.py), if predicted TEMPLATE_GAIN faster
        than `best` (the best plan of one template); bases: layouts of the main search with
        their virtual stages."""
        best_s = best[0] * (1 - TEMPLATE_GAIN) if best else float("inf")
        search = TemplateSearch(self.estimator, self.estimator.blocks.costs)
        sizes = sorted({c.micro_batch_size for c, _ in bases}) or [
            mbs for mbs in self.options.micro_batch_sizes if self.global_batch_size % mbs == 0]
        kept = [search.option(None, self.classes, plan=plan) for plan in self.options.kept_templates]
        found = search.mixes(bases, sizes, best_s * TEMPLATE_MARGIN, kept)
        self.templates_estimated += search.estimated
        chosen = None
        for _, templates, counts in found:
            plan = search.materialize(templates, counts)
            costs = self.costs_for(plan.max_tensor_parallel)
            prediction = predict(plan, self.cluster, costs)
            if prediction.fits and prediction.iteration_time_s < (chosen[0] if chosen else best_s):
                chosen = (prediction.iteration_time_s, plan, prediction, "templates", costs.setup)
        return chosen

    def _plan_each_expert_parallel(self, progress: Callable[[str], None] | None) -> PlanResult:
        """The best plan over the expert-parallel degrees, one search each."""
        start, cpu_start = time.perf_counter(), time.process_time()
        results, estimated = [], 0
        for ep in self.expert_parallel_degrees:
            if progress:
                progress(f"expert parallel {ep}")
            options = dataclasses.replace(self.options, expert_parallel=(ep,))
            planner = Planner(self.cluster, self.model, self.global_batch_size, options, self.profiles)
            try:
                results.append(planner.plan(progress))
            except HeteroError:
                pass
            estimated += planner.estimated
        if not results:
            raise HeteroError(self._why_nothing_fits())
        best = min(results, key=lambda r: r.prediction.iteration_time_s)
        return dataclasses.replace(best, search_time_s=time.perf_counter() - start, candidates_estimated=estimated,
                                   search_cpu_s=time.process_time() - cpu_start)

    # ----- from a candidate to a plan -----------------------------------------------------

    def materialize(self, candidate: Candidate, order: str, virtual_stages: int = 1) -> Plan:
        """The candidate placed on concrete devices in this order (placement.ORDERS), with
        its stages' recomputation (written out for every stage once any stage recomputes)
        and virtual_stages model chunks per stage."""
        recompute = None
        if candidate.recompute and any(mode != "none" for mode in candidate.recompute):
            recompute = [plan_recompute(mode) for mode in candidate.recompute]
        return place(self.cluster, self.classes, candidate.degrees, candidate.micro_batch_size,
                     candidate.layers, candidate.replica_classes, candidate.micro_batches, order,
                     recompute=recompute, virtual_stages=virtual_stages)

    def _interleavings(self, candidate: Candidate, order: str, plain: bool = True) -> list[tuple[int, Plan]]:
        """The candidate's plan with each virtual-stage count megatron-core can run it with:
        every stage's layers split into v chunks as equal as they split (placement.even_chunks:
        a stage of 9 layers in chunks of 5 and 4), kept only when the plan's validation
        accepts it (its micro-batch counts against the pipeline); without plain, only the
        interleaved ones."""
        found = []
        for v in self.options.virtual_stages:
            if v == 1:
                if plain:
                    found.append((1, self.materialize(candidate, order)))
                continue
            if len(candidate.layers) < 2 or min(candidate.layers) < v:
                continue
            try:
                found.append((v, self.materialize(candidate, order, v)))
            except ValidationError:
                continue
        return found

    def _why_nothing_fits(self) -> str:
        largest = max(self.cluster.devices[c.device_type].memory_gib for c in self.classes)
        return (
            f"no plan fits: {self.model.total_params() / 1e9:.1f}B parameters at global batch "
            f"{self.global_batch_size} do not fit the memory of cluster {self.cluster.name} "
            f"({self.cluster.num_devices} devices, largest {largest:g} GiB) under any TP "
            f"{self.options.tensor_parallel} x PP x DP split; add devices, lower the micro-batch "
            "size or sequence length, or use the distributed optimizer"
        )


def _best_estimate(candidate: Candidate) -> float:
    """A candidate's estimate, plain or interleaved, whichever is faster."""
    return min(candidate.estimate_s, candidate.interleaved[1]) if candidate.interleaved else candidate.estimate_s
