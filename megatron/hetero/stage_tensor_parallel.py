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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetero.plan import Plan

_plan: Plan | None = None
_sequence_parallel = False


def use_plan_grid(plan: Plan | None, sequence_parallel: bool = False) -> None:
    """Installs (or, with None, removes) the per-stage grid the patched classes follow.
    A plan whose stages share one degree leaves megatron-core's own grid in place."""
    global _plan, _sequence_parallel
    _plan = plan if plan is not None and plan.per_stage_tensor_parallel else None
    _sequence_parallel = sequence_parallel


def active_plan() -> Plan | None:
    return _plan


# ----- process groups ----------------------------------------------------------------


def rank_groups(plan: Plan, token: str) -> list[list[int]]:
    """megatron-core's group lists for one token, from the plan's grid (cp and ep are 1)."""
    names = set(token.split("-"))
    unknown = names - {"tp", "dp", "pp", "cp", "ep"}
    if unknown:
        raise ValueError(f"unknown parallelism {sorted(unknown)} in {token!r}")
    coords = [plan.coords(r) for r in range(plan.world_size)]
    if "pp" in names and "tp" not in names:
        if "dp" in names:  # no megatron-core token asks for this; refuse rather than guess
            raise ValueError(f"{token!r}: pipeline and data groups without tensor ranks are not defined "
                             "when stages differ in tensor-parallel degree")
        return [plan.pipeline_group(t, d) for d in range(plan.data_parallel)
                for t in range(plan.max_tensor_parallel)]
    groups: dict[tuple, list[int]] = {}
    for rank, c in enumerate(coords):
        key = (None if "pp" in names else c.pp_rank, None if "dp" in names else c.dp_rank,
               None if "tp" in names else c.tp_rank)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def plan_rank_generator(original: type) -> type:
    """megatron-core's RankGenerator, answering from the installed plan's grid when one is."""

    class PlanRankGenerator(original):
        def get_ranks(self, token):
            if _plan is None:
                return super().get_ranks(token)
            return rank_groups(_plan, token)

    PlanRankGenerator.__name__ = PlanRankGenerator.__qualname__ = "PlanRankGenerator"
    return PlanRankGenerator


def finish_plan_grid(timeout) -> None:
    """After initialize_model_parallel under a per-stage grid, two groups megatron-core
    derives from one grid's arithmetic: a rank in several pipeline groups keeps the first,
    the one of its own tensor rank (megatron-core would hand out a list); the distributed
    optimizer's instance group (one instance: every rank) is counted in whole grids and
    would be left unset."""
    from megatron.core import parallel_state as ps

    if isinstance(ps._PIPELINE_GLOBAL_RANKS[0], list):
        ps._PIPELINE_MODEL_PARALLEL_GROUP = ps._PIPELINE_MODEL_PARALLEL_GROUP[0]
        ps._PIPELINE_GLOBAL_RANKS = ps._PIPELINE_GLOBAL_RANKS[0]
    if ps._INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP is None:
        ps._INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP = dist.new_group(
            list(range(dist.get_world_size())), timeout=timeout)


def finalize_model_grads_on_plan_grid(finalize, model, num_tokens=None, *args, **kwargs):
    """megatron-core's finalize_model_grads, with its per-token scaling's one pipeline-group
    collective (the last stage broadcasting the token count) taken over the replica's
    model-parallel group: pipeline groups overlap on a per-stage grid, so a broadcast on
    one would wait for a rank that is in another."""
    from megatron.core import parallel_state as ps

    result = finalize(model, None, *args, **kwargs)
    if num_tokens is not None:
        replica = _plan.replica_ranks(_plan.coords(dist.get_rank()).dp_rank)
        dist.broadcast(num_tokens, src=replica[-1], group=ps.get_model_parallel_group())
        dist.all_reduce(num_tokens, group=ps.get_data_parallel_group(with_context_parallel=True))
        if num_tokens > 0:
            for chunk in model:
                chunk.scale_gradients(1.0 / num_tokens)
    return result


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
    me = plan.coords(logical_rank)
    my_tp = plan.stage_tensor_parallel[me.pp_rank]
    peer_tp = plan.stage_tensor_parallel[peer_stage]
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
            pieces.append(Piece(plan.rank_at(u, me.dp_rank, peer_stage), start, stop))
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
    me = plan.coords(rank)
    stage, my_tp = me.pp_rank, plan.stage_tensor_parallel[me.pp_rank]
    # Sends alone carry no shape (megatron-core passes None): the tensor has it.
    shape = tensor_shape if tensor_shape is not None else (send_next if send_next is not None else send_prev).shape
    sharded = _sequence_parallel
    whole = shape[0] * my_tp if sharded else shape[0]  # sequence rows of the whole activation
    offset = _rows(me.tp_rank, my_tp, whole, sharded)[0]
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

    def buffer():
        return torch.empty(tensor_shape, requires_grad=True, device=device, dtype=config.pipeline_dtype)

    ops: list[dist.P2POp] = []
    received_prev = buffer() if recv_prev else None
    received_next = buffer() if recv_next else None
    # Sends first, then receives, each in peer order: both ends list a pair's pieces alike.
    for tensor, peer_stage in ((send_prev, stage - 1), (send_next, stage + 1)):
        if tensor is not None:
            for piece in stage_pieces(plan, rank, peer_stage, whole, sharded, receiving=False):
                ops.append(dist.P2POp(dist.isend, tensor[piece.start - offset:piece.stop - offset], piece.peer))
    for tensor, peer_stage in ((received_prev, stage - 1), (received_next, stage + 1)):
        if tensor is not None:
            for piece in stage_pieces(plan, rank, peer_stage, whole, sharded, receiving=True):
                view = tensor.detach()[piece.start - offset:piece.stop - offset]
                ops.append(dist.P2POp(dist.irecv, view, piece.peer))
    requests = dist.batch_isend_irecv(ops) if ops else []
    if wait_on_reqs:
        for request in requests:
            request.wait()
        requests = None
    return received_prev, received_next, requests


__all__ = ["Piece", "active_plan", "finalize_model_grads_on_plan_grid", "finish_plan_grid",
           "plan_rank_generator", "rank_groups", "resharding_communicator", "stage_pieces", "use_plan_grid"]
