"""The interleaved 1F1B schedule the predictor simulates (hetero/predict/interleaved_schedule.py)
held against megatron-core's own forward_backward_pipelining_with_interleaving, run rank by
rank with its forward and backward steps recorded; and the simulation's timing rules."""

from __future__ import annotations

import types

import pytest
import torch

from hetero.errors import PlanError
from hetero.plan import Plan
from hetero.predict.interleaved_schedule import (ChunkTiming, check_micro_batch_groups, interleaved_op_order,
                                                 simulate_interleaved)
from hetero.predict.predictor import StageWork, simulate_pipelines
from hetero.predict.schedule import interleaved_shape, pipeline_shape


class _Group:
    """What the schedule asks of a process group: its rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Done:
    def wait(self) -> bool:
        return True


class _Channel:
    """A pipeline rank's p2p communicator whose receives complete at once with a fresh tensor:
    only the rank's own order is under test."""

    def __init__(self, rank: int, size: int, chunks: int, config) -> None:
        self.pp_group, self.virtual_pipeline_model_parallel_size = _Group(rank, size), chunks
        self.config = config

    def recv_forward(self, tensor_shape, is_first_stage=False):
        return None if is_first_stage else torch.zeros(tensor_shape, requires_grad=True)

    def recv_backward(self, tensor_shape, is_last_stage=False):
        return None if is_last_stage else torch.zeros(tensor_shape, requires_grad=True)

    def _exchange(self, sent, received: bool, tensor_shape, overlap: bool, send_key: str, recv_key: str):
        tensor = torch.zeros(tensor_shape, requires_grad=True) if received else None
        handles = {**({send_key: _Done()} if sent is not None else {}), **({recv_key: _Done()} if received else {})}
        return (tensor, handles) if overlap else tensor

    def send_forward_recv_forward(self, output_tensor, recv_prev, tensor_shape, overlap_p2p_comm=False):
        return self._exchange(output_tensor, recv_prev, tensor_shape, overlap_p2p_comm, "send_next", "recv_prev")

    def send_backward_recv_backward(self, input_tensor_grad, recv_next, tensor_shape, overlap_p2p_comm=False):
        return self._exchange(input_tensor_grad, recv_next, tensor_shape, overlap_p2p_comm, "send_prev", "recv_next")


def megatron_core_order(stage: int, stages: int, chunks: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """Rank `stage`'s (kind, micro-batch, chunk) as megatron-core's interleaved schedule runs
    them, with overlapped p2p communication as the runtime sets it."""
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.hetero.cpu_device import CudaAsCpuMode

    config = TransformerConfig(num_layers=stages * chunks, hidden_size=8, num_attention_heads=1,
                               pipeline_model_parallel_size=stages, virtual_pipeline_model_parallel_size=chunks,
                               pipeline_dtype=torch.float32, overlap_p2p_comm=True, batch_p2p_comm=False,
                               use_cpu_initialization=True)
    model = []
    for _ in range(chunks):
        chunk = torch.nn.Module()
        chunk.config, chunk.model_type, chunk.set_input_tensor = config, ModelType.encoder_or_decoder, lambda t: None
        model.append(chunk)
    log: list = []

    def forward_step(*args, current_microbatch=None, vp_stage=None, **kwargs):
        log.append(("F", current_microbatch, vp_stage))
        output = torch.zeros(1, requires_grad=True)
        output.ran_as = (current_microbatch, vp_stage)
        return output, torch.tensor(0)

    def backward_step(input_tensor, output_tensor, output_tensor_grad, *model_type_and_config):  # 0.17+: no model_type
        log.append(("B", *output_tensor.ran_as))

    groups = types.SimpleNamespace(tp=_Group(0, 1), cp=_Group(0, 1), embd=None, pos_embd=None,
                                   pp=_Group(stage, stages), dp_cp=_Group(0, 1))
    saved = schedules.forward_step, schedules.backward_step
    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    try:
        with CudaAsCpuMode():
            schedules.forward_backward_pipelining_with_interleaving(
                forward_step_func=None, data_iterator=[iter(())] * chunks, model=model, num_microbatches=micro_batches,
                seq_length=4, micro_batch_size=1, p2p_communicator=_Channel(stage, stages, chunks, config),
                pg_collection=groups)
    finally:
        schedules.forward_step, schedules.backward_step = saved
    return log


@pytest.mark.parametrize("stages, chunks, micro_batches", [(2, 2, 4), (2, 2, 2), (4, 2, 8), (2, 3, 6), (3, 2, 6),
                                                           (4, 4, 4)])
def test_op_order_is_megatron_cores_own(stages: int, chunks: int, micro_batches: int) -> None:
    """Every rank's forwards and backwards in order, with their micro-batch and chunk."""
    for stage in range(stages):
        assert interleaved_op_order(stage, stages, chunks, micro_batches) == megatron_core_order(
            stage, stages, chunks, micro_batches)


def test_micro_batch_counts_megatron_core_refuses_are_refused() -> None:
    check_micro_batch_groups(6, 3)
    with pytest.raises(PlanError, match="last group"):  # megatron-core: "dependency bubbles"
        check_micro_batch_groups(5, 3)
    with pytest.raises(PlanError, match="at least 2 micro-batches"):
        check_micro_batch_groups(1, 2)


def test_equal_stages_with_free_transfers_give_narayanans_bubble_and_the_closed_form_agrees() -> None:
    stages, chunks, micro_batches, forward, backward = 4, 2, 8, 1.0, 2.0
    plan = Plan.uniform(tensor_parallel=1, pipeline_parallel=stages, data_parallel=1, micro_batch_size=1,
                        num_layers=8, global_batch_size=micro_batches)
    works = [[StageWork(2, forward / 2, backward / 2, 0.0, 0.0)] * stages]
    ends, _ = simulate_pipelines(plan, works, chunks)
    bubble = (stages - 1) / chunks * (forward + backward)
    assert max(ends) == pytest.approx(micro_batches * (forward + backward) + bubble)
    closed = interleaved_shape(pipeline_shape([forward + backward] * stages), chunks)
    assert closed.time(micro_batches) == pytest.approx(max(ends))


def test_the_first_rank_waits_for_the_last_ranks_chunk_around_the_wrap() -> None:
    """A micro-batch's second chunk on rank 0 starts once rank 1 (slower) has run its first
    chunk and the output has come around; every send keeps its rank until it has crossed."""
    send = 0.25
    fast = [ChunkTiming(1.0, 2.0, send, 0.0), ChunkTiming(1.0, 2.0, send, send)]
    slow = [ChunkTiming(3.0, 6.0, send, send), ChunkTiming(3.0, 6.0, 0.0, send)]
    ops = simulate_interleaved([fast, slow], 2)
    rank_1_chunk_0 = next(op for op in ops[1] if (op.kind, op.micro_batch, op.chunk) == ("F", 0, 0))
    rank_0_chunk_1 = next(op for op in ops[0] if (op.kind, op.micro_batch, op.chunk) == ("F", 0, 1))
    assert rank_1_chunk_0.start == pytest.approx(1.0 + send)
    assert rank_1_chunk_0.end == pytest.approx(1.0 + send + 3.0 + send)
    assert rank_0_chunk_1.start == pytest.approx(rank_1_chunk_0.end)
    last_backward = ops[0][-1]
    assert (last_backward.kind, last_backward.chunk) == ("B", 0)  # the model's first chunk sends nothing back
    assert last_backward.end - last_backward.start == pytest.approx(2.0)


def test_a_stages_ends_sit_in_its_first_and_last_chunks() -> None:
    """The embedding runs in the first stage's first chunk, the output layer and loss in the
    last stage's last chunk; the last stage's other chunks send around to the first stage."""
    first = StageWork(4, 1.0, 2.0, 0.5, 0.7, send_forward_s=0.1, wrap_backward_s=0.3)
    last = StageWork(2, 1.0, 2.0, 5.0, 9.0, send_backward_s=0.1, wrap_forward_s=0.3)
    chunks = first.chunks([3, 1], first=True, last=False)
    assert [(c.forward_s, c.backward_s) for c in chunks] == [(3.5, 6.7), (1.0, 2.0)]
    assert [(c.send_forward_s, c.send_backward_s) for c in chunks] == [(0.1, 0.0), (0.1, 0.3)]
    chunks = last.chunks([1, 1], first=False, last=True)
    assert [(c.forward_s, c.backward_s) for c in chunks] == [(1.0, 2.0), (6.0, 11.0)]
    assert [(c.send_forward_s, c.send_backward_s) for c in chunks] == [(0.3, 0.1), (0.0, 0.1)]
