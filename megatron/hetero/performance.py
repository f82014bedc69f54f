"""Megatron-LM's performance features under a plan, as megatron-core settings.

Nothing here re-implements a feature: each flag becomes the TransformerConfig or
DistributedDataParallelConfig field that megatron-core already has, decided the way
Megatron-LM's ``validate_args`` / ``core_transformer_config_from_args`` decide it, plus
what a heterogeneous plan adds:

- recomputation per stage: ``stages[s].recompute`` of a version 2 plan overrides the
  ``--recompute-*`` flags for stage s (a small-memory device recomputes, a large one not);
- interleaved 1F1B with uneven virtual stages: ``stages[s].virtual_stages`` (or an even
  split from ``--num-virtual-stages-per-pipeline-rank`` /
  ``--num-layers-per-virtual-pipeline-stage``) becomes megatron-core's
  ``pipeline_model_parallel_layout`` with one entry per virtual stage;
- Megatron-LM's default fused kernels on GPUs, each on exactly when Megatron-LM turns it
  on, except where Megatron-LM would stop with an error because the kernel's package is
  missing: there it is off and the start-up line says so.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass

import torch

from hetero.errors import HeteroError, PlanError
from hetero.pipeline_layout import SplitFlags, megatron_split
from hetero.plan import Plan
from hetero.plan_entries import RecomputeEntry


# ----- flags against the plan (before any process group exists) -------------------------


def configure_performance(args: argparse.Namespace, plan: Plan) -> Plan:
    """Checks the performance flags, as Megatron-LM does, and returns the plan with its
    virtual stages filled in when the flags ask for an even interleaved split."""
    check_performance_flags(args)
    return performance_on_plan(args, plan)


def check_performance_flags(args: argparse.Namespace) -> None:
    """The refusals of performance flags, which need no plan: start-up runs them even where
    no plan could be made, so that a refused flag is reported whatever else is wrong."""
    _check_transformer_engine_features(args)
    _check_overlap(args)


def performance_on_plan(args: argparse.Namespace, plan: Plan) -> Plan:
    """The performance flags against the plan (check_performance_flags aside); returns the
    plan with its virtual stages filled in when the flags ask for an even interleaved split."""
    _check_recompute_flags(args)  # first: the per-stage recomputation reads what it settles
    _check_sequence_parallel(args, plan)
    if plan.num_templates > 1:
        return _on_templates(args, plan)
    plan = _with_virtual_stages(args, plan)
    _check_uniform_recompute_groups(args, plan)
    return plan


def _on_templates(args: argparse.Namespace, plan: Plan) -> Plan:
    """The performance flags under a plan of several templates: each template's stages
    checked as a plan of their own."""
    for flag in ("--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"):
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise HeteroError(f"{flag}: the interleaved schedule is not supported with several replica "
                              "templates yet; drop the flag or use a plan of one template")
    for flag, used in (("--ckpt-format torch", args.ckpt_format == "torch"), ("--hetero-adapt", args.hetero_adapt)):
        if used:
            raise HeteroError(f"{flag} is not supported with several replica templates yet; "
                              + ("use --ckpt-format torch_dist (the default)" if "ckpt" in flag else "drop it"))
    for template in range(plan.num_templates):
        _check_uniform_recompute_groups(args, plan.template_plan(template))
        if plan.templates[template].stages[0].virtual_stages:  # this template interleaves
            _check_micro_batch_groups(args, plan, template)
    return plan


def _check_recompute_flags(args: argparse.Namespace) -> None:
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            raise HeteroError("--recompute-activations means --recompute-granularity selective; "
                              "drop one of the two")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "selective" and (args.recompute_method or args.recompute_num_layers):
        raise HeteroError("--recompute-granularity selective takes no --recompute-method or "
                          "--recompute-num-layers (Megatron-LM: selective recomputes "
                          "--recompute-modules in every layer)")
    if args.recompute_granularity == "full" and (args.recompute_method is None or args.recompute_num_layers is None):
        raise HeteroError("--recompute-granularity full needs --recompute-method uniform|block and "
                          "--recompute-num-layers N")
    # Without --recompute-granularity, Megatron-LM accepts --recompute-method, --recompute-num-layers
    # and --recompute-modules and recomputes nothing (megatron-core checks them only under a
    # granularity); so does this runtime (recompute_fields). With full, --recompute-modules is
    # likewise unused.


def _check_uniform_recompute_groups(args: argparse.Namespace, plan: Plan) -> None:
    """megatron-core's uniform method checkpoints groups of recompute_num_layers layers and
    indexes past the end when a (virtual) stage's layers are not a whole number of groups."""
    for index, stage in enumerate(plan.stages):
        fields = recompute_fields(args, plan, index)
        if fields.get("recompute_method") != "uniform":
            continue
        group = fields["recompute_num_layers"]
        chunks = stage.virtual_stages or [stage.num_layers]
        if any(n % group for n in chunks):
            source = "the plan's stages[%d].recompute" % index if stage.recompute else "--recompute-num-layers"
            raise HeteroError(
                f"{source}: uniform recomputation in groups of {group} layers, but stage {index} "
                f"holds {'+'.join(map(str, chunks))} layers (megatron-core needs whole groups); "
                "use a group size that divides every stage's layers (1 always does), the block "
                "method, or a per-stage recompute in the plan (version 2)")


def _check_sequence_parallel(args: argparse.Namespace, plan: Plan) -> None:
    # Megatron-LM turns sequence parallelism off at TP=1 (its numerics would only change).
    args.sequence_parallel_disabled = args.sequence_parallel and plan.max_tensor_parallel == 1
    if args.sequence_parallel_disabled:
        args.sequence_parallel = False


def transformer_engine_on_gpu() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def local_attention(args: argparse.Namespace, have_te: bool) -> bool:
    """Whether the layers use megatron-core's own attention (its local layer spec)."""
    return args.transformer_impl == "local" or (args.transformer_impl is None and not have_te)


def _check_transformer_engine_features(args: argparse.Namespace) -> None:
    have_te = transformer_engine_on_gpu()
    reason = ("transformer-engine is not installed" if torch.cuda.is_available()
              else "this process has no GPU, and transformer-engine needs one")
    if args.tp_comm_overlap:
        if not have_te:
            raise HeteroError(f"--tp-comm-overlap overlaps tensor-parallel communication with GEMMs "
                              f"through transformer-engine's userbuffers, and {reason}; drop the flag")
        raise HeteroError("--tp-comm-overlap: transformer-engine's userbuffers are not initialised by "
                          "this release; drop the flag")
    if args.context_parallel_size != 1 and not local_attention(args, have_te):
        # Context parallelism runs in megatron-core's local attention (patch local-attention-
        # context-parallel, parity-tested); transformer-engine's ring attention has not been
        # run by this release (its cp_comm_type variants, hierarchical groups).
        raise HeteroError(f"--context-parallel-size {args.context_parallel_size} is trained by megatron-core's "
                          "local attention; transformer-engine's context-parallel attention is not tested "
                          "with this release: add --transformer-impl local")
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te" and not have_te:
        raise HeteroError(f"--cross-entropy-fusion-impl te needs transformer-engine, and {reason}; "
                          "use --cross-entropy-fusion-impl native")
    local_impl = local_attention(args, have_te)
    if args.attention_backend in ("flash", "fused", "unfused") and local_impl:
        raise HeteroError(f"--attention-backend {args.attention_backend} is transformer-engine's "
                          f"attention, and {reason if not have_te else 'the run uses --transformer-impl local'}; "
                          "use --attention-backend local (or auto)")
    if args.attention_backend == "local" and not local_impl:
        raise HeteroError("--attention-backend local is only supported with --transformer-impl local "
                          "(as in Megatron-LM, where it needs --spec local)")


def _check_overlap(args: argparse.Namespace) -> None:
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise HeteroError("--overlap-param-gather gathers the distributed optimizer's shards; it "
                          "needs --use-distributed-optimizer")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise HeteroError("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM)")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise HeteroError("--ddp-bucket-size must be a positive number of elements")


def _with_virtual_stages(args: argparse.Namespace, plan: Plan) -> Plan:
    per_rank, per_stage = args.num_virtual_stages_per_pipeline_rank, args.num_layers_per_virtual_pipeline_stage
    if per_rank is not None and per_stage is not None:
        raise HeteroError("give only one of --num-virtual-stages-per-pipeline-rank and "
                          "--num-layers-per-virtual-pipeline-stage")
    split_flags = SplitFlags.of_args(args)
    planned = plan.virtual_pipeline_size
    if planned is not None:
        if per_rank is not None and per_rank != planned:
            raise HeteroError(f"--num-virtual-stages-per-pipeline-rank {per_rank} contradicts the "
                              f"plan's {planned} virtual stages per rank; drop the flag")
        # With Megatron's uneven-split flags the first/last virtual stages differ; the plan
        # was built from (or checked against) the whole split in startup.load_plan.
        if per_stage is not None and not split_flags.shapes_stages and set(plan.virtual_stage_layers()) != {per_stage}:
            raise HeteroError(f"--num-layers-per-virtual-pipeline-stage {per_stage} contradicts the "
                              f"plan's virtual stages {plan.virtual_stage_layers()}; drop the flag")
        result = plan
    elif per_rank is None and per_stage is None:
        return plan
    else:
        # Megatron's own split where its flags shape the stages (the plan agrees with them).
        split = megatron_split(plan.num_layers, plan.pipeline_parallel, split_flags) if split_flags.shapes_stages else None
        result = _even_virtual_split(plan, per_rank, per_stage, split)
        if result.virtual_pipeline_size is None:
            return result
    if result.pipeline_parallel == 2 and not args.overlap_p2p_comm:
        raise HeteroError("the interleaved schedule with pipeline-model-parallel size 2 needs "
                          "overlapped pipeline communication (Megatron-LM: otherwise two sends and "
                          "receives between the same two ranks share one batch); drop "
                          "--no-overlap-p2p-communication")
    _check_micro_batch_groups(args, result)
    return result


def _check_micro_batch_groups(args: argparse.Namespace, plan: Plan, template: int = 0) -> None:
    """megatron-core's interleaved schedule runs a replica's M micro-batches in groups of
    --microbatch-group-size-per-virtual-pipeline-stage N (default: the pipeline-parallel size
    P) and raises, only when it runs, unless P <= N <= M and the last group, M mod N, is
    empty or at least P long. Every count a replica (of ``template``) runs is checked here:
    the plan's, which is also evaluation's (Megatron-LM's evaluate runs the whole global
    batch, never a ramp step), and each --rampup-batch-size step's."""
    pp = plan.templates[template].pipeline_parallel
    first = plan.grid.replica_offsets[template]
    mine = range(first, first + plan.templates[template].data_parallel)
    given = getattr(args, "microbatch_group_size_per_vp_stage", None)
    group = given if given is not None else pp
    flag = (f"--microbatch-group-size-per-virtual-pipeline-stage {group}" if given is not None else
            f"the interleaved schedule (--microbatch-group-size-per-virtual-pipeline-stage unset: groups of "
            f"the pipeline-parallel size {pp})")
    if group < pp:
        raise HeteroError(f"{flag} is below the pipeline-parallel size {pp} (megatron-core refuses it); "
                          f"give at least {pp}")
    counts = {plan.replicas[d].num_micro_batches: "the plan's global batch, in training and evaluation"
              for d in mine}
    for batch in _ramp_batch_sizes(args, plan):
        try:
            split = plan.split_micro_batches(batch)
            counts.update({split[d]: f"the --rampup-batch-size step of {batch} samples"
                           for d in mine if split[d] not in counts})
        except PlanError:
            continue  # the batch schedule names a ramp step the plan cannot split
    for count, source in sorted(counts.items()):
        if count < group or 0 < count % group < pp:
            why = (f"fewer than one group of {group}" if count < group else
                   f"a last group of {count % group}, shorter than the pipeline-parallel size {pp}")
            batch = "--rampup-batch-size (a higher start)" if "rampup" in source else "--global-batch-size"
            raise HeteroError(
                f"{flag}: a replica runs {count} micro-batches an iteration ({source}), {why}; "
                f"megatron-core's interleaved schedule refuses that when it runs. Give a {batch} "
                f"that gives every replica at least {group} micro-batches, a multiple of {group} or "
                f"one leaving a last group of {pp} or more"
                + (", or a group size that fits" if given is not None else ""))


def _ramp_batch_sizes(args: argparse.Namespace, plan: Plan) -> list[int]:
    """The global batch sizes of --rampup-batch-size's steps (Megatron-LM's ramp: from the
    start size up by the increment to the plan's global batch), none without a ramp."""
    ramp = getattr(args, "rampup_batch_size", None)
    if not ramp:
        return []
    start, increment = int(ramp[0]), int(ramp[1])
    if increment < 1:
        return []
    return list(range(start, plan.global_batch_size, increment))


def _even_virtual_split(plan: Plan, per_rank: int | None, per_stage: int | None,
                        split: list[list[int]] | None = None) -> Plan:
    stages = []
    for index, stage in enumerate(plan.stages):
        if split is not None:
            stages.append({**stage.model_dump(exclude_none=True),
                           "virtual_stages": split[index] if len(split[index]) > 1 else None})
            continue
        chunks = per_rank if per_rank is not None else stage.num_layers // per_stage
        if chunks < 1 or stage.num_layers % chunks or (per_stage and stage.num_layers % per_stage):
            flag = (f"--num-virtual-stages-per-pipeline-rank {per_rank}" if per_rank is not None
                    else f"--num-layers-per-virtual-pipeline-stage {per_stage}")
            raise HeteroError(f"{flag}: stage {index} holds {stage.num_layers} layers, which do not "
                              "split evenly; give the split in the plan (stages[s].virtual_stages, "
                              "plan version 2)")
        stages.append({**stage.model_dump(exclude_none=True),
                       "virtual_stages": [stage.num_layers // chunks] * chunks if chunks > 1 else None})
    if stages[0]["virtual_stages"] is None:
        return plan  # one virtual stage per rank: the plain 1F1B schedule, as Megatron-LM
    data = {**plan.to_dict(), "version": 2, "stages": stages}
    return Plan.from_dict(data, source="the plan with the virtual stages of the flags")


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
