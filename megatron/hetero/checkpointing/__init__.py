"""Checkpoints: Megatron-LM's layout, megatron-core's distributed format, atomic, re-shardable.

    DIR/latest_checkpointed_iteration.txt     the last complete checkpoint's iteration
    DIR/iter_0000010/                         megatron-core dist checkpoint (torch_dist)
    DIR/iter_0000010/hetero_plan.json         the plan that wrote it

Tensors are saved by global name and offset (megatron-core ShardedTensors), so a
checkpoint loads under any other plan: another stage split, other TP/PP/DP degrees, rank
order or micro-batch split. That is what one needs after a node dies: re-plan on the
survivors and continue.

Atomic: every rank writes into iter_N.tmp; once all have finished, rank 0 writes the
manifest (every file's size and checksum), renames the directory to iter_N and then
replaces the tracker file. A crash at any point leaves the tracker naming a complete
checkpoint; a leftover .tmp directory is never read and is removed by the next save. A
save that fails on any rank (a full or read-only disk) fails on every rank with the
reason, before anything is renamed. At --load the manifest is checked, so a truncated or
corrupted file is named instead of failing deep inside torch; --ckpt-step N loads an
older iteration. With --async-save the tensors are written in the background and the
manifest, rename and tracker update run as the save's finalization, once every rank's
write has completed.

The checkpoint is also Megatron-LM's (docs/checkpoints.md maps every key): the model under
"model" ("model0", "model1", ... one per virtual stage of an interleaved run), "optimizer",
"opt_param_scheduler", "rng_state", "args", "iteration", "checkpoint_version" and
"num_floating_point_operations_so_far", with the sharding choices recorded as megatron-core
content metadata, which Megatron-LM's load_checkpoint reads back. A checkpoint Megatron-LM
wrote loads here the same way, under any plan.

Megatron-LM's checkpoint flags are passed on to megatron-core: --ckpt-fully-parallel-save
(the default; --no-ckpt-fully-parallel-save turns it off) and --ckpt-fully-parallel-load
spread the replicated tensors over the data-parallel ranks, --dist-ckpt-strictness says
what loading does with keys only one side has.

Modules: ``manifest`` (the directory: tracker, iterations, each one's manifest), ``state``
(the sharded state dict and its content metadata, the layout, the RNG, the state a snapshot
holds), ``save`` (the atomic, optionally background save), ``load`` (the load under any
plan, the checks of what the checkpoint holds) and ``legacy`` (Megatron-LM's per-rank
--ckpt-format torch).
"""

from megatron.hetero.checkpointing.manifest import TRACKER, iteration_dir, latest_iteration
from megatron.hetero.checkpointing import legacy
from megatron.hetero.checkpointing.state import (
    CONTENT_METADATA,
    MODEL_SHARDING,
    OPTIMIZER_SHARDING,
    apply_loaded,
    floating_point_operations_so_far,
    model_chunks_of,
    model_keys,
    model_shape,
    common_state_for_memory,
    state_for_memory,
)
from megatron.hetero.checkpointing.save import finalize_pending_saves, save_checkpoint
from megatron.hetero.checkpointing.load import load_checkpoint

__all__ = [
    "CONTENT_METADATA",
    "MODEL_SHARDING",
    "OPTIMIZER_SHARDING",
    "TRACKER",
    "apply_loaded",
    "finalize_pending_saves",
    "floating_point_operations_so_far",
    "iteration_dir",
    "latest_iteration",
    "legacy",
    "load_checkpoint",
    "model_chunks_of",
    "model_keys",
    "model_shape",
    "save_checkpoint",
    "common_state_for_memory",
    "state_for_memory",
]
