"""The parser's training and run-control groups."""

from __future__ import annotations

import argparse
import signal

from megatron.hetero import flags


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None,
                   help="train on this many samples instead of --train-iters iterations")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "RAMPUP_SAMPLES"),
                   help="grow the global batch from START by INCREMENT to --global-batch-size "
                        "over RAMPUP_SAMPLES samples; each step's batch is split across the plan's "
                        "replicas in the plan's proportions")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="learning rate of the input embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="minimum learning rate of the input embedding and output layer")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="take the learning-rate schedule from the checkpoint, not the flags")
    flags.declare(g, ("--override-opt_param-scheduler",))
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"])
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    flags.declare(g, ("--dump-param-to-param-group-map",))
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="always on: heterogeneous replicas weight gradients by tokens")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on the exit signal (any rank), finish the iteration, save and exit 0")
    g.add_argument("--exit-signal", default="SIGTERM",
                   choices=[s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)],
                   metavar="SIGNAL", help="the signal --exit-signal-handler acts on (default SIGTERM)")


def _add_run_control_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("run control")
    g.add_argument("--exit-duration-in-mins", type=int, default=None,
                   help="save (with --save) and exit after this many minutes of training")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic algorithms only (torch.use_deterministic_algorithms)")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's automatic garbage collector; collect at fixed points")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every N iterations (0: never during training)")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false",
                   dest="manual_gc_eval",
                   help="with --manual-gc: do not collect before and after each evaluation")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="release cached accelerator memory each iteration: 0 off, 1 after the "
                        "forward/backward, 2 also after the optimizer step")
    g.add_argument("--skip-train", action="store_true",
                   help="no training: evaluate on the validation and test sets and exit")
    g.add_argument("--rerun-mode", default="validate_results", choices=["validate_results", "disabled"],
                   help="what a NaN or Inf loss does: stop the run, naming the rank that found it. "
                        "validate_results (the default) says so without re-running the iteration to "
                        "tell a transient fault from a reproducible one, as Megatron-LM would first")
    # Megatron-LM's training-loop switches, declared from its facts (training.Trainer.train).
    flags.declare(g, RUN_CONTROL_FLAGS)


# Megatron-LM's run-control flags that the training loop applies as its train() does.
RUN_CONTROL_FLAGS = ("--train-sync-interval", "--no-check-for-nan-in-loss-and-grad",
                     "--distributed-timeout-seconds-after-init", "--iterations-to-skip",
                     "--check-weight-hash-across-dp-replicas-interval", "--decrease-batch-size-if-needed")
