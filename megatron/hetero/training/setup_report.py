"""What a run prints at start-up: the flags, the plan's sizes and rank placement, the batch
ramp-up, the megatron-core patches applied, and the notes on flags and performance."""

from __future__ import annotations

import argparse

from hetero.plan import Plan
from megatron.hetero.batch_schedule import BatchSchedule
from megatron.hetero.core_version import installed_megatron_core
from megatron.hetero.cpu_device import substitution_note
from megatron.hetero.log import arguments_block, print_rank_0
from megatron.hetero.model import resolve_transformer_impl
from megatron.hetero.performance import startup_lines as performance_startup_lines


def _print_setup(args: argparse.Namespace, plan: Plan, plan_source: str | None, patches: list[str],
                 schedule: BatchSchedule, again: bool = False) -> None:
    if not again:  # an in-process restart's flags are the job's: printed once
        print_rank_0(arguments_block(args))
    print_rank_0(
        f"using world size: {plan.world_size}, data-parallel size: {plan.data_parallel}, "
        f"context-parallel size: {plan.context_parallel}, " + _model_parallel_sizes(plan))
    print_rank_0(f"> hetero plan: {plan_source or 'none (uniform Megatron plan)'}: {plan.summary()}")
    if plan_source:
        for logical in range(plan.world_size):
            c, d = plan.grid.coords(logical), plan.device_of_logical(logical)
            print_rank_0(
                f"    logical rank {logical:4d} (tp {c.tp_rank}, "
                + (f"cp {c.cp_rank}, " if plan.context_parallel > 1 else "")
                + (f"template {c.template}, " if plan.num_templates > 1 else "")
                + f"dp {c.dp_rank}, pp {c.pp_rank}) "
                f"-> launch rank {plan.launch_rank(logical):4d} on {d.host} ({d.device_type}, {d.vendor})"
            )
    if schedule.ramps:
        print_rank_0("> batch-size ramp-up (--rampup-batch-size), each step split over the replicas "
                     "in the plan's proportions (largest remainder):")
        for line in schedule.describe():
            print_rank_0(line)
    print_rank_0(f"> megatron-core {installed_megatron_core()} patches applied: {', '.join(patches) or 'none'}")
    for note in getattr(args, "noop_flags", ()):  # said once, as Megatron-LM's own warnings
        print_rank_0(f"> {note}")
    for note in args.startup_notes:
        print_rank_0(f"WARNING: {note}")
    for line in performance_startup_lines(args, plan, resolve_transformer_impl(args)):
        print_rank_0(line)
    note = substitution_note(getattr(args, "cpu_substitutions", []))
    if note:  # one line for every GPU-only choice the CPU replaced (cpu_device.py)
        print_rank_0(f"> {note}")


def _model_parallel_sizes(plan: Plan) -> str:
    """Megatron-LM's sizes line, a pipeline of each template."""
    parts = []
    for template in plan.templates:
        degrees = template.stage_tensor_parallel
        tp = "/".join(map(str, degrees)) if len(set(degrees)) > 1 else str(template.tensor_parallel)
        parts.append(f"tensor-model-parallel size: {tp}, pipeline-model-parallel size: {template.pipeline_parallel}")
    if len(parts) == 1:
        return parts[0]
    return "; ".join(f"template {k}: {part}" for k, part in enumerate(parts))
