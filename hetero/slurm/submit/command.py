"""hetero-launch --slurm: a plan as a Slurm heterogeneous batch job that keeps itself alive.

    hetero-launch --slurm plan.json --submit --partition gpu --time 12:00:00 \\
        --env GLOO_SOCKET_IFNAME=eth0 -- <Megatron flags, with --save DIR --save-interval N>
    hetero-launch --slurm plan.json --dry-run -- <flags>      # print the batch script only
    hetero-launch --slurm plan.json -- <flags>                # write it; submit it yourself

A plan names device classes and counts (its hosts need not be real machines). The batch
script has one heterogeneous-job component per node class of the plan: the hosts of one
device type that run the same number of ranks. A component asks for that many nodes, one
task per node (the node's torchrun), its GPUs (`--gres=gpu:N` where Slurm lists GPU GRES on
the nodes), whole nodes (`--exclusive --mem=0`), `--no-kill` (a lost node is our driver's to
handle) and where its nodes are:

- `--constraint-by feature` (default): a feature expression that every node of that device
  type in the partition has and no other node there has (`h100`, `a100&80gb`), or the one
  `--feature DEVICE=EXPR` gives. Slurm picks any such nodes; the driver binds the plan's
  hosts to them.
- `--constraint-by nodelist`: `--nodelist` of the plan's hosts (a plan made from a spec of
  `hetero-plan discover --slurm` names Slurm nodes).

Slurm 22.05 lets a failed node leave a heterogeneous job only if it is not its component's
first node (the component's batch host), so `--layout single` writes one job instead, every
class's nodes counted by feature (`--constraint=[h100*1&a100*2]`): any node but the batch
node may then fail, but all nodes get one `--gres=gpu:N`, so every node must run the same
number of ranks.

Before anything is written or submitted, the plan is checked against the cluster
(`scontrol show node/partition`): every device type of the plan is a device of the
partition's nodes (Slurm's features and GRES types, read as discover reads them, with
`--device-map`; the plan's own cluster section settles labels that name several devices),
with enough nodes of it, and a `--feature` matches nodes of its device type. Every problem
is named with its fix (`error: ...`, exit 2).

Written into the run directory (--run-dir; default hetero-runs/<plan>-<time>, which must be
on storage every node sees, as the checkpoints must): plan.json (the plan as given),
launch.json (the components, for the driver) and job.sbatch. The script's body runs the
driver, hetero.slurm.driver, on the first node of component 0: the supervisor inside
the allocation (binding hosts to nodes, one srun step per node, re-planning after a lost
node, re-admitting a returned one: see its docstring and docs/slurm.md).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from hetero.errors import HeteroError
from hetero.slurm.client import read_slurm, submit
from hetero.slurm.submit.components import plan_components
from hetero.slurm.submit.options import check_flags, launch_options
from hetero.slurm.submit.run_dir import SCRIPT_FILE, default_run_dir, write_run_dir
from hetero.slurm.submit.script import batch_script
from hetero.plan import Plan


def main(options: argparse.Namespace, train_args: list[str]) -> int:
    """hetero-launch --slurm (commands.main hands over the parsed options)."""
    try:
        notes = check_flags(options, train_args)
        launch = launch_options(options)
        if options.submit and shutil.which("sbatch") is None:
            raise HeteroError("--submit needs Slurm's sbatch on PATH: run hetero-launch on a login node of the "
                              "cluster, or install the Slurm client (Debian: slurm-client) and point SLURM_CONF at "
                              "the cluster's slurm.conf; --dry-run prints the script without submitting")
        if shutil.which("scontrol") is None:
            raise HeteroError("hetero-launch --slurm checks the plan against the cluster with Slurm's scontrol, "
                              "which is not on PATH: run it on a login node of the cluster, or install the Slurm "
                              "client (Debian: slurm-client) and point SLURM_CONF at the cluster's slurm.conf")
        if not (Path(launch.workdir) / launch.script).is_file():
            raise HeteroError(f"{launch.script} is not in {launch.workdir}, where the job starts: run hetero-launch "
                              "from the Megatron-Hetero checkout (on storage every node sees), or pass --script PATH")
        plan = Plan.load(options.plan)
        components, found = plan_components(plan, read_slurm(), launch)
        notes += found
        run_dir = Path(options.run_dir).absolute() if options.run_dir else default_run_dir(options.plan)
        script = batch_script(str(Path(options.plan)), plan, components, run_dir, launch, train_args)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        if options.dry_run:
            print(script, end="")
            print(f"# dry run: nothing written to {run_dir} and nothing submitted", file=sys.stderr)
            return 0
        write_run_dir(run_dir, options.plan, components, script, launch)
        if not options.submit:
            print(f"hetero-launch: wrote {run_dir / SCRIPT_FILE} ({len(components)} component"
                  f"{'s' if len(components) > 1 else ''}); submit it with: sbatch {run_dir / SCRIPT_FILE}")
            return 0
        job_id = submit(run_dir / SCRIPT_FILE)
    except HeteroError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"hetero-launch: submitted job {job_id} ({len(components)} component{'s' if len(components) > 1 else ''}: "
          + "; ".join(f"{len(c.hosts)} x {c.device_type}" for c in components)
          + f"); watch: tail -f {run_dir}/slurm-{job_id}.out; the driver's record: {run_dir}/driver.json")
    return 0
