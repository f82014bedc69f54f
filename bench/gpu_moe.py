"""The mixture-of-experts and fp8 sections of bench/gpu_bench.py (its one entry point runs them).

gemm8: fp8 (e4m3, per-tensor scales, bf16 output, torch._scaled_mm) beside bf16 matrix
    multiplies on transformer-layer shapes and on the expert GEMMs of three published MoE
    models, each expert's GEMM in a loop against torch's grouped GEMMs (torch._grouped_mm,
    torch._scaled_grouped_mm) where this torch has them; forward, dgrad and wgrad.
moe: loss and load-balancing-loss parity of a small MoE GPT, one NCCL process (EP 1) against
    two processes on the one GPU labelled as two vendors with expert parallelism 2, so every
    token all-to-all crosses the ``hetero`` backend's host-staged bridge.
train-moe: a Qwen3-30B-A3B-shaped model cut to a few layers, trained on the GPU, its measured
    iteration time beside the predictor's (hetero/predict/costs.py's MoE terms).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch



def catalog_device_type() -> str:
    """The catalog name of the GPU this runs on (an H200 has the H100's compute and more
    memory bandwidth: plans and predictions must name the one present)."""
    from hetero.spec.catalog import DEVICES
    from hetero.spec.devices import device_type_matches
    if torch.cuda.is_available():
        found = torch.cuda.get_device_name(0)
        for name in ("H200", "H100-80GB", "H800", "A100-80GB", "A100-40GB"):
            if name in DEVICES and device_type_matches(name, found):
                return name
    return "H100-80GB"


DEVICE_TYPE = catalog_device_type()
FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GEMM_WARMUPS, GEMM_REPEATS = 3, 12


# ----- 1. fp8 and grouped GEMMs -------------------------------------------------------------

@dataclass(frozen=True)
class ExpertShape:
    """One model's expert GEMMs on one rank: `experts` local experts, each fed `tokens` rows."""

    model: str
    hidden: int
    ffn: int  # one expert's FFN width; fc1 is 2 x ffn wide (SwiGLU's gate and up halves)
    experts: int
    tokens: int

    def gemms(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of the expert's two linear layers."""
        return [("fc1", self.hidden, 2 * self.ffn), ("fc2", self.ffn, self.hidden)]


EXPERT_SHAPES = [
    ExpertShape("Qwen3-30B-A3B", 2048, 768, 16, 2048),
    ExpertShape("Mixtral-8x7B", 4096, 14336, 2, 8192),
    ExpertShape("DeepSeek-V3", 7168, 2048, 4, 1024),
    ExpertShape("DeepSeek-V3", 7168, 2048, 4, 4096),
]
# A dense layer of hidden 2048 at 8192 tokens (QKV, projection, MLP in and out), and a square.
DENSE_SHAPES = [(8192, 2048, 6144), (8192, 2048, 2048), (8192, 2048, 8192), (8192, 8192, 2048), (8192, 8192, 8192)]
PASSES = ("forward", "dgrad", "wgrad")


def pass_dims(tokens: int, inputs: int, outputs: int, which: str) -> tuple[int, int, int]:
    """(m, k, n) of one pass of a linear layer y = x W (x: tokens x inputs): forward
    x W, dgrad dy W^T (tokens x outputs by outputs x inputs), wgrad dy^T x (outputs x tokens
    by tokens x inputs: the contraction runs over the tokens)."""
    return {"forward": (tokens, inputs, outputs), "dgrad": (tokens, outputs, inputs),
            "wgrad": (outputs, tokens, inputs)}[which]


def time_s(step: Callable[[], object]) -> tuple[float, float]:
    """Median seconds of one call and the spread (max - min) / median over GEMM_REPEATS calls,
    each between its own CUDA events, after GEMM_WARMUPS calls."""
    for _ in range(GEMM_WARMUPS):
        step()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(GEMM_REPEATS)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) / 1e3 for start, end in events]
    median = statistics.median(times)
    return median, (max(times) - min(times)) / median


def to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in e4m3 with one float32 scale (x ~ q * scale), its largest magnitude at e4m3's top."""
    if x.dim() == 2 and x.stride(0) == 1 and x.stride(1) > 1:  # column-major: keep it so
        quantized, scale = to_fp8(x.t())
        return quantized.t(), scale
    scale = (x.abs().max().float() / E4M3_MAX).clamp(min=1e-12)
    return (x / scale).to(FP8).contiguous(), scale.reshape(())


def fp8_rowwise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x in e4m3 with one float32 scale per slice along `dim` (torch's grouped fp8 GEMM takes
    row-wise scales only)."""
    scale = (x.abs().amax(dim=dim, keepdim=True).float() / E4M3_MAX).clamp(min=1e-12)
    return (x / scale).to(FP8), scale.squeeze(dim).contiguous()


def dense_operands(m: int, k: int, n: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """a (m x k, row-major) and b (k x n, column-major: the transpose of a contiguous n x k),
    the layout _scaled_mm requires of its second operand; bf16 matmul takes either."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
    return a, b


def scaled_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """||got - reference|| / ||reference||: a wrong layout or scale gives ~1, e4m3's rounding ~0.03-0.05.
    (On the meta device, which checks the calls' shapes and layouts without a GPU: nan.)"""
    if tuple(got.shape) != tuple(reference.shape):
        raise RuntimeError(f"result of shape {tuple(got.shape)}, expected {tuple(reference.shape)}")
    if got.is_meta:
        return float("nan")
    return float((got.float() - reference.float()).norm() / reference.float().norm())


def dense_case(m: int, k: int, n: int, device: str = "cuda") -> dict:
    """One GEMM in bf16 and in fp8: the callables to time and the fp8 result's error."""
    a, b = dense_operands(m, k, n, device)
    a8, sa = to_fp8(a)
    b8, sb = to_fp8(b)  # .t() of a contiguous tensor stays column-major through the cast
    error = relative_error(scaled_mm(a8, b8, sa, sb), a @ b)
    return {"bf16": lambda: a @ b, "fp8": lambda: scaled_mm(a8, b8, sa, sb), "fp8_error": error}


def expert_case(groups: int, m: int, k: int, n: int, contraction_grouped: bool, device: str = "cuda") -> dict:
    """`groups` GEMMs of m x k by k x n (the experts of one pass): a loop of per-expert GEMMs
    in bf16 and fp8, and torch's grouped GEMMs where present.

    Forward and dgrad group the rows (tokens): a 2-D (groups*m x k) by a 3-D (groups x k x n)
    operand, offsets along the rows. wgrad groups the contraction (tokens): a 2-D (m x groups*k)
    by a 2-D (groups*k x n) operand, offsets along k, one m x n result per expert.
    """
    cases: dict = {}
    pairs = [dense_operands(m, k, n, device) for _ in range(groups)]
    quantized = [(to_fp8(a), to_fp8(b)) for a, b in pairs]
    cases["bf16 loop"] = lambda: [a @ b for a, b in pairs]
    cases["fp8 loop"] = lambda: [scaled_mm(a8, b8, sa, sb) for (a8, sa), (b8, sb) in quantized]
    reference = torch.stack([a @ b for a, b in pairs])
    offsets = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (k if contraction_grouped else m)
    if contraction_grouped:
        mat_a = torch.cat([a for a, _ in pairs], dim=1).contiguous()  # m x groups*k, row-major
        mat_b = torch.cat([b for _, b in pairs], dim=0)  # groups*k x n: column-major
        mat_b = mat_b.t().contiguous().t()
    else:
        mat_a = torch.cat([a for a, _ in pairs], dim=0)  # groups*m x k
        mat_b = torch.stack([b.t() for _, b in pairs]).transpose(1, 2)  # groups x k x n, column-major
    if hasattr(torch, "_grouped_mm"):
        try:
            got = torch._grouped_mm(mat_a, mat_b, offs=offsets, out_dtype=torch.bfloat16)
            got = got if contraction_grouped else got.view(groups, m, n)
            cases["bf16 grouped_error"] = relative_error(got, reference)
            cases["bf16 grouped"] = lambda: torch._grouped_mm(mat_a, mat_b, offs=offsets, out_dtype=torch.bfloat16)
        except (RuntimeError, NotImplementedError) as error:
            cases["bf16 grouped_missing"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    else:
        cases["bf16 grouped_missing"] = "torch._grouped_mm is not in this torch"
    if hasattr(torch, "_scaled_grouped_mm"):
        try:
            if contraction_grouped:
                # Row-wise scales of a 2-D x 2-D grouped product: one per output row of each
                # group for a (groups*m), one per output column of each group for b (groups*n).
                parts_a = [fp8_rowwise(a.contiguous(), 1) for a, _ in pairs]
                parts_b = [fp8_rowwise(b, 0) for _, b in pairs]
                a8 = torch.cat([q for q, _ in parts_a], dim=1).contiguous()
                b8 = torch.cat([q.t().contiguous() for q, _ in parts_b], dim=1).t()  # column-major
                sa = torch.cat([s for _, s in parts_a]).contiguous()
                sb = torch.cat([s for _, s in parts_b]).contiguous()
            else:
                a8, sa = fp8_rowwise(mat_a, 1)  # groups*m rows, one scale each
                b8, sb = fp8_rowwise(mat_b, 1)  # groups x n scales (over k), b8 column-major
                b8 = b8.transpose(1, 2).contiguous().transpose(1, 2)

            def grouped8() -> torch.Tensor:
                return torch._scaled_grouped_mm(a8, b8, sa, sb, offs=offsets, out_dtype=torch.bfloat16)

            got = grouped8()
            got = got if contraction_grouped else got.view(groups, m, n)
            cases["fp8 grouped_error"] = relative_error(got, reference)
            cases["fp8 grouped"] = grouped8
        except (RuntimeError, NotImplementedError) as error:
            cases["fp8 grouped_missing"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    else:
        cases["fp8 grouped_missing"] = "torch._scaled_grouped_mm is not in this torch"
    (first_a8, first_sa), (first_b8, first_sb) = quantized[0]  # names of their own: grouped8 closes over a8...
    cases["fp8 loop_error"] = relative_error(scaled_mm(first_a8, first_b8, first_sa, first_sb), reference[0])
    return cases


def measure(cases: dict, flops: float, peak: float) -> dict:
    """Times every callable in `cases` (the rest are figures to keep); TFLOP/s, fraction of the
    peak of its precision (fp8: twice bf16's), spread."""
    row: dict = {}
    for name, value in cases.items():
        if not callable(value):
            row[name] = value
            continue
        seconds, spread = time_s(value)
        tflops = flops / seconds / 1e12
        row[name] = {"tflops": tflops, "fraction": tflops / (2 * peak if name.startswith("fp8") else peak),
                     "spread": spread}
    return row


def bench_gemm8() -> dict:
    """fp8 beside bf16 on dense-layer and expert shapes, every pass."""
    from hetero.spec.catalog import DEVICES

    peak = DEVICES[DEVICE_TYPE].peak_tflops
    print(f"fp8 (e4m3, per-tensor scales) and bf16 GEMMs; fraction of {peak:.0f} (bf16) / {2 * peak:.0f} (fp8) "
          f"TFLOP/s; torch._grouped_mm {'present' if hasattr(torch, '_grouped_mm') else 'absent'}, "
          f"torch._scaled_grouped_mm {'present' if hasattr(torch, '_scaled_grouped_mm') else 'absent'}")
    print("| shape | pass | bf16 TFLOP/s (of peak) | fp8 TFLOP/s (of peak) | fp8/bf16 | fp8 error |\n"
          "|---|---|---:|---:|---:|---:|")
    dense = []
    for tokens, inputs, outputs in DENSE_SHAPES:
        for which in PASSES:
            m, k, n = pass_dims(tokens, inputs, outputs, which)
            row = {"tokens": tokens, "in": inputs, "out": outputs, "pass": which, "mkn": [m, k, n],
                   **measure(dense_case(m, k, n), 2 * m * k * n, peak)}
            row["fp8_over_bf16"] = row["fp8"]["tflops"] / row["bf16"]["tflops"]
            dense.append(row)
            print(f"| {tokens} x {inputs} -> {outputs} | {which} | {row['bf16']['tflops']:.0f} "
                  f"({row['bf16']['fraction']:.2f}) | {row['fp8']['tflops']:.0f} ({row['fp8']['fraction']:.2f}) "
                  f"| {row['fp8_over_bf16']:.2f} | {row['fp8_error']:.3f} |", flush=True)
    print("\n| model (experts x tokens) | GEMM | pass | bf16 loop | bf16 grouped | fp8 loop | fp8 grouped | "
          "fp8/bf16 (loop) |\n|---|---|---|---:|---:|---:|---:|---:|")
    experts = []
    for shape in EXPERT_SHAPES:
        for gemm, inputs, outputs in shape.gemms():
            for which in PASSES:
                m, k, n = pass_dims(shape.tokens, inputs, outputs, which)
                cases = expert_case(shape.experts, m, k, n, contraction_grouped=which == "wgrad")
                row = {"model": shape.model, "experts": shape.experts, "tokens_per_expert": shape.tokens,
                       "gemm": gemm, "pass": which, "mkn": [m, k, n],
                       **measure(cases, 2 * m * k * n * shape.experts, peak)}
                row["fp8_over_bf16_loop"] = row["fp8 loop"]["tflops"] / row["bf16 loop"]["tflops"]
                experts.append(row)
                torch.cuda.empty_cache()

                def cell(name: str) -> str:
                    if name in row and isinstance(row[name], dict):
                        return f"{row[name]['tflops']:.0f} ({row[name]['fraction']:.2f})"
                    return "-"

                print(f"| {shape.model} ({shape.experts} x {shape.tokens}) | {gemm} | {which} | {cell('bf16 loop')} "
                      f"| {cell('bf16 grouped')} | {cell('fp8 loop')} | {cell('fp8 grouped')} "
                      f"| {row['fp8_over_bf16_loop']:.2f} |", flush=True)
    missing = {k: v for row in experts[:3] for k, v in row.items() if k.endswith("_missing")}
    if missing:
        print(f"grouped GEMMs not run: {missing}")
    errors = [(r["mkn"], k, v) for r in dense + experts for k, v in r.items() if k.endswith("error") and v > 0.1]
    if errors:
        print(f"WARNING: fp8/grouped results far from bf16's (a layout or scale problem): {errors[:6]}")
    return {"peak_bf16_tflops": peak, "peak_fp8_tflops": 2 * peak, "dense": dense, "experts": experts,
            "large_errors": errors}


# ----- 2. MoE loss parity across the bridge -------------------------------------------------

MOE_PARITY_FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
                    "--max-position-embeddings", "256", "--vocab-size", "8000", "--attention-dropout", "0",
                    "--hidden-dropout", "0", "--micro-batch-size", "2", "--global-batch-size", "16",
                    "--train-iters", "5", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--seed", "7",
                    "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
                    "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
                    "--disable-bias-linear"]
MOE_FIGURES = ("lm loss", "load_balancing_loss")


def moe_parity_plans(parity_plan: Callable[..., dict]) -> dict[str, dict]:
    """The reference (one process, EP 1) and two processes as two vendors, EP 2 over their two
    equal replicas (an expert-parallel group's replicas run equal micro-batch counts)."""
    return {"moe_one_gpu": parity_plan(1, 1, [4], [8], ["nvidia"]),
            "moe_ep2_two_vendors": {**parity_plan(1, 2, [4], [4, 4], ["nvidia", "amd"]), "expert_parallel": 2}}


def compare_figures(reference: dict[str, list[float]], got: dict[str, list[float]], tolerance: float = 1e-5) -> dict:
    """Per figure: the largest relative difference over the iterations, and whether every
    iteration is there and within `tolerance`."""
    result = {}
    for name in MOE_FIGURES:
        ref, new = reference.get(name, []), got.get(name, [])
        worst = max((abs(a - b) / abs(a) for a, b in zip(ref, new)), default=float("inf"))
        result[name] = {"reference": ref, "losses": new, "max_relative_difference": worst,
                        "ok": len(ref) > 0 and len(new) == len(ref) and worst <= tolerance}
    return result


def bench_moe(out: Path, run_figures: Callable[[Path, str, dict, str, list[str]], dict[str, list[float]]],
              parity_plan: Callable[..., dict]) -> dict:
    plans = moe_parity_plans(parity_plan)
    reference = run_figures(out, "moe_one_gpu", plans["moe_one_gpu"], "nccl", MOE_PARITY_FLAGS)
    got = run_figures(out, "moe_ep2_two_vendors", plans["moe_ep2_two_vendors"], "hetero", MOE_PARITY_FLAGS)
    result = compare_figures(reference, got)
    for name, figures in result.items():
        print(f"moe parity {name}: EP 2 as two vendors (hetero backend) vs one GPU (NCCL): max relative "
              f"difference {figures['max_relative_difference']:.2e} over {len(figures['losses'])} iterations "
              f"({'ok' if figures['ok'] else 'FAILED'})", flush=True)
    return result


# ----- 3. a Qwen3-30B-A3B-shaped MoE model trained on the GPU --------------------------------

# Qwen3-30B-A3B's layer (hidden 2048, 32 query heads over 4 key-value groups of head dim 128,
# QK norm, 128 experts of FFN 768, top-8) with one EP 8 rank's 16 experts, cut to 4 layers.
# Routing forced balanced (as NVIDIA's published MoE runs), so each expert gets
# tokens x 8 / 16 rows, the rate the predictor assumes.
QWEN3_MOE_FLAGS = ["--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "6144",
                   "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "4",
                   "--kv-channels", "128", "--qk-layernorm", "--seq-length", "4096",
                   "--max-position-embeddings", "4096", "--vocab-size", "151936", "--normalization", "RMSNorm",
                   "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
                   "--untie-embeddings-and-output-weights", "--bf16", "--attention-dropout", "0",
                   "--hidden-dropout", "0", "--num-experts", "16", "--moe-router-topk", "8",
                   "--moe-ffn-hidden-size", "768", "--moe-router-load-balancing-type", "aux_loss",
                   "--moe-aux-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
                   "--moe-router-force-load-balancing"]
MOE_GLOBAL_BATCH, MOE_TRAIN_ITERATIONS, MOE_WARMUP = 4, 8, 3


def moe_train_prediction(out: Path, data_flags: list[str], cluster) -> tuple[Path, dict]:
    """The plan file of the MoE run (micro-batch 1, world of one) and the predictor's
    iteration time and memory for it from the GEMM curve; needs no GPU."""
    from megatron.hetero.startup import model_spec_of_flags
    from hetero.plan import Plan
    from hetero.predict.costs import CostModel
    from hetero.predict.training_setup import TrainingSetup
    from hetero.predict.memory import DEFAULT_OVERHEAD_GIB
    from hetero.predict.predictor import predict

    spec = model_spec_of_flags(QWEN3_MOE_FLAGS + data_flags)
    devices = [{"host": "gpu0", "device_type": DEVICE_TYPE, "vendor": "nvidia", "nic": "ib"}]
    plan = Plan.from_dict({**Plan.uniform(tensor_parallel=1, pipeline_parallel=1, data_parallel=1, micro_batch_size=1,
                                          num_layers=spec.num_layers, global_batch_size=MOE_GLOBAL_BATCH).to_dict(),
                           "devices": devices})
    path = out / "plan_qwen3_moe.json"
    plan.save(path)
    # Local layers without transformer-engine: unfused attention, no grouped GEMM.
    setup = TrainingSetup("bf16", distributed_optimizer=False, fused_kernels=False, dropout=False, recompute="none")
    predicted = predict(plan, cluster, CostModel(cluster, spec, setup))
    return path, {"model": {"num_experts": spec.num_experts, "moe_router_topk": spec.moe_router_topk,
                            "moe_ffn_hidden_size": spec.moe_ffn_hidden_size, "num_layers": spec.num_layers},
                  "curve_s": predicted.iteration_time_s,
                  "predicted_gib": max(predicted.peak_memory_gib.values()) - DEFAULT_OVERHEAD_GIB}


def moe_train_argv(python: str, plan_path: Path, data_flags: list[str]) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "pretrain_gpt.py",
            "--hetero-plan", str(plan_path), *QWEN3_MOE_FLAGS, *data_flags, "--micro-batch-size", "1",
            "--global-batch-size", str(MOE_GLOBAL_BATCH), "--train-iters", str(MOE_TRAIN_ITERATIONS), "--lr", "1e-4",
            "--log-interval", "1", "--log-memory-interval", str(MOE_TRAIN_ITERATIONS), "--eval-iters", "0"]
