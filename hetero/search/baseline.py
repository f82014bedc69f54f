"""Yardsticks for a plan: what stock Megatron would do, and the best one could hope for.

Megatron baseline: what a Megatron user runs today on the same cluster: uniform layers
per stage, launch-order ranks, equal micro-batches per replica, the best such degrees
(TP, PP, micro-batch size) by the same predictor. If no uniform plan fits on all devices,
the user would run on one device type alone: the best of those.

Upper bound (HetHub's definition): the sum over device types of the throughput each type
reaches training the model alone, each with its share of the global batch; a type that
cannot hold the model alone is measured on a larger cluster of its kind and scaled back
to its device count.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Iterator

from hetero.spec.cluster import Cluster
from hetero.predict.costs import CostModel
from hetero.predict.training_setup import TrainingSetup
from hetero.errors import HeteroError
from hetero.spec.model import ModelSpec
from hetero.grid import Grid
from hetero.plan import DeviceEntry, Plan
from hetero.search.options import FLOOR_ROUNDING, PlannerOptions, setup_for
from hetero.search.planner import Planner
from hetero.predict.predictor import Prediction, fits_in_memory, predict
from hetero.spec.profiles import Profiles
from hetero.predict.schedule import StageTiming, stage_ends_1f1b, timing_shape


@dataclass
class Baseline:
    plan: Plan
    prediction: Prediction
    devices: str
    """Which devices it runs on, in words."""
    setup: TrainingSetup
    """Its settings (recomputation, sequence parallelism)."""

    def to_dict(self) -> dict:
        p = self.plan
        return {
            "devices": self.devices,
            "tensor_parallel": p.tensor_parallel,
            "pipeline_parallel": p.pipeline_parallel,
            "data_parallel": p.data_parallel,
            "micro_batch_size": p.micro_batch_size,
            "recompute": self.setup.recompute,
            "iteration_time_s": round(self.prediction.iteration_time_s, 6),
            "tokens_per_s": round(self.prediction.tokens_per_s, 1),
        }


def _launch_order_devices(cluster: Cluster) -> list[DeviceEntry]:
    return [
        DeviceEntry(host=n.host, device_type=n.device.name, vendor=n.device.vendor, nic=n.nic.kind.name)
        for n in cluster.nodes for _ in range(n.count)
    ]


@dataclass(frozen=True)
class _UniformLayout:
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    micro_batch_size: int


def _uniform_layouts(cluster: Cluster, model: ModelSpec, global_batch_size: int,
                     options: PlannerOptions) -> list[_UniformLayout]:
    """The degrees a Megatron user can run: TP groups inside nodes, PP dividing the layers,
    the most replicas that fit the devices and divide the batch."""
    layouts = []
    for tp in options.tensor_parallel:
        if any(n.count % tp for n in cluster.nodes):
            continue  # Megatron's TP groups would straddle nodes
        for pp in range(1, model.num_layers + 1):
            if model.num_layers % pp or (options.pipeline_parallel is not None and pp not in options.pipeline_parallel):
                continue
            for mbs in options.micro_batch_sizes:
                dp = cluster.num_devices // (tp * pp)
                while dp > 0 and global_batch_size % (mbs * dp):
                    dp -= 1
                if dp > 0:
                    layouts.append(_UniformLayout(tp, pp, dp, mbs))
    return layouts


@dataclass
class _ComputeOnly:
    """A layout's first and last replica (when they differ) with compute alone, under the
    cheapest recomputation: lower bounds of its predicted time (a schedule only gets longer
    as any of its ops does; sends, gradient reduction and the optimizer add time)."""

    replicas: list[tuple[StageTiming, ...]]
    micro_batches: int

    def busiest_stage(self) -> float:
        """A floor: a stage runs every micro-batch's forward and backward one after the other
        (PipelineShape.busiest_stage)."""
        busiest = max(timing_shape(row).busiest_stage(self.micro_batches) for row in self.replicas)
        return busiest * (1 - FLOOR_ROUNDING)

    def schedule(self) -> float:
        """A tighter floor (and a slower one to get): the 1F1B schedule itself, simulated."""
        scheduled = max(max(stage_ends_1f1b(list(row), self.micro_batches)) for row in self.replicas)
        return max(scheduled * (1 - FLOOR_ROUNDING), self.busiest_stage())


def _compute_only(model: ModelSpec, global_batch_size: int, layout: _UniformLayout, devices: list[DeviceEntry],
                  costs: list[CostModel]) -> _ComputeOnly:
    """_ComputeOnly of a uniform plan of this layout on the launch-order devices; costs:
    one cost model per recomputation mode."""
    tp, pp, dp, mbs = layout.tensor_parallel, layout.pipeline_parallel, layout.data_parallel, layout.micro_batch_size
    layers = model.num_layers // pp

    def stage(device: DeviceEntry, s: int) -> StageTiming:
        layer = [c.layer_cost(device.device_type, device.host, tp, mbs, c.setup.recompute) for c in costs]
        extra = costs[0].stage_extra_times(device.device_type, tp, mbs, first=s == 0, last=s == pp - 1)
        return StageTiming(layers * min(x.forward_s for x in layer) + extra[0],
                           layers * min(x.backward_s for x in layer) + extra[1])

    grid = Grid.single(tp, dp, pp)

    def replica(d: int) -> tuple[StageTiming, ...]:  # the uniform plan's rank_order is the identity
        return tuple(stage(devices[grid.rank_at(0, d, s)], s) for s in range(pp))

    return _ComputeOnly(list(dict.fromkeys([replica(0), replica(dp - 1)])), global_batch_size // (mbs * dp))


def _in_floor_order(layouts: list[_ComputeOnly]) -> Iterator[tuple[float, int]]:
    """(schedule floor, index) of every layout, lowest first (ties by index); a schedule is
    simulated only once its busiest-stage floor, never higher, comes first."""
    heap = [(layout.busiest_stage(), index, False) for index, layout in enumerate(layouts)]
    heapq.heapify(heap)
    while heap:
        floor, index, scheduled = heapq.heappop(heap)
        if scheduled:
            yield floor, index
        else:
            heapq.heappush(heap, (layouts[index].schedule(), index, True))


def _best_uniform(cluster: Cluster, model: ModelSpec, global_batch_size: int, options: PlannerOptions,
                  profiles: Profiles | None) -> tuple[Plan, Prediction, TrainingSetup] | None:
    """The fastest uniform plan; like a Megatron user, it leaves the last devices out when
    the degrees do not divide the device count or the batch, and recomputes activations
    (job-wide, the cheapest mode that fits) when they do not fit. Layouts are predicted from
    the lowest floor of their time up, and only while a floor stays under the best time:
    the others cannot win. Ties go to the first layout in (TP, PP, micro-batch) order."""
    devices = _launch_order_devices(cluster)
    layouts = _uniform_layouts(cluster, model, global_batch_size, options)
    costs_by_tp = {tp: [CostModel(cluster, model, dataclasses.replace(setup_for(options, tp), recompute=mode),
                                  profiles) for mode in options.recompute_modes]
                   for tp in {layout.tensor_parallel for layout in layouts}}
    compute_only = [_compute_only(model, global_batch_size, layout, devices, costs_by_tp[layout.tensor_parallel])
                    for layout in layouts]
    best, best_rank = None, None
    for floor, index in _in_floor_order(compute_only):
        if best is not None and floor > best[1].iteration_time_s:
            break
        layout = layouts[index]
        world = layout.tensor_parallel * layout.pipeline_parallel * layout.data_parallel
        plan = Plan.uniform(tensor_parallel=layout.tensor_parallel, pipeline_parallel=layout.pipeline_parallel,
                            data_parallel=layout.data_parallel, micro_batch_size=layout.micro_batch_size,
                            num_layers=model.num_layers, global_batch_size=global_batch_size,
                            devices=devices[:world])
        costs = next((c for c in costs_by_tp[layout.tensor_parallel] if fits_in_memory(plan, cluster, c)), None)
        if costs is None:
            continue
        prediction = predict(plan, cluster, costs)
        rank = (prediction.iteration_time_s, index)
        if best_rank is None or rank < best_rank:
            best, best_rank = (plan, prediction, costs.setup), rank
    return best


def megatron_baseline(cluster: Cluster, model: ModelSpec, global_batch_size: int,
                      options: PlannerOptions = PlannerOptions(),
                      profiles: Profiles | None = None) -> Baseline | None:
    found = _best_uniform(cluster, model, global_batch_size, options, profiles)
    if found is not None:
        used = found[0].world_size
        label = ("all devices" if used == cluster.num_devices
                 else f"the first {used} of {cluster.num_devices} devices")
        return Baseline(found[0], found[1], label, found[2])
    alone = []
    for device_type in cluster.device_counts():
        sub = cluster.only(device_type)
        found = _best_uniform(sub, model, global_batch_size, options, profiles)
        if found is not None:
            alone.append(Baseline(found[0], found[1], f"the {device_type} devices only", found[2]))
    return min(alone, key=lambda b: b.prediction.iteration_time_s, default=None)


@dataclass
class UpperBound:
    tokens_per_s: float
    per_type: dict[str, float]
    """Each device type's contribution (tokens/s)."""

    def to_dict(self) -> dict:
        return {"tokens_per_s": round(self.tokens_per_s, 1),
                "per_device_type": {k: round(v, 1) for k, v in self.per_type.items()}}


def upper_bound(cluster: Cluster, model: ModelSpec, global_batch_size: int,
                options: PlannerOptions = PlannerOptions(), profiles: Profiles | None = None,
                scales: tuple[int, ...] = (1, 2, 4), max_devices: int = 2048,
                max_scale: int = 64) -> UpperBound:
    """Each device type's best per-device throughput training alone, times its count.

    "Best" looks at the type's own nodes and at 2x and 4x as many (up to max_devices), each
    with its share of the global batch scaled alike: a type whose memory is tight alone
    can do better with more of its kind. A type that cannot hold the model at all is
    grown until it can (up to max_scale).
    """
    total = cluster.num_devices
    per_type = {}
    for device_type, count in cluster.device_counts().items():
        share = max(1, round(global_batch_size * count / total))
        sub = cluster.only(device_type)
        best_per_device, scale = 0.0, 1
        while scale <= max_scale:
            if scale > 1 and count * scale > max_devices and best_per_device > 0:
                break
            try:
                result = Planner(sub.scaled(scale) if scale > 1 else sub, model, share * scale,
                                 options, profiles).plan()
                best_per_device = max(best_per_device, result.prediction.tokens_per_s / (count * scale))
            except HeteroError:
                pass
            if best_per_device > 0 and scale >= max(scales):
                break
            scale *= 2
        if best_per_device == 0:
            raise HeteroError(f"{device_type} cannot train {model.total_params() / 1e9:.1f}B "
                              f"parameters even with {max_scale}x as many devices")
        per_type[device_type] = best_per_device * count
    return UpperBound(sum(per_type.values()), per_type)
