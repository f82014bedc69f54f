"""How long the job's messages take (CommunicationCosts, part of CostModel): transfers
between pipeline stages, the data-parallel gradient reduction, tensor-parallel all-reduces
and the experts' token all-to-alls.

Alpha-beta: a transfer of V bytes over a route takes latency + V/bandwidth, the bandwidth
being what the route achieves with every device busy (cluster.py), or what the link
profile measured. An all-reduce over a group is the library's ring (NCCL's node after node,
gloo's in rank order): a reduce-scatter and an all-gather of n - 1 steps each, paced by the
ring's slowest edge; an edge leaving a node carries the NIC shares of the group's members
there (allreduce_terms).
"""

from __future__ import annotations

import functools
import math
from collections import Counter

from hetero.spec.cluster import Cluster, Route
from hetero.spec.devices import CPU
from hetero.predict.moe_overlap import LayerPair, compute_share_beside_communication, overlapped_pair_s
from hetero.predict.training_setup import TrainingSetup
from hetero.spec.model import ModelSpec
from hetero.spec.profiles import Profiles
from hetero.spec.recompute import mode as recompute_mode, modules as recomputed_modules

# Megatron's DDP bucket: max(40M parameters, 1M x data-parallel size) (megatron-core
# distributed_data_parallel.py); the last bucket's reduction cannot overlap backward.
DDP_BUCKET_PARAMS = 40_000_000


def last_bucket_share(params: float, data_parallel: int) -> float:
    """The share of a rank's `params` in megatron-core's last DDP bucket (the first to gather)."""
    return min(1.0, max(DDP_BUCKET_PARAMS, 1e6 * data_parallel) / params) if params else 1.0


def overlapped_reduce_s(setup: TrainingSetup, reduce_s: float, params: float, data_parallel: int,
                        overlappable_s: float) -> float:
    """Exposed seconds of a gradient reduction of `params` (reduce_s in all) that starts,
    bucket by bucket, during the last backward (overlappable_s) with --overlap-grad-reduce:
    all but the last bucket hide behind it. Without the flag, all of it."""
    if not setup.overlap_grad_reduce:
        return reduce_s
    return max(reduce_s * last_bucket_share(params, data_parallel), reduce_s - overlappable_s)


def overlapped_gather_s(setup: TrainingSetup, gather_s: float, params: float, data_parallel: int) -> float:
    """Exposed seconds of the distributed optimizer's all-gather of updated `params`: with
    --overlap-param-gather it runs under the next forward, all but its first bucket."""
    return gather_s * last_bucket_share(params, data_parallel) if setup.overlap_param_gather else gather_s


class CommunicationCosts:
    """CostModel's communication costs (a mixin: CostModel supplies the attributes below and
    the route caches; the overlapped expert exchange asks the layer costs for its compute)."""

    cluster: Cluster
    model: ModelSpec
    setup: TrainingSetup
    profiles: Profiles
    _route_cache: dict[tuple, Route]
    _allreduce_cache: dict[tuple, tuple[float, float]]

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
            reduce = self.reduce_scatter_phases * (grad * per_byte + fixed)
            gather = params * setup.value_bytes * per_byte + fixed
        else:
            reduce, gather = 2 * (grad * per_byte + fixed), 0.0
        return (overlapped_reduce_s(setup, reduce, params, data_parallel, overlappable_s)
                + overlapped_gather_s(setup, gather, params, data_parallel))

    @functools.cached_property
    def reduce_scatter_phases(self) -> int:
        """All-reduce phases one reduce-scatter takes: one, or two where the job's collectives
        run on torch's gloo backend (a cluster of CPU devices), whose reduce-scatter is a
        whole all-reduce of a copy of the input, then a copy of the rank's shard
        (ProcessGroupGloo::reduce_scatter_tensor_coalesced): 6.4 MB over 4 ranks took 26 ms
        where the all-reduce took 21 and the all-gather 16."""
        return 2 if self.collectives_on_gloo else 1

    @functools.cached_property
    def collectives_on_gloo(self) -> bool:
        """Whether the job's collectives run on torch's gloo backend: a cluster of CPU devices."""
        return all(node.device.vendor == CPU for node in self.cluster.nodes)

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
        """Ring all-reduce of num_bytes over members on `hosts` (one entry per member, in the
        group's rank order; allreduce_terms).

        phases=2 is an all-reduce; phases=1 a reduce-scatter or an all-gather alone.
        """
        if len(hosts) <= 1 or num_bytes == 0:
            return 0.0
        per_byte, fixed = self.allreduce_terms(tuple(hosts), concurrent_crossings)
        return phases * (num_bytes * per_byte + fixed)

    def allreduce_terms(self, hosts: tuple[str, ...], concurrent_crossings: int = 1) -> tuple[float, float]:
        """(seconds per byte, fixed seconds) of one all-reduce phase over members on
        `hosts` (in the group's rank order); the time is linear in the size, so the terms are
        computed once.

        A phase is a ring's n - 1 steps, each moving 1/n of the data over every edge of the
        ring at once: the slowest edge paces it. The ring is the library's: NCCL builds its
        rings node by node (a node's members next to each other, one edge in and one out of
        each node), gloo follows the group's rank order. An edge leaving a node carries the
        NIC share of the node's members in the group (divided among the group's edges
        leaving it). Measured on the emulator (bench/reduction_bench.py): replicas packed
        two per node reduce as this ring, not as a hierarchical all-reduce (inside each node,
        then across nodes on 1/k of the data), which priced their NIC time (n - 1)/n over
        (nodes - 1)/nodes too fast - a third on two nodes."""
        key = (hosts, concurrent_crossings)
        if key in self._allreduce_cache:
            return self._allreduce_cache[key]
        measured = self.profiles.allreduce_fit(hosts)
        if measured is not None:  # a phase is half of the measured all-reduce
            self._allreduce_cache[key] = (measured[0] / 2, measured[1] / 2)
            return self._allreduce_cache[key]
        ring = list(hosts) if self.collectives_on_gloo else self._node_by_node(hosts)
        members = Counter(ring)
        edges = Counter(zip(ring, ring[1:] + ring[:1]))  # each distinct edge priced once
        leaving, entering = Counter(), Counter()
        for (a, b), count in edges.items():
            if a != b:
                leaving[a] += count
                entering[b] += count
        slowest, latency = math.inf, 0.0
        for a, b in edges:
            if a == b:
                route = self.route(a, a)
            else:
                flows = max(1, min(members[a] // leaving[a], members[b] // entering[b]))
                route = self.route(a, b, concurrent_crossings, parallel_flows=flows)
            slowest, latency = min(slowest, route.bandwidth), max(latency, route.latency)
        n = len(ring)
        per_byte, fixed = (n - 1) / n / slowest, (n - 1) * (self._ring_step_s if self._ring_step_s is not None
                                                         else latency)
        self._allreduce_cache[key] = (per_byte, fixed)
        return per_byte, fixed

    @functools.cached_property
    def _ring_step_s(self) -> float | None:
        """A ring step's fixed cost, from the all-reduce the link profile measured over the
        whole job (Profiles.ring_step_s); without one each step waits for the ring's slowest
        edge's latency. The profile's pair latencies are timed right after computing, as
        pipeline messages meet them (megatron/hetero/profiling/network.py): on the emulator
        that is a CPU quota's wait, 3-7 ms, which only a ring's first step pays - charged
        to every step they overpriced a six-rank ring by 22% (bench/reduction_bench.py)."""
        return self.profiles.ring_step_s()

    def _node_by_node(self, hosts: tuple[str, ...]) -> list[str]:
        """The members' hosts as NCCL's ring visits them: node after node."""
        return sorted(hosts, key=lambda h: (self.cluster.node(h).group, h))
