"""megatron-core's overlap of the experts' token all-to-alls with another micro-batch's compute
(--overlap-moe-expert-parallel-comm), priced one layer at a time.

In the steady 1F1B its combined schedule runs one micro-batch's forward of a layer beside
another micro-batch's backward of a layer, on two CUDA streams, in this order (megatron-core
0.16, models/common/model_chunk_schedule_plan.py, TransformerLayerSchedulePlan.run):

    communication: combine_bwd | dispatch_fwd -> dispatch_bwd  | combine_fwd
    compute:       attn_fwd    | mlp_bwd -> mlp_dw -> mlp_fwd  | attn_bwd

"mlp" is the routed experts (between dispatch and combine), "attn" the rest of the layer
(attention, norms, router, shared experts, permutation). Each piece waits for what it
consumes: mlp_bwd for combine_bwd, dispatch_fwd for attn_fwd, dispatch_bwd for mlp_bwd's
data gradient, mlp_fwd for dispatch_fwd, combine_fwd for mlp_fwd, attn_bwd for dispatch_bwd.
The next layer's pair needs both streams' results (its attn_fwd takes combine_fwd's output,
its combine_bwd attn_bwd's gradient), so a layer pair costs the end of this graph.

The communication kernels hold SMs while they run (megatron-core's defaults:
--moe-deepep-num-sms 20 for DeepEP, --moe-hybridep-num-sms 16 for HybridEP); compute running
beside them gets the rest of the device.

Only the steady 1F1B pairs: the warm-up's forwards and the cool-down's backwards run alone,
their all-to-alls exposed (unpaired_share).
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE_UNITS = {"V100": 80, "A100": 108, "A800": 108, "H100": 132, "H800": 132, "H200": 132,
                 "MI250X": 110, "MI300X": 304}
"""Streaming multiprocessors (AMD: compute units) per device, by catalog-name prefix."""
DEFAULT_COMPUTE_UNITS = 132
COMMUNICATION_UNITS = {"flex": 20, "alltoall": 20}
"""SMs the token all-to-all holds while it runs: megatron-core's --moe-deepep-num-sms default
for the flex dispatcher (the plan does not say DeepEP or HybridEP, whose default is 16).
NCCL's all-to-all kernel is given the same (an assumption: NCCL sizes its channels itself)."""


@dataclass(frozen=True)
class LayerPair:
    """One layer's pieces, in seconds, for the overlapped pair: a micro-batch's forward and
    another's backward (mlp_backward is the data gradient; mlp_weight_gradient follows it)."""

    attn_forward: float
    mlp_forward: float
    attn_backward: float
    mlp_backward: float
    mlp_weight_gradient: float
    dispatch_forward: float
    combine_forward: float
    dispatch_backward: float
    combine_backward: float

    @property
    def compute_s(self) -> float:
        return (self.attn_forward + self.mlp_forward + self.attn_backward + self.mlp_backward
                + self.mlp_weight_gradient)


def compute_share_beside_communication(device_name: str, dispatcher: str) -> float:
    """The share of a device's SMs compute keeps while a token all-to-all runs."""
    units = next((n for prefix, n in COMPUTE_UNITS.items() if device_name.startswith(prefix)),
                 DEFAULT_COMPUTE_UNITS)
    return max(0.0, 1 - COMMUNICATION_UNITS[dispatcher] / units)


def overlapped_pair_s(pair: LayerPair, compute_share: float) -> float:
    """Seconds the two streams take for one layer pair, compute slowed to `compute_share` of
    its speed while a communication piece runs beside it."""
    compute = [("attn_forward", pair.attn_forward, ()),
               ("mlp_backward", pair.mlp_backward, ("combine_backward",)),
               ("mlp_weight_gradient", pair.mlp_weight_gradient, ()),
               ("mlp_forward", pair.mlp_forward, ("dispatch_forward",)),
               ("attn_backward", pair.attn_backward, ("dispatch_backward",))]
    communication = [("combine_backward", pair.combine_backward, ()),
                     ("dispatch_forward", pair.dispatch_forward, ("attn_forward",)),
                     ("dispatch_backward", pair.dispatch_backward, ("mlp_backward",)),
                     ("combine_forward", pair.combine_forward, ("mlp_forward",))]
    streams = [compute, communication]
    position, left = [0, 0], [compute[0][1], communication[0][1]]
    finished: set[str] = set()
    now = 0.0
    while position[0] < len(compute) or position[1] < len(communication):
        ready = [position[i] < len(s) and all(d in finished for d in s[position[i]][2])
                 for i, s in enumerate(streams)]
        if not any(ready):  # cannot happen with the order above; a wrong edit would loop forever
            raise RuntimeError("overlapped layer schedule waits on itself")
        rates = [1.0, 1.0]
        if ready[0] and ready[1] and left[1] > 0:
            rates[0] = compute_share
        steps = [left[i] / rates[i] for i in range(2) if ready[i] and rates[i] > 0]
        step = min(steps) if steps else 0.0
        now += step
        for i, stream in enumerate(streams):
            if not ready[i]:
                continue
            left[i] -= step * rates[i]
            if left[i] <= 1e-15:
                finished.add(stream[position[i]][0])
                position[i] += 1
                left[i] = stream[position[i]][1] if position[i] < len(stream) else 0.0
    return now


def unpaired_share(micro_batches: int, pipeline_parallel: int, stage: int, virtual_stages: int = 1) -> float:
    """The share of a stage's forward chunks that run before its first pair (and of its
    backward chunks after its last), as megatron-core schedules them with the overlap
    (pipeline_parallel/schedules.py, get_pp_rank_microbatches;
    pipeline_parallel/combined_1f1b.py): without a pipeline the first forward and the last
    backward; in the interleaved schedule its warm-up, (p - rank - 1) * 2 + (v - 1) * p
    chunks (micro-batch groups of p), plus one more forward so that every pair's forward
    and backward are independent."""
    chunks = micro_batches * virtual_stages
    if chunks <= 0:
        return 0.0
    if pipeline_parallel == 1:
        alone = 1
    else:
        alone = (pipeline_parallel - stage - 1) * 2 + (virtual_stages - 1) * pipeline_parallel + 1
    return min(chunks, alone) / chunks
