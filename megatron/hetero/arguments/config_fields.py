"""Megatron-LM flags declared from its facts: megatron-core config fields, builder options,
logging switches and other names; their groups, their checks and derived defaults."""

from __future__ import annotations

import argparse
import logging
import os

from hetero.errors import HeteroError
from megatron.hetero import flags


# Megatron-LM flags whose whole effect is the megatron-core config field of the same name:
# Megatron-LM's core_transformer_config_from_args copies every args attribute named like a
# TransformerConfig (or MLATransformerConfig) field, and model.transformer_config does the
# same. Declared from Megatron-LM's facts (names, dest, default, value syntax): honouring
# such a flag is listing it here.
CONFIG_FIELD_FLAGS: dict[str, tuple[str, ...]] = {
    "model shape (megatron-core config fields)": (
        "--fp32-residual-connection", "--add-qkv-bias", "--glu-linear-offset", "--activation-func-clamp-value",
        "--embedding-init-method-std", "--qk-l2-norm", "--attention-output-gate",
        "--softmax-type", "--no-rope-freq", "--mrope-section", "--window-size",
        "--window-attn-skip-freq", "--disable-bf16-reduced-precision-matmul",
        "--no-clone-scatter-output-in-embedding", "--distribute-saved-activations",
        "--test-mode", "--no-barrier-with-level-1-timing", "--config-logger-dir",
        "--mtp-num-layers", "--mtp-loss-scaling-factor", "--use-fused-weighted-squared-relu",
        "--no-initialization",
        "--mlp-chunks-for-training",  # core_v0.19.0's
    ),
    "multi-latent attention (megatron-core MLATransformerConfig fields)": (
        "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
        "--qk-pos-emb-head-dim", "--v-head-dim", "--rope-type", "--rotary-scaling-factor",
        "--mscale", "--mscale-all-dim",
    ),
    "pipeline schedule (megatron-core config fields)": (
        "--microbatch-group-size-per-virtual-pipeline-stage", "--overlap-p2p-communication-warmup-flush",
    ),
    "optimizer (megatron-core config fields)": (
        "--apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type", "--overlap-param-gather-with-optimizer-step",
    ),
    "mixture of experts (megatron-core config fields)": (
        "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
        "--moe-shared-expert-gate", "--moe-layer-freq", "--moe-router-score-function",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
        "--moe-router-topk-scaling-factor", "--moe-router-num-groups", "--moe-router-group-topk",
        "--moe-router-pre-softmax", "--moe-router-dtype", "--moe-router-force-load-balancing",
        "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity",
        "--moe-token-drop-policy", "--moe-z-loss-coeff", "--moe-input-jitter-eps",
        "--moe-apply-probs-on-input", "--moe-layer-recompute", "--moe-enable-routing-replay",
    ),
}


# Megatron-LM flags that its pretrain_gpt.py passes unchanged to megatron-core's tokenizer
# and dataset builders (build_tokenizer(args), GPTDatasetConfig); data.py does the same. A tag
# lacking a flag leaves it out (flags.declare); core_v0.19.0 renamed the two --tokenizer-hf-*
# switches into their negations (flags/later_tags.py reads them by the old dests too).
DATA_BUILDER_FLAGS = (
    "--tokenizer-metadata", "--tokenizer-special-tokens", "--tiktoken-special-tokens",
    "--tokenizer-hf-include-special-tokens", "--tokenizer-sentencepiece-legacy",
    "--trust-remote-code", "--num-dataset-builder-threads", "--object-storage-cache-path",
    "--mid-level-dataset-surplus", "--allow-ambiguous-pad-tokens", "--dataloader-fast-cache-load",
    "--dataloader-defer-npy-index-mmap", "--per-dataset-sequences-path",
    # core_v0.19.0's
    "--tokenizer-hf-no-use-fast", "--tokenizer-hf-no-include-special-tokens",
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces", "--chat-template",
    "--null-tokenizer-eod-id", "--null-tokenizer-pad-id",  # read by data.NullTokenizer
)

# Megatron-LM flags that its gpt_builders passes to megatron-core's GPTModel (or, for
# --quick-geglu, turns into the config's activation); model.py does the same.
MODEL_BUILDER_FLAGS = ("--use-rope-scaling", "--fp16-lm-cross-entropy", "--quick-geglu")
# Megatron-LM's logging switches that the runtime applies as Megatron-LM does.
LOGGING_FLAGS = ("--logging-level", "--timing-log-option")
# Megatron-LM's other names of --num-layers and --seq-length (used when those are not given).
ALIAS_FLAGS = {"--encoder-num-layers": "num_layers", "--encoder-seq-length": "seq_length"}


def _add_config_field_args(parser: argparse.ArgumentParser) -> None:
    for title, names in CONFIG_FIELD_FLAGS.items():
        flags.declare(parser.add_argument_group(title), names)
    flags.declare(parser.add_argument_group("model (megatron-core GPTModel arguments)"), MODEL_BUILDER_FLAGS)
    flags.declare(parser.add_argument_group("data and tokenizer (megatron-core builders' options)"),
                  DATA_BUILDER_FLAGS)
    flags.declare(parser.add_argument_group("model (Megatron-LM's other names)"), tuple(ALIAS_FLAGS))
    flags.declare(parser.add_argument_group("logging (Megatron-LM's switches)"), LOGGING_FLAGS)


def apply_logging_level(args: argparse.Namespace) -> None:
    """Megatron-LM's setup_logging: the root logger's level from --logging-level, else the
    MEGATRON_LOGGING_LEVEL environment variable; unchanged when neither is given."""
    level = args.logging_level
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.getLogger().setLevel(level)


def _resolve_aliases(args: argparse.Namespace) -> None:
    """--encoder-num-layers/--encoder-seq-length stand for --num-layers/--seq-length, as in
    Megatron-LM's validate_args (giving both is an error there too)."""
    for alias, dest in ALIAS_FLAGS.items():
        value = getattr(args, alias[2:].replace("-", "_"))
        if value is None:
            continue
        if getattr(args, dest) is not None:
            raise HeteroError(f"{alias} and --{dest.replace('_', '-')} name the same setting; give one")
        setattr(args, dest, value)


def _validate_config_fields(args: argparse.Namespace) -> None:
    """Megatron-LM's checks and derived defaults of the flags declared from its facts."""
    if args.quick_geglu and (args.swiglu or args.squared_relu):
        raise HeteroError("--quick-geglu is an activation, as --swiglu and --squared-relu are; pick one")
    if args.fp16_lm_cross_entropy and not args.fp16:
        raise HeteroError("--fp16-lm-cross-entropy needs --fp16 (as in Megatron-LM)")
    if args.fp32_residual_connection and not (args.fp16 or args.bf16):
        raise HeteroError("--fp32-residual-connection needs --fp16 or --bf16 (as in Megatron-LM)")
    if args.add_bias_linear:
        args.add_qkv_bias = True  # Megatron-LM keeps the two in sync
    for name, given in (("--dataloader-fast-cache-load", args.dataloader_fast_cache_load),
                        ("--dataloader-defer-npy-index-mmap", args.dataloader_defer_npy_index_mmap)):
        if given and args.data_cache_path is None:  # megatron-core's dataset config asserts it
            raise HeteroError(f"{name} needs --data-cache-path DIR (the index cache it reads)")
    if args.no_weight_decay_cond_type == "apply_wd_to_qk_layernorm":
        args.apply_wd_to_qk_layernorm = True  # its deprecated spelling, as in Megatron-LM
    if args.tiktoken_special_tokens and not args.tokenizer_special_tokens:
        args.tokenizer_special_tokens = args.tiktoken_special_tokens  # its deprecated alias
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.overlap_param_gather_with_optimizer_step and not (args.use_distributed_optimizer
                                                               and args.overlap_param_gather):
        raise HeteroError("--overlap-param-gather-with-optimizer-step gathers the distributed optimizer's "
                          "updated shards during its step: it needs --use-distributed-optimizer and "
                          "--overlap-param-gather (as in Megatron-LM)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise HeteroError("--override-opt_param-scheduler (the flags' schedule) and "
                          "--use-checkpoint-opt_param-scheduler (the checkpoint's): give one")
    if args.fp16 and not args.loss_scale:
        # As Megatron-LM: dynamic loss scaling reads NaN/Inf gradients as its signal to back off.
        args.check_for_nan_in_loss_and_grad = False
    if args.ddp_num_buckets is not None and (args.ddp_bucket_size is not None or args.ddp_num_buckets < 1):
        raise HeteroError("--ddp-num-buckets must be a positive count, and not given with --ddp-bucket-size "
                          "(both size the buckets); give one of them")
    for name in ("train_sync_interval", "distributed_timeout_seconds_after_init",
                 "check_weight_hash_across_dp_replicas_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise HeteroError(f"--{name.replace('_', '-')} must be at least 1")
