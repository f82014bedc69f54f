"""Predicted iteration time, throughput and memory of any plan on a cluster.

One iteration, as megatron-core runs it:
1. every replica runs 1F1B over its own micro-batch count (schedule.py, exact per stage),
   or with virtual stages megatron-core's interleaved 1F1B (interleaved_schedule.py: its op
   order, each chunk's own work, a transfer at every chunk boundary, the wrap-around from
   the last stage to the first included);
2. each rank, when its schedule ends, reduces its stage's gradients over its data-parallel
   group (a ring all-reduce, or reduce-scatter + all-gather with the distributed
   optimizer; overlapped with the last backward when asked), and the tied embedding's
   gradient between first and last stage; with expert parallelism the experts' gradients
   go over the expert data-parallel group instead (the ranks holding the same experts);
3. the gradient-norm all-reduce makes everyone wait for the slowest, then the optimizer
   steps.
So the iteration takes max over stages of (the latest replica's end of that stage + its
reduction) + the slowest optimizer step. Every time comes from CostModel (costs.py),
every memory figure from memory.py: the planner's fast estimate uses the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from hetero.spec.cluster import Cluster
from hetero.predict.costs import CostModel
from hetero.errors import PlanError
from hetero.predict.memory import GIB, MemoryEstimate, capacity_bytes, rank_memory, rank_params, stage_params
from hetero.plan import Plan
from hetero.predict.interleaved_schedule import ChunkTiming, simulate_interleaved
from hetero.predict.schedule import Op, StageTiming, simulate_1f1b
from hetero.predict.stragglers import replica_spread, slowest_of
from hetero.predict.expert_exchange import expert_exchange_beyond_node_s, unpaired_exchange_s
from hetero.predict.moe_overlap import unpaired_share
from hetero.predict.tied_embedding import tied_embedding_sync_s
from hetero.predict.templates import predict_templates


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
    """Schedule ops of each replica (replicas with equal timings share one simulation)."""
    reduction_start_s: float | None = None
    """A plan of several templates (templates.py): when the cross-template gradient reduction
    starts (the slowest replica's end); stage_end_s and reduce_s then list every template's
    stages, template by template."""

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
    grid = []
    dp = plan.data_parallel
    for d in range(dp):
        row = []
        for s in range(plan.pipeline_parallel):
            entries = [plan.device_of_logical(r) for r in plan.grid.tensor_group(d, s)]
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


def stage_recompute(plan: Plan, stage: int, costs: CostModel) -> str:
    """A stage's recomputation: its own entry's, else the job's."""
    return plan.stages[stage].recompute_mode() or costs.setup.recompute


def _crossings(cluster: Cluster, pairs: list[tuple[str, str]]) -> int:
    return sum(cluster.node(a).group != cluster.node(b).group for a, b in pairs)


@dataclass(frozen=True)
class StageWork:
    """One (replica, stage)'s work per micro-batch, as the schedules take it apart: its
    decoder layers, what its ends add, and its transfers."""

    num_layers: int
    layer_forward_s: float
    """One decoder layer (its tensor-parallel and expert communication included)."""
    layer_backward_s: float
    end_forward_s: float
    """Beyond the layers (stage_extra_times): the first stage's batch and embedding, the last
    stage's output layer, loss and multi-token-prediction layers."""
    end_backward_s: float
    send_forward_s: float = 0.0
    """Its output to the next stage (0 from the last)."""
    send_backward_s: float = 0.0
    """Its input's gradient to the previous stage (0 from the first)."""
    wrap_forward_s: float = 0.0
    """Interleaved: the last stage's output to the first stage's next chunk."""
    wrap_backward_s: float = 0.0
    """Interleaved: the first stage's gradient to the last stage's previous chunk."""

    @property
    def timing(self) -> StageTiming:
        """The whole stage per micro-batch (non-interleaved 1F1B)."""
        return StageTiming(self.num_layers * self.layer_forward_s + self.end_forward_s,
                           self.num_layers * self.layer_backward_s + self.end_backward_s,
                           self.send_forward_s, self.send_backward_s)

    def chunks(self, chunk_layers: Sequence[float], first: bool, last: bool) -> list[ChunkTiming]:
        """The stage's model chunks: each its own layers; the embedding in the first stage's
        first chunk, the output layer and loss in the last stage's last chunk; every chunk's
        output sent on, from the last stage around to the first."""
        v = len(chunk_layers)
        chunks = []
        for c, layers in enumerate(chunk_layers):
            ends = (first and c == 0) or (last and c == v - 1)
            send_forward = self.send_forward_s if not last else (self.wrap_forward_s if c < v - 1 else 0.0)
            send_backward = self.send_backward_s if not first else (self.wrap_backward_s if c > 0 else 0.0)
            chunks.append(ChunkTiming(layers * self.layer_forward_s + (self.end_forward_s if ends else 0.0),
                                      layers * self.layer_backward_s + (self.end_backward_s if ends else 0.0),
                                      send_forward, send_backward))
        return chunks


def stage_works(plan: Plan, cluster: Cluster, costs: CostModel, grid: list[list[StageSlot]]) -> list[list[StageWork]]:
    """Per (replica, stage): one micro-batch's layers, ends and sends."""
    pp, dp, mbs = plan.pipeline_parallel, plan.data_parallel, plan.micro_batch_size
    tps = plan.stage_tensor_parallel
    # Transfers that share inter-group links at a pipeline boundary run at the same time.
    boundary_crossings = [
        max(tps[s], tps[s + 1])
        * _crossings(cluster, [(grid[d][s].hosts[0], grid[d][s + 1].hosts[0]) for d in range(dp)])
        for s in range(pp - 1)
    ]
    interleaved = virtual_stages_of(plan, costs) > 1
    wrap_crossings = max(tps[0], tps[-1]) * _crossings(cluster, [(row[-1].hosts[0], row[0].hosts[0]) for row in grid])

    def work(slot: StageSlot) -> StageWork:
        s, d, host, tp = slot.stage, slot.replica, slot.hosts[0], tps[slot.stage]
        layer = costs.layer_cost(slot.device_type, host, tp, mbs, stage_recompute(plan, s, costs))
        layer_f, layer_b = layer.forward_s, layer.backward_s
        end_f, end_b = costs.stage_extra_times(slot.device_type, tp, mbs, first=s == 0, last=s == pp - 1)
        if plan.expert_parallel > 1:  # layer_cost priced the all-to-alls as if inside this node
            group, recompute = expert_group_hosts(plan, d, s), stage_recompute(plan, s, costs)
            beyond = expert_exchange_beyond_node_s(costs, group, host, slot.device_type, tp, mbs, recompute)
            # ... and, with the overlap, as if every chunk were paired: the warm-up's and the
            # cool-down's are not (averaged over the stage's chunks).
            alone = unpaired_share(plan.replicas[d].num_micro_batches, pp, s, costs.setup.virtual_stages)
            unpaired = unpaired_exchange_s(costs, group, slot.device_type, tp, mbs, recompute)
            per_layer = beyond[0] + alone * unpaired[0], beyond[1] + alone * unpaired[1]
            layer_f, layer_b = layer_f + per_layer[0], layer_b + per_layer[1]
            # (the last stage's multi-token-prediction layers exchange tokens too)
            mtp = costs.mtp_exchange_layers() if s == pp - 1 else 0.0
            end_f, end_b = end_f + mtp * per_layer[0], end_b + mtp * per_layer[1]

        def transfer(to: int, crossings: int) -> float:
            return costs.stage_transfer(host, grid[d][to].hosts[0], tp, mbs, crossings, tps[to])

        send_f = transfer(s + 1, boundary_crossings[s]) if s < pp - 1 else 0.0
        send_b = transfer(s - 1, boundary_crossings[s - 1]) if s > 0 else 0.0
        wrap_f = transfer(0, wrap_crossings) if interleaved and s == pp - 1 else 0.0
        wrap_b = transfer(pp - 1, wrap_crossings) if interleaved and s == 0 else 0.0
        return StageWork(plan.stages[s].num_layers, layer_f, layer_b, end_f, end_b, send_f, send_b, wrap_f, wrap_b)

    return [[work(slot) for slot in row] for row in grid]


def virtual_stages_of(plan: Plan, costs: CostModel) -> int:
    """Model chunks per pipeline stage: the plan's virtual stages, else the setup's."""
    return plan.virtual_pipeline_size or costs.setup.virtual_stages


def chunk_layers(plan: Plan, stage: int, virtual_stages: int) -> list[float]:
    """Decoder layers of each of a stage's model chunks: the plan's virtual stages, or its
    layers split evenly."""
    entry = plan.stages[stage]
    if entry.virtual_stages:
        return list(entry.virtual_stages)
    return [entry.num_layers / virtual_stages] * virtual_stages


def expert_group_hosts(plan: Plan, replica: int, stage: int) -> tuple[str, ...]:
    """The hosts of the expert-parallel group holding replica's first rank of a stage."""
    first = plan.grid.tensor_group(replica, stage)[0]
    group = next(g for g in plan.grid.expert_groups(stage) if first in g)
    return tuple(plan.device_of_logical(r).host for r in group)


def micro_batch_spreads(plan: Plan, costs: CostModel, grid: list[list[StageSlot]],
                        timings: list[list[StageTiming]]) -> list[list[float]]:
    """spreads[d][s]: the standard deviation of one micro-batch's forward and backward on
    replica d's stage s, from its device's measured variation (hetero/predict/stragglers.py)."""
    tps, mbs = plan.stage_tensor_parallel, plan.micro_batch_size
    return [[costs.micro_batch_cv(slot.device_type, tps[slot.stage], mbs)
             * (timings[d][slot.stage].forward_s + timings[d][slot.stage].backward_s) for slot in row]
            for d, row in enumerate(grid)]


def simulate_pipelines(plan: Plan, works: list[list[StageWork]], virtual_stages: int = 1,
                       spreads: list[list[float]] | None = None) -> tuple[list[float], dict[int, list[list[Op]]]]:
    """(expected latest end of each stage over the replicas, each replica's ops). Replicas
    with the same work and micro-batch count simulate once: 1F1B (schedule.py), or with
    virtual stages megatron-core's interleaved schedule over the stages' chunks
    (interleaved_schedule.py). spreads (micro_batch_spreads): the replicas meet at the
    gradient reduction, so a stage ends when its slowest replica does, later than the
    slowest mean when they vary."""
    simulated: dict[tuple, list[list[Op]]] = {}
    timelines: dict[int, list[list[Op]]] = {}
    pp = plan.pipeline_parallel
    ends: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    v = virtual_stages
    layers = [chunk_layers(plan, s, v) for s in range(pp)]
    for d, row in enumerate(works):
        m = plan.replicas[d].num_micro_batches
        key = (tuple(row), m)
        if key not in simulated:
            if v == 1:
                simulated[key] = simulate_1f1b([work.timing for work in row], m)
            else:
                simulated[key] = simulate_interleaved(
                    [work.chunks(layers[s], s == 0, s == pp - 1) for s, work in enumerate(row)], m)
        timelines[d] = simulated[key]
        for s, ops in enumerate(simulated[key]):
            ends[s].append((ops[-1].end, replica_spread(spreads[d][s], m) if spreads else 0.0))
    return [slowest_of(replicas) for replicas in ends], timelines


def gradient_reduction(plan: Plan, cluster: Cluster, costs: CostModel, grid: list[list[StageSlot]],
                       timings: list[list[StageTiming]]) -> list[float]:
    """Exposed gradient synchronisation of each stage (its slowest tensor-parallel rank),
    plus the tied embedding's all-reduce on the first and last stage."""
    pp, dp, tps = plan.pipeline_parallel, plan.data_parallel, plan.stage_tensor_parallel
    model = costs.model
    hosts = [[[grid[d][s].hosts[t] for d in range(dp)] for t in range(tps[s])] for s in range(pp)]
    crossing_groups = sum(1 for s in range(pp) for t in range(tps[s])
                          if len({cluster.node(h).group for h in hosts[s][t]}) > 1)
    # The experts' gradients reduce over their own groups, all stages' at once: those that span
    # cluster groups share the links between them as the dense groups do.
    expert_crossings = sum(
        1 for s in range(pp) for group in (plan.grid.expert_data_groups(s) if plan.expert_parallel > 1 else ())
        if len({cluster.node(plan.device_of_logical(r).host).group for r in group}) > 1)
    reduce_s = []
    for s in range(pp):
        last_backward = min(timings[d][s].backward_s for d in range(dp))
        if plan.expert_parallel > 1:
            reduce_s.append(_expert_plan_reduction(plan, costs, s, hosts[s], crossing_groups, max(1, expert_crossings),
                                                   last_backward))
            continue
        params = stage_params(costs, plan.stages[s].num_layers, s == 0, s == pp - 1, pp) / tps[s]
        reduce_s.append(max(
            costs.gradient_sync(costs.allreduce_terms(tuple(hosts[s][t]), crossing_groups), params, dp, last_backward)
            for t in range(tps[s])))
    if pp > 1 and not model.untie_embeddings_and_output_weights:
        tie = tied_embedding_sync_s(costs, [grid[d][0].hosts for d in range(dp)],
                                    [grid[d][-1].hosts for d in range(dp)])
        reduce_s[0] += tie
        reduce_s[-1] += tie
    return reduce_s


def _expert_plan_reduction(plan: Plan, costs: CostModel, s: int, hosts: list[list[str]], crossing_groups: int,
                           expert_crossings: int, last_backward: float) -> float:
    """A stage's gradient reduction with expert parallelism: the dense parameters over the
    data-parallel group, then the expert parameters over the expert data-parallel group
    (the ranks holding the same expert shard), as megatron-core's DDP does (two buffers)."""
    pp, dp, tp = plan.pipeline_parallel, plan.data_parallel, plan.stage_tensor_parallel[s]
    dense, experts = rank_params(costs, plan.stages[s].num_layers, s == 0, s == pp - 1, pp, tp)
    dense_s = max(costs.gradient_sync(costs.allreduce_terms(tuple(hosts[t]), crossing_groups), dense, dp, last_backward)
                  for t in range(tp))
    expert_s = 0.0
    for group in plan.grid.expert_data_groups(s):
        group_hosts = tuple(plan.device_of_logical(r).host for r in group)
        expert_s = max(expert_s, costs.gradient_sync(costs.allreduce_terms(group_hosts, expert_crossings), experts,
                                                     len(group)))
    return dense_s + expert_s


def optimizer_time(plan: Plan, costs: CostModel, grid: list[list[StageSlot]]) -> float:
    """The slowest rank's optimizer step (the gradient-norm all-reduce synchronises all)."""
    pp, share = plan.pipeline_parallel, plan.data_parallel if costs.setup.distributed_optimizer else 1
    if plan.expert_parallel > 1:
        def rank_share(s: int) -> float:
            tp = plan.stage_tensor_parallel[s]
            dense, experts = rank_params(costs, plan.stages[s].num_layers, s == 0, s == pp - 1, pp, tp)
            if not costs.setup.distributed_optimizer:
                return dense + experts
            return dense / share + experts / costs.expert_data_parallel_at(tp, plan.data_parallel)
        return max(costs.optimizer_step(slot.device_type, rank_share(slot.stage)) for row in grid for slot in row)
    return max(
        costs.optimizer_step(slot.device_type, stage_params(
            costs, plan.stages[slot.stage].num_layers, slot.stage == 0, slot.stage == pp - 1, pp)
            / plan.stage_tensor_parallel[slot.stage] / share)
        for row in grid for slot in row)


def slot_memories(plan: Plan, costs: CostModel,
                  grid: list[list[StageSlot]]) -> Iterator[tuple[StageSlot, MemoryEstimate]]:
    """Each (replica, stage)'s memory, replica by replica (ranks alike share one estimate)."""
    pp = plan.pipeline_parallel
    memories: dict[tuple, MemoryEstimate] = {}
    for d, row in enumerate(grid):
        m = plan.replicas[d].num_micro_batches
        for slot in row:
            s = slot.stage
            key = (slot.vendor, s, min(m, pp - s) if costs.setup.virtual_stages == 1 else m)
            if key not in memories:
                memories[key] = rank_memory(
                    costs, vendor=slot.vendor, tensor_parallel=plan.stage_tensor_parallel[s],
                    data_parallel=plan.data_parallel, micro_batch_size=plan.micro_batch_size,
                    num_layers=plan.stages[s].num_layers, stage=s, num_stages=pp, num_micro_batches=m,
                    recompute=stage_recompute(plan, s, costs))
            yield slot, memories[key]


def stage_memories(plan: Plan, cluster: Cluster, costs: CostModel, grid: list[list[StageSlot]],
                   timings: list[list[StageTiming]]) -> tuple[list[StageReport], list[str]]:
    """Each (replica, stage)'s memory, and what does not fit."""
    reports, problems = [], []
    for slot, memory in slot_memories(plan, costs, grid):
        d, s, layers = slot.replica, slot.stage, plan.stages[slot.stage].num_layers
        device = cluster.devices[slot.device_type]
        reports.append(StageReport(slot, layers, timings[d][s], memory, capacity_bytes(device.memory_gib)))
        if memory.total > capacity_bytes(device.memory_gib):
            problems.append(
                f"replica {d} stage {s} ({slot.device_type}, {layers} layers) needs "
                f"{memory.total / GIB:.1f} GiB of {device.memory_gib:g} GiB"
            )
    return reports, problems


def fits_in_memory(plan: Plan, cluster: Cluster, costs: CostModel) -> bool:
    """predict(plan, cluster, costs).fits, without predicting the time."""
    if plan.num_templates > 1:
        return all(fits_in_memory(plan.template_plan(k), cluster, costs) for k in range(plan.num_templates))
    costs = costs.with_experts(plan.expert_parallel, plan.expert_tensor_parallel)
    return all(memory.total <= capacity_bytes(cluster.devices[slot.device_type].memory_gib)
               for slot, memory in slot_memories(plan, costs, slots(plan, cluster)))


def model_tflops(plan: Plan, costs: CostModel, grid: list[list[StageSlot]], iteration_s: float) -> dict[str, float]:
    """Model TFLOP/s per device, by device type (recomputation not counted)."""
    model, pp = costs.model, plan.pipeline_parallel
    tokens = plan.micro_batch_size * model.seq_length
    layer_flops = model.layer_forward_flops_per_token() * 3
    logits_flops = model.logits_forward_flops_per_token() * 3
    flops: dict[str, float] = {}
    devices: dict[str, int] = {}
    for d, row in enumerate(grid):
        for slot in row:
            work = plan.stages[slot.stage].num_layers * layer_flops + (logits_flops if slot.stage == pp - 1 else 0)
            flops[slot.device_type] = flops.get(slot.device_type, 0.0) + plan.replicas[d].num_micro_batches * tokens * work
            devices[slot.device_type] = devices.get(slot.device_type, 0) + plan.stage_tensor_parallel[slot.stage]
    return {k: flops[k] / devices[k] / iteration_s / 1e12 for k in flops}


def predict(plan: Plan, cluster: Cluster, costs: CostModel) -> Prediction:
    if plan.num_templates > 1:  # each template as a plan of its own, then their common reduction
        return predict_templates(plan, cluster, costs, predict)
    costs = costs.with_experts(plan.expert_parallel, plan.expert_tensor_parallel)
    grid = slots(plan, cluster)
    works = stage_works(plan, cluster, costs, grid)
    timings = [[work.timing for work in row] for row in works]
    spreads = micro_batch_spreads(plan, costs, grid, timings)
    stage_end, timelines = simulate_pipelines(plan, works, virtual_stages_of(plan, costs), spreads)
    reduce_s = gradient_reduction(plan, cluster, costs, grid, timings)
    optimizer_s = optimizer_time(plan, costs, grid)
    iteration = max(end + reduce for end, reduce in zip(stage_end, reduce_s)) + optimizer_s
    reports, problems = stage_memories(plan, cluster, costs, grid, timings)
    peak: dict[str, float] = {}
    for report in reports:
        device_type = report.slot.device_type
        peak[device_type] = max(peak.get(device_type, 0.0), report.memory.total / GIB)
    return Prediction(
        iteration_time_s=iteration,
        tokens_per_s=plan.global_batch_size * costs.model.seq_length / iteration,
        stage_end_s=stage_end,
        reduce_s=reduce_s,
        optimizer_s=optimizer_s,
        reports=reports,
        tflops_per_device=model_tflops(plan, costs, grid, iteration),
        peak_memory_gib=peak,
        memory_capacity_gib={t: cluster.devices[t].memory_gib for t in peak},
        problems=problems,
        timelines=timelines,
    )
