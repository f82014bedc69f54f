"""Where a run resumes from: the checkpoint to load (--load, its non-persistent checkpoint,
or --pretrained-checkpoint), where non-persistent checkpoints go, and what to tell a user whose
run stopped."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hetero.errors import HeteroError
from megatron.hetero.checkpointing import iteration_dir, latest_iteration
from megatron.hetero.log import print_rank_0


def _resume_hint(args: argparse.Namespace) -> str:
    root = args.save or args.load
    latest = latest_iteration(root) if root else None
    if latest is None:
        return " No checkpoint was written (use --save DIR --save-interval N)."
    return (f" The last complete checkpoint is {iteration_dir(root, latest)}; resume with "
            f"--load {root} (re-plan with hetero-plan first if the cluster changed).")


def non_persistent_dir(args: argparse.Namespace, root: str | None) -> str | None:
    """Where global non-persistent checkpoints go: --non-persistent-global-ckpt-dir, else
    non_persistent under root (--save when saving, --load when loading), as Megatron-LM."""
    if args.non_persistent_global_ckpt_dir or root is None:
        return args.non_persistent_global_ckpt_dir
    return os.path.join(root, "non_persistent")


def checkpoint_to_load(args: argparse.Namespace) -> str | None:
    """--load (or its non-persistent checkpoint, where that one is at least as new), or
    --pretrained-checkpoint while --load holds no checkpoint: then the weights are fine-tuned
    from it (--finetune), as Megatron-LM does."""
    persistent = latest_iteration(args.load) if args.load else None
    transient_dir = non_persistent_dir(args, args.load) if args.non_persistent_ckpt_type else None
    if transient_dir and args.ckpt_step is None and Path(transient_dir).is_dir():
        transient = latest_iteration(transient_dir)
        if transient is not None and (persistent is None or transient >= persistent):
            print_rank_0(f"loading the non-persistent checkpoint of iteration {transient} from {transient_dir}")
            return transient_dir
    if args.pretrained_checkpoint is None or persistent is not None:
        return args.load
    if latest_iteration(args.pretrained_checkpoint) is None:
        raise HeteroError(f"--pretrained-checkpoint {args.pretrained_checkpoint}: no checkpoint there"
                          + (f" (nor in --load {args.load})" if args.load else "")
                          + "; give the --save directory of the run to start from")
    print_rank_0(f"no checkpoint in --load {args.load}: fine-tuning from --pretrained-checkpoint "
                 f"{args.pretrained_checkpoint}")
    args.finetune = True
    return args.pretrained_checkpoint
