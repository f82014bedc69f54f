"""How a Megatron-Hetero process starts, written once: from Megatron-LM's flags to the model.

Every process that starts from pretrain_gpt.py's flags takes these steps, in this order, and
each step is one function below:

1. ``prepare_process``: what must precede everything else (environment, fault handler,
   warnings, the CPU allocator);
2. ``configure``: Megatron-LM's flags parsed (refused flags named), the plan (or Megatron's
   uniform one) applied to them, then validated: Megatron-LM's derived defaults, the model
   against the plan, the performance features, the batch schedule. No megatron-core and no
   process group yet, so a bad launch fails in seconds, on every rank alike;
   ``model_args`` is this step for a model that is built or described but not trained;
3. ``start_megatron_core``: megatron-core imported and patched (patches.py);
4. ``init_distributed``: the launch checked against the plan, then the process groups;
5. ``build_tokenizer``: the vocabulary padded as Megatron-LM pads it, checked against the plan;
6. ``build_model``: this rank's model chunks (TransformerConfig, GPT stages, DDP).

Who runs which: pretrain_gpt.py (``pretrain.main``) runs 1-2, then ``training.run`` runs 3-4,
starts its watchdog (which reports any later failure to every rank), runs 5-6 and trains;
``profiling.compute`` runs 1, ``model_args``, 3, its own world of profiling processes, then 6
per probed depth; ``model_spec_of_flags`` (benches that predict a run before
launching it) runs ``model_args`` only. Nothing else repeats a step.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence

import torch

from hetero.errors import HeteroError
from hetero.plan import DeviceEntry, Plan
from hetero.spec.model import ModelSpec
from megatron.hetero.arguments import (
    apply_plan,
    check_plan_model,
    padded_vocab_size,
    parse_args,
    validate_args,
)
from megatron.hetero import distributed
from megatron.hetero.batch_schedule import batch_schedule
from megatron.hetero.distributed import RankContext
from megatron.hetero.performance import configure_performance

if TYPE_CHECKING:  # importing it here would import megatron-core before step 3
    from megatron.core.transformer.transformer_config import TransformerConfig

# Training flags pretrain_gpt.py's parser insists on and a model does not depend on, given
# before the caller's flags (which win) by ``model_args``.
TRAINING_PLACEHOLDERS = ("--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                         "--lr", "1e-4")


# ----- 1. the process --------------------------------------------------------------------


def prepare_process(launch_rank: int) -> None:
    """Process-wide settings, before flags are parsed or any tensor is allocated."""
    # Megatron's recipes set this: tensor-parallel collectives must keep their launch order.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # A rank killed by SIGSEGV/SIGBUS otherwise dies silently; its peers only see a closed socket.
    faulthandler.enable()
    quiet_expected_warnings(launch_rank)
    if not torch.cuda.is_available():
        from megatron.hetero.cpu_device import configure_host_allocator

        configure_host_allocator()  # before the first tensor: it decides where freed ones go


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


# ----- 2. flags and plan -----------------------------------------------------------------


@dataclass(frozen=True)
class Configured:
    """The job as the command line and the plan file give it, validated."""

    args: argparse.Namespace
    plan: Plan
    plan_source: str | None  # the plan file; None for Megatron's uniform plan


def configure(argv: Sequence[str], world_size: int) -> Configured:
    """Megatron-LM's flags and the plan, checked before megatron-core or any process group."""
    args = parse_args(argv)                        # refused and unknown flags named here
    plan, plan_source = load_plan(args, world_size)
    apply_plan(args, plan)                         # the plan's layout into the flags
    validate_args(args)                            # Megatron-LM's derived defaults and checks
    check_plan_model(args, plan)                   # the model the plan was made for
    plan = configure_performance(args, plan)       # virtual stages filled in from the flags
    batch_schedule(args, plan)                     # --train-samples -> iterations; ramp steps split
    return Configured(args, plan, plan_source)


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


def model_args(flags: Sequence[str], tensor_parallel: int = 1) -> argparse.Namespace:
    """Step 2 for a model that is built or described but not trained: the caller's
    pretrain_gpt.py flags (training flags it leaves out take placeholders), one pipeline stage
    at ``tensor_parallel`` (the divisibility checks and the vocabulary padding use it), and
    the vocabulary padded as the run pads it (step 5)."""
    args = parse_args([*TRAINING_PLACEHOLDERS, *flags])
    args.tensor_model_parallel_size = tensor_parallel
    args.pipeline_model_parallel_size = 1
    validate_args(args)
    build_tokenizer(args)
    return args


def model_spec_of_flags(flags: Sequence[str]) -> ModelSpec:
    """The model pretrain_gpt.py builds from these model and data flags, its vocabulary
    padded as the run pads it: for benches that predict a run before launching it."""
    return ModelSpec.from_megatron_args(model_args(flags))


# ----- 3. megatron-core ------------------------------------------------------------------


def start_megatron_core() -> list[str]:
    """Imports megatron-core (its import-time compiles deferred) and applies the patches
    this process needs (patches.py); returns their names."""
    from megatron.hetero.patches import apply_patches

    return apply_patches()


# ----- 4. process groups -----------------------------------------------------------------


def init_distributed(args: argparse.Namespace, plan: Plan, plan_source: str | None) -> RankContext:
    """The launch checked against the plan (world size, each rank's device), then the
    process groups, this process at the logical rank the plan gives it."""
    return distributed.initialize(
        plan,
        plan_source or "(uniform)",
        args.distributed_backend,
        timedelta(minutes=args.distributed_timeout_minutes),
        check_devices=plan_source is not None,  # the uniform plan expects no device
        sequence_parallel=args.sequence_parallel,
    )


# ----- 5. tokenizer ----------------------------------------------------------------------


def build_tokenizer(args: argparse.Namespace, plan: Plan | None = None) -> Any:
    """The run's tokenizer; sets ``args.padded_vocab_size`` (Megatron-LM's padding) and
    checks it against the vocabulary the plan was made for."""
    from megatron.hetero import data  # imports megatron-core

    built = data.build_tokenizer(args)
    args.padded_vocab_size = padded_vocab_size(built.vocab_size, args)
    planned_vocab = plan.model.vocab_size if plan is not None and plan.model is not None else None
    if planned_vocab is not None and planned_vocab != args.padded_vocab_size:
        raise HeteroError(
            f"the plan was made for a vocabulary of {planned_vocab}, this run pads its tokenizer's "
            f"{built.vocab_size} to {args.padded_vocab_size}; regenerate the plan with "
            f"hetero-plan --vocab-size {args.padded_vocab_size}"
        )
    return built


# ----- 6. the model ----------------------------------------------------------------------


def build_model(args: argparse.Namespace, plan: Plan, timers: Any = None) -> tuple[TransformerConfig, list]:
    """This rank's model chunks of the plan (one per virtual stage, else one), initialised
    independently of the plan and wrapped for data parallelism, with their config."""
    from megatron.hetero import model  # imports megatron-core

    config = model.transformer_config(args, plan)
    config.timers = timers  # megatron-core times its own steps at --timing-log-level 2
    return config, model.build_model(args, plan, config)
