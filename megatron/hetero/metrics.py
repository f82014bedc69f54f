"""TensorBoard and Weights & Biases, written as Megatron-LM writes them.

As in Megatron-LM the last rank (which holds the loss) owns both writers, and the scalar
tags are Megatron's ('lm loss', 'learning-rate', 'batch-size', 'grad-norm', 'lm loss
validation', ..., each also '... vs samples'), so existing dashboards keep working.
TensorBoard is a dependency; W&B is the optional ``wandb`` extra.
"""

from __future__ import annotations

import argparse
import math
import os
import resource

import torch

from megatron.hetero.log import is_last_rank, print_rank_last


class MetricsWriter:
    """The run's TensorBoard / W&B writers; every method is a no-op where there are none."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tensorboard = None
        self.wandb = None
        if not is_last_rank():
            return
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            print_rank_last("> setting tensorboard ...")
            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir,
                                             max_queue=args.tensorboard_queue_size)
        if args.wandb_project:
            import wandb

            save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
            os.makedirs(save_dir, exist_ok=True)
            options = {"dir": save_dir, "name": args.wandb_exp_name, "project": args.wandb_project,
                       "config": {k: v for k, v in vars(args).items() if _plain(v)}}
            if args.wandb_entity:
                options["entity"] = args.wandb_entity
            wandb.init(**options)
            self.wandb = wandb

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb is not None

    def scalar(self, tag: str, value: float, iteration: int, consumed_samples: int | None = None,
               to_wandb: bool = True) -> None:
        """One value at an iteration (and, given the consumed samples, its 'vs samples' twin)."""
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(tag, value, iteration)
            if consumed_samples is not None:
                self.tensorboard.add_scalar(f"{tag} vs samples", value, consumed_samples)
        if self.wandb is not None and to_wandb:
            self.wandb.log({tag: value}, iteration)

    def training(self, iteration: int, consumed_samples: int, *, learning_rate: float,
                 batch_size: int, losses: dict[str, float], loss_scale: float,
                 grad_norm: float | None, num_zeros: int | None, params_norm: float | None,
                 world_size: int) -> None:
        """Megatron-LM's per-iteration scalars (every --tensorboard-log-interval iterations)."""
        args = self.args
        if not self.active or iteration % args.tensorboard_log_interval:
            return
        if self.wandb is not None:
            self.wandb.log({"samples vs steps": consumed_samples}, iteration)
        self.scalar("learning-rate", learning_rate, iteration, consumed_samples)
        self.scalar("batch-size", batch_size, iteration, consumed_samples)
        for key, value in losses.items():
            self.scalar(key, value, iteration, consumed_samples)
        if args.log_loss_scale_to_tensorboard:
            self.scalar("loss-scale", loss_scale, iteration, consumed_samples)
        if args.log_world_size_to_tensorboard:
            self.scalar("world-size", world_size, iteration, consumed_samples)
        if grad_norm is not None:
            self.scalar("grad-norm", grad_norm, iteration, consumed_samples)
        if num_zeros is not None:
            self.scalar("num-zeros", num_zeros, iteration, consumed_samples)
        if params_norm is not None:
            self.scalar("params-norm", params_norm, iteration, consumed_samples)
        if args.log_memory_to_tensorboard:
            for tag, value in memory_scalars().items():
                self.scalar(tag, value, iteration, to_wandb=False)

    def validation(self, iteration: int, consumed_samples: int, losses: dict[str, float],
                   suffix: str = "") -> None:
        for key, value in losses.items():
            self.scalar(f"{key} validation{suffix}", value, iteration, consumed_samples)
            if self.args.log_validation_ppl_to_tensorboard:
                ppl = math.exp(min(20.0, value))
                self.scalar(f"{key} validation{suffix} ppl", ppl, iteration, consumed_samples,
                            to_wandb=False)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def memory_scalars() -> dict[str, float]:
    """Megatron-LM's memory tags from the CUDA allocator; on the CPU (no allocator statistics)
    the process's peak resident memory, under its own tag."""
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"]}
    return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, list, tuple))
