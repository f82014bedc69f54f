"""Per-node torchrun commands for a plan.

    python -m hetero.launch plan.json -- --num-layers 32 ...      # print every node's command
    python -m hetero.launch plan.json --node-rank 1 --run -- ...  # run node 1's command here
                                                                  # (torchrun without its traceback)
    python -m hetero.launch --slurm plan.json --submit -- ...     # a Slurm batch job (hetero/slurm/submit/)

torchrun numbers ranks node by node, so launch ranks of one host are consecutive (the
plan validator insists on it) and node k runs launch ranks of the k-th host in the plan.
Nodes may run different numbers of processes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Sequence

from hetero import env as hetero_env
from hetero.errors import HeteroError
from hetero.slurm import submit as slurm
from hetero.plan import Plan


@dataclass(frozen=True)
class NodeCommand:
    node_rank: int
    host: str
    launch_ranks: list[int]
    argv: list[str]
    env: dict[str, str]

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


def node_commands(
    plan: Plan,
    plan_path: str,
    train_args: Sequence[str],
    master_addr: str | None = None,
    master_port: int = 29500,
    script: str = "pretrain_gpt.py",
    emulate_devices: bool = False,
) -> list[NodeCommand]:
    """One torchrun command per host of the plan.

    emulate_devices sets HETERO_DEVICE so that processes on CPU-only hosts stand in for
    the plan's devices (an emulated cluster).
    """
    hosts = plan.hosts()
    master_addr = master_addr or hosts[0][0]
    commands = []
    for node_rank, (host, ranks) in enumerate(hosts):
        argv = [
            "torchrun",
            f"--nnodes={len(hosts)}",
            f"--node-rank={node_rank}",
            f"--nproc-per-node={len(ranks)}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
            script,
            "--hetero-plan",
            plan_path,
            *train_args,
        ]
        env = {}
        if emulate_devices:
            env[hetero_env.DEVICE] = hetero_env.per_local_rank_value(
                [plan.devices[r].device_type for r in ranks], hetero_env.DEVICE)
            env[hetero_env.VENDOR] = hetero_env.per_local_rank_value(
                [plan.devices[r].vendor for r in ranks], hetero_env.VENDOR)
        commands.append(NodeCommand(node_rank, host, ranks, argv, env))
    return commands


def split_at_double_dash(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """(a command's own flags, what follows `--`: the flags it passes on to another)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    argv, train_args = split_at_double_dash(argv)
    parser = argparse.ArgumentParser(
        prog="python -m hetero.launch",
        description="Print (or run) the torchrun command of each node of a plan.",
    )
    parser.add_argument("plan", help="plan.json")
    parser.add_argument("--master-addr", default=None, help="default: the plan's first host")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--script", default="pretrain_gpt.py")
    parser.add_argument("--emulate-devices", action="store_true",
                        help="set HETERO_DEVICE so CPU processes stand in for the plan's devices")
    parser.add_argument("--node-rank", type=int, default=None, help="only this node")
    parser.add_argument("--run", action="store_true", help="run the command of --node-rank here")
    parser.add_argument("--slurm", action="store_true",
                        help="write (--submit: and submit) a Slurm batch script whose driver runs and "
                             "keeps the job alive (hetero/slurm/submit/)")
    slurm.add_arguments(parser)
    options = parser.parse_args(argv)
    if options.slurm or slurm.slurm_options_given(options):
        return slurm.main(options, train_args)
    try:
        plan = Plan.load(options.plan)
        commands = node_commands(
            plan, options.plan, train_args, options.master_addr, options.master_port,
            options.script, options.emulate_devices,
        )
        if options.node_rank is not None:
            if not 0 <= options.node_rank < len(commands):
                raise HeteroError(
                    f"--node-rank {options.node_rank} is outside the plan's "
                    f"{len(commands)} nodes (0..{len(commands) - 1})"
                )
            commands = [commands[options.node_rank]]
        elif options.run:
            raise HeteroError("--run needs --node-rank: which node's command to run here")
    except HeteroError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if options.run:
        command = commands[0]
        # torchrun's own launch without its traceback after a failed worker (the workers'
        # messages say what was wrong): megatron/hetero/launcher.py, run, not imported here.
        argv = [sys.executable, "-m", "megatron.hetero.launcher", *command.argv[1:]]
        os.execve(argv[0], argv, {**os.environ, **command.env})
    for command in commands:
        ranks = command.launch_ranks
        print(f"# node {command.node_rank}: {command.host}, launch ranks {ranks[0]}-{ranks[-1]}")
        print(command.shell())
    return 0
