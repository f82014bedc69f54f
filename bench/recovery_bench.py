"""What a lost node costs, in-process restart against a restart from the disk checkpoint,
measured side by side on the emulated cpu_demo cluster (a fast and a slow node, two ranks
each; tools/emulator, needs root).

    sudo python bench/recovery_bench.py                 # about 10 minutes on 2 cores
    sudo python bench/recovery_bench.py --repeats 1     # a quick check

1. Snapshot overhead: the same job with and without --inprocess-restart (a snapshot of every
   rank's model and optimizer into host memory after every iteration, copied to a rank on the
   other node), runs alternated; median iteration time of each run, then the median and the
   spread over runs; and the host memory the snapshots hold per rank. Target: <= 3%.
2. Recovery: the slow node is killed after an iteration (between snapshots, not at a
   checkpoint); the time from the kill to the first iteration logged after it, and the
   iterations trained again, for in-process restart (survivors re-planned in place, state from
   memory) and for the elastic restart from the last checkpoint (--save-interval 5). Target:
   <= 5 s in-process.

Every run is a fresh emulated job under the emulator's supervisor; iteration times and losses
come from the job's own event records (hetero.events).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hetero.events import Iteration, SnapshotCost, StateRestored, of_kind, read_events  # noqa: E402
from tools.emulator.cluster import kill_node  # noqa: E402

CLUSTER = REPO / "examples" / "clusters" / "cpu_demo.yaml"
MODEL = {"num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 512, "num_attention_heads": 4,
         "num_query_groups": 4, "seq_length": 64, "vocab_size": 1024, "swiglu": False,
         "untie_embeddings_and_output_weights": False, "add_bias_linear": True,
         "normalization": "LayerNorm", "position_embedding_type": "learned_absolute"}
FLAGS = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--lr", "1e-3", "--lr-decay-style", "constant", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "1000", "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--seed", "1234",
         "--use-distributed-optimizer"]


def plan(workdir: Path) -> Path:
    import yaml

    model = workdir / "model.yaml"
    model.write_text(yaml.safe_dump(MODEL))
    path = workdir / "plan.json"
    subprocess.run([sys.executable, "-m", "hetero.cli", "--cluster", str(CLUSTER), "--model", str(model),
                    "--global-batch-size", "16", "--seq-length", "64", "--micro-batch-size", "2",
                    "--precision", "fp32", "--no-fused-kernels", "--no-dropout", "--skip-baseline",
                    "--skip-upper-bound", "--quiet", "-o", str(path)], cwd=REPO, check=True)
    return path


def supervised(plan_path: Path, run_dir: Path, flags: list[str], kill_after: int | None = None
               ) -> tuple[float | None, list[list], str]:
    """One job under the emulator's supervisor; kills node-slow once iteration kill_after is
    logged. Returns (the kill's time, each attempt's events, the output)."""
    proc = subprocess.Popen([sys.executable, "-m", "tools.emulator", "--cluster", str(CLUSTER), "--plan",
                             str(plan_path), "--elastic", "--run-dir", str(run_dir), "--", "pretrain_gpt.py",
                             *flags], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, killed_at = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if kill_after is not None and f"iteration {kill_after:8d}/" in line:
                time.sleep(0.3)
                killed_at = time.time()
                kill_node("node-slow")
                break
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if code != 0:
        raise SystemExit(f"a benchmark job failed (exit {code}):\n" + "".join(lines)[-4000:])
    attempts = [read_events(folder) for folder in sorted(run_dir.glob("attempt-*-events"))]
    return killed_at, attempts, "".join(lines)


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if values else 0.0


def overhead(plan_path: Path, workdir: Path, repeats: int, iters: int) -> dict:
    per_run = {"off": [], "on": []}
    memory = []
    for repeat in range(repeats):
        for mode in ("off", "on"):
            flags = FLAGS + ["--train-iters", str(iters)] + (["--inprocess-restart"] if mode == "on" else [])
            if mode == "off":
                flags += ["--save", str(workdir / f"unused-{repeat}"), "--save-interval", "100000"]
            _, (recorded,), _ = supervised(plan_path, workdir / f"overhead-{mode}-{repeat}", flags)
            times = [e.elapsed_s for e in of_kind(recorded, Iteration)][3:]  # past the warm-up
            per_run[mode].append(statistics.median(times))
            memory += [e.host_bytes for e in of_kind(recorded, SnapshotCost)]
            print(f"  overhead run {repeat} {mode}: median iteration {per_run[mode][-1] * 1e3:.1f} ms", flush=True)
    ratios = [on / off for on, off in zip(per_run["on"], per_run["off"])]
    return {"iteration_ms_without": statistics.median(per_run["off"]) * 1e3,
            "iteration_ms_with": statistics.median(per_run["on"]) * 1e3,
            "spread_without": spread(per_run["off"]), "spread_with": spread(per_run["on"]),
            "overhead_pct_median": (statistics.median(ratios) - 1) * 100,
            "overhead_pct_pairs": [(r - 1) * 100 for r in ratios],
            "snapshot_host_mb_per_rank_max": max(memory) / 2**20 if memory else None,
            "snapshot_host_mb_per_rank": sorted(m / 2**20 for m in memory)}


def recovery(plan_path: Path, workdir: Path, repeats: int, iters: int, kill_after: int) -> dict:
    found = {"in-process": [], "disk": []}
    redone = {"in-process": [], "disk": []}
    for repeat in range(repeats):
        for mode in ("in-process", "disk"):
            flags = FLAGS + ["--train-iters", str(iters)]
            flags += ["--inprocess-restart"] if mode == "in-process" else [
                "--save", str(workdir / f"ckpt-{repeat}"), "--save-interval", "5"]
            killed_at, attempts, _ = supervised(plan_path, workdir / f"recovery-{mode}-{repeat}", flags,
                                                kill_after=kill_after)
            first = of_kind(attempts[0], Iteration)
            before = max(e.iteration for e in first if e.time <= killed_at)
            # The first iteration trained after the recovery: after the state was restored in
            # the same processes, or in the restarted attempt (an iteration in flight at the
            # kill and logged just after it is no recovery).
            if mode == "in-process":
                (restored,) = of_kind(attempts[0], StateRestored)
                resumed = [e for e in first if e.time > restored.time]
            else:
                resumed = of_kind(attempts[-1], Iteration)
            after = min(resumed, key=lambda e: e.time)
            found[mode].append(after.time - killed_at)
            redone[mode].append(before - (after.iteration - 1))
            print(f"  recovery run {repeat} {mode}: kill -> iteration {after.iteration} in "
                  f"{found[mode][-1]:.2f} s ({redone[mode][-1]} iterations trained again)", flush=True)
    return {mode: {"kill_to_first_iteration_s_median": statistics.median(values),
                   "kill_to_first_iteration_s": values, "spread": spread(values),
                   "iterations_trained_again": redone[mode]} for mode, values in found.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--only", choices=["overhead", "recovery"])
    parser.add_argument("--out", default=None, help="results.json goes there (default: print only)")
    options = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="recovery-bench.") as tmp:
        workdir = Path(tmp)
        plan_path = plan(workdir)
        if options.only in (None, "overhead"):
            print("snapshot overhead (every iteration, one copy on the other node):", flush=True)
            results["overhead"] = overhead(plan_path, workdir, options.repeats, options.iters)
        if options.only in (None, "recovery"):
            print("recovery after a lost node (kill -> first resumed iteration):", flush=True)
            results["recovery"] = recovery(plan_path, workdir, options.repeats, 16, kill_after=7)
    print(json.dumps(results, indent=2))
    if options.out:
        Path(options.out).mkdir(parents=True, exist_ok=True)
        (Path(options.out) / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
