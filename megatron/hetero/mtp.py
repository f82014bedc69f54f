"""Multi-token prediction: its losses in Megatron-LM's iteration line, under any plan.

megatron-core's GPTModel adds each MTP layer's mean loss of a micro-batch to a tracker on the
ranks that run the MTP layers (the last pipeline stage). Megatron-LM averages the tracker
over the data-parallel replicas, scales it by 1 / (micro-batches per replica) and prints it
from its last rank, which megatron-core's rank grid puts on the last stage. Under a plan the
replicas run different micro-batch counts and the printing rank may sit on any stage, so
every rank takes part: the tracker is summed over the pipeline (the other stages add zeros),
averaged over the data-parallel group and scaled by (data-parallel size / total micro-
batches) - the mean over all micro-batches of the iteration, which is Megatron-LM's value
whenever the replicas are equal.
"""

from __future__ import annotations

import argparse

import torch

from megatron.hetero.identity import compute_device
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

# The tracker's per-layer sums: megatron-core 0.17+ keeps each layer's loss, correct and total
# predictions (its acceptance rates) under these names; 0.16 kept the loss as "values".
_TRACKED = (("loss_values", "correct_values", "total_values")
            if hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker") else ("values",))


class MTPMetrics:
    """Collects the multi-token-prediction losses of one iteration (a collective: every rank
    calls it)."""

    def __init__(self, args: argparse.Namespace):
        self.num_layers = args.mtp_num_layers

    def collect(self, iteration: int, data_parallel_size: int, total_micro_batches: int,
                tensorboard=None, wandb=None) -> dict[str, float]:
        tracker = MTPLossLoggingHelper.tracker
        for key in _TRACKED:
            if key not in tracker:  # a rank without MTP layers adds zeros
                tracker[key] = torch.zeros(self.num_layers, device=compute_device())
        tracker["reduce_group"] = parallel_state.get_pipeline_model_parallel_group()
        tracker["avg_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
        totals: dict = {}
        MTPLossLoggingHelper.track_mtp_metrics(data_parallel_size / total_micro_batches, iteration,
                                               tensorboard, wandb, totals)
        return {name: float(value) for name, value in totals.items()}
