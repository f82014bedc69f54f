"""pretrain_gpt.py's body: flags and plan first, then the run.

Everything that can be decided from the command line and the plan file is checked here,
before megatron-core is imported or any process group exists, so a bad launch fails
within seconds and identically on every rank.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import warnings
from typing import Sequence

import torch

from hetero.errors import HeteroError
from hetero.plan import DeviceEntry, Plan
from megatron.hetero.arguments import apply_plan, check_plan_model, parse_args, validate_args
from megatron.hetero.batch_schedule import batch_schedule
from megatron.hetero.distributed import Launch, read_launch, wait_for_peers_to_fail
from megatron.hetero.log import error
from megatron.hetero.performance import configure_performance


def load_plan(args: argparse.Namespace, world_size: int) -> tuple[Plan, str | None]:
    """The plan file, or the uniform plan stock Megatron would run on this launch."""
    if args.hetero_plan:
        return Plan.load(args.hetero_plan), args.hetero_plan
    tp = args.tensor_model_parallel_size or 1
    pp = args.pipeline_model_parallel_size or 1
    if world_size % (tp * pp):
        raise HeteroError(
            f"world size {world_size} is not divisible by tensor x pipeline parallel size "
            f"({tp} x {pp})"
        )
    for flag in ("num_layers", "micro_batch_size", "global_batch_size"):
        if getattr(args, flag) is None:
            raise HeteroError(f"missing --{flag.replace('_', '-')} (or give a --hetero-plan)")
    unplanned = DeviceEntry(host="unplanned", device_type="unplanned", vendor="unplanned")
    plan = Plan.uniform(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=world_size // (tp * pp),
        micro_batch_size=args.micro_batch_size,
        num_layers=args.num_layers,
        global_batch_size=args.global_batch_size,
        devices=[unplanned] * world_size,
    )
    return plan, None


def quiet_expected_warnings(launch_rank: int) -> None:
    # Missing apex / transformer-engine is the normal state on CPU machines.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    # megatron-core 0.16.1 calls torch APIs that torch 2.13 deprecates, and touches .grad of
    # non-leaf tensors in its distributed optimizer; upstream noise, not the user's doing.
    warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*\.grad attribute of a Tensor that is not a leaf.*")
    if not torch.cuda.is_available():
        # On the CPU the tensor-parallel "cuda" RNG is the CPU generator, so every dropout
        # inside its fork trips megatron-core's check that the CPU state did not change.
        logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    if launch_rank != 0:  # as Megatron-LM: rank 0 speaks for everyone
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)


def configure(argv: Sequence[str], launch: Launch) -> tuple[argparse.Namespace, Plan, str | None]:
    args = parse_args(argv)
    plan, plan_source = load_plan(args, launch.world_size)
    apply_plan(args, plan)
    validate_args(args)
    check_plan_model(args, plan)
    plan = configure_performance(args, plan)
    batch_schedule(args, plan)  # --train-samples -> iterations; every ramp step splits
    return args, plan, plan_source


def main(argv: Sequence[str]) -> int:
    """Returns the process exit code: 0, or 2 for bad input (reported on every rank)."""
    # Megatron's recipes set this: tensor-parallel collectives must keep their launch order.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    launch = read_launch()
    # A rank killed by SIGSEGV/SIGBUS otherwise dies silently; its peers only see a closed socket.
    faulthandler.enable()
    quiet_expected_warnings(launch.rank)
    import torch

    if not torch.cuda.is_available():
        from megatron.hetero.cpu_device import configure_host_allocator

        configure_host_allocator()
    try:
        args, plan, plan_source = configure(argv, launch)
        from megatron.hetero.training import run

        run(args, plan, plan_source, launch)
    except HeteroError as err:
        error(launch.rank, str(err))
        wait_for_peers_to_fail(launch)
        return 2
    return 0
