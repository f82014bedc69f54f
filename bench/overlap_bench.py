"""--overlap-grad-reduce measured on the emulated NIC cluster: same plan, with and without.

    sudo python bench/overlap_bench.py                 # ~5 min on 2 cores; needs root
    python bench/overlap_bench.py --rounds 3 --out DIR # results.json beside the table

Two emulated nodes joined by Ethernet (node-0 and node-1 of examples/clusters/emu_nic.yaml:
node-1 has only the Ethernet NIC, shaped by tools/emulator), one data-parallel replica on
each, unequal micro-batch counts (5 and 3). The two settings alternate, round after round,
so that drifting load on the machine hits both alike. Per run: the median iteration time
after warm-up, and from a traced iteration the time spent in finalize_model_grads by the
rank that reaches it last, i.e. the data-parallel reduction left exposed after the backward
pass. The share of the reduction overlapped is 1 - exposed(with) / exposed(without).
Gradient buckets: --ddp-bucket-size 1000000 (Megatron's default of 40M elements would put
this small model in one bucket, whose reduction can only start after the whole backward).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hetero.spec.cluster import Cluster  # noqa: E402
from hetero.plan import DeviceEntry, Plan  # noqa: E402
from tools.emulator import EmulatedCluster, RankLayout, stop_on_termination_signals  # noqa: E402

NODES = ("node-0", "node-1")  # InfiniBand and Ethernet: the replicas meet over Ethernet
MODEL_FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
               "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "2047",
               "--attention-dropout", "0", "--hidden-dropout", "0", "--mock-data",
               "--tokenizer-type", "NullTokenizer", "--num-workers", "0", "--lr", "1e-4",
               "--log-interval", "1", "--eval-iters", "0", "--ddp-bucket-size", "1000000"]
SETTINGS = {"without overlap": [], "--overlap-grad-reduce": ["--overlap-grad-reduce"]}
WARMUP_ITERATIONS = 2


def two_node_plan(cluster: Cluster) -> Plan:
    devices = [DeviceEntry(host=node.host, device_type=node.device.name, vendor=node.device.vendor,
                           nic=node.nic.kind.name) for node in cluster.nodes if node.host in NODES]
    return Plan.from_dict({"version": 1, "tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 2,
                           "micro_batch_size": 2, "stages": [{"num_layers": 4}],
                           "replicas": [{"num_micro_batches": 5}, {"num_micro_batches": 3}],
                           "rank_order": [0, 1], "devices": [d.model_dump() for d in devices]})


def run_once(emulated: EmulatedCluster, plan_path: Path, flags: list[str], iterations: int,
             trace_dir: Path) -> dict:
    argv = ["pretrain_gpt.py", "--hetero-plan", str(plan_path), *MODEL_FLAGS, *flags,
            "--train-iters", str(iterations)]
    env = {"HETERO_TRACE_DIR": str(trace_dir), "HETERO_TRACE_ITERATION": str(iterations)}
    with emulated:
        result = emulated.run(argv, echo=False, env=env, timeout=1200)
    if result.returncode != 0:
        raise SystemExit(f"run failed (exit {result.returncode}):\n{result.output[-4000:]}")
    times = result.iteration_times_s()
    return {"iteration_s": statistics.median(times[WARMUP_ITERATIONS:]), "all_iterations_s": times,
            "exposed_reduction_s": exposed_reduction(trace_dir)}


def exposed_reduction(trace_dir: Path) -> float:
    """Time in finalize_model_grads of the rank that gets there last: the reduction left
    after the backward pass. (A rank arriving earlier also waits for the other replica's
    remaining micro-batches, which is imbalance, not communication.)"""
    reduces = []
    for trace in trace_dir.glob("trace-rank*.json"):
        spans = json.loads(trace.read_text())["spans"]
        reduces += [(start, end - start) for kind, _, start, end in spans if kind == "reduce"]
    return max(reduces)[1]


def summarize(runs: dict[str, list[dict]]) -> dict:
    summary = {}
    for setting, results in runs.items():
        times = [r["iteration_s"] for r in results]
        exposed = [r["exposed_reduction_s"] for r in results]
        summary[setting] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                            "exposed_reduction_s": statistics.median(exposed)}
    plain, overlapped = summary["without overlap"], summary["--overlap-grad-reduce"]
    overlapped["reduction_overlapped"] = 1 - overlapped["exposed_reduction_s"] / plain["exposed_reduction_s"]
    overlapped["reduction_hidden_s"] = plain["exposed_reduction_s"] - overlapped["exposed_reduction_s"]
    # Each round ran both settings back to back: its difference is free of the drift
    # between rounds that the medians above still carry.
    saved = [a["iteration_s"] - b["iteration_s"]
             for a, b in zip(runs["without overlap"], runs["--overlap-grad-reduce"])]
    overlapped["iteration_saved_s"] = statistics.median(saved)
    overlapped["iteration_saved_per_round_s"] = saved
    return summary


def table(summary: dict, rounds: int) -> str:
    lines = [f"| setting | iteration (median of {rounds}) | spread (min-max) | exposed DP reduction | "
             "reduction hidden | iteration time saved (median of rounds; min-max) |",
             "|---|---:|---:|---:|---:|---:|"]
    for setting, row in summary.items():
        hidden, saved = "-", "-"
        if "reduction_overlapped" in row:
            hidden = f"{row['reduction_hidden_s'] * 1e3:.0f} ms ({row['reduction_overlapped']:.0%})"
            per_round = row["iteration_saved_per_round_s"]
            saved = (f"{row['iteration_saved_s'] * 1e3:.0f} ms ({min(per_round) * 1e3:.0f} to "
                     f"{max(per_round) * 1e3:.0f})")
        lines.append(f"| {setting} | {row['median_s'] * 1e3:.0f} ms | {row['min_s'] * 1e3:.0f}-"
                     f"{row['max_s'] * 1e3:.0f} ms | {row['exposed_reduction_s'] * 1e3:.0f} ms | {hidden} | {saved} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="runs of each setting (alternating)")
    parser.add_argument("--iterations", type=int, default=8, help="training iterations per run")
    parser.add_argument("--out", type=Path, default=None, help="directory for results.json")
    options = parser.parse_args()
    stop_on_termination_signals()  # a killed bench still removes its emulated cluster
    missing = EmulatedCluster.missing_prerequisites()
    if missing:
        raise SystemExit("the emulated cluster needs: " + "; ".join(missing))
    cluster = Cluster.load(REPO / "examples" / "clusters" / "emu_nic.yaml")
    plan = two_node_plan(cluster)
    out = options.out or Path(tempfile.mkdtemp(prefix="overlap_bench."))
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    plan.save(plan_path)
    runs: dict[str, list[dict]] = {setting: [] for setting in SETTINGS}
    for round_index in range(options.rounds):
        for setting, flags in SETTINGS.items():
            emulated = EmulatedCluster(cluster, RankLayout.of_plan(plan))
            if round_index == 0 and setting == "without overlap":
                print(emulated.describe(), flush=True)
            result = run_once(emulated, plan_path, flags, options.iterations,
                              out / f"trace-{round_index}-{len(runs[setting])}-{setting.strip('-')}")
            runs[setting].append(result)
            print(f"[bench {time.strftime('%H:%M:%S')}] round {round_index + 1}, {setting}: "
                  f"{result['iteration_s'] * 1e3:.0f} ms per iteration, exposed reduction "
                  f"{result['exposed_reduction_s'] * 1e3:.0f} ms", flush=True)
    summary = summarize(runs)
    (out / "results.json").write_text(json.dumps({"plan": plan.summary(), "runs": runs, "summary": summary},
                                                 indent=2))
    print(f"\nplan: {plan.summary()} over {' and '.join(NODES)} (Ethernet between them)")
    print(table(summary, options.rounds))
    print(f"\nresults: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
