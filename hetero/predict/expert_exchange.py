"""The experts' token exchange beyond one node: what an expert-parallel group spread over
several hosts pays on top of the all-to-alls CostModel.layer_cost already prices.

layer_cost prices each layer's dispatch and combine as if the group sat on the rank's own
node (the common case, and the one a per-layer cost can know). Where the group's members
sit on other hosts too, each layer's forward and backward take longer by the difference.
Both the predictor (the plan's groups, member by member) and the planner's fast estimate
(a group packed as tightly as the class's nodes allow) price it here.
"""

from __future__ import annotations

from typing import Sequence

from hetero.predict.costs import CostModel


def expert_exchange_beyond_node_s(costs: CostModel, group_hosts: Sequence[str], host: str, device_name: str,
                                  tensor_parallel: int, micro_batch_size: int,
                                  recompute: str | None = None) -> tuple[float, float]:
    """(forward, backward) seconds one layer adds for one micro-batch when the expert-parallel
    group of a rank on `host` sits on `group_hosts` (one entry per member) rather than all on
    `host` (CostModel.expert_exchange_times of each). (0, 0) for a group inside the node."""
    group = tuple(group_hosts)
    if len(set(group)) <= 1:
        return 0.0, 0.0
    spanned = costs.expert_exchange_times(group, device_name, tensor_parallel, micro_batch_size, recompute)
    local = costs.expert_exchange_times((host,) * len(group), device_name, tensor_parallel, micro_batch_size,
                                        recompute)
    return spanned[0] - local[0], spanned[1] - local[1]


def packed_expert_group(hosts: Sequence[str], devices_per_node: int, expert_parallel: int,
                        expert_tensor_parallel: int) -> tuple[str, ...]:
    """The hosts of an expert-parallel group placed as tightly as nodes allow: its members are
    expert_tensor_parallel ranks apart (megatron-core's expert order), so a node of
    devices_per_node ranks holds devices_per_node // expert_tensor_parallel of them; the
    group fills its first hosts in order (reused cyclically where too few are given)."""
    per_node = max(1, min(expert_parallel, devices_per_node // expert_tensor_parallel))
    return tuple(hosts[(member // per_node) % len(hosts)] for member in range(expert_parallel))


def expert_data_group_hosts(data_group_hosts: Sequence[str], expert_data_parallel: int) -> tuple[str, ...]:
    """The hosts of an expert data-parallel group (the ranks holding one expert shard), from
    those of its stage's data-parallel group: one member in each expert-parallel group, and
    those take the stage's ranks in turn, so every (DP / EDP)-th member."""
    stride = max(1, len(data_group_hosts) // max(1, expert_data_parallel))
    return tuple(data_group_hosts[::stride][:expert_data_parallel])


def unpaired_exchange_s(costs: CostModel, group_hosts: Sequence[str], device_name: str, tensor_parallel: int,
                        micro_batch_size: int, recompute: str | None = None) -> tuple[float, float]:
    """(forward, backward) seconds one layer's all-to-alls take beyond CostModel's overlapped
    price when its chunk runs outside a pair (the pipeline's warm-up and cool-down: moe_overlap.
    unpaired_share); (0, 0) without --overlap-moe-expert-parallel-comm."""
    group = tuple(group_hosts)
    if not costs.setup.moe_a2a_overlap or len(group) <= 1:
        return 0.0, 0.0
    paired = costs.expert_exchange_times(group, device_name, tensor_parallel, micro_batch_size, recompute)
    alone = costs.expert_exchange_alone_s(group, tensor_parallel, micro_batch_size, recompute)
    return alone[0] - paired[0], alone[1] - paired[1]
