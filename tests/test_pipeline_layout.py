"""Megatron-LM's uneven-pipeline flags: the stages they make, checked against megatron-core's
own placement code, their errors, their agreement with a plan, and loss parity of runs that
use them (hetero/pipeline_layout.py)."""

import json

import pytest

from conftest import GPT_MODEL, TRAINING, assert_same_training, make_plan, run_pretrain
from hetero.errors import HeteroError, PlanError
from hetero.pipeline_layout import SplitFlags, megatron_split, parse_layout
from hetero.plan import Plan
from megatron.hetero.startup import configure

# (num_layers, pipeline size, flags, the virtual pipeline size Megatron-LM's validate_args derives)
CASES = [
    (8, 4, SplitFlags(), None),
    (8, 2, SplitFlags(virtual_stages_per_rank=2), 2),
    (8, 2, SplitFlags(layers_per_virtual_stage=2), 2),
    (4, 2, SplitFlags(first_stage_layers=1), None),
    (4, 2, SplitFlags(last_stage_layers=1), None),
    (8, 4, SplitFlags(first_stage_layers=1, last_stage_layers=1), None),
    (10, 4, SplitFlags(first_stage_layers=1, last_stage_layers=3), None),
    (7, 3, SplitFlags(last_stage_layers=1), None),
    (16, 4, SplitFlags(first_stage_layers=2, last_stage_layers=2, virtual_stages_per_rank=2), 2),
    (10, 3, SplitFlags(first_stage_layers=2, last_stage_layers=4, virtual_stages_per_rank=2), 2),
    (7, 4, SplitFlags(account_for_embedding=True), None),
    (7, 2, SplitFlags(account_for_loss=True), None),
    (6, 4, SplitFlags(account_for_embedding=True, account_for_loss=True), None),
    (14, 4, SplitFlags(account_for_embedding=True, account_for_loss=True, virtual_stages_per_rank=2), 2),
    (14, 4, SplitFlags(account_for_embedding=True, account_for_loss=True, layers_per_virtual_stage=2), 2),
    (10, 2, SplitFlags(account_for_embedding=True, account_for_loss=True, virtual_stages_per_rank=3), 3),
    (4, 2, SplitFlags(layout="Et|t*3L"), None),
    (6, 3, SplitFlags(layout="Ett|t,t|ttL"), None),
    (8, 2, SplitFlags(layout="Et|t|t*3|t*3L"), 2),
    (7, 3, SplitFlags(layout="E(t|)*2,t*2|(t|)*2,tL"), 2),
]


@pytest.fixture
def core_state():
    """megatron-core's pipeline coordinates as module state (no process group): what its
    placement functions read when not given a rank."""
    from megatron.core import parallel_state

    yield parallel_state
    parallel_state.set_pipeline_model_parallel_rank(None)
    parallel_state.set_pipeline_model_parallel_world_size(None)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def _core_config(num_layers: int, pp: int, flags: SplitFlags, virtual: int | None):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        virtual_pipeline_model_parallel_size=virtual if flags.layout is None else None,
        num_layers_in_first_pipeline_stage=flags.first_stage_layers,
        num_layers_in_last_pipeline_stage=flags.last_stage_layers,
        account_for_embedding_in_pipeline_split=flags.account_for_embedding,
        account_for_loss_in_pipeline_split=flags.account_for_loss,
        pipeline_model_parallel_layout=flags.layout)


def _placement(config, pp: int, virtual: int | None, state) -> list[list[tuple[int, int]]]:
    """(layers built, offset of the first) of every virtual stage of every rank, by megatron-core."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    state.set_pipeline_model_parallel_world_size(pp)
    state.set_virtual_pipeline_model_parallel_world_size(virtual)
    placement = []
    for rank in range(pp):
        state.set_pipeline_model_parallel_rank(rank)
        chunks = [None] if virtual is None else range(virtual)
        placement.append([(get_num_layers_to_build(config, vp_stage=v, pp_rank=rank),
                           get_transformer_layer_offset(config, vp_stage=v, pp_rank=rank)) for v in chunks])
    return placement


@pytest.mark.parametrize("num_layers, pp, flags, virtual", CASES)
def test_the_uniform_plan_builds_megatrons_stages(num_layers, pp, flags, virtual, core_state):
    """Megatron-core with the flags themselves and megatron-core with the plan's layout (what
    the run passes it) build the same layers at the same offsets on every (virtual) stage."""
    wanted = _placement(_core_config(num_layers, pp, flags, virtual), pp, virtual, core_state)
    plan = Plan.uniform(tensor_parallel=1, pipeline_parallel=pp, data_parallel=1, micro_batch_size=1,
                        num_layers=num_layers, global_batch_size=pp * 2, split_flags=flags)
    assert plan.virtual_pipeline_size == virtual
    assert megatron_split(num_layers, pp, flags) == [[n for n, _ in chunks] for chunks in wanted]
    ours = _core_config(num_layers, pp, SplitFlags(layout=plan.pipeline_layout()), None)  # what the run passes
    assert _placement(ours, pp, virtual, core_state) == wanted
    # The embedding on the first virtual stage of rank 0, the loss on the last of the last rank.
    layout = plan.pipeline_layout()
    assert layout[0][0] == "embedding" and layout[-1][-1] == "loss"


# Flags megatron-core (its config checks or its placement) rejects: so does the split, by name.
REJECTED = [
    (4, 2, SplitFlags(first_stage_layers=4), "0 layers are left for 1 other"),
    (5, 3, SplitFlags(first_stage_layers=2), "do not split evenly over the other 2"),
    (5, 2, SplitFlags(), "5 is not divisible by pipeline_parallel"),
    (6, 2, SplitFlags(account_for_embedding=True), "7 is not divisible"),
    (8, 2, SplitFlags(first_stage_layers=3, virtual_stages_per_rank=2), "not divisible by the 2 virtual"),
    (8, 2, SplitFlags(first_stage_layers=1, account_for_loss=True), "cannot be combined"),
    (4, 2, SplitFlags(layout="Et|t*3L", first_stage_layers=1), "drop --decoder-first-pipeline-num-layers 1"),
    (4, 2, SplitFlags(layout="Et|t*2L"), "places 3 decoder layers"),
    (4, 2, SplitFlags(layout="tE|t*3L"), "embedding (E) must come first"),
]


@pytest.mark.parametrize("num_layers, pp, flags, fragment", REJECTED)
def test_megatrons_error_cases_are_errors_naming_the_flag(num_layers, pp, flags, fragment, core_state):
    with pytest.raises(PlanError) as err:
        megatron_split(num_layers, pp, flags)
    assert fragment in str(err.value)
    virtual = flags.virtual_stages_per_rank
    with pytest.raises((ValueError, AssertionError)):  # megatron-core's own verdict
        _placement(_core_config(num_layers, pp, flags, virtual), pp, virtual, core_state)


def test_megatron_lm_only_checks():
    """Checks Megatron-LM's validate_args makes before megatron-core sees the flags, and one
    megatron-core misses (it would give the last stage -1 layers)."""
    with pytest.raises(PlanError, match="-1 layers are left"):
        megatron_split(4, 2, SplitFlags(first_stage_layers=5))
    with pytest.raises(PlanError, match="at most one of"):
        megatron_split(8, 2, SplitFlags(layout="Et|t*7L", virtual_stages_per_rank=2))
    with pytest.raises(PlanError, match="--num-virtual-stages-per-pipeline-rank"):
        megatron_split(8, 2, SplitFlags(first_stage_layers=2, layers_per_virtual_stage=1))
    assert parse_layout("E|(tt|)*2,t*2L") == ["E", "tt", "tt", "ttL"]
    with pytest.raises(PlanError, match="'x' is not a layer"):
        parse_layout("Et|xL")
    # multi-token-prediction layers (m) sit beside the loss, after the last stage's decoder layers
    assert megatron_split(4, 2, SplitFlags(layout="Et|t*3mL")) == [[1], [3]]
    with pytest.raises(PlanError, match=r"end the layout with \.\.\.mL"):
        megatron_split(4, 2, SplitFlags(layout="Etm|t*3L"))
    with pytest.raises(PlanError, match="without a decoder layer"):  # megatron-core builds it; a plan cannot
        Plan.uniform(tensor_parallel=1, pipeline_parallel=3, data_parallel=1, micro_batch_size=1,
                     num_layers=4, global_batch_size=3, split_flags=SplitFlags(layout="E|t*4|L"))


def _plan_file(tmp_path, stages) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(make_plan(tp=1, pp=2, dp=1, stages=stages, replicas=[8], rank_order=[0, 1])))
    return str(path)


def test_flags_that_disagree_with_the_plan_name_the_stage(tmp_path):
    plan = _plan_file(tmp_path, [1, 3])
    with pytest.raises(HeteroError) as err:
        configure(GPT_MODEL + TRAINING + ["--hetero-plan", plan, "--decoder-first-pipeline-num-layers", "3"], 2)
    assert ("--decoder-first-pipeline-num-layers 3 asks for 3 layers on stage 0; the plan puts 1 there "
            "(stages[0].num_layers); drop the flag or regenerate the plan") in str(err.value)
    with pytest.raises(HeteroError, match=r"--pipeline-model-parallel-layout 'Ett\|ttL' asks for 2 layers on stage 0"):
        configure(GPT_MODEL + TRAINING + ["--hetero-plan", plan, "--pipeline-model-parallel-layout", "Ett|ttL"], 2)
    with pytest.raises(HeteroError, match=r"places 1 multi-token-prediction layers \(m\) and --mtp-num-layers is None"):
        configure(GPT_MODEL + TRAINING + ["--hetero-plan", plan, "--pipeline-model-parallel-layout", "Et|tttmL"], 2)
    agreeing = configure(GPT_MODEL + TRAINING + ["--hetero-plan", plan, "--decoder-first-pipeline-num-layers", "1",
                                                 "--decoder-last-pipeline-num-layers", "3"], 2)
    assert [s.num_layers for s in agreeing.plan.stages] == [1, 3]


@pytest.mark.slow
@pytest.mark.parametrize("flags, stages", [
    (["--decoder-first-pipeline-num-layers", "1"], "[1,3]"),
    (["--pipeline-model-parallel-layout", "Et|t|t|tL"], "[1+1,1+1]"),  # interleaved: 2 virtual stages a rank
], ids=["first-stage-layers", "layout"])
def test_loss_parity_with_megatrons_uneven_flags(flags, stages, tmp_path, gpt_reference):
    result = run_pretrain(GPT_MODEL + TRAINING + ["--pipeline-model-parallel-size", "2", *flags],
                          nproc=2, tmp_path=tmp_path)
    assert f"(uniform Megatron plan): TP=1 PP=2 DP=1 micro-batch=2 layers per stage={stages}" in result.stdout
    assert_same_training(gpt_reference, result)
