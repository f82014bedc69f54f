"""The rank grid: which logical rank plays which part of a plan, the one place that knows.

A plan's logical ranks (the ranks of the default process group) form one grid per replica
template: template ``k`` holds ``data_parallel_k`` replicas of a pipeline of its own shape
(a tensor-parallel degree per stage), with ``context_parallel`` ranks per tensor rank. The
templates' ranks follow one another; inside a template the ranks are numbered in an order
string, as megatron-core's ``RankGenerator`` numbers them: ``"tp-cp-dp-pp"`` (megatron-core's
default "tp-cp-ep-dp-pp", whose expert axis lives in its own grid) means tensor rank fastest,
then context, then data, then pipeline. A stage's tensor-parallel degree may differ from its
neighbours' (tp runs inside pp in every order Megatron knows, so its range can depend on the
stage). Every group (tensor, data, pipeline, model-parallel, ...) comes from one routine,
``Grid.groups(token)``: the ranks of one template that agree on every coordinate the token
does not name. Megatron-LM's ``--use-tp-pp-dp-mapping`` is the same grid enumerated in
another order (``Grid.positions``).

The expert grid of a stage (megatron-core's order: expert tensor fastest, then expert model,
then expert data) is laid over the stage's ranks in the same way (``expert_rank_at``).

Everything here is pure arithmetic over shapes: the plan (hetero/plan.py) builds its grid
from its templates; the planner's placement builds one before a plan exists; the runtime's
process groups, stage-to-stage transfers and gradient reductions ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Sequence

DEFAULT_ORDER = "tp-cp-dp-pp"
"""Megatron-core's default rank order (tensor fastest, then context, data, pipeline)."""
TP_PP_DP_ORDER = "tp-cp-pp-dp"
"""Megatron-LM's --use-tp-pp-dp-mapping: pipeline inside data."""
_AXES = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class TemplateShape:
    """One replica template's shape: a tensor-parallel degree per pipeline stage, and how
    many replicas of it the plan runs."""

    stage_tensor_parallel: tuple[int, ...]
    data_parallel: int

    @property
    def pipeline_parallel(self) -> int:
        return len(self.stage_tensor_parallel)


@dataclass(frozen=True)
class RankCoords:
    """Where one logical rank sits: tensor rank, replica (``dp_rank``, counted over every
    template's replicas), pipeline stage (within its template), context rank, its template,
    and its data-parallel rank within the template (megatron-core's data-parallel rank)."""

    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0
    template: int = 0
    template_dp_rank: int | None = None

    @property
    def local_dp_rank(self) -> int:
        """The data-parallel rank megatron-core sees (within the template)."""
        return self.dp_rank if self.template_dp_rank is None else self.template_dp_rank


def _check_order(order: str) -> list[str]:
    axes = order.split("-")
    if sorted(axes) != sorted(_AXES) or axes[0] != "tp":
        raise ValueError(f"rank order {order!r}: give each of {', '.join(_AXES)} once, tp first "
                         "(a stage's tensor-parallel degree depends on the stage)")
    return axes


class Grid:
    """The logical ranks of one plan's templates (module docstring)."""

    def __init__(self, templates: Sequence[TemplateShape], context_parallel: int = 1,
                 expert_parallel: int = 1, expert_tensor_parallel: int | None = None) -> None:
        if not templates:
            raise ValueError("a grid needs at least one template")
        self.templates = tuple(templates)
        self.context_parallel = context_parallel
        self.expert_parallel = expert_parallel
        self.expert_tensor_parallel = expert_tensor_parallel
        self.template_offsets: list[int] = []   # first logical rank of each template
        self.replica_offsets: list[int] = []    # first (global) replica of each template
        coords: list[RankCoords] = []
        replicas = 0
        for index in range(len(self.templates)):
            self.template_offsets.append(len(coords))
            self.replica_offsets.append(replicas)
            coords.extend(self._walk(index, DEFAULT_ORDER))
            replicas += self.templates[index].data_parallel
        self.template_offsets.append(len(coords))
        self.replica_offsets.append(replicas)
        self._coords = coords
        self._rank = {c: r for r, c in enumerate(coords)}

    @classmethod
    def single(cls, stage_tensor_parallel: int | Sequence[int], data_parallel: int, pipeline_parallel: int = 1,
               context_parallel: int = 1) -> "Grid":
        """One template: a degree for every stage (int: the same for ``pipeline_parallel``)."""
        degrees = ((stage_tensor_parallel,) * pipeline_parallel if isinstance(stage_tensor_parallel, int)
                   else tuple(stage_tensor_parallel))
        return cls([TemplateShape(degrees, data_parallel)], context_parallel)

    # ----- enumeration --------------------------------------------------------------

    def _walk(self, template: int, order: str) -> Iterator[RankCoords]:
        """The coordinates of template's ranks in the order given (its first axis fastest)."""
        shape = self.templates[template]
        axes = _check_order(order)[::-1]  # slowest first
        first_replica = sum(t.data_parallel for t in self.templates[:template])

        def size(axis: str, at: dict) -> int:
            if axis == "tp":
                return shape.stage_tensor_parallel[at["pp"]]
            return {"cp": self.context_parallel, "dp": shape.data_parallel, "pp": shape.pipeline_parallel}[axis]

        def walk(depth: int, at: dict) -> Iterator[RankCoords]:
            if depth == len(axes):
                yield RankCoords(tp_rank=at["tp"], dp_rank=first_replica + at["dp"], pp_rank=at["pp"],
                                 cp_rank=at["cp"], template=template,
                                 template_dp_rank=at["dp"] if len(self.templates) > 1 else None)
                return
            axis = axes[depth]
            for value in range(size(axis, at)):
                yield from walk(depth + 1, {**at, axis: value})

        return walk(0, {})

    def positions(self, order: str) -> list[int]:
        """For each logical rank, its place when every template's ranks are enumerated in
        ``order`` instead (templates one after another): Megatron-LM's rank of that role
        under the order's mapping (``TP_PP_DP_ORDER``: --use-tp-pp-dp-mapping)."""
        place = [0] * self.world_size
        for template in range(len(self.templates)):
            start = self.template_offsets[template]
            for index, coords in enumerate(self._walk(template, order)):
                place[self._rank[coords]] = start + index
        return place

    # ----- sizes --------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self._coords)

    @property
    def num_templates(self) -> int:
        return len(self.templates)

    @property
    def data_parallel(self) -> int:
        """Replicas over every template."""
        return self.replica_offsets[-1]

    def template_of_replica(self, dp_rank: int) -> int:
        if not 0 <= dp_rank < self.data_parallel:
            raise ValueError(f"replica {dp_rank} is outside 0..{self.data_parallel - 1}")
        return next(k for k in range(self.num_templates) if dp_rank < self.replica_offsets[k + 1])

    def template_ranks(self, template: int) -> range:
        """The logical ranks of one template (consecutive)."""
        return range(self.template_offsets[template], self.template_offsets[template + 1])

    def stage_tensor_parallel(self, template: int = 0) -> tuple[int, ...]:
        return self.templates[template].stage_tensor_parallel

    # ----- one rank -----------------------------------------------------------------

    def coords(self, logical_rank: int) -> RankCoords:
        if not 0 <= logical_rank < self.world_size:
            raise ValueError(f"logical rank {logical_rank} is outside 0..{self.world_size - 1}")
        return self._coords[logical_rank]

    def rank_at(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """The logical rank of tensor rank tp_rank, context rank cp_rank of replica dp_rank
        (counted over every template) in its template's stage pp_rank."""
        template = self.template_of_replica(dp_rank)
        degrees = self.templates[template].stage_tensor_parallel
        if not (0 <= pp_rank < len(degrees) and 0 <= tp_rank < degrees[pp_rank]
                and 0 <= cp_rank < self.context_parallel):
            raise ValueError(f"replica {dp_rank}'s pipeline has stages 0..{len(degrees) - 1} of tensor-parallel "
                             f"degrees {list(degrees)} and context ranks 0..{self.context_parallel - 1}; asked for "
                             f"tensor rank {tp_rank}, context rank {cp_rank} of stage {pp_rank}")
        local = dp_rank - self.replica_offsets[template]
        return self._rank[RankCoords(tp_rank, dp_rank, pp_rank, cp_rank, template,
                                     local if self.num_templates > 1 else None)]

    def stage_offset(self, pp_rank: int, template: int = 0) -> int:
        """The first logical rank of a template's stage (its ranks are consecutive)."""
        shape = self.templates[template]
        return (self.template_offsets[template]
                + shape.data_parallel * self.context_parallel * sum(shape.stage_tensor_parallel[:pp_rank]))

    # ----- groups: one routine ------------------------------------------------------

    def groups(self, token: str, template: int | None = None) -> list[list[int]]:
        """Every group of one kind, as megatron-core's RankGenerator.get_ranks(token) lists
        them (``token``: axes joined by "-", e.g. "tp", "dp-cp", "tp-pp"; "ep", the dense
        grid's expert axis, has size 1 there, as in megatron-core's decoder grid): in each template
        (or the one given), the ranks that agree on every coordinate the token leaves out,
        in logical order. A group along the pipeline without the tensor axis joins tensor
        rank ``t mod tp_s`` of each stage s (a rank of a narrower stage then lies in several
        groups: one per tensor rank of the widest stage)."""
        axes = set(token.split("-")) - {"ep"}
        unknown = axes - set(_AXES)
        if unknown:
            raise ValueError(f"unknown parallelism {sorted(unknown)} in {token!r}")
        chosen = range(self.num_templates) if template is None else [template]
        found: list[list[int]] = []
        for k in chosen:
            found.extend(self._template_groups(k, axes))
        return found

    def _template_groups(self, template: int, axes: set[str]) -> list[list[int]]:
        degrees = self.templates[template].stage_tensor_parallel
        ranks = self.template_ranks(template)

        def key(c: RankCoords, tensor: int | None) -> tuple:
            return (None if "pp" in axes else c.pp_rank, None if "dp" in axes else c.dp_rank,
                    None if "cp" in axes else c.cp_rank, tensor)

        groups: dict[tuple, list[int]] = {}
        if "pp" in axes and "tp" not in axes and len(set(degrees)) > 1:
            for tensor in range(max(degrees)):
                for rank in ranks:
                    c = self._coords[rank]
                    if c.tp_rank == tensor % degrees[c.pp_rank]:
                        groups.setdefault(key(c, tensor), []).append(rank)
            return list(groups.values())
        for rank in ranks:
            c = self._coords[rank]
            groups.setdefault(key(c, None if "tp" in axes else c.tp_rank), []).append(rank)
        return list(groups.values())

    def group_of(self, logical_rank: int, token: str) -> list[int]:
        """This rank's group of a kind: the first listed that holds it (under a per-stage
        grid a narrower stage's rank thus keeps the pipeline group of its own tensor rank)."""
        template = self.coords(logical_rank).template
        return next(g for g in self.groups(token, template) if logical_rank in g)

    def tensor_group(self, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> list[int]:
        """One (replica, stage, context rank)'s tensor-parallel group."""
        degree = self.templates[self.template_of_replica(dp_rank)].stage_tensor_parallel[pp_rank]
        return [self.rank_at(t, dp_rank, pp_rank, cp_rank) for t in range(degree)]

    def context_group(self, tp_rank: int, dp_rank: int, pp_rank: int) -> list[int]:
        """The ranks that split one replica's sequences (context parallelism)."""
        return [self.rank_at(tp_rank, dp_rank, pp_rank, c) for c in range(self.context_parallel)]

    def data_group(self, tp_rank: int, pp_rank: int, cp_rank: int = 0, template: int = 0) -> list[int]:
        """A template's ranks holding the same weights and sequence chunks: one per replica."""
        first, count = self.replica_offsets[template], self.templates[template].data_parallel
        return [self.rank_at(tp_rank, d, pp_rank, cp_rank) for d in range(first, first + count)]

    def pipeline_group(self, tp_rank: int, dp_rank: int, cp_rank: int = 0) -> list[int]:
        """One replica's pipeline, stage by stage: tensor rank ``tp_rank mod tp_s`` of each."""
        degrees = self.templates[self.template_of_replica(dp_rank)].stage_tensor_parallel
        return [self.rank_at(tp_rank % tp, dp_rank, s, cp_rank) for s, tp in enumerate(degrees)]

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """Every logical rank of one replica."""
        template = self.templates[self.template_of_replica(dp_rank)]
        return [r for s in range(template.pipeline_parallel) for c in range(self.context_parallel)
                for r in self.tensor_group(dp_rank, s, c)]

    # ----- the expert grid of a stage ---------------------------------------------------

    def stage_expert_tensor_parallel(self, pp_rank: int, template: int = 0) -> int:
        """A stage's expert tensor-parallel degree (default: the stage's degree)."""
        return self.expert_tensor_parallel or self.templates[template].stage_tensor_parallel[pp_rank]

    def stage_expert_data_parallel(self, pp_rank: int, template: int = 0) -> int:
        """How many copies of each expert shard a stage holds: its ranks over EP x ETP."""
        shape = self.templates[template]
        return (shape.stage_tensor_parallel[pp_rank] * self.context_parallel * shape.data_parallel
                // (self.expert_parallel * self.stage_expert_tensor_parallel(pp_rank, template)))

    def expert_rank_at(self, etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int, template: int = 0) -> int:
        """The logical rank at (expert tensor, expert model, expert data) ranks of a stage."""
        return self.stage_offset(pp_rank, template) + expert_local_rank(
            etp_rank, ep_rank, edp_rank, self.stage_expert_tensor_parallel(pp_rank, template), self.expert_parallel)

    def expert_groups(self, pp_rank: int, template: int = 0) -> list[list[int]]:
        """A stage's expert model-parallel groups: the ranks that share out the experts and
        exchange tokens in an all-to-all every micro-batch."""
        etp = self.stage_expert_tensor_parallel(pp_rank, template)
        return [[self.expert_rank_at(t, e, d, pp_rank, template) for e in range(self.expert_parallel)]
                for d in range(self.stage_expert_data_parallel(pp_rank, template)) for t in range(etp)]

    def expert_data_groups(self, pp_rank: int, template: int = 0) -> list[list[int]]:
        """A stage's expert data-parallel groups: the ranks holding the same expert shard."""
        etp = self.stage_expert_tensor_parallel(pp_rank, template)
        return [[self.expert_rank_at(t, e, d, pp_rank, template)
                 for d in range(self.stage_expert_data_parallel(pp_rank, template))]
                for e in range(self.expert_parallel) for t in range(etp)]

    def expert_tensor_groups(self, pp_rank: int, template: int = 0) -> list[list[int]]:
        """A stage's expert tensor-parallel groups: the ranks that split one expert."""
        etp = self.stage_expert_tensor_parallel(pp_rank, template)
        return [[self.expert_rank_at(t, e, d, pp_rank, template) for t in range(etp)]
                for d in range(self.stage_expert_data_parallel(pp_rank, template)) for e in range(self.expert_parallel)]

    @cached_property
    def expert_replica_blocks(self) -> list[list[int]]:
        """The replicas bound to run equal micro-batch counts: those whose ranks share an
        expert-parallel group (in any stage, transitively), as lists of replica indices."""
        block_of = list(range(self.data_parallel))

        def root(replica: int) -> int:
            while block_of[replica] != replica:
                replica = block_of[replica]
            return replica

        for template, shape in enumerate(self.templates):
            for pp_rank in range(shape.pipeline_parallel):
                for group in self.expert_groups(pp_rank, template):
                    replicas = [self.coords(rank).dp_rank for rank in group]
                    for replica in replicas[1:]:
                        block_of[root(replica)] = root(replicas[0])
        blocks: dict[int, list[int]] = {}
        for replica in range(self.data_parallel):
            blocks.setdefault(root(replica), []).append(replica)
        return list(blocks.values())


def expert_local_rank(etp_rank: int, ep_rank: int, edp_rank: int, expert_tensor_parallel: int,
                      expert_parallel: int) -> int:
    """megatron-core's expert order inside one stage (expert tensor fastest, then expert
    model, then expert data), counted from the stage's first logical rank."""
    return etp_rank + expert_tensor_parallel * (ep_rank + expert_parallel * edp_rank)
