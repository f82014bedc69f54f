"""One decoder layer's cost on one rank for one micro-batch (LayerCosts, part of CostModel).

Compute: a measured profile when there is one, else the sum of the layer's GEMMs, each at
the efficiency its shape reaches on the device (efficiency.py), and its memory-bound
kernels (norms, softmax, dropout, activations) at the device's memory bandwidth. Backward
is twice forward; recomputation adds the forward again (full) or the attention core
(selective). The layer's tensor-parallel all-reduces and its experts' token exchange inside
a node come from CommunicationCosts.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.spec.cluster import Cluster
from hetero.predict.efficiency import MEMORY_EFFICIENCY, curve_for
from hetero.predict.tensor_parallel_overlap import exposed_tp_comm_s
from hetero.predict.fixed_costs import (layer_kernel_gaps_s, moe_expert_kernel_gaps_s, moe_kernel_gaps_s,
                                        unfused_attention_bytes)
from hetero.predict.training_setup import FP8_PEAK_OVER_16BIT, TrainingSetup
from hetero.spec.model import ModelSpec
from hetero.spec.profiles import Profiles
from hetero.spec.recompute import mode as recompute_mode, modules as recomputed_modules

# Flash attention's backward recomputes the scores and runs four more matrix products (the
# probabilities' gradient, dV, dQ, dK): five against the forward's two (Dao et al.,
# FlashAttention, 2022, algorithm 4), so the fused attention core's backward is 2.5 forwards,
# where every other GEMM's is two.
FLASH_ATTENTION_BACKWARD_OVER_FORWARD = 2.5
# What each of megatron-core's --recompute-modules runs again (CostModel._layer_forward_parts);
# "moe" also exchanges its tokens again (expert_exchange_times).
PARTS_OF_MODULE = {
    "core_attn": ("core_attn",), "moe_act": ("moe_act",), "layernorm": ("layernorm",),
    "mla_up_proj": ("mla_up_proj",), "mlp": ("mlp",), "shared_experts": ("shared_experts",),
    "moe": ("router", "permutation", "routed_experts", "moe_act", "shared_experts"),
}


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer, one micro-batch, one rank: seconds of forward and of backward
    (recomputation and tensor-parallel communication included)."""

    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


class LayerCosts:
    """CostModel's decoder-layer costs (a mixin: CostModel supplies the attributes below, the
    memo and the communication costs)."""

    cluster: Cluster
    model: ModelSpec
    setup: TrainingSetup
    profiles: Profiles
    expert_parallel: int

    def _gemm_s(self, device_name: str, m: float, n: float, k: float, count: float = 1.0) -> float:
        """A 16-bit GEMM (the attention core, the router, the output layer)."""
        device = self.cluster.devices[device_name]
        efficiency = curve_for(device_name, device.vendor).gemm(m, n, k)
        return count * 2 * m * n * k / (device.peak_tflops * 1e12 * efficiency)

    def _linear_s(self, device_name: str, m: float, n: float, k: float, count: float = 1.0) -> float:
        """A linear layer's GEMM (m tokens, n outputs, k inputs): in fp8 where the setup's
        recipe casts it, with the cast of its input (forward; backward casts the output
        gradient of the same size, priced by the caller's doubling of forward)."""
        device = self.cluster.devices[device_name]
        if not self.setup.fp8_gemms or not device.supports("fp8"):
            return self._gemm_s(device_name, m, n, k, count)
        efficiency = curve_for(device_name, device.vendor, "fp8").gemm(m, n, k)
        gemm = count * 2 * m * n * k / (FP8_PEAK_OVER_16BIT * device.peak_tflops * 1e12 * efficiency)
        return gemm + self._memory_s(device_name, count * m * k * self.setup.fp8_cast_bytes)

    def _memory_s(self, device_name: str, num_bytes: float) -> float:
        device = self.cluster.devices[device_name]
        return num_bytes / (device.memory_bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY)

    def _attention_core_s(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> float:
        """Scores, softmax and their product with V (forward), for one micro-batch."""
        m, v = self.model, self.setup.value_bytes
        heads = m.num_attention_heads / tensor_parallel
        s, d = m.seq_length, m.head_dim
        # Two batched GEMMs (s x d by d x s, s x s by s x d) per head.
        gemms = self._gemm_s(device_name, s, s, d, count=2 * micro_batch_size * heads)
        if self.setup.fused_kernels:
            # Flash attention computes only the keys each query attends (the causal half, or
            # its sliding window; whole tiles, so a narrow window costs somewhat more), and
            # keeps no s x s matrix. megatron-core's local attention masks a full matrix.
            return gemms * m.attended_keys_per_query() / s
        scores = micro_batch_size * heads * s * s * v  # one score matrix
        # masked softmax (read, write), and with dropout its mask and output (read, write x2)
        traffic = scores * (2 + (3 if self.setup.dropout else 0))
        return gemms + self._memory_s(device_name, traffic)

    def _layer_forward_compute_s(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> float:
        """Analytical forward of one layer: GEMMs at their shape's efficiency, the
        attention core, and the memory-bound kernels around them."""
        return sum(self._layer_forward_parts(device_name, tensor_parallel, micro_batch_size).values())

    def _layer_forward_parts(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> dict[str, float]:
        """The analytical forward of one layer by part, each averaged over the model's dense
        and MoE layers (a MoE part weighs the MoE layers' share): what selective
        recomputation of megatron-core's modules runs again."""
        return self._memo(("parts", device_name, tensor_parallel, micro_batch_size),
                          lambda: self._layer_forward_parts_of(device_name, tensor_parallel, micro_batch_size))

    def _layer_forward_parts_of(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> dict[str, float]:
        m, t, v = self.model, tensor_parallel, self.setup.value_bytes
        tokens = m.seq_length * micro_batch_size
        h = m.hidden_size
        q = m.num_attention_heads * m.head_dim
        kv = m.query_groups * m.head_dim
        parts: dict[str, float] = {}
        if m.multi_latent_attention:  # its projections as one GEMM of the same work
            attention = self._linear_s(device_name, tokens, m.attention_gemm_flops_per_token() / (2 * h) / t, h)
            parts["mla_up_proj"] = attention * m.mla_up_projection_flops_per_token() / m.attention_gemm_flops_per_token()
            parts["attention_linear"] = attention - parts["mla_up_proj"]
        else:
            parts["attention_linear"] = (self._linear_s(device_name, tokens, (q + 2 * kv) / t, h)
                                         + self._linear_s(device_name, tokens, h, q / t))
        parts["core_attn"] = self._attention_core_s(device_name, t, micro_batch_size)

        def mlp(ffn: int, copies: float = 1) -> float:  # GEMMs, and the activation (read, write)
            if not ffn:
                return 0.0
            up = ffn * (2 if m.swiglu else 1) / t
            return (self._linear_s(device_name, tokens, up, h) + self._linear_s(device_name, tokens, h, ffn / t)
                    + self._memory_s(device_name, tokens * v * 2 * ffn * copies / t))

        share = m.moe_layer_fraction if m.is_moe else 0.0
        parts["mlp"] = (1 - share) * mlp(m.ffn)
        sequence_split = t if self.setup.sequence_parallel else 1
        # Norms (read, write) x2, then bias-dropout-add (read 2, write 1, mask) x2 over the
        # hidden width.
        parts["layernorm"] = self._memory_s(device_name, tokens * v * 4 * h / sequence_split)
        parts["residual"] = self._memory_s(device_name, tokens * v * 6 * h / sequence_split)
        if share:
            topk, ffn = m.moe_router_topk, m.moe_ffn_hidden_size
            parts["routed_experts"] = share * self._routed_expert_gemms_s(device_name, t, micro_batch_size)
            parts["moe_act"] = share * self._memory_s(device_name, tokens * v * 2 * ffn * topk / t)
            parts["router"] = share * self._gemm_s(device_name, tokens, m.num_experts, h)
            parts["shared_experts"] = share * mlp(m.shared_expert_ffn)
            # Token permutation on a rank's 1/t of the tokens: the top-k copies written and
            # read again for the all-to-all, sorted by local expert (read, write) on arrival,
            # and the way back (sort, unpermute with the probabilities into one token).
            parts["permutation"] = share * self._memory_s(device_name, tokens / t * v * h * (2 + 4 * topk))
        return parts

    def _routed_expert_gemms_s(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> float:
        """Forward GEMMs of one MoE layer's routed experts on one rank. The stage's TP x DP
        ranks share the routed work evenly: each rank holds E/EP experts split ETP ways and
        computes 1/t of its replica's token-expert pairs, so an expert's GEMMs have
        tokens * topk * EP * ETP / (E * t) rows."""
        m, t = self.model, tensor_parallel
        ffn, experts, h = m.moe_ffn_hidden_size, m.num_experts, m.hidden_size
        ep, etp = self.expert_parallel, self.expert_tensor_parallel_at(t)
        routed = m.seq_length * micro_batch_size * m.moe_router_topk * ep * etp / (experts * t)
        up = ffn * (2 if m.swiglu else 1) / etp
        return (self._linear_s(device_name, routed, up, h, experts / ep)
                + self._linear_s(device_name, routed, h, ffn / etp, experts / ep))

    def routed_experts_forward_s(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> float:
        """The routed experts' part of one MoE layer's forward on one rank (their GEMMs,
        activation and kernel gaps): what megatron-core's overlapped schedule runs between
        dispatch and combine. A measured layer is scaled by its measured over analytical time."""
        m = self.model
        if not m.is_moe:
            return 0.0
        parts = self._layer_forward_parts(device_name, tensor_parallel, micro_batch_size)
        gaps = moe_expert_kernel_gaps_s(m.num_experts / self.expert_parallel)[0]
        routed = (parts["routed_experts"] + parts["moe_act"]) / m.moe_layer_fraction + gaps
        if self._compute_profile(device_name) is None:
            return routed
        analytical = (self._layer_forward_compute_s(device_name, tensor_parallel, micro_batch_size)
                      + self._layer_overheads_s(device_name, tensor_parallel, micro_batch_size)[0])
        return routed * self.layer_compute(device_name, tensor_parallel, micro_batch_size)[0] / analytical

    def _layer_overheads_s(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> tuple[float, float]:
        """(forward, backward) of one layer beyond its arithmetic and bytes: kernel gaps and
        the unfused attention's passes over the scores (hetero/predict/fixed_costs.py)."""
        m, setup = self.model, self.setup
        forward, backward = layer_kernel_gaps_s(setup.fused_kernels)
        if m.is_moe:
            moe = moe_kernel_gaps_s(m.num_experts / self.expert_parallel)
            forward += m.moe_layer_fraction * moe[0]
            backward += m.moe_layer_fraction * moe[1]
        fused_softmax = setup.fused_kernels if setup.fused_softmax is None else setup.fused_softmax
        if not fused_softmax and not setup.fused_kernels:  # flash attention has no score matrix
            scores = micro_batch_size * m.num_attention_heads / tensor_parallel * m.seq_length ** 2
            extra = unfused_attention_bytes(scores, setup.value_bytes)
            forward += self._memory_s(device_name, extra[0])
            backward += self._memory_s(device_name, extra[1])
        return forward, backward

    def _compute_profile(self, device_name: str):
        return self.profiles.compute_profile(device_name, self.model, self.setup.precision)

    def _profiled_at(self, device_name: str, tensor_parallel: int) -> bool:
        profile = self._compute_profile(device_name)
        return profile is not None and tensor_parallel > 1 and any(
            e.tensor_parallel == tensor_parallel for e in profile.entries)

    def layer_compute(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> tuple[float, float]:
        """(forward, backward) seconds of one decoder layer's compute for one micro-batch,
        without recomputation or communication."""
        def compute() -> tuple[float, float]:
            profile = self._compute_profile(device_name)
            if profile is not None:
                entry, scale = Profiles.entry(profile, tensor_parallel, micro_batch_size)
                return entry.layer_forward_s * scale, entry.layer_backward_s * scale
            forward = self._layer_forward_compute_s(device_name, tensor_parallel, micro_batch_size)
            extra_forward, extra_backward = self._layer_overheads_s(device_name, tensor_parallel, micro_batch_size)
            if self.setup.fused_kernels:
                extra_backward += (FLASH_ATTENTION_BACKWARD_OVER_FORWARD - 2) * self._attention_core_s(
                    device_name, tensor_parallel, micro_batch_size)
            return forward + extra_forward, 2 * forward + extra_backward
        return self._memo(("compute", device_name, tensor_parallel, micro_batch_size), compute)

    def micro_batch_cv(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> float:
        """How much one micro-batch's compute varies on this device (standard deviation /
        mean), as profiled; 0 where not measured (a device known from its data sheet alone)."""
        profile = self._compute_profile(device_name)
        if profile is None:
            return 0.0
        return Profiles.entry(profile, tensor_parallel, micro_batch_size)[0].micro_batch_cv or 0.0

    def layer_times(self, device_name: str, tensor_parallel: int, micro_batch_size: int,
                    recompute: str | None = None) -> tuple[float, float]:
        """(forward, backward) compute of one layer, backward including recomputation (the
        setup's, or the stage's own when given)."""
        recompute = recompute or self.setup.recompute
        forward, backward = self.layer_compute(device_name, tensor_parallel, micro_batch_size)
        if recompute_mode(recompute) == "full":
            backward += forward
        elif recompute_mode(recompute) == "selective":
            parts = self._layer_forward_parts(device_name, tensor_parallel, micro_batch_size)
            again = {part for module in recomputed_modules(recompute) for part in PARTS_OF_MODULE[module]}
            # The modules' share of the layer's forward, measured or not.
            backward += forward * sum(parts.get(part, 0.0) for part in again) / sum(parts.values())
        return forward, backward

    def layer_cost(self, device_name: str, host: str, tensor_parallel: int, micro_batch_size: int,
                   recompute: str | None = None) -> LayerCost:
        """One layer on one rank: compute, recomputation and the tensor-parallel all-reduces
        (two per layer in forward, two in backward, two more when the forward is
        recomputed; with sequence parallelism an all-gather and a reduce-scatter of the
        same volume each)."""
        recompute = recompute or self.setup.recompute

        def compute() -> LayerCost:
            forward, backward = self.layer_times(device_name, tensor_parallel, micro_batch_size, recompute)
            # Token dispatch and combine, forward and backward (and the recomputed forward),
            # with the expert-parallel group inside this node (the predictor adds the rest
            # when a group spans nodes).
            exchange_forward, exchange_backward = self.expert_exchange_times(
                (host,) * self.expert_parallel, device_name, tensor_parallel, micro_batch_size, recompute)
            forward += exchange_forward
            backward += exchange_backward
            allreduce = self.tp_allreduce(host, tensor_parallel, self.activation_bytes(micro_batch_size))
            if self._profiled_at(device_name, tensor_parallel):
                allreduce = 0.0  # measured with its tensor-parallel group: the all-reduces are in it
            recomputed = 2 if recompute_mode(recompute) == "full" else 0
            if self.setup.tp_comm_overlap:  # hidden under the GEMMs beside them
                gemms = self.layer_compute(device_name, tensor_parallel, micro_batch_size)[0]
                exposed = exposed_tp_comm_s(allreduce, gemms, tensor_parallel)
                return LayerCost(forward + exposed, backward + exposed_tp_comm_s(allreduce, 2 * gemms, tensor_parallel)
                                 + recomputed / 2 * exposed)
            return LayerCost(forward + 2 * allreduce, backward + (2 + recomputed) * allreduce)
        return self._memo(("layer", device_name, host, tensor_parallel, micro_batch_size, recompute), compute)

    def layer_activation_bytes(self, tensor_parallel: int, micro_batch_size: int,
                               recompute: str | None = None) -> float:
        """What one layer keeps for backward, per micro-batch, under the setup's
        recomputation (or the one given)."""
        setup = self.setup
        return self.model.layer_activation_bytes(
            micro_batch_size, tensor_parallel, setup.value_bytes, fused_kernels=setup.fused_kernels,
            dropout=setup.dropout, recompute=recompute or setup.recompute,
            sequence_parallel=setup.sequence_parallel)
