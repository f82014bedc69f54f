"""The themes of refused flags: each a feature Megatron-Hetero does not run, said once.

``THEMES``: each theme's title and reason (``what`` the feature is, then ``todo`` for the
user). ``THEME_FLAGS``: the refused flags of each theme, every one listed once (the flags of
other Megatron-LM programs by their group, ``OTHER_PROGRAM_GROUPS``); a refused flag's message
is its theme's reason unless catalog.REASONS gives it words of its own. docs/flags.md groups
the refused flags by theme, in the order of ``THEMES``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Theme:
    """Refused flags that share one reason: ``what`` the feature is, ``todo`` for the user."""

    title: str
    what: str
    todo: str = "not supported yet - remove it"

    def reason(self) -> str:
        return f"{self.what}; {self.todo}"


THEMES: dict[str, Theme] = {
    "overlap": Theme(
        "communication overlap and bucketing variants",
        "a communication-overlap variant beyond --overlap-grad-reduce, --overlap-param-gather "
        "and the --ddp-* bucketing flags (tensor-parallel overlap through transformer-engine's "
        "userbuffers, averaging inside the collective, deferred "
        "weight gradients)",
        "remove it (--overlap-grad-reduce, --overlap-param-gather and --ddp-bucket-size "
        "overlap and bucket the data-parallel communication)"),
    "pipeline_schedule": Theme(
        "interleaved-pipeline tuning",
        "ring-exchange pipeline transfers, which need a torch.distributed.ring_exchange that "
        "PyTorch does not ship",
        "remove it (interleaving itself runs with --num-virtual-stages-per-pipeline-rank, "
        "--num-layers-per-virtual-pipeline-stage or the plan's stages[s].virtual_stages)"),
    "context_parallel": Theme(
        "context parallelism",
        "a variant of transformer-engine's context-parallel attention (its communication types, "
        "hierarchical or hybrid context groups), which this release does not run",
        "remove it (--context-parallel-size itself runs: megatron-core's attention gathers each "
        "layer's keys and values over the context ranks)"),
    "low_precision": Theme(
        "FP8 and FP4 training",
        "FP8/FP4 training needs transformer-engine on Hopper/Ada/Blackwell/MI300 GPUs"),
    "gpu_runtime": Theme(
        "GPU-only runtime tuning",
        "tunes CUDA/NCCL/transformer-engine internals (CUDA graphs, NCCL user buffers and "
        "symmetric memory, activation offloading, transformer-engine's RNG tracker and "
        "activations) that Megatron-Hetero does not drive", "remove it"),
    "parallel_layout": Theme(
        "parallel layout (the plan decides)",
        "sets the pipeline or data-parallel layout, which the heterogeneous plan decides",
        "remove it; give per-stage layer counts and rank order in the plan (hetero-plan "
        "--hetero-plan plan.json)"),
    "fsdp": Theme("FSDP", "fully sharded data parallelism (Megatron-FSDP, torch FSDP2)",
                  "not supported yet - remove it; --use-distributed-optimizer shards optimizer state"),
    "moe": Theme(
        "MoE options that need NVIDIA-only libraries or overlap expert-parallel communication",
        "a mixture-of-experts option that needs NVIDIA-only code (the DeepEP/HybridEP "
        "communication libraries, the legacy grouped_gemm package, transformer-engine's overlap "
        "of the expert all-to-all with compute) or that Megatron-Hetero does not run yet "
        "(per-layer MoE logging, upcycling a dense checkpoint); every other MoE shape and "
        "routing flag of megatron-core is honoured, expert parallelism included",
        "remove it"),
    "mla": Theme(
        "multi-latent attention inference options",
        "caching multi-latent attention's compressed latents, an inference option of "
        "megatron-core's MLA flash decoding (training never reads it; --multi-latent-attention "
        "and its shape flags run)", "remove it"),
    "attention_variants": Theme(
        "experimental attention variants",
        "an experimental attention variant (gated delta net, DeepSeek sparse attention), QK "
        "clipping or max-attention-logit logging, which Megatron-LM runs on transformer-engine "
        "and flash-linear-attention kernels and in its own training loop"),
    "model_variants": Theme(
        "model-architecture variants",
        "a model-construction option Megatron-Hetero does not run (Xavier initialisation, MTP "
        "layers in their own pipeline stage)", "remove it"),
    "optimizer_variants": Theme(
        "optimizer and precision variants",
        "an optimizer variant that needs GPUs or transformer-engine (optimizer state offloaded "
        "from GPU memory to the CPU, precision-aware optimizer state in transformer-engine's "
        "FusedAdam)", "remove it"),
    "checkpoint_variants": Theme(
        "checkpoint variants",
        "a checkpointing mode beyond Megatron-Hetero's torch_dist save/load (non-persistent or "
        "local checkpoints, conversion of legacy distributed-optimizer state, gradient dumps, "
        "replication)"),
    "data_variants": Theme(
        "dataset variants",
        "a dataset or data-loader mode beyond --data-path/--mock-data with --split, a dataset per "
        "split, --dataloader-type single/cyclic and megatron-core's dataset options (FIM, "
        "multiple validation sets, phase transitions)"),
    "tokenizer_variants": Theme(
        "tokenizer options",
        "a tokenizer option of Megatron-LM's legacy tokenizers (--legacy-tokenizer, extra "
        "sentinel ids) or a fixed padded vocabulary; megatron-core's tokenizer options are "
        "honoured"),
    "logging_variants": Theme(
        "logging options",
        "a logging or timing option Megatron-Hetero's logger does not produce", "remove it"),
    "run_control": Theme(
        "run control", "a run-control option (process-group set-up, "
        "large-gradient checks, test modes) Megatron-Hetero does not implement", "remove it"),
    "resilience": Theme(
        "fault tolerance and resilience",
        "needs NVIDIA's resilience packages (straggler detector, nvidia-resiliency-ext fault "
        "tolerance and in-process restart, rerun state machine, ADLR autoresume)",
        "not supported - remove it; Megatron-Hetero's watchdog reports a lost process and "
        "--save/--load resume the run"),
    "inprocess_wrapper": Theme(
        "in-process restart's wrapper", "a setting of nvidia-resiliency-ext's in-process restart wrapper, "
        "which Megatron-Hetero's in-process restart does not use (it restarts a node's processes together, "
        "waits --inprocess-barrier-timeout for the job's re-plan and takes a peer silent for "
        "--inprocess-heartbeat-timeout as lost)", "leave it at its default (remove it)"),
    "kitchen": Theme("kitchen quantization", "NVIDIA kitchen quantization recipes",
                     "not supported - remove it"),
    "heterogeneous_layers": Theme(
        "heterogeneous layer architecture",
        "Megatron-LM's per-layer heterogeneous ARCHITECTURE (NAS models with differing "
        "layers), unrelated to Megatron-Hetero's heterogeneous hardware"),
    "other_programs": Theme(
        "flags of other Megatron-LM programs",
        "belongs to another Megatron-LM program (vision, BERT/T5, retrieval/biencoder, RL, "
        "SFT, inference, Mamba/hybrid models, model-optimizer export); Megatron-Hetero "
        "pretrains GPT models", "not supported - remove it"),
    "legacy": Theme("legacy and experimental", "Megatron-LM's legacy models or experimental "
                    "configuration paths (YAML configs, model specs, meta-device init)",
                    "not supported - remove it"),
    "removed": Theme("removed from Megatron-LM", "removed from Megatron-LM (its parser still "
                     "knows the name only to refuse it)", "remove it"),
    # Themes of flags only a later Megatron-LM tag than the reference one has.
    "te_kernels": Theme(
        "transformer-engine kernel options",
        "a transformer-engine kernel, fusion or weight layout (its operation fuser, fused residual "
        "RMSNorm, a grouped GEMM for the shared expert, single grouped expert weights, block-"
        "interleaved GLU weights, fused multi-latent attention down-projections, a pinned "
        "FlashAttention generation) that Megatron-Hetero does not set up",
        "not supported yet - remove it; --transformer-impl transformer_engine runs "
        "transformer-engine's standard layers"),
    "mup": Theme(
        "maximal update parameterization (MuP)",
        "maximal update parameterization scales the initialisation, the hidden weights' learning "
        "rates and the embedding and output multipliers by the model's width; Megatron-LM scales "
        "the learning rates in its own optimizer set-up, which Megatron-Hetero's does not do",
        "not supported yet - remove it and the --mup-* flags"),
    "profiling": Theme(
        "profiler options",
        "a profiler option beyond the trace --profile writes (tensor shapes, call stacks and "
        "Chakra execution traces in torch.profiler; NVTX ranges and shapes for Nsight Systems)",
        "not supported yet - remove it; --profile with --use-pytorch-profiler writes "
        "torch.profiler's trace"),
    "distillation": Theme(
        "logits distillation",
        "Megatron-LM's logits distillation: saving a model's top-k or top-p logits to files "
        "(--logits-save-*, with every weight frozen by --freeze-all-layers) or training on "
        "saved logits (--logits-load-*)", "not supported yet - remove it"),
    "checkpoint_options": Theme(
        "distributed checkpoint options",
        "an option of Megatron-LM's distributed checkpointing that Megatron-Hetero's torch_dist "
        "save and load do not take (the background writer's strategy, workers, priorities and "
        "shared-memory staging; the exchange algorithm and process groups of fully parallel "
        "save and load; checking on load that every shard is read once; file hashes)",
        "not supported yet - remove it; --async-save, --ckpt-fully-parallel-load and "
        "--no-ckpt-fully-parallel-save run"),
    "evaluation": Theme(
        "evaluation options",
        "an evaluation setting Megatron-Hetero's evaluation does not take (a first iteration to "
        "evaluate at, a global or micro-batch size of evaluation's own)",
        "not supported yet - remove it; --eval-interval and --eval-iters set the evaluation"),
    "flight_recorder": Theme(
        "NCCL flight recorder",
        "sets up PyTorch's NCCL flight recorder (TORCH_FR_DUMP_TEMP_FILE, "
        "TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT and the other TORCH_* "
        "variables it reads) before the process groups exist, which Megatron-Hetero does not do",
        "remove it and set those environment variables in the launch script: torch.distributed "
        "reads them itself"),
    # Only under a later Megatron-LM tag than the reference one (flags/rules.py), for a flag
    # nothing rules on there: one that tag added, or one it acts on where the reference did not.
    "unreviewed": Theme("newer Megatron-LM flags not supported yet",
                        "a flag Megatron-LM's pretrain_gpt.py acts on since core_v0.16.1 (added, or "
                        "read where it was not) that Megatron-Hetero does not implement yet",
                        "not supported yet - remove it"),
}

# Which refused flags share each theme (each flag once; flags/catalog.py checks it).
THEME_FLAGS: dict[str, tuple[str, ...]] = {
    "overlap": (
        "--tp-comm-overlap-cfg", "--tp-comm-overlap-rs-dgrad",
        "--no-tp-comm-bulk-wgrad", "--no-tp-comm-bulk-dgrad", "--no-tp-comm-overlap-ag",
        "--no-tp-comm-overlap-rs", "--no-tp-comm-split-ag", "--no-tp-comm-split-rs",
        "--tp-comm-bootstrap-backend", "--ddp-average-in-collective", "--delay-wgrad-compute",
        "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit",
    ),
    "pipeline_schedule": (
        "--use-ring-exchange-p2p",
    ),
    "context_parallel": (
        "--hierarchical-context-parallel-sizes", "--cp-comm-type",
        "--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank",
    ),
    "low_precision": (
        "--fp8-format", "--fp8-recipe", "--fp8-quantizer-factory", "--fp8-margin",
        "--fp8-interval", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--no-fp8-wgrad",
        "--fp8-param-gather", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
        "--num-layers-at-end-in-bf16", "--fp4-format", "--fp4-recipe", "--fp4-param-gather",
        "--fp4-quantizer-factory", "--te-precision-config-file",
        "--reuse-grad-buf-for-mxfp8-param-ag", "--moe-router-padding-for-fp8",
        "--moe-router-padding-for-quantization",
        # core_v0.19.0's
        "--fp8-output-proj",
    ),
    "gpu_runtime": (
        "--enable-cuda-graph", "--external-cuda-graph", "--cuda-graph-impl",
        "--cuda-graph-warmup-steps", "--cuda-graph-scope", "--te-rng-tracker",
        "--use-te-activation-func",
        "--symmetric-ar-type", "--use-nccl-ub", "--disable-symmetric-registration",
        "--fsdp-manual-registration", "--pipeline-model-parallel-comm-backend",
        "--cpu-offloading-num-layers",
        "--fine-grained-activation-offloading", "--offload-modules",
        "--min-offloaded-tensor-size", "--batch-invariant-mode",
        # core_v0.19.0's
        "--cpu-offloading-retain-pinned-cpu-buffers", "--delay-offload-until-cuda-graph",
        "--delta-offload-bytes-across-pp-ranks", "--activation-offload-fraction",
        "--fine-grained-offloading-max-inflight-offloads", "--optimizer-cuda-graph", "--moe-paged-stash",
    ),
    "parallel_layout": (
        "--num-distributed-optimizer-instances",
        # core_v0.19.0's
        "--tensor-parallel-num-weight-shards", "--expert-tensor-parallel-num-weight-shards",
    ),
    "fsdp": (
        "--use-megatron-fsdp", "--use-torch-fsdp2",
        "--no-strict-fsdp-dtensor-load",
    ),
    "moe": (
        "--overlap-moe-expert-parallel-comm",
        "--ep-overlap-early-attn-memory-release", "--moe-latent-size",
        "--moe-shared-expert-overlap",
        "--moe-use-legacy-grouped-gemm",
        "--moe-enable-deepep", "--moe-flex-dispatcher-backend",
        "--moe-deepep-num-sms",
        "--moe-hybridep-num-sms", "--moe-use-upcycling",
        # core_v0.19.0's
        "--overlap-dispatch-backward-with-experts-wgrad", "--high-priority-a2a-comm-stream",
        "--moe-permute-fusion-into-hybridep", "--moe-hybridep-pad-uneven-dispatch-inputs",
        "--moe-flex-dispatcher-num-sms", "--moe-hybridep-num-blocks-permute",
        "--moe-hybridep-num-blocks-unpermute", "--moe-hybridep-num-sms-preprocessing",
        "--moe-ncclep-static-shape", "--moe-ncclep-zero-copy", "--moe-expert-rank-capacity-factor",
        "--moe-router-force-biased",
    ),
    "mla": (
        "--cache-mla-latents",
    ),
    "attention_variants": (
        "--experimental-attention-variant", "--qk-clip", "--qk-clip-alpha", "--qk-clip-threshold",
        "--log-max-attention-logit",
    ),
    "model_variants": (
        "--init-method-xavier-uniform",
        "--mtp-standalone",
        "--decoder-num-layers",
        "--decoder-seq-length",
        # core_v0.19.0's
        "--mtp-use-repeated-layer", "--mtp-detach-heads",
    ),
    "optimizer_variants": (
        "--optimizer-cpu-offload",
        "--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype",
        "--exp-avg-dtype", "--exp-avg-sq-dtype",
        # core_v0.19.0's
        "--ddp-param-name-patterns-for-fp32-local-accumulation",
    ),
    "checkpoint_variants": (
        "--save-wgrads-interval", "--save-dgrads-interval",
        "--load-main-params-from-ckpt",
        "--non-persistent-local-ckpt-dir", "--non-persistent-local-ckpt-algo",
        "--ckpt-convert-update-legacy-dist-opt-format",
        "--distrib-optim-fully-reshardable-mem-efficient",
        "--replication",
        # core_v0.19.0's
        "--save-params-interval", "--save-activations-interval", "--save-tokens-per-expert-interval",
        "--override-ckpt-iteration", "--enable-msc",
    ),
    "data_variants": (
        "--phase-transition-iterations", "--fim-data",
        "--multiple-validation-sets",
        # core_v0.19.0's
        "--dataloader-inter-document-masking",
    ),
    "tokenizer_variants": (
        "--padded-vocab-size", "--vocab-extra-ids",
        "--legacy-tokenizer",
        # core_v0.19.0's
        "--no-pad-vocab-size",
    ),
    "logging_variants": (
        "--log-energy",
        # core_v0.19.0's
        "--moe-routing-trace-path",  # its --moe-routing-trace-* options: no-ops without it
    ),
    "run_control": (
        "--check-for-large-grads", "--lazy-mpu-init", "--fake-process-group",
        # core_v0.19.0's
        "--step-batch-size-schedule", "--exit-signal-handler-for-training",
    ),
    "resilience": (
        "--log-straggler",
        "--run-workload-inspector-server",
        "--enable-ft-package",
        "--error-injection-rate",
        "--error-injection-type", "--check-for-spiky-loss",
        "--result-rejected-tracker-filename", "--adlr-autoresume",
        # core_v0.19.0's
        "--gpu-sniff-test-interval",
    ),
    "kitchen": ("--use-kitchen-attention", "--kitchen-attention-backend"),
    "heterogeneous_layers": (
        "--heterogeneous-layers-config-path", "--heterogeneous-layers-config-encoded-json",
    ),
    "legacy": (
        "--use-legacy-models", "--yaml-cfg", "--spec", "--enable-experimental",
        "--init-model-with-meta-device",
    ),
    "removed": ("--batch-size", "--warmup", "--model-parallel-size", "--checkpoint-activations"),
    # Themes of flags core_v0.19.0 added (flags/themes.py).
    "te_kernels": (
        "--use-transformer-engine-op-fuser", "--fused-residual-rmsnorm", "--use-grouped-gemm-for-shared-expert",
        "--moe-shared-expert-glu-interleave-size", "--moe-single-grouped-weight", "--moe-single-grouped-bias",
        "--moe-mlp-glu-interleave-size", "--mla-down-proj-fusion", "--flash-attention-version",
    ),
    "mup": (
        "--use-mup", "--mup-width-mult", "--mup-base-hidden-size", "--mup-embedding-mult", "--mup-output-mult",
        "--mup-base-head-dim", "--mup-attn-scale-power",
    ),
    "profiling": (
        "--pytorch-profiler-collect-shapes", "--pytorch-profiler-collect-callstack",
        "--pytorch-profiler-collect-chakra", "--record-shapes", "--nvtx-ranges",
    ),
    "distillation": (
        "--freeze-all-layers", "--logits-save-top-k", "--logits-save-top-p", "--logits-save-top-p-min-k",
        "--logits-save-dir", "--logits-save-dtype", "--logits-load-dir", "--logits-load-decode-threads",
        "--logits-load-prefetch-factor", "--logits-load-msc-prefetch-depth", "--logits-load-kd-loss-alpha",
        "--logits-load-ignore-errors",
    ),
    "checkpoint_options": (
        "--async-strategy", "--async-ckpt-cpu-priority", "--async-ckpt-io-priority", "--async-ckpt-use-cpu-shm",
        "--dist-ckpt-workers", "--ckpt-fully-parallel-load-exchange-algo",
        "--ckpt-fully-parallel-save-process-group", "--ckpt-fully-parallel-load-process-group",
        "--no-ckpt-load-validate-sharding-integrity", "--verify-integrity",
    ),
    "evaluation": ("--start-eval-at-iter", "--eval-global-batch-size", "--eval-micro-batch-size"),
    "flight_recorder": (
        "--flight-recorder-dump-path", "--flight-recorder-trace-buffer-size",
        "--no-flight-recorder-dump-on-timeout", "--flight-recorder-include-stack-trace",
        "--no-flight-recorder-include-only-active", "--no-flight-recorder-extra-dump-on-exec",
    ),
}

# Megatron-LM's argument groups that belong wholly to other programs.
OTHER_PROGRAM_GROUPS = ("rl", "vision", "biencoder", "inference", "sft", "modelopt-generic")
OTHER_PROGRAM_FLAGS = ("--is-hybrid-model", "--inference-rng-tracker",
                       # core_v0.19.0's: inference, and Mamba/hybrid models' layer patterns
                       "--inference-cuda-graph-scope", "--inference-disable-triton-nvls-kernels",
                       "--hybrid-layer-pattern", "--mtp-hybrid-override-pattern")


def theme_of_flags(group_of: dict[str, str]) -> dict[str, str]:
    """Each refused flag's theme; ``group_of`` maps a flag to its Megatron-LM group title
    (the groups of other programs are refused whole)."""
    themes = {flag: theme for theme, flags in THEME_FLAGS.items() for flag in flags}
    for flag in OTHER_PROGRAM_FLAGS:
        themes[flag] = "other_programs"
    for flag, group in group_of.items():
        if group in OTHER_PROGRAM_GROUPS and flag not in themes:
            themes[flag] = "other_programs"
    return themes
