"""Plans of several replica templates: each device class its own pipeline shape.

The plan format (version 4) and its checks, the rank grid of several templates, the cells and
groups of the templates' gradient reduction, and real training jobs: templates that differ
in pipeline depth, layer split and tensor-parallel degree, with unequal micro-batch counts and
permuted ranks, train exactly as one process does (fp32, <= 1e-4 relative, distributed
optimizer on), tied and untied, on gloo and on the hetero backend across two vendors; their
checkpoints resume in one process and under a one-template plan, and back.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest

from conftest import GPT_MODEL, LLAMA_MODEL, TRAINING, cpu_devices, make_plan, run_pretrain
from hetero.errors import PlanError
from hetero.grid import TP_PP_DP_ORDER
from hetero.plan import Plan
from megatron.hetero.template_reduction import plan_groups

ITERS = ["--train-iters", "10"]
TRAINED = TRAINING + ITERS + ["--use-distributed-optimizer"]


def templated(devices: list[dict] | None = None, rank_order: list[int] | None = None) -> dict:
    """Two templates: TP (2, 1) over stages of 3 and 1 layers, one replica of 5 micro-batches;
    TP 1 over three stages of 1, 2 and 1 layers, one replica of 3 (6 ranks in all)."""
    return {
        "version": 4, "micro_batch_size": 2,
        "templates": [
            {"tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel": 1,
             "stages": [{"num_layers": 3}, {"num_layers": 1, "tensor_parallel": 1}],
             "replicas": [{"num_micro_batches": 5}]},
            {"tensor_parallel": 1, "pipeline_parallel": 3, "data_parallel": 1,
             "stages": [{"num_layers": 1}, {"num_layers": 2}, {"num_layers": 1}],
             "replicas": [{"num_micro_batches": 3}]}],
        "rank_order": rank_order or [4, 1, 5, 0, 2, 3],
        "devices": devices or cpu_devices(6),
    }


# ----- the format and the grid ------------------------------------------------------------


def test_a_plan_of_templates_loads_counts_and_round_trips():
    plan = Plan.from_dict(templated())
    assert plan.num_templates == 2 and plan.world_size == 6 and plan.global_batch_size == 16
    assert plan.data_parallel == 2 and [r.num_micro_batches for r in plan.replicas] == [5, 3]
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.to_dict()["version"] == 4 and "stages" not in plan.to_dict()
    with pytest.raises(PlanError, match="2 replica templates, each with its own stages"):
        plan.stages
    one = plan.template_plan(1)  # a template as a plan of its own: version 3, launch order kept
    assert one.to_dict()["version"] == 3 and one.world_size == 3 and one.num_layers == 4
    assert [one.devices[one.rank_order[r]] for r in range(3)] == [
        plan.devices[plan.rank_order[r]] for r in plan.grid.template_ranks(1)]


def test_one_template_is_written_as_before():
    data = make_plan(2, 2, 2, [2, 2], [4, 4], list(range(8)))
    plan = Plan.from_dict(data)
    assert plan.num_templates == 1 and plan.to_dict() == data and plan.tensor_parallel == 2
    assert Plan.of_templates(plan.templates, micro_batch_size=2, rank_order=data["rank_order"],
                             devices=plan.devices).to_dict() == {**data, "version": 3}


@pytest.mark.parametrize("change, fragment", [
    ({"version": 3}, "templates need plan version 4"),
    ({"tensor_parallel": 2}, "tensor_parallel and templates both given"),
    ({"context_parallel": 2}, "does not support context_parallel"),
    ({"expert_parallel": 2}, "does not support expert_parallel"),
    ({"devices": cpu_devices(5)}, "templates[0]: data_parallel x sum of the stages' tensor_parallel"),
])
def test_what_several_templates_refuse_is_named(change, fragment):
    with pytest.raises(PlanError) as refused:
        Plan.from_dict({**templated(), **change})
    assert fragment in str(refused.value)


def test_every_template_holds_the_whole_model():
    data = templated()
    data["templates"][1]["stages"][1]["num_layers"] = 3
    with pytest.raises(PlanError, match=r"the templates hold \[4, 5\] decoder layers"):
        Plan.from_dict(data)
    data = templated()
    data["templates"][0]["stages"] = [{"num_layers": 2, "virtual_stages": [1, 1]},
                                      {"num_layers": 2, "virtual_stages": [1, 1]}]
    data["templates"][0]["tensor_parallel"] = 1
    data.update(devices=cpu_devices(5), rank_order=[0, 1, 2, 3, 4])
    data["templates"][0]["replicas"] = [{"num_micro_batches": 4}]
    with pytest.raises(PlanError, match="virtual_stages on a pipeline of 2 stages"):
        Plan.from_dict(data)


def test_the_grid_of_templates():
    grid = Plan.from_dict(templated()).grid
    assert list(grid.template_ranks(0)) == [0, 1, 2] and list(grid.template_ranks(1)) == [3, 4, 5]
    for rank in range(grid.world_size):  # every rank once, its coordinates round trip
        c = grid.coords(rank)
        assert grid.rank_at(c.tp_rank, c.dp_rank, c.pp_rank, c.cp_rank) == rank
        assert c.template == (0 if rank < 3 else 1) and c.local_dp_rank == 0
    for token in ("tp", "dp", "pp", "tp-pp", "dp-cp", "tp-dp-cp"):
        groups = grid.groups(token)
        assert sorted(itertools.chain(*groups)) == list(range(6)) or token == "pp", token
        assert all(len({grid.coords(r).template for r in g}) == 1 for g in groups), token  # never across
    assert grid.groups("tp") == [[0, 1], [2], [3], [4], [5]]
    assert grid.groups("pp") == [[0, 2], [1, 2], [3, 4, 5]]  # the TP 1 stage serves both tensor ranks
    # Megatron-LM's tp-pp-dp mapping is the same grid in another order
    assert grid.positions(TP_PP_DP_ORDER) == list(range(6))


def test_cells_follow_every_templates_stage_and_shard_boundaries():
    """Two holders of a 4-row tensor at TP 2 (rows 0-1, 2-3) and one at TP 1 (rows 0-3):
    two groups, each pairing one TP 2 rank with the TP 1 rank; a layer held whole by both
    templates' ranks is one group."""
    tables = [[("w", 0, 2), ("layer.5", 0, 8)], [("w", 2, 2)], [("w", 0, 4), ("layer.5", 0, 8)]]
    groups = plan_groups(tables)
    assert [(g.ranks, [(c.name, c.start, c.stop) for c in g.cells]) for g in groups] == [
        ((0, 2), [("layer.5", 0, 8), ("w", 0, 2)]), ((1, 2), [("w", 2, 4)])]


# ----- training: parity with one process -------------------------------------------------

slow = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt_ten():
    result = run_pretrain(GPT_MODEL + TRAINING + ITERS)
    assert result.returncode == 0, result.output[-3000:]
    return result


@pytest.fixture(scope="module")
def llama_ten():
    result = run_pretrain(LLAMA_MODEL + TRAINING + ITERS)
    assert result.returncode == 0, result.output[-3000:]
    return result


def assert_same(reference, result, first: int = 1, last: int = 10) -> None:
    """lm loss and params norm of iterations first..last, each within 1e-4 relative."""
    assert result.returncode == 0, result.output[-3000:]
    for name in ("lm loss", "params norm"):
        want, got = reference.series(name), result.iteration_losses(name)
        assert sorted(got) == list(range(first, last + 1)), (name, sorted(got))
        for i, value in got.items():
            assert abs(value - want[i - 1]) <= 1e-4 * abs(want[i - 1]), (name, i, value, want[i - 1])


@slow
def test_untied_templates_train_as_one_process(tmp_path, llama_ten):
    """Templates of depth 2 and 3, TP (2, 1) and 1, 5 and 3 micro-batches, permuted ranks,
    with sequence parallelism and the reduction overlapped with the backward; the templates'
    weights compared bit for bit every 5 iterations."""
    result = run_pretrain(LLAMA_MODEL + TRAINED + ["--sequence-parallel", "--overlap-grad-reduce",
                                                   "--overlap-param-gather",
                                                   "--check-weight-hash-across-dp-replicas-interval", "5"],
                          nproc=6, plan=templated(), tmp_path=tmp_path)
    assert_same(llama_ten, result)
    assert result.stdout.count("Weight hashes match") == 3
    groups = re.search(r"gradient reduction: (\d+) of this rank's (\d+) groups started during the backward",
                       result.stdout)
    assert groups and groups[1] == groups[2], result.stdout[-3000:]  # every one: none waited for the end


def interleaved(rank_order: list[int]) -> dict:
    """Six layers: TP 1 over stages of 4 and 2 layers, 2 micro-batches; TP 2 over three
    interleaved stages of two virtual stages of one layer each, 6 micro-batches (8 ranks)."""
    return {
        "version": 4, "micro_batch_size": 2,
        "templates": [
            {"tensor_parallel": 1, "pipeline_parallel": 2, "data_parallel": 1,
             "stages": [{"num_layers": 4}, {"num_layers": 2}], "replicas": [{"num_micro_batches": 2}]},
            {"tensor_parallel": 2, "pipeline_parallel": 3, "data_parallel": 1,
             "stages": [{"num_layers": 2, "virtual_stages": [1, 1]}] * 3, "replicas": [{"num_micro_batches": 6}]}],
        "rank_order": rank_order, "devices": cpu_devices(8),
    }


@slow
def test_an_interleaved_template_beside_a_plain_one(tmp_path):
    """One template runs megatron-core's interleaved schedule (its wrap-around transfers from
    the last stage to the first), the other plain 1F1B; batched pipeline communication and
    sequence parallelism."""
    six = [*LLAMA_MODEL, *TRAINING, *ITERS]
    six[six.index("--num-layers") + 1] = "6"
    reference = run_pretrain(six)
    assert reference.returncode == 0, reference.output[-3000:]
    result = run_pretrain(six + ["--use-distributed-optimizer", "--sequence-parallel", "--no-overlap-p2p-communication"],
                          nproc=8, plan=interleaved([7, 1, 5, 0, 2, 3, 4, 6]), tmp_path=tmp_path)
    assert_same(reference, result)
    assert "interleaved 1F1B in template 1" in result.stdout


@slow
def test_tied_templates_on_the_hetero_backend_across_two_vendors(tmp_path, gpt_ten):
    """Template 0 on one vendor, template 1 on the other: every cross-template reduction goes
    through the host-staged bridge; the tied table's four copies (two per template) summed."""
    order = [4, 1, 5, 0, 2, 3]
    devices = [dict(d, vendor="nvidia" if order.index(launch) < 3 else "amd")
               for launch, d in enumerate(cpu_devices(6))]
    result = run_pretrain(GPT_MODEL + TRAINED + ["--distributed-backend", "hetero"], nproc=6,
                          plan=templated(devices, order), tmp_path=tmp_path, env={"HETERO_DEVICE": "cpu"})
    assert_same(gpt_ten, result)


@slow
def test_checkpoints_move_between_templated_and_one_template_plans(tmp_path, gpt_ten):
    """Saved under the templates at iteration 5: resumed in one process and under a plan of one
    template (TP 1, PP 2, two replicas), each continuing the reference; a checkpoint of one
    process resumed under the templates continues it too."""
    flags = GPT_MODEL + TRAINED
    saved = run_pretrain(flags + ["--save", str(tmp_path / "templated"), "--exit-interval", "5"], nproc=6,
                         plan=templated(), tmp_path=tmp_path)
    assert_same(gpt_ten, saved, last=5)
    alone = run_pretrain(flags + ["--load", str(tmp_path / "templated")])
    assert_same(gpt_ten, alone, first=6)
    one_template = make_plan(1, 2, 2, [1, 3], [5, 3], [3, 0, 2, 1])
    moved = run_pretrain(flags + ["--load", str(tmp_path / "templated")], nproc=4, plan=one_template,
                         tmp_path=tmp_path)
    assert_same(gpt_ten, moved, first=6)
    single = run_pretrain(flags + ["--save", str(tmp_path / "single"), "--exit-interval", "5"])
    assert single.returncode == 0, single.output[-3000:]
    back = run_pretrain(flags + ["--load", str(tmp_path / "single")], nproc=6, plan=templated(), tmp_path=tmp_path)
    assert_same(gpt_ten, back, first=6)
