"""What a layer, a stage's ends and an iteration cost beyond their arithmetic and bytes.

The analytical layer (costs.py) prices GEMMs by the device's efficiency curve and element-
wise kernels by their memory traffic. Two things it leaves out grow in weight as devices get
faster, and dominate small models:

- Kernel gaps: a decoder layer is a chain of dependent kernels (megatron-core's local
  layers about 40 in forward, transformer-engine's fused ones far fewer), and between two
  of them the device idles for the launch and ramp of the next. On an H100 the per-micro-
  batch time of a 16-layer GPT at micro-batch 1, 2 and 4 lies on a line whose intercept is
  about 0.6 ms per layer: 120 kernels (forward and backward) at 5 microseconds.
- The unfused attention's score matrix: without flash attention (transformer-engine)
  megatron-core's local DotProductAttention writes the s x s scores with a batched GEMM,
  masks them in place, soft-maxes them in torch (fusions/fused_softmax.py: no fused kernel
  without apex or transformer-engine) and reads the probabilities back for the product with
  V; backward mirrors each pass. The analytical layer counts only the softmax's read and
  write (and twice that for backward).

Per iteration, outside any micro-batch: the optimizer's kernels (a few per parameter
tensor: gradient norm, clipping, Adam's update, the copy to the model's dtype) and the
host's fixed work (the data iterator, loss reduction and logging).
"""

from __future__ import annotations

KERNEL_GAP_S = 5e-6
"""Idle device time between two dependent kernels (launch and ramp)."""
LAYER_KERNELS = {False: (40, 80), True: (16, 32)}
"""(forward, backward) kernels of one decoder layer: megatron-core's local layers, and
transformer-engine's fused ones (by TrainingSetup.fused_kernels)."""
END_KERNELS = {"first": (4, 6), "last": (12, 20)}
"""(forward, backward) kernels of the embedding (lookup, position add, dropout) and of the
output layer and loss (final norm, logits GEMM, vocabulary-parallel cross-entropy)."""
UNFUSED_ATTENTION_EXTRA_BYTES = (8, 42)
"""(forward, backward) bytes per score element the unfused attention path moves beyond the
softmax's read and write, in a 2-byte model dtype. Forward, counted: the GEMM writing the
scores (2), the in-place mask (read and write, 4), the probabilities read by the product
with V (2). Backward, counted: the gradient of the probabilities written (2), the softmax's
backward (6) and the mask's (4), the score gradient read by two GEMMs (4), the
probabilities read again (2), 18 against the 8 the layer's doubled forward already has,
so 10; the per-micro-batch slope measured on one H100 (GPT 0.9B, local layers, sequence
2048) asks for 42 in all, taken as measured: the batched s x s x head GEMMs of this path
have 128-deep products and run bound by memory, which the GEMM curve (fitted to
transformer-layer shapes) does not see."""
OPTIMIZER_KERNELS_PER_TENSOR = 6
"""Kernels per parameter tensor per step: norm, clip, Adam's moments and update, copy."""
TENSORS_PER_LAYER = 12
"""Weights and biases of a GPT decoder layer: QKV, projection, two MLP GEMMs, two norms."""
HOST_ITERATION_S = 3e-3
"""The host's work per iteration outside the schedule: next batch, loss reduction, log line."""


def layer_kernel_gaps_s(fused_kernels: bool) -> tuple[float, float]:
    """(forward, backward) device idle time of one decoder layer for one micro-batch."""
    forward, backward = LAYER_KERNELS[fused_kernels]
    return forward * KERNEL_GAP_S, backward * KERNEL_GAP_S


def end_kernel_gaps_s(first: bool, last: bool) -> tuple[float, float]:
    """(forward, backward) idle time of the embedding (first stage) and output layer and
    loss (last stage) for one micro-batch."""
    ends = [END_KERNELS[end] for end, on in (("first", first), ("last", last)) if on]
    return sum(f for f, _ in ends) * KERNEL_GAP_S, sum(b for _, b in ends) * KERNEL_GAP_S


def unfused_attention_bytes(score_elements: float, value_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes the unfused attention path moves beyond the softmax's."""
    forward, backward = UNFUSED_ATTENTION_EXTRA_BYTES
    return score_elements * forward * value_bytes / 2, score_elements * backward * value_bytes / 2


def iteration_fixed_s(num_layers: float) -> float:
    """A rank's fixed work per iteration outside the schedule: optimizer kernel gaps for a
    stage of num_layers layers (its parameter tensors) and the host's own work."""
    tensors = TENSORS_PER_LAYER * num_layers + 4  # + embedding tables and final norm
    return tensors * OPTIMIZER_KERNELS_PER_TENSOR * KERNEL_GAP_S + HOST_ITERATION_S


MOE_LAYER_KERNELS = (25, 40)
"""(forward, backward) kernels a MoE layer adds beyond a dense one, besides its experts' GEMMs
(megatron-core's all-to-all dispatcher): router GEMM, score function, top-k and the load-
balancing loss; the token counts, permutation and sort by local expert, both all-to-alls and
the unpermutation with the routing probabilities."""
MOE_EXPERT_KERNELS = (2, 4)
"""(forward, backward) kernels per local expert: transformer-engine's grouped linear runs one
GEMM per expert for fc1 and for fc2 (backward: a data and a weight gradient each)."""


def moe_kernel_gaps_s(local_experts: float) -> tuple[float, float]:
    """(forward, backward) idle time a MoE layer adds for one micro-batch."""
    return tuple((fixed + per_expert * local_experts) * KERNEL_GAP_S
                 for fixed, per_expert in zip(MOE_LAYER_KERNELS, MOE_EXPERT_KERNELS))


def moe_expert_kernel_gaps_s(local_experts: float) -> tuple[float, float]:
    """(forward, backward) of moe_kernel_gaps_s that the experts' own GEMMs cause."""
    return tuple(per_expert * local_experts * KERNEL_GAP_S for per_expert in MOE_EXPERT_KERNELS)
