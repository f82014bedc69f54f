"""A tensor-parallel degree per pipeline stage (plan version 3), at run time.

megatron-core assumes one grid, world = TP x DP x PP (x CP). Two things change when stages
differ in TP; megatron.hetero.patches installs both:

1. Process groups (patch parallel-state-groups-from-per-stage-grid). megatron-core builds
   every group from ``RankGenerator.get_ranks(token)`` ("tp", "dp", "pp", "tp-pp", ...);
   ``PlanRankGenerator`` answers from the plan's grid instead: stage s holds ``dp * tp_s``
   ranks, and a group of a token holds the ranks that agree on every coordinate not in the
   token. Pipeline groups are the exception: tensor rank t of replica d meets tensor rank
   ``t mod tp_s`` of each stage, so a rank of a narrower stage lies in several; it keeps
   the one of its own tensor rank (its stage index and the pipeline size are what
   megatron-core reads from it; transfers do not use it, see 2).
2. Stage-to-stage transfers (patch p2p-reshards-between-stage-degrees).
   ``ReshardingP2PCommunicator`` sends and receives each micro-batch's activation (and its
   gradient) by the plan: with sequence parallelism a stage of degree tp holds sequence
   slice t/tp on tensor rank t, so every receiving rank gets the overlap of its slice with
   each sending rank's; without it every rank of a stage holds the whole tensor and
   receiving rank u takes it from sending rank ``u mod tp_sender``. Every piece is a
   contiguous run of sequence rows, so it is sent from and received into views of the
   schedule's own tensors.
3. Tied input embedding and output layer across stages of different degrees. megatron-core
   sums the two copies' gradients element by element over a group pairing equal shards;
   with degrees (2, 1) shards do not pair, so that group is dropped and
   ``TiedEmbeddingGrads`` sums them by vocabulary row instead: every rank of the first and
   last stage puts the rows it holds into a whole-vocabulary tensor (zeros elsewhere), one
   all-reduce adds the two stages' values, and each rank takes its rows back. Every element
   has exactly two non-zero terms, so the sum is megatron-core's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetero.plan import Plan
from megatron.hetero.identity import this_rank

_plan: Plan | None = None
_sequence_parallel = False
_tied_embedding: "TiedEmbeddingGrads | None" = None


def use_plan_grid(plan: Plan | None, sequence_parallel: bool = False) -> None:
    """Installs (or, with None, removes) the plan's grid the patched classes follow (a
    degree per stage, or several templates side by side). A plan on megatron-core's own
    grid (Plan.megatron_grid) leaves that grid in place."""
    global _plan, _sequence_parallel
    _plan = plan if plan is not None and not plan.megatron_grid else None
    _sequence_parallel = sequence_parallel


def active_plan() -> Plan | None:
    return _plan


# ----- process groups ----------------------------------------------------------------


def rank_groups(plan: Plan, token: str) -> list[list[int]]:
    """megatron-core's group lists for one token ("tp", "dp-cp", "tp-pp", ...), from the plan's
    rank grid (hetero/grid.py; cp and ep are 1 here)."""
    return plan.grid.groups(token)


def expert_rank_groups(plan: Plan, token: str) -> list[list[int]]:
    """megatron-core's expert group lists for one token, from the plan's per-stage expert grids
    (Plan.expert_groups and its kin: each stage's ranks split into expert tensor x expert
    model x expert data blocks). Across the pipeline ("tp-ep-pp") a group joins the ranks
    of one expert data-parallel index of every stage, which needs every stage to hold as
    many copies of its experts (hetero.plan.expert_parallel_problems checks it)."""
    stages = range(plan.pipeline_parallel)
    if token == "ep":
        return [group for s in stages for group in plan.grid.expert_groups(s)]
    if token == "tp":
        return [group for s in stages for group in plan.grid.expert_tensor_groups(s)]
    if token == "dp":
        return [group for s in stages for group in plan.grid.expert_data_groups(s)]
    if token == "pp":
        return rank_groups(plan, "pp")

    def block(s: int, d: int) -> list[int]:  # stage s's expert model-parallel ranks of copy d
        return [plan.grid.expert_rank_at(t, e, d, s) for e in range(plan.expert_parallel)
                for t in range(plan.grid.stage_expert_tensor_parallel(s))]

    if token == "tp-ep":
        return [block(s, d) for s in stages for d in range(plan.grid.stage_expert_data_parallel(s))]
    if token == "tp-ep-pp":
        return [[rank for s in stages for rank in block(s, d)] for d in range(plan.grid.stage_expert_data_parallel(0))]
    raise ValueError(f"no expert group {token!r} is defined when stages differ in tensor-parallel degree")


def plan_rank_generator(original: type) -> type:
    """megatron-core's RankGenerator, answering from the installed plan's grid when one is
    (its expert generator, the one with expert parallelism, from the plan's expert grids)."""

    class PlanRankGenerator(original):
        def get_ranks(self, token):
            if _plan is None:
                return super().get_ranks(token)
            # megatron-core 0.17+ puts generalized TP's weight-sharding axis in every grid
            # ("tp-gtp_remat-pp", ...); a plan has none, so it is an axis of size 1.
            assert getattr(self, "gtp_remat", 1) == 1, "generalized tensor parallelism under a plan"
            axes = [axis for axis in token.split("-") if axis != "gtp_remat"]
            if not axes:
                return [[rank] for rank in range(dist.get_world_size())]
            token = "-".join(axes)
            if self.ep > 1:
                return expert_rank_groups(_plan, token)
            return rank_groups(_plan, token)

    PlanRankGenerator.__name__ = PlanRankGenerator.__qualname__ = "PlanRankGenerator"
    return PlanRankGenerator


def finish_plan_grid(timeout) -> None:
    """After initialize_model_parallel under the plan's grid, the groups megatron-core
    derives from one grid's arithmetic: a rank in several pipeline groups keeps the first,
    the one of its own tensor rank (megatron-core would hand out a list); the distributed
    optimizer's instance group (one instance per template: the template's ranks) is counted
    in whole grids and would be left unset. Tied embeddings: see the module docstring (3);
    under several templates their gradients are summed by the templates' reduction
    (template_reduction.py), so megatron-core's embedding groups are not used."""
    from megatron.core import parallel_state as ps

    if isinstance(ps._PIPELINE_GLOBAL_RANKS[0], list):
        ps._PIPELINE_MODEL_PARALLEL_GROUP = ps._PIPELINE_MODEL_PARALLEL_GROUP[0]
        ps._PIPELINE_GLOBAL_RANKS = ps._PIPELINE_GLOBAL_RANKS[0]
    grid, me = _plan.grid, _plan.grid.coords(dist.get_rank())
    if ps._INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP is None:
        for template in range(grid.num_templates):  # every rank creates every group
            group = dist.new_group(list(grid.template_ranks(template)), timeout=timeout)
            if template == me.template:
                ps._INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP = group
    virtual = _plan.templates[me.template].stages[0].virtual_stages
    if virtual:  # this template's interleaved schedule (megatron-core sets it only on its own grid)
        ps.set_virtual_pipeline_model_parallel_rank(0)
        ps.set_virtual_pipeline_model_parallel_world_size(len(virtual))
    global _tied_embedding
    _tied_embedding = None
    degrees = grid.stage_tensor_parallel(me.template)
    if grid.num_templates > 1:
        ps._EMBEDDING_GROUP = None
        ps._EMBEDDING_GLOBAL_RANKS = None
    elif len(degrees) > 1 and degrees[0] != degrees[-1]:
        # megatron-core's embedding groups pair first- and last-stage ranks of one tensor rank;
        # with unequal degrees they overlap and would pair unequal shards: none is used.
        ps._EMBEDDING_GROUP = None
        ps._EMBEDDING_GLOBAL_RANKS = None
        _tied_embedding = TiedEmbeddingGrads(_plan, timeout)


def finalize_model_grads_on_plan_grid(finalize, model, num_tokens=None, *args, **kwargs):
    """megatron-core's finalize_model_grads, with its per-token scaling's one pipeline-group
    collective (the last stage broadcasting the token count) taken over the replica's
    model-parallel group: pipeline groups overlap on a per-stage grid, so a broadcast on
    one would wait for a rank that is in another."""
    from megatron.core import parallel_state as ps

    result = finalize(model, None, *args, **kwargs)
    if _tied_embedding is not None:
        _tied_embedding.reduce(model)  # before the per-token scaling, as megatron-core's
    if num_tokens is not None:
        replica = _plan.grid.replica_ranks(_plan.grid.coords(dist.get_rank()).dp_rank)
        dist.broadcast(num_tokens, src=replica[-1], group=ps.get_model_parallel_group())
        dist.all_reduce(num_tokens, group=ps.get_data_parallel_group(with_context_parallel=True))
        if num_tokens > 0:
            for chunk in model:
                chunk.scale_gradients(1.0 / num_tokens)
    return result


class TiedEmbeddingGrads:
    """Sums the gradient of the tied word-embedding table over its two copies, the first
    stage's and the last stage's, each sharded by vocabulary rows over its own stage's
    tensor-parallel degree (module docstring, 3)."""

    def __init__(self, plan: Plan, timeout) -> None:
        last = plan.pipeline_parallel - 1
        self.plan = plan
        self.ranks = sorted(r for r in range(plan.world_size) if plan.grid.coords(r).pp_rank in (0, last))
        self.group = dist.new_group(self.ranks, timeout=timeout)  # every rank creates every group

    def reduce(self, model: list[torch.nn.Module]) -> None:
        rank = dist.get_rank()
        if rank not in self.ranks:
            return
        me = self.plan.grid.coords(rank)
        chunk = model[0] if me.pp_rank == 0 else model[-1]
        weight = _tied_weight(chunk, first_stage=me.pp_rank == 0)
        if weight is None:  # untied model: nothing shared
            return
        grad = weight.main_grad if hasattr(weight, "main_grad") else weight.grad
        if grad is None:  # a frozen embedding
            return
        rows, hidden = grad.shape
        tp = self.plan.stage_tensor_parallel[me.pp_rank]
        offset = me.tp_rank * rows * hidden  # megatron-core's vocabulary shards are contiguous
        whole = torch.zeros(rows * tp * hidden, dtype=grad.dtype, device=grad.device)
        start, stop = _reduced_range(chunk, weight, grad.numel(), me.dp_rank)
        flat = grad.view(-1)
        whole[offset + start:offset + stop] = flat[start:stop]
        dist.all_reduce(whole, group=self.group)
        flat.copy_(whole[offset:offset + flat.numel()])


TIED_TABLE_KEY = "embedding.word_embeddings.weight"


def tied_across_degrees() -> bool:
    """Whether the first and last stage of some template differ in degree (their tied table's
    copies too): the same answer on every rank, since it decides how every rank loads."""
    if _plan is None:
        return False
    return any(len(t.stage_tensor_parallel) > 1 and t.stage_tensor_parallel[0] != t.stage_tensor_parallel[-1]
               for t in _plan.templates)


def drop_tied_copy_for_save(state: dict) -> dict:
    """The state to save without the last stage's copy of a tied table whose stages differ in
    degree. megatron-core saves the copy as a replica of the first stage's table, and its
    save checks that every shard of one key has one shape, which two degrees cannot meet;
    the copy is equal to the table (same start, same summed gradients), and at load it is
    read from the table's key, re-sharded to its own degree."""
    if _plan is None:
        return state
    me = _plan.grid.coords(dist.get_rank())
    degrees = _plan.grid.stage_tensor_parallel(me.template)
    if degrees[0] == degrees[-1] or me.pp_rank != len(degrees) - 1:
        return state

    def keep(value) -> bool:
        return TIED_TABLE_KEY not in str(getattr(value, "key", ""))

    def walk(node):
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items() if keep(v)}
        if isinstance(node, list):
            return [walk(v) for v in node if keep(v)]
        return node

    return walk(state)


def _tied_weight(chunk: torch.nn.Module, first_stage: bool) -> torch.nn.Parameter | None:
    from megatron.core.utils import get_attr_wrapped_model

    module = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
    if not getattr(module, "share_embeddings_and_output_weights", False):
        return None
    return module.embedding.word_embeddings.weight if first_stage else module.output_layer.weight


def _reduced_range(chunk: torch.nn.Module, weight: torch.nn.Parameter, numel: int, dp_rank: int) -> tuple[int, int]:
    """The elements of this rank's gradient that hold the sum over data-parallel replicas
    (each element of the stage counted by exactly one rank): with the distributed optimizer
    the part of the weight's own bucket this rank reduce-scattered (megatron-core gives a
    shared embedding a bucket of its own); otherwise all of it, on replica 0 only."""
    for bucket_group in getattr(chunk, "bucket_groups", []):
        if not bucket_group.ddp_config.use_distributed_optimizer:
            break
        for bucket in bucket_group.buckets:
            if weight in bucket.param_to_index:
                begin, end = bucket.param_to_index[weight]
                shard = bucket.grad_data.numel() // bucket_group.intra_distributed_optimizer_instance_size
                own = bucket_group.intra_distributed_optimizer_instance_rank
                lo, hi = max(begin, own * shard), min(end, (own + 1) * shard)
                return (lo - begin, hi - begin) if lo < hi else (0, 0)
    return (0, numel) if dp_rank == 0 else (0, 0)


# ----- stage-to-stage transfers --------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of the sequence (whole-tensor positions) moved between two ranks."""

    peer: int  # the other rank's logical (= global) rank
    start: int
    stop: int


def _rows(tp_rank: int, tp: int, seq_length: int, sharded: bool) -> tuple[int, int]:
    if not sharded:
        return 0, seq_length
    return tp_rank * seq_length // tp, (tp_rank + 1) * seq_length // tp


def stage_pieces(plan: Plan, logical_rank: int, peer_stage: int, seq_length: int, sequence_parallel: bool,
                 receiving: bool) -> list[Piece]:
    """What this rank receives from (receiving) or sends to the ranks of peer_stage in its
    own replica, for a tensor whose whole length is seq_length rows."""
    me = plan.grid.coords(logical_rank)
    degrees = plan.grid.stage_tensor_parallel(me.template)
    my_tp, peer_tp = degrees[me.pp_rank], degrees[peer_stage]
    mine = _rows(me.tp_rank, my_tp, seq_length, sequence_parallel)
    pieces = []
    for u in range(peer_tp):
        theirs = _rows(u, peer_tp, seq_length, sequence_parallel)
        if not sequence_parallel:
            sender, receiver, sender_tp = (u, me.tp_rank, peer_tp) if receiving else (me.tp_rank, u, my_tp)
            if sender != receiver % sender_tp:  # each receiver takes the whole tensor from one sender
                continue
        start, stop = max(mine[0], theirs[0]), min(mine[1], theirs[1])
        if start < stop:
            pieces.append(Piece(plan.grid.rank_at(u, me.dp_rank, peer_stage), start, stop))
    return pieces


def resharding_communicator(original: type) -> type:
    class ReshardingP2PCommunicator(original):
        """megatron-core's P2PCommunicator, moving re-sharded pieces under a per-stage grid."""

        def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                         wait_on_reqs=True):
            if _plan is None:
                return super()._communicate(
                    tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev, recv_prev=recv_prev,
                    recv_next=recv_next, tensor_shape=tensor_shape, wait_on_reqs=wait_on_reqs)
            return _reshard(self.config, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                            tensor_shape, wait_on_reqs)

    ReshardingP2PCommunicator.__name__ = ReshardingP2PCommunicator.__qualname__ = "ReshardingP2PCommunicator"
    return ReshardingP2PCommunicator


def _reshard(config, send_next, send_prev, recv_prev, recv_next, tensor_shape, wait_on_reqs):
    plan, rank = _plan, dist.get_rank()
    me = plan.grid.coords(rank)
    stage, my_tp = me.pp_rank, plan.grid.stage_tensor_parallel(me.template)[me.pp_rank]
    # Sends alone carry no shape (megatron-core passes None): the tensor has it.
    shape = tensor_shape if tensor_shape is not None else (send_next if send_next is not None else send_prev).shape
    sharded = _sequence_parallel
    whole = shape[0] * my_tp if sharded else shape[0]  # sequence rows of the whole activation
    offset = _rows(me.tp_rank, my_tp, whole, sharded)[0]
    device = this_rank().device

    def buffer():
        return torch.empty(tensor_shape, requires_grad=True, device=device, dtype=config.pipeline_dtype)

    received_prev = buffer() if recv_prev else None
    received_next = buffer() if recv_next else None
    # The interleaved schedule wraps around: the last stage sends its chunk's output to the
    # first stage's next chunk (stage numbers modulo the pipeline depth).
    depth = len(plan.grid.stage_tensor_parallel(me.template))
    before, after = (stage - 1) % depth, (stage + 1) % depth
    # Sends first, then receives, each in peer order: both ends list a pair's pieces alike.
    ops: dict[str, list[dist.P2POp]] = {}
    for key, tensor, peer_stage in (("send_prev", send_prev, before), ("send_next", send_next, after)):
        if tensor is not None:
            ops[key] = [dist.P2POp(dist.isend, tensor[piece.start - offset:piece.stop - offset], piece.peer)
                        for piece in stage_pieces(plan, rank, peer_stage, whole, sharded, receiving=False)]
    for key, tensor, peer_stage in (("recv_prev", received_prev, before), ("recv_next", received_next, after)):
        if tensor is not None:
            ops[key] = [dist.P2POp(dist.irecv, tensor.detach()[piece.start - offset:piece.stop - offset], piece.peer)
                        for piece in stage_pieces(plan, rank, peer_stage, whole, sharded, receiving=True)]
    if not wait_on_reqs and not config.batch_p2p_comm:
        # Overlapped pipeline communication (the interleaved schedule's): one handle per
        # direction, keyed as megatron-core's _p2p_ops keys them, waited on by the schedule.
        return received_prev, received_next, {
            key: _Pieces([op.op(op.tensor, op.peer) for op in pieces]) for key, pieces in ops.items()}
    flat = [op for pieces in ops.values() for op in pieces]
    requests = dist.batch_isend_irecv(flat) if flat else []
    if wait_on_reqs:
        for request in requests:
            request.wait()
        requests = None
    return received_prev, received_next, requests


class _Pieces:
    """The requests of one direction's pieces, waited on as one."""

    def __init__(self, requests: list) -> None:
        self.requests = requests

    def wait(self) -> None:
        for request in self.requests:
            request.wait()

    def is_completed(self) -> bool:
        return all(request.is_completed() for request in self.requests)


__all__ = ["Piece", "TIED_TABLE_KEY", "TiedEmbeddingGrads", "drop_tied_copy_for_save", "tied_across_degrees", "active_plan", "finalize_model_grads_on_plan_grid", "finish_plan_grid",
           "plan_rank_generator", "rank_groups", "resharding_communicator", "stage_pieces", "use_plan_grid"]
