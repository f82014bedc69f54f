"""Gradients under a plan of several replica templates: every element of every parameter
summed over every rank that holds it, whatever the template.

Under one template megatron-core's data-parallel reduction works because every replica of a
stage holds the same parameters in the same layout. Templates break that: layer 5 may sit on
stage 1 (beside layers 4-7, tensor-parallel 2) in one template and on stage 0 (beside layers
0-9, whole) in another. The reduction here is laid out over the *global* tensors instead:

1. Each rank lists what it holds of each parameter by its global name (layers by their
   global index, weights.global_parameter_names; a tied output layer is the embedding table)
   as runs along the tensor-parallel partition dimension (megatron-core's sharding: with
   stride s, rank r of t holds pieces r, r+t, ... of size shard/s; a parameter that is not
   sharded is one run of its first dimension).
2. The lists are exchanged once. Each global tensor is cut at every run boundary of every
   holder - the union of all templates' stage boundaries (which layers) and shard boundaries
   (which rows) - into *cells*; a cell's holders are the ranks whose runs cover it. Cells
   with the same holders form one *group*: one process group, one flat buffer, one all-reduce
   per iteration. With one degree everywhere a group is the data-parallel group of one tensor
   rank stretched over every template's replicas; where degrees differ, a rank of the
   narrower template belongs to one group per shard of the wider (the re-sharding).
3. Each element is summed exactly once per replica: a rank contributes its gradient where
   megatron-core's own reduction would count it - tensor-parallel shards, and partial sums
   (sequence-parallel norms, qk-layernorm) from every tensor rank - and zeros where it holds a
   tensor-parallel duplicate (a norm weight without sequence parallelism), whose value its
   tensor rank 0 gives. Tied embeddings need no rule of their own: the first stage's table and
   the last stage's output layer are two holders of one global tensor.

This replaces megatron-core's finish_grad_sync, its tensor-parallel all-reduce of norm
gradients and its embedding all-reduce (``finalize``); every holder ends with the same bits,
so each template's optimizer (megatron-core's, sharded over the template's own replicas)
makes the same update and the templates' copies stay identical (``check_weights_agree``).
Groups are issued in one global order on every rank, so no two ranks wait on each other in
opposite orders. The reduction runs after the last micro-batch's backward, not overlapped.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hetero.errors import HeteroError
from hetero.plan import Plan
from megatron.hetero.identity import this_rank
from megatron.hetero.weights import global_parameter_names


@dataclass(frozen=True)
class Run:
    """Rows [start, start + length) of global tensor ``name``'s partition dimension, held at
    offset ``local`` of a parameter's own partition dimension."""

    name: str
    start: int
    length: int
    local: int


@dataclass
class Held:
    """One parameter of this rank and what it holds of its global tensor."""

    name: str
    param: torch.nn.Parameter
    dim: int
    runs: list[Run]
    contributes: bool


@dataclass(frozen=True)
class Cell:
    """Rows [start, stop) of global tensor ``name``, held alike by one set of ranks."""

    name: str
    start: int
    stop: int


@dataclass
class Group:
    """One set of holders: its process group and this rank's views into its cells."""

    ranks: tuple[int, ...]
    cells: list[Cell]
    handle: dist.ProcessGroup | None = None
    views: list[tuple[Held, int, int]] | None = None  # (parameter, local start, length) per cell


def _is_partial(name: str, param: torch.nn.Parameter, sequence_parallel: bool, qk_layernorm: bool) -> bool:
    """megatron-core's rule (finalize_model_grads._allreduce_non_tensor_model_parallel_grads):
    these gradients are partial sums over the tensor-parallel ranks."""
    return (sequence_parallel and getattr(param, "sequence_parallel", False)) or (
        qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))


def _layer_of(name: str) -> float:
    """Where a global tensor sits in the model: its decoder layer; the embedding before the
    first, the final norm and output layer after the last."""
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2])
    return -1 if name.startswith("embedding.") else float("inf")


def _issue_order(group: Group) -> tuple:
    return (-max(_layer_of(cell.name) for cell in group.cells), group.ranks)


def held_parameters(model_chunks: list, tp_rank: int, tp_size: int, sequence_parallel: bool,
                    qk_layernorm: bool) -> list[Held]:
    """What this rank holds of each global tensor (module docstring, 1)."""
    from megatron.core.utils import get_attr_wrapped_model

    held: list[Held] = []
    seen: set[int] = set()
    for chunk in model_chunks:
        module = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
        tied = getattr(module, "share_embeddings_and_output_weights", False)
        for name, param in global_parameter_names(module):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            if getattr(param, "average_gradients_across_tp_domain", False) or not getattr(param, "allreduce", True):
                raise HeteroError(f"{name}: parameters averaged over tensor ranks or expert parameters are not "
                                  "supported with several replica templates; use one template")
            if name == "output_layer.weight" and tied:
                name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied table
            sharded = getattr(param, "tensor_model_parallel", False)
            dim = param.partition_dim if sharded else 0
            if param.dim() == 0:
                raise HeteroError(f"{name}: a scalar parameter cannot be split into cells")
            if sharded:
                stride = getattr(param, "partition_stride", 1)
                piece = param.shape[dim] // stride
                runs = [Run(name, (tp_rank + j * tp_size) * piece, piece, j * piece) for j in range(stride)]
            else:
                runs = [Run(name, 0, param.shape[dim], 0)]
            contributes = sharded or tp_rank == 0 or _is_partial(name, param, sequence_parallel, qk_layernorm)
            held.append(Held(name, param, dim, runs, contributes))
    return held


def plan_groups(tables: list[list[tuple[str, int, int]]]) -> list[Group]:
    """Cells and groups from every rank's runs (``tables[rank]``: (name, start, length)),
    in one order every rank computes alike (module docstring, 2)."""
    holders: dict[str, list[tuple[int, int, int]]] = {}
    for rank, runs in enumerate(tables):
        for name, start, length in runs:
            holders.setdefault(name, []).append((rank, start, start + length))
    groups: dict[tuple[int, ...], list[Cell]] = {}
    for name in sorted(holders):
        runs = holders[name]
        bounds = sorted({b for _, start, stop in runs for b in (start, stop)})
        for start, stop in zip(bounds, bounds[1:]):
            ranks = tuple(sorted({rank for rank, lo, hi in runs if lo <= start and stop <= hi}))
            if ranks:
                groups.setdefault(ranks, []).append(Cell(name, start, stop))
    return [Group(ranks, cells) for ranks, cells in sorted(groups.items())]


class TemplateReduction:
    """The groups of one plan's templates and this rank's part in them."""

    def __init__(self, plan: Plan, model_chunks: list, sequence_parallel: bool, qk_layernorm: bool,
                 timeout: timedelta) -> None:
        rank = dist.get_rank()
        me = plan.grid.coords(rank)
        tp_size = plan.grid.stage_tensor_parallel(me.template)[me.pp_rank]
        self.held = held_parameters(model_chunks, me.tp_rank, tp_size, sequence_parallel, qk_layernorm)
        mine = [(run.name, run.start, run.length) for h in self.held for run in h.runs]
        tables: list = [None] * dist.get_world_size()
        dist.all_gather_object(tables, mine)
        self.groups = plan_groups(tables)
        by_name: dict[str, list[tuple[Held, Run]]] = {}
        for h in self.held:
            for run in h.runs:
                by_name.setdefault(run.name, []).append((h, run))
        for group in self.groups:
            # every rank creates every group, in the same order
            group.handle = dist.new_group(list(group.ranks), timeout=timeout)
            if rank in group.ranks:
                group.views = [self._view(by_name[cell.name], cell) for cell in group.cells]
        # Issued in one order on every rank, the latest layers first (the order the backward
        # finishes them): no two ranks wait on each other's groups in opposite orders.
        self.mine = sorted((g for g in self.groups if g.views is not None), key=_issue_order)
        self.groups_of: dict[int, list[int]] = {}  # id(parameter) -> indices in self.mine
        for index, group in enumerate(self.mine):
            for held in {id(h.param): h for h, _, _ in group.views}.values():
                self.groups_of.setdefault(id(held.param), []).append(index)
        self._accumulators: list = []  # the autograd nodes our hooks hang on (kept alive)
        self.begin_iteration(None)

    def overlap_with_backward(self) -> None:
        """Starts each group's all-reduce as soon as its cells' gradients are final (their
        parameter's gradient accumulated for the replica's last micro-batch), as megatron-core's
        --overlap-grad-reduce starts a bucket's. The hook runs after DDP's, which adds the
        micro-batch's gradient into main_grad."""
        for held in self.held:
            accumulator = held.param.expand_as(held.param).grad_fn.next_functions[0][0]
            accumulator.register_hook(self._accumulated(held.param))
            self._accumulators.append(accumulator)

    def begin_iteration(self, micro_batches: int | None) -> None:
        """A new iteration of ``micro_batches`` micro-batches (None: no overlap, every group
        issued by ``reduce``)."""
        self.expected = micro_batches
        self.accumulated: dict[int, int] = {}
        self.waiting = [len({id(h.param) for h, _, _ in g.views}) for g in self.mine]
        self.issued: list[tuple[Group, torch.Tensor, object]] = []

    def _accumulated(self, param: torch.nn.Parameter):
        key = id(param)

        def hook(*unused):
            if self.expected is None:
                return
            count = self.accumulated.get(key, 0) + 1
            self.accumulated[key] = count
            if count == self.expected:  # this micro-batch was the replica's last
                for index in self.groups_of.get(key, ()):
                    self.waiting[index] -= 1
                self._issue(until_waiting=True)

        return hook

    def _issue(self, until_waiting: bool) -> None:
        """Issues groups in order: the next while nothing of it is waiting (or every one)."""
        while len(self.issued) < len(self.mine):
            index = len(self.issued)
            if until_waiting and self.waiting[index] > 0:
                return
            group = self.mine[index]
            parts = []
            for held, local, length in group.views:
                grad = self._grad(held).narrow(held.dim, local, length)
                parts.append(grad.reshape(-1) if held.contributes else torch.zeros_like(grad).reshape(-1))
            buffer = torch.cat(parts)
            self.issued.append((group, buffer, dist.all_reduce(buffer, group=group.handle, async_op=True)))

    def describe(self) -> str:
        """One line for the start-up log."""
        largest = max(len(g.ranks) for g in self.groups)
        return (f"> replica templates' gradient reduction: {len(self.groups)} groups of holders (up to {largest} "
                f"ranks), this rank in {len(self.mine)}, {sum(self._size(g) for g in self.mine):,} elements")

    def _size(self, group: Group) -> int:
        return sum(self._grad(held).narrow(held.dim, local, length).numel() for held, local, length in group.views)

    @staticmethod
    def _view(runs: list[tuple[Held, Run]], cell: Cell) -> tuple[Held, int, int]:
        for held, run in runs:
            if run.start <= cell.start and cell.stop <= run.start + run.length:
                return held, run.local + cell.start - run.start, cell.stop - cell.start
        raise AssertionError(f"rank holds no run of {cell}")

    @staticmethod
    def _grad(held: Held) -> torch.Tensor:
        grad = getattr(held.param, "main_grad", None)
        return grad if grad is not None else held.param.grad

    def reduce(self) -> None:
        """Sums every cell's gradient over its holders (one all-reduce per group): issues the
        groups the backward did not, waits for all, puts the sums back."""
        overlapped = len(self.issued)
        self._issue(until_waiting=False)
        if self._accumulators and not getattr(self, "_said", False) and dist.get_rank() == 0:
            self._said = True  # once: how much of the reduction the backward hid
            print(f"> replica templates' gradient reduction: {overlapped} of this rank's {len(self.mine)} "
                  "groups started during the backward", flush=True)
        for group, buffer, work in self.issued:
            work.wait()
            offset = 0
            for held, local, length in group.views:
                grad = self._grad(held).narrow(held.dim, local, length)
                grad.copy_(buffer[offset:offset + grad.numel()].view(grad.shape))
                offset += grad.numel()
        self.begin_iteration(None)

    def check_weights_agree(self) -> str | None:
        """Whether every holder of every cell holds the same weights (None), else which cell
        differs: a hash of each group's cells compared across its holders."""
        for group in self.mine:
            digest = hashlib.sha256()
            for held, local, length in group.views:
                values = held.param.detach().narrow(held.dim, local, length).float().cpu().contiguous()
                digest.update(values.numpy().tobytes())
            local_hash = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8).to(this_rank().device)
            hashes = [torch.empty_like(local_hash) for _ in group.ranks]
            dist.all_gather(hashes, local_hash, group=group.handle)
            differing = [r for r, h in zip(group.ranks, hashes) if not torch.equal(h, hashes[0])]
            if differing:
                return (f"ranks {list(group.ranks)} hold {group.cells[0].name} (and {len(group.cells) - 1} more "
                        f"cells), but rank(s) {differing} hold other values than rank {group.ranks[0]}")
        return None


_reduction: TemplateReduction | None = None
_plan: Plan | None = None
_timeout = timedelta(minutes=10)
_last_stages: dist.ProcessGroup | None = None


def use_plan(plan: Plan | None, timeout: timedelta) -> None:
    """Start-up, on every rank after the process groups: a plan of several templates (None:
    one, megatron-core's reduction), and the group of every template's last stage."""
    global _plan, _timeout, _reduction, _last_stages
    _plan, _timeout, _reduction, _last_stages = plan, timeout, None, None
    if plan is not None:
        grid = plan.grid
        last = [r for r in range(grid.world_size)
                if grid.coords(r).pp_rank == grid.templates[grid.coords(r).template].pipeline_parallel - 1]
        _last_stages = dist.new_group(last, timeout=timeout)


def active() -> bool:
    return _plan is not None


def forget() -> None:
    """Drops the plan and its groups (in-process restart tears them down)."""
    global _plan, _reduction, _last_stages
    _plan, _reduction, _last_stages = None, None, None


def install(model_chunks: list, sequence_parallel: bool, qk_layernorm: bool, overlap: bool) -> None:
    """After the model is built and wrapped (its gradient buffers exist): the groups; with
    ``overlap`` (--overlap-grad-reduce) their all-reduces start during the backward."""
    global _reduction
    if _plan is not None:
        _reduction = TemplateReduction(_plan, model_chunks, sequence_parallel, qk_layernorm, _timeout)
        if overlap:
            _reduction.overlap_with_backward()
        if dist.get_rank() == 0:
            print(_reduction.describe(), flush=True)


def begin_iteration(micro_batches: int) -> None:
    """Before an iteration's forward-backward: how many micro-batches this replica runs (each
    parameter's gradient is final after that many accumulations)."""
    if _reduction is not None and _reduction._accumulators:
        _reduction.begin_iteration(micro_batches)


def reduction() -> TemplateReduction:
    assert _reduction is not None, "install() first"
    return _reduction


def finalize_model_grads(model: list, num_tokens: torch.Tensor | None = None, *args, **kwargs) -> None:
    """megatron-core's finalize_model_grads for a plan of several templates: the cell
    reduction (module docstring), then the per-token scaling by the tokens of every replica
    of every template (each replica's count is known on its last stage; tensor rank 0 gives it)."""
    _reduction.reduce()
    if num_tokens is not None:
        me = _plan.grid.coords(dist.get_rank())
        last = _plan.grid.templates[me.template].pipeline_parallel - 1
        total = num_tokens.detach().clone() if (me.pp_rank == last and me.tp_rank == 0) else torch.zeros_like(num_tokens)
        dist.all_reduce(total)
        num_tokens.copy_(total)
        if total > 0:
            for chunk in model:
                chunk.scale_gradients(1.0 / total)


def agreed_across_templates(statistic):
    """A gradient statistic (megatron-core's get_grad_norm_fp32, count_zeros_fp32) computed by
    each template over its own ranks, then template 0's value given to every rank, so that
    every template clips and reports alike. Every rank steps its optimizer, so every rank
    joins the broadcast."""

    @functools.wraps(statistic)
    def agreed(*args, **kwargs):
        value = statistic(*args, **kwargs)
        if _plan is None:
            return value
        shared = torch.tensor([float(value)], dtype=torch.float64, device=this_rank().device)
        dist.broadcast(shared, src=0)  # logical rank 0 is template 0's
        return type(value)(shared.item()) if isinstance(value, (int, float)) else shared.item()

    return agreed


def sum_over_last_stages(totals: torch.Tensor) -> torch.Tensor:
    """A last stage's loss sums, summed over every template's replicas (tensor rank 0 of each
    last stage gives its replica's); called by every last-stage rank."""
    me = _plan.grid.coords(dist.get_rank())
    contribution = totals if me.tp_rank == 0 else torch.zeros_like(totals)
    dist.all_reduce(contribution, group=_last_stages)
    return contribution
