"""Builds this rank's stage of a megatron-core GPTModel from Megatron-LM flags and a plan."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hetero.errors import HeteroError
from hetero.model import ModelSpec
from hetero.plan import Plan
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
from megatron.hetero.tracing import TRACE
from megatron.hetero.weights import initialize_plan_independent

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_transformer_impl(args: argparse.Namespace) -> str:
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if transformer_engine_available() else "local"
    elif args.transformer_impl == "transformer_engine" and not transformer_engine_available():
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
        tensor_model_parallel_size=plan.tensor_parallel,
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
        # Fused kernels need a GPU; the unfused paths compute the same thing. Kernels that
        # need apex or transformer-engine builds (rope, persistent norm, fused wgrad) stay off.
        bias_activation_fusion=on_gpu
        and not (args.no_bias_swiglu_fusion if args.swiglu else args.no_bias_gelu_fusion),
        masked_softmax_fusion=on_gpu and not args.no_masked_softmax_fusion,
        bias_dropout_fusion=on_gpu and not args.no_bias_dropout_fusion,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
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
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )


def model_spec(args: argparse.Namespace) -> ModelSpec:
    # TODO(merge with the cost-model work): pass num_experts=args.num_experts and
    # moe_router_topk=args.moe_router_topk once ModelSpec has them, so the logged TFLOP/s
    # counts top-k experts for MoE runs.
    return ModelSpec(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.padded_vocab_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        swiglu=args.swiglu,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=args.add_bias_linear,
    )


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
) -> DistributedDataParallel:
    """This rank's stage, initialised independently of the plan, wrapped for DP."""
    stage = gpt_stage(args, config)
    initialize_plan_independent(stage, config, args.seed)
    if torch.cuda.is_available():
        stage.cuda(torch.cuda.current_device())
    if args.fp16 or args.bf16:
        stage = Float16Module(config, stage)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 or args.bf16,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=False,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=stage)
    config.finalize_model_grads_func = _traced_finalize_model_grads
    return model


def _traced_finalize_model_grads(*args, **kwargs):
    """megatron-core's gradient reduction across replicas (and tied embeddings), timed
    when an iteration is traced."""
    with TRACE.span("reduce"):
        return finalize_model_grads(*args, **kwargs)


def gpt_stage(args: argparse.Namespace, config: TransformerConfig) -> GPTModel:
    """The GPT layers of this pipeline stage (first/last stage add embedding/output)."""
    return GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
