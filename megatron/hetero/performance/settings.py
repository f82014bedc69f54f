"""The performance features as megatron-core settings, and what the start-up log says.

Each stage's TransformerConfig fields (sequence parallelism, the interleaved schedule, its
recomputation, the fused kernels this process runs) and the DistributedDataParallelConfig
fields, decided the way Megatron-LM's core_transformer_config_from_args decides them, from
flags already checked against the plan (checks.py).
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass

import torch

from hetero.plan import Plan
from hetero.plan_entries import RecomputeEntry


def transformer_engine_on_gpu() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def local_attention(args: argparse.Namespace, have_te: bool) -> bool:
    """Whether the layers use megatron-core's own attention (its local layer spec)."""
    return args.transformer_impl == "local" or (args.transformer_impl is None and not have_te)


# ----- TransformerConfig fields -----------------------------------------------------------


def recompute_fields(args: argparse.Namespace, plan: Plan, pp_rank: int) -> dict:
    """Stage pp_rank's recomputation: the plan's stages[pp_rank].recompute, else the flags."""
    setting = plan.stages[pp_rank].recompute_setting()
    if setting == "flags":
        if args.recompute_granularity is None:
            return {}
        setting = RecomputeEntry(granularity=args.recompute_granularity, method=args.recompute_method,
                                 num_layers=args.recompute_num_layers, modules=args.recompute_modules)
    if setting is None:
        return {}
    fields = {"recompute_granularity": setting.granularity, "recompute_method": setting.method,
              "recompute_num_layers": setting.num_layers}
    if setting.modules is not None:
        fields["recompute_modules"] = setting.modules
    return fields


def describe_recompute(fields: dict) -> str:
    if not fields:
        return "none"
    if fields["recompute_granularity"] == "selective":
        return f"selective ({', '.join(fields.get('recompute_modules') or ['core_attn'])})"
    return f"full, {fields['recompute_method']}, {fields['recompute_num_layers']} layer(s)"


@dataclass(frozen=True)
class Fusions:
    """Megatron-LM's fused kernels and whether this run uses each (with why not)."""

    bias_activation_fusion: bool
    masked_softmax_fusion: bool
    bias_dropout_fusion: bool
    apply_rope_fusion: bool
    persist_layer_norm: bool
    gradient_accumulation_fusion: bool
    notes: tuple[str, ...] = ()

    def config_fields(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "notes"}

    def describe(self) -> str:
        on = [name for name, value in self.config_fields().items() if value]
        text = ", ".join(on) if on else "none"
        return text + (f" ({'; '.join(self.notes)})" if self.notes else "")


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _fused_rope_available() -> bool:
    from megatron.core.models.common.embeddings import rope_utils

    return getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None


def megatron_fusions(args: argparse.Namespace, transformer_impl: str) -> Fusions:
    """The fused kernels this process runs: none on the CPU, Megatron-LM's on a GPU."""
    if not torch.cuda.is_available():
        return Fusions(False, False, False, False, False, False, ("no GPU: no fused kernels",))
    available = {"rope": _fused_rope_available(),
                 "fused_weight_gradient_mlp_cuda": _module_exists("fused_weight_gradient_mlp_cuda"),
                 "apex": _module_exists("apex"),
                 "scaled_masked_softmax_cuda": _module_exists("scaled_masked_softmax_cuda")}
    return gpu_fusions(args, transformer_impl, available)


def gpu_fusions(args: argparse.Namespace, transformer_impl: str, available: dict[str, bool]) -> Fusions:
    """Megatron-LM's defaults on a GPU: every fusion on unless its --no-... flag is given,
    then turned off by the same rules as its validate_args (bias-GeLU without biases, RoPE
    fusion without RoPE). Where Megatron-LM would stop because the kernel's package is
    missing (``available``: transformer-engine's fused RoPE, apex's wgrad kernel and fused
    norm, Megatron-LM's compiled masked-softmax kernels), the fusion is off and noted."""
    notes = []
    if args.swiglu:
        bias_activation = not args.no_bias_swiglu_fusion
    else:
        bias_activation = not args.no_bias_gelu_fusion and args.add_bias_linear
    rope = args.position_embedding_type == "rope" and not args.no_rope_fusion
    if rope and not available["rope"]:
        rope = False
        notes.append("RoPE fusion needs transformer-engine")
    local = transformer_impl == "local"
    grad_accumulation = not args.no_gradient_accumulation_fusion
    if grad_accumulation and local and not available["fused_weight_gradient_mlp_cuda"]:
        grad_accumulation = False
        notes.append("gradient-accumulation fusion needs apex's fused_weight_gradient_mlp_cuda")
    # megatron-core's local attention imports Megatron-LM's compiled softmax kernels at its
    # first fp16/bf16 forward and stops there if they were never built.
    masked_softmax = not args.no_masked_softmax_fusion
    if masked_softmax and local and not available["scaled_masked_softmax_cuda"]:
        masked_softmax = False
        notes.append("masked-softmax fusion needs Megatron-LM's scaled_masked_softmax_cuda kernels")
    persist = not args.no_persist_layer_norm
    if persist and local and not available["apex"]:
        persist = False
        notes.append("persistent layer norm needs apex")
    return Fusions(
        bias_activation_fusion=bias_activation,
        masked_softmax_fusion=masked_softmax,
        bias_dropout_fusion=not args.no_bias_dropout_fusion,
        apply_rope_fusion=rope,
        persist_layer_norm=persist,
        gradient_accumulation_fusion=grad_accumulation,
        notes=tuple(notes),
    )


def transformer_fields(args: argparse.Namespace, plan: Plan, pp_rank: int, transformer_impl: str) -> dict:
    """Every performance-related TransformerConfig field for pipeline rank pp_rank."""
    from megatron.core.transformer.enums import AttnBackend

    fields = {
        # A TP=1 stage of a per-stage plan holds whole sequences (megatron-core refuses SP there).
        "sequence_parallel": args.sequence_parallel and plan.stage_tensor_parallel[pp_rank] > 1,
        "virtual_pipeline_model_parallel_size": plan.virtual_pipeline_size,
        "overlap_p2p_comm": args.overlap_p2p_comm and plan.virtual_pipeline_size is not None,
        "batch_p2p_comm": not (args.overlap_p2p_comm and plan.virtual_pipeline_size is not None),
        # Megatron-LM frees each sent activation's storage right after posting the send. With
        # NCCL the stream keeps it valid; gloo's sends run on their own threads and would read
        # the freed (replaced) storage when the interleaved schedule overlaps them.
        "deallocate_pipeline_outputs": torch.cuda.is_available(),
        "cross_entropy_loss_fusion": args.cross_entropy_loss_fusion,
        "cross_entropy_fusion_impl": args.cross_entropy_fusion_impl,
        "attention_backend": AttnBackend[args.attention_backend],
        **recompute_fields(args, plan, pp_rank),
        **megatron_fusions(args, transformer_impl).config_fields(),
    }
    return fields


# ----- DistributedDataParallelConfig ------------------------------------------------------


def ddp_fields(args: argparse.Namespace, data_parallel_size: int) -> dict:
    """Megatron-LM's DDP settings: bucket size 40M elements (more at large DP) when the
    reduction overlaps, one bucket otherwise; fp32 reduction for bf16 unless
    --grad-reduce-in-bf16."""
    bucket_size = args.ddp_bucket_size
    if bucket_size is None:
        bucket_size = max(40_000_000, 1_000_000 * data_parallel_size)
    if not args.overlap_grad_reduce:
        bucket_size = None
    return {
        "grad_reduce_in_fp32": args.accumulate_allreduce_grads_in_fp32
        or (args.bf16 and not args.grad_reduce_in_bf16),
        "use_distributed_optimizer": args.use_distributed_optimizer,
        "overlap_grad_reduce": args.overlap_grad_reduce,
        "overlap_param_gather": args.overlap_param_gather,
        "align_param_gather": args.align_param_gather,
        "bucket_size": bucket_size,
    }


def startup_lines(args: argparse.Namespace, plan: Plan, transformer_impl: str) -> list[str]:
    """What the start-up log says about the performance features."""
    lines = []
    if args.sequence_parallel_disabled:
        lines.append("> --sequence-parallel: disabled because tensor-model-parallel size is 1 "
                     "(as Megatron-LM)")
    elif args.sequence_parallel:
        sizes = "/".join(map(str, sorted({tp for t in plan.templates for tp in t.stage_tensor_parallel})))
        lines.append(f"> sequence parallelism over tensor-parallel size {sizes}")
    for index in range(plan.num_templates):
        pipeline = plan.template_plan(index) if plan.num_templates > 1 else plan
        stages = [describe_recompute(recompute_fields(args, pipeline, s)) for s in range(pipeline.pipeline_parallel)]
        if any(s != "none" for s in stages):
            lines.append("> activation recomputation per stage"
                         + (f" of template {index}" if plan.num_templates > 1 else "") + ": "
                         + ", ".join(f"stage {s}: {text}" for s, text in enumerate(stages)))
    for index in range(plan.num_templates):
        pipeline = plan.template_plan(index) if plan.num_templates > 1 else plan
        if pipeline.virtual_pipeline_size is not None:
            split = " | ".join(str(n) for n in pipeline.virtual_stage_layers())
            lines.append("> interleaved 1F1B" + (f" in template {index}" if plan.num_templates > 1 else "")
                         + f": {pipeline.virtual_pipeline_size} virtual stages per pipeline rank, layers per "
                         f"virtual stage {split}, pipeline communication "
                         f"{'overlapped' if args.overlap_p2p_comm else 'batched'}")
    ddp = ddp_fields(args, plan.data_parallel)
    gather = ", parameter all-gather overlapped with forward" if ddp["overlap_param_gather"] else ""
    if plan.num_templates > 1:
        when = ("during the last micro-batch's backward, group by group as its gradients are final"
                if ddp["overlap_grad_reduce"] else "after the last micro-batch's backward")
        lines.append(f"> {plan.num_templates} replica templates: each parameter's gradient reduced over every "
                     f"replica of every template holding it, {when}{gather}")
    elif ddp["overlap_grad_reduce"]:
        buckets = (f"this rank's parameters in {args.ddp_num_buckets} buckets" if args.ddp_num_buckets
                   else f"buckets of {ddp['bucket_size']} elements")
        lines.append(f"> gradient reduction overlapped with backward ({buckets}{gather})")
    lines.append(f"> fused kernels: {megatron_fusions(args, transformer_impl).describe()}"
                 + ("; cross-entropy loss fusion" if args.cross_entropy_loss_fusion else ""))
    return lines
