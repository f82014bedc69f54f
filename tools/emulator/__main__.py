"""python -m tools.emulator: run a script on this machine as if it were a cluster.

    sudo python -m tools.emulator --cluster examples/clusters/cpu_demo.yaml --plan plan.json \\
        -- pretrain_gpt.py --num-layers 6 ...

Every node of the cluster becomes a network namespace with its NIC's rate and latency,
every rank a CPU quota in proportion to its device's speed; everything made is removed
on exit, on error and on Ctrl-C. `--hetero-plan PLAN` is added for pretrain_gpt.py.

    sudo python -m tools.emulator --cluster C.yaml --plan plan.json --elastic \\
        -- pretrain_gpt.py <flags> --save DIR --save-interval N

--elastic keeps the job alive: after a lost node the supervisor (hetero.launch.elastic)
re-plans for the survivors and resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetero.spec.cluster import Cluster
from hetero.errors import HeteroError
from hetero.launch import split_at_double_dash
from hetero.launch.elastic import run_elastic
from hetero.plan import Plan
from tools.emulator import cpu_quota
from tools.emulator.cluster import ElasticRunner, EmulatedCluster, RankLayout, stop_on_termination_signals


def main(argv: list[str] | None = None) -> int:
    argv, job = split_at_double_dash(argv)
    parser = argparse.ArgumentParser(prog="python -m tools.emulator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", required=True, help="cluster spec (YAML)")
    parser.add_argument("--plan", help="plan.json: which rank stands in for which device (default: "
                                       "the cluster's devices in order)")
    parser.add_argument("--unshaped", action="store_true",
                        help="no namespaces, tc or quotas: plain local processes (no root needed)")
    parser.add_argument("--compute-scale", type=float, default=None,
                        help="cores given to a rank of the fastest device type")
    parser.add_argument("--net-scale", type=float, default=None, help="NIC rate multiplier")
    parser.add_argument("--cpu-shares", type=int, default=cpu_quota.DEFAULT_CPU_SHARES,
                        help="each rank's cgroup cpu.shares beside the machine's other processes (default "
                             "%(default)s: a rank gets its whole quota on a busy machine; 0: the kernel's 1024)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--dry-run", action="store_true", help="print the emulated cluster and stop")
    elastic = parser.add_argument_group("elastic (hetero.launch.elastic)")
    elastic.add_argument("--elastic", action="store_true",
                         help="keep the job alive: after a lost node, re-plan for the survivors and "
                              "resume from the last checkpoint (needs --plan and pretrain_gpt.py's --save)")
    elastic.add_argument("--max-restarts", type=int, default=3)
    elastic.add_argument("--run-dir", default="runs/elastic",
                         help="where re-planned plans and each attempt's events (hetero.events) go")
    options = parser.parse_args(argv)
    if not job and not options.dry_run:
        parser.error("give the job after --, e.g. -- pretrain_gpt.py --num-layers 4 ...")
    stop_on_termination_signals()
    if options.elastic:
        return _run_elastic(options, job)
    try:
        cluster = Cluster.load(options.cluster)
        plan = Plan.load(options.plan) if options.plan else None
        layout = RankLayout.of_plan(plan) if plan else RankLayout.of_cluster(cluster)
        if job and job[0].endswith("pretrain_gpt.py") and plan and "--hetero-plan" not in job:
            job = [job[0], "--hetero-plan", options.plan, *job[1:]]
        emulated = EmulatedCluster(cluster, layout, shaped=not options.unshaped,
                                   compute_scale=options.compute_scale, net_scale=options.net_scale,
                                   cpu_shares=options.cpu_shares)
        print(emulated.describe(), flush=True)
        if options.dry_run:
            return 0
        with emulated:
            result = emulated.run(job, timeout=options.timeout)
        return result.returncode
    except HeteroError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("emulator: interrupted; removed everything it created", file=sys.stderr)
        return 130


def _run_elastic(options: argparse.Namespace, job: list[str]) -> int:
    """Every node of the plan on this machine, re-planned after a lost node."""
    try:
        if not options.plan:
            raise HeteroError("--elastic needs --plan plan.json (written by hetero-plan: it records "
                              "the job to re-plan)")
        if not job or not job[0].endswith("pretrain_gpt.py"):
            raise HeteroError("--elastic runs pretrain_gpt.py: give -- pretrain_gpt.py <flags>")
        runner = ElasticRunner(Cluster.load(options.cluster), shaped=not options.unshaped,
                               timeout=options.timeout, run_dir=options.run_dir, compute_scale=options.compute_scale)
        return run_elastic(options.plan, job[1:], runner, Path(options.run_dir), options.max_restarts,
                           log=lambda line: print(line, flush=True))
    except HeteroError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
