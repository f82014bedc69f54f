"""The parser's logging-and-evaluation group (with the profiling flags)."""

from __future__ import annotations

import argparse

from megatron.hetero import flags


PROFILING_FLAGS = ("--profile", "--use-pytorch-profiler", "--profile-step-start", "--profile-step-end",
                   "--profile-ranks", "--record-memory-history", "--memory-snapshot-path",
                   "--log-device-memory-used")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true",
                   help="add the TFLOP/s per device to the iteration line")
    g.add_argument("--log-memory-interval", type=int, default=None,
                   help="also print the memory line every N iterations (at a logging "
                        "iteration), not only once")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="0: iteration time only; 1: also forward-backward, gradient reduction "
                        "and optimizer times; 2: the same (finer timers need GPU events)")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard events here")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--wandb-project", default=None,
                   help="log to Weights & Biases (the wandb extra; WANDB_MODE=offline works)")
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None, help="default: SAVE/wandb")
    g.add_argument("--wandb-entity", default=None)
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    flags.declare(g, ("--log-progress",))  # progress.txt in --save (log.ProgressLog)
    # Megatron-LM's profiling window and CUDA memory history (training.ProfilingWindow).
    flags.declare(g, PROFILING_FLAGS)
