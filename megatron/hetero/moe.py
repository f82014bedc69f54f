"""Mixture-of-experts: the router losses in Megatron-LM's iteration line, under any plan.

megatron-core accumulates each MoE layer's load-balancing loss over the micro-batches a
rank runs; Megatron-LM scales that sum by 1 / (micro-batches per replica) and averages
over data-parallel replicas. Replicas of a heterogeneous plan run different micro-batch
counts, so the plan-independent value is the mean over ALL micro-batches of the
iteration: scale by (data-parallel size / total micro-batches), which equals Megatron-LM's
factor whenever the replicas are equal.

The gradient needs no such care: with the per-token loss megatron-core's router scales
each micro-batch's aux loss by its token count and finalize_model_grads divides by the
global token count, which is the same sum under any split of the micro-batches.

Expert parallelism adds two runtime pieces here: the dispatcher's all-to-all split sizes as
host numbers on the CPU (a patch, patches/layers.py) and the optimizer state of a checkpoint
saved under another expert-parallel size (fit_optimizer_state).
"""

from __future__ import annotations

import argparse

from hetero.errors import HeteroError
from hetero.spec.model import ModelSpec

from megatron.hetero import stage_tensor_parallel
from megatron.hetero.identity import compute_device
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core.transformer.moe.moe_utils import track_moe_metrics


def tracked_losses(args: argparse.Namespace) -> list[str]:
    """The router losses Megatron-LM logs for these flags."""
    types = args.moe_router_load_balancing_type
    types = [types] if isinstance(types, str) else types
    names = []
    if "aux_loss" in types:
        names.append("load_balancing_loss")
    if "seq_aux_loss" in types:
        names.append("seq_load_balancing_loss")
    if "global_aux_loss" in types:
        names.append("global_load_balancing_loss")
    if getattr(args, "moe_z_loss_coeff", None) is not None:
        names.append("z_loss")
    return names


class MoEMetrics:
    """Collects the router losses of one iteration (a collective: every rank calls it)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.names = tracked_losses(args)
        # track_moe_metrics' divisor: the MoE layers of the pattern, the MTP layers included
        self.moe_layers = sum(ModelSpec.from_megatron_args(args).moe_layer_pattern()) + (args.mtp_num_layers or 0)

    def collect(self, iteration: int, data_parallel_size: int, total_micro_batches: int,
                tensorboard=None, wandb=None) -> dict[str, float]:
        totals: dict = {}
        scale = data_parallel_size / total_micro_batches
        if stage_tensor_parallel.active_plan() is not None:
            return self._collect_on_plan_grid(scale, iteration, tensorboard, wandb)
        track_moe_metrics(
            loss_scale=scale,
            iteration=iteration,
            writer=tensorboard,
            wandb_writer=wandb,
            total_loss_dict=totals,
            force_initialize=True,
            track_names=self.names,
            per_layer_logging=getattr(self.args, "moe_per_layer_logging", False),
            # Megatron-LM's averages: over the MoE layers of the pattern (dense layers
            # add nothing), the multi-token-prediction layers included.
            num_layers=self.args.num_layers,
            moe_layer_freq=getattr(self.args, "moe_layer_freq", 1),
            mtp_num_layers=getattr(self.args, "mtp_num_layers", None),
        )
        return {name: float(value) for name, value in totals.items()}

    def _collect_on_plan_grid(self, scale: float, iteration: int, tensorboard, wandb) -> dict[str, float]:
        """track_moe_metrics' value of each loss (the mean over the MoE layers, the MTP layers
        included), reduced by _reduce_on_plan_grid."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        _reduce_on_plan_grid(self.names, self.args.num_layers, stage_tensor_parallel.active_plan())
        tracker = get_moe_layer_wise_logging_tracker()
        totals = {name: float(tracker[name]["values"].float().sum()) * scale / self.moe_layers for name in self.names}
        for name, value in totals.items():
            if tensorboard is not None:
                tensorboard.add_scalar(name, value, iteration)
            if wandb is not None:
                wandb.log({name: value}, iteration)
        clear_aux_losses_tracker()
        return totals


def _reduce_on_plan_grid(names: list[str], num_layers: int, plan) -> None:
    """megatron-core's reduction of the router losses (track_moe_metrics) on a grid whose
    stages differ in tensor-parallel degree: there pipeline groups overlap, so the sum over
    the stages cannot run on them. Each stage first reduces its own layers over its own groups
    as megatron-core does (reduce_group, then the data-parallel average; avg_group), which
    leaves every rank of a stage the same values; the replica's model-parallel group then adds
    the stages, each rank's values weighted by 1 / its stage's degree."""
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    device = compute_device()
    me = plan.grid.coords(dist.get_rank())
    degree = plan.grid.stage_tensor_parallel(me.template)[me.pp_rank]
    data_group = ps.get_data_parallel_group(with_context_parallel=False)
    for name in names:
        entry = tracker.setdefault(name, {"values": torch.zeros(num_layers, device=device),
                                          "reduce_group": None, "avg_group": None, "reduce_group_has_dp": False})
        values = entry["values"]
        if entry.get("reduce_group") is not None:
            dist.all_reduce(values, group=entry["reduce_group"])
            if not entry.get("reduce_group_has_dp", False):
                dist.all_reduce(values, group=data_group, op=dist.ReduceOp.AVG)
        if entry.get("avg_group") is not None:
            dist.all_reduce(values, group=entry["avg_group"], op=dist.ReduceOp.AVG)
        values /= degree
        dist.all_reduce(values, group=ps.get_model_parallel_group())
        entry["reduce_group"] = entry["avg_group"] = None


def host_split_sizes(move_to_cpu):
    """megatron-core's maybe_move_tensor_to_cpu, giving the all-to-all split sizes as host
    numbers on a process without a GPU too: megatron-core converts them (as_numpy) only when
    they were on the GPU, and gloo's all_to_all_single takes numbers, not a tensor."""
    import torch

    def moved(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return moved


_OPTIMIZER_COMMON = ("optimizer", "param_state_sharding_type")


def fit_optimizer_state(state: dict, optimizer) -> dict:
    """A loaded optimizer state in the structure of this run's optimizer.

    Under expert parallelism megatron-core chains two optimizers (dense parameters, experts;
    their param groups flagged is_expert_parallel), without it one. The tensors load by
    parameter name either way (unprefixed keys); the param groups (lr, step, weight decay)
    are stored per optimizer, so a checkpoint of the other structure has them in the wrong
    place: each of this run's groups takes the saved group with the same multipliers.
    """
    from megatron.core.optimizer.optimizer import ChainedOptimizer, param_group_identifier_keys

    targets = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    wants_chained = len(targets) > 1
    if any(type(target).__name__ != "DistributedOptimizer" for target in targets):
        if any(isinstance(key, int) for key in state) == wants_chained:
            return state  # chained as this run's: megatron-core loads it as it is
        raise HeteroError(
            "the checkpoint's optimizer state was saved with another expert-parallel size, and only "
            "the distributed optimizer's state re-shards across expert-parallel sizes: resume it with "
            "--no-load-optim (the weights load, the optimizer starts afresh), and train with "
            "--use-distributed-optimizer to save checkpoints that move")
    entries = [state] + [value for key, value in state.items() if isinstance(key, int)]
    saved = [entry for entry in entries if "optimizer" in entry]
    if len(saved) == (len(targets) if wants_chained else 1) and (state is saved[0]) != wants_chained:
        return state  # saved as this run's optimizer is built
    groups = [group for entry in saved for group in entry["optimizer"]["param_groups"]]
    sharding_type = saved[0].get("param_state_sharding_type")
    keys = [key for key in param_group_identifier_keys if key != "is_expert_parallel"]

    def fitted(target) -> dict:
        result = []
        for group in target.optimizer.param_groups:
            same = [g for g in groups if all(g.get(k) == group.get(k) for k in keys)]
            same.sort(key=lambda g: g.get("is_expert_parallel") != group.get("is_expert_parallel"))
            if same:
                result.append({**same[0], "is_expert_parallel": group.get("is_expert_parallel")})
        return {"optimizer": {"param_groups": result}, "param_state_sharding_type": sharding_type}

    def tensors(entry: dict) -> dict:
        return {k: v for k, v in entry.items() if k not in _OPTIMIZER_COMMON and not isinstance(k, int)}

    if wants_chained:
        return {index: {**tensors(state.get(index, {})), **fitted(target)} for index, target in enumerate(targets)}
    return {**tensors(state), **fitted(targets[0])}
