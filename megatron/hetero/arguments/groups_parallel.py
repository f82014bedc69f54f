"""The parser's distributed, heterogeneous-plan and performance groups."""

from __future__ import annotations

import argparse

from megatron.hetero import flags


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo", "hetero"],
                   help="default nccl on GPUs, gloo on the CPU; hetero: native library inside "
                        "each vendor of the plan's devices, a bridge across vendors")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    flags.declare(g, ("--use-tp-pp-dp-mapping",))  # the uniform plan's rank order (startup.load_plan)
    # megatron-core's tuning of the groups it creates (distributed.GROUP_OPTION_FLAGS)
    flags.declare(g, ("--use-sharp", "--sharp-enabled-group", "--nccl-communicator-config-path",
                      "--high-priority-stream-groups", "--create-all-gather-group",
                      "--disable-gloo-process-groups"))
    g.add_argument("--use-cpu-initialization", action="store_true")
    g.add_argument("--local-rank", "--local_rank", type=int, default=None,
                   help="set by old launchers; the LOCAL_RANK environment variable wins")


def _add_hetero_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("heterogeneous plan")
    g.add_argument("--hetero-plan", default=None,
                   help="plan.json from hetero-plan; without it the job runs Megatron's "
                        "uniform plan (even stages, equal replicas, launch-order ranks)")
    g.add_argument("--hetero-adapt", action="store_true",
                   help="re-split the replicas' micro-batch counts while training when their "
                        "measured times are unbalanced (same global batch, same samples), and "
                        "write a corrected plan with a better layer split for the next restart")
    g.add_argument("--hetero-adapt-output", default=None, metavar="PATH",
                   help="where --hetero-adapt writes the corrected plan (default: "
                        "adapted_plan.json in --save, else in the working directory)")
    g.add_argument("--hetero-allow-untested-megatron-core", action="store_true",
                   help="run on a megatron-core release Megatron-Hetero is not tested with, with "
                        "a warning (as HETERO_ALLOW_UNTESTED_MEGATRON_CORE=1; the tested releases: "
                        "python -m megatron.hetero.patches)")


def _add_performance_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's performance features, switched on in megatron-core (performance/)."""
    g = parser.add_argument_group("performance")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split layer norms, dropout and residuals along the sequence across TP")
    g.add_argument("--recompute-activations", action="store_true",
                   help="alias of --recompute-granularity selective")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="a plan's stages[s].recompute overrides this for stage s")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="*", default=None,
                   help="selective recomputation: what to recompute (default core_attn)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="interleaved 1F1B; a plan's stages[s].virtual_stages gives uneven splits")
    # Megatron-LM's uneven pipeline stages: without a plan they make the stages
    # (hetero/pipeline_layout.py), with one they must agree with it.
    flags.declare(g, ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                      "--pipeline-model-parallel-layout", "--account-for-embedding-in-pipeline-split",
                      "--account-for-loss-in-pipeline-split"))
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--no-align-grad-reduce", action="store_false", dest="align_grad_reduce")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="needs --use-distributed-optimizer and --overlap-grad-reduce")
    g.add_argument("--no-align-param-gather", action="store_false", dest="align_param_gather")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    # Megatron-LM's get_model turns these into DistributedDataParallelConfig fields (model.py).
    flags.declare(g, ("--ddp-num-buckets", "--ddp-pad-buckets-for-high-nccl-busbw",
                      "--ddp-reduce-scatter-with-fp32-accumulation"))
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"])
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "local", "flash", "fused", "unfused"],
                   help="auto: transformer-engine picks on GPUs; local on the CPU")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="needs transformer-engine and a GPU")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="splits each sequence over this many ranks (the plan's context_parallel)")
