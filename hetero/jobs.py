"""A job planned: the plan with its prediction, the Megatron baseline and the upper bound,
the precision chosen, and the record of the job written into the plan (model, training,
cluster, prediction, provenance) so that it can be explained or planned again later
(after a lost node, for another cluster).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Literal
from datetime import datetime, timezone

from hetero.errors import HeteroError, PlanError
from hetero.plan import Plan
from hetero.predict.costs import CostModel, TrainingSetup
from hetero.predict.economics import Economics, economics, missing
from hetero.predict.predictor import Prediction, predict
from hetero.runtime_rules import RUNTIME_PRECISIONS, precision_problems, runtime_problems
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

    @property
    def economics(self) -> Economics:
        return economics((d.device_type for d in self.plan.devices), self.prediction.tokens_per_s,
                         self.cluster.devices)


@dataclass(frozen=True)
class Objective:
    """What the plan is chosen for.

    throughput: the most tokens/s (under max_dollars_per_hour, when given);
    cost: the fewest $ per token; energy: the fewest J per token (each at least
    min_tokens_per_s, and under max_dollars_per_hour, when given).
    """

    goal: Literal["throughput", "cost", "energy"] = "throughput"
    min_tokens_per_s: float | None = None
    max_dollars_per_hour: float | None = None

    @property
    def plain(self) -> bool:
        """The planner's own objective: every device, fastest plan."""
        return self.goal == "throughput" and self.max_dollars_per_hour is None

    def describe(self) -> str:
        text = {"throughput": "the most tokens/s", "cost": "the fewest $ per token",
                "energy": "the fewest J per token"}[self.goal]
        if self.min_tokens_per_s is not None:
            text += f", at least {self.min_tokens_per_s:,.0f} tokens/s"
        if self.max_dollars_per_hour is not None:
            text += f", at most ${self.max_dollars_per_hour:,.2f}/h"
        return text

    def needs(self) -> list[str]:
        """The device facts it prices with."""
        needs = []
        if self.goal == "cost" or self.max_dollars_per_hour is not None:
            needs.append("price_per_hour")
        if self.goal == "energy":
            needs.append("board_power_w")
        return needs

    def admits(self, e: Economics) -> bool:
        if self.min_tokens_per_s is not None and e.tokens_per_s < self.min_tokens_per_s:
            return False
        return self.max_dollars_per_hour is None or e.dollars_per_hour <= self.max_dollars_per_hour

    def better(self, a: Economics, b: Economics) -> bool:
        """a is preferred to b."""
        if self.goal == "cost":
            return a.dollars_per_million_tokens < b.dollars_per_million_tokens
        if self.goal == "energy":
            return a.joules_per_token < b.joules_per_token
        return a.tokens_per_s > b.tokens_per_s


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
    if name not in RUNTIME_PRECISIONS:  # predict() prices FP8; the runtime cannot train in it
        raise HeteroError(precision_problems(name, [], {})[0])
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
    info.update(_per_token(economics((d.device_type for d in plan.devices), prediction.tokens_per_s, devices.devices)))
    if with_upper_bound:
        bound = upper_bound(devices, model, global_batch_size, options, profiles)
        info["upper_bound"] = bound.to_dict()
        info["fraction_of_upper_bound"] = round(prediction.tokens_per_s / bound.tokens_per_s, 4)
    if with_baseline:
        info["baseline"] = baseline.to_dict() if baseline else None
        if baseline:
            info["baseline"].update(_per_token(economics(
                (d.device_type for d in baseline.plan.devices), baseline.prediction.tokens_per_s, devices.devices)))
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
    problems = runtime_problems(plan, model, setup.precision, devices.devices)
    if problems:  # the search only builds layouts the runtime runs: a bug if this fires
        raise HeteroError("hetero-plan made a plan the runtime would refuse: " + "; ".join(problems))
    return PlannedJob(plan, prediction, devices)


def _per_token(e: Economics) -> dict:
    cost, energy = e.dollars_per_million_tokens, e.joules_per_token
    return {"dollars_per_million_tokens": None if cost is None else round(cost, 6),
            "joules_per_token": None if energy is None else round(energy, 6)}


def device_sets(cluster: Cluster) -> list[list[str]]:
    """Every non-empty set of the cluster's device types: the jobs an objective other than
    speed chooses among (a device type left out is not rented). Counts within a type are
    all or nothing."""
    types = list(cluster.device_counts())
    return [list(subset) for size in range(1, len(types) + 1) for subset in itertools.combinations(types, size)]


def plan_for_objective(cluster: Cluster, model: ModelSpec, global_batch_size: int,
                       options: PlannerOptions, objective: Objective, profiles: Profiles | None = None,
                       progress=None, **job_options) -> tuple[PlannedJob, list[tuple[list[str], Economics]]]:
    """The job planned for an objective: for throughput alone, plan_job on every device;
    otherwise each device set is planned for speed (on fixed devices the fastest plan is also
    the cheapest and the most frugal per token) and the sets are compared by the objective.
    Returns the job and what each device set achieved (for the summary)."""
    if objective.plain:
        return plan_job(cluster, model, global_batch_size, options, profiles, progress=progress,
                        **job_options), []
    for what in objective.needs():
        lacking = missing(cluster.device_counts(), cluster.devices, what)
        if lacking:
            section = "prices_per_hour" if what == "price_per_hour" else "board_power_w"
            raise HeteroError(f"--objective {objective.goal}: no {what.replace('_', ' ')} for "
                              f"{', '.join(lacking)}; give them in the cluster spec, e.g. "
                              f"{section}: {{{lacking[0]}: ...}}")
    tried: list[tuple[list[str], Economics]] = []
    best: tuple[list[str], Economics] | None = None
    for kept in device_sets(cluster):
        if progress:
            progress(f"{objective.goal}: devices {'+'.join(kept)}")
        try:
            job = plan_job(cluster.keep(kept), model, global_batch_size, options, profiles,
                           with_baseline=False, with_upper_bound=False,
                           precision=job_options.get("precision", "from-options"))
        except HeteroError:  # the model does not fit these devices alone
            continue
        result = job.economics
        tried.append((kept, result))
        if objective.admits(result) and (best is None or objective.better(result, best[1])):
            best = (kept, result)
    if best is None:
        achieved = "; ".join(f"{'+'.join(k)}: {e.describe()}" for k, e in tried) or "no device set fits the model"
        raise HeteroError(f"no plan meets the objective ({objective.describe()}): {achieved}; relax "
                          "--min-tokens-per-s or --max-dollars-per-hour")
    kept = best[0]
    chosen = cluster if len(kept) == len(cluster.device_counts()) else cluster.keep(kept)
    job = plan_job(chosen, model, global_batch_size, options, profiles, progress=progress, **job_options)
    recorded = job.plan.prediction.model_copy(update={"objective": objective.describe()})
    job.plan = job.plan.model_copy(update={"prediction": recorded})
    return job, tried


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
    """Re-predicts a plan written by hetero-plan (it carries its cluster, model, training),
    after the runtime's own checks of the plan for its model and precision (runtime_rules):
    a plan pretrain_gpt.py would refuse is refused here with the same messages."""
    job = RecordedJob.of(plan, source)
    problems = runtime_problems(plan, job.model, job.setup.precision, job.cluster.devices)
    if problems:
        raise PlanError(f"{source}: pretrain_gpt.py would refuse this plan: " + "; ".join(problems))
    return predict(plan, job.cluster, CostModel(job.cluster, job.model, job.setup, job.profiles)), job.cluster


def plan_for_recorded_job(plan: Plan, cluster: Cluster) -> Plan:
    """The plan's job (model, precision, global batch, micro-batch size) planned anew for
    another cluster: what an elastic run does after losing nodes. The micro-batch size
    stays, since the job's flags state it."""
    job = RecordedJob.of(plan, "the plan")
    options = PlannerOptions(micro_batch_sizes=(plan.micro_batch_size,), setup=job.setup)
    return plan_job(cluster, job.model, plan.global_batch_size, options, job.profiles,
                    with_baseline=False, with_upper_bound=False, profiles_source=job.profiles_source).plan
