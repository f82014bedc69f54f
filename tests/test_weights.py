"""Plan-independent initial weights: the shard rule agrees with megatron-core's own."""

import pytest
import torch

from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu
from megatron.hetero.weights import draw_full, tensor_parallel_shard


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("partition_dim", [0, 1])
def test_shards_match_megatron_core_master_weight_split(stride, world, partition_dim):
    full = torch.randn(16, 24)
    shard_size = full.shape[partition_dim] // world
    for rank in range(world):
        shape = list(full.shape)
        shape[partition_dim] = shard_size
        weight = torch.empty(shape)
        _initialize_affine_weight_cpu(
            weight, full.shape[0], full.shape[1], shard_size, partition_dim,
            init_method=lambda master: master.copy_(full), stride=stride, rank=rank, world_size=world,
        )
        ours = tensor_parallel_shard(full, partition_dim, shard_size, stride, rank, world)
        assert torch.equal(ours, weight)


def test_draws_depend_on_seed_and_name_only():
    normal = lambda t: torch.nn.init.normal_(t, std=0.02)  # noqa: E731
    a = draw_full("decoder.layers.3.mlp.linear_fc1.weight", (8, 4), 7, normal)
    torch.manual_seed(999)  # the global generator must not matter
    b = draw_full("decoder.layers.3.mlp.linear_fc1.weight", (8, 4), 7, normal)
    assert torch.equal(a, b)
    assert not torch.equal(a, draw_full("decoder.layers.2.mlp.linear_fc1.weight", (8, 4), 7, normal))
    assert not torch.equal(a, draw_full("decoder.layers.3.mlp.linear_fc1.weight", (8, 4), 8, normal))


def test_vocabulary_rows_do_not_depend_on_padding():
    normal = lambda t: torch.nn.init.normal_(t, std=0.02)  # noqa: E731
    small = draw_full("embedding.word_embeddings.weight", (1001, 8), 1, normal)
    padded = draw_full("embedding.word_embeddings.weight", (1280, 8), 1, normal)
    assert torch.equal(small, padded[:1001])
