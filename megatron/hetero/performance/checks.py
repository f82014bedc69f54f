"""The performance flags against the plan, before any process group exists.

The refusals Megatron-LM's validate_args makes (and those of what this release does not
run), the recomputation groups and interleaved micro-batch groups megatron-core would only
refuse when it runs, checked per stage and per template; and the even interleaved split
--num-virtual-stages-per-pipeline-rank / --num-layers-per-virtual-pipeline-stage ask for,
written into the plan as its virtual stages.
"""

from __future__ import annotations

import argparse

import torch

from hetero.errors import HeteroError, PlanError
from hetero.pipeline_layout import SplitFlags, megatron_split
from hetero.plan import Plan
from megatron.hetero.performance.settings import local_attention, recompute_fields, transformer_engine_on_gpu


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
