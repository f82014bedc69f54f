"""Objectives other than speed: the fewest $ or J per token, under a floor or a budget.

The hand-checked case: 8 H100 at $10/h and 8 A100-80GB at $1/h training GPT-1.7B. Per
token, the A100s alone cost 8 x $1 over their throughput; with the H100s the rent rises 11x
while the throughput rises less than 4x, so the cheapest plan leaves the H100s out, while the
fastest uses both. Under a floor above what the A100s reach alone, both again (cheaper per
token than the H100s alone: $88/h over ~3.5x the tokens beats $80/h over ~2.6x).
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from conftest import REPO
from hetero.errors import HeteroError
from hetero.job import Objective
from hetero.jobs import plan_for_objective
from hetero.predict.economics import economics
from hetero.search.planner import PlannerOptions
from hetero.spec.cluster import Cluster
from hetero.spec.presets import load_model

TWO_PRICES = {
    "name": "two-prices",
    "prices_per_hour": {"H100-80GB": 10.0, "A100-80GB": 1.0},
    "groups": [{"name": "g", "nodes": [
        {"host": "h0", "device": "H100-80GB", "count": 8, "intra_link": "nvlink4", "nic": {"kind": "ib", "gbps": 400}},
        {"host": "a0", "device": "A100-80GB", "count": 8, "intra_link": "nvlink3", "nic": {"kind": "ib", "gbps": 400}},
    ]}],
}
MODEL = load_model("gpt-1.7b").with_seq_length(2048)
BATCH = 512


def _plan(objective: Objective):
    cluster = Cluster.from_dict(TWO_PRICES)
    job, tried = plan_for_objective(cluster, MODEL, BATCH, PlannerOptions(), objective,
                                    with_baseline=False, with_upper_bound=False)
    return job, dict((tuple(kept), e) for kept, e in tried)


def _used(job) -> set[str]:
    return {d.device_type for d in job.plan.devices}


def test_cost_leaves_the_expensive_devices_out_where_speed_uses_them():
    fastest, _ = _plan(Objective("throughput"))
    cheapest, tried = _plan(Objective("cost"))
    assert _used(fastest) == {"H100-80GB", "A100-80GB"}
    assert _used(cheapest) == {"A100-80GB"}
    # $ per 1M tokens, by hand: the rent of the devices used over the predicted throughput.
    e = cheapest.economics
    assert e.dollars_per_hour == 8 * 1.0
    assert e.dollars_per_million_tokens == pytest.approx(8.0 / 3600 / cheapest.prediction.tokens_per_s * 1e6)
    both = fastest.economics
    assert both.dollars_per_hour == 8 * 10.0 + 8 * 1.0
    assert e.dollars_per_million_tokens < both.dollars_per_million_tokens
    # Every device set was priced, and the choice is the cheapest of them.
    assert set(tried) == {("H100-80GB",), ("A100-80GB",), ("H100-80GB", "A100-80GB")}
    assert min(tried.values(), key=lambda x: x.dollars_per_million_tokens).dollars_per_hour == 8.0


def test_a_throughput_floor_and_a_budget_bind():
    _, tried = _plan(Objective("cost"))
    alone = tried[("A100-80GB",)].tokens_per_s
    floored, _ = _plan(Objective("cost", min_tokens_per_s=alone * 1.2))
    assert _used(floored) == {"H100-80GB", "A100-80GB"}  # cheaper per token than the H100s alone
    assert floored.economics.tokens_per_s >= alone * 1.2
    budget, _ = _plan(Objective("throughput", max_dollars_per_hour=50))
    assert _used(budget) == {"A100-80GB"}  # the only set under $50/h
    with pytest.raises(HeteroError, match="no plan meets the objective"):
        _plan(Objective("cost", min_tokens_per_s=1e12))


def test_energy_prefers_the_devices_with_the_most_tokens_per_joule():
    frugal, tried = _plan(Objective("energy"))
    best = min(tried.values(), key=lambda x: x.joules_per_token)
    assert frugal.economics.joules_per_token == pytest.approx(best.joules_per_token, rel=0.02)
    watts = sum({"H100-80GB": 700, "A100-80GB": 400}[t] for t in (d.device_type for d in frugal.plan.devices))
    assert frugal.economics.joules_per_token == pytest.approx(watts / frugal.prediction.tokens_per_s)


def test_cost_without_prices_names_the_devices_and_the_section():
    spec = {**copy.deepcopy(TWO_PRICES), "prices_per_hour": {}}
    spec["groups"][0]["nodes"][0] = {**spec["groups"][0]["nodes"][0], "device": "V100-32GB", "intra_link": "nvlink2"}
    with pytest.raises(HeteroError, match=r"no price per hour for .*V100-32GB.*prices_per_hour"):
        plan_for_objective(Cluster.from_dict(spec), MODEL, BATCH, PlannerOptions(), Objective("cost"))


def test_economics_is_unknown_when_a_used_device_has_no_price():
    cluster = Cluster.from_dict({**TWO_PRICES, "prices_per_hour": {"A100-80GB": 1.0}})
    e = economics(["V100-16GB", "A100-80GB"], 1000.0, cluster.devices)
    assert e.dollars_per_million_tokens is None and e.joules_per_token == pytest.approx(700 / 1000)


def test_the_summary_prints_dollars_and_joules_per_token(tmp_path):
    import yaml

    spec = tmp_path / "cluster.yaml"
    spec.write_text(yaml.safe_dump(TWO_PRICES))
    out = subprocess.run([sys.executable, "-m", "hetero", "--cluster", str(spec), "--model", "gpt-1.7b",
                          "--global-batch-size", str(BATCH), "--seq-length", "2048", "--objective", "cost",
                          "--quiet", "-o", str(tmp_path / "plan.json")], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "per token  $" in out.stdout and "J/token" in out.stdout
    assert "objective  the fewest $ per token" in out.stdout
    assert "baseline per token: $" in out.stdout
