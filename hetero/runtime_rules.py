"""What the runtime refuses in a plan for a model, checked in one place.

pretrain_gpt.py runs these checks before any process group exists; hetero-plan runs them
before it writes a plan (it writes only plans the runtime runs) and `hetero-plan explain`
runs them on a plan it is given, exiting non-zero with the same messages. The checks that
need the run itself (flags without a model counterpart, this process's device) stay in the
runtime; everything that a plan, its model and its precision decide is here.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from hetero.plan import Plan
from hetero.spec.catalog import DeviceType
from hetero.spec.model import ModelSpec

RUNTIME_PRECISIONS = ("fp32", "bf16", "fp16")
"""The precisions pretrain_gpt.py trains in (--bf16, --fp16, neither)."""

_PRECISION_FLAGS = {"bf16": "--bf16", "fp16": "--fp16", "fp32": "neither --bf16 nor --fp16"}


def precision_problems(precision: str, device_types: Iterable[str],
                       devices: Mapping[str, DeviceType]) -> list[str]:
    """A precision the runtime cannot train in, or one that a device of the job lacks."""
    if precision not in RUNTIME_PRECISIONS:
        return [f"precision {precision}: Megatron-Hetero trains in {', '.join(RUNTIME_PRECISIONS)} "
                f"({', '.join(f'{p}: {_PRECISION_FLAGS[p]}' for p in RUNTIME_PRECISIONS)}); FP8/FP4 "
                "training needs transformer-engine's recipes, which it does not run yet: plan with "
                "--precision bf16 (or leave --precision out)"]
    if precision == "fp32":
        return []
    lacking = sorted({name for name in device_types if name in devices and not devices[name].supports(precision)})
    if not lacking:
        return []
    other = "--fp16" if precision == "bf16" else "--bf16"
    return [f"--{precision} is not supported by {', '.join(lacking)} (its matrix units run "
            f"{', '.join(devices[lacking[0]].precisions)}); train with {other} if every device has it, "
            f"or plan without these devices (hetero-plan picks the precision when --precision is not given)"]


def model_problems(plan: Plan, model: ModelSpec) -> list[str]:
    """What the plan's tensor-parallel degrees cannot shard in this model, and the model
    features a degree per stage or several replica templates cannot run yet."""
    problems = []
    groups = model.num_query_groups or model.num_attention_heads
    ffn = model.ffn_hidden_size
    degrees = sorted({tp for t in plan.templates for tp in t.stage_tensor_parallel})
    several = plan.num_templates > 1
    per_stage = not several and len(degrees) > 1
    for tp in degrees:
        where = " of a stage of the plan" if per_stage else " of a template of the plan" if several else ""
        for name, value in (("--num-attention-heads", model.num_attention_heads),
                            ("--num-query-groups", groups), ("--ffn-hidden-size", ffn)):
            if value is not None and value % tp:
                problems.append(f"{name} {value} is not divisible by the tensor-parallel size {tp}{where}; "
                                f"plan with degrees that divide it (hetero-plan --tensor-parallel ...) or change the model")
    if several:
        unsupported = [name for name, used in (("--num-experts (a mixture of experts)", model.num_experts is not None),
                                               ("--mtp-num-layers (multi-token prediction)", model.mtp_num_layers))
                       if used]
        if unsupported:
            problems.append(f"{' and '.join(unsupported)} with several replica templates: not supported yet; "
                            "use a plan of one template for this model")
        return problems
    if model.num_experts is not None:
        for etp in sorted({plan.grid.stage_expert_tensor_parallel(s) for s in range(plan.pipeline_parallel)}):
            if model.moe_ffn_hidden_size % etp:
                problems.append(f"--moe-ffn-hidden-size {model.moe_ffn_hidden_size} is not divisible by the expert "
                                f"tensor-parallel size {etp}; plan with an expert tensor-parallel degree that "
                                "divides it (--expert-tensor-parallel-size) or change the model")
    if per_stage and model.mtp_num_layers:
        problems.append("--mtp-num-layers with a tensor-parallel degree per stage: the last stage's copy of "
                        "the word embeddings, which the multi-token-prediction layers read, is kept in step "
                        "with the first stage's only at one degree; give every stage the same degree")
    return problems


def runtime_problems(plan: Plan, model: ModelSpec | None, precision: str | None,
                     devices: Mapping[str, DeviceType], extra_device_types: Iterable[str] = ()) -> list[str]:
    """Every reason the runtime would refuse this plan for this model and precision (empty:
    it runs). extra_device_types: devices a process stands in for beyond the plan's."""
    problems = []
    if precision is not None:
        names = {d.device_type for d in plan.devices} | set(extra_device_types)
        problems += precision_problems(precision, names, devices)
    if model is not None:
        problems += model_problems(plan, model)
    return problems


__all__ = ["RUNTIME_PRECISIONS", "model_problems", "precision_problems", "runtime_problems"]
