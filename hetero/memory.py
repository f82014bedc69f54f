"""Memory one rank needs: weights, gradients, optimizer state, activations, overhead.

Bytes per parameter follow Megatron's mixed-precision optimizer: a bf16/fp16 run keeps the
model-dtype weight (2), an fp32 gradient buffer (4) and fp32 master weight plus two Adam
moments (12); fp32 keeps weight (4), gradient (4) and moments (8). The distributed
optimizer splits the optimizer part (master weight and moments) evenly across the
data-parallel group (megatron-core shards evenly; it has no uneven split).

Activations: the 1F1B schedule keeps min(P - s, m) micro-batches in flight on stage s.
Backward adds a transient working set: the gradients of the layer being differentiated
(about one layer's activations for one micro-batch) and, without fused gradient
accumulation, each weight's .grad before it is added into the fp32 gradient buffer (the
largest: one layer's weights, or the vocabulary table on the first and last stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.costs import CostModel

GIB = 1024**3
# CUDA/ROCm context, communicator buffers, library workspaces; a CPU process's interpreter,
# torch, megatron-core and gloo (measured: 378 MB resident before any model memory).
FRAMEWORK_OVERHEAD_GIB = {"cpu": 0.37}
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
    return params


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
    distributed_optimizer: bool,
) -> MemoryEstimate:
    first, last = stage == 0, stage == num_stages - 1
    params = stage_params(costs, num_layers, first, last, num_stages) / tensor_parallel
    precision = costs.precision
    mixed = precision.value_bytes < 4
    optimizer_bytes = 12 if mixed else 8
    if distributed_optimizer:
        optimizer_bytes /= data_parallel
    in_flight = min(num_stages - stage, num_micro_batches)
    per_micro_batch = num_layers * costs.layer_activation_bytes(tensor_parallel, micro_batch_size)
    if last:
        per_micro_batch += costs.model.logits_activation_bytes(
            micro_batch_size, tensor_parallel, precision.value_bytes)
    if first:
        per_micro_batch += costs.activation_message_bytes(micro_batch_size)
    largest_weight = costs.model.layer_params()
    if first or last:
        largest_weight = max(largest_weight, costs.model.vocab_size * costs.model.hidden_size)
    transient = (costs.layer_activation_bytes(tensor_parallel, micro_batch_size)
                 + largest_weight / tensor_parallel * precision.value_bytes)
    return MemoryEstimate(
        weights=params * precision.value_bytes,
        gradients=params * precision.grad_bytes,
        optimizer=params * optimizer_bytes,
        activations=in_flight * per_micro_batch,
        transient=transient,
        overhead=FRAMEWORK_OVERHEAD_GIB.get(vendor, DEFAULT_OVERHEAD_GIB) * GIB,
    )


def capacity_bytes(memory_gib: float) -> float:
    return memory_gib * GIB * (1 - MIN_HEADROOM)
