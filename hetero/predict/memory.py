"""Memory one rank needs: weights, gradients, optimizer state, activations, overhead.

Bytes per parameter follow Megatron's mixed-precision optimizer: a bf16/fp16 run keeps the
model-dtype weight (2), a gradient buffer (fp32 by default for bf16, see
TrainingSetup.grad_bytes) and fp32 master weight plus two Adam moments (12); fp32 keeps
weight (4), gradient (4) and moments (8). The distributed optimizer splits the optimizer
part (master weight and moments) evenly across the data-parallel group (megatron-core
shards evenly; it has no uneven split).

Activations: the 1F1B schedule keeps min(P - s, m) micro-batches in flight on stage s; the
interleaved schedule keeps (2 (P - s - 1) + (v - 1) P + 1) model chunks of 1/v of the
stage each (its warm-up count plus the one in progress). What a layer keeps per
micro-batch depends on recomputation and sequence parallelism (ModelSpec.
layer_activation_bytes). Backward adds a transient working set: one layer's activations
for one micro-batch as if nothing were recomputed (a recomputed layer is rebuilt whole
before its backward) and, without fused gradient accumulation, each weight's .grad before
it is added into the gradient buffer (the largest: one layer's weights, or the vocabulary
table on the first and last stage).

Memory is linear in a stage's layer count; the planner's layer cap is this same function
evaluated at 0 and 1 layers (layer_capacity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hetero.predict.costs import CostModel

GIB = 1024**3
FP8_WEIGHT_COPY_BYTES = 2
"""An fp8 run (transformer-engine) also keeps each weight cast to fp8 for the iteration,
as it is and transposed (the two GEMM layouts Hopper's fp8 units take)."""
# CUDA/ROCm context, communicator buffers, library workspaces; a CPU process's interpreter,
# torch, megatron-core and gloo. On the CPU this is the process's own memory, without the
# pages of mapped library files (their number follows the page cache: 86 or 147 MB for the
# same import). Measured: fresh ranks' peak less mapped files, less the model terms, is
# 256-257 MB for both of tests/test_memory.py's plans (298 MB is anonymous right after the
# imports; some of it is import-time scratch freed before training).
FRAMEWORK_OVERHEAD_GIB = {"cpu": 0.25}
DEFAULT_OVERHEAD_GIB = 2.0
# A plan must leave this fraction of a device free for allocator fragmentation and spikes.
MIN_HEADROOM = 0.05


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    transient: float
    overhead: float

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.transient
                + self.overhead)

    def to_gib(self) -> dict:
        parts = {k: getattr(self, k) / GIB
                 for k in ("weights", "gradients", "optimizer", "activations", "transient", "overhead")}
        return {**{k: round(v, 3) for k, v in parts.items()}, "total": round(self.total / GIB, 3)}


def stage_params(costs: CostModel, num_layers: int, first: bool, last: bool, num_stages: int) -> float:
    """Parameters one tensor-parallel rank of a stage holds, before dividing by TP."""
    model = costs.model
    params = num_layers * model.layer_params()
    if first:
        params += model.embedding_params()
    if last and (num_stages > 1 or model.untie_embeddings_and_output_weights):
        params += model.output_params()
    elif last:  # one stage, tied: the output layer reuses the embedding table
        params += model.output_params() - model.vocab_size * model.hidden_size
    if last:  # megatron-core keeps the multi-token-prediction layers with the loss
        params += model.mtp_params()
    return params


def stage_expert_params(costs: CostModel, num_layers: int, last: bool) -> float:
    """The routed experts among stage_params (the last stage's MTP layers' included)."""
    return num_layers * costs.model.expert_params() + (costs.model.mtp_expert_params() if last else 0.0)


def rank_params(costs: CostModel, num_layers: int, first: bool, last: bool, num_stages: int,
                tensor_parallel: int) -> tuple[float, float]:
    """(dense, expert) parameters one rank of a stage holds: the dense part split over the
    tensor-parallel ranks, the routed experts over expert-parallel x expert-tensor ranks
    (costs.expert_parallel; with EP 1 that is TP, as for the dense part)."""
    experts = stage_expert_params(costs, num_layers, last)
    dense = stage_params(costs, num_layers, first, last, num_stages) - experts
    grid = costs.expert_parallel * costs.expert_tensor_parallel_at(tensor_parallel)
    return dense / tensor_parallel, experts / grid


def micro_batches_in_flight(stage: int, num_stages: int, num_micro_batches: int,
                            virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of the
    whole stage's layers."""
    if virtual_stages == 1:
        return min(num_stages - stage, num_micro_batches)
    chunks = 2 * (num_stages - stage - 1) + (virtual_stages - 1) * num_stages + 1
    return min(chunks, num_micro_batches * virtual_stages) / virtual_stages


def rank_memory(
    costs: CostModel,
    *,
    vendor: str,
    tensor_parallel: int,
    data_parallel: int,
    micro_batch_size: int,
    num_layers: int,
    stage: int,
    num_stages: int,
    num_micro_batches: int,
    distributed_optimizer: bool | None = None,
    recompute: str | None = None,
    in_flight: float | None = None,
) -> MemoryEstimate:
    """One rank's memory; recompute is the stage's own mode (default: the setup's);
    in_flight overrides the micro-batches the schedule keeps in flight."""
    setup = costs.setup
    if distributed_optimizer is None:
        distributed_optimizer = setup.distributed_optimizer
    first, last = stage == 0, stage == num_stages - 1
    dense, experts = rank_params(costs, num_layers, first, last, num_stages, tensor_parallel)
    params = dense + experts
    # The distributed optimizer shards dense state over the data-parallel group, expert
    # state over the expert data-parallel group (the same group with EP 1).
    optimizer_state = optimizer_state_bytes(costs, dense, experts, tensor_parallel, data_parallel,
                                            distributed_optimizer)
    if in_flight is None:
        in_flight = micro_batches_in_flight(stage, num_stages, num_micro_batches, setup.virtual_stages)
    per_micro_batch = num_layers * costs.layer_activation_bytes(tensor_parallel, micro_batch_size, recompute)
    # The output layer, the loss and the MTP layers live in the pipeline's last (virtual) stage,
    # whose backward of a micro-batch follows its forward at once: one micro-batch's worth,
    # whatever the stage's other chunks hold.
    held_once = 0.0
    if last:
        held_once = costs.model.logits_activation_bytes(micro_batch_size, tensor_parallel, setup.value_bytes)
        if costs.model.mtp_num_layers:  # each MTP layer, and its own output layer and loss
            held_once += costs.model.mtp_num_layers * (
                costs.mtp_layer_costs().layer_activation_bytes(tensor_parallel, micro_batch_size, recompute)
                + costs.model.logits_activation_bytes(micro_batch_size, tensor_parallel, setup.value_bytes))
    if first:
        per_micro_batch += costs.activation_message_bytes(micro_batch_size, tensor_parallel)
    largest_weight = costs.model.layer_params()
    if first or last:
        largest_weight = max(largest_weight, costs.model.vocab_size * costs.model.hidden_size)
    transient = (backward_working_set(costs, tensor_parallel, micro_batch_size, recompute)
                 + largest_weight / tensor_parallel * setup.value_bytes)
    return MemoryEstimate(
        weights=params * (setup.value_bytes + (FP8_WEIGHT_COPY_BYTES if setup.fp8_gemms else 0)),
        gradients=params * setup.grad_bytes,
        optimizer=optimizer_state,
        activations=in_flight * per_micro_batch + held_once,
        transient=transient,
        overhead=FRAMEWORK_OVERHEAD_GIB.get(vendor, DEFAULT_OVERHEAD_GIB) * GIB,
    )


def optimizer_state_bytes(costs: CostModel, dense: float, experts: float, tensor_parallel: int, data_parallel: int,
                          distributed_optimizer: bool) -> float:
    """One rank's optimizer state for its (dense, expert) parameters (rank_params): the
    distributed optimizer shards the dense part over the data-parallel group, the experts'
    over the expert data-parallel group (the same group with EP 1)."""
    setup = costs.setup
    if experts and distributed_optimizer:
        expert_share = costs.expert_data_parallel_at(tensor_parallel, data_parallel)
        return setup.optimizer_bytes * (dense / data_parallel + experts / expert_share)
    return (dense + experts) * (setup.optimizer_bytes / (data_parallel if distributed_optimizer else 1))


def backward_working_set(costs: CostModel, tensor_parallel: int, micro_batch_size: int,
                         recompute: str | None = None) -> float:
    """What backward holds beyond the kept activations at the peak. Full recomputation
    rebuilds one layer's activations at a time; otherwise the MLP's backward holds the
    gradients of its two widest tensors (fc1's output and the activation's). Sequence
    parallelism gathers each column-parallel GEMM's whole s x b x h input again in
    backward, next to that input's gradient before its reduce-scatter."""
    setup, model = costs.setup, costs.model
    if (recompute or setup.recompute) == "full":
        working = costs.layer_activation_bytes(tensor_parallel, micro_batch_size, recompute="none")
    else:
        working = 2 * model.seq_length * micro_batch_size * model.ffn * setup.value_bytes / tensor_parallel
    if setup.sequence_parallel and tensor_parallel > 1:
        working += 2 * costs.activation_bytes(micro_batch_size)
    return working


def capacity_bytes(memory_gib: float) -> float:
    return memory_gib * GIB * (1 - MIN_HEADROOM)


def layer_capacity(costs: CostModel, memory_gib: float, **placement) -> int:
    """Most decoder layers a stage can hold within a device's capacity: rank_memory is
    linear in num_layers, so two evaluations of it give the answer. `placement` is
    rank_memory's keywords without num_layers."""
    empty = rank_memory(costs, num_layers=0, **placement).total
    per_layer = rank_memory(costs, num_layers=1, **placement).total - empty
    room = capacity_bytes(memory_gib) - empty
    return max(0, int(room // per_layer)) if per_layer > 0 else 0


END_STAGES = {(True, True): (0, 1), (True, False): (0, 2), (False, True): (1, 2), (False, False): (1, 3)}
"""(stage, stages) of a pipeline that has a stage of each kind (first, last): where
rank_memory prices a stage of that kind."""


@dataclass(frozen=True)
class StageMemoryTerms:
    """rank_memory of one kind of stage (first, middle, last, or the only one) as the
    bilinear function it is: fixed + per_flight*f + n*(per_layer + per_layer_flight*f)
    bytes for n layers and f micro-batches in flight."""

    fixed: float
    per_flight: float
    per_layer: float
    per_layer_flight: float

    @classmethod
    def of(cls, total: Callable[[int, int], float]) -> "StageMemoryTerms":
        """The terms from total(n, f), a stage's bytes with n layers and f micro-batches in
        flight, at n in {0, 1} and f in {1, 2}."""
        m01, m02, m11, m12 = total(0, 1), total(0, 2), total(1, 1), total(1, 2)
        per_flight = m02 - m01
        per_layer_flight = (m12 - m11) - per_flight
        per_layer = (m11 - m01) - per_layer_flight
        return cls(m01 - per_flight, per_flight, per_layer, per_layer_flight)

    def capacity(self, memory_gib: float, in_flight: float) -> int:
        """Most layers that fit with `in_flight` micro-batches in flight."""
        room = capacity_bytes(memory_gib) - self.fixed - self.per_flight * in_flight
        per_layer = self.per_layer + self.per_layer_flight * in_flight
        return max(0, int(room // per_layer)) if per_layer > 0 else 0


def stage_memory_terms(costs: CostModel, *, first: bool, last: bool, **placement) -> StageMemoryTerms:
    """StageMemoryTerms from four evaluations of rank_memory (n in {0, 1}, f in {1, 2}).
    `placement`: rank_memory's keywords other than num_layers, stage, num_stages,
    num_micro_batches and in_flight."""
    stage, num_stages = END_STAGES[first, last]

    def total(n: int, f: int) -> float:
        return rank_memory(costs, num_layers=n, stage=stage, num_stages=num_stages, num_micro_batches=f,
                           in_flight=f, **placement).total

    return StageMemoryTerms.of(total)
