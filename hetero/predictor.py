"""Predicted iteration time, throughput and memory of any plan on a cluster.

One iteration, as megatron-core runs it (no overlap of gradient reduction):
1. every replica runs 1F1B over its own micro-batch count (schedule.py, exact per stage);
2. each rank, when its schedule ends, reduces its stage's gradients over its data-parallel
   group (hierarchical all-reduce, or reduce-scatter + all-gather with the distributed
   optimizer), and the tied embedding's gradient between first and last stage;
3. the gradient-norm all-reduce makes everyone wait for the slowest, then the optimizer
   steps.
So the iteration takes max over stages of (the latest replica's end of that stage + its
reduction) + the slowest optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.cluster import Cluster
from hetero.costs import CostModel
from hetero.errors import PlanError
from hetero.memory import GIB, MemoryEstimate, capacity_bytes, rank_memory, stage_params
from hetero.plan import Plan
from hetero.schedule import Op, StageTiming, simulate_1f1b


@dataclass(frozen=True)
class StageSlot:
    """One (replica, stage): its tensor-parallel group's devices."""

    replica: int
    stage: int
    hosts: tuple[str, ...]
    device_type: str
    vendor: str


@dataclass
class StageReport:
    slot: StageSlot
    num_layers: int
    timing: StageTiming
    memory: MemoryEstimate
    capacity: float


@dataclass
class Prediction:
    iteration_time_s: float
    tokens_per_s: float
    stage_end_s: list[float]
    """Latest end of each stage's schedule over the replicas."""
    reduce_s: list[float]
    """Gradient reduction of each stage."""
    optimizer_s: float
    reports: list[StageReport]
    tflops_per_device: dict[str, float]
    peak_memory_gib: dict[str, float]
    memory_capacity_gib: dict[str, float]
    problems: list[str]
    timelines: dict[int, list[list[Op]]] = field(default_factory=dict)
    """1F1B ops of each replica (replicas with equal timings share one simulation)."""

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {
            "iteration_time_s": round(self.iteration_time_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "tflops_per_device": {k: round(v, 2) for k, v in self.tflops_per_device.items()},
            "peak_memory_gib": {k: round(v, 2) for k, v in self.peak_memory_gib.items()},
            "memory_capacity_gib": self.memory_capacity_gib,
            "pipeline_s": round(max(self.stage_end_s), 6),
            "gradient_reduction_s": [round(x, 6) for x in self.reduce_s],
            "optimizer_s": round(self.optimizer_s, 6),
            "fits_in_memory": self.fits,
        }


def slots(plan: Plan, cluster: Cluster) -> list[list[StageSlot]]:
    """slots[d][s]: the devices of replica d's stage s, checked against the cluster."""
    tp, dp = plan.tensor_parallel, plan.data_parallel
    grid = []
    for d in range(dp):
        row = []
        for s in range(plan.pipeline_parallel):
            entries = [plan.device_of_logical(t + tp * (d + dp * s)) for t in range(tp)]
            for e in entries:
                try:
                    node = cluster.node(e.host)
                except KeyError:
                    raise PlanError(f"the plan places a rank on host {e.host!r}, which the cluster "
                                    f"{cluster.name} does not have") from None
                if node.device.name != e.device_type:
                    raise PlanError(f"the plan says host {e.host} has {e.device_type}; the cluster "
                                    f"{cluster.name} says {node.device.name}")
            slowest = min(entries, key=lambda e: cluster.devices[e.device_type].peak_tflops)
            row.append(StageSlot(d, s, tuple(e.host for e in entries), slowest.device_type, slowest.vendor))
        grid.append(row)
    return grid


def _crossings(cluster: Cluster, pairs: list[tuple[str, str]]) -> int:
    return sum(cluster.node(a).group != cluster.node(b).group for a, b in pairs)


def predict(plan: Plan, cluster: Cluster, costs: CostModel) -> Prediction:
    tp, pp, dp, mbs = plan.tensor_parallel, plan.pipeline_parallel, plan.data_parallel, plan.micro_batch_size
    model, setup = costs.model, costs.setup
    grid = slots(plan, cluster)
    layers = [stage.num_layers for stage in plan.stages]
    message = costs.activation_message_bytes(mbs)

    # Transfers that share inter-group links at a pipeline boundary run at the same time.
    boundary_crossings = [
        tp * _crossings(cluster, [(grid[d][s].hosts[0], grid[d][s + 1].hosts[0]) for d in range(dp)])
        for s in range(pp - 1)
    ]

    def stage_timing(slot: StageSlot) -> StageTiming:
        s, host = slot.stage, slot.hosts[0]
        forward, backward = costs.layer_times(slot.device_type, tp, mbs)
        tp_comm = 2 * costs.tp_allreduce(host, tp, message)  # two per layer each way
        f = layers[s] * (forward + tp_comm)
        b = layers[s] * (backward + tp_comm)
        if s == pp - 1:
            logits_f, logits_b = costs.logits_times(slot.device_type, tp, mbs)
            f, b = f + logits_f, b + logits_b
        d = slot.replica
        send_f = costs.p2p(host, grid[d][s + 1].hosts[0], message, boundary_crossings[s]) if s < pp - 1 else 0.0
        send_b = costs.p2p(host, grid[d][s - 1].hosts[0], message, boundary_crossings[s - 1]) if s > 0 else 0.0
        return StageTiming(f, b, send_f, send_b)

    timings = [[stage_timing(slot) for slot in row] for row in grid]

    # 1. pipelines (replicas with the same timings and micro-batch count simulate once)
    simulated: dict[tuple, list[list[Op]]] = {}
    timelines: dict[int, list[list[Op]]] = {}
    stage_end = [0.0] * pp
    for d in range(dp):
        m = plan.replicas[d].num_micro_batches
        key = (tuple(timings[d]), m)
        if key not in simulated:
            simulated[key] = simulate_1f1b(timings[d], m)
        timelines[d] = simulated[key]
        for s in range(pp):
            stage_end[s] = max(stage_end[s], simulated[key][s][-1].end)

    # 2. gradient reduction per stage
    grad_bytes = costs.precision.grad_bytes
    stage_param_counts = [stage_params(costs, layers[s], s == 0, s == pp - 1, pp) / tp for s in range(pp)]
    dp_hosts = [[[grid[d][s].hosts[t] for d in range(dp)] for t in range(tp)] for s in range(pp)]
    crossing_groups = sum(
        1 for s in range(pp) for t in range(tp)
        if len({cluster.node(h).group for h in dp_hosts[s][t]}) > 1
    )
    reduce_s = []
    for s in range(pp):
        params = stage_param_counts[s]
        per_tp_rank = []
        for t in range(tp):
            hosts = dp_hosts[s][t]
            if setup.distributed_optimizer:
                time = costs.group_allreduce(hosts, params * grad_bytes, crossing_groups, phases=1)
                time += costs.group_allreduce(hosts, params * costs.precision.value_bytes, crossing_groups, phases=1)
            else:
                time = costs.group_allreduce(hosts, params * grad_bytes, crossing_groups)
            per_tp_rank.append(time)
        reduce_s.append(max(per_tp_rank))
    if pp > 1 and not model.untie_embeddings_and_output_weights:
        table = model.vocab_size * model.hidden_size / tp * grad_bytes
        tie = max(costs.group_allreduce([grid[d][0].hosts[t], grid[d][-1].hosts[t]], table)
                  for d in range(dp) for t in range(tp))
        reduce_s[0] += tie
        reduce_s[-1] += tie

    # 3. optimizer
    optimizer_s = 0.0
    for row in grid:
        for slot in row:
            local = stage_param_counts[slot.stage] / (dp if setup.distributed_optimizer else 1)
            optimizer_s = max(optimizer_s, costs.optimizer_step(slot.device_type, local))

    iteration = max(stage_end[s] + reduce_s[s] for s in range(pp)) + optimizer_s

    # throughput and memory
    flops_by_type: dict[str, float] = {}
    devices_by_type: dict[str, int] = {}
    reports, problems = [], []
    peak: dict[str, float] = {}
    capacity_gib: dict[str, float] = {}
    layer_flops = model.layer_forward_flops_per_token() * 3
    logits_flops = model.logits_forward_flops_per_token() * 3
    tokens_per_micro_batch = mbs * model.seq_length
    memories: dict[tuple, MemoryEstimate] = {}
    for d, row in enumerate(grid):
        m = plan.replicas[d].num_micro_batches
        for slot in row:
            s = slot.stage
            work = m * tokens_per_micro_batch * (layers[s] * layer_flops + (logits_flops if s == pp - 1 else 0))
            flops_by_type[slot.device_type] = flops_by_type.get(slot.device_type, 0.0) + work
            devices_by_type[slot.device_type] = devices_by_type.get(slot.device_type, 0) + tp
            key = (slot.vendor, s, min(m, pp - s))
            if key not in memories:
                memories[key] = rank_memory(
                    costs, vendor=slot.vendor, tensor_parallel=tp, data_parallel=dp, micro_batch_size=mbs,
                    num_layers=layers[s], stage=s, num_stages=pp, num_micro_batches=m,
                    distributed_optimizer=setup.distributed_optimizer,
                )
            memory = memories[key]
            device = cluster.devices[slot.device_type]
            capacity = capacity_bytes(device.memory_gib)
            capacity_gib[slot.device_type] = device.memory_gib
            reports.append(StageReport(slot, layers[s], timings[d][s], memory, capacity))
            peak[slot.device_type] = max(peak.get(slot.device_type, 0.0), memory.total / GIB)
            if memory.total > capacity:
                problems.append(
                    f"replica {d} stage {s} ({slot.device_type}, {layers[s]} layers) needs "
                    f"{memory.total / GIB:.1f} GiB of {device.memory_gib:g} GiB"
                )
    tflops = {k: flops_by_type[k] / devices_by_type[k] / iteration / 1e12 for k in flops_by_type}
    return Prediction(
        iteration_time_s=iteration,
        tokens_per_s=plan.global_batch_size * model.seq_length / iteration,
        stage_end_s=stage_end,
        reduce_s=reduce_s,
        optimizer_s=optimizer_s,
        reports=reports,
        tflops_per_device=tflops,
        peak_memory_gib=peak,
        memory_capacity_gib=capacity_gib,
        problems=problems,
        timelines=timelines,
    )
