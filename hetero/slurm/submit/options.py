"""The options of `hetero-launch --slurm`: its command-line flags, their checks, and
LaunchOptions, what the rest of the Slurm launch reads them as."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from hetero.errors import HeteroError
from hetero.slurm.submit.env_rules import EnvRule
from hetero.slurm import discover

CONSTRAINT_MODES = ("feature", "nodelist")
LAYOUTS = ("het", "single")
DEFAULT_MAX_RESTARTS = 3
DEFAULT_POLL_S = 10.0  # how often the driver looks for returned nodes (an scontrol call each)


@dataclass
class LaunchOptions:
    """The --slurm options as the components, the script and the run directory read them."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None
    constraint_by: str = "feature"
    layout: str = "het"
    features: dict[str, str] = field(default_factory=dict)  # device type -> feature expression
    device_map: dict[str, str] = field(default_factory=dict)  # label (lowercase) -> catalog device
    sbatch_args: list[str] = field(default_factory=list)
    env: list[EnvRule] = field(default_factory=list)
    job_name: str | None = None
    max_restarts: int = DEFAULT_MAX_RESTARTS
    readmit: bool = True
    poll_s: float = DEFAULT_POLL_S
    master_port: int = 29500
    script: str = "pretrain_gpt.py"
    emulate_devices: bool = False
    python: str = sys.executable
    workdir: str = field(default_factory=os.getcwd)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --slurm options of hetero-launch."""
    group = parser.add_argument_group("Slurm (with --slurm)")
    group.add_argument("--submit", action="store_true", help="submit the batch script (sbatch); prints the job id")
    group.add_argument("--dry-run", action="store_true", help="print the batch script; write and submit nothing")
    group.add_argument("--partition", default=None, help="every component's partition (default: Slurm's default)")
    group.add_argument("--account", default=None)
    group.add_argument("--time", default=None, help="time limit of every component (sbatch --time)")
    group.add_argument("--constraint-by", choices=CONSTRAINT_MODES, default="feature",
                       help="place each component by a feature expression (default) or by the plan's hosts")
    group.add_argument("--layout", choices=LAYOUTS, default=None,
                       help="het (default): one heterogeneous-job component per node class; single: one job "
                            "(--constraint=[a*1&b*2]) that survives losing any node but the batch node, where "
                            "every node runs the same number of ranks")
    group.add_argument("--feature", action="append", default=[], metavar="DEVICE=EXPR",
                       help="the feature expression of a device type's nodes (default: found from Slurm)")
    group.add_argument("--device-map", action="append", default=[], metavar="LABEL=NAME",
                       help="a Slurm feature or GRES type that names a catalog device (as discover takes it)")
    group.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                       help="an sbatch option for every component, e.g. --sbatch-arg=--qos=high")
    group.add_argument("--env", action="append", default=[], metavar="[SELECTOR:]NAME=VALUE",
                       help="a variable for the ranks of the nodes SELECTOR names (node, device type, feature, "
                            "NIC kind; none: every node), e.g. ib:NCCL_IB_HCA=mlx5_0")
    group.add_argument("--run-dir", default=None, help="where the script, plans, logs and driver.json go "
                                                       "(default hetero-runs/<plan>-<time>; on shared storage)")
    group.add_argument("--job-name", default=None)
    group.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                       help="re-plans after lost nodes before the driver gives up")
    group.add_argument("--no-readmit", action="store_true",
                       help="do not take a returned node back into the job")
    group.add_argument("--poll-s", type=float, default=DEFAULT_POLL_S,
                       help=f"how often the driver looks for returned nodes (default {DEFAULT_POLL_S:g} s)")
    group.add_argument("--python", default=sys.executable, help="the Python of the job's environment on the nodes")


def _mapping(flag: str, items: Sequence[str]) -> dict[str, str]:
    """Repeated KEY=VALUE flags (--feature, --device-map) as a dict, read as discover reads them."""
    result = {}
    for text in items:
        key, value = discover.parse_mapping(flag, text)
        result[key] = value
    return result


def launch_options(options: argparse.Namespace) -> LaunchOptions:
    """The parsed command line as LaunchOptions (labels of --device-map compared lowercase)."""
    device_map = {label.lower(): device for label, device in _mapping("--device-map", options.device_map).items()}
    return LaunchOptions(
        partition=options.partition, account=options.account, time=options.time,
        constraint_by=options.constraint_by, layout=options.layout or "het",
        features=_mapping("--feature", options.feature),
        device_map=device_map, sbatch_args=list(options.sbatch_arg),
        env=[EnvRule.parse(text) for text in options.env], job_name=options.job_name,
        max_restarts=options.max_restarts, readmit=not options.no_readmit, poll_s=options.poll_s,
        master_port=options.master_port,
        script=options.script, emulate_devices=options.emulate_devices, python=options.python)


SLURM_ONLY = ("submit", "dry_run", "partition", "account", "time", "feature", "device_map", "sbatch_arg", "env",
              "run_dir", "job_name", "no_readmit", "layout")


def slurm_options_given(options: argparse.Namespace) -> bool:
    """Whether any option of the Slurm group is given (they mean nothing without --slurm)."""
    return any(getattr(options, name) not in (None, False, []) for name in SLURM_ONLY)


def check_flags(options: argparse.Namespace, train_args: Sequence[str]) -> list[str]:
    """Flag mistakes, before Slurm is asked anything; notes for what is allowed but unwise."""
    if not options.slurm:
        given = [f"--{name.replace('_', '-')}" for name in SLURM_ONLY
                 if getattr(options, name) not in (None, False, [])]
        raise HeteroError(f"{', '.join(given)} {'is a' if len(given) == 1 else 'are'} --slurm option"
                          f"{'' if len(given) == 1 else 's'}: add --slurm")
    if options.poll_s <= 0:
        raise HeteroError(f"--poll-s {options.poll_s:g}: give a positive number of seconds")
    if options.submit and options.dry_run:
        raise HeteroError("--submit and --dry-run exclude each other: --dry-run prints the script only")
    for flag, value in (("--master-addr", options.master_addr), ("--node-rank", options.node_rank)):
        if value is not None:
            raise HeteroError(f"{flag} does not go with --slurm: the driver takes the rendezvous and the node "
                              "ranks from the allocation")
    if options.run:
        raise HeteroError("--run does not go with --slurm: the batch script runs the job (--submit submits it)")
    if options.max_restarts < 0:
        raise HeteroError(f"--max-restarts {options.max_restarts}: give 0 or more")
    if any(a == "--hetero-plan" or a.startswith("--hetero-plan=") for a in train_args):
        raise HeteroError("leave --hetero-plan out of the Megatron flags: the driver passes the plan it binds "
                          "to the allocation")
    if not _flag_given(train_args, "--save") or not _flag_given(train_args, "--save-interval"):
        return ["no --save DIR --save-interval N among the Megatron flags: a lost node ends the job (there is no "
                "checkpoint to resume from)"]
    return []


def _flag_given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)
