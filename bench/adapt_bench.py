"""--hetero-adapt measured on the emulated compute cluster (3 fast + 1 half-speed device).

    sudo python bench/adapt_bench.py          # ~15 min on 2 cores; needs root

1. Fixed splits: the global batch split over the four replicas with the slow one given
   each count in --slow-counts (the rest shared evenly by the fast ones), every split run
   --repeats times; the best one's median throughput is the target.
2. The Megatron baseline's equal split, run for --iterations iterations with and without
   --hetero-adapt: the adapted run must come within 5% of the best fixed split's
   throughput within those iterations, with the losses of the run without it (<= 1e-4).

Throughput of a run: global batch x sequence length / the median time of its last 5
iterations (past warm-up).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hetero.events import Iteration, of_kind  # noqa: E402
from hetero.spec.cluster import Cluster  # noqa: E402
from hetero.plan import Plan  # noqa: E402
from tools.emulator import EmulatedCluster, RankLayout, stop_on_termination_signals  # noqa: E402

MODEL_FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
               "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "2047",
               "--attention-dropout", "0", "--hidden-dropout", "0", "--mock-data",
               "--tokenizer-type", "NullTokenizer", "--num-workers", "0", "--lr", "1e-4",
               "--log-interval", "1", "--eval-iters", "0", "--seed", "1234"]
SEQUENCE = 128
WARMUP = 2
SETTLED = 5  # a run's throughput: the median of its last iterations
# The re-split is only in the log so far (megatron.hetero.adapt prints it; no event yet).
RESPLIT = re.compile(r"hetero-adapt after iteration (\d+): .* -> \[([^]]*)\] \(slowest")


def log(message: str) -> None:
    print(f"[adapt-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def split_plan(cluster: Cluster, counts: list[int]) -> Plan:
    devices = [{"host": node.host, "device_type": node.device.name, "vendor": node.device.vendor,
                "nic": node.nic.kind.name} for node in cluster.nodes for _ in range(node.count)]
    return Plan.from_dict({
        "version": 1, "tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": len(counts),
        "micro_batch_size": 1, "stages": [{"num_layers": 4}],
        "replicas": [{"num_micro_batches": m} for m in counts],
        "rank_order": list(range(len(counts))), "devices": devices})


def settled(seconds: list[float]) -> list[float]:
    """The iterations a run's throughput is taken from: its last ones, past warm-up."""
    return seconds[max(WARMUP, len(seconds) - SETTLED):]


def fast_slow_split(global_batch: int, slow: int, fast_replicas: int) -> list[int]:
    rest = global_batch - slow
    return [rest // fast_replicas + (1 if i < rest % fast_replicas else 0)
            for i in range(fast_replicas)] + [slow]


class Bench:
    def __init__(self, out: Path, cluster: Cluster, iterations: int):
        self.out, self.cluster, self.iterations = out, cluster, iterations
        self.like: EmulatedCluster | None = None

    def run(self, name: str, plan: Plan, iterations: int, extra: list[str] = ()) -> dict:
        path = self.out / f"{name}.json"
        plan.save(path)
        layout = RankLayout.of_plan(plan)
        emulated = (EmulatedCluster(self.cluster, layout) if self.like is None else
                    EmulatedCluster(self.cluster, layout, compute_scale=self.like.compute_scale,
                                    net_scale=self.like.net_scale,
                                    reference_tflops=self.like.reference_tflops))
        self.like = self.like or emulated
        argv = ["pretrain_gpt.py", "--hetero-plan", str(path), *MODEL_FLAGS,
                "--micro-batch-size", "1", "--global-batch-size", str(plan.global_batch_size),
                "--train-iters", str(iterations), *extra]
        with emulated:
            result = emulated.run(argv, echo=False, timeout=3600)
        (self.out / f"{name}.log").write_text(result.output)
        if result.returncode != 0:
            raise SystemExit(f"{name} failed (exit {result.returncode}):\n{result.output[-4000:]}")
        rows = [(e.iteration, e.elapsed_s, e.losses["lm loss"]) for e in of_kind(result.events, Iteration)]
        resplits = [(int(i), split) for i, split in RESPLIT.findall(result.output)]
        return {"seconds": [s for _, s, _ in rows], "losses": [loss for _, _, loss in rows],
                "resplits": resplits}

    def tokens_per_s(self, plan: Plan, seconds: list[float]) -> float:
        return plan.global_batch_size * SEQUENCE / statistics.median(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "bench-adapt"))
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=20, help="of the adapted run")
    parser.add_argument("--fixed-iterations", type=int, default=7, help="of each fixed split")
    parser.add_argument("--slow-counts", type=int, nargs="+", default=[3, 4, 5, 6])
    parser.add_argument("--repeats", type=int, default=2, help="runs of every fixed split")
    options = parser.parse_args()
    stop_on_termination_signals()  # a killed bench still removes its emulated cluster
    missing = EmulatedCluster.missing_prerequisites()
    if missing:
        print("adapt bench skipped: " + "; ".join(missing), file=sys.stderr)
        return 2
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster.load(REPO / "examples" / "clusters" / "emu_compute.yaml")
    bench = Bench(out, cluster, options.iterations)
    batch, replicas = options.global_batch_size, cluster.num_devices
    started = time.monotonic()

    fixed = {}
    for slow in options.slow_counts:
        counts = fast_slow_split(batch, slow, replicas - 1)
        plan = split_plan(cluster, counts)
        runs = [bench.tokens_per_s(plan, settled(bench.run(f"fixed-{slow}-{r}", plan,
                                                           options.fixed_iterations)["seconds"]))
                for r in range(options.repeats)]
        fixed[str(counts)] = {"tokens_per_s": statistics.median(runs), "runs": runs}
        log(f"fixed split {counts}: {statistics.median(runs):.0f} tokens/s (runs "
            f"{', '.join(f'{r:.0f}' for r in runs)})")
    best_split, best = max(fixed.items(), key=lambda item: item[1]["tokens_per_s"])

    equal = split_plan(cluster, [batch // replicas] * replicas)
    plain = bench.run("equal", equal, options.iterations)
    adapted = bench.run("equal-adapted", equal, options.iterations,
                        ["--hetero-adapt", "--hetero-adapt-output", str(out / "adapted_plan.json")])
    seconds = adapted["seconds"]
    adapted_rate = bench.tokens_per_s(equal, settled(seconds))
    plain_rate = bench.tokens_per_s(equal, settled(plain["seconds"]))
    # The first iteration whose last three (median) ran within 5% of the best split.
    within = next((i + 1 for i in range(WARMUP + 2, len(seconds))
                   if bench.tokens_per_s(equal, seconds[i - 2:i + 1]) >= 0.95 * best["tokens_per_s"]),
                  None)
    differences = [abs(a - b) / abs(b) for a, b in zip(adapted["losses"], plain["losses"])]
    results = {
        "fixed": fixed, "best_split": best_split, "best_tokens_per_s": best["tokens_per_s"],
        "equal_tokens_per_s": plain_rate, "adapted_tokens_per_s": adapted_rate,
        "adapted_vs_best": adapted_rate / best["tokens_per_s"], "resplits": adapted["resplits"],
        "first_iteration_within_5pct": within, "max_relative_loss_difference": max(differences),
        "adapted_iteration_s": adapted["seconds"], "equal_iteration_s": plain["seconds"],
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nbest fixed split {best_split}: {best['tokens_per_s']:.0f} tokens/s; equal split "
          f"{plain_rate:.0f}; equal split with --hetero-adapt {adapted_rate:.0f} "
          f"({adapted_rate / best['tokens_per_s']:.1%} of the best) after re-splits "
          f"{adapted['resplits']}; first iteration within 5% of the best: {within}; "
          f"largest loss difference vs the run without it: {max(differences):.2e} "
          f"(bench took {time.monotonic() - started:.0f} s)")
    ok = adapted_rate >= 0.95 * best["tokens_per_s"] and max(differences) <= 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
