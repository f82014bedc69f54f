"""The parser's checkpointing and in-process-restart groups."""

from __future__ import annotations

import argparse

from megatron.hetero import flags


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None, help="directory to load the latest checkpoint from")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="exit (after saving, with --save) when iteration %% N == 0")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only and start at iteration 0")
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist", "torch"],
                   help="torch_dist (loads under any plan) or Megatron-LM's legacy per-rank torch format")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration from --load instead of the latest")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="read the format from the checkpoint (torch_dist is the one we write)")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected",
                   choices=["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                            "raise_all", "return_unexpected", "return_all", "ignore_all"],
                   help="what loading does with keys the checkpoint and the model do not share")
    g.add_argument("--no-ckpt-fully-parallel-save", "--disable-ckpt-fully-parallel-save",
                   action="store_false", dest="ckpt_fully_parallel_save",
                   help="do not spread the writing of replicated tensors over data-parallel ranks")
    g.add_argument("--ckpt-fully-parallel-save", action="store_true",
                   dest="ckpt_fully_parallel_save_deprecated",
                   help="deprecated: the default (see --no-ckpt-fully-parallel-save)")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="spread the reading of replicated tensors over data-parallel ranks")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training goes on")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="one background checkpoint writer for the whole run")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="optimizer state re-shardable over TP/PP/DP (always the case here)")
    # Megatron-LM's save switches (checkpointing.py) and its exit when --load holds nothing.
    flags.declare(g, ("--no-save-optim", "--no-save-rng", "--exit-on-missing-checkpoint",
                      "--save-retain-interval", "--pretrained-checkpoint", "--use-checkpoint-args",
                      "--use-mp-args-from-checkpoint-args", "--no-use-tokenizer-model-from-checkpoint-args",
                      "--ckpt-assume-constant-structure", "--ckpt-convert-save", "--non-persistent-save-interval",
                      "--non-persistent-global-ckpt-dir"))
    g.add_argument("--non-persistent-ckpt-type", default=None, choices=["global", "local", "in_memory"],
                   help="global: checkpoints every --non-persistent-save-interval iterations in "
                        "--non-persistent-global-ckpt-dir (default SAVE/non_persistent), only the newest "
                        "kept; --load resumes from it when it is the newer. local, in_memory: snapshots "
                        "in host memory, copied to ranks on other nodes (--inprocess-restart restores "
                        "from them; without --non-persistent-save-interval, every iteration unless that "
                        "is measured to cost more than 3%% of the training time)")
    g = parser.add_argument_group("in-process restart")
    flags.declare(g, ("--inprocess-restart", "--inprocess-barrier-timeout", "--inprocess-heartbeat-timeout",
                      "--inprocess-max-iterations", "--inprocess-monitor-thread-interval",
                      "--inprocess-monitor-process-interval", "--inprocess-progress-watchdog-interval",
                      "--inprocess-heartbeat-interval", "--inprocess-soft-timeout", "--inprocess-hard-timeout",
                      "--inprocess-completion-timeout", "--inprocess-last-call-wait",
                      "--inprocess-termination-grace-time", "--inprocess-granularity",
                      "--inprocess-active-world-size", "--inprocess-empty-cuda-cache"))
    g.add_argument("--hetero-snapshot-replicas", type=int, default=1, metavar="R",
                   help="in-memory snapshots (--inprocess-restart): copies of each rank's snapshot kept "
                        "on the next R nodes")
    g.add_argument("--ckpt-convert-format", default=None, choices=["torch_dist"],
                   help="write the checkpoint --load holds again in this format, to "
                        "CKPT_CONVERT_SAVE/FORMAT, and exit")
