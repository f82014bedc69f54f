"""Multi-latent attention (--multi-latent-attention, DeepSeek's MLA) on megatron-core's local layers.

MLA's core attention has a key head size (qk_head_dim + qk_pos_emb_head_dim) different from
its value head size (v_head_dim) and its own softmax scale (YaRN's mscale included);
megatron-core's local DotProductAttention takes them through a patch (patches/layers.py). Checked
against softmax(Q K^T * scale + causal mask) V on random tensors under tensor parallelism
(gradients included), the flags against Megatron-LM's rules, and whole jobs - MLA with MoE
and a shared expert, a DeepSeek-V3-shaped proxy - on one process, TP 2, CP 2 and TP 2 x 2 stages.
"""

import math

import pytest
import torch

from conftest import TRAINING, assert_same_training, make_plan, run_pretrain
from hetero.errors import HeteroError
from megatron.hetero.arguments import parse_args
from spawned_ranks import run_on_ranks

MLA = [
    "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
    "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
]
YARN = ["--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "0.707", "--mscale-all-dim", "0.707"]
# DeepSeek-V3's shape in miniature: MLA with YaRN RoPE, a dense first layer then MoE layers
# with a shared expert and sigmoid routing with expert bias.
DENSE = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]
DEEPSEEK_PROXY = [
    *DENSE, *MLA, *YARN,
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
    "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]+[1]*3)",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3",
    "--moe-token-dispatcher-type", "alltoall",
]


def yarn_mscale(scaling_factor: float, mscale_all_dim: float) -> float:
    """YaRN's attention-temperature factor (DeepSeek-V3's yarn_get_mscale)."""
    return 1.0 if scaling_factor <= 1 else 0.1 * mscale_all_dim * math.log(scaling_factor) + 1.0


def reference_attention(query, key, value, scale):
    """softmax(Q K^T * scale + causal mask) V: [s, b, n, dk] x2 and [s, b, n, dv] in, [s, b, n*dv] out."""
    scores = torch.einsum("qbnd,kbnd->bnqk", query, key) * scale
    length = query.size(0)
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bnqk,kbnd->qbnd", scores.softmax(-1), value)
    return out.reshape(length, query.size(1), -1)


def _attention_rank(rank, world):
    """One tensor-parallel rank: MLA's layer builds megatron-core's DotProductAttention
    (patched) with MLA's sizes and scale; its heads run against the reference."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(0)  # the attention's dropout region forks its RNG tracker
    heads, qk, pos, v, scaling, mscale_all_dim = 4, 16, 8, 12, 4.0, 0.707
    config = MLATransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=heads, q_lora_rank=32, kv_lora_rank=16,
        qk_head_dim=qk, qk_pos_emb_head_dim=pos, v_head_dim=v, rope_type="yarn",
        rotary_scaling_factor=scaling, mscale=mscale_all_dim, mscale_all_dim=mscale_all_dim,
        tensor_model_parallel_size=world, attention_dropout=0.0, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
    layer = build_module(spec, config=config, layer_number=1)
    attention = layer.core_attention
    scale = yarn_mscale(scaling, mscale_all_dim) ** 2 / math.sqrt(qk + pos)
    assert abs(attention.softmax_scale - scale) < 1e-12, (attention.softmax_scale, scale)
    assert layer.attn_mask_type == AttnMaskType.causal

    torch.manual_seed(0)  # every rank draws all heads, then takes its own
    length, batch, local_heads = 8, 2, heads // world
    full = [torch.randn(length, batch, heads, d) for d in (qk + pos, qk + pos, v)]
    grad_out = torch.randn(length, batch, heads, v)
    reference = [t.clone().requires_grad_() for t in full]
    expected = reference_attention(*reference, scale)
    expected.backward(grad_out.reshape(length, batch, -1))
    mine = slice(rank * local_heads, (rank + 1) * local_heads)
    local = [t[:, :, mine].clone().requires_grad_() for t in full]
    out = attention(*local, attention_mask=None)
    assert out.shape == (length, batch, local_heads * v), out.shape
    out.backward(grad_out[:, :, mine].reshape(length, batch, -1))
    torch.testing.assert_close(out, expected.view(length, batch, heads, v)[:, :, mine].reshape(out.shape))
    for name, tensor, ref in zip("qkv", local, reference):
        torch.testing.assert_close(tensor.grad, ref.grad[:, :, mine], msg=f"gradient of {name}")


@pytest.mark.slow
def test_local_attention_runs_mla_heads_under_tensor_parallelism():
    outcomes = run_on_ranks(_attention_rank, 2)
    assert outcomes == {0: "ok", 1: "ok"}, outcomes


def _model_args(extra: list[str]) -> list[str]:
    return DENSE + extra + TRAINING


def test_mla_flags_follow_megatron_lms_rules():
    from megatron.hetero.model import _check_multi_latent_attention
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    args = parse_args(_model_args(MLA + YARN))
    assert _check_multi_latent_attention(args) is MLATransformerConfig
    assert (args.q_lora_rank, args.kv_lora_rank, args.v_head_dim, args.rope_type) == (32, 16, 12, "yarn")
    assert _check_multi_latent_attention(parse_args(_model_args(["--rope-type", "rope"]))) is TransformerConfig
    with pytest.raises(HeteroError, match="--rope-type yarn is multi-latent attention's"):
        _check_multi_latent_attention(parse_args(_model_args(["--rope-type", "yarn"])))
    with pytest.raises(HeteroError, match="--group-query-attention"):
        _check_multi_latent_attention(parse_args(_model_args(MLA + ["--group-query-attention"])))
    with pytest.raises(HeteroError, match="--cache-mla-latents.*inference option"):
        parse_args(_model_args(MLA + ["--cache-mla-latents"]))


def _job(extra: list[str] = ()) -> list[str]:
    return DEEPSEEK_PROXY + TRAINING + ["--global-batch-size", "4", "--train-iters", "3", "--eval-iters", "0",
                                        *extra]


@pytest.mark.slow
def test_deepseek_proxy_trains_the_same_under_tensor_and_pipeline_parallelism(tmp_path):
    """MLA + MoE with a shared expert: one process, TP 2, context parallelism 2 (the gathered
    keys and values of MLA's wider key heads) and TP 2 over two pipeline stages of unequal
    depth give the same losses and parameter norms (megatron-core runs MoE under
    TP with sequence parallelism only)."""
    reference = run_pretrain(_job())
    assert reference.returncode == 0, reference.output[-3000:]
    assert len(reference.series("lm loss")) == 3
    tensor_parallel = run_pretrain(_job(["--tensor-model-parallel-size", "2", "--sequence-parallel"]), nproc=2)
    assert_same_training(reference, tensor_parallel, rtol=1e-5)
    context_parallel = run_pretrain(_job(["--context-parallel-size", "2"]), nproc=2)
    assert_same_training(reference, context_parallel, rtol=1e-5)
    plan = make_plan(tp=2, pp=2, dp=1, stages=[1, 3], replicas=[2], rank_order=[3, 1, 0, 2])
    staged = run_pretrain(_job(["--sequence-parallel"]), nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(reference, staged, rtol=1e-5)
