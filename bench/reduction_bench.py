"""Gradient reductions measured on their own on an emulated cluster, against the predictor.

    sudo .venv/bin/python bench/reduction_bench.py            # about 2 minutes; needs root
    sudo .venv/bin/python bench/reduction_bench.py --rounds 15 --out runs/bench-reduction

Cluster examples/clusters/emu_packed.yaml: four nodes of two devices, every node behind one
shaped NIC. The bench profiles the links on the emulated cluster (megatron.hetero.profiling.
network, as `hetero-plan profile` does: every pair of hosts, and an all-reduce over all eight
ranks), then times reductions in isolation (bench/reduction_probe.py) and prices each with
the cost model from that profile, as the planner would. No case's group is the profiled
all-reduce's (all eight ranks), so every row is the model's ring, not a measurement fed back:

- the data-parallel reduction of replicas packed two per node (a stage whose replicas share a
  node), over two nodes and over three;
- two stages' data-parallel groups at once, one member of each per node on four nodes (each
  group gets its device's share of the NIC);
- the cross-template reduction of a plan of two replica templates (hetero/predict/
  template_reduction.py): the whole model on both devices of one node, a two-stage pipeline
  over the other two nodes; its groups, their sizes and order are the runtime's cells (the
  union of the templates' stage boundaries), all issued at once as the runtime issues them.

Every case's time is the median over --rounds rounds (its slowest rank's time per round),
with the spread ((max - min) / median). Target: each within 10% of its prediction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hetero.io import write_json_atomic  # noqa: E402
from hetero.predict.costs import CostModel  # noqa: E402
from hetero.predict.template_reduction import TemplateLayout, cell_groups, cross_template_reduction  # noqa: E402
from hetero.predict.training_setup import TrainingSetup  # noqa: E402
from hetero.spec.cluster import Cluster  # noqa: E402
from hetero.spec.profiles import LinkProfile, Profiles  # noqa: E402
from tools.emulator import EmulatedCluster, RankLayout, stop_on_termination_signals  # noqa: E402

CLUSTER = REPO / "examples" / "clusters" / "emu_packed.yaml"
# The templates' model: 4 layers of hidden 512 (3.1 M parameters each), so that one group's
# all-reduce moves tens of MB and takes a tenth of a second at the emulated NIC's rate.
MODEL_FLAGS = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "256",
               "--max-position-embeddings", "256", "--vocab-size", "2047", "--mock-data",
               "--tokenizer-type", "NullTokenizer"]
SETUP = TrainingSetup("fp32", distributed_optimizer=False, fused_kernels=False, dropout=False)
DATA_PARALLEL_ELEMENTS = 6 * 2**20  # one stage's gradients: 24 MiB of fp32
# Two templates: the whole model on node 0's two devices (two replicas), a pipeline of two
# stages (layers 2/2) over nodes 1 and 2, its two replicas' first stages on node 1.
TEMPLATES = [TemplateLayout((4,), (1,)), TemplateLayout((2, 2), (1, 1))]
RANKS_OF = {(0, 0, 0): [0, 1], (1, 0, 0): [2, 3], (1, 1, 0): [4, 5]}  # (template, stage, tp rank) -> ranks


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def cases(costs: CostModel, hosts: list[str]) -> list[dict]:
    """The cases, each with its groups (launch ranks), element counts and prediction."""
    out = []

    def data_parallel(name: str, groups: list[list[int]]) -> None:
        crossing = sum(1 for g in groups if len({hosts[r] for r in g}) > 1)
        seconds = max(costs.group_allreduce([hosts[r] for r in g], DATA_PARALLEL_ELEMENTS * 4, crossing)
                      for g in groups)
        out.append({"name": name, "groups": groups, "elements": [DATA_PARALLEL_ELEMENTS] * len(groups),
                    "predicted_s": seconds})

    data_parallel("data-parallel, 2 per node on 2 nodes (DP4)", [[0, 1, 2, 3]])
    data_parallel("data-parallel, 2 per node on 3 nodes (DP6)", [[0, 1, 2, 3, 4, 5]])
    data_parallel("two stages' groups at once, 1 per node each (2 x DP4)", [[0, 2, 4, 6], [1, 3, 5, 7]])
    groups = cell_groups(costs, TEMPLATES)
    # The runtime issues a rank's groups latest layers first (template_reduction._issue_order):
    # the group of the last stages, then the first stages', then the tied table's.
    groups.sort(key=lambda g: (-min(_end_layer(h) for h in g.holders), len(g.holders)))
    reduce = cross_template_reduction(costs, TEMPLATES, lambda holder: [hosts[r] for r in RANKS_OF[holder]])
    out.append({"name": "cross-template: whole model on node 0, PP2 over nodes 1-2",
                "groups": [sorted(r for h in g.holders for r in RANKS_OF[h]) for g in groups],
                "elements": [round(g.params) for g in groups], "predicted_s": max(reduce.values())})
    return out


def _end_layer(holder: tuple[int, int, int]) -> int:
    k, s, _ = holder
    return sum(TEMPLATES[k].layers[:s + 1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "bench-reduction"))
    parser.add_argument("--rounds", type=int, default=9)
    options = parser.parse_args()
    stop_on_termination_signals()
    missing = EmulatedCluster.missing_prerequisites()
    if missing:
        print("reduction bench skipped: " + "; ".join(missing), file=sys.stderr)
        return 2
    from megatron.hetero.startup import model_spec_of_flags

    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster.load(CLUSTER)
    layout = RankLayout.of_cluster(cluster)
    hosts = [host for host, ranks in layout.hosts for _ in ranks]
    emulated = EmulatedCluster(cluster, layout)
    log(f"profiling the links\n{emulated.describe()}")
    with emulated:
        result = emulated.run(["-m", "megatron.hetero.profiling.network", "-o", str(out)], echo=False, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"link profile failed:\n{result.output[-3000:]}")
    links = json.loads((out / "links.json").read_text())
    profiles = Profiles(links=[LinkProfile.model_validate(links)])
    costs = CostModel(cluster, model_spec_of_flags(MODEL_FLAGS), SETUP, profiles)
    planned = cases(costs, hosts)
    (out / "cases.json").write_text(json.dumps({"cases": planned}, indent=1))
    log(f"timing {len(planned)} reductions, {options.rounds} rounds")
    timing = EmulatedCluster(cluster, layout, compute_scale=emulated.compute_scale, net_scale=emulated.net_scale)
    with timing:
        result = timing.run([str(REPO / "bench" / "reduction_probe.py"), "--cases", str(out / "cases.json"),
                               "--rounds", str(options.rounds), "--out", str(out / "times.json")],
                              echo=False, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"reduction probe failed:\n{result.output[-3000:]}")
    rounds = json.loads((out / "times.json").read_text())["rounds_s"]
    rows = []
    for case in planned:
        times = rounds[case["name"]]
        median = statistics.median(times)
        rows.append({**case, "rounds_s": times, "measured_s": median,
                     "spread": (max(times) - min(times)) / median,
                     "error": case["predicted_s"] / median - 1})
    write_json_atomic(out / "results.json", {"rows": rows, "links": links, "emulated": emulated.describe(),
                                             "ring_step_s": profiles.ring_step_s()})
    print("\n| reduction | MB per rank | measured s (median) | spread | predicted s | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        mine = max(sum(n for g, n in zip(row["groups"], row["elements"]) if r in g) for r in range(len(hosts)))
        print(f"| {row['name']} | {mine * 4 / 1e6:.1f} | {row['measured_s']:.3f} | {row['spread']:.1%} "
              f"| {row['predicted_s']:.3f} | {row['error']:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
