"""--use-checkpoint-args: the model flags read back from the checkpoint the run loads.

Megatron-LM's load_args_from_checkpoint, applied before the flags are validated: the
checkpoint's stored arguments ("args" of its common state) give the model's shape. Some
fields always come from the checkpoint, the others only where the command line left them
unset; the parallel sizes come with --use-mp-args-from-checkpoint-args, the tokenizer unless
--no-use-tokenizer-model-from-checkpoint-args. Only flags this runtime honours are taken.
"""

from __future__ import annotations

import argparse

from hetero.errors import HeteroError

# Megatron-LM's lists (core_v0.16.1): taken from the checkpoint whatever the command line says ...
_ALWAYS = (
    "num_query_groups", "group_query_attention", "position_embedding_type", "add_position_embedding",
    "use_rotary_position_embeddings", "rotary_base", "rotary_percent", "rotary_interleaved",
    "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu", "untie_embeddings_and_output_weights",
    "apply_layernorm_1p", "normalization", "apply_query_key_layer_scaling", "attention_dropout",
    "hidden_dropout", "num_experts", "moe_layer_freq", "moe_router_topk", "moe_router_pre_softmax",
    "moe_grouped_gemm", "moe_shared_expert_intermediate_size", "moe_router_score_function",
    "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "tiktoken_pattern",
)
# ... and only where the command line gave none.
_UNLESS_GIVEN = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
                 "kv_channels", "max_position_embeddings", "moe_token_dispatcher_type", "ckpt_format")
_TOKENIZER = ("tokenizer_model", "tokenizer_type")
_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")


def _stored_args(root: str, step: int | None) -> argparse.Namespace | None:
    """The arguments stored with the checkpoint under root (its latest, or iteration step)."""
    from megatron.hetero import checkpointing
    from megatron.hetero.checkpointing import legacy as checkpoint_legacy
    from megatron.hetero.patches import import_megatron_core

    iteration = step if step is not None else checkpointing.latest_iteration(root)
    if iteration is None:
        return None
    directory = checkpointing.iteration_dir(root, iteration)
    if checkpoint_legacy.holds_legacy(directory):
        common = checkpoint_legacy.read_common(directory)
    else:
        import_megatron_core()
        from megatron.core import dist_checkpointing

        try:
            common = dist_checkpointing.load_common_state_dict(str(directory))
        except Exception as err:  # a damaged checkpoint: named, with the way out
            raise HeteroError(f"--use-checkpoint-args: cannot read the arguments stored in {directory} "
                              f"({type(err).__name__}: {err}); load another with --ckpt-step N") from None
    return common.get("args")


def apply_checkpoint_args(args: argparse.Namespace, honoured: frozenset[str]) -> list[str]:
    """Sets the model flags from the checkpoint of --pretrained-checkpoint, then of --load (as
    Megatron-LM, the later wins); returns what was set, for the start-up log."""
    if args.load is None and args.pretrained_checkpoint is None:
        raise HeteroError("--use-checkpoint-args reads the model flags from the checkpoint to load; "
                          "give --load DIR or --pretrained-checkpoint DIR")
    notes = []
    for root in (args.pretrained_checkpoint, args.load):
        stored = _stored_args(root, args.ckpt_step) if root is not None else None
        if stored is None:
            continue
        if hasattr(stored, "disable_bias_linear"):  # Megatron-LM's one-off conversion of old checkpoints
            stored.add_bias_linear = not stored.disable_bias_linear
        names = [*(((n, True) for n in _ALWAYS)), *((n, False) for n in _UNLESS_GIVEN)]
        if args.use_tokenizer_model_from_checkpoint_args:
            names += [(n, True) for n in _TOKENIZER]
        if args.use_mp_args_from_checkpoint_args:
            names += [(n, True) for n in _PARALLEL]
        for name, force in names:
            value = getattr(stored, name, None)
            if name not in honoured or value is None or (not force and getattr(args, name, None) is not None):
                continue
            if getattr(args, name, None) != value:
                notes.append(f"Setting {name} to {value} from checkpoint")
            setattr(args, name, value)
    return notes
