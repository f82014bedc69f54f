"""hetero-plan: plan a job for a cluster, or explain an existing plan.

    hetero-plan --cluster C.yaml --model llama2-7b --global-batch-size 512 --seq-length 4096 \\
        [--profiles DIR] -o plan.json [--timeline plan.png]
    hetero-plan explain plan.json [--timeline plan.png] [--memory]

(also `python -m hetero.plan ...`)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from hetero.baseline import megatron_baseline, upper_bound
from hetero.cluster import Cluster
from hetero.costs import RECOMPUTE_MODES, CostModel, TrainingSetup
from hetero.errors import HeteroError
from hetero.model import ModelSpec, load_model
from hetero.plan import Plan
from hetero.planner import Planner, PlannerOptions
from hetero.predictor import Prediction, predict
from hetero.profiles import Profiles
from hetero.report import measured_against_predicted, memory_table, summary, timeline_png

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
    info = {}
    baseline = None
    if with_baseline:
        baseline = megatron_baseline(devices, model, global_batch_size, options, profiles)
        if baseline and baseline.prediction.iteration_time_s < prediction.iteration_time_s:
            plan, prediction, setup = baseline.plan, baseline.prediction, baseline.setup
            family = "Megatron baseline (every planned layout was predicted slower)"
    info.update(prediction.to_dict())
    if with_upper_bound:
        bound = upper_bound(devices, model, global_batch_size, options, profiles)
        info["upper_bound"] = bound.to_dict()
        info["fraction_of_upper_bound"] = round(prediction.tokens_per_s / bound.tokens_per_s, 4)
    if with_baseline:
        info["baseline"] = baseline.to_dict() if baseline else None
        if baseline:
            info["speedup_over_baseline"] = round(
                baseline.prediction.iteration_time_s / prediction.iteration_time_s, 4)
    extra = {
        "model": model.to_dict(),
        "training": {"global_batch_size": global_batch_size, "seq_length": model.seq_length,
                     **setup.to_dict(), "precision_reason": why},
        "cluster": devices.to_dict(),
        "prediction": info,
        "provenance": {
            "tool": f"hetero-plan {VERSION}",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "family": family,
            "search_time_s": round(searched, 3),
            "total_time_s": round(time.perf_counter() - start, 3),
            "candidates_estimated": estimated,
            "profiles": profiles_source,
        },
    }
    plan = Plan.from_dict({**plan.to_dict(), **extra})
    return PlannedJob(plan, prediction, devices)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True, help="cluster spec YAML")
    p.add_argument("--model", required=True, help="preset name or model YAML (Megatron field names)")
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--vocab-size", type=int, default=None, help="padded vocabulary (default: the model's)")
    p.add_argument("--profiles", default=None, help="directory of measured profiles (tools/)")
    p.add_argument("--roofline-for-missing", action="store_true",
                   help="with --profiles: estimate device types that have no profile")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp8", "fp32"], default=None,
                   help="default: bf16 if every device has it, else the faster of fp16 on all "
                        "devices and bf16 without the devices that lack it")
    p.add_argument("--recompute", choices=["auto", "none", "selective", "full"], default="auto",
                   help="auto: per stage, the cheapest that fits")
    p.add_argument("--sequence-parallel", choices=["auto", "on", "off"], default="auto",
                   help="auto: on whenever TP > 1")
    p.add_argument("--virtual-stages", type=_int_list, default=(1, 2),
                   help="interleaving degrees to try (1: plain 1F1B)")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument("--grad-reduce-in-bf16", action="store_true")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--no-fused-kernels", action="store_true",
                   help="megatron-core's local layers (CPU runs): attention keeps its score "
                        "matrix, SwiGLU its intermediate tensors")
    p.add_argument("--no-dropout", action="store_true",
                   help="the recipe sets hidden and attention dropout to 0 (no masks kept)")
    p.add_argument("--tensor-parallel", type=_int_list, default=(1, 2, 4, 8), help="degrees to try")
    p.add_argument("--micro-batch-size", type=_int_list, default=(1, 2, 4, 8), help="sizes to try")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--skip-upper-bound", action="store_true")
    p.add_argument("-o", "--output", required=True, help="plan.json to write")
    p.add_argument("--timeline", default=None, help="also draw the predicted iteration (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress")
    return p


def _plan_command(argv: Sequence[str]) -> int:
    args = _plan_parser().parse_args(argv)
    cluster = Cluster.load(args.cluster)
    model = load_model(args.model).with_seq_length(args.seq_length)
    if args.vocab_size:
        model = ModelSpec(**{**model.to_dict(), "vocab_size": args.vocab_size})
    profiles = None
    if args.profiles:
        profiles = Profiles.load_dir(args.profiles)
        missing = profiles.missing(list(cluster.device_counts()), model, args.precision or "bf16")
        if missing and not args.roofline_for_missing:
            raise HeteroError(
                f"--profiles {args.profiles} has no {args.precision or 'bf16'} compute profile of this model "
                f"shape for {', '.join(missing)}; measure them with tools/profile_compute.py, or "
                "pass --roofline-for-missing to estimate them from the catalog"
            )
    setup = TrainingSetup(precision=args.precision or "bf16",
                          distributed_optimizer=not args.no_distributed_optimizer,
                          fused_kernels=not args.no_fused_kernels, dropout=not args.no_dropout,
                          overlap_grad_reduce=args.overlap_grad_reduce,
                          overlap_param_gather=args.overlap_param_gather,
                          grad_reduce_dtype="bf16" if args.grad_reduce_in_bf16 else None)
    options = PlannerOptions(
        tensor_parallel=args.tensor_parallel, micro_batch_sizes=args.micro_batch_size, setup=setup,
        recompute_modes=RECOMPUTE_MODES if args.recompute == "auto" else (args.recompute,),
        sequence_parallel={"auto": None, "on": True, "off": False}[args.sequence_parallel],
        virtual_stages=args.virtual_stages)
    def progress(step: str) -> None:
        print(f"  searching {step} ...", file=sys.stderr, flush=True)

    job = plan_job(cluster, model, args.global_batch_size, options, profiles,
                   with_baseline=not args.skip_baseline, with_upper_bound=not args.skip_upper_bound,
                   progress=None if args.quiet else progress, profiles_source=args.profiles,
                   precision=args.precision)
    job.plan.save(args.output)
    print(summary(job.plan, job.prediction, cluster, f"hetero-plan: wrote {args.output}"))
    if args.timeline:
        print(f"timeline   {timeline_png(job.plan, job.prediction, args.timeline)}")
    return 0


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
        extra = plan.model_extra
        missing = [k for k in ("cluster", "model", "training") if k not in extra]
        if missing:
            raise HeteroError(f"{source} has no {', '.join(missing)} section; a plan written by "
                              "hetero-plan records them")
        setup = TrainingSetup.from_dict(extra["training"])
        profiles_source = extra.get("provenance", {}).get("profiles")
        return cls(Cluster.from_dict(extra["cluster"], f"{source}: cluster"), ModelSpec(**extra["model"]),
                   setup, Profiles.load_dir(profiles_source) if profiles_source else None, profiles_source)


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


def _explain_command(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="hetero-plan explain", description="Summarise an existing plan.")
    p.add_argument("plan")
    p.add_argument("--timeline", default=None, help="draw the predicted iteration (PNG)")
    p.add_argument("--memory", action="store_true", help="per-stage memory breakdown")
    p.add_argument("--measured", default=None, metavar="LOG",
                   help="a training log of this plan: its iteration time against the prediction")
    args = p.parse_args(argv)
    plan = Plan.load(args.plan)
    prediction, cluster = explain(plan, args.plan)
    print(summary(plan, prediction, cluster, f"hetero-plan explain {args.plan}"))
    if args.memory:
        print(memory_table(prediction))
    if args.measured:
        print(measured_against_predicted(Path(args.measured).read_text(), prediction.iteration_time_s))
    if args.timeline:
        print(f"timeline   {timeline_png(plan, prediction, args.timeline)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "explain":
            return _explain_command(argv[1:])
        return _plan_command(argv)
    except HeteroError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
