"""The cost model against Megatron-LM's published weak-scaling table (SC21).

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC21 (arXiv 2104.04473), table 1; the published figures are in
NVIDIA/Megatron-LM README.md and images/cases_april2021.png at commit 50a4b5fa0280
(2021-04-08); each row's configuration is examples/academic_paper_scripts/sc21/
run_table_1.sh + CONFIG.sh of that repository. Hardware: Selene, DGX A100 80GB nodes (8
GPUs, NVLink3, 8 x 200 Gb/s HDR InfiniBand each). Every row: fp16, sequence 2048,
vocabulary 51,200, full activation recomputation, learned absolute positions, GeLU 4h MLP,
no distributed optimizer; torch DDP (overlapped gradient all-reduce) on the first four
rows, Megatron's local DDP (reduction after the backward) on the others; interleaved
schedule where a row gives layers per virtual stage.

Both sides use the paper's FLOP convention (eq. 3): FLOPs per iteration =
96 B s l h^2 (1 + s/(6h) + V/(16 l h)); the published TFLOP/s per GPU becomes an iteration
time as FLOPs / (TFLOP/s x GPUs), which is compared with the predicted iteration time of
exactly that configuration.

    python bench/published.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetero.spec.cluster import Cluster  # noqa: E402
from hetero.predict.costs import CostModel, TrainingSetup  # noqa: E402
from hetero.spec.model import ModelSpec  # noqa: E402
from hetero.plan import Plan  # noqa: E402
from hetero.predict.predictor import Prediction, predict  # noqa: E402

SEQUENCE, VOCABULARY, GPUS_PER_NODE = 2048, 51200, 8


@dataclass(frozen=True)
class Row:
    name: str
    heads: int
    hidden: int
    layers: int
    tensor_parallel: int
    pipeline_parallel: int
    gpus: int
    global_batch: int
    micro_batch: int
    layers_per_virtual_stage: int | None
    ddp: str
    tflops_per_gpu: float

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def virtual_stages(self) -> int:
        if self.layers_per_virtual_stage is None:
            return 1
        return self.layers // self.pipeline_parallel // self.layers_per_virtual_stage

    def paper_flops(self) -> float:
        b, s, l, h, v = self.global_batch, SEQUENCE, self.layers, self.hidden, VOCABULARY
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    def published_iteration_s(self) -> float:
        return self.paper_flops() / (self.tflops_per_gpu * 1e12 * self.gpus)


TABLE = [
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, None, "torch", 137),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, None, "torch", 138),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, None, "torch", 142),
    Row("18B", 48, 6144, 40, 8, 1, 256, 1024, 8, None, "torch", 135),
    Row("39B", 64, 8192, 48, 8, 2, 512, 1536, 4, None, "local", 138),
    Row("76B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, "local", 140),
    Row("145B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, "local", 148),
    Row("310B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, "local", 155),
    Row("530B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, "local", 163),
    Row("1T", 160, 25600, 128, 8, 64, 3072, 3072, 1, None, "local", 163),
]


def selene(num_gpus: int) -> Cluster:
    """DGX A100 80GB nodes on one HDR InfiniBand fabric."""
    nodes = [{"host": f"dgx{i:03d}", "device": "A100-80GB", "count": GPUS_PER_NODE, "intra_link": "nvlink3",
              "nic": {"kind": "ib", "gbps": 1600}} for i in range(num_gpus // GPUS_PER_NODE)]
    return Cluster.from_dict({"name": f"Selene {num_gpus} GPUs", "groups": [{"name": "selene", "nodes": nodes}]})


def model_of(row: Row) -> ModelSpec:
    return ModelSpec(num_layers=row.layers, hidden_size=row.hidden, num_attention_heads=row.heads,
                     seq_length=SEQUENCE, vocab_size=VOCABULARY)


def setup_of(row: Row) -> TrainingSetup:
    return TrainingSetup(
        precision="fp16", distributed_optimizer=False, fused_kernels=False, dropout=True,
        recompute="full", virtual_stages=row.virtual_stages, overlap_grad_reduce=row.ddp == "torch",
        scatter_stage_transfers=True,  # 2021 default: --scatter-gather-tensors-in-pipeline
    )


def plan_of(row: Row, cluster: Cluster) -> Plan:
    """Megatron's own layout of the row: even stages, equal replicas, launch order."""
    devices = [{"host": n.host, "device_type": n.device.name, "vendor": n.device.vendor, "nic": "ib"}
               for n in cluster.nodes for _ in range(n.count)]
    plan = Plan.uniform(tensor_parallel=row.tensor_parallel, pipeline_parallel=row.pipeline_parallel,
                        data_parallel=row.data_parallel, micro_batch_size=row.micro_batch,
                        num_layers=row.layers, global_batch_size=row.global_batch)
    return Plan.from_dict({**plan.to_dict(), "devices": devices})


def predict_row(row: Row) -> Prediction:
    cluster = selene(row.gpus)
    return predict(plan_of(row, cluster), cluster, CostModel(cluster, model_of(row), setup_of(row)))


def compare() -> list[dict]:
    results = []
    for row in TABLE:
        prediction = predict_row(row)
        published = row.published_iteration_s()
        results.append({
            "row": row.name, "published_s": published, "predicted_s": prediction.iteration_time_s,
            "error": prediction.iteration_time_s / published - 1,
            "memory_gib": max(prediction.peak_memory_gib.values()), "fits": prediction.fits,
        })
    return results


def main() -> int:
    results = compare()
    print("| row | published s/iter | predicted s/iter | error | predicted peak memory |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['row']} | {r['published_s']:.2f} | {r['predicted_s']:.2f} | {r['error']:+.1%} | "
              f"{r['memory_gib']:.1f} GiB{'' if r['fits'] else ' (does not fit)'} |")
    mean = sum(abs(r["error"]) for r in results) / len(results)
    print(f"mean absolute error {mean:.1%}, largest {max(abs(r['error']) for r in results):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
