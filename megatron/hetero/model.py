"""Builds this rank's stage of a megatron-core GPTModel from Megatron-LM flags and a plan
(called by startup.build_model)."""

from __future__ import annotations

import argparse

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
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.hetero import stage_tensor_parallel
from megatron.hetero.performance import ddp_fields, transformer_engine_on_gpu, transformer_fields
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


def transformer_config(args: argparse.Namespace, plan: Plan) -> TransformerConfig:
    on_gpu = torch.cuda.is_available()
    params_dtype = _DTYPES[args.params_dtype]
    return TransformerConfig(
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
        gated_linear_unit=args.swiglu,
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
        pipeline_model_parallel_layout=plan.pipeline_layout() if plan.pipeline_parallel > 1 else None,
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
    if args.squared_relu:
        from megatron.core.activations import squared_relu

        return squared_relu
    return F.gelu


def _moe_config(args: argparse.Namespace) -> dict:
    """Megatron-LM's MoE flags as TransformerConfig fields (none for a dense model)."""
    if args.num_experts is None:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_permute_fusion=args.moe_permute_fusion,
        moe_router_fusion=args.moe_router_fusion,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The model these flags build, as the planner describes models."""
    return ModelSpec.from_megatron_args(args)


def _layer_spec(args: argparse.Namespace):
    if resolve_transformer_impl(args) == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
            qk_layernorm=args.qk_layernorm)
    return get_gpt_layer_local_spec(
        num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
        qk_layernorm=args.qk_layernorm, normalization=args.normalization)


def build_model(
    args: argparse.Namespace, plan: Plan, config: TransformerConfig
) -> list[DistributedDataParallel]:
    """This rank's model chunks (one per virtual stage, else one), initialised independently
    of the plan, each wrapped for DP."""
    ddp_config = DistributedDataParallelConfig(**ddp_fields(args, plan.data_parallel))
    chunks = []
    for vp_stage in range(plan.virtual_pipeline_size or 1):
        stage = gpt_stage(args, config, vp_stage if plan.virtual_pipeline_size else None)
        initialize_plan_independent(stage, config, args.seed)
        if torch.cuda.is_available():
            stage.cuda(torch.cuda.current_device())
        if args.fp16 or args.bf16:
            stage = Float16Module(config, stage)
        # As Megatron-LM: chunks after the first reduce in one bucket each; their reduction
        # overlaps the other chunks' backward anyway.
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=stage,
                                              disable_bucketing=vp_stage > 0))
    config.finalize_model_grads_func = _traced_finalize_model_grads
    _set_schedule_sync_functions(args, config, chunks)
    return chunks


def _set_schedule_sync_functions(args: argparse.Namespace, config: TransformerConfig,
                                 chunks: list[DistributedDataParallel]) -> None:
    """What Megatron-LM's setup_model_and_optimizer hands the schedule for overlapped
    reduction: the schedule holds back the DDP hooks (no_sync) until each replica's own
    last micro-batch, then every bucket's reduction starts as its gradients are done."""

    def per_chunk(functions: list):
        return functions[0] if len(functions) == 1 else functions

    if args.overlap_grad_reduce:
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
        if stage_tensor_parallel.active_plan() is not None:
            return stage_tensor_parallel.finalize_model_grads_on_plan_grid(finalize_model_grads, *args, **kwargs)
        return finalize_model_grads(*args, **kwargs)


def gpt_stage(args: argparse.Namespace, config: TransformerConfig, vp_stage: int | None = None) -> GPTModel:
    """The GPT layers of this pipeline stage, or of its virtual stage vp_stage (the model's
    first/last stage adds embedding/output)."""
    return GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
    )


def count_parameters(model_chunks: list[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in model_chunks for p in chunk.parameters())
