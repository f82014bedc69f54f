"""How long the pieces of one training iteration take on given devices and links: the one
cost model. The predictor composes these functions for every rank of a plan; the planner's
fast estimate calls the very same functions for a few representative ranks.

Compute: a measured profile when there is one, else the sum of the layer's GEMMs, each at
the efficiency its shape reaches on the device (efficiency.py), and its memory-bound
kernels (norms, softmax, dropout, activations) at the device's memory bandwidth. Backward
is twice forward; recomputation adds the forward again (full) or the attention core
(selective).

Communication (alpha-beta): a transfer of V bytes over a route takes latency + V/bandwidth,
the bandwidth being what the route achieves with every device busy (cluster.py). An
all-reduce over a group is hierarchical, as NCCL does it across nodes: reduce-scatter
inside each node, all-reduce of the shards across nodes (each node's members drive their
own NIC shares in parallel), all-gather inside each node.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from hetero.spec.cluster import Cluster, Route
from hetero.predict.efficiency import MEMORY_EFFICIENCY, curve_for
from hetero.predict.moe_overlap import LayerPair, compute_share_beside_communication, overlapped_pair_s
from hetero.predict.tensor_parallel_overlap import exposed_tp_comm_s
from hetero.predict.fixed_costs import (end_kernel_gaps_s, iteration_fixed_s, layer_kernel_gaps_s,
                                        moe_expert_kernel_gaps_s, moe_kernel_gaps_s, unfused_attention_bytes)
from hetero.errors import HeteroError
from hetero.spec.model import ModelSpec
from hetero.spec.profiles import Profiles
from hetero.spec.recompute import check as check_recompute, mode as recompute_mode, modules as recomputed_modules

BYTES_PER_VALUE = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
# fp8 training (transformer-engine's recipes, Megatron's --fp8-format): each linear layer casts
# its GEMM inputs to fp8 and runs the GEMM on the fp8 matrix units (twice the 16-bit dense
# peak on Hopper, Ada and CDNA3 data sheets); activations, weights, the attention core and
# communication stay bf16. Per GEMM input: read in bf16 (2 bytes), written in fp8 and as its
# fp8 transpose for the other pass's GEMM (1 + 1): transformer-engine's fused cast-transpose.
FP8_PEAK_OVER_16BIT = 2.0
FP8_CAST_BYTES_PER_VALUE = 4
# Megatron's --fp8-recipe. Delayed scaling casts with the scale of earlier steps' maxima; the
# block and MX recipes find each block's maximum inside the cast kernel; tensorwise (current)
# scaling first reads the whole input for its maximum, then casts it: 2 more bytes a value.
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP8_AMAX_PASS_BYTES_PER_VALUE = {"tensorwise": 2}
# Flash attention's backward recomputes the scores and runs four more matrix products (the
# probabilities' gradient, dV, dQ, dK): five against the forward's two (Dao et al.,
# FlashAttention, 2022, algorithm 4), so the fused attention core's backward is 2.5 forwards,
# where every other GEMM's is two.
FLASH_ATTENTION_BACKWARD_OVER_FORWARD = 2.5
# Bytes an Adam step touches per parameter: fp32 grad (4), master weight read+write (8),
# two moments read+write (16), model-dtype weight write (2-4).
ADAM_BYTES_PER_PARAM = 32
# What each of megatron-core's --recompute-modules runs again (CostModel._layer_forward_parts);
# "moe" also exchanges its tokens again (expert_exchange_times).
PARTS_OF_MODULE = {
    "core_attn": ("core_attn",), "moe_act": ("moe_act",), "layernorm": ("layernorm",),
    "mla_up_proj": ("mla_up_proj",), "mlp": ("mlp",), "shared_experts": ("shared_experts",),
    "moe": ("router", "permutation", "routed_experts", "moe_act", "shared_experts"),
}
MOE_DISPATCHERS = ("alltoall", "flex")
# Megatron's DDP bucket: max(40M parameters, 1M x data-parallel size) (megatron-core
# distributed_data_parallel.py); the last bucket's reduction cannot overlap backward.
DDP_BUCKET_PARAMS = 40_000_000


@dataclass(frozen=True)
class TrainingSetup:
    """How the job runs, beyond the plan: what pretrain_gpt.py's flags and kernels will be."""

    precision: str = "bf16"
    distributed_optimizer: bool = True
    fused_kernels: bool = True
    """GPU kernels as transformer-engine provides them: flash attention (no score matrix
    kept) and fused SwiGLU. Off for megatron-core's local layers (the CPU runtime)."""
    dropout: bool = True
    """Hidden/attention dropout > 0 (Megatron's default 0.1): masks are kept for backward."""
    recompute: str = "none"
    """Activation recomputation (--recompute-granularity, hetero/spec/recompute.py): none, full
    (every layer's forward again during backward), selective (megatron-core's default module,
    the attention core) or selective:MODULE,... (--recompute-modules)."""
    sequence_parallel: bool = False
    """--sequence-parallel: norms and dropouts split over the tensor-parallel ranks."""
    virtual_stages: int = 1
    """Model chunks per pipeline stage (interleaved 1F1B when > 1)."""
    overlap_grad_reduce: bool = False
    """--overlap-grad-reduce: the gradient reduction runs during the last backward."""
    overlap_param_gather: bool = False
    """--overlap-param-gather (distributed optimizer): the all-gather of updated weights
    runs during the next forward."""
    grad_reduce_dtype: str | None = None
    """Gradient buffers and their reduction: None is Megatron's default (fp32 for bf16
    runs, the model dtype otherwise); bf16 is --grad-reduce-in-bf16."""
    scatter_stage_transfers: bool = False
    """Each tensor-parallel rank sends 1/TP of the activation to the next stage and the
    receiver all-gathers (sequence parallelism implies it)."""
    fused_softmax: bool | None = None
    """Without flash attention: whether the scores go through a fused scale-mask-softmax
    kernel (apex's; Megatron-LM's own compiled one in its 2021 releases) or megatron-core's
    torch fallback, several passes over the score matrix (hetero/predict/fixed_costs.py).
    None: as fused_kernels."""
    tp_comm_overlap: bool = False
    """--tp-comm-overlap (transformer-engine's userbuffers): each layer's tensor-parallel
    all-gathers and reduce-scatters run in chunks under the GEMMs next to them
    (tensor_parallel_overlap.py)."""
    moe_dispatcher: str = "alltoall"
    """--moe-token-dispatcher-type: alltoall (megatron-core's all-to-all: each of a token's
    top-k copies travels to its expert's rank) or flex (DeepEP / HybridEP: a token crosses to
    each other node holding one of its experts once and is fanned out inside that node)."""
    fp8_recipe: str = "delayed"
    """--fp8-recipe (fp8 runs): how each cast finds its scale (FP8_RECIPES)."""
    moe_a2a_overlap: bool = False
    """--overlap-moe-expert-parallel-comm (megatron-core's combined 1F1B): a micro-batch's token
    all-to-alls run under another micro-batch's compute, so a layer's exchange costs only what
    exceeds that layer's compute (expert_exchange_times)."""

    def __post_init__(self) -> None:
        if self.precision not in BYTES_PER_VALUE:
            raise HeteroError(f"precision {self.precision!r} is not one of {', '.join(BYTES_PER_VALUE)}")
        check_recompute(self.recompute)
        if self.virtual_stages < 1:
            raise HeteroError("virtual_stages must be at least 1")
        if self.fp8_recipe not in FP8_RECIPES:
            raise HeteroError(f"fp8_recipe {self.fp8_recipe!r} is not one of {', '.join(FP8_RECIPES)}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise HeteroError(f"moe_dispatcher {self.moe_dispatcher!r} is not one of {', '.join(MOE_DISPATCHERS)}")

    @property
    def value_bytes(self) -> int:
        """Bytes of an activation, weight or message (fp8 runs keep them in bf16)."""
        return 2 if self.fp8_gemms else BYTES_PER_VALUE[self.precision]

    @property
    def fp8_gemms(self) -> bool:
        """Linear layers' GEMMs run in fp8 (transformer-engine's recipes)."""
        return self.precision == "fp8"

    @property
    def fp8_cast_bytes(self) -> int:
        """Bytes an fp8 linear layer's input cast moves per value (read, fp8 copy and its
        transpose, and the maximum's pass where the recipe has one)."""
        return FP8_CAST_BYTES_PER_VALUE + FP8_AMAX_PASS_BYTES_PER_VALUE.get(self.fp8_recipe, 0)

    @property
    def grad_bytes(self) -> int:
        if self.grad_reduce_dtype is not None:
            return BYTES_PER_VALUE[self.grad_reduce_dtype]
        # megatron-core DDP: grad_reduce_in_fp32 = --accumulate-allreduce-grads-in-fp32 or bf16
        return 4 if self.precision in ("bf16", "fp8", "fp32") else self.value_bytes

    @property
    def optimizer_bytes(self) -> int:
        """fp32 master weight (mixed precision only) and two Adam moments, per parameter."""
        return 12 if self.value_bytes < 4 else 8

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainingSetup":
        """The fields this release knows, from a plan's training section."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer, one micro-batch, one rank: seconds of forward and of backward
    (recomputation and tensor-parallel communication included)."""

    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


class CostModel:
    def __init__(self, cluster: Cluster, model: ModelSpec, setup: TrainingSetup,
                 profiles: Profiles | None = None, expert_parallel: int = 1,
                 expert_tensor_parallel: int | None = None):
        self.cluster, self.model, self.setup = cluster, model, setup
        self.precision = setup  # value_bytes, grad_bytes
        self.profiles = profiles or Profiles()
        # The plan's expert grid (Plan.expert_parallel / expert_tensor_parallel; None: each
        # stage's tensor-parallel degree). Costs that depend on it live on a sibling model
        # per grid (with_experts), so every cache below stays keyed as before.
        self.expert_parallel, self.expert_tensor_parallel = expert_parallel, expert_tensor_parallel
        self._cache: dict[tuple, object] = {}
        self._allreduce_cache: dict[tuple, tuple[float, float]] = {}
        self._route_cache: dict[tuple, Route] = {}
        self._siblings: dict[tuple[int, int | None], CostModel] = {(expert_parallel, expert_tensor_parallel): self}

    def with_experts(self, expert_parallel: int, expert_tensor_parallel: int | None = None) -> "CostModel":
        """This cost model for a plan with this expert grid (the same model when it is ours)."""
        key = (expert_parallel, expert_tensor_parallel)
        if key not in self._siblings:
            sibling = CostModel(self.cluster, self.model, self.setup, self.profiles,
                                expert_parallel, expert_tensor_parallel)
            sibling._siblings = self._siblings
            sibling._route_cache, sibling._allreduce_cache = self._route_cache, self._allreduce_cache
            self._siblings[key] = sibling
        return self._siblings[key]

    def expert_tensor_parallel_at(self, tensor_parallel: int) -> int:
        """The expert tensor-parallel degree of a stage of this tensor-parallel degree."""
        return self.expert_tensor_parallel or tensor_parallel

    def expert_data_parallel_at(self, tensor_parallel: int, data_parallel: int) -> int:
        """Copies of each expert shard in a stage (its TP x DP ranks over EP x ETP)."""
        return max(1, tensor_parallel * data_parallel
                   // (self.expert_parallel * self.expert_tensor_parallel_at(tensor_parallel)))

    def _memo(self, key: tuple, compute):
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    # ----- compute ----------------------------------------------------------------------

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

    def stage_extra_times(self, device_name: str, tensor_parallel: int, micro_batch_size: int,
                          first: bool, last: bool) -> tuple[float, float]:
        """(forward, backward) a stage spends per micro-batch beyond its decoder layers: the
        first reads the batch and runs the embedding, the last reads the labels and runs the
        output layer and loss, and the multi-token-prediction layers (mtp_times). A profile
        measures the ends as "logits" (a one-stage model); its embedding share, when
        measured, goes to the first stage, the rest to the last (a profile without the share
        puts it all on the last, as earlier releases did)."""
        if not (first or last):
            return 0.0, 0.0
        forward, backward = self._stage_ends_s(device_name, tensor_parallel, micro_batch_size, first, last)
        if last:
            mtp = self.mtp_times(device_name, tensor_parallel, micro_batch_size)
            forward, backward = forward + mtp[0], backward + mtp[1]
        return forward, backward

    def _stage_ends_s(self, device_name: str, tensor_parallel: int, micro_batch_size: int,
                      first: bool, last: bool) -> tuple[float, float]:
        profile = self._compute_profile(device_name)
        if profile is not None:
            entry, scale = Profiles.entry(profile, tensor_parallel, micro_batch_size)
            if entry.logits_forward_s is not None and entry.logits_backward_s is not None:
                whole = entry.logits_forward_s, entry.logits_backward_s
                split = entry.embedding_forward_s is not None and entry.embedding_backward_s is not None
                if first and last:
                    part = whole
                elif not split:
                    part = whole if last else (0.0, 0.0)
                elif first:
                    part = (entry.batch_s or 0.0) + entry.embedding_forward_s, entry.embedding_backward_s
                else:
                    part = max(0.0, whole[0] - entry.embedding_forward_s), max(0.0, whole[1] - entry.embedding_backward_s)
                return part[0] * scale, part[1] * scale
        m, v = self.model, self.setup.value_bytes
        tokens = m.seq_length * micro_batch_size
        forward = backward = 0.0
        if first:  # a lookup and the position embedding's add; backward writes the table's dense gradient
            forward += self._memory_s(device_name, 3 * tokens * m.hidden_size * v)
            backward += self._memory_s(device_name, tokens * m.hidden_size * v + m.vocab_size / tensor_parallel
                                       * m.hidden_size * self.setup.grad_bytes)
        if last:
            logits = self._logits_s(device_name, tensor_parallel, micro_batch_size)
            forward, backward = forward + logits, backward + 2 * logits
        gaps = end_kernel_gaps_s(first, last)
        return forward + gaps[0], backward + gaps[1]

    def _logits_s(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> float:
        """The output layer's GEMM and the loss (logits to fp32, softmax), forward."""
        m, tokens = self.model, self.model.seq_length * micro_batch_size
        vocab = m.vocab_size / tensor_parallel
        return (self._gemm_s(device_name, tokens, vocab, m.hidden_size)
                + self._memory_s(device_name, tokens * vocab * (self.setup.value_bytes + 4) * 2))

    def mtp_layer_costs(self) -> "CostModel":
        """The cost model of one multi-token-prediction layer: the model's last layer kind
        (a MoE layer for DeepSeek-V3, whose average layer mixes in three dense ones)."""
        kind = self.model.mtp_layer_model()
        if kind is self.model:
            return self
        return self._memo(("mtp kind",), lambda: CostModel(
            self.cluster, kind, self.setup, self.profiles, self.expert_parallel, self.expert_tensor_parallel))

    def mtp_times(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> tuple[float, float]:
        """(forward, backward) of the multi-token-prediction layers, which megatron-core runs
        on the last pipeline stage after the loss's hidden states, per micro-batch. Each is a
        decoder layer of the last layer's kind (its expert exchange priced inside a node; the
        predictor adds what crosses nodes, mtp_exchange_layers), the 2h -> h projection of
        the shifted token's embedding beside the hidden state, with their norms and the
        embedding lookup, and another output layer and loss. A measured layer stands in for
        the MTP layer where the device is profiled."""
        m = self.model
        if not m.mtp_num_layers:
            return 0.0, 0.0
        host = next(n.host for n in self.cluster.nodes if n.device.name == device_name)
        kind = self if self._compute_profile(device_name) is not None else self.mtp_layer_costs()
        layer = kind.layer_cost(device_name, host, tensor_parallel, micro_batch_size)
        tokens, h, v = m.seq_length * micro_batch_size, m.hidden_size, self.setup.value_bytes
        split = tensor_parallel if self.setup.sequence_parallel else 1
        projection = (self._linear_s(device_name, tokens, h / tensor_parallel, 2 * h)
                      # the lookup, two norms (read, write) and the concatenation, over the hidden width
                      + self._memory_s(device_name, tokens * v * h * (3 + 2 * 2 + 4) / split))
        ends = projection + self._logits_s(device_name, tensor_parallel, micro_batch_size)
        gaps = end_kernel_gaps_s(False, True)
        return (m.mtp_num_layers * (layer.forward_s + ends + gaps[0]),
                m.mtp_num_layers * (layer.backward_s + 2 * ends + gaps[1]))

    def mtp_exchange_layers(self) -> float:
        """The multi-token-prediction layers' expert exchange, in units of the average layer's
        (which weighs a MoE layer's by the MoE share): what the last stage adds to its layer
        count where the predictor prices the exchange beyond a node."""
        m = self.model
        if not m.mtp_num_layers or not m.is_moe or not m.moe_layer_pattern()[-1]:
            return 0.0
        return m.mtp_num_layers / m.moe_layer_fraction

    def layer_activation_bytes(self, tensor_parallel: int, micro_batch_size: int,
                               recompute: str | None = None) -> float:
        """What one layer keeps for backward, per micro-batch, under the setup's
        recomputation (or the one given)."""
        setup = self.setup
        return self.model.layer_activation_bytes(
            micro_batch_size, tensor_parallel, setup.value_bytes, fused_kernels=setup.fused_kernels,
            dropout=setup.dropout, recompute=recompute or setup.recompute,
            sequence_parallel=setup.sequence_parallel)

    def activation_bytes(self, micro_batch_size: int) -> float:
        """One micro-batch's hidden states (s x b x h), whole."""
        return self.model.seq_length * micro_batch_size * self.model.hidden_size * self.setup.value_bytes

    def activation_message_bytes(self, micro_batch_size: int, tensor_parallel: int = 1) -> float:
        """What one tensor-parallel rank sends across a pipeline boundary per micro-batch:
        the whole activation, or 1/TP of it when transfers are scattered."""
        whole = self.activation_bytes(micro_batch_size)
        if self.setup.scatter_stage_transfers or self.setup.sequence_parallel:
            return whole / tensor_parallel
        return whole

    def optimizer_step(self, device_name: str, params: float) -> float:
        profile = self._compute_profile(device_name)
        if profile is not None and profile.optimizer_step_s_per_param is not None:
            return params * profile.optimizer_step_s_per_param
        layers = params / max(1, self.model.layer_params())
        return self._memory_s(device_name, params * ADAM_BYTES_PER_PARAM) + iteration_fixed_s(layers)

    # ----- data-parallel gradient synchronisation ---------------------------------------

    def gradient_sync(self, terms: tuple[float, float], params: float, data_parallel: int,
                      overlappable_s: float = 0.0) -> float:
        """Exposed seconds of one stage's gradient reduction over a group with all-reduce
        `terms` (seconds per byte, fixed seconds of one phase): an all-reduce, or with the
        distributed optimizer a reduce-scatter of gradients plus an all-gather of updated
        weights. Overlapped reduction hides behind `overlappable_s` (the last backward)
        except its last bucket; an overlapped gather hides behind the next forward except
        its first bucket."""
        per_byte, fixed = terms
        if params == 0 or per_byte == 0:
            return 0.0
        setup = self.setup
        grad = params * setup.grad_bytes
        if setup.distributed_optimizer:
            reduce = grad * per_byte + fixed
            gather = params * setup.value_bytes * per_byte + fixed
        else:
            reduce, gather = 2 * (grad * per_byte + fixed), 0.0
        last_bucket = min(1.0, max(DDP_BUCKET_PARAMS, 1e6 * data_parallel) / params)
        if setup.overlap_grad_reduce:
            reduce = max(reduce * last_bucket, reduce - overlappable_s)
        if setup.overlap_param_gather:
            gather *= last_bucket
        return reduce + gather

    # ----- communication ----------------------------------------------------------------

    def route(self, host_a: str, host_b: str, concurrent_crossings: int = 1,
              parallel_flows: int = 1) -> Route:
        key = (host_a, host_b, concurrent_crossings, parallel_flows)
        if key not in self._route_cache:
            measured = self.profiles.link(host_a, host_b)
            if measured is not None:
                route = Route(measured.bandwidth_gbs * 1e9 * parallel_flows, measured.latency_us * 1e-6, True)
            else:
                route = self.cluster.path(host_a, host_b, concurrent_crossings, parallel_flows)
            self._route_cache[key] = route
        return self._route_cache[key]

    def p2p(self, host_a: str, host_b: str, num_bytes: float, concurrent_crossings: int = 1) -> float:
        route = self.route(host_a, host_b, concurrent_crossings)
        return route.latency + num_bytes / route.bandwidth

    def stage_transfer(self, host_a: str, host_b: str, tensor_parallel: int, micro_batch_size: int,
                       concurrent_crossings: int = 1, receiver_tensor_parallel: int | None = None) -> float:
        """One micro-batch's activation (or gradient) from one stage's rank to the next's;
        scattered transfers are all-gathered again inside the receiving node. Between stages
        of different tensor-parallel degree (plan version 3) the activation is re-sharded."""
        if receiver_tensor_parallel is not None and receiver_tensor_parallel != tensor_parallel:
            return self.p2p(host_a, host_b, self.reshard_busiest_bytes(
                micro_batch_size, tensor_parallel, receiver_tensor_parallel), concurrent_crossings)
        message = self.activation_message_bytes(micro_batch_size, tensor_parallel)
        seconds = self.p2p(host_a, host_b, message, concurrent_crossings)
        whole = self.activation_bytes(micro_batch_size)
        if message < whole:
            route = self.route(host_b, host_b)
            seconds += (tensor_parallel - 1) * route.latency + (whole - message) / route.bandwidth
        return seconds

    def reshard_busiest_bytes(self, micro_batch_size: int, sender_tensor_parallel: int,
                              receiver_tensor_parallel: int) -> float:
        """What the busiest rank of a re-sharded stage transfer moves (stage_tensor_parallel.py):
        sequence-parallel slices, the larger of a sender's and a receiver's slice; whole
        copies, one to each of the ceil(tp_to / tp_from) receivers a sender serves."""
        whole = self.activation_bytes(micro_batch_size)
        if self.setup.sequence_parallel:
            return whole / min(sender_tensor_parallel, receiver_tensor_parallel)
        return whole * -(-receiver_tensor_parallel // sender_tensor_parallel)

    def expert_exchange_s(self, hosts: tuple[str, ...], tensor_parallel: int, micro_batch_size: int) -> float:
        """One micro-batch's token dispatch plus combine (two all-to-alls) in one direction
        (forward or backward), averaged over the layers (dense layers exchange nothing), for
        an expert-parallel group whose members sit on `hosts` (one entry per member).

        Each rank sends its 1/t of the tokens (megatron-core requires sequence parallelism
        with TP and EP), each to top-k experts: topk * s * b * h / t values, of which the
        share bound for other members leaves; what leaves the node shares its NIC with the
        node's other members. The flex dispatcher sends a token to another node once when any
        of its experts is there (routing spread evenly over the group's experts: a node
        holding a share q of them is missed by all top-k with probability (1 - q)^k)."""
        ep, model = len(hosts), self.model
        if ep <= 1 or not model.is_moe:
            return 0.0
        sent = (model.seq_length * micro_batch_size * model.hidden_size * self.setup.value_bytes
                * model.moe_router_topk / tensor_parallel)
        per_host: dict[str, int] = {}
        for host in hosts:
            per_host[host] = per_host.get(host, 0) + 1
        slowest = 0.0
        for host, members in per_host.items():
            local = self.route(host, host)
            seconds = (members - 1) * local.latency + sent * (members - 1) / ep / local.bandwidth
            outside = [h for h in per_host if h != host]
            if outside:
                leaving = sent * (ep - members) / ep * members  # the node's members, one NIC share
                if self.setup.moe_dispatcher == "flex":
                    nodes_reached = sum(self._node_reached(per_host[h] / ep) for h in outside)
                    leaving = sent / model.moe_router_topk * nodes_reached * members
                route = min((self.route(host, h, parallel_flows=members) for h in outside),
                            key=lambda r: r.bandwidth)
                seconds += len(outside) * route.latency + leaving / route.bandwidth
            slowest = max(slowest, seconds)
        return 2 * slowest * model.moe_layer_fraction

    def _node_reached(self, share: float) -> float:
        """The chance that a token has one of its experts on a node holding this share of the
        expert-parallel group's experts, routing spread evenly: missed by all top-k with
        probability (1 - share)^k. With group-limited routing whose groups each lie on one
        node (the node holding share x G of them), the node is reached when one of its groups
        is among the token's group_topk (each chosen group taking one of its experts at
        least)."""
        m = self.model
        groups, chosen = m.moe_router_num_groups, m.moe_router_group_topk
        if groups and chosen:
            held = share * groups
            if abs(held - round(held)) < 1e-9 and round(held) >= 1:
                return 1 - math.comb(groups - round(held), chosen) / math.comb(groups, chosen)
        return 1 - (1 - share) ** m.moe_router_topk

    def expert_exchange_alone_s(self, hosts: tuple[str, ...], tensor_parallel: int, micro_batch_size: int,
                                recompute: str | None = None) -> tuple[float, float]:
        """(forward, backward) seconds of one layer's token all-to-alls for one micro-batch with
        nothing overlapping them (a recomputed forward, or a recomputed MoE layer, exchanges
        again in backward)."""
        exchange = self.expert_exchange_s(hosts, tensor_parallel, micro_batch_size)
        recompute = recompute or self.setup.recompute
        again = recompute_mode(recompute) == "full" or "moe" in recomputed_modules(recompute)
        return exchange, exchange * (2 if again else 1)

    def expert_exchange_times(self, hosts: tuple[str, ...], device_name: str, tensor_parallel: int,
                              micro_batch_size: int, recompute: str | None = None) -> tuple[float, float]:
        """(forward, backward) seconds one layer's token all-to-alls add to one micro-batch on
        an expert-parallel group on `hosts` (a recomputed forward exchanges again). With
        --overlap-moe-expert-parallel-comm the steady 1F1B pairs one micro-batch's forward with
        another's backward and runs each one's all-to-alls beside the other's compute, as
        megatron-core orders them (moe_overlap.py): what the pair takes beyond its compute is
        exposed, the communication kernels' hold on the SMs included."""
        recompute = recompute or self.setup.recompute
        forward, backward = self.expert_exchange_alone_s(hosts, tensor_parallel, micro_batch_size, recompute)
        exchange = forward  # one direction's dispatch and combine
        if not self.setup.moe_a2a_overlap or exchange == 0:
            return forward, backward
        fraction = self.model.moe_layer_fraction  # exchange is averaged over the layers
        compute_forward, compute_backward = self.layer_times(device_name, tensor_parallel, micro_batch_size, recompute)
        mlp = self.routed_experts_forward_s(device_name, tensor_parallel, micro_batch_size)
        one_way = exchange / fraction / 2  # a MoE layer's dispatch, or its combine, in one direction
        pair = LayerPair(attn_forward=max(0.0, compute_forward - mlp), mlp_forward=mlp,
                         attn_backward=max(0.0, compute_backward - 2 * mlp), mlp_backward=mlp,
                         mlp_weight_gradient=mlp, dispatch_forward=one_way, combine_forward=one_way,
                         dispatch_backward=one_way, combine_backward=one_way)
        share = compute_share_beside_communication(device_name, self.setup.moe_dispatcher)
        exposed = fraction * (overlapped_pair_s(pair, share) - pair.compute_s)
        # A recomputed forward's exchange runs outside the pairing.
        return exposed * 0.5, exposed * 0.5 + (backward - exchange)

    def tp_allreduce(self, host: str, tensor_parallel: int, num_bytes: float) -> float:
        """Ring all-reduce among the tensor-parallel ranks of one node."""
        if tensor_parallel == 1:
            return 0.0
        route = self.route(host, host)
        steps = 2 * (tensor_parallel - 1)
        return steps * route.latency + steps / tensor_parallel * num_bytes / route.bandwidth

    def group_allreduce(self, hosts: list[str], num_bytes: float, concurrent_crossings: int = 1,
                        phases: float = 2.0) -> float:
        """Hierarchical all-reduce of num_bytes over members on `hosts` (one entry per member).

        phases=2 is an all-reduce; phases=1 a reduce-scatter or an all-gather alone.
        """
        if len(hosts) <= 1 or num_bytes == 0:
            return 0.0
        per_byte, fixed = self.allreduce_terms(tuple(hosts), concurrent_crossings)
        return phases * (num_bytes * per_byte + fixed)

    def allreduce_terms(self, hosts: tuple[str, ...], concurrent_crossings: int = 1) -> tuple[float, float]:
        """(seconds per byte, fixed seconds) of one all-reduce phase over members on
        `hosts`; the time is linear in the size, so the terms are computed once."""
        key = (hosts, concurrent_crossings)
        if key in self._allreduce_cache:
            return self._allreduce_cache[key]
        measured = self.profiles.allreduce_fit(hosts)
        if measured is not None:  # a phase is half of the measured all-reduce
            self._allreduce_cache[key] = (measured[0] / 2, measured[1] / 2)
            return self._allreduce_cache[key]
        per_host: dict[str, int] = {}
        for host in hosts:
            per_host[host] = per_host.get(host, 0) + 1
        per_byte = fixed = 0.0
        k = max(per_host.values())
        if k > 1:  # inside nodes: reduce-scatter (+ all-gather)
            intra = min((self.route(h, h) for h in per_host if per_host[h] > 1),
                        key=lambda r: r.bandwidth)
            per_byte += (k - 1) / k / intra.bandwidth
            fixed += (k - 1) * intra.latency
        num_hosts = len(per_host)
        if num_hosts > 1:  # across nodes: a ring over hosts, each host's members in parallel
            ordered = sorted(per_host, key=lambda h: (self.cluster.node(h).group, h))
            edges = [
                self.route(a, b, concurrent_crossings, parallel_flows=min(per_host[a], per_host[b]))
                for a, b in zip(ordered, ordered[1:] + ordered[:1])
            ]
            per_byte += (num_hosts - 1) / num_hosts / min(e.bandwidth for e in edges)
            fixed += (num_hosts - 1) * max(e.latency for e in edges)
        self._allreduce_cache[key] = (per_byte, fixed)
        return per_byte, fixed
