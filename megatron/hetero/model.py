"""Builds this rank's stage of a megatron-core GPTModel from Megatron-LM flags and a plan
(called by startup.build_model)."""

from __future__ import annotations

import argparse
import dataclasses
import weakref

import torch
import torch.nn.functional as F

from hetero.errors import HeteroError
from hetero.spec.model import ModelSpec
from hetero.plan import Plan
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.hetero import stage_tensor_parallel, template_reduction
from megatron.hetero.arguments import config_from_flags, honoured_config_values
from megatron.hetero.performance import ddp_fields, transformer_engine_on_gpu, transformer_fields
from megatron.hetero.identity import compute_device
from megatron.hetero.tracing import BUSY, TRACE
from megatron.hetero.weights import initialize_plan_independent

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_transformer_impl(args: argparse.Namespace) -> str:
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if transformer_engine_on_gpu() else "local"
    elif args.transformer_impl == "transformer_engine" and not transformer_engine_on_gpu():
        raise HeteroError(
            "--transformer-impl transformer_engine needs transformer-engine and a GPU; "
            "install it, or use --transformer-impl local"
        )
    return args.transformer_impl


# Config fields the plan and the runtime decide per stage (this stage's recomputation, its
# tensor-parallel degree, ...): never copied from the flags, even where a stage sets none.
_PLAN_DECIDED = frozenset({
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "sequence_parallel", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "overlap_p2p_comm",
    # In the plan's pipeline layout (megatron-core refuses them beside a layout).
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
})


def transformer_config(args: argparse.Namespace, plan: Plan) -> TransformerConfig:
    """Megatron-LM's rule (core_transformer_config_from_args): every honoured flag whose dest
    is a TransformerConfig field (MLATransformerConfig's under --multi-latent-attention) is
    copied into it; the fields below, which the plan and the
    runtime decide or which need translating, take precedence."""
    config_class = _check_multi_latent_attention(args)
    fields = {field.name for field in dataclasses.fields(config_class)}
    copied = {name: value for name, value in honoured_config_values(args, fields).items()
              if name not in _PLAN_DECIDED}
    if args.rope_type is None:
        copied.pop("rope_type", None)  # as Megatron-LM: the config's default (MLA's is yarn)
    try:
        config = config_class(**{**copied, **_decided_fields(args, plan)})
    except (ValueError, AssertionError) as error:  # megatron-core's own checks of the flags
        raise HeteroError(f"megatron-core rejects this model's flags: {error}") from None
    _check_runs_without_gpu(config)
    if config.mtp_num_layers and args.position_embedding_type not in ("rope", "none"):
        raise HeteroError(f"--mtp-num-layers with --position-embedding-type {args.position_embedding_type}: "
                          "Megatron-LM runs multi-token prediction with rope or none position embeddings "
                          "only (its validate_args); use --position-embedding-type rope")
    return config


def _check_multi_latent_attention(args: argparse.Namespace) -> type[TransformerConfig]:
    """The config class Megatron-LM's core_transformer_config_from_args picks, with its checks
    of the MLA flags: MLATransformerConfig under --multi-latent-attention."""
    if not args.multi_latent_attention:
        if args.rope_type not in (None, "rope"):
            raise HeteroError(f"--rope-type {args.rope_type} is multi-latent attention's (its yarn RoPE); "
                              "without --multi-latent-attention, RoPE is --position-embedding-type rope")
        return TransformerConfig
    if args.group_query_attention:
        raise HeteroError("--multi-latent-attention and --group-query-attention both shape the keys and "
                          "values (MLA compresses them into --kv-lora-rank); give one")
    if args.qk_l2_norm:
        raise HeteroError("--qk-l2-norm is not supported with --multi-latent-attention (megatron-core's "
                          "MLA layers have no L2 norm of queries and keys); drop one of them")
    return MLATransformerConfig


def _check_runs_without_gpu(config: TransformerConfig) -> None:
    """megatron-core layers that need a GPU, named before they fail deep inside the build."""
    if torch.cuda.is_available():
        return
    if config.fp32_residual_connection and (config.bf16 or config.fp16):
        raise HeteroError("--fp32-residual-connection with --bf16/--fp16 needs a GPU: megatron-core's "
                          "local layer norm on the CPU cannot take fp32 input with 16-bit weights")


def _decided_fields(args: argparse.Namespace, plan: Plan) -> dict:
    on_gpu = torch.cuda.is_available()
    params_dtype = _DTYPES[args.params_dtype]
    return dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        qk_layernorm=args.qk_layernorm,
        gated_linear_unit=args.swiglu or args.quick_geglu,
        activation_func=_activation(args),
        rotary_interleaved=args.rotary_interleaved,
        deterministic_mode=args.deterministic_mode,
        **_moe_config(args),
        add_bias_linear=args.add_bias_linear,
        init_method_std=args.init_method_std,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        tensor_model_parallel_size=plan.stage_tensor_parallel[parallel_state.get_pipeline_model_parallel_rank()],
        pipeline_model_parallel_size=plan.pipeline_parallel,
        context_parallel_size=plan.context_parallel,
        pipeline_model_parallel_layout=(plan.pipeline_layout(args.mtp_num_layers or 0)
                                        if plan.pipeline_parallel > 1 else None),
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        use_cpu_initialization=args.use_cpu_initialization or not on_gpu,
        # Replicas run different micro-batch counts; weighting by tokens keeps the update
        # equal to one homogeneous run over the same global batch.
        calculate_per_token_loss=True,
        # Sequence parallelism, this stage's recomputation, the virtual stages, Megatron-LM's
        # default fusions where their kernels exist: megatron.hetero.performance.
        **transformer_fields(args, plan, parallel_state.get_pipeline_model_parallel_rank(),
                             resolve_transformer_impl(args)),
    )


def _activation(args: argparse.Namespace):
    if args.swiglu:
        return F.silu
    if args.quick_geglu:
        from megatron.core.activations import quick_gelu

        return quick_gelu
    if args.squared_relu:
        from megatron.core.activations import squared_relu

        return squared_relu
    return F.gelu


def _moe_config(args: argparse.Namespace) -> dict:
    """--num-experts under its TransformerConfig name (the other MoE flags share theirs and
    are copied with every honoured config field)."""
    return {} if args.num_experts is None else {"num_moe_experts": args.num_experts}


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The model these flags build, as the planner describes models."""
    return ModelSpec.from_megatron_args(args)


def _layer_spec(args: argparse.Namespace, config: TransformerConfig, vp_stage: int | None):
    """As Megatron-LM's gpt_builders: with experts, megatron-core's decoder block spec (dense
    and MoE layers as --moe-layer-freq says, this stage's layers only); else one layer spec."""
    use_te = resolve_transformer_impl(args) == "transformer_engine"
    mla = args.multi_latent_attention
    if args.num_experts:  # the block spec reads config.multi_latent_attention
        return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                          normalization=args.normalization,
                                          qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
            qk_layernorm=args.qk_layernorm, multi_latent_attention=mla, qk_l2_norm=args.qk_l2_norm)
    return get_gpt_layer_local_spec(
        num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm,
        multi_latent_attention=mla, normalization=args.normalization, qk_l2_norm=args.qk_l2_norm)


# The DDP-wrapped chunks built in this process (weakly: a chunk no one holds goes).
_BUILT: "weakref.WeakSet[DistributedDataParallel]" = weakref.WeakSet()


def release_models() -> None:
    """Lets the models this process built go (in-process restart, before the next plan's).
    megatron-core's DDP registers a hook on each parameter's gradient accumulator, a closure
    over the DDP object and the parameter, and autograd keeps the accumulator (and with it the
    hook) from C++, where Python's collector cannot see it: every earlier plan's model,
    optimizer and process groups (their sockets, pipes and memory) would stay alive. The
    hooks' closures are emptied (they never run again: the model is done)."""
    import gc

    for chunk in list(_BUILT):
        chunk.grad_accs.clear()
        for cell in [r for r in gc.get_referrers(chunk) if type(r).__name__ == "cell"]:
            for closure in gc.get_referrers(cell):
                if isinstance(closure, tuple) and all(type(c).__name__ == "cell" for c in closure):
                    for member in closure:
                        member.cell_contents = None
    _BUILT.clear()


def build_model(
    args: argparse.Namespace, plan: Plan, config: TransformerConfig
) -> list[DistributedDataParallel]:
    """This rank's model chunks (one per virtual stage, else one), initialised independently
    of the plan, each wrapped for DP."""
    stages = []
    for vp_stage in range(plan.virtual_pipeline_size or 1):
        stage = gpt_stage(args, config, vp_stage if plan.virtual_pipeline_size else None)
        if config.perform_initialization:  # --no-initialization: megatron-core drew nothing either
            initialize_plan_independent(stage, config, args.seed)
        stages.append(stage)
    if args.overlap_param_gather_with_optimizer_step and plan.virtual_pipeline_size is None:
        raise HeteroError("--overlap-param-gather-with-optimizer-step runs with the interleaved schedule "
                          "only (megatron-core overlaps the first model chunk's gather with the step); add "
                          "--num-virtual-stages-per-pipeline-rank or give the plan's stages virtual_stages")
    # Megatron-LM's rule: every honoured flag named like a DDP config field, then ours.
    fields = {**ddp_fields(args, plan.data_parallel), **megatron_ddp_fields(args, stages)}
    templated = template_reduction.active()
    if templated:  # the templates' reduction replaces DDP's (and overlaps itself, if asked)
        fields.update(overlap_grad_reduce=False, bucket_size=None)
    ddp_config = config_from_flags(DistributedDataParallelConfig, args, **fields)
    chunks = []
    for vp_stage, stage in enumerate(stages):
        if torch.cuda.is_available():
            stage.cuda(compute_device())
        if args.fp16 or args.bf16:
            stage = Float16Module(config, stage)
        # As Megatron-LM: chunks after the first reduce in one bucket each; their reduction
        # overlaps the other chunks' backward anyway (every chunk with the gather overlapped
        # with the optimizer step).
        chunks.append(DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=stage,
            disable_bucketing=vp_stage > 0 or args.overlap_param_gather_with_optimizer_step))
    if args.data_parallel_random_init:
        # As Megatron-LM: every replica starts from replica 0's weights (here they are drawn
        # the same anyway, by parameter name), whatever its own random stream.
        for chunk in chunks:
            chunk.broadcast_params()
    _BUILT.update(chunks)
    config.finalize_model_grads_func = _traced_finalize_model_grads
    _set_schedule_sync_functions(args, config, chunks, templated)
    # Several templates: every parameter's gradient reduced over every template's holders.
    template_reduction.install(chunks, config.sequence_parallel, config.qk_layernorm, args.overlap_grad_reduce)
    return chunks


def megatron_ddp_fields(args: argparse.Namespace, stages: list[torch.nn.Module]) -> dict:
    """The DistributedDataParallelConfig fields Megatron-LM's get_model sets from flags of
    other names: NaN/Inf checks of the gradients before their reduction (on GPUs, unless
    --no-check-for-nan-in-loss-and-grad), bucket padding and fp32 reduce-scatter accumulation,
    and --ddp-num-buckets (this rank's parameters over that many buckets)."""
    fields = {
        # On the CPU megatron-core's report of a NaN gradient fails on torch.cuda before it says
        # so; there the loss check (training.checked_forward_step) stops the run instead, at
        # the next forward at the latest.
        "check_for_nan_in_grad": args.check_for_nan_in_loss_and_grad and torch.cuda.is_available(),
        "pad_buckets_for_high_nccl_busbw": args.ddp_pad_buckets_for_high_nccl_busbw,
        "reduce_scatter_with_fp32_accumulation": args.ddp_reduce_scatter_with_fp32_accumulation,
    }
    if args.ddp_num_buckets is not None:
        parameters = sum(p.numel() for stage in stages for p in stage.parameters())
        fields["bucket_size"] = parameters // args.ddp_num_buckets
    return fields


def _set_schedule_sync_functions(args: argparse.Namespace, config: TransformerConfig,
                                 chunks: list[DistributedDataParallel], templated: bool = False) -> None:
    """What Megatron-LM's setup_model_and_optimizer hands the schedule for overlapped
    reduction: the schedule holds back the DDP hooks (no_sync) until each replica's own
    last micro-batch, then every bucket's reduction starts as its gradients are done."""

    def per_chunk(functions: list):
        return functions[0] if len(functions) == 1 else functions

    if args.overlap_grad_reduce and not templated:  # templates: template_reduction counts micro-batches
        config.no_sync_func = per_chunk([chunk.no_sync for chunk in chunks])
        if args.align_grad_reduce:
            config.grad_sync_func = per_chunk([chunk.start_grad_sync for chunk in chunks])
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = per_chunk([chunk.start_param_sync for chunk in chunks])


def _traced_finalize_model_grads(*args, **kwargs):
    """megatron-core's gradient reduction across replicas (and tied embeddings), where the
    busy time of the iteration ends (timed when an iteration is traced)."""
    BUSY.reduction_starts()
    with TRACE.span("reduce"):
        if template_reduction.active():
            return template_reduction.finalize_model_grads(*args, **kwargs)
        if stage_tensor_parallel.active_plan() is not None:
            return stage_tensor_parallel.finalize_model_grads_on_plan_grid(finalize_model_grads, *args, **kwargs)
        return finalize_model_grads(*args, **kwargs)


def gpt_stage(args: argparse.Namespace, config: TransformerConfig, vp_stage: int | None = None) -> GPTModel:
    """The GPT layers of this pipeline stage, or of its virtual stage vp_stage (the model's
    first/last stage adds embedding/output)."""
    layer_spec = _layer_spec(args, config, vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        mtp_block_spec=_mtp_block_spec(args, config, layer_spec, vp_stage),
        vp_stage=vp_stage,
    )


def _mtp_block_spec(args: argparse.Namespace, config: TransformerConfig, layer_spec, vp_stage: int | None):
    """--mtp-num-layers: megatron-core's multi-token-prediction block, its layers shaped like
    the decoder's last layer (as Megatron-LM's gpt_builders)."""
    if config.mtp_num_layers is None:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

    use_te = resolve_transformer_impl(args) == "transformer_engine"
    if hasattr(layer_spec, "layer_specs"):  # the MoE block spec: its last layer, as in Megatron-LM
        layer_spec = get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te,
                                                 normalization=args.normalization,
                                                 qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)[-1]
    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=use_te, vp_stage=vp_stage)


def count_parameters(model_chunks: list[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in model_chunks for p in chunk.parameters())
