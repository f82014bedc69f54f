"""Expert parallelism (--expert-model-parallel-size > 1) under heterogeneous plans.

The plan's expert-group arithmetic against megatron-core's own expert grid, the rule that
the replicas of one expert-parallel group run equal micro-batch counts (their ranks meet in
an all-to-all every micro-batch), and real jobs: unequal replicas, uneven stages, permuted
ranks, tensor parallelism with sequence parallelism, the distributed optimizer and a
checkpoint saved under EP 2 resumed by one process, each trained as one process trains.
"""

import json

import pytest

from conftest import LLAMA_MODEL, TRAINING, make_plan, run_pretrain
from hetero.errors import HeteroError, PlanError
from hetero.plan import Plan, expert_parallel_problems
from megatron.hetero.startup import configure

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall"]
JOB = LLAMA_MODEL + TRAINING + MOE + ["--eval-iters", "0", "--train-iters", "3"]


def _plan(**fields) -> Plan:
    expert = {key: fields.pop(key) for key in ("expert_parallel", "expert_tensor_parallel") if key in fields}
    return Plan.from_dict({**make_plan(**fields), **expert})


@pytest.mark.parametrize("tp, pp, dp, ep, etp", [
    (1, 1, 4, 2, None), (2, 2, 2, 2, 1), (2, 1, 4, 4, 2), (1, 3, 4, 4, None), (4, 1, 2, 2, 2),
])
@pytest.mark.core019
def test_plan_expert_groups_are_megatron_cores(tp, pp, dp, ep, etp):
    from megatron.core.parallel_state import RankGenerator

    plan = _plan(tp=tp, pp=pp, dp=dp, stages=[1] * pp, replicas=[2] * dp,
                 rank_order=list(range(tp * pp * dp))[::-1], expert_parallel=ep, expert_tensor_parallel=etp)
    expert_tp = etp or tp
    grid = RankGenerator(tp=expert_tp, ep=ep, dp=tp * dp // (ep * expert_tp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for token, ours in (("ep", plan.grid.expert_groups), ("dp", plan.grid.expert_data_groups),
                        ("tp", plan.grid.expert_tensor_groups)):
        assert sorted(g for s in range(pp) for g in ours(s)) == sorted(grid.get_ranks(token)), token


def test_plan_fields_load_old_plans_and_round_trip():
    old = make_plan(tp=1, pp=1, dp=2, stages=[4], replicas=[5, 3], rank_order=[1, 0])
    plan = Plan.from_dict(old)
    assert (plan.expert_parallel, plan.expert_tensor_parallel) == (1, None)
    assert plan.to_dict() == Plan.from_dict(plan.to_dict()).to_dict() and "expert_parallel" not in plan.to_dict()
    with_experts = _plan(tp=2, pp=1, dp=2, stages=[4], replicas=[5, 3], rank_order=[3, 1, 2, 0],
                         expert_parallel=2, expert_tensor_parallel=1)
    # EP 2 x ETP 1 inside each replica's two tensor ranks: the replicas may differ.
    assert with_experts.grid.expert_groups(0) == [[0, 1], [2, 3]]
    assert Plan.from_dict(json.loads(json.dumps(with_experts.to_dict()))) == with_experts


def test_plan_refuses_an_expert_group_over_unequal_replicas():
    with pytest.raises(PlanError, match=r"spans replicas \[0, 1\], which run \[5, 3\] micro-batches.*equal"):
        _plan(tp=1, pp=2, dp=2, stages=[3, 1], replicas=[5, 3], rank_order=[0, 1, 2, 3], expert_parallel=2)
    with pytest.raises(PlanError, match="does not divide stage 0's 4 ranks"):
        _plan(tp=2, pp=1, dp=2, stages=[4], replicas=[4, 4], rank_order=[0, 1, 2, 3],
              expert_parallel=4, expert_tensor_parallel=2)
    with pytest.raises(PlanError, match="expert_tensor_parallel 1 differs from stage 0's tensor_parallel 2"):
        _plan(tp=2, pp=1, dp=1, stages=[4], replicas=[8], rank_order=[0, 1], expert_tensor_parallel=1)
    model = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 1000,
             "num_experts": 6, "moe_router_topk": 2}
    with pytest.raises(PlanError, match="the model has 6 experts: use a divisor"):
        Plan.from_dict({**make_plan(tp=1, pp=1, dp=4, stages=[4], replicas=[2] * 4, rank_order=[0, 1, 2, 3]),
                        "expert_parallel": 4, "model": model})
    # The planner's check, before a Plan exists: groups of two consecutive replicas.
    assert expert_parallel_problems([1], [3, 3, 1, 1], 2) == []
    assert expert_parallel_problems([1], [3, 1, 3, 1], 2)


def test_batch_size_ramp_keeps_expert_parallel_replicas_equal():
    plan = _plan(tp=1, pp=1, dp=4, stages=[4], replicas=[3, 3, 1, 1], rank_order=[3, 2, 1, 0], expert_parallel=2)
    assert plan.grid.expert_replica_blocks == [[0, 1], [2, 3]]
    assert [plan.split_micro_batches(2 * n) for n in (8, 6, 12)] == [[3, 3, 1, 1], [2, 2, 1, 1], [5, 5, 1, 1]]
    # 7 micro-batches would go 3, 2, 1, 1 by the proportions: replicas 0 and 1 would deadlock.
    assert Plan.from_dict({**plan.to_dict(), "expert_parallel": 1}).split_micro_batches(2 * 7) == [3, 2, 1, 1]
    with pytest.raises(PlanError, match="multiples of 2 micro-batches"):
        plan.split_micro_batches(2 * 7)


def test_flags_contradicting_the_plan_and_unequal_groups_stop_before_any_collective(tmp_path):
    """configure() is start-up before the process groups: the errors come from there."""
    unequal = make_plan(tp=1, pp=1, dp=2, stages=[4], replicas=[5, 3], rank_order=[1, 0])
    unequal["expert_parallel"] = 2
    (tmp_path / "unequal.json").write_text(json.dumps(unequal))
    with pytest.raises(HeteroError, match=r"spans replicas \[0, 1\], which run \[5, 3\]"):
        configure(JOB + ["--hetero-plan", str(tmp_path / "unequal.json")], 2)
    equal = {**unequal, "replicas": [{"num_micro_batches": 4}] * 2}
    (tmp_path / "equal.json").write_text(json.dumps(equal))
    with pytest.raises(HeteroError, match=r"--expert-model-parallel-size 1 contradicts the plan \(2\)"):
        configure(JOB + ["--hetero-plan", str(tmp_path / "equal.json"), "--expert-model-parallel-size", "1"], 2)
    assert configure(JOB + ["--hetero-plan", str(tmp_path / "equal.json")], 2).args.expert_model_parallel_size == 2
    # Without a plan the flags build Megatron-LM's layout.
    assert configure(JOB + ["--expert-model-parallel-size", "2"], 2).plan.grid.expert_groups(0) == [[0, 1]]


def _assert_same(reference, result) -> None:
    """Every iteration the result logged (a resumed run starts past 1) as the reference's."""
    assert result.returncode == 0, result.output[-3000:]
    for name in ("lm loss", "params norm", "load_balancing_loss"):
        logged = result.iteration_losses(name)
        ref, got = [reference.iteration_losses(name)[i] for i in logged], list(logged.values())
        assert len(got) > 0, (name, ref, got)
        for a, b in zip(ref, got):
            assert abs(a - b) <= 1e-4 * abs(a), (name, ref, got)


@pytest.mark.slow
@pytest.mark.core019
def test_expert_parallel_jobs_train_as_one_process(tmp_path):
    reference = run_pretrain(JOB)
    assert reference.returncode == 0, reference.output[-3000:]
    assert len(reference.series("load_balancing_loss")) == 3 and len(reference.series("params norm")) == 3
    # EP 2, TP 1: unequal replicas (3, 3 | 1, 1: equal inside each expert-parallel group),
    # permuted ranks, the distributed optimizer over the expert data-parallel groups; saves.
    unequal = make_plan(tp=1, pp=1, dp=4, stages=[4], replicas=[3, 3, 1, 1], rank_order=[2, 0, 3, 1])
    unequal["expert_parallel"] = 2
    saved = run_pretrain(JOB + ["--use-distributed-optimizer", "--save", str(tmp_path / "ckpt"),
                                "--save-interval", "2"], nproc=4, plan=unequal, tmp_path=tmp_path)
    _assert_same(reference, saved)
    assert "TP=1 EP=2 ETP=1 PP=1 DP=4" in saved.output
    # EP 2 over the two tensor ranks (expert tensor parallel 1) with sequence parallelism,
    # uneven stages, permuted ranks; on the hetero backend, each expert-parallel group's
    # all-to-all across two vendors (launch ranks 0, 1: nvidia; 2, 3: amd).
    devices = [{"host": "localhost", "device_type": "cpu", "vendor": v} for v in ["nvidia"] * 2 + ["amd"] * 2]
    tensor = make_plan(tp=2, pp=2, dp=1, stages=[3, 1], replicas=[8], rank_order=[1, 3, 0, 2], devices=devices)
    tensor.update(expert_parallel=2, expert_tensor_parallel=1)
    across_vendors = run_pretrain(JOB + ["--sequence-parallel", "--distributed-backend", "hetero"], nproc=4,
                                  plan=tensor, tmp_path=tmp_path, env={"HETERO_DEVICE": "cpu"})
    _assert_same(reference, across_vendors)
    assert "TP=2 EP=2 ETP=1 PP=2" in across_vendors.output
    # The EP 2 checkpoint of iteration 2, resumed by one process (EP 1): iteration 3 as before.
    resumed = run_pretrain(JOB + ["--use-distributed-optimizer", "--load", str(tmp_path / "ckpt"), "--ckpt-step", "2"])
    assert list(resumed.iteration_losses()) == [3]
    _assert_same(reference, resumed)
    # A checkpoint saved by the non-distributed optimizer under EP 2 cannot move its state to
    # EP 1: said so, no traceback.
    saved_plain = run_pretrain(JOB + ["--save", str(tmp_path / "plain"), "--save-interval", "2"],
                               nproc=4, plan=unequal, tmp_path=tmp_path)
    assert saved_plain.returncode == 0, saved_plain.output[-3000:]
    moved = run_pretrain(JOB + ["--load", str(tmp_path / "plain"), "--ckpt-step", "2"])
    assert moved.returncode != 0 and "Traceback" not in moved.output, moved.output[-3000:]
    assert "saved with another expert-parallel size" in moved.output and "--no-load-optim" in moved.output


def test_stages_of_different_degrees_must_hold_as_many_copies_of_their_experts():
    """Each stage lays its expert grid over its own ranks; megatron-core's expert optimizer
    pairs one copy of every stage's experts through the pipeline, so the copies must agree."""
    fields = dict(tp=2, pp=2, dp=2, stages=[1, 3], replicas=[4, 4], rank_order=list(range(6)), stage_tp=[2, 1])
    following = _plan(**fields, expert_parallel=2)  # expert TP = each stage's degree: 1 copy each
    assert [following.grid.stage_expert_data_parallel(s) for s in (0, 1)] == [1, 1]
    with pytest.raises(PlanError, match=r"gives the stages \[2, 1\] copies of their experts.*leave "
                                        r"expert_tensor_parallel unset"):
        _plan(**fields, expert_parallel=2, expert_tensor_parallel=1)


@pytest.mark.slow
def test_expert_parallel_with_a_degree_per_stage_trains_as_one_process(tmp_path):
    """EP 2 on stages of TP 2 and TP 1 (each stage's experts split as its degree: expert TP 2,
    then 1), uneven stages, permuted ranks, sequence parallelism, the distributed optimizer;
    its checkpoint resumed by one process. And EP 2 x expert TP 2 on one degree, whose
    dispatcher gathers unequal token counts over the expert tensor group."""
    job = JOB + ["--sequence-parallel", "--use-distributed-optimizer"]
    reference = run_pretrain(job)
    assert reference.returncode == 0, reference.output[-3000:]
    plan = make_plan(tp=2, pp=2, dp=2, stages=[1, 3], replicas=[4, 4], rank_order=[5, 3, 1, 4, 2, 0], stage_tp=[2, 1])
    plan["expert_parallel"] = 2
    staged = run_pretrain(job + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"], nproc=6,
                          plan=plan, tmp_path=tmp_path)
    _assert_same(reference, staged)
    assert "TP=[2,1] EP=2 ETP=[2,1]" in staged.output, staged.output[-3000:]
    resumed = run_pretrain(job + ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "2"])
    assert list(resumed.iteration_losses()) == [3]
    _assert_same(reference, resumed)
    wide = make_plan(tp=2, pp=1, dp=2, stages=[4], replicas=[4, 4], rank_order=[3, 1, 2, 0])
    wide.update(expert_parallel=2, expert_tensor_parallel=2)
    _assert_same(reference, run_pretrain(job, nproc=4, plan=wide, tmp_path=tmp_path))
