"""How much of a device's peak a matrix multiply reaches, by shape and device family.

A GEMM of shape (M, K) x (K, N) is fast when every dimension is large enough to fill the
device's tensor-core tiles and to hide memory traffic behind arithmetic; small dimensions
leave the device partly idle. We use Hockney's two-parameter form (Hockney & Jesshope,
"Parallel Computers 2", 1988: r(n) = r_inf * n / (n + n_half)) on the GEMM's smallest
dimension n:

    efficiency(n) = large_gemm_fraction * n / (n + half_size)

- large_gemm_fraction: what cuBLAS/rocBLAS reach on the large 16-bit GEMMs of a training
  step, as a fraction of the datasheet's dense peak. Measured on an H100 SXM 80GB
  (bench/gpu_bench.py, torch 2.11 / cuBLAS 13, bf16): the largest squares reach 0.80, the
  shapes of transformer layers (tokens x 2048..8192) 0.59-0.74; a least-squares fit of
  this curve over 15 shapes gives 0.75 and a half size of about 200. Megatron-LM's SC21
  weak-scaling table (bench/published.py) implies about the same share on the A100 with
  NVIDIA's usual half size for its tiles (~128: "Matrix Multiplication Background", docs.
  nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication, shows K or N of
  256-512 well under full speed). MI250X/MI300X: AMD's published hipBLASLt benchmarks
  reach about 70% and 60%.
- half_size: the dimension at which half of that is reached.

Profiles (measured per-layer times, megatron/hetero/profiling/compute.py) replace all of this.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EfficiencyCurve:
    large_gemm_fraction: float
    """Fraction of dense peak a large, well-shaped 16-bit GEMM reaches."""
    half_size: float
    """Smallest GEMM dimension at which half of large_gemm_fraction is reached."""

    def gemm(self, m: float, n: float, k: float) -> float:
        smallest = max(1.0, min(m, n, k))
        return self.large_gemm_fraction * smallest / (smallest + self.half_size)


# Per device family (catalog names, matched by prefix); the default for anything else.
CURVES: dict[str, EfficiencyCurve] = {
    "V100": EfficiencyCurve(0.80, 96),
    "A100": EfficiencyCurve(0.75, 128),
    "A800": EfficiencyCurve(0.75, 128),
    "H100": EfficiencyCurve(0.75, 192),
    "H800": EfficiencyCurve(0.75, 192),
    "H200": EfficiencyCurve(0.75, 192),
    "MI250X": EfficiencyCurve(0.70, 192),
    "MI300X": EfficiencyCurve(0.60, 256),
}
DEFAULT_CURVE = EfficiencyCurve(0.65, 192)
# fp8 GEMMs (as a fraction of the fp8 dense peak, twice the 16-bit one): the same tiles move
# half the bytes per multiply-add, so a GEMM needs larger dimensions to keep the fp8 units
# busy. Measured on an H200 (the H100's compute; bench/gpu_bench.py --only gemm8, torch 2.11
# torch._scaled_mm with per-tensor scales): 0.58-0.71 of the fp8 peak on transformer-layer
# shapes (1.6-2.0x bf16), 0.32-0.61 on mixture-of-experts expert GEMMs with 768-1536 deep
# sides; the least-squares fit over 39 GEMMs (dense, and each expert shape's better of one
# GEMM per expert and torch's grouped GEMM) is 0.76 with a half size of 530.
FP8_CURVES: dict[str, EfficiencyCurve] = {
    "H100": EfficiencyCurve(0.76, 530),
    "H800": EfficiencyCurve(0.76, 530),
    "H200": EfficiencyCurve(0.76, 530),
}
DEFAULT_FP8_CURVE = EfficiencyCurve(0.55, 384)
# CPU processes (the emulator, tests): fp32 GEMMs through oneDNN/MKL on AVX-512 cores reach
# about 80% of the cores' FMA peak on large shapes, and need a few hundred rows and columns
# to get there (cache blocking), so the small test models run far below it.
CPU_CURVE = EfficiencyCurve(0.80, 256)
# Memory-bound kernels (norms, softmax, dropout, activations, the optimizer): the share of
# datasheet bandwidth a streaming kernel reaches (STREAM-like copies reach 80-90% on HBM).
MEMORY_EFFICIENCY = 0.8


def curve_for(device_name: str, vendor: str | None = None, precision: str = "bf16") -> EfficiencyCurve:
    """The GEMM efficiency curve of a device (16-bit, or fp8 of its fp8 peak)."""
    if vendor == "cpu":
        return CPU_CURVE
    curves, default = (FP8_CURVES, DEFAULT_FP8_CURVE) if precision == "fp8" else (CURVES, DEFAULT_CURVE)
    for prefix, curve in curves.items():
        if device_name.startswith(prefix):
            return curve
    return default
