"""Planner benchmark: paper-scale clusters, search time, % of the upper bound, speed-up.

    python bench/plan_bench.py            # every scenario (a few minutes on 2 cores)
    python bench/plan_bench.py --quick    # the two search-speed targets only
    python bench/plan_bench.py --no-templates   # plans of one replica template only (the search before templates)
    python bench/plan_bench.py --per-stage-tp   # Sailor-like rows: one TP degree vs one per stage, with search times

Each row plans the job with the same predictor that computes its Megatron baseline
(uniform layers, launch-order ranks, equal micro-batches, best degrees) and HetHub's
upper bound (best per-device throughput of each type alone, times its count). "search"
is the planner alone; "total" adds the baseline and the upper bound.
Targets (2 cores, the search's CPU time): search <= 1 s for 512 GPUs, <= 30 s for 4096 GPUs
of 4 types. "search CPU" is the planner's own CPU time, "CPU s" the process's for the whole
row: on a shared machine the wall times grow with the load, the CPU time much less.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hetero.jobs import plan_job  # noqa: E402
from hetero.search.options import PlannerOptions  # noqa: E402
from hetero.spec.cluster import Cluster  # noqa: E402
from hetero.spec.presets import load_model  # noqa: E402

CLUSTERS = REPO / "examples" / "clusters"

# (scenario, cluster file, model, global batch, sequence length)
SCENARIOS = [
    ("HetHub-like", "hethub_like.yaml", "llama-140b", 1536, 4096),
    ("Holmes-like", "holmes_like.yaml", "gpt-3.6b", 512, 2048),
    ("Poplar-like", "poplar_like.yaml", "llama2-70b", 512, 4096),
    ("Sailor-like 128", "sailor_like_128.yaml", "llama2-7b", 512, 2048),
    ("Sailor-like 320", "sailor_like_320.yaml", "llama2-7b", 1024, 2048),
    ("Sailor-like 512", "sailor_like_512.yaml", "llama2-7b", 1024, 2048),
    ("MoE H100+A100 64", "moe_h100_a100.yaml", "mixtral-8x7b", 256, 4096),
    ("4 types, 4096", "mixed_4096.yaml", "llama2-70b", 2048, 4096),
]
QUICK = {"Sailor-like 512", "4 types, 4096"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the search-speed targets")
    parser.add_argument("--per-stage-tp", action="store_true",
                        help="the Sailor-like scenarios planned without and with a degree per stage")
    parser.add_argument("--no-templates", action="store_true", help="plans of one replica template only")
    parser.add_argument("--only", nargs="+", default=None, help="these scenarios (by name)")
    args = parser.parse_args()
    if args.per_stage_tp:
        return per_stage_tensor_parallel()
    options = PlannerOptions(templates=not args.no_templates)
    header = (f"{'scenario':16} {'devices':>7} {'model':11} {'search s':>8} {'search CPU':>10} {'total s':>8} "
              f"{'CPU s':>7} {'tokens/s':>11} {'% of UB':>7} {'vs Megatron':>11}  plan")
    print(header)
    print("-" * len(header))
    for name, cluster_file, model_name, gbs, seq in SCENARIOS:
        if (args.quick and name not in QUICK) or (args.only and name not in args.only):
            continue
        cluster = Cluster.load(CLUSTERS / cluster_file)
        model = load_model(model_name).with_seq_length(seq)
        start, cpu_start = time.perf_counter(), time.process_time()
        job = plan_job(cluster, model, gbs, options, with_baseline=not args.quick, with_upper_bound=not args.quick,
                       precision=None)  # the planner picks it from the devices
        total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        p = job.plan
        info, provenance, training = p.prediction, p.provenance, p.training
        ub = f"{info.fraction_of_upper_bound:.1%}" if info.fraction_of_upper_bound is not None else "-"
        if args.quick:
            speedup = "-"
        elif info.speedup_over_baseline:
            speedup = f"{info.speedup_over_baseline:.2f}x"
        else:
            speedup = "cannot fit"  # no uniform Megatron plan fits the cluster
        recompute = sorted({st.recompute_mode() or "none" for t in p.templates for st in t.stages})
        layout = (f"{shapes(p)} mb{p.micro_batch_size} v{training.virtual_stages} "
                  f"{'SP ' if training.sequence_parallel else ''}recompute {'/'.join(recompute)} "
                  f"{training.precision} {provenance.family}")
        print(f"{name:16} {cluster.num_devices:7d} {model_name:11} {provenance.search_time_s:8.2f} "
              f"{job.search_cpu_s:10.2f} {total:8.1f} {cpu:7.1f} {info.tokens_per_s:11,.0f} {ub:>7} {speedup:>11}  "
              f"{layout}", flush=True)
    return 0


def degrees(template) -> str:
    tps = template.stage_tensor_parallel
    return "/".join(map(str, tps)) if len(set(tps)) > 1 else str(tps[0])


def shapes(plan) -> str:
    """Each template's degrees (its devices' first letters when there are several)."""
    parts = []
    for k, t in enumerate(plan.templates):
        shape = f"TP{degrees(t)} PP{t.pipeline_parallel} DP{t.data_parallel}"
        if plan.num_templates > 1:
            types = sorted({d.device_type for d in plan.template_plan(k).devices})
            shape = f"{'+'.join(types)}: {shape}"
        parts.append(shape)
    return " | ".join(parts)


def per_stage_tensor_parallel() -> int:
    """One degree for the job against a degree per stage (the planner's own search either
    way), both predicted by the one cost model, with each search's CPU time. "classes" gives
    each stage's device type by its first letter (a sandwich: the same letter at both ends)."""
    print(f"{'scenario':29} {'one TP: tokens/s':>17} {'search CPU':>10} {'per-stage: tokens/s':>20} {'search CPU':>10} "
          f"{'speed-up':>8}  per-stage plan")
    scenarios = [(f"{name} {model_name}", cluster_file, model_name, gbs, seq)
                 for name, cluster_file, _, gbs, seq in SCENARIOS if name.startswith("Sailor")
                 for model_name in ("opt-350m", "gpt-neo-2.7b", "llama2-7b")]
    for name, cluster_file, model_name, gbs, seq in scenarios:
        cluster = Cluster.load(CLUSTERS / cluster_file)
        model = load_model(model_name).with_seq_length(seq)
        jobs = [plan_job(cluster, model, gbs, PlannerOptions(per_stage_tensor_parallel=flag),
                         with_baseline=False, with_upper_bound=False, precision=None) for flag in (False, True)]
        one, mixed = (j.plan for j in jobs)
        speed = [p.prediction.tokens_per_s for p in (one, mixed)]
        print(f"{name:29} {speed[0]:17,.0f} {jobs[0].search_cpu_s:10.2f} {speed[1]:20,.0f} "
              f"{jobs[1].search_cpu_s:10.2f} {speed[1] / speed[0]:7.2f}x  {layout_of(mixed)} "
              f"(one TP: {layout_of(one)})", flush=True)
    return 0


def layout_of(plan) -> str:
    parts = []
    for t in plan.templates:
        classes = "".join(stage.device_types[0][0] for stage in t.stages)
        layers = "/".join("+".join(map(str, stage.virtual_stages)) if stage.virtual_stages else str(stage.num_layers)
                          for stage in t.stages)
        parts.append(f"TP{degrees(t)} PP{t.pipeline_parallel} DP{t.data_parallel} layers {layers} classes {classes}")
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
