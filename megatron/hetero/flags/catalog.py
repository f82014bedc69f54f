"""What Megatron-Hetero does with each Megatron-LM flag arguments.py does not define.

A flag of Megatron-LM's pretrain_gpt.py (megatron_lm_flags.json) is honoured when
arguments.py defines it; every other flag is listed here exactly once:

- ``NOOPS`` (and ``noops()``): accepted, no effect, because Megatron-LM itself ignores it
  (deprecated, read nowhere, or overridden by its validate_args in every run we can make);
- a theme of ``THEMES``: refused by name, with what the feature is and what to do
  (``REASONS`` where one flag needs its own words).

``DEFAULT_ONLY`` lists flags arguments.py defines (the runtime reads their value) whose
every value but Megatron-LM's default is refused at start-up: they count as refused.
``REFUSED_VALUES`` lists values of honoured flags that Megatron-LM accepts and we refuse.
``DEFAULT_DIFFERENCES`` lists honoured flags whose default is not Megatron-LM's.

rules.check_registry names any flag that is both honoured and listed here, or neither.
"""

from __future__ import annotations

from dataclasses import dataclass

# Flags of ours that Megatron-LM does not have.
HETERO_FLAGS = ("--hetero-plan", "--hetero-adapt", "--hetero-adapt-output", "--local_rank")


@dataclass(frozen=True)
class Theme:
    """Refused flags that share one reason: ``what`` the feature is, ``todo`` for the user."""

    title: str
    what: str
    todo: str = "not supported yet - remove it"

    def reason(self) -> str:
        return f"{self.what}; {self.todo}"


THEMES: dict[str, Theme] = {
    "recompute": Theme(
        "recomputation variants",
        "a recomputation variant beyond Megatron-Hetero's (activations saved distributed over "
        "tensor-parallel ranks, recomputation of whole MoE layers)",
        "remove it (recomputation itself runs with --recompute-granularity, --recompute-method, "
        "--recompute-num-layers and --recompute-modules, or per stage in the plan: "
        "stages[s].recompute)"),
    "overlap": Theme(
        "communication overlap and bucketing variants",
        "a communication-overlap or bucketing variant beyond --overlap-grad-reduce, "
        "--overlap-param-gather and --ddp-bucket-size (tensor-parallel overlap through "
        "transformer-engine's userbuffers, overlap with the optimizer step, bucket counts and "
        "padding, fp32 reduce-scatter accumulation, averaging inside the collective, deferred "
        "weight gradients)",
        "remove it (--overlap-grad-reduce, --overlap-param-gather and --ddp-bucket-size "
        "overlap and bucket the data-parallel communication)"),
    "pipeline_schedule": Theme(
        "interleaved-pipeline tuning",
        "tunes the interleaved pipeline schedule beyond Megatron-LM's defaults (micro-batch "
        "groups per virtual stage, overlapped warm-up and flush, ring-exchange transfers)",
        "remove it (interleaving itself runs with --num-virtual-stages-per-pipeline-rank, "
        "--num-layers-per-virtual-pipeline-stage or the plan's stages[s].virtual_stages)"),
    "context_parallel": Theme(
        "context parallelism",
        "context parallelism (each sequence split over ranks), for which heterogeneous plans "
        "have no axis",
        "remove it (Megatron-LM's default, --context-parallel-size 1, is accepted)"),
    "kernels": Theme(
        "fused-kernel switches",
        "turns off megatron-core's fused gradient division or its JIT fuser; Megatron-Hetero "
        "picks these kernels itself (Megatron-LM's defaults on GPUs, eager on the CPU)",
        "remove it"),
    "low_precision": Theme(
        "FP8 and FP4 training",
        "FP8/FP4 training needs transformer-engine on Hopper/Ada/Blackwell/MI300 GPUs"),
    "gpu_runtime": Theme(
        "GPU-only runtime tuning",
        "tunes CUDA/NCCL/transformer-engine internals (CUDA graphs, user buffers, SHARP, "
        "stream priorities, offloading) that Megatron-Hetero does not drive", "remove it"),
    "parallel_layout": Theme(
        "parallel layout (the plan decides)",
        "sets the pipeline or data-parallel layout, which the heterogeneous plan decides",
        "remove it; give per-stage layer counts and rank order in the plan (hetero-plan "
        "--hetero-plan plan.json)"),
    "fsdp": Theme("FSDP", "fully sharded data parallelism (Megatron-FSDP, torch FSDP2)",
                  "not supported yet - remove it; --use-distributed-optimizer shards optimizer state"),
    "moe": Theme(
        "MoE options beyond the supported set",
        "a mixture-of-experts option beyond --num-experts, --moe-router-topk, "
        "--moe-router-load-balancing-type, --moe-aux-loss-coeff, --moe-grouped-gemm, "
        "--moe-permute-fusion, --moe-router-fusion and --moe-token-dispatcher-type at "
        "expert-parallel size 1"),
    "mla": Theme("multi-latent attention", "multi-latent attention (DeepSeek's MLA)"),
    "attention_variants": Theme(
        "experimental attention variants",
        "an experimental attention variant (sparse/linear/windowed attention, softmax variants, "
        "QK clipping, attention gates)"),
    "model_variants": Theme(
        "model-architecture variants",
        "a model-architecture option Megatron-Hetero does not build yet (activation, residual, "
        "bias, RoPE-scaling, initialisation or multi-token-prediction variant)", "remove it"),
    "optimizer_variants": Theme(
        "optimizer and precision variants",
        "an optimizer or precision variant (Muon, CPU offload, precision-aware optimizer "
        "state, fp16 cross-entropy, special weight-decay rules) Megatron-Hetero does not "
        "build yet", "remove it"),
    "checkpoint_variants": Theme(
        "checkpoint variants",
        "a checkpointing mode beyond Megatron-Hetero's torch_dist save/load (non-persistent or "
        "local checkpoints, conversion, retention, checkpoint-args reuse)"),
    "data_variants": Theme(
        "dataset variants",
        "a dataset or data-loader mode beyond --data-path/--mock-data with --split (separate "
        "split paths, FIM, object storage, data-args files, loader types)"),
    "tokenizer_variants": Theme(
        "tokenizer options",
        "a tokenizer option beyond --tokenizer-type, --vocab-file, --merge-file, "
        "--tokenizer-model and --vocab-size"),
    "logging_variants": Theme(
        "logging options",
        "a logging or timing option Megatron-Hetero's logger does not produce", "remove it"),
    "profiling": Theme("profiling", "Megatron-LM's torch/nsys profiler hooks and memory snapshots",
                       "not supported yet - remove it; profile with megatron.hetero.profiling.compute"),
    "run_control": Theme(
        "run control", "a run-control option (signals, skipped iterations, batch-size "
        "adjustment, process-group set-up, NaN and gradient checks, test modes) "
        "Megatron-Hetero does not implement", "remove it"),
    "resilience": Theme(
        "fault tolerance and resilience",
        "needs NVIDIA's resilience packages (straggler detector, nvidia-resiliency-ext fault "
        "tolerance and in-process restart, rerun state machine, ADLR autoresume)",
        "not supported - remove it; Megatron-Hetero's watchdog reports a lost process and "
        "--save/--load resume the run"),
    "one_logger": Theme("one-logger", "NVIDIA's one-logger telemetry (the one_logger package)",
                        "not supported - remove it"),
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
}

# One message for a flag, where the theme's reason is not specific enough.
REASONS: dict[str, str] = {
    "--batch-size": "removed from Megatron-LM; use --micro-batch-size",
    "--warmup": "removed from Megatron-LM; use --lr-warmup-fraction or --lr-warmup-iters",
    "--model-parallel-size": "removed from Megatron-LM; use --tensor-model-parallel-size",
    "--checkpoint-activations": "removed from Megatron-LM; use --recompute-activations "
                                "(its replacement)",
    "--tiktoken-special-tokens": "deprecated alias of --tokenizer-special-tokens, which "
                                 "Megatron-Hetero does not build yet - remove it",
    "--no-weight-decay-cond-type": "deprecated alias of --apply-wd-to-qk-layernorm, which "
                                   "Megatron-Hetero does not build yet - remove it",
    "--enable-cuda-graph": "deprecated alias of --cuda-graph-impl local; CUDA graphs are not "
                           "supported - remove it",
    "--external-cuda-graph": "deprecated alias of --cuda-graph-impl transformer_engine; CUDA "
                             "graphs are not supported - remove it",
    "--expert-model-parallel-size": "expert parallelism (experts spread over ranks), which "
                                    "heterogeneous plans do not place: every replica holds all "
                                    "experts; remove it (Megatron-LM's default, "
                                    "--expert-model-parallel-size 1, is accepted)",
    "--tp-comm-overlap": "overlaps tensor-parallel communication with GEMMs through "
                         "transformer-engine's userbuffers, which Megatron-Hetero does not "
                         "initialise; remove it",
    "--use-legacy-models": "Megatron-LM's legacy (non-megatron-core) models are not supported; "
                           "Megatron-Hetero builds megatron-core's GPTModel - remove it",
}

# Flags arguments.py defines, because the runtime reads their value, but whose every value
# other than Megatron-LM's default is refused at start-up (validate_args, configure_performance):
# refused, under this theme. Given at the default they change nothing, as any refused flag.
DEFAULT_ONLY: dict[str, str] = {
    "--context-parallel-size": "context_parallel",
    "--expert-model-parallel-size": "moe",
    "--tp-comm-overlap": "overlap",
}

# Values of honoured flags that Megatron-LM accepts and Megatron-Hetero refuses, by name.
REFUSED_VALUES: dict[str, dict[str, str]] = {
    "--exit-signal": {name: "a process cannot catch this signal, so nothing could save on it; "
                            "use SIGTERM (Slurm's), SIGINT or SIGUSR1" for name in ("SIGKILL", "SIGSTOP")},
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
    "--ckpt-format": {
        value: "Megatron-Hetero writes and reads torch_dist checkpoints only; use "
               "--ckpt-format torch_dist" for value in ("torch", "torch_dcp", "fsdp_dtensor")},
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
}

_THEME_FLAGS: dict[str, tuple[str, ...]] = {
    "recompute": (
        "--distribute-saved-activations",
        "--moe-layer-recompute",
    ),
    "overlap": (
        "--overlap-param-gather-with-optimizer-step", "--tp-comm-overlap-cfg", "--tp-comm-overlap-rs-dgrad",
        "--no-tp-comm-bulk-wgrad", "--no-tp-comm-bulk-dgrad", "--no-tp-comm-overlap-ag",
        "--no-tp-comm-overlap-rs", "--no-tp-comm-split-ag", "--no-tp-comm-split-rs",
        "--tp-comm-bootstrap-backend", "--ddp-num-buckets",
        "--ddp-pad-buckets-for-high-nccl-busbw", "--ddp-reduce-scatter-with-fp32-accumulation",
        "--ddp-average-in-collective", "--delay-wgrad-compute",
        "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit",
    ),
    "pipeline_schedule": (
        "--microbatch-group-size-per-virtual-pipeline-stage",
        "--overlap-p2p-communication-warmup-flush", "--use-ring-exchange-p2p",
    ),
    "context_parallel": (
        "--hierarchical-context-parallel-sizes", "--cp-comm-type",
        "--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank",
    ),
    "kernels": (
        "--no-gradient-reduce-div-fusion", "--disable-jit-fuser",
    ),
    "low_precision": (
        "--fp8-format", "--fp8-recipe", "--fp8-quantizer-factory", "--fp8-margin",
        "--fp8-interval", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--no-fp8-wgrad",
        "--fp8-param-gather", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
        "--num-layers-at-end-in-bf16", "--fp4-format", "--fp4-recipe", "--fp4-param-gather",
        "--fp4-quantizer-factory", "--te-precision-config-file", "--keep-fp8-transpose-cache",
        "--reuse-grad-buf-for-mxfp8-param-ag", "--moe-router-padding-for-fp8",
        "--moe-router-padding-for-quantization",
    ),
    "gpu_runtime": (
        "--enable-cuda-graph", "--external-cuda-graph", "--cuda-graph-impl",
        "--cuda-graph-warmup-steps", "--cuda-graph-scope", "--te-rng-tracker",
        "--use-te-activation-func", "--disable-bf16-reduced-precision-matmul",
        "--symmetric-ar-type", "--use-nccl-ub", "--disable-symmetric-registration",
        "--fsdp-manual-registration", "--use-sharp", "--sharp-enabled-group",
        "--create-all-gather-group", "--nccl-communicator-config-path",
        "--pipeline-model-parallel-comm-backend", "--high-priority-stream-groups",
        "--cpu-offloading-num-layers",
        "--fine-grained-activation-offloading", "--offload-modules",
        "--min-offloaded-tensor-size", "--batch-invariant-mode",
        "--no-clone-scatter-output-in-embedding",
    ),
    "parallel_layout": (
        "--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split", "--use-tp-pp-dp-mapping",
        "--num-distributed-optimizer-instances",
       
    ),
    "fsdp": (
        "--use-megatron-fsdp", "--use-torch-fsdp2", "--data-parallel-sharding-strategy",
        "--outer-dp-sharding-strategy", "--fsdp-double-buffer",
        "--suggested-communication-unit-size", "--torch-fsdp2-no-reshard-after-forward",
        "--no-strict-fsdp-dtensor-load",
    ),
    "moe": (
        "--expert-tensor-parallel-size", "--moe-extended-tp", "--overlap-moe-expert-parallel-comm",
        "--ep-overlap-early-attn-memory-release", "--moe-shared-expert-intermediate-size",
        "--moe-shared-expert-gate", "--moe-shared-expert-overlap", "--moe-ffn-hidden-size",
        "--moe-enable-routing-replay", "--moe-router-num-groups", "--moe-router-group-topk",
        "--moe-router-pre-softmax", "--moe-router-topk-scaling-factor",
        "--moe-router-score-function", "--moe-router-dtype", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "--moe-router-force-load-balancing",
        "--moe-use-legacy-grouped-gemm", "--moe-z-loss-coeff", "--moe-input-jitter-eps",
        "--moe-enable-deepep", "--moe-flex-dispatcher-backend", "--moe-per-layer-logging",
        "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity",
        "--moe-token-drop-policy",
        "--moe-apply-probs-on-input", "--moe-latent-size", "--moe-deepep-num-sms",
        "--moe-hybridep-num-sms", "--moe-layer-freq", "--moe-use-upcycling",
        "--moe-upcycling-granularity", "--moe-pad-experts-for-cuda-graph-inference",
    ),
    "mla": (
        "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
        "--qk-pos-emb-head-dim", "--v-head-dim", "--rotary-scaling-factor", "--mscale",
        "--mscale-all-dim", "--cache-mla-latents",
    ),
    "attention_variants": (
        "--experimental-attention-variant", "--dsa-indexer-n-heads", "--dsa-indexer-head-dim",
        "--dsa-indexer-topk", "--dsa-indexer-loss-coeff", "--dsa-indexer-use-sparse-loss",
        "--linear-conv-kernel-dim", "--linear-key-head-dim", "--linear-value-head-dim",
        "--linear-num-key-heads", "--linear-num-value-heads", "--linear-attention-freq",
        "--window-size", "--window-attn-skip-freq", "--softmax-type", "--qk-l2-norm",
        "--qk-clip", "--qk-clip-alpha", "--qk-clip-threshold", "--attention-output-gate",
        "--log-max-attention-logit",
    ),
    "model_variants": (
        "--apply-residual-connection-post-layernorm", "--fp32-residual-connection",
        "--add-qkv-bias", "--glu-linear-offset", "--activation-func-clamp-value",
        "--openai-gelu", "--quick-geglu", "--use-fused-weighted-squared-relu",
        "--rotary-seq-len-interpolation-factor", "--use-rope-scaling", "--rope-scaling-factor",
        "--no-rope-freq", "--rope-type", "--mrope-section", "--relative-attention-num-buckets",
        "--relative-attention-max-distance", "--embedding-init-method-std",
        "--init-method-xavier-uniform", "--data-parallel-random-init", "--no-initialization",
        "--mtp-num-layers", "--mtp-loss-scaling-factor", "--mtp-standalone",
        "--encoder-num-layers", "--decoder-num-layers", "--encoder-seq-length",
        "--decoder-seq-length",
    ),
    "optimizer_variants": (
        "--muon-momentum", "--muon-no-split-qkv", "--muon-use-nesterov", "--muon-scale-mode",
        "--muon-fp32-matmul-prec", "--muon-num-ns-steps", "--muon-tp-mode",
        "--muon-extra-scale-factor", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
        "--use-torch-optimizer-for-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
        "--no-pin-cpu-grads", "--no-pin-cpu-params", "--dump-param-to-param-group-map",
        "--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype",
        "--exp-avg-dtype", "--exp-avg-sq-dtype", "--fp16-lm-cross-entropy",
        "--apply-wd-to-qk-layernorm",
        "--no-weight-decay-cond-type", 
    ),
    "checkpoint_variants": (
        "--save-wgrads-interval", "--save-dgrads-interval", "--save-retain-interval",
        "--load-main-params-from-ckpt", "--non-persistent-save-interval",
        "--non-persistent-ckpt-type", "--non-persistent-global-ckpt-dir",
        "--non-persistent-local-ckpt-dir", "--non-persistent-local-ckpt-algo",
        "--pretrained-checkpoint", "--use-checkpoint-args",
        "--use-mp-args-from-checkpoint-args", "--no-use-tokenizer-model-from-checkpoint-args",
        "--exit-on-missing-checkpoint", "--ckpt-convert-format", "--ckpt-convert-save",
        "--ckpt-convert-update-legacy-dist-opt-format", 
        "--ckpt-assume-constant-structure",
        "--dist-ckpt-save-pre-mcore-014", "--distrib-optim-fully-reshardable-mem-efficient",
        "--replication", "--replication-factor", "--no-save-optim", "--no-save-rng",
        "--override-opt_param-scheduler",
    ),
    "data_variants": (
        "--phase-transition-iterations", "--train-data-path", "--valid-data-path",
        "--test-data-path", "--data-args-path", "--per-split-data-args-path",
        "--per-dataset-sequences-path", "--dataloader-fast-cache-load",
        "--dataloader-defer-npy-index-mmap", "--num-dataset-builder-threads",
        "--object-storage-cache-path", "--mid-level-dataset-surplus",
        "--allow-ambiguous-pad-tokens", "--fim-data", "--fim-rate", "--fim-spm-rate",
        "--fim-split-sample", "--fim-fragment-rate", "--fim-no-prefix", "--fim-prefix-token",
        "--fim-middle-token", "--fim-suffix-token", "--fim-pad-token", "--fim-eod-token",
        "--dataloader-type", "--multiple-validation-sets", "--full-validation",
    ),
    "tokenizer_variants": (
        "--padded-vocab-size", "--vocab-extra-ids", "--tokenizer-metadata",
        "--tokenizer-special-tokens", "--legacy-tokenizer", "--tiktoken-special-tokens",
        "--tokenizer-sentencepiece-legacy", "--tokenizer-hf-use-fast",
        "--tokenizer-hf-include-special-tokens", "--trust-remote-code",
    ),
    "logging_variants": (
        "--log-progress", "--timing-log-option", "--log-device-memory-used", "--no-barrier-with-level-1-timing",
        "--logging-level", "--log-energy",
        "--config-logger-dir",
    ),
    "profiling": (
        "--profile", "--profile-step-start", "--profile-step-end", "--use-pytorch-profiler",
        "--profile-ranks", "--record-memory-history", "--memory-snapshot-path",
    ),
    "run_control": (
        "--exit-signal-handler-for-dataloader", "--iterations-to-skip",
        "--decrease-batch-size-if-needed", "--train-sync-interval",
        "--check-weight-hash-across-dp-replicas-interval", "--disable-gloo-process-groups",
        "--no-check-for-nan-in-loss-and-grad", "--check-for-large-grads", "--lazy-mpu-init",
        "--fake-process-group", "--distributed-timeout-seconds-after-init", "--test-mode",
    ),
    "resilience": (
        "--log-straggler", "--straggler-ctrlr-port", "--straggler-minmax-count",
        "--disable-straggler-on-startup", "--run-workload-inspector-server",
        "--inprocess-restart", "--inprocess-max-iterations", "--inprocess-monitor-thread-interval",
        "--inprocess-monitor-process-interval", "--inprocess-progress-watchdog-interval",
        "--inprocess-heartbeat-interval", "--inprocess-soft-timeout", "--inprocess-hard-timeout",
        "--inprocess-heartbeat-timeout", "--inprocess-barrier-timeout",
        "--inprocess-completion-timeout", "--inprocess-last-call-wait",
        "--inprocess-termination-grace-time", "--inprocess-granularity",
        "--inprocess-active-world-size", "--inprocess-empty-cuda-cache", "--enable-ft-package",
        "--calc-ft-timeouts", "--ft-num-warmup-iters", "--error-injection-rate",
        "--error-injection-type", "--rerun-mode", "--check-for-spiky-loss",
        "--result-rejected-tracker-filename", "--adlr-autoresume", "--adlr-autoresume-interval",
    ),
    "one_logger": (
        "--no-one-logger", "--one-logger-project", "--one-logger-run-name", "--one-logger-async",
        "--app-tag-run-name", "--app-tag-run-version",
    ),
    "kitchen": ("--use-kitchen-attention", "--kitchen-attention-backend"),
    "heterogeneous_layers": (
        "--heterogeneous-layers-config-path", "--heterogeneous-layers-config-encoded-json",
    ),
    "legacy": (
        "--use-legacy-models", "--yaml-cfg", "--spec", "--enable-experimental",
        "--init-model-with-meta-device", "--onnx-safe",
    ),
    "removed": ("--batch-size", "--warmup", "--model-parallel-size", "--checkpoint-activations"),
}

# Megatron-LM's argument groups that belong wholly to other programs.
OTHER_PROGRAM_GROUPS = ("rl", "vision", "biencoder", "inference", "sft", "modelopt-generic")
_OTHER_PROGRAM_FLAGS = (
    "--bert-no-binary-head", "--mask-prob", "--short-seq-prob", "--sample-rate",
    "--is-hybrid-model", "--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups",
    "--mamba-num-heads", "--disable-mamba-mem-eff-path", "--mlp-chunks-for-prefill",
    "--hybrid-attention-ratio", "--hybrid-mlp-ratio", "--hybrid-override-pattern",
    "--flash-decode", "--inference-rng-tracker", "--inference-fuse-tp-communication",
)


def theme_of_flags(group_of: dict[str, str]) -> dict[str, str]:
    """Each refused flag's theme; ``group_of`` maps a flag to its Megatron-LM group title
    (the groups of other programs are refused whole)."""
    themes = {flag: theme for theme, flags in _THEME_FLAGS.items() for flag in flags}
    for flag in _OTHER_PROGRAM_FLAGS:
        themes[flag] = "other_programs"
    for flag, group in group_of.items():
        if group in OTHER_PROGRAM_GROUPS and flag not in themes:
            themes[flag] = "other_programs"
    return themes


def noops() -> dict[str, str]:
    """Every no-op flag and why it has no effect."""
    return dict(NOOPS)


def duplicate_entries() -> list[str]:
    """Flags listed more than once across themes and no-ops."""
    seen: dict[str, int] = {}
    lists = [*_THEME_FLAGS.values(), _OTHER_PROGRAM_FLAGS, NOOPS]
    for flags in lists:
        for flag in flags:
            seen[flag] = seen.get(flag, 0) + 1
    return sorted(f for f, n in seen.items() if n > 1)


# ---- honoured flags whose default is not Megatron-LM's (tests check this list) ----------
DEFAULT_DIFFERENCES: dict[str, str] = {
    "--tensor-model-parallel-size": "none given: the plan decides (1 without a plan, as Megatron-LM)",
    "--pipeline-model-parallel-size": "none given: the plan decides (1 without a plan, as Megatron-LM)",
    "--transformer-impl": "none given: transformer_engine when it is installed (Megatron-LM's "
                          "default), else local",
    "--distributed-backend": "none given: nccl on GPUs (Megatron-LM's default), gloo on the CPU",
    "--local-rank": "none given: the LOCAL_RANK environment variable, as torchrun sets it",
    "--tokenizer-type": "none given: GPT2BPETokenizer, Megatron-LM's pretrain_gpt.py default "
                        "(set when the flags are validated)",
    "--eval-interval": "1000 (Megatron-LM core_v0.16.1 has no default and fails without it "
                       "when training by iterations; 1000 was its earlier default)",
}
