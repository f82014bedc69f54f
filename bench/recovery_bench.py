"""What a lost node costs, in-process restart against a restart from the disk checkpoint,
measured side by side on the emulated cpu_demo cluster (a fast and a slow node, two ranks
each; tools/emulator, needs root).

    sudo python bench/recovery_bench.py                 # parts 1 and 2 about 10 minutes on 2 cores
    sudo python bench/recovery_bench.py --repeats 1     # a quick check
    sudo python bench/recovery_bench.py --only goodput  # part 3 alone (a 4-node cluster of its own)

1. Snapshot overhead: the same job with and without --inprocess-restart (a snapshot of every
   rank's model and optimizer into host memory at the default interval, which the job measures
   and logs, copied to a rank on the other node), runs alternated; the wall time per iteration
   from the first logged iteration past the warm-up to the last (snapshots included), then the
   median and the spread over runs; and the host memory the snapshots hold per rank.
   Target: <= 3%.
2. Recovery: the slow node is killed after an iteration (between snapshots, not at a
   checkpoint); the time from the kill to the first iteration logged after it, and the
   iterations trained again, for in-process restart (survivors re-planned in place, state from
   memory) and for the elastic restart from the last checkpoint (--save-interval 5). Target:
   <= 5 s in-process.

3. Goodput (--only goodput): a 200-iteration job on a 4-node emulated cluster (one cpu-fast
   rank per node, four data-parallel replicas) loses node-b at iteration 50, node-c at 100 and
   node-d at 150 and finishes on node-a; in-process restart against the elastic restart from
   disk checkpoints (--save-interval 10, a new attempt per loss), runs alternated. Per mode:
   wall time start -> finish, iterations trained again, time lost (wall minus the kept
   iterations' times: the last time each iteration was trained) and goodput (kept time /
   wall), and kill -> first resumed iteration for each loss, and where the time lost went.
   Every attempt's ranks keep their share of the machine (the emulator's elastic runner sizes
   the quotas for the whole cluster), so that a restart on fewer ranks does not run on faster
   emulated devices than the in-process survivors. One repeat unless --repeats says more (a
   run per mode takes minutes).

Every run is a fresh emulated job under the emulator's supervisor; iteration times and losses
come from the job's own event records (hetero.events). A node is killed by SIGKILL to its
processes within the benchmark's own job only (other emulated jobs on the machine may use the
same host names).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
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
from hetero import env as hetero_env  # noqa: E402
from tools.emulator.cluster import descendants  # noqa: E402

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


def plan(workdir: Path, cluster: Path = CLUSTER, name: str = "plan.json") -> Path:
    """hetero-plan's plan of MODEL (global batch 16, micro-batch 2, fp32) for the cluster."""
    import yaml

    model = workdir / "model.yaml"
    model.write_text(yaml.safe_dump(MODEL))
    path = workdir / name
    subprocess.run([sys.executable, "-m", "hetero.cli", "--cluster", str(cluster), "--model", str(model),
                    "--global-batch-size", "16", "--seq-length", "64", "--micro-batch-size", "2",
                    "--precision", "fp32", "--no-fused-kernels", "--no-dropout", "--skip-baseline",
                    "--skip-upper-bound", "--quiet", "-o", str(path)], cwd=REPO, check=True)
    return path


def kill_node_of(job_pid: int, host: str) -> int:
    """SIGKILL to every process of one emulated node of the job under job_pid (its launcher
    and its workers), as tools.emulator.cluster.kill_node does, but only within this job:
    another emulated job on the machine may have a node of the same name."""
    marker = f"{hetero_env.EMULATED_HOST}={host}".encode()
    killed = 0
    for pid in descendants([job_pid]):
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        except (OSError, ProcessLookupError):
            pass
    return killed


def attempts_of(run_dir: Path) -> list[list]:
    """Each attempt's events, in attempt order."""
    folders = sorted(run_dir.glob("attempt-*-events"), key=lambda f: int(f.name.split("-")[1]))
    return [read_events(folder) for folder in folders]


def supervised_losing(cluster: Path, plan_path: Path, run_dir: Path, flags: list[str],
                      losses: list[tuple[int, str]] = (), max_restarts: int = 3
                      ) -> tuple[float, float, list[float], list[int], list[list], str]:
    """One job under the emulator's supervisor; kills each (iteration, host) of losses's node
    once that iteration is logged (the first time: after a resume from disk the iteration
    numbers repeat). Returns (start, end, each kill's time, the processes each kill ended, each attempt's
    events, output)."""
    pending = list(losses)
    emulator = ["-m", "tools.emulator"]
    started = time.time()
    proc = subprocess.Popen([sys.executable, *emulator, "--cluster", str(cluster), "--plan",
                             str(plan_path), "--elastic", "--max-restarts", str(max_restarts), "--run-dir",
                             str(run_dir), "--", "pretrain_gpt.py", *flags], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, kills, killed = [], [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            if pending and f"iteration {pending[0][0]:8d}/" in line:
                time.sleep(0.3)
                kills.append(time.time())
                killed.append(kill_node_of(proc.pid, pending[0][1]))
                if killed[-1] == 0:
                    raise SystemExit(f"no process of {pending[0][1]} to kill:\n" + "".join(lines)[-4000:])
                pending.pop(0)
        code = proc.wait(timeout=900)
        ended = time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if code != 0 or pending:
        fd, kept = tempfile.mkstemp(prefix="recovery-bench-failed.", suffix=".log")
        with os.fdopen(fd, "w") as log:
            log.write("".join(lines))
        raise SystemExit(f"a benchmark job failed (exit {code}, losses not reached: {pending}; its whole output "
                         f"in {kept}):\n" + "".join(lines)[-4000:])
    return started, ended, kills, killed, attempts_of(run_dir), "".join(lines)


def supervised(plan_path: Path, run_dir: Path, flags: list[str], kill_after: int | None = None
               ) -> tuple[float | None, list[list], str]:
    """One job under the emulator's supervisor; kills node-slow once iteration kill_after is
    logged. Returns (the kill's time, each attempt's events, the output)."""
    losses = [(kill_after, "node-slow")] if kill_after is not None else []
    _, _, kills, _, attempts, output = supervised_losing(CLUSTER, plan_path, run_dir, flags, losses)
    return (kills[0] if kills else None), attempts, output


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if values else 0.0


def overhead(plan_path: Path, workdir: Path, repeats: int, iters: int) -> dict:
    per_run = {"off": [], "on": []}
    memory, intervals, snapshot_ms, own_clock = [], [], [], []
    for repeat in range(repeats):
        for mode in ("off", "on"):
            flags = FLAGS + ["--train-iters", str(iters)] + (["--inprocess-restart"] if mode == "on" else [])
            if mode == "off":
                flags += ["--save", str(workdir / f"unused-{repeat}"), "--save-interval", "100000"]
            _, (recorded,), output = supervised(plan_path, workdir / f"overhead-{mode}-{repeat}", flags)
            chosen = re.findall(r"a snapshot every (\d+) iteration", output)
            if chosen:
                intervals.append(int(chosen[-1]))
            # The job's own clock: what a snapshot costs per iteration at the interval it chose
            for added, error, iteration, every in re.findall(
                    r"a snapshot takes \d+ ms and adds (-?\d+) \+- (\d+) ms to the time between iteration "
                    r"boundaries, an iteration takes (\d+) ms: a snapshot every (\d+) iteration", output)[-1:]:
                scale = 100 / int(every) / int(iteration)
                own_clock.append((int(added) * scale, int(error) * scale))
            logged = sorted(of_kind(recorded, Iteration), key=lambda e: e.iteration)[3:]  # past the warm-up
            # The wall time per iteration from the first log line to the last: every iteration
            # and everything between them (a snapshot comes after the logged iteration time, as
            # Megatron-LM's checkpoint time does, and every N iterations: a mean, not a median)
            per_run[mode].append((logged[-1].time - logged[0].time) / (len(logged) - 1))
            memory += [e.host_bytes for e in of_kind(recorded, SnapshotCost)]
            # each rank's median snapshot, past the plan's first two (taken in full)
            snapshot_ms += [statistics.median(e.seconds[2:]) * 1e3 for e in of_kind(recorded, SnapshotCost)
                            if len(e.seconds) > 2]
            print(f"  overhead run {repeat} {mode}: {per_run[mode][-1] * 1e3:.1f} ms per iteration", flush=True)
    ratios = [on / off for on, off in zip(per_run["on"], per_run["off"])]
    return {"iteration_ms_without": statistics.median(per_run["off"]) * 1e3,
            "iteration_ms_with": statistics.median(per_run["on"]) * 1e3,
            "spread_without": spread(per_run["off"]), "spread_with": spread(per_run["on"]),
            "overhead_pct_median": (statistics.median(ratios) - 1) * 100,
            "overhead_pct_pairs": [(r - 1) * 100 for r in ratios],
            "snapshot_interval_chosen": intervals,
            # what the job measured over its first iterations, and that measurement's standard error
            "overhead_pct_by_the_jobs_clock": [round(pct, 2) for pct, _ in own_clock],
            "overhead_pct_by_the_jobs_clock_error": [round(err, 2) for _, err in own_clock],
            "snapshot_ms_median_per_rank": sorted(snapshot_ms),
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


FOUR_NODES = {
    "name": "cpu-four",
    "devices": {"cpu-fast": {"vendor": "cpu", "memory_gib": 4, "peak_tflops": 0.05, "memory_bandwidth_gbs": 5}},
    "groups": [{"name": "local", "nodes": [
        {"host": f"node-{name}", "device": "cpu-fast", "count": 1, "intra_link": "loopback",
         "nic": {"kind": "ethernet", "gbps": 8}} for name in ("a", "b", "c", "d")]}],
}
GOODPUT_ITERS = 200
GOODPUT_LOSSES = [(50, "node-b"), (100, "node-c"), (150, "node-d")]


def four_node_plan(workdir: Path) -> tuple[Path, Path]:
    """The 4-node cluster and its plan: four data-parallel replicas, one per node (global
    batch 16, micro-batch 2), so that every loss takes a replica and the survivors go on."""
    import yaml

    from hetero.plan import Plan

    cluster = workdir / "four.yaml"
    cluster.write_text(yaml.safe_dump(FOUR_NODES))
    path = plan(workdir, cluster, "plan-four.json")
    hosts = sorted({host for host, _ in Plan.load(path).hosts()})
    want = sorted(node["host"] for node in FOUR_NODES["groups"][0]["nodes"])
    if hosts != want:
        raise SystemExit(f"the 4-node plan uses {hosts}, not every node {want}: adjust the model or batch")
    return cluster, path


def first_resumed(attempts: list[list], killed_at: float, in_process: bool):
    """The first iteration trained after the recovery from the kill at killed_at: in-process,
    the first logged after the state was restored (an iteration in flight at the kill and
    logged just after it is no recovery); else (or when the supervisor fell back to a new
    attempt) the first of the attempts started after the kill."""
    if in_process:
        restored = [e for events in attempts for e in of_kind(events, StateRestored) if e.time > killed_at]
        if restored:
            restored_at = min(restored, key=lambda e: e.time)
            after = [e for events in attempts for e in of_kind(events, Iteration) if e.time > restored_at.time]
            if after:
                return min(after, key=lambda e: e.time), restored_at
    running = max((i for i, events in enumerate(attempts) if any(e.time <= killed_at for e in events)), default=0)
    after = [e for events in attempts[running + 1:] for e in of_kind(events, Iteration)]
    return (min(after, key=lambda e: e.time) if after else None), None


def goodput_of(mode: str, started: float, ended: float, kills: list[float], killed: list[int],
               attempts: list[list]) -> dict:
    trained = sorted((e for events in attempts for e in of_kind(events, Iteration)), key=lambda e: e.time)
    kept = {}
    for event in trained:  # the last time each iteration was trained
        kept[event.iteration] = event
    missing = sorted(set(range(1, GOODPUT_ITERS + 1)) - set(kept))
    kept_s = sum(e.elapsed_s * e.interval for e in kept.values())
    wall = ended - started
    losses = []
    for (iteration, host), killed_at, processes in zip(GOODPUT_LOSSES, kills, killed):
        before = max((e.iteration for e in trained if e.time <= killed_at), default=0)
        after, restored = first_resumed(attempts, killed_at, mode == "in-process")
        # iterations logged after the kill and before the recovery (an iteration in flight)
        late = [e.iteration for e in trained if killed_at < e.time < (after.time if after else ended)
                and e is not after]
        losses.append({"node": host, "at_iteration": iteration, "processes_killed": processes,
                       "logged_after_kill_before_resume": late,
                       "kill_to_first_resumed_iteration_s": after.time - killed_at if after else None,
                       "resumed_at_iteration": after.iteration if after else None,
                       "iterations_trained_again": before - (after.iteration - 1) if after else None,
                       "restored_from": restored.source if restored else None})
    # Where the time lost went: before the first iteration (start-up), after the last (shut
    # down), the iterations trained again, and between iterations outside their logged times
    # (recoveries, restarts, snapshots, checkpoint saves).
    first = trained[0].time - trained[0].elapsed_s - started if trained else None
    last = ended - trained[-1].time if trained else None
    between = sum(max(0.0, b.time - a.time - b.elapsed_s * b.interval) for a, b in zip(trained, trained[1:]))
    redone_s = sum(e.elapsed_s * e.interval for e in trained) - kept_s
    return {"wall_s": wall, "iterations_trained": len(trained), "iterations_trained_again": len(trained) - len(kept),
            "missing_iterations": missing, "kept_iterations_s": kept_s, "time_lost_s": wall - kept_s,
            "goodput": kept_s / wall, "attempts": len(attempts),
            "time_lost_in": {"start_up_s": first, "iterations_trained_again_s": redone_s,
                             "between_iterations_s": between, "shut_down_s": last},
            "losses": losses}


def goodput(workdir: Path, repeats: int) -> dict:
    cluster, plan_path = four_node_plan(workdir)
    runs = {"in-process": [], "disk": []}
    for repeat in range(repeats):
        for mode in ("in-process", "disk"):
            flags = FLAGS + ["--train-iters", str(GOODPUT_ITERS)]
            flags += ["--inprocess-restart"] if mode == "in-process" else [
                "--save", str(workdir / f"goodput-ckpt-{repeat}"), "--save-interval", "10"]
            started, ended, kills, killed, attempts, _ = supervised_losing(
                cluster, plan_path, workdir / f"goodput-{mode}-{repeat}", flags, GOODPUT_LOSSES)
            run = goodput_of(mode, started, ended, kills, killed, attempts)
            runs[mode].append(run)
            resumes = ", ".join(f"{l['node']}@{l['at_iteration']} {l['kill_to_first_resumed_iteration_s']:.1f} s"
                                if l["kill_to_first_resumed_iteration_s"] is not None else f"{l['node']}: none"
                                for l in run["losses"])
            print(f"  goodput run {repeat} {mode}: wall {run['wall_s']:.1f} s, {run['iterations_trained_again']} "
                  f"iterations trained again, lost {run['time_lost_s']:.1f} s, goodput {run['goodput']:.3f}; "
                  f"kill -> resumed: {resumes}" + (f"; MISSING {run['missing_iterations']}"
                                                   if run["missing_iterations"] else ""), flush=True)
    summary = {}
    for mode, done in runs.items():
        summary[mode] = {
            "repeats": len(done),
            "wall_s_median": statistics.median(r["wall_s"] for r in done),
            "goodput_median": statistics.median(r["goodput"] for r in done),
            "time_lost_s_median": statistics.median(r["time_lost_s"] for r in done),
            "iterations_trained_again_median": statistics.median(r["iterations_trained_again"] for r in done),
            "kill_to_first_resumed_iteration_s_median": [
                statistics.median(v) if (v := [r["losses"][i]["kill_to_first_resumed_iteration_s"] for r in done
                                               if r["losses"][i]["kill_to_first_resumed_iteration_s"] is not None])
                else None for i in range(len(GOODPUT_LOSSES))],
            "runs": done}
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each mode (default 3 for overhead and recovery, 1 for goodput)")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--only", choices=["overhead", "recovery", "goodput"])
    parser.add_argument("--out", default=None, help="results.json goes there (default: print only)")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="work in DIR and keep it (runs' events, plans, checkpoints; default: a "
                             "temporary directory, removed)")
    options = parser.parse_args()
    repeats = options.repeats if options.repeats is not None else 3
    if options.keep and Path(options.keep).exists() and any(Path(options.keep).iterdir()):
        parser.error(f"--keep {options.keep}: give a new or empty directory (old checkpoints would be resumed)")
    results = {}
    with (contextlib.nullcontext(options.keep) if options.keep
          else tempfile.TemporaryDirectory(prefix="recovery-bench.")) as tmp:
        workdir = Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if options.only in (None, "overhead", "recovery"):
            plan_path = plan(workdir)
        if options.only in (None, "overhead"):
            print("snapshot overhead (the default interval, one copy on the other node):", flush=True)
            results["overhead"] = overhead(plan_path, workdir, repeats, options.iters)
        if options.only in (None, "recovery"):
            print("recovery after a lost node (kill -> first resumed iteration):", flush=True)
            results["recovery"] = recovery(plan_path, workdir, repeats, 16, kill_after=7)
        if options.only in (None, "goodput"):
            goodput_repeats = options.repeats if options.repeats is not None else 1
            print(f"goodput: {GOODPUT_ITERS} iterations on 4 nodes, losing "
                  + ", ".join(f"{host} at {it}" for it, host in GOODPUT_LOSSES)
                  + f"; in-process against disk (--save-interval 10), {goodput_repeats} repeat(s)"
                  + (" (the default for this part: a run per mode takes minutes; --repeats N for more)"
                     if options.repeats is None else "") + ":", flush=True)
            results["goodput"] = goodput(workdir, goodput_repeats)
    print(json.dumps(results, indent=2))
    if options.out:
        Path(options.out).mkdir(parents=True, exist_ok=True)
        (Path(options.out) / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
