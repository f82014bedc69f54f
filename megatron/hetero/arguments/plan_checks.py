"""The plan against the flags: its parallel layout taken over, its model, precision and
devices checked."""

from __future__ import annotations

import argparse

from hetero import env
from hetero.spec.catalog import DEVICES
from hetero.spec.cluster import Cluster
from hetero.errors import HeteroError
from hetero.spec.model import ModelSpec
from hetero.plan import Plan
from hetero.runtime_rules import model_problems, precision_problems
from megatron.hetero.problems import Problems


def apply_plan(args: argparse.Namespace, plan: Plan, template: int = 0) -> None:
    """Takes the parallel layout from the plan, checking the flags that restate it. Every
    flag that contradicts the plan is named (one error for all), raised after the plan's
    values are in place, so the checks that follow still run on the plan's layout. Under a
    plan of several templates the pipeline's degrees are those of ``template`` (this rank's),
    and a flag restating the degrees of any template agrees with the plan."""
    contradictions = []
    shapes = plan.templates
    mine = shapes[template]
    for flag, planned, allowed in (
            ("--tensor-model-parallel-size", mine.tensor_parallel, {t.tensor_parallel for t in shapes}),
            ("--pipeline-model-parallel-size", mine.pipeline_parallel, {t.pipeline_parallel for t in shapes}),
            ("--micro-batch-size", plan.micro_batch_size, {plan.micro_batch_size}),
            ("--global-batch-size", plan.global_batch_size, {plan.global_batch_size}),
            ("--num-layers", plan.num_layers, {plan.num_layers})):
        dest = flag[2:].replace("-", "_")
        given = getattr(args, dest)
        if given is not None and given not in allowed:  # absent: the plan's value
            shown = planned if len(allowed) == 1 else " or ".join(map(str, sorted(allowed)))
            contradictions.append(f"{flag} {given} contradicts the plan ({shown})")
        setattr(args, dest, planned)
    args.hetero_template = template
    args.data_parallel_size = plan.data_parallel
    for flag, planned, default in (("--expert-model-parallel-size", plan.expert_parallel, 1),
                                   ("--expert-tensor-parallel-size", plan.expert_tensor_parallel,
                                    mine.tensor_parallel)):
        dest = flag[2:].replace("-", "_")
        given = getattr(args, dest)
        # absent: the plan's value; without experts (no --num-experts) the flag shapes nothing
        if given is not None and given != (planned or default) and args.num_experts:
            contradictions.append(f"{flag} {given} contradicts the plan ({planned or default})")
        setattr(args, dest, planned)
    if args.context_parallel_size not in (1, plan.context_parallel):  # 1: the flag's default
        contradictions.append(f"--context-parallel-size {args.context_parallel_size} contradicts the plan "
                              f"({plan.context_parallel})")
    args.context_parallel_size = plan.context_parallel
    # --tensor-model-parallel-size is the job's degree; a version 3 plan may give stages their
    # own, a version 4 plan each template its own: every degree of the job (the vocabulary is
    # padded for all of them, every one must divide the heads).
    args.stage_tensor_parallel_sizes = [tp for t in shapes for tp in t.stage_tensor_parallel]
    problems = Problems()  # one problem per flag, each with its fix
    for contradiction in contradictions:
        problems.add(f"{contradiction}; drop the flag or regenerate the plan for this setting")
    problems.raise_if_any()


def check_plan_model(args: argparse.Namespace, plan: Plan) -> None:
    """A plan from hetero-plan records the model and training it was made for; the run
    must be that model (the plan's times and memory are for it) and that precision, on
    devices that support it. Every field of the model is compared after Megatron's
    defaults are filled in on both sides, except the vocabulary: the tokenizer pads it
    later, and the training start compares the padded size with the plan's."""
    wrong = []
    ours = ModelSpec.from_megatron_args(args)
    if plan.model is not None:
        wrong = [f"{name}: plan {planned_value!r}, flags {flag_value!r}"
                 for name, planned_value, flag_value in plan.model.spec().differences(ours, skip=("vocab_size",))]
    training = plan.training
    # Set before the checks below raise, so the start-up's later checks see them either way.
    if training is not None and training.distributed_optimizer:
        args.use_distributed_optimizer = True  # the plan's memory assumes it
    if training is not None and training.sequence_parallel and plan.max_tensor_parallel > 1:
        args.sequence_parallel = True  # so do its activation memory and transfers
    precision = training.precision if training is not None else None
    if precision and precision != args.params_dtype:
        flag = {"bf16": "--bf16", "fp16": "--fp16", "fp32": "neither --bf16 nor --fp16"}.get(precision, precision)
        wrong.append(f"precision: plan {precision} ({flag}), flags {args.params_dtype}")
    if wrong:
        raise HeteroError(
            "the plan was made for another model or precision (" + "; ".join(wrong) + "); run the "
            "model it was made for, or regenerate it with hetero-plan --model ... --precision ..."
        )
    check_precision_supported(args, plan)
    check_moe_sequence_parallel(args, plan)
    problems = model_problems(plan, ours)
    if problems:  # the same checks hetero-plan runs before it writes a plan
        raise HeteroError("; ".join(problems))


def check_moe_sequence_parallel(args: argparse.Namespace, plan: Plan) -> None:
    """megatron-core's MoE layer refuses to train under tensor parallelism without sequence
    parallelism (a ValueError in its first forward): said here, on every rank alike, before
    any process group exists."""
    if args.num_experts is not None and plan.max_tensor_parallel > 1 and not args.sequence_parallel:
        degrees = args.stage_tensor_parallel_sizes or [plan.max_tensor_parallel]
        stages = f" (stage degrees {degrees})" if len(set(degrees)) > 1 else ""
        raise HeteroError(f"--num-experts with tensor parallelism {plan.max_tensor_parallel}{stages} needs "
                          "--sequence-parallel: megatron-core's MoE layer does not train without it; add "
                          "--sequence-parallel")


def check_precision_supported(args: argparse.Namespace, plan: Plan) -> None:
    """--bf16 (or --fp16) on a device whose matrix units lack it: refused, naming the
    device (the plan's devices, and HETERO_DEVICE when this process stands in for one)."""
    devices = dict(DEVICES)
    if plan.cluster is not None:
        devices.update(Cluster(plan.cluster, "the plan's cluster section").devices)
    names = {d.device_type for d in plan.devices}
    standing_in = env.device()  # this local rank's entry, as the device check reads it
    if standing_in:
        names.add(standing_in)
    # The same check hetero-plan and its explain run (hetero.runtime_rules).
    problems = precision_problems(args.params_dtype, names, devices)
    if problems:
        raise HeteroError(problems[0])
