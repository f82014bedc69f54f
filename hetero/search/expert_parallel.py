"""Expert parallelism in the search: which degrees to try, and a plan made to run them.

The search tries each expert-parallel degree as its own job setting (the cost model of
that grid prices the all-to-alls, the experts' share of memory and their gradient
reduction), with one expert per tensor slice (expert tensor-parallel 1, megatron-core's
usual MoE layout: experts are cut by EP, not by TP) unless the options fix the expert
tensor-parallel degree. The degrees tried by default stay within one node, where the
all-to-all runs over the fastest fabric; a degree the options fix may not, and placement may
spread a group over nodes: the fast estimate and the predictor both price the all-to-alls
on the hosts a group spans (hetero/predict/expert_exchange.py).
"""

from __future__ import annotations

import math
from fractions import Fraction

from pydantic import ValidationError

from hetero.errors import PlanError
from hetero.plan import Plan
from hetero.search.options import DeviceClass, PlannerOptions
from hetero.spec.model import ModelSpec


def expert_parallel_choices(model: ModelSpec, classes: list[DeviceClass], options: PlannerOptions) -> tuple[int, ...]:
    """The expert-parallel degrees the search tries: the options' own, else 1 and every
    divisor of the expert count that fits in the smallest node (none without experts)."""
    if not model.is_moe:
        return (1,)
    if options.expert_parallel is not None:
        return options.expert_parallel
    per_node = min(c.devices_per_node for c in classes)
    return tuple(ep for ep in range(1, per_node + 1) if model.num_experts % ep == 0)


def expert_tensor_parallel_for(expert_parallel: int, fixed: int | None = None) -> int | None:
    """The expert tensor-parallel degree the search pairs with an EP degree: the fixed one
    where the options give it, else 1 at EP > 1 and None (the stage's TP, megatron-core's
    default and the only degree it trains correctly at EP 1) at EP 1."""
    if expert_parallel == 1:
        return None  # a fixed degree at EP 1 is the stages' TP (with_expert_parallel checks it)
    return fixed if fixed is not None else 1


def with_expert_parallel(plan: Plan, expert_parallel: int, expert_tensor_parallel: int | None = None) -> Plan | None:
    """The plan with this expert-parallel degree (and expert tensor-parallel degree, when
    fixed), or None where its stages' TP x DP ranks do not split into expert groups, or
    where a fixed expert tensor-parallel degree at EP 1 differs from a stage's TP.

    The one place the search meets the runtime's rule that the ranks of an expert-parallel
    group run equal micro-batch counts (their all-to-alls pair up every micro-batch): the
    replicas bound together (Plan.expert_replica_blocks) get equal counts, in proportion to
    the block's mean count, rounded by largest remainder in whole blocks. None also where
    the global batch cannot be so split."""
    if expert_parallel == 1:
        fixed = expert_tensor_parallel
        return plan if fixed is None or set(plan.stage_tensor_parallel) == {fixed} else None
    data = plan.to_dict()
    data.update(expert_parallel=expert_parallel,
                expert_tensor_parallel=expert_tensor_parallel_for(expert_parallel, expert_tensor_parallel))
    try:
        bound = Plan.from_dict({**data, "replicas": [{**r, "num_micro_batches": 1} for r in data["replicas"]]})
    except (PlanError, ValidationError, ValueError):
        return None
    counts = equal_block_counts([r.num_micro_batches for r in plan.replicas], bound.grid.expert_replica_blocks)
    if counts is None:
        return None
    data["replicas"] = [{**r, "num_micro_batches": n} for r, n in zip(data["replicas"], counts)]
    try:
        return Plan.from_dict(data)
    except PlanError:  # the equal counts break another rule (the interleaved schedule's)
        return None


def equal_block_counts(counts: list[int], blocks: list[list[int]]) -> list[int] | None:
    """The same total as counts, equal inside each block, each block near its mean: floors
    of the means, then one more to whole blocks by largest remainder while the rest allows
    (None when it cannot be handed out in whole blocks, or a replica would get none)."""
    means = [Fraction(sum(counts[r] for r in block), len(block)) for block in blocks]
    per_replica = [math.floor(mean) for mean in means]
    left = sum(counts) - sum(n * len(block) for n, block in zip(per_replica, blocks))
    for index in sorted(range(len(blocks)), key=lambda i: (-(means[i] - per_replica[i]), blocks[i][0])):
        if len(blocks[index]) <= left and means[index] != per_replica[index]:
            per_replica[index] += 1
            left -= len(blocks[index])
    if left or min(per_replica) < 1:
        return None
    equal = [0] * len(counts)
    for n, block in zip(per_replica, blocks):
        for replica in block:
            equal[replica] = n
    return equal
