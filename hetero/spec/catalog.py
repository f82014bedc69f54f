"""What we know about devices and links before anything is measured.

Peak figures are dense (no sparsity) bf16 tensor-core rates, fp16 where a device has no
bf16. Each device lists the 16/8-bit precisions its matrix units support (fp32 runs
everywhere): bf16 arrived with Ampere (NVIDIA) and CDNA2 (AMD), fp8 with Hopper/Ada and
CDNA3; the planner picks the job's precision from these. They are upper bounds; the predictor multiplies them by an efficiency and measured
profiles (megatron/hetero/profiling/: compute.py, network.py) replace them. A cluster spec can override or add devices.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceType:
    name: str
    vendor: str
    memory_gib: float
    peak_tflops: float
    """Dense bf16 (fp16 where no bf16) matrix throughput, TFLOP/s."""
    memory_bandwidth_gbs: float
    """Device memory bandwidth, GB/s."""
    precisions: tuple[str, ...] = ("bf16", "fp16")
    """Low precisions its matrix units run (fp32 always runs)."""
    board_power_w: float | None = None
    """Board power (TDP) from the datasheet, W: the energy objective counts every device
    used at this power while the job runs (an upper bound of what it draws)."""
    price_per_hour: float | None = None
    """Rent of one device for one hour, $; a cluster spec overrides it (prices_per_hour)."""

    def supports(self, precision: str) -> bool:
        return precision == "fp32" or precision in self.precisions


AMPERE = ("bf16", "fp16")
VOLTA = ("fp16",)
HOPPER = ("bf16", "fp16", "fp8")  # also Ada (L40S, RTX 4090) and CDNA3 (MI300X)


def _d(name, vendor, memory_gib, peak_tflops, memory_bandwidth_gbs, precisions=AMPERE, watts=None,
       price=None) -> DeviceType:
    return DeviceType(name, vendor, memory_gib, peak_tflops, memory_bandwidth_gbs, precisions, watts, price)


# Prices, $ per device-hour: the middle of the "specialty cloud" on-demand range of the
# Mercatus cloud GPU pricing guide, May 2026 (https://www.mercatus-ai.com/blog/cloud-gpu-pricing:
# A100 80GB $1.10-1.50, H100 SXM5 $2.50-3.50, H200 SXM5 $3.50-4.50). Rents differ 2-4x between
# providers and change monthly: give your own under prices_per_hour in the cluster spec.
# Devices without a listed price have none here; the cost objective then asks for one.


DEVICES: dict[str, DeviceType] = {
    d.name: d
    for d in (
        # NVIDIA V100 datasheet (Volta, SXM2): 125 TFLOPS fp16 tensor, 900 GB/s HBM2.
        # https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
        _d("V100-16GB", "nvidia", 16, 125, 900, VOLTA, watts=300),  # SXM2: 300 W
        _d("V100-32GB", "nvidia", 32, 125, 900, VOLTA, watts=300),
        # NVIDIA A100 datasheet (SXM): 312 TFLOPS bf16 dense; 40GB 1,555 GB/s, 80GB 2,039 GB/s.
        # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
        _d("A100-40GB", "nvidia", 40, 312, 1555, watts=400),  # SXM: 400 W
        _d("A100-80GB", "nvidia", 80, 312, 2039, watts=400, price=1.30),
        # A800 (China-market A100: same compute and memory, NVLink cut to 400 GB/s).
        # https://www.nvidia.cn/data-center/a800/ (A800 80GB SXM datasheet)
        _d("A800-80GB", "nvidia", 80, 312, 2039, watts=400),
        # NVIDIA H100 datasheet (SXM5): 989 TFLOPS bf16 dense (1,979 with sparsity), 3.35 TB/s.
        # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
        _d("H100-80GB", "nvidia", 80, 989, 3350, HOPPER, watts=700, price=3.00),  # SXM5: up to 700 W
        # H800 (China-market H100 SXM: same compute, NVLink 400 GB/s).
        _d("H800", "nvidia", 80, 989, 3350, HOPPER, watts=700),
        # NVIDIA H200 datasheet (SXM): 989 TFLOPS bf16 dense, 141 GB HBM3e, 4.8 TB/s.
        # https://www.nvidia.com/en-us/data-center/h200/
        _d("H200", "nvidia", 141, 989, 4800, HOPPER, watts=700, price=4.00),  # up to 700 W
        # H20 (China-market Hopper): 148 TFLOPS fp16/bf16 dense, 96 GB HBM3, 4.0 TB/s
        # (NVIDIA partner spec sheets; no public NVIDIA datasheet).
        _d("H20", "nvidia", 96, 148, 4000, HOPPER, watts=400),  # 400 W (partner sheets)
        # NVIDIA L40S datasheet: 362 TFLOPS bf16 dense (733 with sparsity), 48 GB GDDR6, 864 GB/s.
        # https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413
        _d("L40S", "nvidia", 48, 362, 864, HOPPER, watts=350),  # 350 W
        # NVIDIA Ada whitepaper, RTX 4090: 165.2 TFLOPS fp16/bf16 tensor with fp32
        # accumulate (dense), 24 GB GDDR6X, 1,008 GB/s.
        # https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf
        _d("RTX-4090", "nvidia", 24, 165, 1008, HOPPER, watts=450),  # 450 W total graphics power
        # AMD Instinct MI210: 181 TFLOPS fp16/bf16, 64 GB HBM2e, 1.6 TB/s.
        # https://www.amd.com/en/products/accelerators/instinct/mi200/mi210.html
        _d("MI210", "amd", 64, 181, 1638, watts=300),  # 300 W
        # AMD Instinct MI250X: 383 TFLOPS fp16/bf16, 128 GB HBM2e, 3.2 TB/s per package of two
        # GCDs; ROCm shows each GCD as its own device (and PyTorch runs one process per GCD),
        # so the catalog entry is one GCD: half of each figure.
        # https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html
        _d("MI250X", "amd", 64, 191.5, 1638, watts=280),  # 560 W per package: half per GCD
        # AMD Instinct MI300X: 1,307 TFLOPS fp16/bf16 dense, 192 GB HBM3, 5.3 TB/s.
        # https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html
        _d("MI300X", "amd", 192, 1307, 5300, HOPPER, watts=750),  # 750 W
        # Huawei Ascend 910B: published figures vary by bin (256-376 TFLOPS fp16, 32-64 GB);
        # the common 910B3 figures are ~313 TFLOPS fp16, 64 GB HBM2e, 1.6 TB/s. Profile it.
        _d("Ascend-910B", "huawei", 64, 313, 1600),
    )
}


@dataclass(frozen=True)
class LinkType:
    """One kind of connection and what a transfer over it achieves."""

    name: str
    bandwidth_gbs: float
    """Per direction, GB/s (for NICs the spec gives Gbit/s per node instead)."""
    latency_us: float
    efficiency: float
    """Fraction of the nominal bandwidth large collectives reach (NCCL-tests bus bandwidth
    over nominal: about 0.8-0.9 on NVLink and RDMA, much less over TCP)."""
    rdma: bool = True


# Inside a node (per direction, per device).
INTRA_NODE_LINKS: dict[str, LinkType] = {
    link.name: link
    for link in (
        # NVLink 2 (V100 SXM2): 300 GB/s total, 150 per direction.
        LinkType("nvlink2", 150, 3, 0.8),
        # NVLink 3 (A100 SXM): 600 GB/s total, 300 per direction.
        LinkType("nvlink3", 300, 3, 0.8),
        # A800/H800: NVLink cut to 400 GB/s total, 200 per direction.
        LinkType("nvlink-400", 200, 3, 0.8),
        # NVLink 4 (H100/H200 SXM): 900 GB/s total, 450 per direction.
        LinkType("nvlink4", 450, 3, 0.8),
        # AMD Infinity Fabric between MI250X GCDs/packages: 50-100 GB/s per link.
        LinkType("xgmi", 100, 5, 0.7),
        # Huawei HCCS (Ascend 910B): 56 GB/s per link.
        LinkType("hccs", 56, 5, 0.7),
        # PCIe x16 per direction: Gen4 32 GB/s, Gen5 64 GB/s (through host bridges).
        LinkType("pcie4", 32, 10, 0.7),
        LinkType("pcie5", 64, 10, 0.7),
        # Processes of one CPU host (the emulator and tests): shared memory, 2 cores.
        LinkType("loopback", 1.5, 30, 1.0, rdma=False),
    )
}

# Between nodes; bandwidth comes from the cluster spec (Gbit/s per node).
NIC_KINDS: dict[str, LinkType] = {
    "ib": LinkType("ib", 0, 2, 0.9),
    "roce": LinkType("roce", 0, 5, 0.85),
    # TCP over Ethernet: kernel copies and no GPUDirect; NCCL's socket transport reaches
    # roughly half to two thirds of the line rate.
    "ethernet": LinkType("ethernet", 0, 30, 0.6, rdma=False),
}

# Between devices of different vendors (NCCL and RCCL cannot talk to each other): tensors
# are staged through host memory on both sides (device->host over PCIe, the network,
# host->device), chunked so the three overlap; the slowest piece bounds it. Gen4 x16
# device-host copies reach ~24 GB/s.
VENDOR_BRIDGE = LinkType("host-staged bridge", 24, 20, 0.8, rdma=False)
