"""Plans of several replica templates: their prediction, the fast estimate's agreement with
it, the planner's search for them, and re-plans that keep the templates a lost node was not
part of.

The reference cluster: one node of eight "big" devices (80 GB, 400 TFLOPS) beside two nodes
of eight "small" ones (24 GB, 80 TFLOPS) on one InfiniBand fabric, and a 3.6B-parameter
model: a big device holds it whole, a small one only split in two. One pipeline shape for
both wastes one of them; a template each runs the big ones at TP1 and the small ones at TP2.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from conftest import REPO
from hetero.job import Objective
from hetero.jobs import plan_for_objective, plan_for_recorded_job, plan_job
from hetero.plan import Plan
from hetero.predict.costs import CostModel
from hetero.predict.predictor import predict
from hetero.predict.template_reduction import TemplateLayout, cell_groups
from hetero.predict.training_setup import TrainingSetup
from hetero.report import summary, timeline_png
from hetero.runtime_rules import model_problems
from hetero.search.options import PlannerOptions, device_classes
from hetero.search.placement import place, place_templates
from hetero.search.planner import Planner
from hetero.spec.cluster import Cluster
from hetero.spec.model import ModelSpec
from hetero.spec.presets import load_model

DEVICES = {"big": {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 400, "memory_bandwidth_gbs": 3000},
           "small": {"vendor": "nvidia", "memory_gib": 24, "peak_tflops": 80, "memory_bandwidth_gbs": 1000}}
MODEL = ModelSpec(num_layers=32, hidden_size=3072, num_attention_heads=32, seq_length=4096, vocab_size=32000)
BATCH = 1024


def big_and_small(gbps: int = 800, small_nodes: int = 2) -> Cluster:
    nodes = [{"host_prefix": "big", "num_nodes": 1, "device": "big", "count": 8, "intra_link": "nvlink3",
              "nic": {"kind": "ib", "gbps": gbps}},
             {"host_prefix": "small", "num_nodes": small_nodes, "device": "small", "count": 8, "intra_link": "nvlink3",
              "nic": {"kind": "ib", "gbps": gbps}}]
    return Cluster.from_dict({"name": "big-and-small", "devices": DEVICES, "groups": [{"name": "g", "nodes": nodes}]})


def two_templates(cluster: Cluster, big_tp: int = 1, small_tp: int = 2, big_micro: int = 91,
                  small_micro: int = 37) -> Plan:
    """The big node at big_tp (one stage), the small nodes at small_tp (one stage), placed."""
    classes = device_classes(cluster)
    big = place(cluster, classes, big_tp, 1, [32], [(0,)] * (8 // big_tp), [big_micro] * (8 // big_tp), "replica-major")
    small_replicas = 8 * (len(classes[1].hosts)) // small_tp
    small = place(cluster, classes, small_tp, 1, [32], [(1,)] * small_replicas, [small_micro] * small_replicas,
                  "replica-major")
    return place_templates(cluster, [big, small])


def costs_of(cluster: Cluster, tp: int = 2) -> CostModel:
    return CostModel(cluster, MODEL, TrainingSetup(sequence_parallel=tp > 1))


# ----- prediction ---------------------------------------------------------------------------


def test_each_template_runs_its_own_pipeline_and_all_wait_for_the_reduction():
    cluster = big_and_small()
    plan = two_templates(cluster)
    assert plan.version == 4 and plan.num_templates == 2
    costs = costs_of(cluster)
    prediction = predict(plan, cluster, costs)
    alone = [predict(plan.template_plan(k), cluster, costs) for k in range(2)]
    # The pipelines do not slow each other: the slowest template's pipeline, then the
    # cross-template reduction, then the optimizer step.
    assert prediction.reduction_start_s == pytest.approx(max(max(p.stage_end_s) for p in alone))
    assert min(prediction.reduce_s) > 0
    assert prediction.iteration_time_s == pytest.approx(
        prediction.reduction_start_s + max(prediction.reduce_s) + prediction.optimizer_s)
    assert prediction.iteration_time_s > max(max(p.stage_end_s) for p in alone)
    assert prediction.fits and len(prediction.timelines) == plan.data_parallel
    assert {r.slot.replica for r in prediction.reports} == set(range(plan.data_parallel))


def test_the_reduction_grows_with_slower_links():
    fast, slow = big_and_small(gbps=800), big_and_small(gbps=100)
    reduce_fast = predict(two_templates(fast), fast, costs_of(fast)).reduce_s
    reduce_slow = predict(two_templates(slow), slow, costs_of(slow)).reduce_s
    assert all(s > 2 * f for f, s in zip(reduce_fast, reduce_slow))


def test_templates_of_different_degrees_reduce_in_more_groups_of_the_same_volume():
    cluster = big_and_small()
    costs = costs_of(cluster)
    same = cell_groups(costs, [TemplateLayout((32,), (2,)), TemplateLayout((32,), (2,))])
    mixed = cell_groups(costs, [TemplateLayout((32,), (1,)), TemplateLayout((32,), (2,))])
    assert sum(g.params for g in same) == pytest.approx(sum(g.params for g in mixed))
    assert sum(g.params for g in same) == pytest.approx(MODEL.total_params(), rel=1e-3)

    def groups_of(groups, holder):
        return sum(holder in g.holders for g in groups)

    assert groups_of(same, (0, 0, 0)) == 1 and groups_of(mixed, (0, 0, 0)) == 2  # TP1 rank: one group per shard
    # Stages cut at different layers: a stage takes part in a group per overlapping stage of the other.
    staged = cell_groups(costs, [TemplateLayout((16, 16), (2, 2)), TemplateLayout((10, 22), (2, 2))])
    assert groups_of(staged, (0, 1, 0)) == 2 and groups_of(staged, (1, 0, 0)) == 2
    # The tied table: every template's first and last stage hold it, in one group per shard.
    tied = [g for g in staged if {(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)} <= set(g.holders)]
    assert len(tied) == 1
    plan = two_templates(cluster)
    mixed_s = predict(plan, cluster, costs).reduce_s
    equal_s = predict(two_templates(cluster, big_tp=2, big_micro=46), cluster, costs).reduce_s
    assert mixed_s[0] > equal_s[0]  # the TP1 ranks hold and reduce twice the parameters, in two groups


def test_memory_is_each_templates_own():
    cluster = big_and_small()
    plan = two_templates(cluster)
    prediction = predict(plan, cluster, costs_of(cluster))
    for k in range(2):
        alone = predict(plan.template_plan(k), cluster, costs_of(cluster))
        for name, gib in alone.peak_memory_gib.items():
            assert prediction.peak_memory_gib[name] == pytest.approx(gib)


def test_explain_and_the_timeline_show_every_template(tmp_path):
    cluster = big_and_small()
    plan = two_templates(cluster)
    prediction = predict(plan, cluster, costs_of(cluster))
    text = summary(plan, prediction, cluster, "test")
    assert "2 replica templates" in text and "template 0 TP=1 PP=1 DP=8" in text and "template 1 TP=2 PP=1 DP=8" in text
    assert timeline_png(plan, prediction, tmp_path / "plan.png").stat().st_size > 0


def big_and_interleaved_small(cluster: Cluster, virtual_stages: int = 2) -> Plan:
    """The big node at TP1 (one stage), the small nodes at TP2 in a pipeline of four stages
    with virtual_stages model chunks each (one template interleaved, the other not)."""
    classes = device_classes(cluster)
    big = place(cluster, classes, 1, 1, [32], [(0,)] * 8, [88] * 8, "replica-major")
    small = place(cluster, classes, 2, 1, [8] * 4, [(1,) * 4] * 2, [160] * 2, "replica-major",
                  virtual_stages=virtual_stages)
    return place_templates(cluster, [big, small])


def test_an_interleaved_template_runs_the_interleaved_schedule_with_its_memory():
    cluster = big_and_small()
    plan = big_and_interleaved_small(cluster)
    assert [len(t.stages[0].virtual_stages or [1]) for t in plan.templates] == [1, 2]
    costs = costs_of(cluster)
    prediction = predict(plan, cluster, costs)
    plain = predict(big_and_interleaved_small(cluster, virtual_stages=1), cluster, costs)
    small_replicas = [d for d in prediction.timelines if plan.template_of_replica(d) == 1]
    assert {op.chunk for d in small_replicas for ops in prediction.timelines[d] for op in ops} == {0, 1}
    # each chunk keeps its activations in flight: more memory, a shorter pipeline (the
    # bubble fills a chunk at a time); the big template's memory is its own either way
    assert prediction.peak_memory_gib["small"] > plain.peak_memory_gib["small"]
    assert prediction.peak_memory_gib["big"] == pytest.approx(plain.peak_memory_gib["big"])
    small_end = max(prediction.stage_end_s[1:])  # stage_end_s: template 0's one stage, then template 1's
    assert small_end < max(plain.stage_end_s[1:])
    # the fast estimate prices the same schedule and memory
    fits, seconds = Planner(cluster, MODEL, plan.global_batch_size).estimate(plan)
    assert fits == prediction.fits
    assert seconds == pytest.approx(prediction.iteration_time_s, rel=0.05)


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_the_overlapped_reduction_costs_at_most_the_plain_one(distributed_optimizer):
    """--overlap-grad-reduce: all but each rank's last bucket hide behind its stage's last
    backward; --overlap-param-gather: the gather behind the next forward. The predictor and
    the fast estimate price it with one rule."""
    cluster = big_and_small(gbps=100)
    plan = big_and_interleaved_small(cluster)
    times = {}
    for overlap in (False, True):
        setup = TrainingSetup(sequence_parallel=True, distributed_optimizer=distributed_optimizer,
                              overlap_grad_reduce=overlap, overlap_param_gather=overlap and distributed_optimizer)
        prediction = predict(plan, cluster, CostModel(cluster, MODEL, setup))
        estimate = Planner(cluster, MODEL, plan.global_batch_size, PlannerOptions(setup=setup)).estimate(plan)[1]
        times[overlap] = (prediction.reduce_s, prediction.iteration_time_s, estimate)
    (plain_reduce, plain_s, plain_estimate), (overlapped_reduce, overlapped_s, overlapped_estimate) = \
        times[False], times[True]
    assert all(o <= p for o, p in zip(overlapped_reduce, plain_reduce))
    assert max(overlapped_reduce) < max(plain_reduce)
    assert overlapped_s < plain_s and overlapped_estimate < plain_estimate
    assert overlapped_estimate == pytest.approx(overlapped_s, rel=0.05)


# ----- the planner ----------------------------------------------------------------------------


def test_the_planner_gives_each_class_its_own_shape_where_memory_differs():
    cluster = big_and_small()
    one = Planner(cluster, MODEL, BATCH, PlannerOptions(templates=False)).plan()
    result = Planner(cluster, MODEL, BATCH, PlannerOptions()).plan()
    plan = result.plan
    assert result.family == "templates" and plan.num_templates == 2
    shapes = {}
    for k, template in enumerate(plan.templates):
        types = {d.device_type for d in plan.template_plan(k).devices}
        assert len(types) == 1  # class-pure
        shapes[types.pop()] = (template.tensor_parallel, template.pipeline_parallel)
    assert shapes["big"] != shapes["small"] and shapes["big"][0] < shapes["small"][0]
    assert result.prediction.iteration_time_s < one.prediction.iteration_time_s
    fits, seconds = Planner(cluster, MODEL, BATCH).estimate(plan)
    assert fits and seconds == pytest.approx(result.prediction.iteration_time_s, rel=0.02)


def test_no_templates_for_models_the_runtime_cannot_train_with_them():
    cluster = big_and_small()
    plan = two_templates(cluster)
    assert any("several replica templates" in p for p in model_problems(plan, dataclasses.replace(MODEL, mtp_num_layers=1)))
    moe = dataclasses.replace(MODEL, num_experts=8, moe_router_topk=2)
    assert any("several replica templates" in p for p in model_problems(plan, moe))
    assert not Planner(cluster, dataclasses.replace(MODEL, mtp_num_layers=1), BATCH)._searches_templates()


def test_a_written_templated_plan_is_explained_again(tmp_path):
    job = plan_job(big_and_small(), MODEL, BATCH, with_baseline=False, with_upper_bound=False)
    assert job.plan.num_templates == 2
    path = tmp_path / "plan.json"
    job.plan.save(path)
    again = Plan.load(path)
    assert again.to_dict() == job.plan.to_dict()
    out = subprocess.run([sys.executable, "-m", "hetero", "explain", str(path)], cwd=REPO, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert "2 replica templates" in out.stdout


def test_a_replan_after_a_lost_node_keeps_the_templates_it_was_not_part_of():
    cluster = big_and_small(small_nodes=3)
    plan = plan_job(cluster, MODEL, BATCH, with_baseline=False, with_upper_bound=False).plan
    assert plan.num_templates == 2
    small_hosts = sorted({d.host for d in plan.devices if d.device_type == "small"})
    survivors = big_and_small(small_nodes=2)  # small2 lost
    assert small_hosts[-1] not in {n.host for n in survivors.nodes}
    again = plan_for_recorded_job(plan, survivors)
    assert {d.host for d in again.devices} <= {n.host for n in survivors.nodes}
    assert again.global_batch_size == plan.global_batch_size and again.micro_batch_size == plan.micro_batch_size
    assert predict(again, survivors, CostModel(survivors, MODEL, TrainingSetup(**again.training.setup_fields()))).fits
    # The search offers the big devices' template, which lost nothing, as it was placed, with
    # templates on the hosts it leaves free, beside everything else.
    from hetero.search.templates import TemplateSearch

    big = next(plan.template_plan(k) for k in range(plan.num_templates)
               if plan.template_plan(k).devices[0].device_type == "big")
    planner = Planner(survivors, MODEL, BATCH, PlannerOptions(micro_batch_sizes=(plan.micro_batch_size,),
                                                              kept_templates=(big,)))
    search = TemplateSearch(planner.estimator, planner.estimator.blocks.costs)
    kept = search.option(None, planner.classes, plan=big)
    mixes = search.around([kept], plan.micro_batch_size, float("inf"))
    assert mixes and all(chosen[0] is kept for _, chosen, _ in mixes)
    mixed = search.materialize(*min(mixes, key=lambda m: m[0])[1:])
    assert mixed.template_plan(0).devices == big.devices and mixed.template(0).stages == big.template(0).stages


# ----- a device class used in part -------------------------------------------------------------


def test_the_cost_objective_uses_a_device_class_in_part():
    """Sailor-like A100-40GB and V100-16GB at 1:3, GPT-Neo-2.7B: per token the A100s are the
    cheaper class, and fewer of them cheaper still (each runs more micro-batches per gradient
    reduction over the cloud network), so the cheapest plan rents part of the A100 nodes."""
    spec = Cluster.load(REPO / "examples" / "clusters" / "sailor_like_128.yaml").to_dict()
    spec["prices_per_hour"] = {"A100-40GB": 2.93, "V100-16GB": 2.48}
    cluster = Cluster.from_dict(spec)
    model = load_model("gpt-neo-2.7b").with_seq_length(2048)
    job, tried = plan_for_objective(cluster, model, 512, PlannerOptions(), Objective("cost"),
                                    with_baseline=False, with_upper_bound=False, precision=None)
    used = {d.device_type for d in job.plan.devices}
    assert used == {"A100-40GB"} and len(job.plan.devices) < 32
    costs = {tuple(k): e.dollars_per_million_tokens for k, e in tried}
    assert job.economics.dollars_per_million_tokens < costs[("A100-40GB",)]
    assert job.economics.dollars_per_million_tokens == pytest.approx(min(costs.values()), rel=1e-6)
