"""The gradient reduction of a plan of several replica templates: one cost, two callers.

Every template holds the whole model in its own pipeline shape, so megatron-core's data-
parallel reduction (one group per stage and tensor rank) cannot sum them. The runtime
instead, at the end of every replica's last micro-batch:

- cuts the model at the union of all templates' stage boundaries and tensor-parallel shard
  boundaries (*cells*); each distinct set of holder ranks is one process group with one
  all-reduce per iteration, a ring in logical-rank order (template 0's ranks first). Where
  templates give the same layers different tensor-parallel degrees, a rank of the narrower
  template takes part in several groups (one per shard of the wider), with the matching
  part of its tensor: the volume is the same, the groups and their latencies more. Where
  the degrees agree, a group is the data-parallel group of one tensor rank spanning every
  template's replicas;
- sums the tied word embedding's gradient (every template's first-stage embedding and
  last-stage output layer hold one table) in the same all-reduce of its cell;
- with the distributed optimizer, all-gathers each template's updated parameters within
  its own replicas (megatron-core shards optimizer state over them), as a plan of one
  template does.

With --overlap-grad-reduce the groups' all-reduces start during the backward of each
replica's last micro-batch, as soon as a rank's cells of a group have their final
gradients (one global order, latest layers first), and the iteration waits for the rest at
its end; with --overlap-param-gather the all-gather runs under the next forward. Both are
priced with the rule of one template's overlapped reduction (communication_costs.py): all
but the last bucket hide behind the stage's last backward, all but the first bucket of the
gather behind the next forward. The runtime's side is megatron/hetero/template_reduction.py.

A rank issues all its groups at once and waits for them (each process group runs its own
all-reduce): their bytes share the rank's links, so they take as long as one after the other,
but their fixed terms (each ring's steps' latencies) overlap - measured on the emulator
(bench/reduction_bench.py), three groups priced one after the other came out 22% slow. Groups
of different ranks run at once, sharing the links between fabric groups. Both the predictor
(a plan's concrete hosts) and the planner's fast estimate (representative hosts of a class)
price it here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from hetero.predict.communication_costs import overlapped_gather_s, overlapped_reduce_s
from hetero.predict.costs import CostModel
from hetero.predict.memory import stage_params

Holder = tuple[int, int, int]
"""(template, stage, tensor rank): the ranks of every replica of a template at that place."""


@dataclass(frozen=True)
class TemplateLayout:
    """What the cells of one template depend on: its layers and degree per stage."""

    layers: tuple[int, ...]
    tensor_parallel: tuple[int, ...]


@dataclass(frozen=True)
class CellGroup:
    """One process group of the cross-template reduction: who holds its parameters, and
    how many parameters (over all its cells) each of its ranks all-reduces."""

    holders: tuple[Holder, ...]
    params: float


@functools.lru_cache(maxsize=1024)
def _shard_pieces(degrees: tuple[int, ...]) -> tuple[tuple[float, tuple[int, ...]], ...]:
    """[0, 1) cut at every shard boundary j / t of these tensor-parallel degrees: each piece's
    width and the shard of each degree that holds it."""
    unit = math.lcm(*degrees)  # a piece is whole units of 1/unit
    cuts = sorted({j * (unit // t) for t in degrees for j in range(t)} | {unit})
    return tuple(((high - low) / unit, tuple(low * t // unit for t in degrees)) for low, high in zip(cuts, cuts[1:]))


def cell_groups(costs: CostModel, layouts: Sequence[TemplateLayout]) -> list[CellGroup]:
    """The reduction's groups (holders in template order), from the templates' layouts."""
    model = costs.model
    return _cell_groups(model.layer_params(), model.embedding_params(), model.output_params(),
                        model.vocab_size * model.hidden_size, model.untie_embeddings_and_output_weights,
                        tuple(layouts))


@functools.lru_cache(maxsize=256)
def _cell_groups(layer_params: float, embedding_params: float, output_params: float, table: float, untied: bool,
                 layouts: tuple[TemplateLayout, ...]) -> list[CellGroup]:
    num_layers = sum(layouts[0].layers)
    starts = [[sum(t.layers[:s]) for s in range(len(t.layers))] for t in layouts]
    cuts = sorted({c for first in starts for c in first} | {num_layers})
    found: dict[tuple[Holder, ...], float] = {}

    def add(stages: Sequence[int], params: float, tie_last: bool = False) -> None:
        """params spread over the shards of template k's stage stages[k] (and, for the tied
        table, also of its last stage)."""
        places = [(k, s) for k, s in enumerate(stages)]
        if tie_last:
            places += [(k, len(t.layers) - 1) for k, t in enumerate(layouts) if len(t.layers) > 1]
        for width, shards in _shard_pieces(tuple(layouts[k].tensor_parallel[s] for k, s in places)):
            holders = tuple(sorted({(k, s, t) for (k, s), t in zip(places, shards)}))
            found[holders] = found.get(holders, 0.0) + params * width

    for low, high in zip(cuts, cuts[1:]):
        stages = [max(s for s, first in enumerate(firsts) if first <= low) for firsts in starts]
        add(stages, (high - low) * layer_params)
    last_stages = [len(t.layers) - 1 for t in layouts]
    add([0] * len(layouts), embedding_params - table)  # position embeddings: first stages
    add(last_stages, output_params - table)  # the final norm: last stages
    if untied:
        add([0] * len(layouts), table)
        add(last_stages, table)
    else:
        add([0] * len(layouts), table, tie_last=True)
    return [CellGroup(holders, params) for holders, params in found.items() if params > 0]


def cross_template_reduction(costs: CostModel, layouts: Sequence[TemplateLayout],
                             hosts_of: Callable[[Holder], Sequence[str]],
                             last_backward: Mapping[tuple[int, int], float] | None = None
                             ) -> dict[tuple[int, int], float]:
    """Exposed seconds each (template, stage) spends reducing its gradients after its
    pipeline: its busiest tensor rank's cell all-reduces, one after the other, plus
    (distributed optimizer) its parameters' all-gather within the template's replicas.

    hosts_of(holder): the host of each of the template's replicas' ranks at that place,
    in replica order (the predictor: the plan's; the fast estimate: representative ones).
    last_backward[k, s]: the last micro-batch's backward of template k's stage s, which an
    overlapped reduction hides behind (none: nothing hides)."""
    groups = cell_groups(costs, layouts)
    setup, cluster = costs.setup, costs.cluster
    places = {holder: tuple(hosts_of(holder)) for g in groups for holder in g.holders}
    members = {g: tuple(h for holder in g.holders for h in places[holder]) for g in groups}
    spanning = sum(1 for g in groups if len({cluster.node(h).group for h in set(members[g])}) > 1)
    chain: dict[Holder, int] = {}
    for g in groups:
        for holder in g.holders:
            chain[holder] = chain.get(holder, 0) + 1
    # Groups of different ranks run at once; a rank's own share its links, so a link carries
    # them one after the other.
    crossings = max(1, math.ceil(spanning / max(chain.values())))
    busy: dict[Holder, float] = {}  # a rank's groups' bytes, one group's after the other's
    waits: dict[Holder, float] = {}  # the longest of its groups' fixed terms (they overlap)
    held: dict[Holder, float] = {}  # parameters a rank reduces, over all its groups
    widest: dict[Holder, int] = {}  # its largest group's ranks (megatron-core's bucket size)
    for g in groups:
        per_byte, fixed = costs.allreduce_terms(members[g], crossings)
        if not per_byte:
            continue
        for holder in g.holders:
            busy[holder] = busy.get(holder, 0.0) + 2 * g.params * setup.grad_bytes * per_byte
            waits[holder] = max(waits.get(holder, 0.0), 2 * fixed)
            held[holder] = held.get(holder, 0.0) + g.params
            widest[holder] = max(widest.get(holder, 0), len(members[g]))
    reduce: dict[tuple[int, int], float] = {}
    for holder, seconds in busy.items():
        k, s, _ = holder
        seconds += waits[holder]
        hidden_behind = last_backward.get((k, s), 0.0) if last_backward else 0.0
        seconds = overlapped_reduce_s(setup, seconds, held[holder], widest[holder], hidden_behind)
        if setup.distributed_optimizer:
            seconds += _parameter_gather_s(costs, layouts, holder, places[holder])
        reduce[k, s] = max(reduce.get((k, s), 0.0), seconds)
    return reduce


def _parameter_gather_s(costs: CostModel, layouts: Sequence[TemplateLayout], holder: Holder,
                        hosts: Sequence[str]) -> float:
    """One rank's exposed all-gather of its updated parameters over its template's replicas."""
    k, s, _ = holder
    layout = layouts[k]
    stages = len(layout.layers)
    params = stage_params(costs, layout.layers[s], s == 0, s == stages - 1, stages) / layout.tensor_parallel[s]
    if len(hosts) <= 1 or params == 0:
        return 0.0
    gather = costs.group_allreduce(list(hosts), params * costs.setup.value_bytes, phases=1)
    return overlapped_gather_s(costs.setup, gather, params, len(hosts))


def template_layouts(templates) -> list[TemplateLayout]:
    """The layouts of a plan's templates (hetero.plan_entries.TemplateEntry)."""
    return [TemplateLayout(tuple(stage.num_layers for stage in t.stages), tuple(t.stage_tensor_parallel))
            for t in templates]
