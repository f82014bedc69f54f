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
"""

from __future__ import annotations

import argparse

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
    return names


class MoEMetrics:
    """Collects the router losses of one iteration (a collective: every rank calls it)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.names = tracked_losses(args)

    def collect(self, iteration: int, data_parallel_size: int, total_micro_batches: int,
                tensorboard=None, wandb=None) -> dict[str, float]:
        totals: dict = {}
        track_moe_metrics(
            loss_scale=data_parallel_size / total_micro_batches,
            iteration=iteration,
            writer=tensorboard,
            wandb_writer=wandb,
            total_loss_dict=totals,
            force_initialize=True,
            track_names=self.names,
            num_layers=self.args.num_layers,
            moe_layer_freq=1,
        )
        return {name: float(value) for name, value in totals.items()}
