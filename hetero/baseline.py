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
from dataclasses import dataclass

from hetero.cluster import Cluster
from hetero.costs import CostModel, TrainingSetup
from hetero.errors import HeteroError
from hetero.model import ModelSpec
from hetero.plan import DeviceEntry, Plan
from hetero.planner import Planner, PlannerOptions, setup_for
from hetero.predictor import Prediction, predict
from hetero.profiles import Profiles


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


def _best_uniform(cluster: Cluster, model: ModelSpec, global_batch_size: int,
                  options: PlannerOptions, profiles: Profiles | None) -> tuple[Plan, Prediction] | None:
    """The fastest uniform plan; like a Megatron user, it leaves the last devices out when
    the degrees do not divide the device count or the batch, and recomputes activations
    (job-wide, the cheapest mode that fits) when they do not fit."""
    devices = _launch_order_devices(cluster)
    best = None
    for tp in options.tensor_parallel:
        if any(n.count % tp for n in cluster.nodes):
            continue  # Megatron's TP groups would straddle nodes
        setup = setup_for(options, tp)
        costs_by_mode = {mode: CostModel(cluster, model, dataclasses.replace(setup, recompute=mode), profiles)
                         for mode in options.recompute_modes}
        for pp in range(1, model.num_layers + 1):
            if model.num_layers % pp:
                continue
            for mbs in options.micro_batch_sizes:
                dp = len(devices) // (tp * pp)
                while dp > 0 and global_batch_size % (mbs * dp):
                    dp -= 1
                if dp == 0:
                    continue
                plan = Plan.uniform(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
                                    micro_batch_size=mbs, num_layers=model.num_layers,
                                    global_batch_size=global_batch_size,
                                    devices=devices[: tp * pp * dp])
                for costs in costs_by_mode.values():
                    prediction = predict(plan, cluster, costs)
                    if prediction.fits:
                        if best is None or prediction.iteration_time_s < best[1].iteration_time_s:
                            best = (plan, prediction, costs.setup)
                        break
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
