"""One micro-batch: the seeds of a rank, the batch it reads, the forward step and its loss.

Each data-parallel replica runs the 1F1B schedule over its own number of micro-batches;
megatron-core's per-token loss mode sums gradients and divides by the global token count,
so replicas of different size contribute exactly by the tokens they processed (loss_func
returns the summed loss and the token count).
"""

from __future__ import annotations

import argparse
import random
from functools import partial
from typing import Callable, Iterator

import numpy as np
import torch

from hetero.errors import HeteroError
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.hetero.core_compat import batch_on_this_cp_rank
from megatron.hetero.identity import this_rank


def rank_seed(seed: int, pp_rank: int, dp_rank: int, data_parallel_random_init: bool = False) -> int:
    """Megatron-LM's seed of a rank: a stream per pipeline stage, and with
    --data-parallel-random-init one per data-parallel replica too (their dropout differs;
    their weights stay replica 0's)."""
    return seed + 100 * pp_rank + (10 * dp_rank if data_parallel_random_init else 0)


def set_random_seed(seed: int, data_parallel_random_init: bool = False) -> None:
    """Megatron-LM's seeding: a different stream per pipeline stage, RNG tracker for TP."""
    seed = rank_seed(seed, parallel_state.get_pipeline_model_parallel_rank(),
                     parallel_state.get_data_parallel_rank(), data_parallel_random_init)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


# ----- one micro-batch -----------------------------------------------------------------


def get_batch(data_iterator: Iterator[dict] | None):
    """(tokens, labels, loss_mask, attention_mask, position_ids); Nones on middle stages."""
    if data_iterator is None:
        return None, None, None, None, None
    batch = next(data_iterator)
    batch = {k: v.to(this_rank().device, non_blocking=True) for k, v in batch.items() if v is not None}
    # Context parallelism: this rank's two load-balanced chunks of every sequence (the
    # attention mask keeps all its columns: context_parallel.py), as Megatron-LM's get_batch.
    batch = batch_on_this_cp_rank(batch)
    return (
        batch["tokens"],
        batch["labels"],
        batch["loss_mask"],
        batch.get("attention_mask"),
        batch["position_ids"],
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed loss and token count; the schedule and finalize_model_grads do the division."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])}
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask)


def checked_forward_step(data_iterator, model, rerun_mode: str = "disabled"):
    """forward_step whose loss function stops the run on a NaN or Inf loss before the data-
    parallel reduction, as Megatron-LM's loss_func does unless --no-check-for-nan-in-loss-and-grad."""
    output, loss_of = forward_step(data_iterator, model)
    return output, partial(_finite_loss, loss_of, rerun_mode)


def forward_step_for(args: argparse.Namespace) -> Callable:
    """The forward step the schedule runs: loss-checked unless --no-check-for-nan-in-loss-and-grad."""
    if not args.check_for_nan_in_loss_and_grad:
        return forward_step
    return partial(checked_forward_step, rerun_mode=args.rerun_mode)


def _finite_loss(loss_of: Callable, rerun_mode: str, output_tensor: torch.Tensor):
    loss, num_tokens, report = loss_of(output_tensor)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for kind, bad in (("NaN", torch.isnan), ("Inf", torch.isinf)):
        if bad(loss).any():
            unchecked = (" The iteration was not re-run to tell a transient fault from a reproducible one "
                         "(Megatron-LM's --rerun-mode validate_results would)." if rerun_mode == "validate_results" else "")
            raise HeteroError(
                f"found {kind} in local forward loss calculation on rank {rank}; "
                f"lower --lr or check the data (--no-check-for-nan-in-loss-and-grad trains on).{unchecked}")
    return loss, num_tokens, report


def chunk_data_iterators(data_iterator, num_chunks: int):
    """The schedule's data: one iterator, or with virtual stages one per model chunk, where
    only the chunk holding the model's first (embedding) or last (loss) layers reads."""
    if num_chunks == 1:
        return data_iterator
    reading = 0 if parallel_state.is_pipeline_first_stage() else num_chunks - 1
    return [data_iterator if chunk == reading else None for chunk in range(num_chunks)]
