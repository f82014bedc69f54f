"""What Megatron-Hetero does with each Megatron-LM flag arguments/ does not define.

A flag of Megatron-LM's pretrain_gpt.py (megatron_lm_flags.json) is honoured when
arguments/ defines it; every other flag is listed here exactly once:

- ``NOOPS`` (and ``noops()``): accepted, no effect, because Megatron-LM itself ignores it
  (deprecated, read nowhere, or overridden by its validate_args in every run we can make);
- a theme of ``THEMES``: refused by name, with what the feature is and what to do
  (``REASONS`` where one flag needs its own words).

``DEFAULT_ONLY`` lists flags arguments/ defines (the runtime reads their value) whose
every value but Megatron-LM's default is refused at start-up: they count as refused.
``REFUSED_VALUES`` lists values of honoured flags that Megatron-LM accepts and we refuse.
``DEFAULT_DIFFERENCES`` lists honoured flags whose default is not Megatron-LM's.

rules.check_registry names any flag that is both honoured and listed here, or neither.
"""

from __future__ import annotations

from dataclasses import dataclass

# Flags of ours that Megatron-LM does not have.
HETERO_FLAGS = ("--hetero-plan", "--hetero-adapt", "--hetero-adapt-output", "--hetero-snapshot-replicas",
                "--hetero-allow-untested-megatron-core", "--local_rank")


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
    # Only for the flags of a later Megatron-LM tag than the reference one (flags/rules.py):
    # every flag of the reference tag has a ruling of its own.
    "unreviewed": Theme("newer Megatron-LM flags not supported yet",
                        "a flag Megatron-LM added after core_v0.16.1 that Megatron-Hetero does not "
                        "implement yet", "not supported yet - remove it"),
}

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
                 "--linear-value-head-dim")},
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
}

_THEME_FLAGS: dict[str, tuple[str, ...]] = {
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
    ),
    "parallel_layout": (
        "--num-distributed-optimizer-instances",
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
    ),
    "optimizer_variants": (
        "--optimizer-cpu-offload",
        "--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype",
        "--exp-avg-dtype", "--exp-avg-sq-dtype",
    ),
    "checkpoint_variants": (
        "--save-wgrads-interval", "--save-dgrads-interval",
        "--load-main-params-from-ckpt",
        "--non-persistent-local-ckpt-dir", "--non-persistent-local-ckpt-algo",
        "--ckpt-convert-update-legacy-dist-opt-format",
        "--distrib-optim-fully-reshardable-mem-efficient",
        "--replication",
    ),
    "data_variants": (
        "--phase-transition-iterations", "--fim-data",
        "--multiple-validation-sets",
    ),
    "tokenizer_variants": (
        "--padded-vocab-size", "--vocab-extra-ids",
        "--legacy-tokenizer",
    ),
    "logging_variants": (
        "--log-energy",
    ),
    "run_control": (
        "--check-for-large-grads", "--lazy-mpu-init", "--fake-process-group",
    ),
    "resilience": (
        "--log-straggler",
        "--run-workload-inspector-server",
        "--enable-ft-package",
        "--error-injection-rate",
        "--error-injection-type", "--check-for-spiky-loss",
        "--result-rejected-tracker-filename", "--adlr-autoresume",
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
}

# Megatron-LM's argument groups that belong wholly to other programs.
OTHER_PROGRAM_GROUPS = ("rl", "vision", "biencoder", "inference", "sft", "modelopt-generic")
_OTHER_PROGRAM_FLAGS = ("--is-hybrid-model", "--inference-rng-tracker")


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
