"""Kill -> first resumed iteration under Slurm: in-process restart against the restart from
the disk checkpoint, on a real Slurm cluster in network namespaces on this machine
(tools/emulator/slurm.py: node0 with two H100s, node1 and node2 with one A100 each, one
slurmd per namespace; needs root and Slurm, which it installs with apt-get when missing).

    sudo python bench/slurm_recovery_bench.py                # 3 rounds
    sudo python bench/slurm_recovery_bench.py --repeats 1    # a quick check

The job is the heterogeneous one of tests/test_slurm_launch.py (discover -> plan -> PP=2 with
stages of 3 and 1 layers, replicas of 18 and 14 micro-batches, a permuted rank order), submitted
with `python -m hetero.launch --slurm plan.json --submit --emulate-devices`. Each round runs,
alternated:

1. in-process: --inprocess-restart --use-distributed-optimizer; node2 is killed (its slurmd and
   everything in its namespace, a crashed machine) once iteration 5 is logged; the time from
   the kill to the first iteration logged after the state was restored (StateRestored) in the
   same processes.
2. disk: --save DIR --save-interval 2; node2 is killed once a checkpoint of iteration >= 4 is
   written; the time from the kill to the first iteration of the resumed attempt
   (attempt-1-events) - the driver stops the survivors, re-plans and starts them again from
   the checkpoint.

Slurm's default SlurmdTimeout (300 s): the lost node stays in the job, unused. Once the job has
resumed, node2's slurmd is started again; the job runs on without it (--no-readmit) to its end,
and the next run waits until every node is idle. Times come from the job's event records
(hetero.events) and the driver's record (driver.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hetero.events import CheckpointSaved, Iteration, LostRanks, StateRestored, of_kind, read_events  # noqa: E402
from tools.emulator.slurm_job import GLOBAL_BATCH, cli, heterogeneous_plan, wait  # noqa: E402

KILLED = "node2"  # the second node of component 0 (the A100s): Slurm keeps it in the job
IN_PROCESS_KILL_AFTER = 5  # iteration logged
DISK_KILL_AFTER = 4  # checkpoint of at least this iteration written


def training(iterations: int) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", str(GLOBAL_BATCH),
            "--train-iters", str(iterations), "--lr", "1e-3", "--lr-decay-style", "constant", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--num-workers", "0", "--seed", "1234", "--log-params-norm"]


def one_run(slurm, plan: Path, workdir: Path, mode: str, iterations: int) -> dict:
    """One submitted job that loses node2; returns the measured times."""
    run_dir = workdir / f"run-{mode}"
    train = training(iterations)
    if mode == "in-process":
        train += ["--inprocess-restart", "--use-distributed-optimizer"]
    else:
        train += ["--save", str(workdir / f"ckpt-{mode}"), "--save-interval", "2"]
    done = cli(slurm, "hetero.launch", "--slurm", str(plan), "--submit", "--emulate-devices", "--run-dir",
               str(run_dir), "--poll-s", "2", "--no-readmit", "--env", "GLOO_SOCKET_IFNAME=eth0",
               "--env", "OMP_NUM_THREADS=1", "--", *train, cwd=REPO)
    job = done.stdout.split("submitted job ")[1].split()[0]
    output = run_dir / f"slurm-{job}.out"
    record_path = run_dir / "driver.json"
    first = run_dir / "attempt-0-events"

    def record() -> dict:
        try:
            return json.loads(record_path.read_text()) if record_path.exists() else {}
        except json.JSONDecodeError:  # being written
            return {}

    killed_at = None
    try:
        if mode == "in-process":
            wait(f"iteration {IN_PROCESS_KILL_AFTER}", lambda: any(
                e.iteration >= IN_PROCESS_KILL_AFTER for e in of_kind(read_events(first), Iteration)), 600, output)
        else:
            wait(f"a checkpoint of iteration >= {DISK_KILL_AFTER}", lambda: any(
                e.iteration >= DISK_KILL_AFTER for e in of_kind(read_events(first), CheckpointSaved)), 600, output)
        slurm.kill_node(KILLED)
        killed_at = time.time()
        before = max(e.iteration for e in of_kind(read_events(first), Iteration) if e.time <= killed_at)
        result = {"job": job, "last_iteration_before_kill": before}
        if mode == "in-process":
            restored = wait("the state restored", lambda: of_kind(read_events(first), StateRestored), 600, output)[0]
            resumed = wait("the first iteration after the re-plan", lambda: sorted(
                (e for e in of_kind(read_events(first), Iteration) if e.time > restored.time),
                key=lambda e: e.time), 600, output)[0]
            result.update(kill_to_state_restored_s=restored.time - killed_at, restored_from=restored.source,
                          restored_iteration=restored.iteration)
            # where the time goes: a survivor names the lost peer, the driver re-plans
            reported = [e.time for e in of_kind(read_events(first), LostRanks) if e.time >= killed_at]
            if reported:
                result["kill_to_loss_reported_s"] = min(reported) - killed_at
            replans = record().get("attempts", [{}])[0].get("replans", [])
            if replans:
                result["kill_to_replanned_s"] = replans[0]["time"] - killed_at
        else:
            resumed = wait("the resumed attempt's first iteration", lambda: sorted(
                of_kind(read_events(run_dir / "attempt-1-events"), Iteration), key=lambda e: e.time), 600, output)[0]
        result.update(kill_to_first_resumed_iteration_s=resumed.time - killed_at, resumed_at_iteration=resumed.iteration,
                      iterations_trained_again=before - (resumed.iteration - 1))
    finally:
        # node2 back (the job runs on without it: --no-readmit); the job to its end and every
        # node idle before the next run.
        if killed_at is not None:
            slurm.restart_node(KILLED, wait=False)
        try:
            final = wait("the job to end", lambda: record().get("outcome") and record(), 1200, output)
        except TimeoutError:
            subprocess.run(["scancel", job], env=slurm.env(), capture_output=True)
            raise
        finally:
            slurm.wait_idle(timeout=300)
    result["outcome"] = final["outcome"]
    attempts = final.get("attempts", [])
    if mode == "disk" and len(attempts) >= 2 and attempts[0].get("ended"):
        result["kill_to_job_stopped_s"] = attempts[0]["ended"] - killed_at
        if attempts[1].get("first_iteration_time"):
            result["stopped_to_resumed_iteration_s"] = attempts[1]["first_iteration_time"] - attempts[0]["ended"]
    if final["outcome"] != "finished":
        raise SystemExit(f"the {mode} job did not finish ({final['outcome']}):\n" + output.read_text()[-6000:])
    return result


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if values else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each: one in-process and one disk run)")
    parser.add_argument("--train-iters", type=int, default=40)
    parser.add_argument("--out", default=None, help="results.json goes there (default: print only)")
    options = parser.parse_args()

    from tools.emulator.slurm import SlurmCluster, SlurmNode, ensure_installed, missing_prerequisites

    missing = missing_prerequisites()
    if missing:
        raise SystemExit("no Slurm cluster on this machine: " + "; ".join(missing))
    ensure_installed()
    runs: dict[str, list[dict]] = {"in-process": [], "disk": []}
    with tempfile.TemporaryDirectory(prefix="slurm-recovery-bench.") as tmp:
        workdir = Path(tmp)
        # Slurm's default SlurmdTimeout: the lost node stays in the job (unused) and returns
        # while still in it, as on a real cluster before Slurm notices.
        cluster = SlurmCluster([SlurmNode("node0", "h100", gpus=2), SlurmNode("node1", "a100"),
                                SlurmNode("node2", "a100")], slurmd_timeout_s=300)
        with cluster:
            plan = heterogeneous_plan(workdir, cluster)
            print(f"kill {KILLED} -> first resumed iteration under Slurm, {options.repeats} round(s) of "
                  f"{options.train_iters}-iteration jobs:", flush=True)
            for repeat in range(options.repeats):
                for mode in ("in-process", "disk"):
                    cluster.wait_idle(timeout=300)
                    run = one_run(cluster, plan, workdir / f"round-{repeat}", mode, options.train_iters)
                    runs[mode].append(run)
                    print(f"  round {repeat} {mode}: kill -> iteration {run['resumed_at_iteration']} in "
                          f"{run['kill_to_first_resumed_iteration_s']:.1f} s "
                          f"({run['iterations_trained_again']} iterations trained again)", flush=True)
    results = {}
    for mode, done in runs.items():
        values = [r["kill_to_first_resumed_iteration_s"] for r in done]
        results[mode] = {"kill_to_first_resumed_iteration_s": values,
                         "kill_to_first_resumed_iteration_s_median": statistics.median(values) if values else None,
                         "spread": spread(values), "runs": done}
    print(json.dumps(results, indent=2))
    if options.out:
        Path(options.out).mkdir(parents=True, exist_ok=True)
        (Path(options.out) / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
