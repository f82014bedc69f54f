"""The planner's claims measured on an emulated cluster (tools/emulator), as real runs.

    sudo python bench/emulated_bench.py            # 100-195 min on 2 cores (by the VM's speed); needs root
    python bench/emulated_bench.py --out DIR       # results.json, report.md, timeline.png

1. Predictor accuracy: on two emulated clusters - compute heterogeneity (3 fast + 1 half-
   speed device) and mixed NICs (2 InfiniBand + 2 Ethernet nodes) - profile compute and
   links ON the emulated cluster, then run several plans and compare the measured
   iteration time and peak memory with the prediction. Target: mean error <= 5%.
2. Plan quality: on the compute cluster, the planner's plan vs the Megatron baseline,
   run one after the other (target >= 1.5x), and vs the measured upper bound: each
   device type trained alone on its share of the batch, throughputs summed (>= 95%);
   and vs every alternative the bench runs there (at least as fast, within the spread).
3. NIC awareness: on the NIC cluster, the planner's rank order vs the same plan in
   launch order.
4. Shapes the first two do not reach (cpu_demo.yaml: two fast and two half-speed devices,
   two per node): pipelines of uneven stages with unequal replicas, tensor parallelism
   (TP=2 inside a node, with TP=2 profiles), both together, a degree per stage (1/2/1,
   plan version 3), and the planner's own pick.
5. timeline.png: a measured iteration of the planner's plan above its prediction.
6. Interleaved 1F1B (--only interleaved; the demo's model and set-up, on cpu_demo.yaml): the
   interleaved plan the demo picked, against the same plan without virtual stages.
7. Replica templates (--only templates; emu_one_fast.yaml: one fast device that holds the
   whole model, four a third as fast that hold half of it): the planner's plan of several
   templates against its best plan of one template (hetero-plan --no-templates), run side
   by side: one compute profile of both plans' cases before and one after, the timed runs
   alternating between the plans.

Each cluster is profiled once before its runs (compute and links): the planner plans with
that. The VM's speed drifts by 10-25% over tens of minutes (one plan measured 2.39 s and,
two hours later, 3.04 s; two profiles 12 minutes apart differed by 10-20%), more than the
5% the predictor is held to, so every plan's runs are bracketed by two short compute
profiles of the cases it uses, one right before its timed runs and one right after; the
row is predicted with their median (links from the cluster's profile). The prediction from
the cluster's profile alone is reported beside it.

Every plan runs --repeats timed runs (fresh processes each time) and one more for peak
memory; a row reports the median of the timed runs' iteration times and their spread
((max - min) / median): one run is not a measurement on a shared machine. Timed runs and
the compute profile keep freed memory in the process, as a GPU's caching allocator does (the
emulator's default); the memory run returns it to the OS, so that its peak is the job's own.

    sudo python bench/emulated_bench.py --only shapes --plans 1 --repeats 2   # a quick check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hetero.search.baseline import megatron_baseline  # noqa: E402
from hetero.spec.cluster import Cluster  # noqa: E402
from hetero.predict.costs import CostModel  # noqa: E402
from hetero.predict.training_setup import TrainingSetup  # noqa: E402
from hetero.io import write_json_atomic
from hetero.plan import Plan  # noqa: E402
from hetero.search.options import PlannerOptions  # noqa: E402
from hetero.search.planner import Planner  # noqa: E402
from hetero.search.shortlist import distinct_shapes  # noqa: E402
from hetero.predict.predictor import Prediction, predict  # noqa: E402
from hetero.spec.profiles import Profiles  # noqa: E402
from hetero.events import Memory, of_kind  # noqa: E402
from hetero.report import measured_timeline_png  # noqa: E402
from emulated_report import report  # noqa: E402  (bench/ is this script's folder)
from tools.emulator import EmulatedCluster, JobResult, RankLayout, stop_on_termination_signals  # noqa: E402
from tools.emulator.cluster import KEEP_FREED_MEMORY_ENV  # noqa: E402

CLUSTERS = REPO / "examples" / "clusters"
MODEL_FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
               "--seq-length", "256", "--max-position-embeddings", "256", "--vocab-size", "2047",
               "--attention-dropout", "0", "--hidden-dropout", "0"]
DATA_FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--num-workers", "0"]
SETUP = TrainingSetup("fp32", distributed_optimizer=False, fused_kernels=False, dropout=False)
# The demo's model and set-up (examples/run_demo.sh): the interleaved scenario's.
DEMO_MODEL_FLAGS = ["--num-layers", "6", "--hidden-size", "128", "--ffn-hidden-size", "352",
                    "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
                    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                    "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--seq-length", "128",
                    "--max-position-embeddings", "128", "--vocab-size", "2047", "--attention-dropout", "0",
                    "--hidden-dropout", "0"]
DEMO_SETUP = TrainingSetup("fp32", fused_kernels=False, dropout=False)
OPTIONS = PlannerOptions(tensor_parallel=(1,), micro_batch_sizes=(1, 2, 4), setup=SETUP)
WARMUP_ITERATIONS = 2
BRACKET_REPEATS = 8  # timed rounds of a bracketing profile (the cluster's profile takes 16)
MEMORY_RUN_ENV = {KEEP_FREED_MEMORY_ENV: "0"}  # freed memory returned: the peak is the job's own
TEMPLATES_GLOBAL_BATCH = 20
# The templates cluster's model: wider and shorter than MODEL_FLAGS, so that its weights and
# optimizer state, not its activations, decide what fits: half of it fits a small device
# without recomputation, all of it does not fit even with full recomputation.
TEMPLATES_MODEL_FLAGS = ["--num-layers", "4", "--hidden-size", "384", "--num-attention-heads", "8",
                         "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "2047",
                         "--attention-dropout", "0", "--hidden-dropout", "0"]
TEMPLATES_OPTIONS = PlannerOptions(tensor_parallel=(1,), micro_batch_sizes=(1, 2), setup=SETUP)


def model_spec(model_flags: list[str]):
    from megatron.hetero.startup import model_spec_of_flags

    return model_spec_of_flags(model_flags + DATA_FLAGS)


class Bench:
    def __init__(self, out: Path, iterations: int, repeats: int = 3, max_plans: int | None = None,
                 model_flags: list[str] = MODEL_FLAGS, setup: TrainingSetup = SETUP):
        self.out, self.iterations, self.repeats, self.max_plans = out, iterations, repeats, max_plans
        self.model_flags, self.setup = model_flags, setup
        self.spec = model_spec(model_flags)
        self.results: dict = {"predictor": [], "quality": {}, "nic": {}}

    def log(self, message: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)

    def save(self) -> None:
        """results.json and report.md as measured so far: a bench stopped after an hour keeps
        what it measured."""
        write_json_atomic(self.out / "results.json", self.results)
        if self.results["predictor"]:
            (self.out / "report.md").write_text(report(self.results))

    def emulator(self, cluster: Cluster, layout: RankLayout, like: EmulatedCluster | None = None) -> EmulatedCluster:
        """Same scale factors as `like`: device speeds stay those of the full cluster."""
        if like is None:
            return EmulatedCluster(cluster, layout)
        return EmulatedCluster(cluster, layout, compute_scale=like.compute_scale, net_scale=like.net_scale,
                               reference_tflops=like.reference_tflops)

    def run(self, emulated: EmulatedCluster, argv: list[str], what: str, env: dict | None = None) -> JobResult:
        with emulated:
            result = emulated.run(argv, echo=False, env=env, timeout=1200)
        if result.returncode != 0:
            raise SystemExit(f"{what} failed (exit {result.returncode}):\n{result.output[-4000:]}")
        return result

    def profile(self, name: str, cluster: Cluster, tensor_parallel: tuple[int, ...] = (1,),
                micro_batch_sizes: tuple[int, ...] = (1, 2, 4)) -> tuple[Profiles, EmulatedCluster]:
        """Compute and links, before the runs (what the planner plans with)."""
        directory = self.out / name / "profiles"
        emulated = self.emulator(cluster, RankLayout.of_cluster(cluster))
        self.log(f"{name}: profiling compute and links on the emulated cluster\n{emulated.describe()}")
        self.profile_compute(directory, cluster, emulated, tensor_parallel, micro_batch_sizes)
        self.run(self.emulator(cluster, RankLayout.of_cluster(cluster), emulated),
                 ["-m", "megatron.hetero.profiling.network", "-o", str(directory)], "link profile")
        return Profiles.load_dir(directory), emulated

    def profile_compute(self, directory: Path, cluster: Cluster, like: EmulatedCluster,
                        tensor_parallel: tuple[int, ...], micro_batch_sizes: tuple[int, ...],
                        repeats: int | None = None) -> Profiles:
        rounds = ["--repeats", str(repeats)] if repeats else []
        self.run(self.emulator(cluster, RankLayout.of_cluster(cluster), like),
                 ["-m", "megatron.hetero.profiling.compute", "-o", str(directory), "--micro-batch-sizes",
                  *map(str, micro_batch_sizes), "--tensor-parallel", *map(str, tensor_parallel), *rounds, "--",
                  *self.model_flags, *DATA_FLAGS],
                 "compute profile")
        return Profiles.load_dir(directory)

    def bracket(self, directory: Path, cluster: Cluster, plan: Plan, like: EmulatedCluster) -> Profiles:
        """A short compute profile of the plan's own cases (its degrees, its micro-batch size)."""
        return self.profile_compute(directory, cluster, like, tuple(sorted(set(plan.stage_tensor_parallel))),
                                    (plan.micro_batch_size,), BRACKET_REPEATS)

    def measure(self, name: str, cluster: Cluster, plan: Plan, like: EmulatedCluster,
                trace_dir: Path | None = None, bracketed: bool = False) -> dict:
        path = self.out / name / "plan.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(path)
        argv = ["pretrain_gpt.py", "--hetero-plan", str(path), *self.model_flags, *DATA_FLAGS,
                "--micro-batch-size", str(plan.micro_batch_size), "--global-batch-size", str(plan.global_batch_size),
                "--train-iters", str(self.iterations), "--lr", "1e-4", "--log-interval", "1",
                "--log-memory-interval", str(self.iterations), "--eval-iters", "0"]
        trace = {"HETERO_TRACE_DIR": str(trace_dir), "HETERO_TRACE_ITERATION": str(self.iterations - 1)} if trace_dir else {}
        # One run for peak memory with freed memory returned to the OS (the job's own peak),
        # then the timed runs with it kept, as the emulator's ranks keep it by default.
        memory_run = self.run(self.emulator(cluster, RankLayout.of_plan(plan), like), argv,
                              f"training {name} (memory run)", MEMORY_RUN_ENV)
        stage_memory: dict[int, list[float]] = {}
        # The record after the last iteration: the peak of the whole run (the first
        # iteration's comes before the optimizer state exists).
        for memory in of_kind(memory_run.events, Memory):
            if memory.iteration == self.iterations:  # the peak of a stage's ranks
                stage_memory.setdefault(plan.grid.coords(memory.logical_rank).pp_rank, []).append(
                    memory.peak_mb * 2**20)
        passes = [self.bracket(self.out / name / "profile-before", cluster, plan, like)] if bracketed else []
        runs, times = [], []
        for repeat in range(1, self.repeats + 1):
            these = self.run(self.emulator(cluster, RankLayout.of_plan(plan), like), argv,
                             f"training {name} (timed run {repeat})", trace).iteration_times_s()
            runs.append(statistics.median(these[WARMUP_ITERATIONS:]))
            times.append(these)
        if bracketed:
            passes.append(self.bracket(self.out / name / "profile-after", cluster, plan, like))
        iteration = statistics.median(runs)
        return {"iteration_s": iteration, "tokens_per_s": plan.global_batch_size * self.spec.seq_length / iteration,
                "runs_s": runs, "spread": (max(runs) - min(runs)) / iteration, "all_iterations_s": times,
                "memory_per_stage": {s: statistics.median(m) for s, m in stage_memory.items()},
                "bracket": passes}

    def compare(self, cluster_name: str, label: str, cluster: Cluster, plan: Plan, like: EmulatedCluster,
                profiles: Profiles, trace_dir: Path | None = None) -> tuple[dict, Prediction]:
        """Measures a plan and predicts it from its bracketing profiles (and, beside, from the
        cluster's profile `profiles`, which the planner planned with)."""
        self.log(f"{cluster_name}: running {label}: {describe(plan)}")
        measured = self.measure(f"{cluster_name}/{slug(label)}", cluster, plan, like, trace_dir, bracketed=True)
        before, after = measured["bracket"]
        around = Profiles(before.with_compute_passes(after).compute, profiles.link_profiles)
        prediction = predict(plan, cluster, CostModel(cluster, self.spec, self.setup, around))
        from_cluster_profile = predict(plan, cluster, CostModel(cluster, self.spec, self.setup, profiles))
        predicted_memory = {r.slot.stage: r.memory.total for r in prediction.reports if r.slot.replica == 0}
        iteration = measured["iteration_s"]
        row = {"cluster": cluster_name, "plan": label, "layout": describe(plan), "measured_s": iteration,
               "runs_s": measured["runs_s"], "spread": measured["spread"], "iterations_s": measured["all_iterations_s"],
               "measured_tokens_per_s": measured["tokens_per_s"],
               "predicted_s": prediction.iteration_time_s, "time_error": prediction.iteration_time_s / iteration - 1,
               "predicted_before_s": from_cluster_profile.iteration_time_s,
               "time_error_before": from_cluster_profile.iteration_time_s / iteration - 1,
               "memory": [{"stage": s, "predicted_mb": predicted_memory[s] / 2**20, "measured_mb": m / 2**20,
                           "error": predicted_memory[s] / m - 1}
                          for s, m in sorted(measured["memory_per_stage"].items())]}
        self.results["predictor"].append(row)
        self.save()
        self.log(f"  measured {iteration:.3f} s (median of {len(row['runs_s'])}, spread {row['spread']:.1%}), "
                 f"predicted {row['predicted_s']:.3f} s ({row['time_error']:+.1%}; from the cluster's profile "
                 f"{row['time_error_before']:+.1%}); memory " + ", ".join(
                     f"stage {m['stage']} {m['measured_mb']:.0f} MB vs {m['predicted_mb']:.0f} ({m['error']:+.1%})"
                     for m in row["memory"]))
        return row, prediction

    def alternatives(self, planner: Planner, taken: list[Plan], count: int) -> list[tuple[str, Plan]]:
        """The planner's next-best distinct layouts (other PP degree, family or micro-batch)."""
        found = sorted(planner.candidates(), key=lambda c: c.estimate_s)
        chosen, seen = [], {layout_key(p) for p in taken}
        for candidate in distinct_shapes(found):
            plan = planner.materialize(candidate, candidate.order)
            key = layout_key(plan)
            if key not in seen and predict(plan, planner.cluster, planner.costs).fits:
                seen.add(key)
                chosen.append((f"alternative {len(chosen) + 1} ({candidate.family})", plan))
            if len(chosen) == count:
                break
        return chosen

    # ----- the three results -----------------------------------------------------------

    def compute_cluster(self, global_batch: int) -> None:
        cluster = Cluster.load(CLUSTERS / "emu_compute.yaml")
        profiles, like = self.profile("compute", cluster)
        planner = Planner(cluster, self.spec, global_batch, OPTIONS, profiles)
        best = planner.plan()
        baseline = megatron_baseline(cluster, self.spec, global_batch, OPTIONS, profiles)
        trace_dir = self.out / "compute" / "trace"
        planned, planned_prediction = self.compare("compute", "planner", cluster, best.plan, like, profiles, trace_dir)
        stock, _ = self.compare("compute", "Megatron baseline", cluster, baseline.plan, like, profiles)
        for label, plan in self.alternatives(planner, [best.plan, baseline.plan], 2):
            self.compare("compute", label, cluster, plan, like, profiles)
        alone = {}
        for device_type, count in cluster.device_counts().items():
            share = round(global_batch * count / cluster.num_devices)
            sub = cluster.only(device_type)
            plan = Planner(sub, self.spec, share, OPTIONS, profiles).plan().plan
            self.log(f"compute: upper bound, {device_type} alone on {share} of {global_batch} sequences: {describe(plan)}")
            alone[device_type] = self.measure(f"compute/alone-{device_type}", sub, plan, like)["tokens_per_s"]
            self.log(f"  measured {alone[device_type]:.0f} tokens/s")
        bound = sum(alone.values())
        measured_timeline_png(best.plan, planned_prediction, load_traces(trace_dir), self.out / "timeline.png")
        self.results["quality"] = {
            "planner_tokens_per_s": planned["measured_tokens_per_s"],
            "baseline_tokens_per_s": stock["measured_tokens_per_s"],
            "speedup": planned["measured_tokens_per_s"] / stock["measured_tokens_per_s"],
            "upper_bound_tokens_per_s": bound, "alone_tokens_per_s": alone,
            "fraction_of_upper_bound": planned["measured_tokens_per_s"] / bound,
            "planner_layout": planned["layout"], "baseline_layout": stock["layout"]}
        self.save()

    def nic_cluster(self, global_batch: int) -> None:
        cluster = Cluster.load(CLUSTERS / "emu_nic.yaml")
        profiles, like = self.profile("nic", cluster)
        costs = CostModel(cluster, self.spec, SETUP, profiles)
        planner = Planner(cluster, self.spec, global_batch, OPTIONS, profiles)
        best = planner.plan().plan
        in_launch_order = Plan.from_dict({**best.to_dict(), "rank_order": list(range(best.world_size))})
        aware, _ = self.compare("nic", "planner (NIC-aware order)", cluster, best, like, profiles)
        taken = [best]
        if best.rank_order != in_launch_order.rank_order:
            launch, _ = self.compare("nic", "same plan in launch order", cluster, in_launch_order, like, profiles)
            taken.append(in_launch_order)
        else:
            launch = aware
        baseline = megatron_baseline(cluster, self.spec, global_batch, OPTIONS, profiles).plan
        if layout_key(baseline) not in {layout_key(p) for p in taken}:
            self.compare("nic", "Megatron baseline", cluster, baseline, like, profiles)
            taken.append(baseline)
        for label, plan in self.alternatives(planner, taken, 1):
            self.compare("nic", label, cluster, plan, like, profiles)
        # Where the order decides which links data parallelism crosses: PP=2 x DP=2, each
        # stage's replicas on the two IB nodes or on an IB and an Ethernet node.
        uniform = Plan.uniform(tensor_parallel=1, pipeline_parallel=2, data_parallel=2, micro_batch_size=1,
                               num_layers=self.spec.num_layers, global_batch_size=global_batch,
                               devices=best.devices)
        orders = [Plan.from_dict({**uniform.to_dict(), "rank_order": order}) for order in ([0, 2, 1, 3], [0, 1, 2, 3])]
        ranked = sorted(orders, key=lambda p: predict(p, cluster, costs).iteration_time_s)
        pp_aware, _ = self.compare("nic", "PP2xDP2, predictor's order", cluster, ranked[0], like, profiles)
        pp_other, _ = self.compare("nic", "PP2xDP2, other order", cluster, ranked[1], like, profiles)
        self.results["nic"] = {"aware_tokens_per_s": aware["measured_tokens_per_s"],
                               "launch_order_tokens_per_s": launch["measured_tokens_per_s"],
                               "speedup": aware["measured_tokens_per_s"] / launch["measured_tokens_per_s"],
                               "aware_rank_order": best.rank_order, "layout": aware["layout"],
                               "pp_aware": pp_aware, "pp_other": pp_other,
                               "pp_speedup": pp_aware["measured_tokens_per_s"] / pp_other["measured_tokens_per_s"]}
        self.save()

    def shapes_cluster(self, global_batch: int) -> None:
        """Uneven pipelines with unequal replicas, TP=2, both, and the planner's pick."""
        cluster = Cluster.load(CLUSTERS / "cpu_demo.yaml")
        profiles, like = self.profile("shapes", cluster, tensor_parallel=(1, 2), micro_batch_sizes=(1, 2))
        devices = plan_devices(cluster, self.spec.num_layers)
        layers = self.spec.num_layers
        fast_share = max(1, round(global_batch * 2 / 3))

        def plan(tp: int, pp: int, dp: int, stages: list[int], replicas: list[int]) -> Plan:
            return Plan.from_dict({"version": 1, "tensor_parallel": tp, "pipeline_parallel": pp,
                                   "data_parallel": dp, "micro_batch_size": 1,
                                   "stages": [{"num_layers": n} for n in stages],
                                   "replicas": [{"num_micro_batches": m} for m in replicas],
                                   "rank_order": list(range(4)), "devices": devices})

        # Launch ranks 0, 1 are the fast node, 2, 3 the slow one; logical rank order is
        # tensor fastest, then replica, then stage.
        shapes = [
            ("PP2 uneven stages, unequal replicas", plan(1, 2, 2, [layers - 1, 1],
                                                        [global_batch // 2 + 1, global_batch // 2 - 1])),
            ("TP2 x DP2, replicas by speed", plan(2, 1, 2, [layers], [fast_share, global_batch - fast_share])),
            ("TP2 x PP2, uneven stages", plan(2, 2, 1, [layers - 1, 1], [global_batch])),
            ("per-stage TP 1/2/1", per_stage_plan(layers, global_batch, devices)),
        ]
        options = PlannerOptions(tensor_parallel=(1, 2), micro_batch_sizes=(1, 2), setup=SETUP,
                                 recompute_modes=("none",), sequence_parallel=False, virtual_stages=(1,))
        picked = Planner(cluster, self.spec, global_batch, options, profiles).plan().plan
        shapes.append(("planner (TP 1 or 2)", picked))
        for label, shape in shapes[: self.max_plans]:
            self.compare("shapes", label, cluster, shape, like, profiles)


    def interleaved_cluster(self, global_batch: int) -> None:
        """The plan hetero-plan picked for the demo's model on a quiet machine while the
        predictor still timed interleaving as a plain 1F1B over chunks (its prediction 22.6%
        fast): PP2 x DP2, the slow node's stage first with 1 + 1 layers, the fast node's with
        2 + 2; and the same plan without virtual stages. Run one after the other, each
        predicted from its own bracketing profiles."""
        cluster = Cluster.load(CLUSTERS / "cpu_demo.yaml")
        profiles, like = self.profile("interleaved", cluster, micro_batch_sizes=(2,))
        devices = plan_devices(cluster, self.spec.num_layers)

        def plan(chunked: bool) -> Plan:
            stages = [{"num_layers": n, **({"virtual_stages": [n // 2] * 2} if chunked else {})} for n in (2, 4)]
            return Plan.from_dict({"version": 2, "tensor_parallel": 1, "pipeline_parallel": 2, "data_parallel": 2,
                                   "micro_batch_size": 2, "stages": stages,
                                   "replicas": [{"num_micro_batches": global_batch // 4}] * 2,
                                   "rank_order": [2, 3, 0, 1],  # stage 0 on the slow node (launch ranks 2, 3)
                                   "devices": devices})

        rows = {}
        for chunked, label in ((True, "PP2 x DP2, 2 virtual stages"), (False, "the same, plain 1F1B")):
            rows[chunked], _ = self.compare("interleaved", label, cluster, plan(chunked), like, profiles)
        self.results["interleaved"] = {
            "measured_speedup": rows[False]["measured_s"] / rows[True]["measured_s"],
            "predicted_speedup": rows[False]["predicted_s"] / rows[True]["predicted_s"],
            "errors": {"interleaved": rows[True]["time_error"], "plain": rows[False]["time_error"]}}
        self.save()


    def templates_cluster(self, global_batch: int) -> None:
        """The planner's plan of several replica templates against its best plan of one
        (--no-templates) on emu_one_fast.yaml, where memory forces the device classes into
        different shapes. Both plans are run side by side: their memory runs, then one short
        compute profile of both plans' cases, their timed runs alternating (A B, B A, A B, ...),
        and one more profile; each is predicted from the median of the two profiles."""
        cluster = Cluster.load(CLUSTERS / "emu_one_fast.yaml")
        load_before = os.getloadavg()
        profiles, like = self.profile("templates", cluster, micro_batch_sizes=TEMPLATES_OPTIONS.micro_batch_sizes)
        plans = {}
        for templates, label in ((True, "planner"), (False, "planner, --no-templates")):
            options = dataclasses.replace(TEMPLATES_OPTIONS, templates=templates)
            picked = Planner(cluster, self.spec, global_batch, options, profiles).plan()
            plans[label] = picked.plan
            self.log(f"templates: {label}: {describe(picked.plan)}, predicted "
                     f"{picked.prediction.iteration_time_s:.3f} s")
        if plans["planner"].num_templates < 2:
            self.log("templates: the planner's pick is a plan of one template on these profiles")
        name = "templates"
        memory, traces = {}, {}
        for label, plan in plans.items():
            path = self.out / name / slug(label) / "plan.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            plan.save(path)
            self.log(f"templates: memory run of {label}")
            memory[label] = self.stage_memory(plan, self.run(
                self.emulator(cluster, RankLayout.of_plan(plan), like), self.train_argv(plan, path),
                f"training {label} (memory run)", MEMORY_RUN_ENV))
        cases_tp = tuple(sorted({tp for plan in plans.values() for t in plan.templates for tp in t.stage_tensor_parallel}))
        cases_mbs = tuple(sorted({plan.micro_batch_size for plan in plans.values()}))
        passes = [self.profile_compute(self.out / name / "profile-before", cluster, like, cases_tp, cases_mbs,
                                       BRACKET_REPEATS)]
        runs: dict[str, list[float]] = {label: [] for label in plans}
        times: dict[str, list[list[float]]] = {label: [] for label in plans}
        labels = list(plans)
        for repeat in range(1, self.repeats + 1):
            for label in (labels if repeat % 2 else labels[::-1]):
                plan = plans[label]
                trace_dir = self.out / name / slug(label) / f"trace-{repeat}"
                trace = {"HETERO_TRACE_DIR": str(trace_dir), "HETERO_TRACE_ITERATION": str(self.iterations - 1)}
                these = self.run(self.emulator(cluster, RankLayout.of_plan(plan), like),
                                 self.train_argv(plan, self.out / name / slug(label) / "plan.json"),
                                 f"training {label} (timed run {repeat})", trace).iteration_times_s()
                runs[label].append(statistics.median(these[WARMUP_ITERATIONS:]))
                times[label].append(these)
                self.log(f"  {label}, run {repeat}: {runs[label][-1]:.3f} s/iteration")
        passes.append(self.profile_compute(self.out / name / "profile-after", cluster, like, cases_tp, cases_mbs,
                                           BRACKET_REPEATS))
        around = Profiles(passes[0].with_compute_passes(passes[1]).compute, profiles.link_profiles)
        rows = {}
        for label, plan in plans.items():
            prediction = predict(plan, cluster, CostModel(cluster, self.spec, self.setup, around))
            from_cluster_profile = predict(plan, cluster, CostModel(cluster, self.spec, self.setup, profiles))
            iteration = statistics.median(runs[label])
            predicted_memory = {}
            for k in range(plan.num_templates):
                first = plan.grid.replica_offsets[k]
                predicted_memory.update({(k, r.slot.stage): r.memory.total for r in prediction.reports
                                         if r.slot.replica == first})
            row = {"cluster": name, "plan": label, "layout": describe(plan), "measured_s": iteration,
                   "runs_s": runs[label], "spread": (max(runs[label]) - min(runs[label])) / iteration,
                   "iterations_s": times[label],
                   "measured_tokens_per_s": plan.global_batch_size * self.spec.seq_length / iteration,
                   "predicted_s": prediction.iteration_time_s, "time_error": prediction.iteration_time_s / iteration - 1,
                   "predicted_before_s": from_cluster_profile.iteration_time_s,
                   "time_error_before": from_cluster_profile.iteration_time_s / iteration - 1,
                   "predicted_stage_end_s": prediction.stage_end_s, "predicted_reduce_s": prediction.reduce_s,
                   "predicted_optimizer_s": prediction.optimizer_s,
                   "memory": [{"stage": stage_label(plan, k, s), "predicted_mb": predicted_memory[k, s] / 2**20,
                               "measured_mb": m / 2**20, "error": predicted_memory[k, s] / m - 1}
                              for (k, s), m in sorted(memory[label].items())]}
            rows[label] = row
            self.results["predictor"].append(row)
            self.log(f"  {label}: measured {iteration:.3f} s (median of {len(runs[label])}, spread "
                     f"{row['spread']:.1%}), predicted {row['predicted_s']:.3f} s ({row['time_error']:+.1%}; from the "
                     f"cluster's profile {row['time_error_before']:+.1%})")
        templated, one = rows["planner"], rows["planner, --no-templates"]
        self.results["templates"] = {
            "templated_layout": templated["layout"], "one_template_layout": one["layout"],
            "num_templates": plans["planner"].num_templates,
            "measured_speedup": one["measured_s"] / templated["measured_s"],
            "predicted_speedup": one["predicted_s"] / templated["predicted_s"],
            "errors": {"templated": templated["time_error"], "one_template": one["time_error"]},
            "spreads": {"templated": templated["spread"], "one_template": one["spread"]},
            "load_before": load_before, "load_after": os.getloadavg()}
        self.save()

    def train_argv(self, plan: Plan, path: Path) -> list[str]:
        return ["pretrain_gpt.py", "--hetero-plan", str(path), *self.model_flags, *DATA_FLAGS,
                "--micro-batch-size", str(plan.micro_batch_size), "--global-batch-size", str(plan.global_batch_size),
                "--train-iters", str(self.iterations), "--lr", "1e-4", "--log-interval", "1",
                "--log-memory-interval", str(self.iterations), "--eval-iters", "0"]

    def stage_memory(self, plan: Plan, result: JobResult) -> dict[tuple[int, int], float]:
        """Each (template, stage)'s peak after the last iteration, the median over its ranks."""
        found: dict[tuple[int, int], list[float]] = {}
        for memory in of_kind(result.events, Memory):
            if memory.iteration == self.iterations:
                coords = plan.grid.coords(memory.logical_rank)
                found.setdefault((coords.template, coords.pp_rank), []).append(memory.peak_mb * 2**20)
        return {key: statistics.median(m) for key, m in found.items()}


def plan_devices(cluster: Cluster, num_layers: int) -> list[dict]:
    """The cluster's devices as a plan lists them, in launch order."""
    return [d.model_dump() for d in Plan.uniform(
        tensor_parallel=1, pipeline_parallel=1, data_parallel=cluster.num_devices, micro_batch_size=1,
        num_layers=num_layers, global_batch_size=cluster.num_devices,
        devices=[{"host": n.host, "device_type": n.device.name, "vendor": n.device.vendor, "nic": n.nic.kind.name}
                 for n in cluster.nodes for _ in range(n.count)]).devices]


def per_stage_plan(layers: int, global_batch: int, devices: list[dict]) -> Plan:
    """Plan version 3 on cpu_demo: the middle stage at TP=2 on the fast node (launch ranks 0,
    1), the first and last at TP=1 on the slow one (2, 3): first and last share a degree,
    so the tied embedding stays tied."""
    return Plan.from_dict({"version": 3, "tensor_parallel": 1, "pipeline_parallel": 3, "data_parallel": 1,
                           "micro_batch_size": 1,
                           "stages": [{"num_layers": 1}, {"num_layers": layers - 2, "tensor_parallel": 2},
                                      {"num_layers": 1}],
                           "replicas": [{"num_micro_batches": global_batch}],
                           "rank_order": [2, 0, 1, 3], "devices": devices})


def describe(plan: Plan) -> str:
    if plan.num_templates > 1:
        return " + ".join(f"[{describe(plan.template_plan(k))}]" for k in range(plan.num_templates))
    layers = "/".join(str(s.num_layers) for s in plan.stages)
    micro = "/".join(str(r.num_micro_batches) for r in plan.replicas)
    tp = "/".join(map(str, plan.stage_tensor_parallel)) if plan.per_stage_tensor_parallel else plan.tensor_parallel
    return (f"TP{tp} PP{plan.pipeline_parallel} DP{plan.data_parallel} mbs {plan.micro_batch_size} "
            f"layers {layers} micro-batches {micro} order {plan.rank_order}")


def stage_label(plan: Plan, template: int, stage: int) -> str:
    return f"{stage} of template {template + 1}" if plan.num_templates > 1 else str(stage)


def layout_key(plan: Plan) -> tuple:
    return (tuple(plan.stage_tensor_parallel), plan.pipeline_parallel, plan.data_parallel, plan.micro_batch_size,
            tuple(s.num_layers for s in plan.stages), tuple(r.num_micro_batches for r in plan.replicas),
            tuple(plan.rank_order))


def slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def load_traces(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("trace-rank*.json"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "bench-emulated"))
    parser.add_argument("--iterations", type=int, default=8,
                        help="training iterations per run (2 warm-up; iterations of one run vary by 10-15%%)")
    parser.add_argument("--global-batch-size", type=int, default=48,
                        help="of the compute cluster: 24 micro-batches of 2 split 7/7/7/3 within 2%% of the "
                             "devices' speeds; 16 of 2 (32) cannot come closer than 9%%")
    parser.add_argument("--small-global-batch-size", type=int, default=16, help="of the NIC and shapes clusters")
    parser.add_argument("--only", choices=["compute", "nic", "shapes", "interleaved", "templates"], default=None)
    parser.add_argument("--templates-global-batch-size", type=int, default=TEMPLATES_GLOBAL_BATCH,
                        help="of the templates cluster")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every plan (median, spread)")
    parser.add_argument("--plans", type=int, default=None, help="at most this many plans of the shapes scenario")
    options = parser.parse_args()
    stop_on_termination_signals()  # a killed bench still removes its emulated cluster
    missing = EmulatedCluster.missing_prerequisites()
    if missing:
        print("emulated bench skipped: " + "; ".join(missing), file=sys.stderr)
        return 2
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(out, options.iterations, options.repeats, options.plans)
    start = time.monotonic()
    if options.only in (None, "compute"):
        bench.compute_cluster(options.global_batch_size)
    if options.only in (None, "nic"):
        bench.nic_cluster(options.small_global_batch_size)
    if options.only in (None, "shapes"):
        bench.shapes_cluster(options.small_global_batch_size)
    if options.only in (None, "compute", "nic", "shapes"):
        bench.save()
        print("\n" + report(bench.results))
    if options.only in (None, "interleaved"):  # the demo's model, so a bench (and report) of its own
        demo = Bench(out / "demo-model", options.iterations, options.repeats, model_flags=DEMO_MODEL_FLAGS,
                     setup=DEMO_SETUP)
        demo.interleaved_cluster(options.small_global_batch_size)
        print("\n" + report(demo.results))
    if options.only in (None, "templates"):  # a cluster and report of its own
        templated = Bench(out / "templates", options.iterations, options.repeats, model_flags=TEMPLATES_MODEL_FLAGS)
        templated.templates_cluster(options.templates_global_batch_size)
        print("\n" + report(templated.results))
    print(f"(bench took {time.monotonic() - start:.0f} s; files in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
