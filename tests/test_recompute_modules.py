"""Selective recomputation of megatron-core's modules (--recompute-modules) in the cost model:
each module's forward again in backward, its activations not kept, and the name that carries
the setting from the flags through the plan to the prediction."""

from __future__ import annotations

import functools

import pytest

from hetero.errors import HeteroError
from hetero.plan_entries import StageEntry
from hetero.predict.costs import CostModel
from hetero.predict.training_setup import TrainingSetup
from hetero.search.options import plan_recompute
from hetero.spec import recompute
from hetero.spec.cluster import Cluster
from hetero.spec.megatron_args import job_of_flags
from hetero.spec.presets import load_model

DEVICE = "H100-80GB"


def _dgx_h100(nodes: int) -> Cluster:
    return Cluster.from_dict({"name": "dgx", "groups": [{"name": "g", "nodes": [
        {"host": f"dgx{i}", "device": DEVICE, "count": 8, "intra_link": "nvlink4",
         "nic": {"kind": "ib", "gbps": 3200}} for i in range(nodes)]}]})


def test_a_setting_has_one_name():
    assert recompute.selective(None) == recompute.selective(["core_attn"]) == "selective"
    assert recompute.selective(["moe_act", "layernorm", "moe_act"]) == "selective:layernorm,moe_act"
    assert recompute.modules("selective:layernorm,moe_act") == {"layernorm", "moe_act"}
    assert recompute.modules("selective") == {"core_attn"} and recompute.modules("full") == frozenset()
    with pytest.raises(HeteroError, match="recompute modules attn: megatron-core knows core_attn, moe_act"):
        recompute.selective(["attn"])
    with pytest.raises(HeteroError, match="is not one of none, full, selective"):
        recompute.mode("full:mlp")
    with pytest.raises(HeteroError, match="recompute"):
        TrainingSetup(recompute="selective:attention")


def test_the_flags_name_their_modules_and_the_plan_carries_them():
    base = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--vocab-size", "1000", "--tokenizer-type", "NullTokenizer"]
    job = job_of_flags(base + ["--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm"])
    assert job.recompute == "selective:layernorm,mlp"
    assert job_of_flags(base + ["--recompute-activations"]).recompute == "selective"
    entry = plan_recompute(job.recompute)
    assert entry == {"granularity": "selective", "modules": ["layernorm", "mlp"]}
    stage = StageEntry(num_layers=4, recompute=entry)
    assert stage.recompute_mode() == job.recompute
    assert StageEntry(num_layers=4, recompute="selective").recompute_mode() == "selective"
    with pytest.raises(ValueError, match="modules attn: megatron-core recomputes core_attn"):
        StageEntry(num_layers=4, recompute={"granularity": "selective", "modules": ["attn"]})


@pytest.fixture(scope="module")
def moe_costs() -> CostModel:
    return CostModel(_dgx_h100(1), load_model("qwen3-30b-a3b"), TrainingSetup(dropout=False), expert_parallel=8)


def test_each_module_costs_its_forward_again(moe_costs):
    none = moe_costs.layer_times(DEVICE, 1, 1, "none")
    full = moe_costs.layer_times(DEVICE, 1, 1, "full")
    assert full[1] == pytest.approx(none[1] + none[0])
    parts = moe_costs._layer_forward_parts(DEVICE, 1, 1)
    for module in recompute.MODULES:
        again = moe_costs.layer_times(DEVICE, 1, 1, recompute.selective([module]))
        assert again[0] == none[0]
        assert none[1] <= again[1] < full[1]
    # moe_act runs the routed experts' activation again, its share of the measured-or-not forward.
    moe_act = moe_costs.layer_times(DEVICE, 1, 1, "selective:moe_act")
    assert moe_act[1] - none[1] == pytest.approx(none[0] * parts["moe_act"] / sum(parts.values()))
    # Two modules cost their sum; "moe" holds the shared experts, counted once.
    both = moe_costs.layer_times(DEVICE, 1, 1, "selective:layernorm,moe_act")
    layernorm = moe_costs.layer_times(DEVICE, 1, 1, "selective:layernorm")
    assert both[1] - none[1] == pytest.approx((moe_act[1] - none[1]) + (layernorm[1] - none[1]))
    whole_moe = moe_costs.layer_times(DEVICE, 1, 1, "selective:moe")
    assert moe_costs.layer_times(DEVICE, 1, 1, "selective:moe,shared_experts") == whole_moe


def test_recomputing_the_moe_layer_exchanges_its_tokens_again(moe_costs):
    hosts = ("dgx0",) * 8
    exchange = moe_costs.expert_exchange_s(hosts, 1, 1)
    assert moe_costs.expert_exchange_times(hosts, DEVICE, 1, 1, "selective:moe_act") == (exchange, exchange)
    assert moe_costs.expert_exchange_times(hosts, DEVICE, 1, 1, "selective:moe") == (exchange, 2 * exchange)


# Activations one layer keeps per micro-batch, bf16, TP 2 with sequence parallelism, flash attention.
BYTES, TP = 2, 2


def _kept(model, setting: str) -> float:
    return model.layer_activation_bytes(1, TP, BYTES, fused_kernels=True, dropout=False, recompute=setting,
                                        sequence_parallel=True)


def test_each_module_keeps_fewer_activations():
    model = load_model("qwen3-30b-a3b")
    tokens, v, t = model.seq_length, BYTES, TP
    kept = functools.partial(_kept, model)

    none = kept("none")
    # layernorm: the two norm outputs (the QKV and fc1 inputs), sequence-parallel.
    assert none - kept("selective:layernorm") == pytest.approx(tokens * 2 * v * model.hidden_size / t)
    # moe_act: the activation's output, the fc2 input of each of the top-k experts.
    assert none - kept("selective:moe_act") == pytest.approx(
        tokens * model.moe_router_topk * v * model.moe_ffn_hidden_size / t)
    # moe: the whole MoE block keeps only its input (already counted with the norms).
    moe_block = model.moe_router_topk * 3 * v * model.moe_ffn_hidden_size
    assert none - kept("selective:moe") == pytest.approx(tokens * moe_block / t)
    # With flash attention the attention core keeps no scores: core_attn saves nothing.
    assert kept("selective") == none
    assert kept("full") < min(kept(f"selective:{m}") for m in recompute.MODULES)


def test_mla_up_projection_recomputation_drops_queries_keys_and_values():
    model = load_model("deepseek-v3")
    tokens, v, t = model.seq_length, BYTES, TP
    kept = functools.partial(_kept, model)

    heads = model.num_attention_heads
    qk = heads * (model.qk_head_dim + model.qk_pos_emb_head_dim)
    assert kept("none") - kept("selective:mla_up_proj") == pytest.approx(
        tokens * v * (2 * qk + heads * model.v_head_dim) / t)
    costs = CostModel(_dgx_h100(1), model, TrainingSetup(dropout=False, sequence_parallel=True), expert_parallel=8)
    parts = costs._layer_forward_parts(DEVICE, 2, 1)
    up = parts["mla_up_proj"] / (parts["mla_up_proj"] + parts["attention_linear"])
    assert up == pytest.approx(model.mla_up_projection_flops_per_token() / model.attention_gemm_flops_per_token())
    assert 0 < up < 1
