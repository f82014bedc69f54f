"""A job planned: the plan with its prediction, the Megatron baseline and the upper bound,
the precision chosen, and the record of the job written into the plan (model, training,
cluster, prediction, provenance) so that it can be explained or planned again later
(after a lost node, for another cluster).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from hetero.errors import HeteroError, PlanError
from hetero.plan import Plan
from hetero.predict.costs import CostModel, TrainingSetup
from hetero.predict.predictor import Prediction, predict
from hetero.record import ModelRecord, PredictionRecord, ProvenanceRecord, TrainingRecord
from hetero.search.baseline import megatron_baseline, upper_bound
from hetero.search.planner import Planner, PlannerOptions
from hetero.spec.cluster import Cluster, ClusterSpec
from hetero.spec.model import ModelSpec
from hetero.spec.profiles import Profiles

VERSION = "0.1.0"


@dataclass
class PlannedJob:
    plan: Plan
    prediction: Prediction
    cluster: Cluster


def precision_choices(cluster: Cluster, requested: str | None) -> tuple[str, Cluster, str]:
    """(precision to plan in, the devices that run it, why).

    Asked for a precision: the devices that support it (the others left out, and said so).
    Not asked: bf16 when every device has it; else fp16 on every device (the planner may
    still leave the devices without bf16 out; plan_job then switches to bf16).
    """
    counts = cluster.device_counts()
    kept = [t for t in counts if cluster.devices[t].supports(requested or "bf16")]
    left_out = [t for t in counts if t not in kept]
    if requested is not None:
        if not kept:
            raise HeteroError(f"no device of cluster {cluster.name} supports {requested}; "
                              "choose another --precision")
        if left_out:
            return (requested, cluster.keep(kept),
                    f"{requested} as asked; {', '.join(left_out)} left out (no {requested})")
        return requested, cluster, f"{requested} as asked"
    if not left_out:
        return "bf16", cluster, "bf16: every device supports it"
    return "fp16", cluster, f"fp16 on all devices ({', '.join(left_out)} has no bf16)"


def _prefer_bf16(cluster: Cluster, model: ModelSpec, result, profiles: Profiles | None):
    """An fp16 plan that uses only devices with bf16, predicted again in bf16: the same
    speed (same peak rates) but fp32 gradients; taken when it still fits and is no more
    than 5% slower (bf16 needs no loss scaling)."""
    used = {d.device_type for d in result.plan.devices}
    if not all(cluster.devices[t].supports("bf16") for t in used):
        return None
    setup = dataclasses.replace(result.setup, precision="bf16")
    prediction = predict(result.plan, cluster, CostModel(cluster, model, setup, profiles))
    if prediction.fits and prediction.iteration_time_s <= 1.05 * result.prediction.iteration_time_s:
        left_out = sorted(t for t in cluster.device_counts() if t not in used)
        why = f"bf16: the plan leaves {', '.join(left_out)} out (no bf16), every device it uses has bf16"
        return dataclasses.replace(result, prediction=prediction, setup=setup), why
    return None


def plan_job(cluster: Cluster, model: ModelSpec, global_batch_size: int,
             options: PlannerOptions = PlannerOptions(), profiles: Profiles | None = None,
             with_baseline: bool = True, with_upper_bound: bool = True,
             progress=None, profiles_source: str | None = None,
             precision: str | None = "from-options") -> PlannedJob:
    """Plans, then measures the plan against the Megatron baseline and the upper bound.

    precision: "from-options" plans in options.setup.precision on every device; None
    lets the planner pick from what the devices support (precision_choices); a name asks
    for that precision on the devices that support it. A plan predicted slower than the
    baseline is replaced by the baseline's layout (the planner never returns a worse one).
    """
    start = time.perf_counter()
    if precision == "from-options":
        name, devices, why = options.setup.precision, cluster, f"{options.setup.precision} as asked"
    else:
        name, devices, why = precision_choices(cluster, precision)
    options = dataclasses.replace(options, setup=dataclasses.replace(options.setup, precision=name))
    result = Planner(devices, model, global_batch_size, options, profiles).plan(progress)
    if precision is None and name == "fp16":
        switched = _prefer_bf16(devices, model, result, profiles)
        if switched is not None:
            result, why = switched
            options = dataclasses.replace(options, setup=dataclasses.replace(options.setup, precision="bf16"))
            devices = devices.keep(sorted({d.device_type for d in result.plan.devices}))
    searched, estimated = result.search_time_s, result.candidates_estimated
    plan, prediction, family, setup = result.plan, result.prediction, result.family, result.setup
    baseline = None
    if with_baseline:
        baseline = megatron_baseline(devices, model, global_batch_size, options, profiles)
        if baseline and baseline.prediction.iteration_time_s < prediction.iteration_time_s:
            plan, prediction, setup = baseline.plan, baseline.prediction, baseline.setup
            family = "Megatron baseline (every planned layout was predicted slower)"
    info = prediction.to_dict()
    if with_upper_bound:
        bound = upper_bound(devices, model, global_batch_size, options, profiles)
        info["upper_bound"] = bound.to_dict()
        info["fraction_of_upper_bound"] = round(prediction.tokens_per_s / bound.tokens_per_s, 4)
    if with_baseline:
        info["baseline"] = baseline.to_dict() if baseline else None
        if baseline:
            info["speedup_over_baseline"] = round(
                baseline.prediction.iteration_time_s / prediction.iteration_time_s, 4)
    recorded = plan.model_copy(update={
        "model": ModelRecord.of(model),
        "training": TrainingRecord(global_batch_size=global_batch_size, seq_length=model.seq_length,
                                   **setup.to_dict(), precision_reason=why),
        "cluster": ClusterSpec.model_validate(devices.to_dict()),
        "prediction": PredictionRecord.model_validate(info),
        "provenance": ProvenanceRecord(
            tool=f"hetero-plan {VERSION}",
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            family=family,
            search_time_s=round(searched, 3),
            total_time_s=round(time.perf_counter() - start, 3),
            candidates_estimated=estimated,
            profiles=profiles_source,
        ),
    })
    # Read back as pretrain_gpt.py and explain will: what hetero-plan writes, it can load.
    plan = Plan.from_dict(recorded.to_dict(), source="the plan made")
    return PlannedJob(plan, prediction, devices)


@dataclass
class RecordedJob:
    """What a plan written by hetero-plan records of the job it was made for."""

    cluster: Cluster
    model: ModelSpec
    setup: TrainingSetup
    profiles: Profiles | None
    profiles_source: str | None

    @classmethod
    def of(cls, plan: Plan, source: str) -> "RecordedJob":
        missing = [name for name in ("cluster", "model", "training") if getattr(plan, name) is None]
        if missing:
            raise PlanError(f"{source} has no {', '.join(missing)} section; a plan written by "
                            "hetero-plan records them")
        profiles_source = plan.provenance.profiles if plan.provenance is not None else None
        return cls(Cluster(plan.cluster, f"{source}: cluster"), plan.model.spec(),
                   TrainingSetup(**plan.training.setup_fields()),
                   Profiles.load_dir(profiles_source) if profiles_source else None, profiles_source)


def explain(plan: Plan, source: str) -> tuple[Prediction, Cluster]:
    """Re-predicts a plan written by hetero-plan (it carries its cluster, model, training)."""
    job = RecordedJob.of(plan, source)
    return predict(plan, job.cluster, CostModel(job.cluster, job.model, job.setup, job.profiles)), job.cluster


def plan_for_recorded_job(plan: Plan, cluster: Cluster) -> Plan:
    """The plan's job (model, precision, global batch, micro-batch size) planned anew for
    another cluster: what an elastic run does after losing nodes. The micro-batch size
    stays, since the job's flags state it."""
    job = RecordedJob.of(plan, "the plan")
    options = PlannerOptions(micro_batch_sizes=(plan.micro_batch_size,), setup=job.setup)
    return plan_job(cluster, job.model, plan.global_batch_size, options, job.profiles,
                    with_baseline=False, with_upper_bound=False, profiles_source=job.profiles_source).plan
