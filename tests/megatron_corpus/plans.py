"""The heterogeneous plan every corpus recipe also runs under, made from the recipe's own
flags by one rule. The recipe's command line stays as scale.py makes it; the plan agrees
with it (world size, TP, PP, virtual stages per rank, micro-batch size, global batch,
layers) and changes only what a plan decides and Megatron-LM's flags cannot say:

1. Stages: the split Megatron-LM makes from the flags (``megatron_split``), then one decoder
   layer moved from the first (virtual) stage to the last where PP > 1 - unless the recipe
   pins the split itself (--pipeline-model-parallel-layout, --decoder-first/last-pipeline-num-layers,
   --account-for-embedding/loss-in-pipeline-split, --num-layers-per-virtual-pipeline-stage),
   which the plan then keeps as given (uneven as the recipe makes it; even where it counts
   layers per virtual stage).
2. Replicas: where DP > 1, the global batch's micro-batches shared out in proportion
   2 : 1 : ... : 1 (replica 0 as if on devices twice as fast) by hetero.balance's
   largest-remainder rule, in whole units of the interleaved schedule (scale.Layout.
   replica_unit: PP micro-batches, or lcm(PP, N) with the recipe's group size N; megatron-core
   runs them so). Replicas whose ranks share an expert-parallel
   group run equal counts (their all-to-alls must line up: hetero.plan's rule), so an
   expert-parallel recipe whose one expert group spans every replica gets equal replicas.
3. Ranks: logical rank i runs on launch rank world - 1 - i (the launch order reversed), so
   every process group is built from permuted ranks, even where DP = PP = 1 leaves the plan
   no other freedom (a one-process recipe's plan can vary nothing). A recipe that orders its
   ranks itself (--use-tp-pp-dp-mapping) keeps that order.

The devices are CPU processes on this host. Context parallelism has no axis in a plan (the
runtime refuses it under any plan), so a CP recipe's plan has TP x PP x DP processes. A
recipe whose flags give no model size, a split with a stage that holds no decoder layer, or
an expert layout the runtime refuses gets no plan: it is refused under a plan as it is
without one.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.balance import split_in_proportion
from hetero.errors import PlanError
from hetero.pipeline_layout import SplitFlags
from hetero.pipeline_layout import megatron_split as pipeline_split
from hetero.plan import PLAN_VERSION, Plan, expert_parallel_problems
from hetero.plan_entries import DeviceEntry, ReplicaEntry, StageEntry
from megatron.hetero.startup import tp_pp_dp_rank_order

from tests.megatron_corpus.scale import Layout

FAST_REPLICA_WEIGHT = 2  # replica 0's share against 1 for every other replica
PINNING_FLAGS = ("--pipeline-model-parallel-layout",
                 "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                 "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                 "--num-layers-per-virtual-pipeline-stage")
CPU = DeviceEntry(host="localhost", device_type="cpu", vendor="cpu")


@dataclass(frozen=True)
class RecipePlan:
    """A recipe's plan and what it makes heterogeneous (for the table); or no plan, and why."""

    plan: Plan | None
    note: str


def _values(argv: list[str]) -> dict[str, str | None]:
    """flag -> its first value (None for a switch) of a scaled command line."""
    values: dict[str, str | None] = {}
    for index, token in enumerate(argv):
        if token.startswith("--"):
            following = argv[index + 1] if index + 1 < len(argv) else None
            values[token] = None if following is None or following.startswith("--") else following
    return values


def megatron_split(argv: list[str], layout: Layout) -> list[list[int]] | None:
    """Decoder layers of each (virtual) stage as Megatron-LM splits them from the flags, per
    pipeline rank in chunk order (hetero.pipeline_layout, the runtime's own rule); None where
    the flags give no whole split (the runtime then refuses the recipe by itself)."""
    values = _values(argv)
    if values.get("--num-layers") is None:
        return None

    def number(flag: str) -> int | None:
        return int(values[flag]) if values.get(flag) is not None else None

    flags = SplitFlags(
        first_stage_layers=number("--decoder-first-pipeline-num-layers"),
        last_stage_layers=number("--decoder-last-pipeline-num-layers"),
        layout=(values.get("--pipeline-model-parallel-layout") or "").replace("\\", "") or None,
        account_for_embedding="--account-for-embedding-in-pipeline-split" in values,
        account_for_loss="--account-for-loss-in-pipeline-split" in values,
        layers_per_virtual_stage=number("--num-layers-per-virtual-pipeline-stage"),
        virtual_stages_per_rank=number("--num-virtual-stages-per-pipeline-rank"))
    try:
        split = pipeline_split(int(values["--num-layers"]), layout.pp, flags)
    except PlanError:
        return None
    return split if len(split[0]) == layout.virtual else None


def _replica_micro_batches(total: int, data_parallel: int, group: int) -> list[int]:
    """total micro-batches over the replicas, 2 : 1 : ... : 1, in whole groups; equal where
    so few groups leave a replica without one."""
    weights = [FAST_REPLICA_WEIGHT] + [1] * (data_parallel - 1)
    counts = [group * n for n in split_in_proportion(total // group, weights)]
    if min(counts) < group:
        counts = [total // data_parallel] * data_parallel
    return counts


def plan_for(pairs: list[list[str]], argv: list[str], layout: Layout) -> RecipePlan:
    """The rule above for one recipe (its flags and its scaled command line). No plan where
    the flags give no model size, micro-batch or whole split to plan for, or a split a plan
    cannot hold (the runtime refuses such a recipe without a plan too)."""
    values = _values(argv)
    split = megatron_split(argv, layout)
    if split is None or values.get("--micro-batch-size") is None:
        return RecipePlan(None, "no plan: the flags give no model size, micro-batch or whole stage split")
    if min(map(min, split)) < 1:
        return RecipePlan(None, "no plan: the recipe's split leaves a (virtual) stage without a decoder "
                                "layer, which a plan cannot hold")
    micro = int(values["--micro-batch-size"])
    # Megatron-LM's default global batch: one micro-batch a replica.
    global_batch = int(values.get("--global-batch-size") or micro * layout.dp)
    if global_batch % (micro * layout.dp):
        return RecipePlan(None, "no plan: the global batch is no whole number of micro-batches a replica")
    notes = []
    pinned = [flag for flag in PINNING_FLAGS if flag in {p[0] for p in pairs}]
    if layout.pp > 1 and not pinned and split[0][0] > 1:
        split[0][0] -= 1
        split[-1][-1] += 1
    if layout.pp > 1:
        shown = "/".join("+".join(map(str, chunks)) for chunks in split)
        notes.append(f"stages {shown}" + (f" (as {pinned[0]} gives)" if pinned else ""))
    replicas = _replica_micro_batches(global_batch // micro, layout.dp, layout.replica_unit)
    # A model without experts has no parameter the expert layout shapes (the runtime's rule).
    expert_tp = (int(values["--expert-tensor-parallel-size"])
                 if values.get("--expert-tensor-parallel-size") and values.get("--num-experts") else None)
    bound = expert_parallel_problems([layout.tp] * layout.pp, replicas, layout.ep, expert_tp, layout.cp)
    if bound:  # replicas sharing an expert-parallel all-to-all run equal counts (the plan's rule)
        replicas = [global_batch // micro // layout.dp] * layout.dp
        unrunnable = expert_parallel_problems([layout.tp] * layout.pp, replicas, layout.ep, expert_tp, layout.cp)
        if unrunnable:  # the runtime refuses this expert layout under any plan, and without one
            return RecipePlan(None, f"no plan: {unrunnable[0]}")
    if layout.dp > 1:
        equal = " (equal: too few micro-batches to split unevenly)" if len(set(replicas)) == 1 else ""
        if bound:
            equal = " (equal: one expert-parallel group spans them)"
        notes.append(f"replicas {'/'.join(map(str, replicas))}{equal}")
    world = layout.tp * layout.cp * layout.pp * layout.dp
    # The recipe's own rank-order flag decides the order where it gives one (a plan that
    # disagrees is refused by name, as a user's would be).
    tp_pp_dp = "--use-tp-pp-dp-mapping" in {p[0] for p in pairs}
    if world == 1:
        notes.append("one process: nothing to vary")
    elif tp_pp_dp:
        notes.append("ranks in --use-tp-pp-dp-mapping's order")
    else:
        notes.append("ranks reversed" + ("" if notes else " (DP 1, PP 1: no other freedom)"))
    plan = Plan(
        version=PLAN_VERSION,
        tensor_parallel=layout.tp,
        pipeline_parallel=layout.pp,
        data_parallel=layout.dp,
        micro_batch_size=micro,
        stages=[StageEntry(num_layers=sum(chunks), virtual_stages=chunks if layout.virtual > 1 else None)
                for chunks in split],
        replicas=[ReplicaEntry(num_micro_batches=n) for n in replicas],
        rank_order=list(reversed(range(world))),
        devices=[CPU] * world,
        expert_parallel=layout.ep,
        expert_tensor_parallel=expert_tp,
        context_parallel=layout.cp,
    )
    if tp_pp_dp:
        plan = plan.model_copy(update={"rank_order": tp_pp_dp_rank_order(plan)})
    return RecipePlan(plan, ", ".join(notes))
