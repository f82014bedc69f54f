"""Waiting for the slowest replica: the expected maximum of varying ends against sampled
maxima, and the predictor's iteration growing with a device's measured variation."""

import numpy
import pytest

from hetero.spec.cluster import Cluster
from hetero.predict.costs import CostModel
from hetero.predict.training_setup import TrainingSetup
from hetero.spec.model import ModelSpec
from hetero.plan import Plan
from hetero.predict.predictor import predict
from hetero.spec.profiles import ComputeProfile, Profiles, model_shape
from hetero.predict.stragglers import expected_slowest, replica_spread

SAMPLES = 400_000


def _sampled_slowest(ends: list[tuple[float, float, int]], seed: int = 0) -> tuple[float, float]:
    """(mean of the sampled maxima, its standard error)."""
    rng = numpy.random.default_rng(seed)
    columns = numpy.concatenate([rng.normal(mean, sigma, (SAMPLES, n)) for mean, sigma, n in ends], axis=1)
    maxima = columns.max(axis=1)
    return float(maxima.mean()), float(maxima.std() / numpy.sqrt(SAMPLES))


@pytest.mark.parametrize("ends", [
    [(1.0, 0.1, 2)], [(1.0, 0.1, 4)], [(1.0, 0.1, 3), (0.9, 0.2, 1)],
    [(7.3, 0.27, 3), (6.8, 0.5, 1)], [(2.0, 0.05, 1), (1.0, 0.5, 2)], [(5.0, 0.3, 1), (5.0, 0.3, 1), (4.0, 0.1, 6)],
])
def test_expected_slowest_matches_sampled_maxima(ends):
    sampled, error = _sampled_slowest(ends)
    excess = sampled - max(mean for mean, _, _ in ends)  # what waiting adds
    # Clark's moment matching is exact for two normals and close for a few: within 3% of
    # the excess or 0.1% of the time (plus the sampling error).
    assert expected_slowest(ends) == pytest.approx(sampled, abs=max(0.03 * excess, 1e-3 * sampled) + 4 * error)


@pytest.mark.parametrize("count", [16, 256])
def test_expected_slowest_of_many_alike_replicas(count):
    sampled, error = _sampled_slowest([(1.0, 0.1, count)])
    assert expected_slowest([(1.0, 0.1, count)]) == pytest.approx(sampled, abs=0.01 * (sampled - 1.0) + 4 * error)


def test_without_variation_the_slowest_is_the_latest_mean():
    assert expected_slowest([(3.0, 0.0, 4), (3.5, 0.0, 1), (1.0, 0.0, 7)]) == 3.5
    assert expected_slowest([(2.0, 0.3, 1)]) == 2.0  # one rank waits for nobody
    with pytest.raises(ValueError):
        expected_slowest([])


def test_a_replica_varies_with_the_square_root_of_its_micro_batches():
    assert replica_spread(0.2, 9) == pytest.approx(0.6)


def _cluster() -> Cluster:
    return Cluster.from_dict({
        "name": "four alike", "devices": {"dev": {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 300,
                                                  "memory_bandwidth_gbs": 2000}},
        "groups": [{"name": "g", "nodes": [{"host": "n0", "device": "dev", "count": 4, "intra_link": "nvlink3",
                                             "nic": {"kind": "ib", "gbps": 400}}]}]})


def _profiles(model: ModelSpec, cv: float | None) -> Profiles:
    entries = [{"tensor_parallel": 1, "micro_batch_size": mbs, "layer_forward_s": 0.01 * mbs,
                "layer_backward_s": 0.02 * mbs, "logits_forward_s": 0.005 * mbs, "logits_backward_s": 0.01 * mbs,
                "micro_batch_cv": cv} for mbs in (1, 2)]
    return Profiles([ComputeProfile.model_validate({"kind": "compute", "device_type": "dev", "precision": "bf16",
                                                    "model": model_shape(model), "entries": entries})])


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_data_parallel_replicas_wait_for_the_slowest(micro_batches):
    """Four replicas alike: the iteration grows by about 1.03 standard deviations of a
    replica's compute (the expected maximum of four standard normals is 1.029)."""
    model = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=32000)
    cluster = _cluster()
    plan = Plan.uniform(tensor_parallel=1, pipeline_parallel=1, data_parallel=4, micro_batch_size=1,
                        num_layers=4, global_batch_size=4 * micro_batches,
                        devices=[{"host": "n0", "device_type": "dev", "vendor": "nvidia"}] * 4)
    steady, varying = (predict(plan, cluster, CostModel(cluster, model, TrainingSetup(), _profiles(model, cv)))
                       for cv in (None, 0.1))
    micro_batch_s = 4 * 0.03 + 0.015
    sigma = replica_spread(0.1 * micro_batch_s, micro_batches)
    assert varying.iteration_time_s - steady.iteration_time_s == pytest.approx(1.029 * sigma, rel=0.03)


def test_a_single_replica_does_not_wait():
    model = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=32000)
    cluster = _cluster()
    plan = Plan.uniform(tensor_parallel=1, pipeline_parallel=1, data_parallel=1, micro_batch_size=1,
                        num_layers=4, global_batch_size=8,
                        devices=[{"host": "n0", "device_type": "dev", "vendor": "nvidia"}])
    times = [predict(plan, cluster, CostModel(cluster, model, TrainingSetup(), _profiles(model, cv))).iteration_time_s
             for cv in (None, 0.2)]
    assert times[0] == times[1]


def test_profiles_median_keeps_the_variation():
    from hetero.spec.profiles import median_entry

    entries = [{"tensor_parallel": 1, "micro_batch_size": 1, "layer_forward_s": 1.0, "micro_batch_cv": cv}
               for cv in (0.05, 0.2, 0.1)]
    assert median_entry(entries)["micro_batch_cv"] == 0.1
