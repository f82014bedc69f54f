"""The cost model against Megatron-LM's published weak-scaling table (SC21), and against
training measured on one H100 (megatron-core's local layers).

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

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetero.spec.cluster import Cluster  # noqa: E402
from hetero.predict.costs import CostModel  # noqa: E402
from hetero.predict.training_setup import TrainingSetup  # noqa: E402
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
        fused_softmax=True,  # 2021 default: --masked-softmax-fusion, Megatron-LM's compiled kernel
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


# ----- one H100, megatron-core's local layers ---------------------------------------------
# Measured with bench/gpu_bench.py (docs/results.md, "One real GPU"): GPT 0.9B (16 layers,
# hidden 2048, 16 heads, sequence 2048, vocabulary 50,257 padded to 50,304), global batch 16,
# bf16, no dropout, one H100 SXM 80GB, megatron-core 0.16.1 without transformer-engine or
# apex (local layers: unfused attention, torch softmax). Median of iterations 5-14 of two runs.


@dataclass(frozen=True)
class GpuRow:
    micro_batch: int
    recompute: str
    measured_s: tuple[float, float]
    """The two runs' median iteration times."""


ONE_H100 = [GpuRow(1, "none", (1.02, 1.35)), GpuRow(2, "none", (0.85, 0.89)),
            GpuRow(4, "none", (0.82, 0.85)), GpuRow(4, "full", (1.05, 1.08))]


def predict_gpu_row(row: GpuRow) -> Prediction:
    node = {"host": "gpu0", "device": "H100-80GB", "count": 1, "intra_link": "nvlink4", "nic": {"kind": "ib", "gbps": 400}}
    cluster = Cluster.from_dict({"name": "one H100", "groups": [{"name": "local", "nodes": [node]}]})
    model = ModelSpec(num_layers=16, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50304)
    setup = TrainingSetup("bf16", distributed_optimizer=False, fused_kernels=False, dropout=False,
                          recompute=row.recompute)
    devices = [{"host": "gpu0", "device_type": "H100-80GB", "vendor": "nvidia", "nic": "ib"}]
    plan = Plan.uniform(tensor_parallel=1, pipeline_parallel=1, data_parallel=1, micro_batch_size=row.micro_batch,
                        num_layers=model.num_layers, global_batch_size=16)
    plan = Plan.from_dict({**plan.to_dict(), "devices": devices})
    return predict(plan, cluster, CostModel(cluster, model, setup))


# ----- mixtures of experts on DGX H100 (Megatron-Core through NeMo's Megatron-Bridge) -------
# Source: NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary.md and
# docs/performance-summary-archive.md (https://docs.nvidia.com/nemo/megatron-bridge/latest/
# performance-summary.html), "Pre-Training Performance", System: DGX-H100 (8 H100 SXM 80GB,
# NVLink 4, 8 x 400 Gb/s InfiniBand per node), sequence 4096, distributed optimizer. The
# recipes behind each row: scripts/performance/configs (v0.2.1, v0.3.x) and
# src/megatron/bridge/perf_recipes (later) of the same repository. Tokens/s/GPU is the
# published figure; the iteration time is global batch x sequence / (tokens/s/GPU x GPUs).
# Every published row but gpt-oss's (BF16) is FP8. FP8 is priced as transformer-engine runs it (hetero/predict/costs.py:
# linear layers' GEMMs at the fp8 rate measured on an H200, their inputs' casts; bf16
# activations, attention and communication), with the recipes' current (tensorwise) scaling:
# every H100 recipe is "FP8_CS".


@dataclass(frozen=True)
class MoeRow:
    name: str
    model: str
    """Preset (hetero/spec/presets.py)."""
    source: str
    precision: str
    gpus: int
    global_batch: int
    micro_batch: int
    tensor_parallel: int
    pipeline_parallel: int
    virtual_stages: int
    expert_parallel: int
    tokens_per_s_per_gpu: float
    layout: str | None = None
    """--pipeline-model-parallel-layout where the layers do not split evenly."""
    a2a_overlap: bool = False
    """The recipe's moe_a2a_overlap (Megatron's --overlap-moe-expert-parallel-comm)."""
    dispatcher: str = "alltoall"
    """flex where the recipe selects DeepEP or HybridEP, else megatron-core's all-to-all."""
    recompute: str = "none"
    """The recipe's recomputation (hetero/spec/recompute.py names)."""
    overlap_grad_reduce: bool = True
    """Megatron-Bridge turns it on wherever data parallelism is; a recipe may turn it off."""
    not_compared: str | None = None
    """Why a published row is shown but left out of the comparison."""

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tensor_parallel * self.pipeline_parallel)

    def published_iteration_s(self, seq_length: int) -> float:
        return self.global_batch * seq_length / (self.tokens_per_s_per_gpu * self.gpus)


# The two dropless Qwen3-30B-A3B rows below ran megatron-core's plain all-to-all dispatcher:
# the 25.11 recipe (v0.2.1) gives H100 no flex dispatcher, and the 26.02 one (v0.3.0) names
# DeepEP as the flex backend but never selects the flex dispatcher (Megatron-Bridge commit
# 6a41745d, "fix: Set flex and alltoall for perf jobs", v0.3.1). The same layout ran 77%
# faster in 26.02.01 with the fix, and 2x faster in 25.09 with token dropping. What makes the
# dropless all-to-all path this slow on this small-hidden model (the per-layer wait for the
# token counts on the host, at least) is not priced by the cost model.
_SLOW_DISPATCHER = ("dropless all-to-all dispatcher without DeepEP (fixed in Megatron-Bridge 6a41745d; "
                    "26.02.01 ran the same layout 77% faster): not priced")
# 94 layers + embedding + loss = 96 units over 8 x 4 chunks of 3 (Megatron's --account-for-
# embedding-in-pipeline-split / --account-for-loss-in-pipeline-split; the recipe's own split is
# not stated in the summary).
_QWEN3_235B_LAYOUT = "Ett|(ttt|)*30ttL"

MOE_TABLE = [
    # 25.09 container, DGX-H100 row "DeepSeekV3 (dropless)": FP8 (per-tensor), 338 model
    # TFLOP/s/GPU. Recipe (v0.2.1 configs): DeepEP flex dispatcher, all-to-all overlapped with
    # another micro-batch's compute (moe_a2a_overlap), selective recomputation of MLA's up-
    # projections and the dense layers' MLP, the gradient reduction not overlapped ("to avoid
    # functional errors"). 61 layers and the multi-token-prediction layer over
    # 8 x 4 chunks, "Et|(tt|)*30mL": rank 0 holds 7 layers, ranks 1-6 8, rank 7 6 and the MTP
    # layer, which its last chunk holds alone with the loss. A plan gives every chunk a decoder
    # layer, so rank 7's sixth layer moves from its third chunk to its last: the same layers per
    # rank, which is what the prediction reads (a rank's chunks each run 1/v of its stage).
    MoeRow("DeepSeek-V3 671B", "deepseek-v3", "Megatron-Bridge archive, 25.09, DGX-H100", "fp8",
           1024, 8192, 1, 2, 8, 4, 64, 1297, layout="Et|(tt|)*22t|(tt|)*7tmL", a2a_overlap=True,
           dispatcher="flex", recompute="selective:mla_up_proj,mlp", overlap_grad_reduce=False),
    # 25.09, "Qwen3_30B_a3B (tokendrop)": 241 TFLOP/s/GPU.
    MoeRow("Qwen3-30B-A3B (token-drop)", "qwen3-30b-a3b", "Megatron-Bridge archive, 25.09, DGX-H100", "fp8",
           16, 512, 2, 1, 2, 24, 8, 10494),
    # 26.02.01, Qwen3_30B_a3B: 208 TFLOP/s/GPU (flex dispatcher, DeepEP).
    MoeRow("Qwen3-30B-A3B", "qwen3-30b-a3b", "Megatron-Bridge archive, 26.02.01, DGX-H100", "fp8",
           16, 1024, 1, 1, 2, 12, 8, 9058, a2a_overlap=True, dispatcher="flex"),
    # 26.04, Qwen3_30B_a3B: 205 TFLOP/s/GPU; EP 16 over both nodes (HybridEP), no pipeline.
    MoeRow("Qwen3-30B-A3B", "qwen3-30b-a3b", "Megatron-Bridge archive, 26.04, DGX-H100", "fp8",
           16, 1024, 1, 1, 1, 1, 16, 8901, dispatcher="flex"),
    # 25.11, Qwen3_235B_a22B: FP8-CS, 233 TFLOP/s/GPU.
    MoeRow("Qwen3-235B-A22B", "qwen3-235b-a22b", "Megatron-Bridge archive, 25.11, DGX-H100", "fp8",
           256, 2048, 1, 2, 8, 4, 32, 1575, layout=_QWEN3_235B_LAYOUT, a2a_overlap=True),
    # 26.02, Qwen3_235B_a22B: 242 TFLOP/s/GPU.
    MoeRow("Qwen3-235B-A22B", "qwen3-235b-a22b", "Megatron-Bridge archive, 26.02, DGX-H100", "fp8",
           256, 8192, 1, 2, 8, 4, 32, 1633, layout=_QWEN3_235B_LAYOUT, a2a_overlap=True),
    # 26.02, GPT OSS 120B: BF16, 163 TFLOP/s/GPU (the same layout: 26.02.01 5,984, 26.04 5,810,
    # 26.04.01 5,824 tokens/s/GPU). Recipe (v0.3.0 configs): the all-to-all dispatcher without
    # overlap, recomputation of the norms and the experts' activation (recompute_modules
    # layernorm, moe_act); 36 layers over 4 stages.
    MoeRow("gpt-oss-120b", "gpt-oss-120b", "Megatron-Bridge archive, 26.02, DGX-H100", "bf16",
           64, 1280, 1, 1, 4, 1, 8, 5993, recompute="selective:layernorm,moe_act"),
    # 25.11, Qwen3_30B_a3B (dropless): FP8-CS, 121 TFLOP/s/GPU; 26.02: 118.
    MoeRow("Qwen3-30B-A3B (dropless, all-to-all)", "qwen3-30b-a3b", "Megatron-Bridge archive, 25.11, DGX-H100",
           "fp8", 16, 512, 2, 1, 2, 24, 8, 5275, a2a_overlap=True, not_compared=_SLOW_DISPATCHER),
    MoeRow("Qwen3-30B-A3B (dropless, all-to-all)", "qwen3-30b-a3b", "Megatron-Bridge archive, 26.02, DGX-H100",
           "fp8", 16, 1024, 1, 1, 2, 12, 8, 5113, a2a_overlap=True, not_compared=_SLOW_DISPATCHER),
]


def dgx_h100(num_gpus: int) -> Cluster:
    nodes = [{"host": f"dgx{i:04d}", "device": "H100-80GB", "count": GPUS_PER_NODE, "intra_link": "nvlink4",
              "nic": {"kind": "ib", "gbps": 3200}} for i in range(num_gpus // GPUS_PER_NODE)]
    return Cluster.from_dict({"name": f"DGX H100 {num_gpus} GPUs", "groups": [{"name": "eos", "nodes": nodes}]})


def predict_moe_row(row: MoeRow, a2a_overlap: bool | None = None) -> Prediction:
    """The row's run as predicted, with its recipe's all-to-all overlap (or the one given)."""
    from hetero.pipeline_layout import SplitFlags
    from hetero.spec.presets import PRESETS
    model = PRESETS[row.model].with_seq_length(4096)
    cluster = dgx_h100(row.gpus)
    devices = [{"host": n.host, "device_type": n.device.name, "vendor": n.device.vendor, "nic": "ib"}
               for n in cluster.nodes for _ in range(n.count)]
    flags = SplitFlags(layout=row.layout) if row.layout else SplitFlags(
        virtual_stages_per_rank=row.virtual_stages if row.virtual_stages > 1 else None)
    plan = Plan.uniform(tensor_parallel=row.tensor_parallel, pipeline_parallel=row.pipeline_parallel,
                        data_parallel=row.data_parallel, micro_batch_size=row.micro_batch,
                        num_layers=model.num_layers, global_batch_size=row.global_batch, split_flags=flags,
                        expert_parallel=row.expert_parallel,
                        expert_tensor_parallel=1 if row.expert_parallel > 1 else None)
    plan = Plan.from_dict({**plan.to_dict(), "devices": devices})
    setup = TrainingSetup(row.precision, distributed_optimizer=True, fused_kernels=True, dropout=False,
                          recompute=row.recompute, grad_reduce_dtype="bf16",  # every recipe: grad_reduce_in_fp32 off
                          sequence_parallel=row.tensor_parallel > 1, virtual_stages=row.virtual_stages,
                          overlap_grad_reduce=row.overlap_grad_reduce, overlap_param_gather=True, moe_a2a_overlap=row.a2a_overlap if a2a_overlap is None else a2a_overlap,
                          moe_dispatcher=row.dispatcher, fp8_recipe="tensorwise")
    return predict(plan, cluster, CostModel(cluster, model, setup))


def compare_moe() -> list[dict]:
    """Each row predicted as its recipe runs; where the recipe overlaps the all-to-alls also
    without the overlap (every all-to-all exposed, an upper bound)."""
    results = []
    for row in MOE_TABLE:
        prediction = predict_moe_row(row)
        published = row.published_iteration_s(4096)
        exposed = predict_moe_row(row, a2a_overlap=False).iteration_time_s if row.a2a_overlap else None
        results.append({"row": row, "published_s": published, "predicted_s": prediction.iteration_time_s,
                        "error": prediction.iteration_time_s / published - 1,
                        "exposed_s": exposed, "exposed_error": exposed / published - 1 if exposed else None,
                        "tflops": max(prediction.tflops_per_device.values()),
                        "memory_gib": max(prediction.peak_memory_gib.values()), "fits": prediction.fits})
    return results


@contextlib.contextmanager
def moe_forward_added(extra_s: float):
    """What if every MoE layer's forward took extra_s more per micro-batch (the host-side
    time the cost model does not price: the wait for the token counts and the launches after
    it)? A question asked of the model, not a term of it: it adds to the MoE layer's kernel
    gaps while the block runs."""
    from hetero.predict import layer_costs

    original = layer_costs.moe_kernel_gaps_s

    def with_extra(local_experts: float) -> tuple[float, float]:
        forward, backward = original(local_experts)
        return forward + extra_s, backward

    layer_costs.moe_kernel_gaps_s = with_extra
    try:
        yield
    finally:
        layer_costs.moe_kernel_gaps_s = original


def what_if(added_ms: list[float]) -> None:
    """The MoE table's errors with each added forward time (--moe-forward-ms)."""
    rows = [row for row in MOE_TABLE if not row.not_compared]
    print("| added per MoE layer forward | " + " | ".join(f"{r.name} {r.source.split(', ')[1]}" for r in rows) + " |")
    print("|---:|" + "---:|" * len(rows))
    for ms in added_ms:
        with moe_forward_added(ms / 1000):
            errors = [predict_moe_row(r).iteration_time_s / r.published_iteration_s(4096) - 1 for r in rows]
        print(f"| {ms:g} ms | " + " | ".join(f"{e:+.1%}" for e in errors) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moe-forward-ms", type=float, nargs="+", metavar="MS",
                        help="only the MoE table's errors, with this much added to every MoE layer's "
                             "forward per micro-batch (a what-if for the unpriced host-side time)")
    args = parser.parse_args()
    if args.moe_forward_ms:
        what_if(args.moe_forward_ms)
        return 0
    results = compare()
    print("| row | published s/iter | predicted s/iter | error | predicted peak memory |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['row']} | {r['published_s']:.2f} | {r['predicted_s']:.2f} | {r['error']:+.1%} | "
              f"{r['memory_gib']:.1f} GiB{'' if r['fits'] else ' (does not fit)'} |")
    mean = sum(abs(r["error"]) for r in results) / len(results)
    print(f"mean absolute error {mean:.1%}, largest {max(abs(r['error']) for r in results):.1%}")
    print("\n| one H100: micro-batch | recompute | measured s/iter (two runs) | predicted | error |")
    print("|---:|---|---:|---:|---:|")
    for row in ONE_H100:
        predicted = predict_gpu_row(row).iteration_time_s
        errors = " / ".join(f"{predicted / m - 1:+.1%}" for m in row.measured_s)
        print(f"| {row.micro_batch} | {row.recompute} | {row.measured_s[0]:.2f} / {row.measured_s[1]:.2f} | "
              f"{predicted:.3f} | {errors} |")
    print("\n| MoE on DGX H100 | source | GPUs | TP/PP/VP/EP | micro/global batch | published s/iter "
          "| predicted | error | all-to-alls not overlapped | predicted TFLOP/s/GPU | peak memory |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for r in compare_moe():
        row = r["row"]
        exposed = f"{r['exposed_s']:.2f} ({r['exposed_error']:+.1%})" if r["exposed_s"] else "(not overlapped)"
        predicted = f"{r['predicted_s']:.2f}" if not row.not_compared else f"{r['predicted_s']:.2f} (not compared)"
        print(f"| {row.name} | {row.source}, {row.precision} | {row.gpus} | "
              f"{row.tensor_parallel}/{row.pipeline_parallel}/{row.virtual_stages}/{row.expert_parallel} | "
              f"{row.micro_batch}/{row.global_batch} | {r['published_s']:.2f} | {predicted} | "
              f"{r['error']:+.1%} | {exposed} | {r['tflops']:.0f} | "
              f"{r['memory_gib']:.1f} GiB{'' if r['fits'] else ' (does not fit)'} |")
    for row in MOE_TABLE:
        if row.not_compared:
            print(f"not compared: {row.name}, {row.source}: {row.not_compared}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
