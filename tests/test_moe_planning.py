"""Mixtures of experts on the planning side: Megatron-LM's FLOPs, the presets' published
sizes, expert parallelism in the predictor, the fast estimate and hetero-plan."""

import ast
import json
import subprocess
from argparse import Namespace
from pathlib import Path

import pytest

from hetero.cli import main
from hetero.errors import HeteroError
from hetero.plan import DeviceEntry, Plan
from hetero.predict.costs import CostModel
from hetero.predict.training_setup import TrainingSetup
from hetero.predict.predictor import predict
from hetero.search.expert_parallel import with_expert_parallel
from hetero.search.options import PlannerOptions
from hetero.search.planner import Planner
from hetero.spec.cluster import Cluster
from hetero.spec.model import ModelSpec
from hetero.spec.presets import PRESETS

REPO = Path(__file__).resolve().parent.parent
MOE_CLUSTER = REPO / "examples" / "clusters" / "moe_h100_a100.yaml"
MEGATRON_LM = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")


def _megatron_flops_function():
    """Megatron-LM's own num_floating_point_operations at the pinned tag, from a local
    mirror of its repository (the function is read, not copied into this project)."""
    try:
        source = subprocess.run(
            ["git", "--git-dir", str(MEGATRON_LM), "show", "core_v0.16.1:megatron/training/training.py"],
            capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("no local mirror of Megatron-LM to read num_floating_point_operations from")
    tree = ast.parse(source)
    function = next(n for n in tree.body
                    if isinstance(n, ast.FunctionDef) and n.name == "num_floating_point_operations")
    namespace = {"is_linear_attention_variant": lambda variant: False}
    exec(compile(ast.Module([function], []), "training.py", "exec"), namespace)
    return namespace["num_floating_point_operations"]


def _megatron_args(model: ModelSpec) -> Namespace:
    return Namespace(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        seq_length=model.seq_length, ffn_hidden_size=model.ffn_hidden_size, kv_channels=model.kv_channels,
        num_query_groups=model.num_query_groups, group_query_attention=not model.multi_latent_attention,
        swiglu=model.swiglu, padded_vocab_size=model.vocab_size, num_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk, moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_router_num_groups=model.moe_router_num_groups, moe_router_group_topk=model.moe_router_group_topk,
        moe_layer_freq=list(model.moe_layer_freq) if isinstance(model.moe_layer_freq, tuple) else model.moe_layer_freq,
        mtp_num_layers=model.mtp_num_layers, multi_latent_attention=model.multi_latent_attention,
        q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
        qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
        attention_output_gate=False, experimental_attention_variant=None, is_hybrid_model=False,
        moe_latent_size=None)


def test_flops_are_megatron_lms_for_moe_mla_and_mtp():
    megatron_flops = _megatron_flops_function()
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "deepseek-v3-proxy", "llama3-70b"):
        model = PRESETS[name]
        assert model.training_flops(4) == pytest.approx(megatron_flops(_megatron_args(model), 4), rel=1e-9), name
    # every other layer MoE, as --moe-layer-freq 2 says
    alternating = ModelSpec(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256, vocab_size=1024,
                            swiglu=True, num_experts=4, moe_router_topk=2, moe_layer_freq=2)
    assert alternating.moe_layer_pattern() == (1, 0, 1, 0)
    assert alternating.training_flops(2) == pytest.approx(megatron_flops(_megatron_args(alternating), 2), rel=1e-9)


@pytest.mark.parametrize("name, total, active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9),    # Mixtral of Experts, section 2
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),    # Qwen3 technical report, table 2
    ("deepseek-v3", 671e9, 37e9),        # DeepSeek-V3 report, abstract (without the MTP module)
])
def test_presets_have_their_published_sizes(name, total, active):
    model = PRESETS[name]
    assert model.total_params() - model.mtp_params() == pytest.approx(total, rel=0.01)
    routed_unused = (model.num_layers * model.moe_layer_fraction * (model.num_experts - model.moe_router_topk)
                     * model.expert_params() / (model.moe_layer_fraction * model.num_experts))
    assert model.total_params() - model.mtp_params() - routed_unused == pytest.approx(active, rel=0.06)


def test_moe_fields_round_trip_through_megatron_args_and_dicts():
    model = PRESETS["deepseek-v3"]
    args = vars(_megatron_args(model)) | {
        "untie_embeddings_and_output_weights": True, "add_bias_linear": False, "normalization": "RMSNorm",
        "position_embedding_type": "rope", "group_query_attention": False}
    assert ModelSpec.from_megatron_args(args) == model
    assert ModelSpec(**model.to_dict()) == model
    assert "multi_latent_attention" not in PRESETS["llama3-8b"].to_dict()


def _devices(cluster: Cluster, hosts: list[str]) -> list[DeviceEntry]:
    return [DeviceEntry(host=h, device_type=cluster.node(h).device.name, vendor="nvidia")
            for h in hosts for _ in range(cluster.node(h).count)]


def _mixtral_plan(expert_parallel: int, hosts: list[str]) -> tuple[Plan, Cluster]:
    """TP 2, one 8-GPU node per pipeline stage (4 stages), so each stage's 8 ranks are 4 replicas."""
    cluster = Cluster.load(MOE_CLUSTER)
    plan = Plan.uniform(tensor_parallel=2, pipeline_parallel=4, data_parallel=4, micro_batch_size=1,
                        num_layers=32, global_batch_size=64, devices=_devices(cluster, hosts))
    return with_expert_parallel(plan, expert_parallel), cluster


def test_expert_parallel_shares_out_experts_and_pays_its_all_to_alls():
    planner = Planner(Cluster.load(MOE_CLUSTER), PRESETS["mixtral-8x7b"], 64, PlannerOptions(expert_parallel=(1,)))
    costs = planner.costs_for(2)
    plain, cluster = _mixtral_plan(1, ["h100-0", "h100-1", "h100-2", "h100-3"])
    within, _ = _mixtral_plan(4, ["h100-0", "h100-1", "h100-2", "h100-3"])
    one, four = predict(plain, cluster, costs), predict(within, cluster, costs)
    # experts / EP per rank: memory falls by 3/4 of the experts' weights, gradients and state
    assert four.peak_memory_gib["H100-80GB"] < one.peak_memory_gib["H100-80GB"] - 10
    # the all-to-alls run in every MoE layer of every micro-batch, inside the node here
    exchange = costs.with_experts(4, 1).expert_exchange_s(("h100-0",) * 4, 2, 1)
    assert exchange > 0 and costs.expert_exchange_s(("h100-0",) * 4, 2, 1) > 0
    layer = costs.with_experts(4, 1).layer_cost("H100-80GB", "h100-0", 2, 1)
    bare = costs.with_experts(4, 1).layer_times("H100-80GB", 2, 1)
    assert layer.forward_s - bare[0] >= exchange
    # a group spread over two fabrics pays the Ethernet between them
    assert costs.expert_exchange_s(("h100-0", "h100-0", "a100-0", "a100-0"), 2, 1) > 5 * exchange


def test_replicas_of_an_expert_group_get_equal_micro_batch_counts():
    cluster = Cluster.load(MOE_CLUSTER)
    plan = Plan.uniform(tensor_parallel=4, pipeline_parallel=1, data_parallel=4, micro_batch_size=1,
                        num_layers=32, global_batch_size=40, devices=_devices(cluster, ["h100-0", "a100-0"]))
    data = plan.to_dict()
    for replica, count in zip(data["replicas"], (13, 13, 7, 7)):
        replica["num_micro_batches"] = count
    uneven = Plan.from_dict(data)
    assert [r.num_micro_batches for r in with_expert_parallel(uneven, 8).replicas] == [13, 13, 7, 7]
    data["replicas"] = [dict(r, num_micro_batches=n) for r, n in zip(data["replicas"], (14, 12, 7, 7))]
    evened = with_expert_parallel(Plan.from_dict(data), 8)  # EP 8 x ETP 1 binds replicas 0-1 and 2-3
    assert [r.num_micro_batches for r in evened.replicas] == [13, 13, 7, 7]
    assert with_expert_parallel(uneven, 3) is None  # 3 does not divide a stage's 16 ranks


def test_fast_estimate_of_an_expert_parallel_plan_agrees_with_the_predictor():
    cluster = Cluster.load(MOE_CLUSTER)
    planner = Planner(cluster, PRESETS["mixtral-8x7b"], 64, PlannerOptions(expert_parallel=(1,)))
    for ep in (1, 4, 8):
        plan, _ = _mixtral_plan(ep, ["h100-0", "h100-1", "a100-0", "a100-1"])
        fits, seconds = planner.estimate(plan)
        prediction = predict(plan, cluster, planner.costs_for(2))
        assert fits == prediction.fits
        assert seconds == pytest.approx(prediction.iteration_time_s, rel=0.1), ep


def test_hetero_plan_picks_expert_parallelism_for_moe_on_a_mixed_cluster(tmp_path, capsys):
    for model, expect_ep in (("mixtral-8x7b", True), ("qwen3-30b-a3b", False)):
        out = tmp_path / f"{model}.json"
        # (its search time is a target of bench/plan_bench.py, the "MoE H100+A100 64" row)
        assert main(["--cluster", str(MOE_CLUSTER), "--model", model, "--global-batch-size", "256",
                     "--seq-length", "4096", "-o", str(out)]) == 0
        plan = Plan.load(out)
        chosen = json.loads(out.read_text()).get("expert_parallel", 1)
        assert plan.expert_parallel == chosen
        if expect_ep:
            assert plan.expert_parallel > 1
        for block in plan.grid.expert_replica_blocks:
            assert len({plan.replicas[r].num_micro_batches for r in block}) == 1
    capsys.readouterr()


MIXTRAL_FLAGS = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
                 "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
                 "--num-experts", "8", "--moe-router-topk", "2", "--seq-length", "4096",
                 "--max-position-embeddings", "4096", "--swiglu", "--normalization", "RMSNorm",
                 "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
                 "--disable-bias-linear", "--bf16", "--use-distributed-optimizer", "--global-batch-size", "256",
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "31999"]


@pytest.mark.parametrize("expert_flags,expert_grid", [
    (["--expert-model-parallel-size", "8"], (8, 1)),  # left to itself the search picks EP 4
    (["--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "2"], (4, 2)),
    (["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"], (2, 1)),
])
def test_expert_degrees_the_flags_give_are_the_plans(expert_flags, expert_grid, tmp_path, capsys, monkeypatch):
    """The run refuses a plan whose EP or ETP contradicts its flags: the search keeps to them."""
    from megatron.hetero.startup import configure

    out = tmp_path / "plan.json"
    flags = [*MIXTRAL_FLAGS, "--train-iters", "2", "--lr", "1e-3", "--mock-data", *expert_flags]
    assert main(["--cluster", str(MOE_CLUSTER), "-o", str(out), "--quiet", "--skip-baseline",
                 "--skip-upper-bound", "--", *flags]) == 0
    plan = Plan.load(out)
    assert (plan.expert_parallel, plan.expert_tensor_parallel or plan.tensor_parallel) == expert_grid
    # pretrain_gpt.py's own start-up checks, with the flags the plan was made from
    monkeypatch.setenv("HETERO_DEVICE", plan.devices[0].device_type)
    args = configure([*flags, "--hetero-plan", str(out)], plan.world_size).args
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size or args.tensor_model_parallel_size
            ) == expert_grid
    capsys.readouterr()


@pytest.mark.parametrize("own,expert_flags,fragment", [
    (["--expert-parallel", "2,4"], ["--expert-model-parallel-size", "8"],
     "--expert-parallel 2,4 contradicts the flags' --expert-model-parallel-size 8; give it in one place"),
    ([], ["--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "2",
          "--tensor-model-parallel-size", "4"], "--expert-tensor-parallel-size 2 with --expert-model-parallel-size 1"),
])
def test_expert_degrees_contradicting_the_search_are_named(own, expert_flags, fragment, capsys):
    assert main(["--cluster", str(MOE_CLUSTER), "-o", "unused.json", "--quiet", "--skip-baseline",
                 "--skip-upper-bound", *own, "--", *MIXTRAL_FLAGS, *expert_flags]) == 2
    assert fragment in capsys.readouterr().err


def test_hetero_plans_expert_parallel_option_limits_the_degrees(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["--cluster", str(MOE_CLUSTER), "--model", "mixtral-8x7b", "--global-batch-size", "256",
                 "--seq-length", "4096", "-o", str(out), "--quiet", "--skip-baseline", "--skip-upper-bound",
                 "--expert-parallel", "2"]) == 0
    assert Plan.load(out).expert_parallel == 2
    capsys.readouterr()


def test_gpt_oss_preset_has_its_published_size_and_alternating_windows():
    model = PRESETS["gpt-oss-120b"]
    # the model card: 116.8B parameters, 5.1B active per token (the input embedding not counted)
    assert model.total_params() == pytest.approx(116.8e9, rel=0.002)
    routed_unused = model.num_layers * (model.num_experts - model.moe_router_topk) * model.expert_params() / model.num_experts
    assert model.total_params() - routed_unused - model.embedding_params() == pytest.approx(5.13e9, rel=0.01)
    assert model.window_layer_pattern() == (1, 0) * 18  # --window-attn-skip-freq 2: every second layer full
    assert ModelSpec(**model.to_dict()) == model


def test_sliding_window_attention_prices_the_keys_each_query_attends():
    base = dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=1024, vocab_size=1024)
    full = ModelSpec(**base)
    windowed = ModelSpec(**base, window_size="(128,0)", window_attn_skip_freq="([1]*3+[0])")
    assert windowed.window_size == (128, 0) and windowed.window_layer_pattern() == (1, 1, 1, 0)
    # counted key by key: query i attends keys max(0, i - 128) .. i
    s = base["seq_length"]
    exact = sum(min(i, 128) + 1 for i in range(s)) / s
    assert windowed.attended_keys_per_query() == pytest.approx(0.75 * exact + 0.25 * s / 2)
    assert full.attended_keys_per_query() == s / 2
    # Megatron-LM's model FLOPs (the logged TFLOP/s) ignore the window; the cost does not.
    assert windowed.training_flops(1) == full.training_flops(1)
    cluster = Cluster.from_dict({"name": "h", "groups": [{"name": "g", "nodes": [
        {"host": "h0", "device": "H100-80GB", "count": 8, "intra_link": "nvlink4", "nic": {"kind": "ib", "gbps": 400}}]}]})
    core = {name: CostModel(cluster, m, TrainingSetup(fused_kernels=fused))._attention_core_s("H100-80GB", 1, 1)
            for name, m in (("full", full), ("windowed", windowed)) for fused in (True,)}
    assert core["windowed"] / core["full"] == pytest.approx(windowed.attended_keys_per_query() / (s / 2))
    # megatron-core's local attention masks a whole score matrix: no saving there.
    local = [CostModel(cluster, m, TrainingSetup(fused_kernels=False))._attention_core_s("H100-80GB", 1, 1)
             for m in (full, windowed)]
    assert local[0] == local[1]
    with pytest.raises(HeteroError, match="--window-size"):
        ModelSpec(**base, window_size="128")
    with pytest.raises(HeteroError, match="window_attn_skip_freq gives 3 layers"):
        ModelSpec(**base, window_size=(128, 0), window_attn_skip_freq=(1, 1, 0))


def test_window_flags_reach_the_planned_model():
    from hetero.spec.megatron_args import job_of_flags
    job = job_of_flags(["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
                        "--max-position-embeddings", "128", "--vocab-size", "1000", "--tokenizer-type", "NullTokenizer",
                        "--window-size", "(64,0)", "--window-attn-skip-freq", "2"])
    assert job.model.window_size == (64, 0) and job.model.window_layer_pattern() == (1, 0, 1, 0)


def test_multi_token_prediction_layers_run_on_the_last_stage():
    """megatron-core keeps the MTP layers with the loss: the last stage runs, per micro-batch,
    one more layer of the last layer's kind (a MoE layer for a DeepSeek-V3 shape whose
    average layer mixes in a dense one), its projection and another output layer, and holds
    their weights and activations; the other stages are unchanged."""
    import dataclasses
    cluster = Cluster.load(MOE_CLUSTER)
    with_mtp = PRESETS["deepseek-v3-proxy"]
    without = dataclasses.replace(with_mtp, mtp_num_layers=None)
    hosts = ["h100-0", "h100-1"]
    plan = with_expert_parallel(Plan.uniform(
        tensor_parallel=1, pipeline_parallel=2, data_parallel=8, micro_batch_size=1, num_layers=8,
        global_batch_size=64, devices=_devices(cluster, hosts)), 4)
    setup = TrainingSetup("bf16", distributed_optimizer=True)
    predictions = {}
    for name, model in (("mtp", with_mtp), ("none", without)):
        costs = CostModel(cluster, model, setup, expert_parallel=4, expert_tensor_parallel=1)
        predictions[name] = (predict(plan, cluster, costs), costs)
    (mtp, costs), (none, _) = predictions["mtp"], predictions["none"]
    first = [r for r in mtp.reports if r.slot.stage == 0][0]
    assert first.timing == [r for r in none.reports if r.slot.stage == 0][0].timing
    last, last_none = ([r for r in p.reports if r.slot.stage == 1][0] for p in (mtp, none))
    added = last.timing.forward_s - last_none.timing.forward_s
    assert added == pytest.approx(costs.mtp_times("H100-80GB", 1, 1)[0], rel=1e-6)  # EP inside a node
    moe_layer = costs.mtp_layer_costs().layer_cost("H100-80GB", "h100-1", 1, 1).forward_s
    average_layer = costs.layer_cost("H100-80GB", "h100-1", 1, 1).forward_s
    assert moe_layer > average_layer and added > moe_layer + costs._logits_s("H100-80GB", 1, 1)
    assert last.memory.weights > last_none.memory.weights and last.memory.activations > last_none.memory.activations
    assert mtp.iteration_time_s > none.iteration_time_s
    # the fast estimate prices the same last stage
    planner = Planner(cluster, with_mtp, 64, PlannerOptions(expert_parallel=(4,)))
    seconds = planner.estimate(plan)[1]
    assert seconds == pytest.approx(planner_prediction(planner, plan, cluster).iteration_time_s, rel=0.1)
    assert seconds > Planner(cluster, without, 64, PlannerOptions(expert_parallel=(4,))).estimate(plan)[1]


def planner_prediction(planner: Planner, plan: Plan, cluster: Cluster):
    return predict(plan, cluster, planner.costs_for(plan.tensor_parallel).with_experts(
        plan.expert_parallel, plan.expert_tensor_parallel))
