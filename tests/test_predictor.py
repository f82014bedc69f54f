"""The predictor against cases computed by hand."""

import json
import random

import pytest

from hetero.spec.cluster import Cluster
from hetero.predict.costs import CostModel
from hetero.predict.training_setup import TrainingSetup
from hetero.predict.memory import GIB, rank_memory
from hetero.spec.model import ModelSpec
from hetero.spec.presets import PRESETS
from hetero.plan import DeviceEntry, Plan
from hetero.predict.predictor import predict
from hetero.spec.profiles import Profiles
from hetero.predict.schedule import (
    StageTiming,
    equal_stages_step,
    equal_stages_time,
    makespan,
    op_order,
    pipeline_shape,
    simulate_1f1b,
    stage_ends_1f1b,
    timing_shape,
)


def _cluster(nodes, inter=()):
    groups = {}
    for node in nodes:
        groups.setdefault(node.pop("group", "g"), []).append(node)
    return Cluster.from_dict({
        "name": "hand",
        "devices": {"amd-gpu": {"vendor": "amd", "memory_gib": 64, "peak_tflops": 100,
                                "memory_bandwidth_gbs": 1000}},
        "groups": [{"name": g, "nodes": n} for g, n in groups.items()],
        "inter_group": list(inter),
    })


def _node(host, count=1, device="A100-80GB", gbps=100, kind="ib", group="g"):
    return {"host": host, "device": device, "count": count, "intra_link": "nvlink3",
            "nic": {"kind": kind, "gbps": gbps}, "group": group}


# ----- 1F1B schedule ------------------------------------------------------------------


def test_megatron_1f1b_op_order():
    assert op_order(0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert op_order(1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert op_order(0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # warm-up capped by m


def test_uneven_two_stage_pipeline_by_hand():
    # Stage 1 is twice as slow. Worked by hand:
    # s0 F0[0,1] F1[1,2]; s1 F0[1,3] B0[3,7]; s0 B0[7,9]; s1 F1[7,9] B1[9,13];
    # s0 F2[9,10] B1[13,15]; s1 F2[13,15] B2[15,19]; s0 B2[19,21].
    ops = simulate_1f1b([StageTiming(1, 2), StageTiming(2, 4)], 3)
    assert [(o.kind, o.micro_batch, o.start, o.end) for o in ops[0]] == [
        ("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 7, 9), ("F", 2, 9, 10), ("B", 1, 13, 15), ("B", 2, 19, 21)]
    assert makespan(ops) == 21


def test_uniform_pipeline_matches_closed_form_and_sends_block():
    assert makespan(simulate_1f1b([StageTiming(1, 2)] * 4, 8)) == (8 + 4 - 1) * 3
    # A blocking send adds to its sender's op: two stages, send 0.5 each way.
    ops = simulate_1f1b([StageTiming(1, 2, send_forward_s=0.5), StageTiming(1, 2, send_backward_s=0.5)], 1)
    assert makespan(ops) == pytest.approx(1.5 + 1 + 2.5 + 2)


def _random_stages(rng: random.Random, count: int, non_decreasing: bool) -> list[StageTiming]:
    """Stages of random forward, backward and send times (no send out of the last stage nor
    back from the first); with non_decreasing, each works at least as long per micro-batch
    as the one before it."""
    work = [rng.uniform(0.2, 5.0) for _ in range(count)]
    if non_decreasing:
        work.sort()
    stages = []
    for s, total in enumerate(work):
        parts = [rng.random(), rng.random(), rng.random() if s < count - 1 else 0.0, rng.random() if s else 0.0]
        stages.append(StageTiming(*(total * part / sum(parts) for part in parts)))
    return stages


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 * max(abs(a), abs(b))


@pytest.mark.parametrize("micro_batches", [1, 2, 3, 7, 16, 40])
def test_closed_form_equals_the_simulation_where_no_stage_works_less_than_the_one_before(micro_batches):
    rng = random.Random(micro_batches)
    for _ in range(200):
        stages = _random_stages(rng, rng.randint(1, 8), non_decreasing=True)
        simulated = max(stage_ends_1f1b(stages, micro_batches))
        assert _close(timing_shape(stages).time(micro_batches), simulated)


@pytest.mark.parametrize("micro_batches", [2, 5, 16])
def test_closed_form_for_one_micro_batch_or_one_stage_and_a_floor_everywhere(micro_batches):
    rng = random.Random(100 + micro_batches)
    for _ in range(200):
        stages = _random_stages(rng, rng.randint(2, 8), non_decreasing=False)
        assert _close(timing_shape(stages).time(1), max(stage_ends_1f1b(stages, 1)))
        assert _close(timing_shape(stages[:1]).time(micro_batches), max(stage_ends_1f1b(stages[:1], micro_batches)))
        shape = timing_shape(stages)  # uneven stages: the slowest stage's busy time bounds it
        assert shape.busiest_stage(micro_batches) <= max(stage_ends_1f1b(stages, micro_batches)) * (1 + 1e-12)


@pytest.mark.parametrize("stages, micro_batches", [(1, 1), (1, 9), (4, 1), (4, 8), (7, 30)])
def test_equal_stages_closed_form(stages, micro_batches):
    step = 0.37
    timings = [StageTiming(0.12, 0.25)] * stages
    simulated = max(stage_ends_1f1b(timings, micro_batches))
    assert _close(equal_stages_time(step, micro_batches, stages), pipeline_shape([step] * stages).time(micro_batches))
    assert _close(equal_stages_time(step, micro_batches, stages), simulated)
    assert _close(equal_stages_step(equal_stages_time(step, micro_batches, stages), micro_batches, stages), step)


# ----- communication ------------------------------------------------------------------


def test_ring_allreduce_across_hosts_by_hand():
    cluster = _cluster([_node(h) for h in "abcd"])
    costs = CostModel(cluster, PRESETS["gpt-1.7b"], TrainingSetup())
    share = 100e9 / 8 * 0.9  # one device per node gets the whole 100 Gb/s NIC at 90%
    expected = 2 * 3 / 4 * 1e9 / share + 2 * 3 * 2e-6
    assert costs.group_allreduce(list("abcd"), 1e9) == pytest.approx(expected)
    assert costs.group_allreduce(list("abcd"), 1e9, phases=1) == pytest.approx(expected / 2)


def test_ring_over_two_members_on_each_of_two_hosts():
    """NCCL's ring visits node after node: one edge out of each node, which carries both
    members' NIC shares (the whole NIC); the ring's three steps of a quarter each."""
    cluster = _cluster([_node("a", count=2), _node("b", count=2)])
    costs = CostModel(cluster, PRESETS["gpt-1.7b"], TrainingSetup())
    nic = 2 * 100e9 / 8 / 2 * 0.9  # both members' halves of the node's NIC
    expected = 2 * (3 / 4 * 1e9 / nic + 3 * 3e-6)  # NVLink's 3 us is the slowest edge's latency
    assert costs.group_allreduce(["a", "b", "a", "b"], 1e9) == pytest.approx(expected)
    assert costs.group_allreduce(["a", "a", "b", "b"], 1e9) == pytest.approx(expected)


def test_gloo_rings_follow_the_groups_rank_order():
    """On CPU devices (gloo) the ring is the group's rank order: members alternating between
    two nodes make every edge cross, two out of each node, each with one member's share."""
    cluster = Cluster.from_dict({
        "name": "cpus", "devices": {"cpu-dev": {"vendor": "cpu", "memory_gib": 4, "peak_tflops": 0.05,
                                                "memory_bandwidth_gbs": 5}},
        "groups": [{"name": "g", "nodes": [
            {"host": h, "device": "cpu-dev", "count": 2, "intra_link": "loopback",
             "nic": {"kind": "ethernet", "gbps": 8}} for h in "ab"]}]})
    costs = CostModel(cluster, PRESETS["gpt-1.7b"], TrainingSetup())
    packed = costs.allreduce_terms(("a", "a", "b", "b"))
    alternating = costs.allreduce_terms(("a", "b", "a", "b"))
    share = cluster.path("a", "b").bandwidth  # one member's share of the NIC
    assert packed[0] == pytest.approx(3 / 4 / (2 * share))
    assert alternating[0] == pytest.approx(3 / 4 / share)


def test_cross_vendor_and_cross_group_routes():
    cluster = _cluster(
        [_node("nv", gbps=1600, group="x"), _node("amd", device="amd-gpu", gbps=1600, group="y")],
        inter=[{"between": ["x", "y"], "kind": "ethernet", "gbps": 400}],
    )
    route = cluster.path("nv", "amd")
    assert not route.rdma
    assert route.bandwidth == pytest.approx(24e9 * 0.8)  # host staging between vendors binds
    # four transfers share the 400 Gb/s link between the groups: now it binds
    assert cluster.path("nv", "amd", concurrent_crossings=4).bandwidth == pytest.approx(400e9 / 8 * 0.6 / 4)
    same_vendor = cluster.path("nv", "nv")
    assert same_vendor.rdma and same_vendor.bandwidth == pytest.approx(300e9 * 0.8)


# ----- memory ---------------------------------------------------------------------------


def test_gpt_layer_parameters_and_activations():
    m = PRESETS["gpt-3.6b"]
    h, s, a = m.hidden_size, m.seq_length, m.num_attention_heads
    assert m.layer_params() == 12 * h * h + 13 * h  # Megatron's count for a GPT layer
    for t in (1, 2, 8):  # Korthikanti et al.: s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes
        assert m.layer_activation_bytes(1, t, 2, fused_kernels=False) == pytest.approx(
            s * h * (10 + 24 / t + 5 * a * s / (h * t)))
        assert m.layer_activation_bytes(1, t, 2, fused_kernels=True) == pytest.approx(s * h * (10 + 24 / t))
    assert PRESETS["llama2-7b"].total_params() == pytest.approx(6.74e9, rel=0.01)
    assert PRESETS["llama2-70b"].total_params() == pytest.approx(69.0e9, rel=0.01)


def test_bytes_per_parameter_with_and_without_distributed_optimizer():
    cluster = _cluster([_node("a")])
    model = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512, vocab_size=1024)
    costs = CostModel(cluster, model, TrainingSetup())
    common = dict(vendor="nvidia", tensor_parallel=1, data_parallel=4, micro_batch_size=1, num_layers=4,
                  stage=0, num_stages=1, num_micro_batches=1)
    plain = rank_memory(costs, distributed_optimizer=False, **common)
    sharded = rank_memory(costs, distributed_optimizer=True, **common)
    params = plain.weights / 2
    assert (plain.weights + plain.gradients + plain.optimizer) / params == pytest.approx(18)
    assert (sharded.weights + sharded.gradients + sharded.optimizer) / params == pytest.approx(6 + 12 / 4)
    assert plain.activations == pytest.approx(4 * model.layer_activation_bytes(1, 1, 2)
                                              + model.logits_activation_bytes(1, 1, 2)
                                              + costs.activation_message_bytes(1))
    assert plain.overhead == 2.0 * GIB


# ----- a whole plan -----------------------------------------------------------------------


def test_one_device_iteration_is_micro_batches_times_work_plus_step():
    cluster = _cluster([_node("a")])
    model = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512, vocab_size=1024)
    costs = CostModel(cluster, model, TrainingSetup())
    device = DeviceEntry(host="a", device_type="A100-80GB", vendor="nvidia")
    plan = Plan.uniform(tensor_parallel=1, pipeline_parallel=1, data_parallel=1, micro_batch_size=2,
                        num_layers=4, global_batch_size=16, devices=[device])
    costs = CostModel(cluster, model, TrainingSetup(distributed_optimizer=False))
    prediction = predict(plan, cluster, costs)
    f, b = costs.layer_times("A100-80GB", 1, 2)
    lf, lb = costs.stage_extra_times("A100-80GB", 1, 2, first=True, last=True)
    work = 8 * (4 * (f + b) + lf + lb)
    assert prediction.iteration_time_s == pytest.approx(work + prediction.optimizer_s)
    assert prediction.reduce_s == [0.0]
    assert prediction.tokens_per_s == pytest.approx(16 * 512 / prediction.iteration_time_s)


def test_measured_profiles_replace_the_roofline(tmp_path):
    cluster = _cluster([_node("a")])
    model = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512, vocab_size=1024)
    from hetero.spec.profiles import model_shape
    (tmp_path / "a100.json").write_text(json.dumps({
        "kind": "compute", "device_type": "A100-80GB", "precision": "bf16", "model": model_shape(model),
        "entries": [{"tensor_parallel": 1, "micro_batch_size": 1, "layer_forward_s": 0.01, "layer_backward_s": 0.03}],
    }))
    (tmp_path / "links.json").write_text(json.dumps({
        "kind": "links", "links": [{"hosts": ["a", "a"], "bandwidth_gbs": 7.0, "latency_us": 4}]}))
    profiles = Profiles.load_dir(tmp_path)
    costs = CostModel(cluster, model, TrainingSetup(), profiles)
    assert costs.layer_times("A100-80GB", 1, 1) == (0.01, 0.03)
    assert costs.layer_times("A100-80GB", 1, 4) == pytest.approx((0.04, 0.12))  # scaled by micro-batch
    assert costs.layer_times("A100-80GB", 2, 1) == pytest.approx((0.005, 0.015))  # and by TP
    assert costs.route("a", "a").bandwidth == 7e9
    assert profiles.missing(["A100-80GB", "H100-80GB"], model, "bf16") == ["H100-80GB"]


def test_profiles_of_several_passes_merge_to_their_median():
    from hetero.errors import HeteroError
    from hetero.spec.profiles import ComputeProfile, LinkProfile, median_profile, model_shape

    model = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512, vocab_size=1024)

    def one_pass(forward: float, optimizer: float | None, device: str = "A100-80GB") -> ComputeProfile:
        return ComputeProfile.model_validate({
            "kind": "compute", "device_type": device, "precision": "bf16", "model": model_shape(model),
            "entries": [{"tensor_parallel": 1, "micro_batch_size": 1, "layer_forward_s": forward,
                         "layer_backward_s": 2 * forward, "logits_forward_s": forward / 2},
                        {"tensor_parallel": 2, "micro_batch_size": 1, "layer_forward_s": forward / 2,
                         "layer_backward_s": forward}],
            "optimizer_step_s_per_param": optimizer, "measured_on": f"pass {forward}"})

    merged = median_profile([one_pass(0.010, 1e-9), one_pass(0.014, None), one_pass(0.011, 3e-9)])
    by_tp = {e.tensor_parallel: e for e in merged.entries}
    assert (by_tp[1].layer_forward_s, by_tp[1].layer_backward_s) == pytest.approx((0.011, 0.022))
    assert by_tp[1].logits_forward_s == pytest.approx(0.0055)
    assert by_tp[2].logits_forward_s is None and by_tp[2].layer_forward_s == pytest.approx(0.0055)
    assert merged.optimizer_step_s_per_param == pytest.approx(2e-9)  # the passes that measured it
    with pytest.raises(HeteroError, match="different device types"):
        median_profile([one_pass(0.01, None), one_pass(0.01, None, device="H100-80GB")])

    links = LinkProfile.model_validate({"kind": "links", "links": [
        {"hosts": ["a", "a"], "bandwidth_gbs": 7.0, "latency_us": 4}]})
    first = Profiles([one_pass(0.010, None), one_pass(0.02, None, device="H100-80GB")], [links])
    later = Profiles([one_pass(0.012, None), one_pass(0.03, None, device="H100-80GB")])
    both = first.with_compute_passes(later)
    assert both.compute_profile("A100-80GB", model, "bf16").entries[0].layer_forward_s == pytest.approx(0.011)
    assert both.compute_profile("H100-80GB", model, "bf16").entries[0].layer_forward_s == pytest.approx(0.025)
    assert both.link("a", "a").bandwidth_gbs == 7.0


def test_the_first_stage_runs_the_embedding_and_the_last_the_rest_of_the_profiled_logits():
    from hetero.spec.profiles import ComputeProfile, model_shape

    cluster = _cluster([_node("a")])
    model = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512, vocab_size=1024)
    entry = {"tensor_parallel": 1, "micro_batch_size": 1, "layer_forward_s": 0.01, "layer_backward_s": 0.02,
             "logits_forward_s": 0.008, "logits_backward_s": 0.012}
    split = {**entry, "batch_s": 0.001, "embedding_forward_s": 0.002, "embedding_backward_s": 0.003}

    def costs_of(entry: dict) -> CostModel:
        profile = ComputeProfile.model_validate({"kind": "compute", "device_type": "A100-80GB", "precision": "bf16",
                                                 "model": model_shape(model), "entries": [entry]})
        return CostModel(cluster, model, TrainingSetup(), Profiles([profile]))

    costs = costs_of(split)
    assert costs.stage_extra_times("A100-80GB", 1, 1, first=True, last=False) == pytest.approx((0.003, 0.003))
    assert costs.stage_extra_times("A100-80GB", 1, 1, first=False, last=True) == pytest.approx((0.006, 0.009))
    assert costs.stage_extra_times("A100-80GB", 1, 1, first=True, last=True) == pytest.approx((0.008, 0.012))
    assert costs.stage_extra_times("A100-80GB", 1, 1, first=False, last=False) == (0.0, 0.0)
    assert costs.stage_extra_times("A100-80GB", 1, 2, first=True, last=False) == pytest.approx((0.006, 0.006))
    # A profile without the share (earlier releases) keeps it all on the last stage.
    unsplit = costs_of(entry)
    assert unsplit.stage_extra_times("A100-80GB", 1, 1, first=True, last=False) == (0.0, 0.0)
    assert unsplit.stage_extra_times("A100-80GB", 1, 1, first=False, last=True) == pytest.approx((0.008, 0.012))
    # Without a profile: the embedding's memory traffic on the first stage, the output layer on the last.
    analytic = CostModel(cluster, model, TrainingSetup())
    first = analytic.stage_extra_times("A100-80GB", 1, 1, first=True, last=False)
    last = analytic.stage_extra_times("A100-80GB", 1, 1, first=False, last=True)
    assert 0 < first[0] < last[0] and 0 < first[1] < last[1]
    assert analytic.stage_extra_times("A100-80GB", 1, 1, first=True, last=True) == pytest.approx(
        (first[0] + last[0], first[1] + last[1]))
