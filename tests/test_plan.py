import json

import pytest

from conftest import make_plan
from hetero.errors import PlanError
from hetero.plan import DeviceEntry, Plan


def _plan(**overrides) -> dict:
    data = make_plan(tp=2, pp=2, dp=2, stages=[10, 6], replicas=[5, 3],
                     rank_order=[7, 6, 5, 4, 3, 2, 1, 0])
    data.update(overrides)
    return data


def test_logical_rank_layout_follows_megatron_order():
    plan = Plan.from_dict(_plan())
    # tensor rank t of replica d in stage s is logical rank t + tp*(d + dp*s)
    for s in range(2):
        for d in range(2):
            for t in range(2):
                coords = plan.grid.coords(t + 2 * (d + 2 * s))
                assert (coords.tp_rank, coords.dp_rank, coords.pp_rank) == (t, d, s)
    assert plan.launch_rank(0) == 7 and plan.logical_rank(7) == 0
    assert all(plan.logical_rank(plan.launch_rank(i)) == i for i in range(8))


def test_derived_sizes_and_layout():
    plan = Plan.from_dict(_plan())
    assert plan.world_size == 8 and plan.num_layers == 16
    assert plan.global_batch_size == 2 * 8
    assert [plan.first_micro_batch(d) for d in range(2)] == [0, 5]
    layout = plan.pipeline_layout()
    assert layout[0] == ["embedding"] + ["decoder"] * 10
    assert layout[1] == ["decoder"] * 6 + ["loss"]


def test_megatron_core_accepts_the_layout():
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    plan = Plan.from_dict(make_plan(tp=1, pp=4, dp=1, stages=[10, 6, 8, 1], replicas=[4],
                                    rank_order=[0, 1, 2, 3]))
    layout = PipelineParallelLayerLayout(plan.pipeline_layout(), pipeline_model_parallel_size=4)
    layout.validate_layer_layout(num_layers=25, mtp_num_layers=None)
    assert [layout.get_num_layers_to_build(vp_stage=None, pp_rank=r) for r in range(4)] == [10, 6, 8, 1]
    assert [layout.get_layer_offset(vp_stage=None, pp_rank=r) for r in range(4)] == [0, 10, 16, 24]


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"stages": [{"num_layers": 4}]}, "stages has 1 entries but pipeline_parallel is 2"),
        ({"replicas": [{"num_micro_batches": 0}, {"num_micro_batches": 3}]},
         "replicas[0].num_micro_batches: Input should be greater than or equal to 1"),
        ({"rank_order": [0, 1, 2, 3, 4, 5, 6, 6]}, "rank_order must be a permutation of 0..7"),
        ({"devices": [{"host": "a", "device_type": "cpu", "vendor": "cpu"}] * 7},
         "devices has 7 entries"),
        ({"tensor_parallel": "two"}, "tensor_parallel: Input should be a valid integer"),
        ({"version": 5}, "plan version 5 is not supported"),
        ({"version": 4}, "version 4 lists the layout under templates"),
    ],
)
def test_malformed_plans_name_the_field(change, fragment):
    with pytest.raises(PlanError) as err:
        Plan.from_dict(_plan(**change), source="p.json")
    assert fragment in str(err.value)


def test_missing_field_and_bad_json(tmp_path):
    data = _plan()
    del data["rank_order"]
    with pytest.raises(PlanError, match=r"rank_order: required field is missing"):
        Plan.from_dict(data)
    path = tmp_path / "broken.json"
    path.write_text('{"version": 1,')
    with pytest.raises(PlanError, match=r"is not valid JSON \(line 1"):
        Plan.load(path)


def test_hosts_must_be_contiguous_for_torchrun():
    devices = [{"host": h, "device_type": "cpu", "vendor": "cpu"} for h in "aabbaabb"]
    with pytest.raises(PlanError, match="not contiguous"):
        Plan.from_dict(_plan(devices=devices))
    devices = [{"host": h, "device_type": "cpu", "vendor": "cpu"} for h in "aaaabbbc"]
    plan = Plan.from_dict(_plan(devices=devices))
    assert plan.hosts() == [("a", [0, 1, 2, 3]), ("b", [4, 5, 6]), ("c", [7])]


def test_unknown_keys_survive_a_round_trip(tmp_path):
    """Unknown top-level keys, entry keys and informational record keys are kept as they are."""
    data = _plan(notes={"by": "a person"},
                 prediction={"iteration_time_s": 1.5, "tokens_per_s": 2000.0, "from_a_newer_release": [1]},
                 provenance={"tool": "hetero-plan 0.1", "created": "2026-01-31T12:00:00+00:00"})
    data["stages"][0]["device_type"] = "H100-80GB"
    path = tmp_path / "plan.json"
    Plan.from_dict(data).save(path)
    again = json.loads(path.read_text())
    assert again["notes"] == {"by": "a person"}
    assert again["prediction"] == data["prediction"] and again["provenance"] == data["provenance"]
    assert again["stages"][0]["device_type"] == "H100-80GB"
    assert Plan.load(path) == Plan.from_dict(data)
    assert list(again)[-1] == "notes"  # after the layout and the record
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary left behind


def test_the_record_is_typed():
    plan = Plan.from_dict(_plan(prediction={"iteration_time_s": 1.5, "tokens_per_s": 2000}))
    assert plan.prediction.tokens_per_s == 2000 and plan.model is None and plan.training is None
    assert plan.model_extra == {}  # the sections are fields, not extra keys
    with pytest.raises(PlanError, match=r"provenance: Input should be a valid dictionary"):
        Plan.from_dict(_plan(provenance="hetero-plan 0.1"))
    with pytest.raises(PlanError, match=r"training.precison: Extra inputs are not permitted"):
        Plan.from_dict(_plan(training={"global_batch_size": 16, "seq_length": 64, "precision": "bf16",
                                       "precison": "fp16"}))


def test_uniform_plan_is_megatrons_default():
    device = DeviceEntry(host="n", device_type="cpu", vendor="cpu")
    plan = Plan.uniform(tensor_parallel=2, pipeline_parallel=2, data_parallel=2, micro_batch_size=1,
                        num_layers=8, global_batch_size=16, devices=[device] * 8)
    assert [s.num_layers for s in plan.stages] == [4, 4]
    assert [r.num_micro_batches for r in plan.replicas] == [8, 8]
    assert plan.rank_order == list(range(8))
    with pytest.raises(PlanError, match="not divisible by pipeline_parallel"):
        Plan.uniform(tensor_parallel=1, pipeline_parallel=3, data_parallel=1, micro_batch_size=1,
                     num_layers=8, global_batch_size=4, devices=[device] * 3)


def test_a_model_with_a_sliding_window_is_recorded_and_read_back():
    """gpt-oss's window (a pair) survives the record, in Python and through JSON."""
    import json

    from hetero.record import ModelRecord
    from hetero.spec.presets import load_model

    spec = load_model("gpt-oss-120b")
    record = ModelRecord.of(spec)
    again = ModelRecord.model_validate(json.loads(json.dumps(record.model_dump(mode="json"))))
    assert again.spec().window_size == spec.window_size == (128, 0)
