"""Megatron's performance features under heterogeneous plans: the same training, faster.

Each multi-process run is compared iteration by iteration with a 1-process run of the same
model and data (fp32, relative 1e-4 on the loss and the parameter norm). The plans mix
what a plan can change: uneven stages, replicas of unequal micro-batch counts, a permuted
rank order (TP=2 plans of 4 processes cannot also have unequal stages and replicas).
"""

import pytest

from conftest import (
    GPT_MODEL,
    LLAMA_MODEL,
    TRAINING,
    assert_same_training,
    make_plan,
    run_pretrain,
)
from hetero.errors import HeteroError, PlanError
from hetero.plan import Plan
from megatron.hetero.arguments import apply_plan, parse_args, validate_args
from megatron.hetero.performance import (
    configure_performance,
    gpu_fusions,
    megatron_fusions,
    recompute_fields,
)

assert GPT_MODEL[:2] == ["--num-layers", "4"]
GPT_6_LAYERS = ["--num-layers", "6"] + GPT_MODEL[2:]


def _plan_v2(stages: list[dict], **kwargs) -> dict:
    plan = make_plan(stages=[s["num_layers"] for s in stages], **kwargs)
    plan["version"] = 2
    plan["stages"] = stages
    return plan


def _configured(plan: dict, *flags: str):
    args = parse_args(GPT_MODEL + TRAINING + list(flags))
    loaded = Plan.from_dict(plan)
    apply_plan(args, loaded)
    validate_args(args)
    return args, configure_performance(args, loaded)


# ----- plan format version 2 and flag checks (no processes) ------------------------------


def test_version_1_plan_loads_and_version_2_fields_need_version_2():
    plan = make_plan(tp=1, pp=2, dp=2, stages=[3, 1], replicas=[5, 3], rank_order=[2, 0, 3, 1])
    assert Plan.from_dict(plan).virtual_pipeline_size is None
    plan["stages"][0]["recompute"] = "selective"
    with pytest.raises(PlanError, match=r"stages\[0\].recompute need plan version 2"):
        Plan.from_dict(plan)


def test_virtual_stages_give_megatron_core_layout_in_model_order():
    plan = Plan.from_dict(_plan_v2(
        [{"num_layers": 4, "virtual_stages": [3, 1]}, {"num_layers": 2, "virtual_stages": [1, 1]}],
        tp=1, pp=2, dp=2, replicas=[6, 2], rank_order=[2, 0, 3, 1]))
    assert plan.virtual_pipeline_size == 2
    assert plan.virtual_stage_layers() == [3, 1, 1, 1]  # chunk v of rank s is stage v*pp + s
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    layout = PipelineParallelLayerLayout(plan.pipeline_layout(), pipeline_model_parallel_size=2)
    layout.validate_layer_layout(num_layers=6, mtp_num_layers=None)
    counts = [[sum(t.name == "decoder" for t in chunk) for chunk in rank] for rank in layout.layout]
    assert counts == [[3, 1], [1, 1]]


@pytest.mark.parametrize("replicas, fragment", [
    ([5, 3], "replica 0: 5; replica 1: 3"),
    ([7, 1], "replica 0: 7; replica 1: 1"),
])
def test_interleaving_needs_micro_batch_counts_in_whole_groups(replicas, fragment):
    data = _plan_v2([{"num_layers": 2, "virtual_stages": [1, 1]}] * 2,
                    tp=1, pp=2, dp=2, replicas=replicas, rank_order=[0, 1, 2, 3])
    with pytest.raises(PlanError, match="multiple of 2") as err:
        Plan.from_dict(data)
    assert fragment in str(err.value)


def test_virtual_stages_from_flags_split_evenly_or_name_the_fix():
    plan = make_plan(tp=1, pp=2, dp=2, stages=[2, 2], replicas=[6, 2], rank_order=[0, 1, 2, 3])
    _, planned = _configured(plan, "--num-virtual-stages-per-pipeline-rank", "2")
    assert planned.virtual_stage_layers() == [1, 1, 1, 1]
    uneven = make_plan(tp=1, pp=2, dp=2, stages=[3, 1], replicas=[6, 2], rank_order=[0, 1, 2, 3])
    with pytest.raises(HeteroError, match="stage 0 holds 3 layers.*stages\\[s\\].virtual_stages"):
        _configured(uneven, "--num-virtual-stages-per-pipeline-rank", "2")
    with pytest.raises(HeteroError, match="drop --no-overlap-p2p-communication"):
        _configured(plan, "--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication")


def test_micro_batch_groups_fit_every_count_a_replica_runs():
    """megatron-core's interleaved schedule runs M micro-batches in groups of N and refuses,
    only once it runs, N below PP, M below N or a last group shorter than PP. The plan's
    counts are also evaluation's (Megatron-LM evaluates the whole global batch); each
    --rampup-batch-size step's counts are checked too. PP 2, replicas 4 and 4."""
    plan = _plan_v2([{"num_layers": 2, "virtual_stages": [1, 1]}] * 2,
                    tp=1, pp=2, dp=2, replicas=[4, 4], rank_order=[0, 1, 2, 3])
    group = "--microbatch-group-size-per-virtual-pipeline-stage"
    assert _configured(plan, group, "4")[1].virtual_pipeline_size == 2  # one whole group
    assert _configured(plan, group, "2")[1].virtual_pipeline_size == 2  # two
    with pytest.raises(HeteroError, match=f"{group} 3: a replica runs 4 micro-batches .*training and "
                                          "evaluation.*a last group of 1, shorter than the pipeline"):
        _configured(plan, group, "3")
    with pytest.raises(HeteroError, match=f"{group} 1 is below the pipeline-parallel size 2"):
        _configured(plan, group, "1")
    with pytest.raises(HeteroError, match=f"{group} 5: a replica runs 4 .* fewer than one group of 5"):
        _configured(plan, group, "5")
    # The ramp's first step, 8 samples: 2 micro-batches a replica.
    with pytest.raises(HeteroError, match=r"runs 2 micro-batches .*--rampup-batch-size step of 8 samples"):
        _configured(plan, group, "4", "--rampup-batch-size", "8", "8", "64")


def test_uniform_recomputation_needs_whole_groups_per_stage():
    plan = _plan_v2([{"num_layers": 3, "recompute": {"granularity": "full", "method": "uniform", "num_layers": 2}},
                     {"num_layers": 1}], tp=1, pp=2, dp=2, replicas=[5, 3], rank_order=[2, 0, 3, 1])
    with pytest.raises(PlanError, match=r"stages\[0\].recompute: uniform groups of 2 layers"):
        Plan.from_dict(plan)


def test_per_stage_recomputation_overrides_the_flags():
    plan = _plan_v2([{"num_layers": 3, "recompute": "none"},
                     {"num_layers": 1, "recompute": {"granularity": "full", "method": "block", "num_layers": 1}}],
                    tp=1, pp=2, dp=2, replicas=[5, 3], rank_order=[2, 0, 3, 1])
    args, planned = _configured(plan, "--recompute-activations")
    assert recompute_fields(args, planned, 0) == {}
    assert recompute_fields(args, planned, 1) == {
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}
    plan["stages"][0].pop("recompute")
    args, planned = _configured(plan, "--recompute-activations")
    assert recompute_fields(args, planned, 0)["recompute_granularity"] == "selective"


@pytest.mark.parametrize("flags, fragment", [
    (["--recompute-granularity", "full"], "needs --recompute-method uniform|block"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     "stage 0 holds 3 layers (megatron-core needs whole groups)"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"], "takes no --recompute-method"),
    (["--overlap-param-gather", "--overlap-grad-reduce"], "needs --use-distributed-optimizer"),
    (["--overlap-param-gather", "--use-distributed-optimizer"], "needs --overlap-grad-reduce"),
    (["--tp-comm-overlap"], "--tp-comm-overlap overlaps tensor-parallel communication"),
    (["--context-parallel-size", "2"], "--context-parallel-size 2 contradicts the plan (1)"),
])
def test_refused_performance_flags_name_the_reason(flags, fragment):
    plan = make_plan(tp=1, pp=2, dp=2, stages=[3, 1], replicas=[5, 3], rank_order=[2, 0, 3, 1])
    with pytest.raises(HeteroError) as err:
        _configured(plan, *flags)
    assert fragment in str(err.value)


def test_no_fused_kernels_on_the_cpu():
    args, _ = _configured(make_plan(tp=1, pp=1, dp=1, stages=[4], replicas=[8], rank_order=[0]))
    assert not any(megatron_fusions(args, "local").config_fields().values())


def test_gpu_fusions_follow_megatron_lm():
    args, _ = _configured(make_plan(tp=1, pp=1, dp=1, stages=[4], replicas=[8], rank_order=[0]))
    everything = {"rope": True, "fused_weight_gradient_mlp_cuda": True, "apex": True,
                  "scaled_masked_softmax_cuda": True}
    fusions = gpu_fusions(args, "local", everything)
    assert fusions.bias_activation_fusion and fusions.gradient_accumulation_fusion and fusions.persist_layer_norm
    assert not fusions.apply_rope_fusion  # learned positions: no RoPE to fuse
    llama = parse_args(GPT_MODEL + TRAINING + ["--swiglu", "--position-embedding-type", "rope",
                                              "--disable-bias-linear", "--no-gradient-accumulation-fusion"])
    fusions = gpu_fusions(llama, "transformer_engine", everything)
    assert fusions.apply_rope_fusion and fusions.bias_activation_fusion  # SwiGLU fusion needs no bias
    assert not fusions.gradient_accumulation_fusion
    bare = gpu_fusions(llama, "local", dict.fromkeys(everything, False))
    assert not bare.apply_rope_fusion and not bare.persist_layer_norm and not bare.masked_softmax_fusion
    assert gpu_fusions(llama, "local", everything).masked_softmax_fusion
    assert "RoPE fusion needs transformer-engine" in bare.describe()
    gelu_without_bias = parse_args(GPT_MODEL + TRAINING + ["--disable-bias-linear"])
    assert not gpu_fusions(gelu_without_bias, "local", everything).bias_activation_fusion


# ----- loss parity (4 processes) ---------------------------------------------------------


@pytest.mark.slow
def test_sequence_parallel_and_overlapped_reduction_with_unequal_replicas(tmp_path, llama_reference):
    plan = make_plan(tp=2, pp=1, dp=2, stages=[4], replicas=[6, 2], rank_order=[1, 3, 0, 2])
    result = run_pretrain(LLAMA_MODEL + TRAINING + ["--sequence-parallel", "--overlap-grad-reduce",
                                                    "--ddp-bucket-size", "20000"],
                          nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(llama_reference, result)
    assert "> sequence parallelism over tensor-parallel size 2" in result.stdout


@pytest.mark.slow
def test_sequence_parallel_with_uneven_stages_and_per_stage_recomputation(tmp_path, llama_reference):
    plan = _plan_v2([{"num_layers": 3, "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}},
                     {"num_layers": 1}], tp=2, pp=2, dp=1, replicas=[8], rank_order=[3, 1, 2, 0])
    result = run_pretrain(LLAMA_MODEL + TRAINING + ["--sequence-parallel"], nproc=4, plan=plan,
                          tmp_path=tmp_path)
    assert_same_training(llama_reference, result)
    assert "stage 0: full, uniform, 1 layer(s), stage 1: none" in result.stdout


@pytest.mark.slow
def test_full_and_selective_recomputation(tmp_path, gpt_reference):
    # Stage 0 takes the flags (full, uniform); the plan makes stage 1 selective.
    plan = _plan_v2([{"num_layers": 3}, {"num_layers": 1, "recompute": "selective"}],
                    tp=1, pp=2, dp=2, replicas=[5, 3], rank_order=[2, 0, 3, 1])
    flags = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"]
    result = run_pretrain(GPT_MODEL + TRAINING + flags, nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(gpt_reference, result)
    assert "stage 0: full, uniform, 3 layer(s), stage 1: selective (core_attn)" in result.stdout


@pytest.mark.slow
def test_per_stage_recomputation_one_stage_only(tmp_path, gpt_reference):
    plan = _plan_v2([{"num_layers": 3, "recompute": {"granularity": "full", "method": "block", "num_layers": 2}},
                     {"num_layers": 1, "recompute": "none"}],
                    tp=1, pp=2, dp=2, replicas=[5, 3], rank_order=[2, 0, 3, 1])
    # Also megatron-core's fused cross entropy (torch.compile'd on the CPU).
    result = run_pretrain(GPT_MODEL + TRAINING + ["--recompute-activations", "--cross-entropy-loss-fusion"],
                          nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(gpt_reference, result)
    assert "stage 0: full, block, 2 layer(s), stage 1: none" in result.stdout
    assert "; cross-entropy loss fusion" in result.stdout


@pytest.fixture(scope="module")
def gpt6_reference():
    result = run_pretrain(GPT_6_LAYERS + TRAINING)
    assert result.returncode == 0, result.output[-3000:]
    return result


@pytest.mark.slow
def test_interleaved_uneven_virtual_stages_unequal_replicas(tmp_path, gpt6_reference):
    # Model order 3 | 1 | 1 | 1: rank 0 holds virtual stages 0 and 2, rank 1 stages 1 and 3.
    plan = _plan_v2([{"num_layers": 4, "virtual_stages": [3, 1]}, {"num_layers": 2, "virtual_stages": [1, 1]}],
                    tp=1, pp=2, dp=2, replicas=[6, 2], rank_order=[2, 0, 3, 1])
    # With every chunk's reduction overlapped and the distributed optimizer's gather too.
    flags = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--use-distributed-optimizer",
             "--overlap-param-gather"]
    result = run_pretrain(GPT_6_LAYERS + TRAINING + flags, nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(gpt6_reference, result)
    assert "interleaved 1F1B: 2 virtual stages per pipeline rank, layers per virtual stage 3 | 1 | 1 | 1" in result.stdout


@pytest.mark.slow
def test_overlapped_reduction_and_param_gather_with_distributed_optimizer(tmp_path, gpt_reference):
    plan = make_plan(tp=1, pp=2, dp=2, stages=[3, 1], replicas=[5, 3], rank_order=[2, 0, 3, 1])
    flags = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
             "--ddp-bucket-size", "20000"]
    result = run_pretrain(GPT_MODEL + TRAINING + flags, nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(gpt_reference, result)
    assert "parameter all-gather overlapped with forward" in result.stdout
