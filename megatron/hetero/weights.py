"""Initial weights that depend only on the seed and a parameter's global name.

megatron-core draws initial weights from one generator in construction order, so the
weights a stage gets depend on which layers it builds: a different stage split, TP degree
or vocabulary padding gives a different model from the same seed. Here each randomly
initialised tensor is drawn whole from its own generator, seeded by (seed, global name),
and each rank keeps its tensor-parallel shard, so every plan starts from the same model.
Vocabulary-sized tensors are drawn in fixed blocks of rows, so the real rows do not
depend on how far the table is padded.
"""

from __future__ import annotations

import hashlib
import re
from typing import Callable, Iterator

import torch

from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

_VOCAB_ROW_BLOCK = 64
_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)(\d+)\.|(\.experts\.linear_fc[12]\.weight)(\d+)$")
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def global_parameter_names(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name in the unsplit model, parameter): decoder layers get their global index."""
    layer_names = {}
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        for local_index, layer in enumerate(decoder.layers):
            layer_names[f"decoder.layers.{local_index}."] = f"decoder.layers.{layer.layer_number - 1}."
    # Expert parallelism: this rank holds the experts from ep_rank x (its expert count) on,
    # numbered from 0 in the names (SequentialMLP's local_experts.<i>, a grouped MLP's weight<i>).
    experts = getattr(getattr(model, "config", None), "num_moe_experts", None)
    offset = (experts // parallel_state.get_expert_model_parallel_world_size()
              * parallel_state.get_expert_model_parallel_rank()) if experts else 0

    def global_expert(match: re.Match) -> str:
        if match.group(1):
            return f"{match.group(1)}{offset + int(match.group(2))}."
        return f"{match.group(3)}{offset + int(match.group(4))}"

    for name, param in model.named_parameters():
        for local, global_ in layer_names.items():
            if name.startswith(local):
                name = global_ + name[len(local):]
                break
        if offset and is_expert(name):
            name = _LOCAL_EXPERT.sub(global_expert, name)
        yield name, param


def _init_method_for(name: str, config: TransformerConfig) -> Callable[[torch.Tensor], None]:
    if name.startswith("embedding."):
        return config.embedding_init_method
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return config.output_layer_init_method
    return config.init_method


def _draw(shape: tuple[int, ...], seed: int, init: Callable[[torch.Tensor], None]) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tensor = torch.empty(shape, dtype=torch.float32)
        init(tensor)
    return tensor


def draw_full(name: str, shape: tuple[int, ...], seed: int, init) -> torch.Tensor:
    """The whole (unsplit) tensor for a parameter name; vocabulary tables by row blocks."""
    if name not in _VOCAB_PARAMS:
        return _draw(shape, _seed_for(seed, name), init)
    rows, rest = shape[0], shape[1:]
    blocks = [
        _draw((_VOCAB_ROW_BLOCK, *rest), _seed_for(seed, f"{name}/rows{start}"), init)
        for start in range(0, rows, _VOCAB_ROW_BLOCK)
    ]
    return torch.cat(blocks)[:rows]


def tensor_parallel_shard(
    full: torch.Tensor, partition_dim: int, shard_size: int, stride: int, rank: int, world: int
) -> torch.Tensor:
    """Rank's shard of an unsplit tensor, cut the way megatron-core cuts a master weight.

    With stride s the tensor is s interleaved blocks per rank ([gate; up] of SwiGLU's fc1
    has stride 2): rank r keeps pieces r, r+world, ... of size shard_size/s.
    """
    pieces = torch.split(full, shard_size // stride, dim=partition_dim)
    return torch.cat(pieces[rank::world], dim=partition_dim)


def is_expert(name: str) -> bool:
    """Whether a parameter belongs to a routed expert (not a shared expert, not the router)."""
    return ".mlp.experts." in name


def _tensor_parallel(param: torch.nn.Parameter, expert: bool) -> tuple[int, int]:
    """(rank, size) of the group that splits param: an expert's is the expert
    tensor-parallel group (--expert-tensor-parallel-size), which may differ from the
    tensor-parallel group."""
    if expert:
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _local_shard(full: torch.Tensor, param: torch.nn.Parameter, expert: bool) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    rank, world = _tensor_parallel(param, expert)
    return tensor_parallel_shard(
        full,
        partition_dim=dim,
        shard_size=param.shape[dim],
        stride=getattr(param, "partition_stride", 1),
        rank=rank,
        world=world,
    )


def _full_shape(param: torch.nn.Parameter, expert: bool) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= _tensor_parallel(param, expert)[1]
    return tuple(shape)


@torch.no_grad()
def initialize_plan_independent(model: torch.nn.Module, config: TransformerConfig, seed: int) -> int:
    """Redraws every randomly initialised tensor (matrices and embeddings) of one stage.

    One-dimensional parameters (norm weights, biases) are constants in megatron-core and
    are left as built. Returns the number of tensors drawn.
    """
    shares_embedding = getattr(model, "share_embeddings_and_output_weights", False)
    drawn = 0
    for name, param in global_parameter_names(model):
        if param.dim() < 2:
            continue
        if name == "output_layer.weight" and shares_embedding:
            name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied table
        expert = is_expert(name)
        full = draw_full(name, _full_shape(param, expert), seed, _init_method_for(name, config))
        param.copy_(_local_shard(full, param, expert).to(param.dtype))
        drawn += 1
    return drawn
