"""How long the pieces of one training iteration take on given devices and links.

Compute: a measured profile when there is one, else a roofline over the catalog figures:
max(FLOPs / (peak x MATMUL_EFFICIENCY), bytes / (memory bandwidth x MEMORY_EFFICIENCY)).
Backward is twice forward.

Communication (alpha-beta): a transfer of V bytes over a route takes latency + V/bandwidth,
the bandwidth being what the route achieves with every device busy (cluster.py). An
all-reduce over a group is hierarchical, as NCCL does it across nodes: reduce-scatter
inside each node, all-reduce of the shards across nodes (each node's members drive their
own NIC shares in parallel), all-gather inside each node.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.cluster import Cluster, Route
from hetero.model import ModelSpec
from hetero.profiles import Profiles

# Fraction of peak matrix throughput Megatron reaches on large dense transformer layers
# (52% MFU for GPT-3 175B on A100 in Narayanan et al. 2021; 40-55% typical). Profiles
# replace it with measurements.
MATMUL_EFFICIENCY = 0.5
MEMORY_EFFICIENCY = 0.7
BYTES_PER_VALUE = {"bf16": 2, "fp16": 2, "fp32": 4}
# Bytes an Adam step touches per parameter: fp32 grad (4), master weight read+write (8),
# two moments read+write (16), model-dtype weight write (2-4).
ADAM_BYTES_PER_PARAM = 32


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

    @property
    def value_bytes(self) -> int:
        return BYTES_PER_VALUE[self.precision]

    @property
    def grad_bytes(self) -> int:
        return 4  # Megatron reduces bf16 gradients in fp32 (accumulate_allreduce_grads_in_fp32)

    def to_dict(self) -> dict:
        return {"precision": self.precision, "distributed_optimizer": self.distributed_optimizer,
                "fused_kernels": self.fused_kernels, "dropout": self.dropout}


class CostModel:
    def __init__(self, cluster: Cluster, model: ModelSpec, setup: TrainingSetup,
                 profiles: Profiles | None = None):
        self.cluster, self.model, self.setup = cluster, model, setup
        self.precision = setup  # value_bytes, grad_bytes
        self.profiles = profiles or Profiles()
        self._layer_cache: dict[tuple, tuple[float, float]] = {}
        self._allreduce_cache: dict[tuple, tuple[float, float]] = {}
        self._route_cache: dict[tuple, Route] = {}

    # ----- compute ----------------------------------------------------------------------

    def _roofline(self, device_name: str, flops: float, bytes_moved: float) -> float:
        device = self.cluster.devices[device_name]
        compute = flops / (device.peak_tflops * 1e12 * MATMUL_EFFICIENCY)
        memory = bytes_moved / (device.memory_bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY)
        return max(compute, memory)

    def layer_times(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> tuple[float, float]:
        """(forward, backward) seconds of one decoder layer's compute for one micro-batch."""
        key = (device_name, tensor_parallel, micro_batch_size)
        if key not in self._layer_cache:
            profile = self.profiles.compute_profile(device_name, self.model, self.setup.precision)
            if profile is not None:
                entry, scale = Profiles.entry(profile, tensor_parallel, micro_batch_size)
                times = (entry.layer_forward_s * scale, entry.layer_backward_s * scale)
            else:
                m, v = self.model, self.precision.value_bytes
                tokens = m.seq_length * micro_batch_size
                flops = tokens * m.layer_forward_flops_per_token() / tensor_parallel
                moved = m.layer_params() / tensor_parallel * v + self.layer_activation_bytes(
                    tensor_parallel, micro_batch_size)
                forward = self._roofline(device_name, flops, moved)
                times = (forward, 2 * forward)
            self._layer_cache[key] = times
        return self._layer_cache[key]

    def logits_times(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> tuple[float, float]:
        """(forward, backward) of the output layer and loss on the last stage."""
        profile = self.profiles.compute_profile(device_name, self.model, self.setup.precision)
        if profile is not None:
            entry, scale = Profiles.entry(profile, tensor_parallel, micro_batch_size)
            if entry.logits_forward_s is not None and entry.logits_backward_s is not None:
                return entry.logits_forward_s * scale, entry.logits_backward_s * scale
        m = self.model
        tokens = m.seq_length * micro_batch_size
        flops = tokens * m.logits_forward_flops_per_token() / tensor_parallel
        moved = m.vocab_size * m.hidden_size / tensor_parallel * self.precision.value_bytes + \
            m.logits_activation_bytes(micro_batch_size, tensor_parallel, self.precision.value_bytes)
        forward = self._roofline(device_name, flops, moved)
        return forward, 2 * forward

    def layer_activation_bytes(self, tensor_parallel: int, micro_batch_size: int) -> float:
        return self.model.layer_activation_bytes(
            micro_batch_size, tensor_parallel, self.setup.value_bytes,
            fused_kernels=self.setup.fused_kernels, dropout=self.setup.dropout)

    def activation_message_bytes(self, micro_batch_size: int) -> float:
        """What crosses a pipeline boundary per micro-batch (each TP rank sends it whole)."""
        return self.model.seq_length * micro_batch_size * self.model.hidden_size * self.precision.value_bytes

    def optimizer_step(self, device_name: str, params: float) -> float:
        profile = self.profiles.compute_profile(device_name, self.model, self.setup.precision)
        if profile is not None and profile.optimizer_step_s_per_param is not None:
            return params * profile.optimizer_step_s_per_param
        device = self.cluster.devices[device_name]
        return params * ADAM_BYTES_PER_PARAM / (device.memory_bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY)

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
