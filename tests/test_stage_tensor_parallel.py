"""A tensor-parallel degree per pipeline stage (plan version 3): the plan's grid, the
groups megatron-core builds from it, the re-sharded stage transfers, and loss parity."""

import itertools

import pytest

from conftest import GPT_MODEL, LLAMA_MODEL, TRAINING, assert_same_training, make_plan, run_pretrain
from hetero.errors import PlanError
from hetero.plan import Plan
from megatron.hetero.stage_tensor_parallel import rank_groups, stage_pieces


def plan_of(stage_tp, dp=2, stages=None, replicas=None, rank_order=None) -> Plan:
    stages = stages or [1] * len(stage_tp)
    world = dp * sum(stage_tp)
    return Plan.from_dict(make_plan(1, len(stage_tp), dp, stages, replicas or [1] * dp,
                                    rank_order or list(range(world)), stage_tp=stage_tp))


# ----- the plan's grid -------------------------------------------------------------------


@pytest.mark.parametrize("stage_tp", [[2, 1], [1, 2], [1, 4, 2], [2, 2]])
def test_every_logical_rank_has_one_place_in_the_grid(stage_tp):
    plan = plan_of(stage_tp, dp=3)
    assert plan.world_size == 3 * sum(stage_tp)
    places = [plan.grid.coords(r) for r in range(plan.world_size)]
    assert [plan.grid.rank_at(c.tp_rank, c.dp_rank, c.pp_rank) for c in places] == list(range(plan.world_size))
    assert {(c.pp_rank, c.tp_rank) for c in places} == {(s, t) for s, tp in enumerate(stage_tp) for t in range(tp)}


def test_one_degree_for_every_stage_keeps_megatrons_order():
    uniform = plan_of([2, 2, 2], dp=2)
    assert not uniform.per_stage_tensor_parallel
    assert [uniform.grid.rank_at(t, d, s) for s in range(3) for d in range(2) for t in range(2)] == list(range(12))


def test_groups_partition_the_world_and_agree_with_the_grid():
    plan = plan_of([2, 1, 4], dp=2)
    for token in ("tp", "dp", "tp-pp", "tp-dp", "tp-dp-cp", "cp", "ep", "tp-ep-pp", "dp-cp"):
        groups = rank_groups(plan, token)
        assert sorted(itertools.chain(*groups)) == list(range(plan.world_size)), token
    assert rank_groups(plan, "tp") == [plan.grid.tensor_group(d, s) for s in range(3) for d in range(2)]
    assert sorted(rank_groups(plan, "tp-pp")) == [plan.grid.replica_ranks(d) for d in range(2)]
    # pipeline groups: tensor rank t meets rank t mod tp_s of each stage, one per stage
    pipelines = rank_groups(plan, "pp")
    assert len(pipelines) == 2 * 4 and all(len(g) == 3 for g in pipelines)
    assert all([plan.grid.coords(r).pp_rank for r in g] == [0, 1, 2] for g in pipelines)


def test_plan_errors_name_the_field_and_the_fix():
    good = make_plan(1, 2, 1, [2, 2], [4], [0, 1, 2], stage_tp=[2, 1])
    with pytest.raises(PlanError, match=r"stages\[0\].tensor_parallel, stages\[1\].tensor_parallel need "
                                        r"plan version 3"):
        Plan.from_dict({**good, "version": 2})
    with pytest.raises(PlanError, match="data_parallel x sum of the stages' tensor_parallel"):
        Plan.from_dict({**good, "devices": good["devices"][:2]})
    interleaved = {**good, "replicas": [{"num_micro_batches": 4}],
                   "stages": [{"num_layers": 2, "tensor_parallel": 2, "virtual_stages": [1, 1]},
                              {"num_layers": 2, "virtual_stages": [1, 1]}]}
    with pytest.raises(PlanError, match="interleaved schedule with a tensor-parallel degree per stage"):
        Plan.from_dict(interleaved)


# ----- re-sharded stage transfers ----------------------------------------------------------


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("stage_tp", [[2, 1], [1, 2], [4, 2], [2, 4], [1, 4], [3, 2]])
def test_what_one_stage_sends_is_what_the_next_receives(stage_tp, sequence_parallel):
    plan = plan_of(stage_tp, dp=2)
    seq = 24
    for d in range(2):
        sent = {(r, p.peer, p.start, p.stop) for r in plan.grid.tensor_group(d, 0)
                for p in stage_pieces(plan, r, 1, seq, sequence_parallel, receiving=False)}
        received = {(p.peer, r, p.start, p.stop) for r in plan.grid.tensor_group(d, 1)
                    for p in stage_pieces(plan, r, 0, seq, sequence_parallel, receiving=True)}
        assert sent == received
        # every receiving rank gets exactly its rows, once
        for r in plan.grid.tensor_group(d, 1):
            t, tp = plan.grid.coords(r).tp_rank, stage_tp[1]
            rows = sorted((p.start, p.stop) for p in stage_pieces(plan, r, 0, seq, sequence_parallel, True))
            want = (t * seq // tp, (t + 1) * seq // tp) if sequence_parallel else (0, seq)
            assert rows[0][0] == want[0] and rows[-1][1] == want[1]
            assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
            assert all(plan.grid.coords(p.peer).dp_rank == d for p in stage_pieces(plan, r, 0, seq, sequence_parallel, True))


# ----- training: loss parity with one process (fp32, CPU) -----------------------------------

# The Llama-style model is untied: the first and last stage differ in degree below.
slow = pytest.mark.slow


@slow
@pytest.mark.core019
def test_tp2_then_tp1_uneven_stages_unequal_replicas_permuted(tmp_path, llama_reference):
    plan = make_plan(1, 2, 2, [3, 1], [5, 3], [5, 0, 4, 1, 3, 2], stage_tp=[2, 1])
    result = run_pretrain(LLAMA_MODEL + TRAINING, nproc=6, plan=plan, tmp_path=tmp_path)
    assert_same_training(llama_reference, result)


@slow
def test_tp1_then_tp2_with_sequence_parallel(tmp_path, llama_reference):
    plan = make_plan(1, 2, 2, [1, 3], [2, 6], [4, 1, 5, 0, 2, 3], stage_tp=[1, 2])
    result = run_pretrain(LLAMA_MODEL + TRAINING + ["--sequence-parallel"], nproc=6, plan=plan,
                          tmp_path=tmp_path)
    assert_same_training(llama_reference, result)


@slow
def test_hetero_backend_across_vendors_with_recomputation(tmp_path, llama_reference):
    """The hetero backend with the TP=2 stage on one vendor and the TP=1 stage on the other
    (stage transfers cross vendors), every layer recomputed."""
    labels = ["nvidia", "nvidia", "amd"]
    devices = [{"host": "localhost", "device_type": "cpu", "vendor": v} for v in labels]
    plan = make_plan(1, 2, 1, [2, 2], [8], [1, 0, 2], devices=devices, stage_tp=[2, 1])
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    result = run_pretrain(LLAMA_MODEL + TRAINING + ["--distributed-backend", "hetero"] + recompute, nproc=3,
                          plan=plan, tmp_path=tmp_path, env={"HETERO_DEVICE": "cpu"})
    assert_same_training(llama_reference, result)


@slow
def test_tp2_then_tp1_distributed_optimizer_sequence_parallel(tmp_path, llama_reference):
    plan = make_plan(1, 2, 2, [2, 2], [6, 2], [0, 1, 2, 3, 4, 5], stage_tp=[2, 1])
    result = run_pretrain(LLAMA_MODEL + TRAINING + ["--use-distributed-optimizer", "--sequence-parallel"],
                          nproc=6, plan=plan, tmp_path=tmp_path)
    assert_same_training(llama_reference, result)


# A tied model (GPT_MODEL: one table for the input embedding and the output layer) whose
# first and last stage differ in degree: the two copies' gradients are summed by vocabulary
# row (stage_tensor_parallel.TiedEmbeddingGrads).


@slow
def test_tied_embedding_tp2_then_tp1_uneven_stages_unequal_replicas_permuted(tmp_path, gpt_reference):
    plan = make_plan(1, 2, 2, [3, 1], [5, 3], [5, 0, 4, 1, 3, 2], stage_tp=[2, 1])
    result = run_pretrain(GPT_MODEL + TRAINING, nproc=6, plan=plan, tmp_path=tmp_path)
    assert_same_training(gpt_reference, result)


@slow
def test_tied_embedding_tp1_then_tp2_distributed_optimizer_resumed_at_tp2_then_tp1(tmp_path, gpt_reference):
    """Trained at stage degrees (1, 2) with the distributed optimizer and sequence
    parallelism, saved at iteration 3, resumed at degrees (2, 1) with another split: the same
    training as one process, before and after the resume."""
    flags = GPT_MODEL + TRAINING + ["--use-distributed-optimizer", "--sequence-parallel"]
    saved = run_pretrain(flags + ["--save", str(tmp_path / "ckpt"), "--exit-interval", "3"], nproc=6,
                         plan=make_plan(1, 2, 2, [1, 3], [2, 6], [4, 1, 5, 0, 2, 3], stage_tp=[1, 2]),
                         tmp_path=tmp_path)
    assert saved.returncode == 0, saved.output[-3000:]
    reference = gpt_reference.series("lm loss")
    assert len(saved.series("lm loss")) == 3
    for got, want in zip(saved.series("lm loss"), reference):
        assert abs(got - want) <= 1e-4 * want, (saved.series("lm loss"), reference)
    resumed = run_pretrain(flags + ["--load", str(tmp_path / "ckpt")], nproc=3,
                           plan=make_plan(1, 2, 1, [2, 2], [8], [2, 0, 1], stage_tp=[2, 1]), tmp_path=tmp_path)
    assert resumed.returncode == 0, resumed.output[-3000:]
    got = resumed.iteration_losses()
    assert sorted(got) == [4, 5]
    for i, loss in got.items():
        assert abs(loss - reference[i - 1]) <= 1e-4 * reference[i - 1], (i, loss, reference)


@pytest.fixture(scope="module")
def llama_six():
    result = run_pretrain(LLAMA_MODEL + TRAINING + ["--train-iters", "6"])
    assert result.returncode == 0, result.output[-3000:]
    return result


@slow
def test_resume_under_other_stage_degrees_continues_the_same_training(tmp_path, llama_six):
    """Saved with stages at TP (2, 1), resumed with TP (1, 2) and another split: the
    distributed checkpoint re-shards every tensor to the new degrees."""
    six = LLAMA_MODEL + TRAINING + ["--train-iters", "6", "--use-distributed-optimizer"]
    saved = run_pretrain(six + ["--save", str(tmp_path / "ckpt"), "--exit-interval", "3"], nproc=6,
                         plan=make_plan(1, 2, 2, [3, 1], [5, 3], [5, 0, 4, 1, 3, 2], stage_tp=[2, 1]),
                         tmp_path=tmp_path)
    assert saved.returncode == 0, saved.output[-3000:]
    resumed = run_pretrain(six + ["--load", str(tmp_path / "ckpt")], nproc=3,
                           plan=make_plan(1, 2, 1, [1, 3], [8], [1, 2, 0], stage_tp=[1, 2]), tmp_path=tmp_path)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "successfully loaded checkpoint" in resumed.stdout
    reference = llama_six.series("lm loss")
    got = resumed.iteration_losses()
    assert sorted(got) == [4, 5, 6]
    for i, loss in got.items():
        assert abs(loss - reference[i - 1]) <= 1e-4 * reference[i - 1], (i, loss, reference)


def test_start_up_refuses_what_a_degree_per_stage_cannot_run(tmp_path):
    """Said before any process group exists, with the fix: multi-token prediction (its copy
    of the word embeddings on the last stage is kept in step at one degree only), and a
    mixture of experts under tensor parallelism without sequence parallelism."""
    from hetero.errors import HeteroError
    from megatron.hetero.startup import configure

    path = tmp_path / "plan.json"
    path.write_text(__import__("json").dumps(make_plan(1, 2, 1, [2, 2], [8], [0, 1, 2], stage_tp=[2, 1])))
    rope = ["--position-embedding-type", "rope"]
    with pytest.raises(HeteroError, match="--mtp-num-layers with a tensor-parallel degree per stage"):
        configure(GPT_MODEL + TRAINING + rope + ["--mtp-num-layers", "1", "--hetero-plan", str(path)], 3)
    with pytest.raises(HeteroError, match=r"--num-experts with tensor parallelism 2 \(stage degrees \[2, 1\]\) "
                                          r"needs --sequence-parallel"):
        configure(GPT_MODEL + TRAINING + ["--num-experts", "2", "--hetero-plan", str(path)], 3)
