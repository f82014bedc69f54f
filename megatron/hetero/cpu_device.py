"""Run megatron-core on a machine without a GPU.

megatron-core names the CUDA device in ~130 places (``device="cuda"``,
``torch.cuda.current_device()``, ``.cuda()``, type checks against
``'torch.cuda.FloatTensor'``). Patching each site would be a fork, so on a CPU-only
process we reinterpret "cuda" as "this process's compute device", which is the CPU:

- one ``TorchFunctionMode`` (torch's own ``with torch.device(...)`` is built the same way)
  rewrites a ``device=`` of ``"cuda"``/``cuda:N``/an int to ``cpu``, makes ``Tensor.cuda()``
  a no-op and lets ``Tensor.type()`` report the CUDA type name megatron checks for;
- ``torch.cuda`` helpers that megatron calls unconditionally (``current_device``,
  ``synchronize``, ``empty_cache``, the RNG state functions) act on the CPU;
- megatron's own RNG tracker helpers act on the CPU generator, so the model-parallel RNG
  tracker (used for dropout under tensor parallelism) keeps its meaning;
- CUDA streams and events (the MoE all-to-all dispatcher copies its token counts to the
  host on a side stream) are the CPU's single in-order stream: waiting and synchronizing
  are no-ops because every operation has already completed when the next one starts.

Nothing here is active on a process that has a GPU.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from hetero import env

_CPU = torch.device("cpu")

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare int names a CUDA ordinal in torch
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CudaAsCpuMode(TorchFunctionMode):
    """Maps every request for a CUDA device onto the CPU."""

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(args[0].dtype, func(*args))
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):  # page-locked host memory exists only for a GPU's copies
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _cpu_get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


_active_mode: CudaAsCpuMode | None = None


class _HostEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _HostStream:
    """The CPU's one in-order stream: every instance is the same stream."""

    def __init__(self, *args, **kwargs):
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, _HostStream)

    def __hash__(self) -> int:
        return 0

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return event or _HostEvent()

    def synchronize(self) -> None:
        pass


class _OnHostStream:
    """``with torch.cuda.stream(s):`` on the CPU: nothing to switch."""

    def __init__(self, stream=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def enable_cpu_device() -> list[str]:
    """Installs the CPU reinterpretation of CUDA for the rest of the process.

    Returns the names of what it replaced, for the patch listing.
    """
    global _active_mode
    if torch.cuda.is_available():
        raise RuntimeError("enable_cpu_device() is for processes without a GPU")
    if _active_mode is not None:
        return []
    from megatron.core.tensor_parallel import random as mcore_random

    replaced = {
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "synchronize"): lambda *a, **k: None,
        (torch.cuda, "empty_cache"): lambda: None,
        (torch.cuda, "get_rng_state"): _cpu_get_rng_state,
        (torch.cuda, "set_rng_state"): _cpu_set_rng_state,
        (torch.cuda.random, "get_rng_state"): _cpu_get_rng_state,
        (torch.cuda.random, "set_rng_state"): _cpu_set_rng_state,
        (torch.cuda, "manual_seed"): lambda seed: torch.manual_seed(seed),
        (mcore_random, "_get_cuda_rng_state"): _cpu_get_rng_state,
        (mcore_random, "_set_cuda_rng_state"): _cpu_set_rng_state,
        (torch.cuda.nvtx, "range_push"): lambda *a, **k: None,
        (torch.cuda.nvtx, "range_pop"): lambda *a, **k: None,
        (torch.cuda, "Stream"): _HostStream,
        (torch.cuda, "Event"): lambda *a, **k: _HostEvent(),
        (torch.cuda, "current_stream"): lambda *a, **k: _HostStream(),
        (torch.cuda, "stream"): _OnHostStream,
    }
    for (owner, name), replacement in replaced.items():
        setattr(owner, name, replacement)
    _active_mode = CudaAsCpuMode()
    _active_mode.__enter__()
    return [f"{owner.__name__}.{name}" for owner, name in replaced]


def active_mode() -> CudaAsCpuMode | None:
    """The installed mode (None before enable_cpu_device)."""
    return _active_mode


KEEP_FREED_MEMORY_ENV = env.CPU_KEEP_FREED_MEMORY


def configure_host_allocator() -> str:
    """How a CPU rank's freed tensors are handled, before the first one is allocated:
    "returned" (the default) or "kept" (HETERO_CPU_KEEP_FREED_MEMORY=1); says which.

    Returned: every freed tensor goes back to the operating system, so the process's peak
    resident memory is the job's own peak - what the memory model predicts and the memory
    lines report. Kept: glibc keeps freed memory for reuse, as a GPU's caching allocator
    does. Timing runs on an emulated cluster want this: returning memory makes every
    allocation fault its pages in again, and on a virtual machine that hands freed pages
    back to its host (free page reporting) that cost an emulated run 30% of its iteration
    time and varied it by 20-30% between runs of the same plan. Peak memory then counts
    glibc's reuse slack (15% more here), so it is not the figure to compare.
    """
    if env.keep_freed_memory():
        keep_freed_memory()
        return "kept"
    return "returned" if return_freed_memory_to_os() else "kept"


def _glibc_mallopt():
    """glibc's mallopt(param, value), or None where the C library is not glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)


def return_freed_memory_to_os(threshold_bytes: int = 128 * 1024) -> bool:
    """Makes glibc map every allocation above threshold_bytes on its own, as it does at
    start-up, so that freeing a tensor gives its memory back to the system.

    glibc otherwise raises its threshold after the first large free, then serves tensors
    from a heap it never shrinks: a CPU process's resident memory would keep its peak
    forever, hiding what the job actually uses (and what the predictor estimates).
    Returns False where this is not glibc.
    """
    mallopt = _glibc_mallopt()
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes))


def keep_freed_memory() -> bool:
    """Makes glibc keep what is freed: tensors up to 32 MiB come from the heap, and the
    heap is never trimmed. Left to its defaults, glibc still unmaps large blocks and trims
    the heap's top as sizes vary: a steady training step re-faulted ~5,000 pages (20 MiB),
    and more when several models take turns. Returns False where this is not glibc."""
    mallopt = _glibc_mallopt()
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


# GPU-only kernel and implementation choices whose computation megatron-core also runs on
# the CPU: (flag, the value given, what runs instead). A GPU recipe then starts unchanged on
# a CPU machine (tests, the emulated cluster), and the start-up says once what ran instead.
# Choices without a CPU equivalent (FP8/FP4, CUDA graphs, NCCL-only tuning) stay refused by
# the flag catalog.
_TE_ATTENTION = ("flash", "fused", "unfused")


def substitute_gpu_choices(args: Any, kernel_flags: list[str]) -> list[str]:
    """On a process without a GPU, replaces the GPU-only choices in ``args`` by their CPU
    equivalents and returns one phrase per substitution (empty where a GPU is visible).

    ``kernel_flags``: the given flags that only turn fused kernels off; the CPU runs none,
    so they are listed too (nothing to replace)."""
    if torch.cuda.is_available():
        return []
    done: list[str] = []
    if args.transformer_impl == "transformer_engine":
        args.transformer_impl = "local"
        done.append("--transformer-impl transformer_engine -> local (megatron-core's own layers)")
    if args.attention_backend in _TE_ATTENTION:
        done.append(f"--attention-backend {args.attention_backend} -> local (megatron-core's "
                    "DotProductAttention; the backend only picks transformer-engine's kernel)")
        args.attention_backend = "local"
    if getattr(args, "moe_grouped_gemm", False):
        args.moe_grouped_gemm = False
        done.append("--moe-grouped-gemm -> experts one after another (megatron-core's "
                    "SequentialMLP, the same computation)")
    for name, what in (("moe_permute_fusion", "token permutation"), ("moe_router_fusion", "router")):
        if getattr(args, name, False):
            setattr(args, name, False)
            done.append(f"--{name.replace('_', '-')} -> megatron-core's unfused {what}")
    if args.distributed_backend == "nccl":
        args.distributed_backend = "gloo"
        done.append("--distributed-backend nccl -> gloo")
    if getattr(args, "profile", False) and not args.use_pytorch_profiler:
        # Megatron-LM's --profile alone opens an nsys capture range through CUDA's profiler API;
        # torch.profiler (its --use-pytorch-profiler) profiles the same iterations on the CPU.
        args.use_pytorch_profiler = True
        args.profile_trace_dir = args.tensorboard_dir or os.path.abspath("profile")
        done.append(f"--profile (an nsys capture range) -> torch.profiler, as with --use-pytorch-profiler "
                    f"(its trace in {args.profile_trace_dir})")
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te":
        args.cross_entropy_fusion_impl = "native"
        done.append("--cross-entropy-fusion-impl te -> native (megatron-core's own fused "
                    "cross-entropy)")
    from megatron.hetero.distributed import GROUP_OPTION_FLAGS

    tuned = []
    for flag, dest, default in GROUP_OPTION_FLAGS.values():
        if getattr(args, dest, default) != default:
            setattr(args, dest, default)
            tuned.append(flag)
    if tuned:
        done.append(f"{', '.join(tuned)}: no effect (NCCL group tuning; every group is a gloo group "
                    "on the CPU)")
    if kernel_flags:
        done.append(f"{', '.join(kernel_flags)}: no effect (no fused kernels on the CPU)")
    return done


def substitution_note(done: list[str]) -> str | None:
    """The one start-up line listing the substitutions (None when there were none)."""
    if not done:
        return None
    return "GPU-only choices run as their CPU equivalents on this process: " + "; ".join(done)


@contextmanager
def host_work() -> Iterator[None]:
    """Runs the calling thread's work inside as a GPU's host does it, beside the device.

    On an emulated node a rank's CPU quota stands for its device's speed, and everything the
    rank does is charged to it. Some work a GPU rank leaves to its host while the GPU
    computes: a snapshot's copy to host memory and its messages to another node (DMA
    engines, the host's cores, the NIC). Inside, the calling thread runs in the rank's host
    cgroup (no quota, an ordinary process's weight, so it never takes a device's quota from
    it; tools/emulator/cpu_quota.py), and threads it starts stay there (a process group
    made inside keeps its gloo threads there). Elsewhere, and where the emulator gave no
    host cgroup, nothing changes."""
    host, device = env.emulator_host_cgroup(), env.emulator_cgroup()
    if not host or not device:
        yield
        return
    thread = str(threading.get_native_id())
    with open(os.path.join(host, "tasks"), "w") as tasks:  # tens of microseconds
        tasks.write(thread)
    try:
        yield
    finally:
        with open(os.path.join(device, "tasks"), "w") as tasks:
            tasks.write(thread)
