"""Loading a checkpoint, this runtime's or Megatron-LM's, under any plan.

Tensors are saved by global name and offset (megatron-core ShardedTensors), so a torch_dist
checkpoint loads under any other plan: another stage split, other TP/PP/DP degrees, rank
order or micro-batch split, the tensors re-sharded. The manifest is checked first, so a
truncated or corrupted file is named instead of failing deep inside torch; --ckpt-step N
loads an older iteration. What the checkpoint says of itself (its model's shape, layout,
optimizer form, content metadata) is read from its "hetero" section, or from the arguments
Megatron-LM stored; a checkpoint of another model, or whose optimizer state this run cannot
read, is refused with the way out. Megatron-LM's legacy torch format loads under the layout
that wrote it only (legacy.py).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hetero import events
from hetero.errors import HeteroError
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.hetero import stage_tensor_parallel, template_reduction
from megatron.hetero.arguments import vocab_divisor_giving
from megatron.hetero.checkpointing import legacy as checkpoint_legacy
from megatron.hetero.checkpointing.manifest import (
    TRACKER,
    complete_iterations,
    is_complete,
    iteration_dir,
    latest_iteration,
    verify_manifest,
)
from megatron.hetero.checkpointing.save import _rank_0_step
from megatron.hetero.checkpointing.state import (
    MODEL_SHARDING,
    OPTIMIZER_SHARDING,
    _carried,
    _layout,
    _layout_text,
    _restore_rng,
    _set_rng_state,
    _stage_degrees,
    _state,
    apply_loaded,
    model_chunks_of,
    model_keys,
    model_shape,
)
from megatron.hetero.log import print_rank_0


def _iteration_to_load(root: str, ckpt_step: int | None) -> int | None:
    """--ckpt-step N, or the tracker's iteration."""
    if ckpt_step is None:
        return latest_iteration(root)
    if not is_complete(iteration_dir(root, ckpt_step)):
        complete = complete_iterations(Path(root))
        raise HeteroError(f"--ckpt-step {ckpt_step}: {iteration_dir(root, ckpt_step)} is not a complete "
                          f"checkpoint; complete ones under {root}: {', '.join(map(str, complete)) or 'none'}")
    return ckpt_step


def _loaded(root: str, iteration: int, common: dict, sizes, start: float,
            args: argparse.Namespace) -> tuple[int, float]:
    """What every load ends with (either format): the carried counters, Megatron-LM's line,
    the event; the iteration to continue from (0 with --finetune) and the seconds taken."""
    _carried["num_floating_point_operations_so_far"] = common.get("num_floating_point_operations_so_far", 0.0)
    seconds = time.perf_counter() - start
    print_rank_0(f"  successfully loaded checkpoint from {root} {_layout_text(sizes)} at iteration {iteration} "
                 f"({seconds:.2f} s)")
    if dist.get_rank() == 0:
        events.emit(events.CheckpointLoaded(iteration=iteration, directory=str(root)))
    return (0 if args.finetune else common["iteration"]), seconds


def _load_legacy(root: str, directory: Path, iteration: int, model, optimizer, scheduler,
                 args: argparse.Namespace, start: float) -> tuple[int, float]:
    """Megatron-LM's legacy per-rank format (--ckpt-format torch): loaded under the layout
    that wrote it; another layout is refused with the way over (one torch_dist save)."""
    if args.ckpt_format != "torch" and not args.auto_detect_ckpt_format:
        raise HeteroError(
            f"{directory} holds a checkpoint in Megatron-LM's legacy torch format (mp_rank_* files), this "
            "run reads torch_dist: add --ckpt-format torch (checkpoints are then written in that format "
            "too) or --auto-detect-ckpt-format (written in torch_dist, which loads under any plan)")
    common = checkpoint_legacy.read_common(directory)
    saved = _saved_facts(common)
    _check_same_model(directory, saved, common, args)
    sizes, _ = _layout()
    chunks = model_chunks_of(model)
    keys = model_keys(len(chunks))
    problem = checkpoint_legacy.layout_problem(directory, common, sizes, _stage_degrees(), len(chunks), keys)
    _raise_legacy_layout(directory, common, problem)
    # As Megatron-LM: a checkpoint saved with --no-save-optim gives back the weights only.
    restore_optimizer = not args.no_load_optim and not args.finetune and saved.get("optimizer_saved", True)
    _check_optimizer_form(directory, saved, args, restore_optimizer)
    print_rank_0(f" loading checkpoint from {root} at iteration {iteration} (Megatron-LM's torch format)")
    failure, rng = None, None
    try:
        rng = checkpoint_legacy.load(directory, chunks, keys, optimizer, scheduler,
                                     restore_optimizer=restore_optimizer,
                                     restore_rng=not args.no_load_rng and not args.finetune,
                                     distributed_optimizer=bool(args.use_distributed_optimizer))
    except HeteroError as err:
        failure = str(err)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failure)
    _raise_legacy_layout(directory, common, next((f for f in gathered if f), None))
    if rng is not None:
        _set_rng_state(rng)
    return _loaded(root, iteration, common, sizes, start, args)


def _raise_legacy_layout(directory: Path, common: dict, problem: str | None) -> None:
    """The same refusal on every rank when any rank's layout does not fit the files."""
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is None:
        return
    ckpt_args = common.get("args", argparse.Namespace())
    tp = getattr(ckpt_args, "tensor_model_parallel_size", 1)
    pp = getattr(ckpt_args, "pipeline_model_parallel_size", 1)
    raise HeteroError(
        f"the checkpoint in {directory} is in Megatron-LM's legacy torch format, whose per-rank pieces "
        f"load only under the layout that wrote them: {first}. Resume it once under that layout "
        f"(--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}, Megatron-LM's even "
        f"split, no --hetero-plan) with --auto-detect-ckpt-format --ckpt-format torch_dist --save NEWDIR "
        f"--exit-interval {common.get('iteration', 0) + 1} (one iteration, then a torch_dist checkpoint), "
        "then resume --load NEWDIR under this plan: torch_dist loads under any plan")


def _shape_of_megatron_args(ckpt_args: argparse.Namespace) -> dict:
    """model_shape() of the arguments Megatron-LM stored under "args"."""
    fields = dict(vars(ckpt_args))
    dtype = fields.get("params_dtype")
    fields["params_dtype"] = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    return model_shape(argparse.Namespace(**fields))


def _saved_facts(common: dict) -> dict:
    """What the checkpoint says of itself: the "hetero" section this runtime writes, or, in
    one Megatron-LM wrote, the same facts read from its stored arguments."""
    if "hetero" in common:
        return common["hetero"]
    ckpt_args = common.get("args")
    if ckpt_args is None:
        return {}
    return {"model_shape": _shape_of_megatron_args(ckpt_args),
            "layout": [getattr(ckpt_args, "pipeline_model_parallel_size", 1),
                       getattr(ckpt_args, "tensor_model_parallel_size", 1),
                       getattr(ckpt_args, "data_parallel_size", None)],
            "stage_tensor_parallel": None,
            "distributed_optimizer": bool(getattr(ckpt_args, "use_distributed_optimizer", False)),
            "rng_form": None if getattr(ckpt_args, "no_save_rng", False) else "megatron-lm",
            "optimizer_saved": not getattr(ckpt_args, "no_save_optim", False),
            "written_by": "Megatron-LM"}


def _saved_metadata(common: dict, saved: dict) -> dict:
    """The content metadata to read the checkpoint with: as stored, or for checkpoints of
    earlier releases (none stored), what they were written with."""
    stored = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if stored is not None:
        return stored
    if "hetero" in common:
        return {**(MODEL_SHARDING if saved.get("layer_keys") == "per-layer" else {}), **OPTIMIZER_SHARDING}
    return {}


def _vocabulary_fix(theirs: dict, ours: dict, common: dict, args: argparse.Namespace) -> str | None:
    """The flag that gives this run the checkpoint's (padded) vocabulary, when that is what
    differs."""
    if theirs.get("padded_vocab_size") in (None, ours["padded_vocab_size"]):
        return None
    padded = theirs["padded_vocab_size"]
    ckpt_args = common.get("args")
    divisor = vocab_divisor_giving(padded, args.tokenizer_vocab_size, args)
    if divisor is not None:
        return (f"the checkpoint's vocabulary is padded to {padded}, this run pads its tokenizer's "
                f"{args.tokenizer_vocab_size} to {ours['padded_vocab_size']}: resume with "
                f"--make-vocab-size-divisible-by {divisor}")
    named = [f"--{name.replace('_', '-')} {getattr(ckpt_args, name)}" for name in
             ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size")
             if ckpt_args is not None and getattr(ckpt_args, name, None) is not None]
    written = f" (it was written with {' '.join(named)})" if named else ""
    return (f"the checkpoint's vocabulary is padded to {padded}, which no --make-vocab-size-divisible-by "
            f"gives this run's tokenizer ({args.tokenizer_vocab_size} tokens): resume with the tokenizer "
            f"and vocabulary file it was written with{written}")


def _check_same_model(directory: Path, saved: dict, common: dict, args: argparse.Namespace) -> None:
    theirs, ours = saved.get("model_shape", {}), model_shape(args)
    vocabulary = _vocabulary_fix(theirs, ours, common, args)
    if vocabulary:
        raise HeteroError(f"the checkpoint in {directory} has another vocabulary: {vocabulary}")
    different = [f"{k}: checkpoint {theirs.get(k)!r}, this run {ours[k]!r}"
                 for k in ours if k in theirs and theirs[k] != ours[k]]
    if different:
        raise HeteroError(
            f"the checkpoint in {directory} is of another model ({'; '.join(different)}); load it "
            "with the flags it was written with, or point --load at a checkpoint of this model"
        )


def _check_optimizer_form(directory: Path, saved: dict, args: argparse.Namespace, restore_optimizer: bool) -> None:
    saved_sharded = saved.get("distributed_optimizer")
    if restore_optimizer and saved_sharded is not None and saved_sharded != bool(args.use_distributed_optimizer):
        written = "with" if saved_sharded else "without"
        raise HeteroError(
            f"the checkpoint in {directory} was written {written} the distributed optimizer, whose "
            f"optimizer state has another form; resume {written} --use-distributed-optimizer "
            "(a plan from hetero-plan chooses it), or pass --no-load-optim to load the weights only"
        )



def load_checkpoint(root: str, model, optimizer, scheduler, args: argparse.Namespace) -> tuple[int, float]:
    """Restores the latest checkpoint under root (this runtime's or Megatron-LM's); model is
    the list of this rank's chunks (or one chunk). Returns (iteration, seconds), or (0, 0) if
    there is none.

    Under the same layout everything comes back, RNG included, so training continues as
    if never stopped. Under another layout (re-planned) the tensors are re-sharded; the
    per-rank RNG streams have no counterpart and are left as seeded.
    """
    iteration = _iteration_to_load(root, args.ckpt_step)
    if iteration is None:
        print_rank_0(f"WARNING: no checkpoint in {root} ({TRACKER} not found); starting from scratch")
        return 0, 0.0
    start = time.perf_counter()
    directory = iteration_dir(root, iteration)
    older = [i for i in complete_iterations(Path(root)) if i < iteration]
    _rank_0_step(lambda: verify_manifest(directory, iteration, older), "checking the checkpoint")
    if checkpoint_legacy.holds_legacy(directory):
        return _load_legacy(root, directory, iteration, model, optimizer, scheduler, args, start)
    common = dist_checkpointing.load_common_state_dict(str(directory))
    saved = _saved_facts(common)
    metadata = _saved_metadata(common, saved)
    _check_same_model(directory, saved, common, args)
    sizes, _ = _layout()
    same_layout = _stage_degrees() == saved.get("stage_tensor_parallel") and (
        template_reduction.active() or list(sizes) == saved.get("layout"))  # templates: every shape is in the degrees
    # None: Megatron-LM's --no-save-rng; absent: this runtime's earlier form (one per rank).
    rng_form = saved.get("rng_form", "per-rank-dict")
    restore_rng = same_layout and not args.no_load_rng and not args.finetune and rng_form is not None
    # As Megatron-LM: a checkpoint saved with --no-save-optim gives back the weights only.
    restore_optimizer = not args.no_load_optim and not args.finetune and saved.get("optimizer_saved", True)
    _check_optimizer_form(directory, saved, args, restore_optimizer)
    saved_sharded = saved.get("distributed_optimizer")
    sharding_type = metadata.get("distrib_optim_sharding_type")
    if (restore_optimizer and saved_sharded and not same_layout
            and sharding_type not in (None, *DistributedOptimizer.checkpoint_fully_reshardable_formats)):
        raise HeteroError(
            f"the checkpoint in {directory} holds its distributed-optimizer state per data-parallel "
            f"rank ({sharding_type}), which loads only under the layout it was written with (PP, TP, DP) = "
            f"{tuple(saved.get('layout', ()))}, not {sizes}: save it in Megatron-LM with "
            "--dist-ckpt-optim-fully-reshardable, resume under that layout, or pass --no-load-optim")
    print_rank_0(f" loading checkpoint from {root} at iteration {iteration}"
                 + (" (written by Megatron-LM)" if saved.get("written_by") else ""))
    stacked = not metadata.get("singleton_local_shards", False)
    state = _state(model, optimizer, scheduler, loading=True, optimizer_state=restore_optimizer,
                   metadata=metadata,
                   rng=restore_rng and ("per-rank-dict" if rng_form != "megatron-lm" else True))
    strategy = get_default_load_sharded_strategy(str(directory))
    if args.ckpt_fully_parallel_load:
        strategy = FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    # A tied table's last-stage copy is read at its own degree from the first stage's key, and
    # stacked layers are read at each stage's own degree: shardings megatron-core's regular
    # grid check would refuse, though every rank reads a rectangular piece of the saved tensor.
    irregular = stage_tensor_parallel.tied_across_degrees() or (
        stacked and stage_tensor_parallel.active_plan() is not None)
    try:
        loaded = dist_checkpointing.load(state, str(directory), strategy, strict=args.dist_ckpt_strictness,
                                         validate_access_integrity=not irregular)
    except CheckpointingException as err:
        first = str(err).strip().splitlines()[0][:400]
        raise HeteroError(
            f"loading {directory} with --dist-ckpt-strictness {args.dist_ckpt_strictness}: the "
            f"checkpoint and this run do not hold the same tensors ({first} ...); with --no-load-optim, "
            "--finetune or --skip-train the optimizer state is not loaded, which the raise_* modes "
            "count as unexpected: use assume_ok_unexpected (the default) or log_all") from None
    if StrictHandling(args.dist_ckpt_strictness) in (StrictHandling.RETURN_UNEXPECTED,
                                                     StrictHandling.RETURN_ALL):
        loaded, missing, unexpected = loaded
        print_rank_0(f"  checkpoint keys missing from the checkpoint: {sorted(missing) or 'none'}; "
                     f"not used by the model: {sorted(unexpected) or 'none'}")
    apply_loaded(loaded, model, optimizer, scheduler, restore_optimizer)
    if restore_rng:
        _restore_rng(loaded["rng_state"])
    elif not same_layout:
        theirs_tp, ours_tp = saved.get("stage_tensor_parallel"), _stage_degrees()
        print_rank_0(f"  the checkpoint was written under layout (PP, TP, DP) = {tuple(saved.get('layout', ()))}"
                     + (f", stage TP {theirs_tp}" if theirs_tp else "") + f"; this run is {sizes}"
                     + (f", stage TP {ours_tp}" if ours_tp else "") + ": tensors re-sharded, random streams "
                     "start from --seed")
    return _loaded(root, iteration, common, sizes, start, args)
