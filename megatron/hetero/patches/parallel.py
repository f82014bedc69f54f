"""Patches for parallelism: the pipeline schedule's timing, process groups and p2p transfers
from a per-stage plan, statistics agreed across replica templates, and gloo's collectives
(CPU processes) where megatron-core relies on NCCL's behaviour."""

from __future__ import annotations

import functools


def _apply_schedule_trace() -> object:
    from megatron.hetero.tracing import wrap_schedule_functions

    return wrap_schedule_functions()


def _apply_plan_rank_generator() -> object:
    from megatron.core import parallel_state

    from megatron.hetero.stage_tensor_parallel import plan_rank_generator

    parallel_state.RankGenerator = plan_rank_generator(parallel_state.RankGenerator)
    return parallel_state.RankGenerator


def _apply_grad_stats_agree_across_templates() -> object:
    from megatron.core.optimizer import optimizer

    from megatron.hetero.template_reduction import agreed_across_templates

    optimizer.get_grad_norm_fp32 = agreed_across_templates(optimizer.get_grad_norm_fp32)
    optimizer.count_zeros_fp32 = agreed_across_templates(optimizer.count_zeros_fp32)
    return optimizer.get_grad_norm_fp32


def _apply_resharding_p2p() -> object:
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    from megatron.hetero.stage_tensor_parallel import resharding_communicator

    resharding = resharding_communicator(p2p_communication.P2PCommunicator)
    p2p_communication.P2PCommunicator = schedules.P2PCommunicator = resharding
    return resharding


class _HeldSend:
    """A pipeline send's Work, held until it is waited once (gloo's Work blocks on a second
    wait, and it reports itself completed only once waited)."""

    def __init__(self, work) -> None:
        self.work, self.waited = work, False

    def wait(self, *args, **kwargs):
        if self.waited:
            return True
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def _apply_overlapped_sends_kept() -> object:
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    # gloo cancels a send whose Work is freed before the receiver has posted its receive
    # (NCCL's sends live on in their stream), so every overlapped send is held until waited.
    in_flight: list[_HeldSend] = []
    p2p_ops = p2p_communication._p2p_ops

    def p2p_ops_holding_sends(*args, **kwargs):
        requests = p2p_ops(*args, **kwargs)
        in_flight[:] = [send for send in in_flight if not send.waited]
        for key in [key for key in requests if key.startswith("send")]:
            requests[key] = _HeldSend(requests[key])
            in_flight.append(requests[key])
        return requests

    interleaved = schedules.forward_backward_pipelining_with_interleaving

    @functools.wraps(interleaved)
    def interleaved_with_sends_finished(*args, **kwargs):
        result = interleaved(*args, **kwargs)
        # Its receivers post their receives within this same call: finishing the sends here
        # cannot wait on anything this rank has still to do.
        while in_flight:
            in_flight.pop(0).wait()
        return result

    p2p_communication._p2p_ops = p2p_ops_holding_sends
    schedules.forward_backward_pipelining_with_interleaving = interleaved_with_sends_finished
    return interleaved_with_sends_finished


def _apply_uneven_sequence_gather_on_gloo() -> object:
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        # Every rank's rows padded to the longest, gathered equal, the padding dropped.
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:rows] for piece, rows in zip(pieces, output_split_sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        # The same sums, all of them, then this rank's rows.
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start: start + input_split_sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
    return gather_along_first_dim

