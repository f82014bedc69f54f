"""Megatron-LM's legacy per-rank checkpoint format (--ckpt-format torch).

    DIR/iter_0000010/mp_rank_00/model_optim_rng.pt         without pipeline parallelism
    DIR/iter_0000010/mp_rank_01_002/model_optim_rng.pt     tensor rank 1, pipeline rank 2
    DIR/iter_0000010/mp_rank_01_002/distrib_optim.pt       the distributed optimizer's state

Each (tensor, pipeline) rank's file holds that rank's own pieces of the model ("model", or
"model0", "model1", ... per virtual stage), its optimizer's state_dict, the scheduler,
"rng_state" (a list with one state per data-parallel rank), "args", "iteration",
"checkpoint_version" and "num_floating_point_operations_so_far"; the first data-parallel
replica writes it, as in Megatron-LM. The pieces are cut by the layout that wrote them, so
the format loads only under that layout: same tensor- and pipeline-parallel sizes, same
layers per stage. load.py names the way to another plan (load it once with
--auto-detect-ckpt-format and save torch_dist, which every plan reads).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from hetero.errors import HeteroError
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

MODEL_FILE = "model_optim_rng.pt"
OPTIMIZER_FILE = "distrib_optim.pt"


def holds_legacy(directory: Path) -> bool:
    """Whether an iteration directory is in the legacy format (its per-rank folders)."""
    return any(directory.glob(f"mp_rank_*/{MODEL_FILE}"))


def rank_folder(directory: Path, tensor_rank: int, pipeline_rank: int, pipeline_parallel: bool) -> Path:
    """Megatron-LM's get_checkpoint_name: mp_rank_TT, or mp_rank_TT_PPP with pipeline stages."""
    name = f"mp_rank_{tensor_rank:02d}" + (f"_{pipeline_rank:03d}" if pipeline_parallel else "")
    return directory / name


def _this_rank_folder(directory: Path) -> Path:
    return rank_folder(directory, parallel_state.get_tensor_model_parallel_rank(),
                       parallel_state.get_pipeline_model_parallel_rank(),
                       parallel_state.get_pipeline_model_parallel_world_size() > 1)


def save(directory: Path, model_chunks: list, model_keys: list[str], optimizer, scheduler, common: dict,
         rng_state: dict, distributed_optimizer: bool, save_optimizer: bool = True, save_rng: bool = True) -> None:
    """Writes this rank's file (the first data-parallel replica of each model-parallel rank);
    a collective over the data-parallel group with the distributed optimizer. Without
    save_optimizer / save_rng (--no-save-optim, --no-save-rng) those entries are left out."""
    folder = _this_rank_folder(directory)
    group = parallel_state.get_data_parallel_group()
    states = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, rng_state, group=group)
    # One writer per model-parallel rank: context ranks hold the same weights (as Megatron-LM).
    writer = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
    if distributed_optimizer and save_optimizer:  # gathered to the first replica, which writes it
        optimizer.save_parameter_state(str(folder / OPTIMIZER_FILE))
    if not writer:
        return
    state = dict(common)
    for key, chunk in zip(model_keys, model_chunks):
        state[key] = unwrap_model(chunk).state_dict_for_save_checkpoint()
    if save_optimizer:
        state["optimizer"] = optimizer.state_dict()
        state["opt_param_scheduler"] = scheduler.state_dict()
    if save_rng:
        state["rng_state"] = states
    torch.save(state, folder / MODEL_FILE)


def read_common(directory: Path) -> dict:
    """The first rank file's entries other than the model and optimizer (args, iteration, ...)."""
    first = sorted(directory.glob(f"mp_rank_*/{MODEL_FILE}"))[0]
    state = torch.load(first, map_location="cpu", weights_only=False)
    return {k: v for k, v in state.items() if not k.startswith("model") and k != "optimizer"}


def layout_problem(directory: Path, common: dict, sizes: tuple[int, int, int], stage_degrees: list[int] | None,
                   num_chunks: int, model_keys: list[str]) -> str | None:
    """Why this run's layout cannot read the legacy checkpoint, or None."""
    ckpt_args = common.get("args", argparse.Namespace())
    tp = getattr(ckpt_args, "tensor_model_parallel_size", 1)
    pp = getattr(ckpt_args, "pipeline_model_parallel_size", 1)
    if stage_degrees is not None or (sizes[0], sizes[1]) != (pp, tp):
        run_tp = sizes[1] if stage_degrees is None else f"{stage_degrees} (per stage)"
        return (f"it was written with tensor-parallel size {tp} and pipeline-parallel size {pp}, this run "
                f"has {run_tp} and {sizes[0]}")
    folder = _this_rank_folder(directory)
    if not (folder / MODEL_FILE).exists():
        return f"{folder / MODEL_FILE} is missing"
    return None


def load(directory: Path, model_chunks: list, model_keys: list[str], optimizer, scheduler, *,
         restore_optimizer: bool, restore_rng: bool, distributed_optimizer: bool) -> dict | None:
    """Loads this rank's file into the model (and optimizer, scheduler); returns the saved
    RNG state for this replica when asked, else None. Raises a HeteroError when the file's
    pieces do not fit this rank's model (another split of the layers)."""
    folder = _this_rank_folder(directory)
    state = torch.load(folder / MODEL_FILE, map_location="cpu", weights_only=False)
    keys = [k for k in model_keys if k in state] if len(model_keys) > 1 else ["model"]
    saved_keys = sorted(k for k in state if k.startswith("model"))
    if len(keys) != len(model_keys) or len(saved_keys) != len(model_keys):
        raise HeteroError(f"{folder / MODEL_FILE} holds {len(saved_keys)} model chunk(s) "
                          f"({', '.join(saved_keys)}), this run's rank {len(model_keys)}")
    for key, chunk in zip(model_keys, model_chunks):
        try:
            unwrap_model(chunk).load_state_dict(state[key], strict=True)
        except RuntimeError as err:
            first = str(err).strip().splitlines()[0][:200]
            raise HeteroError(f"{folder / MODEL_FILE} does not fit this rank's layers ({first})") from None
    if restore_optimizer and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
        if distributed_optimizer:
            optimizer.load_parameter_state(str(folder / OPTIMIZER_FILE))
        scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()
    if not restore_rng or not state.get("rng_state"):
        return None
    states = state["rng_state"]
    rank = parallel_state.get_data_parallel_rank()
    return states[rank] if rank < len(states) else states[0]
