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
from typing import Callable, Iterator
from datetime import datetime, timezone

from hetero.errors import HeteroError, PlanError
from hetero.job import Job, Objective
from hetero.plan import Plan
from hetero.predict.costs import CostModel
from hetero.predict.training_setup import TrainingSetup
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
    search_cpu_s: float | None = None
    """The planner's CPU time (benchmarks: steadier than the recorded wall time)."""

    @property
    def economics(self) -> Economics:
        return economics((d.device_type for d in self.plan.devices), self.prediction.tokens_per_s,
                         self.cluster.devices)


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
    return PlannedJob(plan, prediction, devices, result.search_cpu_s)


def _per_token(e: Economics) -> dict:
    cost, energy = e.dollars_per_million_tokens, e.joules_per_token
    return {"dollars_per_million_tokens": None if cost is None else round(cost, 6),
            "joules_per_token": None if energy is None else round(energy, 6)}


def node_steps(nodes: int) -> list[int]:
    """Node counts of one device type an objective other than speed tries: all of them, then
    halving down to one (a device type used in part)."""
    steps = [nodes]
    while steps[-1] > 1:
        steps.append(steps[-1] // 2)
    return steps


PER_DEVICE_SLACK = 1.25
"""How much more a device type may give per device beside others than its best alone (a type
runs a cheaper layout beside others: Holmes-like reaches 100% of the upper bound)."""


def device_choices(cluster: Cluster, alone: dict[str, float]) -> Iterator[dict[str, int]]:
    """The sets of devices an objective other than speed chooses among (a device left out
    is not rented): each device type alone on node_steps of its nodes, then every set of
    several types, all their nodes first, then fewer. alone[t]: the best tokens/s per
    device type t reached alone so far (filled in while the first choices are planned)."""
    nodes = {t: cluster.nodes_of(t) for t in cluster.device_counts()}
    for t, n in nodes.items():
        for count in node_steps(n):
            yield {t: count}
    for size in range(2, len(nodes) + 1):
        for types in itertools.combinations(nodes, size):
            yield {t: nodes[t] for t in types}
    for size in range(2, len(nodes) + 1):
        for types in itertools.combinations(nodes, size):
            for counts in itertools.product(*(node_steps(nodes[t]) for t in types)):
                if all(alone.get(t) for t in types) and counts != tuple(nodes[t] for t in types):
                    yield dict(zip(types, counts))


def _label(cluster: Cluster, choice: dict[str, int]) -> list[str]:
    return [t if n == cluster.nodes_of(t) else f"{t} ({n} of {cluster.nodes_of(t)} nodes)" for t, n in choice.items()]


def plan_for_objective(cluster: Cluster, model: ModelSpec, global_batch_size: int,
                       options: PlannerOptions, objective: Objective, profiles: Profiles | None = None,
                       progress=None, **job_options) -> tuple[PlannedJob, list[tuple[list[str], Economics]]]:
    """The job planned for an objective: for throughput alone, plan_job on every device;
    otherwise each device set (device_choices: types left out, and a type on fewer of its
    nodes) is planned for speed (on fixed devices the fastest plan is also the cheapest and
    the most frugal per token) and the sets are compared by the objective. A set whose
    optimistic throughput (each type at PER_DEVICE_SLACK times its best per device alone)
    cannot win is not planned (device types on all their nodes always are). Returns the job and what each device set achieved (for the
    summary)."""
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
    best: tuple[dict[str, int], Economics] | None = None
    alone: dict[str, float] = {}
    for choice in device_choices(cluster, alone):
        kept = cluster.keep_nodes(choice)
        counts = kept.device_counts()
        partial = any(n < cluster.nodes_of(t) for t, n in choice.items())
        if len(choice) > 1 and partial and best is not None:  # every type has run alone (device_choices)
            optimistic = economics([t for t, n in counts.items() for _ in range(n)],
                                   sum(PER_DEVICE_SLACK * alone[t] * n for t, n in counts.items()), cluster.devices)
            if not (objective.admits(optimistic) and objective.better(optimistic, best[1])):
                continue
        if progress:
            progress(f"{objective.goal}: devices {'+'.join(_label(cluster, choice))}")
        try:
            job = plan_job(kept, model, global_batch_size, options, profiles,
                           with_baseline=False, with_upper_bound=False,
                           precision=job_options.get("precision", "from-options"))
        except HeteroError:  # the model does not fit these devices alone
            continue
        result = job.economics
        if len(choice) == 1:
            (t, n), = counts.items()
            alone[t] = max(alone.get(t, 0.0), result.tokens_per_s / n)
        tried.append((_label(cluster, choice), result))
        if objective.admits(result) and (best is None or objective.better(result, best[1])):
            best = (choice, result)
    if best is None:
        achieved = "; ".join(f"{'+'.join(k)}: {e.describe()}" for k, e in tried) or "no device set fits the model"
        raise HeteroError(f"no plan meets the objective ({objective.describe()}): {achieved}; relax "
                          "--min-tokens-per-s or --max-dollars-per-hour")
    choice = best[0]
    whole = choice == {t: cluster.nodes_of(t) for t in cluster.device_counts()}
    chosen = cluster if whole else cluster.keep_nodes(choice)
    job = plan_job(chosen, model, global_batch_size, options, profiles, progress=progress, **job_options)
    recorded = job.plan.prediction.model_copy(update={"objective": objective.describe()})
    job.plan = job.plan.model_copy(update={"prediction": recorded})
    return job, tried




def plan_for(job: Job, progress: Callable[[str], None] | None = None, with_baseline: bool = True,
         with_upper_bound: bool = True) -> PlannedJob:
    """Plans a job: hetero-plan and every re-plan (elastic, the Slurm driver, re-admission)
    come here. The run pads its vocabulary for the plan's tensor-parallel degrees, so the
    plan is made again at the degrees it chose while that changes the padding (each pass
    narrows them); a job that keeps its trained vocabulary drops degrees at which no
    --make-vocab-size-divisible-by gives it. The plan records the padding's divisor."""
    options = job.options
    while True:
        model = job.model_for(options.tensor_parallel)
        planned, _ = plan_for_objective(job.cluster, model, job.global_batch_size, options, job.objective,
                                        job.profiles_for(model), progress=progress, with_baseline=with_baseline,
                                        with_upper_bound=with_upper_bound, profiles_source=job.profiles_source,
                                        precision=job.precision)
        chosen = tuple(sorted({tp for t in planned.plan.templates for tp in t.stage_tensor_parallel}))
        if job.kept_vocab_size is not None and job.divisor_for(chosen) is None:
            allowed = tuple(t for t in options.tensor_parallel if job.divisor_for((t,)) is not None)
            if allowed == options.tensor_parallel or not allowed:
                raise HeteroError(f"no tensor-parallel degree among {options.tensor_parallel} keeps the trained "
                                  f"vocabulary of {job.kept_vocab_size} rows; resume at the degrees it was trained at")
            options = dataclasses.replace(options, tensor_parallel=allowed)
            continue
        if job.model_for(chosen) == model:
            break
        options = dataclasses.replace(options, tensor_parallel=chosen)
    depths = sorted({t.pipeline_parallel for t in planned.plan.templates})
    if job.pipeline_parallel is not None and depths != [job.pipeline_parallel]:
        raise HeteroError(  # the search keeps to the flags' depth: only a bug gets here
            f"the flags fix --pipeline-model-parallel-size {job.pipeline_parallel}, the plan has "
            f"{'/'.join(map(str, depths))} stages")
    if job.vocabulary is not None:
        training = planned.plan.training.model_copy(update={
            "tokenizer_vocab_size": job.vocabulary.tokenizer_vocab_size,
            "make_vocab_size_divisible_by": job.divisor_for(chosen)})
        planned.plan = Plan.from_dict(planned.plan.model_copy(update={"training": training}).to_dict(),
                                      source="the plan made")
    return planned


def explain(plan: Plan, source: str) -> tuple[Prediction, Cluster]:
    """Re-predicts a plan written by hetero-plan (it carries its cluster, model, training),
    after the runtime's own checks of the plan for its model and precision (runtime_rules):
    a plan pretrain_gpt.py would refuse is refused here with the same messages."""
    job = Job.of_record(plan, source=source)
    problems = runtime_problems(plan, job.model, job.setup.precision, job.cluster.devices)
    if problems:
        raise PlanError(f"{source}: pretrain_gpt.py would refuse this plan: " + "; ".join(problems))
    return predict(plan, job.cluster, CostModel(job.cluster, job.model, job.setup, job.profiles)), job.cluster


def plan_for_recorded_job(plan: Plan, cluster: Cluster) -> Plan:
    """The plan's job (model, precision, global batch, micro-batch size, trained vocabulary)
    planned anew for another cluster: what an elastic run does after losing nodes. The
    micro-batch size stays, since the job's flags state it. A plan of several templates may
    keep the templates whose hosts all remain as they are, with new templates on the hosts
    the others leave, where that is predicted best (the planner's search weighs it against
    every other plan)."""
    job = Job.of_record(plan, cluster)
    hosts = {node.host for node in cluster.nodes}
    templates = [plan.template_plan(k) for k in range(plan.num_templates)] if plan.num_templates > 1 else []
    kept = tuple(template for template in templates if {d.host for d in template.devices} <= hosts)
    job = dataclasses.replace(job, options=dataclasses.replace(job.options, kept_templates=kept))
    return plan_for(job, with_baseline=False, with_upper_bound=False).plan
