"""What Megatron-Hetero does with each Megatron-LM flag arguments/ does not define.

A flag of Megatron-LM's pretrain_gpt.py (megatron_lm_flags.json) is honoured when
arguments/ defines it; every other flag is listed here exactly once:

- ``NOOPS`` (and ``noops()``, with ``LATER_TAG_NOOPS`` of the tag in use): accepted, no
  effect, because Megatron-LM itself ignores it (deprecated, read nowhere, or overridden by
  its validate_args in every run we can make);
- a theme (flags/themes.py: ``THEMES`` and the flags of each, ``THEME_FLAGS``): refused by
  name, with what the feature is and what to do (``REASONS`` where one flag needs its own words).

``DEFAULT_ONLY`` lists flags arguments/ defines (the runtime reads their value) whose
every value but Megatron-LM's default is refused at start-up: they count as refused.
``REFUSED_VALUES`` lists values of honoured flags that Megatron-LM accepts and we refuse.
``DEFAULT_DIFFERENCES`` lists honoured flags whose default is not Megatron-LM's.

rules.check_registry names any flag that is both honoured and listed here, or neither. The flags
of a later Megatron-LM tag than the reference one are ruled on here too ("core_v0.19.0's").
"""

from __future__ import annotations

from megatron.hetero.flags.facts import megatron_tag

# The themes and the refused flags of each (also read as catalog.THEMES, catalog.theme_of_flags).
from megatron.hetero.flags.themes import (  # noqa: F401
    OTHER_PROGRAM_FLAGS,
    OTHER_PROGRAM_GROUPS,
    THEME_FLAGS,
    THEMES,
    theme_of_flags,
)

# Flags of ours that Megatron-LM does not have.
HETERO_FLAGS = ("--hetero-plan", "--hetero-adapt", "--hetero-adapt-output", "--hetero-snapshot-replicas",
                "--hetero-allow-untested-megatron-core", "--local_rank")


# One message for a flag, where the theme's reason is not specific enough.
REASONS: dict[str, str] = {
    "--batch-size": "removed from Megatron-LM; use --micro-batch-size",
    "--warmup": "removed from Megatron-LM; use --lr-warmup-fraction or --lr-warmup-iters",
    "--model-parallel-size": "removed from Megatron-LM; use --tensor-model-parallel-size",
    "--checkpoint-activations": "removed from Megatron-LM; use --recompute-activations "
                                "(its replacement)",
    "--enable-cuda-graph": "deprecated alias of --cuda-graph-impl local; CUDA graphs are not "
                           "supported - remove it",
    "--external-cuda-graph": "deprecated alias of --cuda-graph-impl transformer_engine; CUDA "
                             "graphs are not supported - remove it",
    "--ddp-average-in-collective": "averages gradients inside the data-parallel collective, "
                                   "which megatron-core cannot combine with per-token loss "
                                   "weighting; Megatron-Hetero always weights by tokens (replicas "
                                   "run different micro-batch counts) - remove it",
    "--moe-latent-size": "MoE latent projections need transformer-engine in megatron-core "
                         "0.16.1 (its local experts refuse them); remove it",
    "--moe-shared-expert-overlap": "overlaps the shared expert on a separate CUDA stream, "
                                   "which megatron-core creates on NVIDIA GPUs only; remove it",
    "--init-method-xavier-uniform": "Megatron-LM core_v0.16.1 itself fails with it (it passes "
                                    "TransformerConfig a scaled_init_method field the config no "
                                    "longer has); remove it",
    "--qk-clip": "QK clipping needs transformer-engine 2.9 or later in Megatron-LM; remove it",
    "--tp-comm-overlap": "overlaps tensor-parallel communication with GEMMs through "
                         "transformer-engine's userbuffers, which Megatron-Hetero does not "
                         "initialise; remove it",
    "--decoder-num-layers": "the decoder of Megatron-LM's encoder-decoder (T5) models; a GPT "
                            "model has none - remove it",
    "--decoder-seq-length": "the decoder of Megatron-LM's encoder-decoder (T5) models; a GPT "
                            "model has none - remove it",
    "--use-legacy-models": "Megatron-LM's legacy (non-megatron-core) models are not supported; "
                           "Megatron-Hetero builds megatron-core's GPTModel - remove it",
    # Flags core_v0.19.0 added.
    **{flag: "shards each weight over more ranks than the tensor-parallel degree (Megatron-LM's "
             "generalized tensor parallelism, a process-group axis of its own that Megatron-Hetero's "
             "plans do not have); not supported yet - remove it"
       for flag in ("--tensor-parallel-num-weight-shards", "--expert-tensor-parallel-num-weight-shards")},
    "--moe-router-force-biased": "adds a random bias, the same on every rank, to the router's logits (a "
                                 "benchmarking aid); not supported yet - remove it; "
                                 "--moe-router-force-load-balancing routes by random logits",
    **{flag: "an option of the flex dispatcher's NCCL-EP backend (--moe-flex-dispatcher-backend ncclep), "
             "which needs transformer-engine's fused grouped MLP on Blackwell GPUs; Megatron-Hetero runs "
             "the alltoall and allgather dispatchers - remove it"
       for flag in ("--moe-ncclep-static-shape", "--moe-ncclep-zero-copy")},
    "--moe-expert-rank-capacity-factor": "a per-rank token budget of the flex dispatcher's HybridEP and "
                                         "NCCL-EP backends (--moe-token-dispatcher-type flex, refused) - "
                                         "remove it; --moe-expert-capacity-factor drops tokens per expert",
    "--moe-paged-stash": "keeps the routed experts' activations for the backward pass in paged GPU "
                         "buffers (spilling to host memory), a memory manager Megatron-Hetero does not "
                         "set up - remove it",
    "--mtp-use-repeated-layer": "applies one multi-token-prediction layer --mtp-num-layers times (shared "
                                "weights), where Megatron-Hetero's plans place and cost one layer per "
                                "prediction depth; not supported yet - remove it",
    "--mtp-detach-heads": "trains the multi-token-prediction heads on their own loss only (detached from "
                          "the main model, their gradients clipped as a group of their own); not "
                          "supported yet - remove it",
    **{flag: f"periodic dumps of the {what} to files for debugging, which Megatron-Hetero does not "
             "write - remove it" for flag, what in (
                 ("--save-params-interval", "parameters"), ("--save-activations-interval", "activations"),
                 ("--save-tokens-per-expert-interval", "numbers of tokens routed to each expert"))},
    "--override-ckpt-iteration": "resumes as if the loaded checkpoint were of another iteration (the "
                                 "data order rewound or skipped with it), which Megatron-Hetero's resume "
                                 "does not do - remove it; --ckpt-step loads another saved iteration",
    "--enable-msc": "routes checkpoint and data paths through NVIDIA's multi-storage client (msc:// "
                    "paths to object stores), which Megatron-Hetero does not use - remove it",
    "--async-strategy": "chooses the background writer of --async-save: Megatron-Hetero's always "
                        "writes with megatron-core's own (what --async-strategy mcore asks for); "
                        "choosing it, nvidia-resiliency-ext's nvrx included, is not supported yet - "
                        "remove it",
    "--dataloader-inter-document-masking": "masks attention between the documents packed into one "
                                           "sequence by their lengths (packed-sequence attention), "
                                           "which Megatron-Hetero's batches do not carry; not supported "
                                           "yet - remove it; --reset-attention-mask masks attention "
                                           "between documents with the dataloader's attention mask",
    "--no-pad-vocab-size": "keeps the vocabulary at the tokenizer's size, where Megatron-Hetero always pads "
                           "it to a multiple of --make-vocab-size-divisible-by times the tensor-parallel "
                           "degree (the same for every plan of one model) - remove it; "
                           "--make-vocab-size-divisible-by 1 pads the least",
    "--step-batch-size-schedule": "a global batch size that steps up at thresholds of consumed tokens or "
                                  "samples, where Megatron-Hetero's plans fix the global batch; not "
                                  "supported yet - remove it; --global-batch-size sets the batch and "
                                  "--rampup-batch-size ramps it up",
    "--exit-signal-handler-for-training": "exits at SIGINT or SIGTERM without saving, after a barrier of "
                                          "all ranks; not supported - remove it; --exit-signal-handler "
                                          "finishes the iteration, saves and exits at --exit-signal",
    "--gpu-sniff-test-interval": "runs GPU performance tests (GEMMs, all-to-all, send/recv) every N "
                                 "iterations to name a rank slower than the others; not supported - "
                                 "remove it; --hetero-adapt measures the replicas' times while training "
                                 "and rebalances a slow one",
    "--ddp-param-name-patterns-for-fp32-local-accumulation": (
        "accumulates in fp32 the gradients of the parameters whose names match these patterns, the "
        "others in the training precision; not supported yet - remove it; "
        "--accumulate-allreduce-grads-in-fp32 accumulates every gradient in fp32"),
}

# Flags arguments/ defines, because the runtime reads their value, but whose every value
# other than Megatron-LM's default is refused at start-up (validate_args, configure_performance):
# refused, under this theme. Given at the default they change nothing, as any refused flag.
DEFAULT_ONLY: dict[str, str] = {
    "--tp-comm-overlap": "overlap",
    # In-process restart is Megatron-Hetero's own (restart.py), not nvidia-resiliency-ext's
    # wrapper these tune: its waits are --inprocess-barrier-timeout (for the job's re-plan) and
    # --inprocess-heartbeat-timeout (a silent peer); the rest set the wrapper's own monitors.
    **{name: "inprocess_wrapper" for name in (
        "--inprocess-max-iterations", "--inprocess-monitor-thread-interval",
        "--inprocess-monitor-process-interval", "--inprocess-progress-watchdog-interval",
        "--inprocess-heartbeat-interval", "--inprocess-soft-timeout", "--inprocess-hard-timeout",
        "--inprocess-completion-timeout", "--inprocess-last-call-wait", "--inprocess-termination-grace-time",
        "--inprocess-granularity", "--inprocess-active-world-size", "--inprocess-empty-cuda-cache")},
}

# Values of honoured flags that Megatron-LM accepts and Megatron-Hetero refuses, by name.
REFUSED_VALUES: dict[str, dict[str, str]] = {
    "--moe-token-dispatcher-type": {
        "flex": "the flex dispatcher runs on DeepEP or HybridEP, NVIDIA-GPU communication "
                "libraries Megatron-Hetero's mixed-vendor clusters cannot assume; use alltoall or "
                "allgather"},
    "--exit-signal": {name: "a process cannot catch this signal, so nothing could save on it; "
                            "use SIGTERM (Slurm's), SIGINT or SIGUSR1" for name in ("SIGKILL", "SIGSTOP")},
    "--dataloader-type": {
        "external": "an external data loader is another program's own iterable dataset; "
                    "pretrain_gpt.py's datasets load with single or cyclic"},
    "--transformer-impl": {
        "inference_optimized": "inference-optimized layers belong to Megatron-LM's inference "
                               "programs; use local or transformer_engine"},
    "--position-embedding-type": {
        "mrope": "multimodal RoPE belongs to Megatron-LM's vision-language models; use rope",
        "relative": "relative (T5-style) position embeddings are not built yet; use rope or "
                    "learned_absolute"},
    "--optimizer": {
        "muon": "the Muon optimizer is not supported yet; use adam or sgd",
        "dist_muon": "the Muon optimizer is not supported yet; use adam or sgd"},
    "--rerun-mode": {
        "report_stats": "re-running iterations to report their determinism is not implemented; use "
                        "validate_results or disabled"},
    "--ckpt-convert-format": {
        "torch": "Megatron-Hetero writes torch_dist checkpoints only (they load under any plan); use "
                 "--ckpt-convert-format torch_dist"},
    "--ckpt-format": {
        value: "Megatron-Hetero writes and reads torch_dist and Megatron-LM's legacy torch "
               "checkpoints; use --ckpt-format torch_dist" for value in ("torch_dcp", "fsdp_dtensor")},
    "--tokenizer-type": {
        value: "a tokenizer of another Megatron-LM program (BERT, multimodal, SFT); Megatron-"
               "Hetero pretrains GPT models" for value in (
                   "BertWordPieceLowerCase", "BertWordPieceCase", "MultimodalTokenizer",
                   "NullMultimodalTokenizer", "SFTTokenizer")},
}

# Accepted, no effect: Megatron-LM ignores these too (the reason says where it does).
NOOPS: dict[str, str] = {
    "--use-mcore-models": "deprecated in Megatron-LM and ignored; megatron-core models are the "
                          "default",
    "--use-dist-ckpt": "deprecated in Megatron-LM and without effect; --ckpt-format chooses "
                       "the format",
    "--dist-ckpt-format": "deprecated in Megatron-LM and without effect; --ckpt-format chooses "
                          "the format",
    "--no-async-tensor-model-parallel-allreduce": "deprecated in megatron-core and ignored",
    "--no-scatter-gather-tensors-in-pipeline": "read nowhere by Megatron-LM core_v0.16.1",
    "--enable-full-sharding-in-hsdp": "read nowhere by Megatron-LM core_v0.16.1",
    "--replication-jump": "Megatron-LM ignores it without --replication (not supported)",
    "--disable-msc": "Megatron-Hetero never uses the multi-storage client, which is what this "
                     "flag asks",
    "--rope-scaling-factor": "Megatron-LM reads it only while validating a heterogeneous-layers "
                             "configuration (--heterogeneous-layers-config-path, refused)",
    "--tokenizer-hf-use-fast": "Megatron-Hetero always loads a Hugging Face tokenizer's fast "
                               "implementation, which is what this flag asks",
    **{flag: "an OptimizerConfig field only megatron-core's CPU-offloading optimizer reads "
             "(--optimizer-cpu-offload, refused); the optimizer ignores it otherwise" for flag in (
                 "--optimizer-offload-fraction", "--use-torch-optimizer-for-cpu-offload",
                 "--overlap-cpu-optimizer-d2h-h2d", "--no-pin-cpu-grads", "--no-pin-cpu-params")},
    **{flag: "a megatron-core config field read only for an experimental attention variant "
             "(--experimental-attention-variant, refused); standard attention ignores it" for flag in (
                 "--dsa-indexer-loss-coeff", "--linear-attention-freq", "--linear-conv-kernel-dim",
                 "--linear-key-head-dim", "--linear-num-key-heads", "--linear-num-value-heads",
                 "--linear-value-head-dim",
                 # core_v0.19.0's
                 "--dsa-indexer-topk-freq", "--dsa-indexer-skip-topk-offset", "--dsa-kernel-backend")},
    **{flag: "a Mamba/hybrid-model setting: Megatron-LM's pretrain_gpt.py only copies it from a checkpoint's "
             "arguments (--use-checkpoint-args); the GPT model never reads it" for flag in (
                 "--hybrid-attention-ratio", "--hybrid-mlp-ratio", "--hybrid-override-pattern",
                 "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads", "--mamba-state-dim")},
    **{flag: "a megatron-core config field only its inference engine reads; training ignores it"
       for flag in ("--flash-decode", "--inference-fuse-tp-communication", "--mlp-chunks-for-prefill")},
    # Megatron-LM's global_vars._set_one_logger warns and trains on when the one_logger
    # package is missing; Megatron-Hetero never reports to one-logger.
    **{flag: "NVIDIA's one-logger telemetry: Megatron-LM trains on without it when the one_logger "
             "package is missing, and Megatron-Hetero never reports to it" for flag in (
                 "--no-one-logger", "--one-logger-project", "--one-logger-run-name", "--one-logger-async",
                 "--app-tag-run-name", "--app-tag-run-version")},
    # Flags core_v0.19.0 added.
    **{flag: "a megatron-core config field read only by its inference-optimized layers "
             "(--transformer-impl inference_optimized, refused); training ignores it" for flag in (
                 "--inference-grouped-gemm-backend", "--inference-moe-disable-fused-quant-kernels",
                 "--inference-moe-token-dispatcher-type")},
    **{flag: f"megatron-core's TransformerConfig.{flag[2:].replace('-', '_')}, read only for "
             "--moe-paged-stash (refused)" for flag in (
                 "--moe-paged-stash-page-size", "--moe-paged-stash-buffer-size-factor-cuda",
                 "--moe-paged-stash-buffer-size-factor-cpu")},
    "--moe-router-quantile-balancing-ema": "megatron-core's TransformerConfig."
                                           "moe_router_quantile_balancing_ema, read only for "
                                           "--moe-router-load-balancing-type quantile_balancing (refused)",
    **{flag: "Megatron-LM reads it only for --position-embedding-type yarn (refused), the YaRN RoPE of a "
             "model without multi-latent attention" for flag in (
                 "--yarn-original-max-position-embeddings", "--yarn-beta-fast", "--yarn-beta-slow",
                 "--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int")},
    "--muon-scalar-optimizer": "megatron-core's OptimizerConfig.muon_scalar_optimizer, read only for "
                               "--optimizer muon or adaptive_muon (refused)",
    **{flag: f"megatron-core's OptimizerConfig.{flag[2:].replace('-', '_')}, read only for --optimizer "
             "lion, or muon with --muon-scalar-optimizer lion (refused)" for flag in (
                 "--lion-beta1", "--lion-beta2")},
    "--no-stream-ckpt-dequant": "megatron-core's loader dequantizes FP8/FP4 model parameters only "
                                "(--fp8-param-gather, --fp4-param-gather: refused); any other "
                                "checkpoint loads the same either way",
    "--mamba-training-ssm-states-dtype": "a Mamba/hybrid-model setting: megatron-core reads it only in "
                                         "Mamba layers, which only a hybrid model (--hybrid-layer-pattern, "
                                         "refused) builds; the GPT model never reads it",
    **{flag: f"megatron-core's DistributedDataParallelConfig.{flag[2:].replace('-', '_')}, read only for "
             "--use-megatron-fsdp (refused)" for flag in (
                 "--megatron-fsdp-main-params-dtype", "--megatron-fsdp-main-grads-dtype",
                 "--megatron-fsdp-grad-comm-dtype", "--megatron-fsdp-max-pool-double-buffer")},
    "--no-use-layer-wise-param-layout": "Megatron-LM reads it only for the layer-wise distributed "
                                        "optimizer of --optimizer muon, lion, soap or adaptive_muon "
                                        "(refused)",
}

# No-ops of a later Megatron-LM tag only: flags of the reference tag that the later tag reads
# where the reference tag did not (there flags/reads.py's rule finds them no-ops by itself).
LATER_TAG_NOOPS: dict[str, dict[str, str]] = {
    "core_v0.19.0": {
        **{flag: "an inference setting: Megatron-LM's training never acts on it (megatron-core reads it "
                 "only in its inference engine)" for flag in (
                     "--moe-pad-experts-for-cuda-graph-inference", "--nccl-all-reduce-for-prefill")},
        "--muon-scale-mode": "megatron-core's OptimizerConfig.muon_scale_mode, read only for --optimizer "
                             "muon (refused)",
        **{flag: f"megatron-core's DistributedDataParallelConfig.{flag[2:].replace('-', '_')}, read only "
                 "for --use-megatron-fsdp (refused)" for flag in (
                     "--data-parallel-sharding-strategy", "--fsdp-double-buffer")},
    },
}


def noops() -> dict[str, str]:
    """Every no-op flag (of the Megatron-LM tag in use) and why it has no effect."""
    return {**NOOPS, **LATER_TAG_NOOPS.get(megatron_tag(), {})}


def duplicate_entries() -> list[str]:
    """Flags listed more than once across themes and no-ops."""
    seen: dict[str, int] = {}
    lists = [*THEME_FLAGS.values(), OTHER_PROGRAM_FLAGS, NOOPS, *LATER_TAG_NOOPS.values()]
    for flags in lists:
        for flag in flags:
            seen[flag] = seen.get(flag, 0) + 1
    return sorted(f for f, n in seen.items() if n > 1)


# ---- honoured flags whose default is not Megatron-LM's (tests check this list) ----------
DEFAULT_DIFFERENCES: dict[str, str] = {
    "--tensor-model-parallel-size": "none given: the plan decides (1 without a plan, as Megatron-LM)",
    "--pipeline-model-parallel-size": "none given: the plan decides (1 without a plan, as Megatron-LM)",
    "--expert-model-parallel-size": "none given: the plan decides (1 without a plan, as Megatron-LM)",
    "--transformer-impl": "none given: transformer_engine when it is installed (Megatron-LM's "
                          "default), else local",
    "--distributed-backend": "none given: nccl on GPUs (Megatron-LM's default), gloo on the CPU",
    "--local-rank": "none given: the LOCAL_RANK environment variable, as torchrun sets it",
    "--tokenizer-type": "none given: GPT2BPETokenizer, Megatron-LM's pretrain_gpt.py default "
                        "(set when the flags are validated)",
    "--eval-interval": "1000 (Megatron-LM core_v0.16.1 has no default and fails without it "
                       "when training by iterations; 1000 was its earlier default)",
}
