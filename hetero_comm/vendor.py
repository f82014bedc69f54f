"""Which vendor this process runs on, as the hetero backend sees it.

Ranks with the same vendor talk through the native library (NCCL, RCCL, gloo on the
CPU); ranks of different vendors through the bridge. The vendor is, first found wins:

1. ``set_vendor(...)``, called before the process group is created (the Megatron-Hetero
   runtime calls it with the plan's ``devices[launch_rank].vendor``);
2. the ``HETERO_VENDOR`` environment variable: one name, or a comma-separated list
   indexed by ``LOCAL_RANK`` (torchrun gives every local rank the same environment);
3. what torch sees: ``amd`` on a ROCm GPU, ``nvidia`` on a CUDA GPU, else ``cpu``.
"""

from __future__ import annotations

import torch

from hetero import env

_vendor: str | None = None


def _normalize(vendor: str) -> str:
    if not isinstance(vendor, str) or not vendor.strip():
        raise ValueError(f"a vendor is a non-empty name such as 'nvidia' or 'amd', got {vendor!r}")
    return vendor.strip().lower()


def set_vendor(vendor: str | None) -> None:
    """Sets this process's vendor for process groups created from now on (None: unset)."""
    global _vendor
    _vendor = None if vendor is None else _normalize(vendor)


def vendor_from_env() -> str | None:
    """HETERO_VENDOR's entry for this local rank (hetero.env), lower case; None when unset."""
    return env.vendor()


def get_vendor() -> str:
    """This process's vendor (see the module docstring for where it comes from)."""
    if _vendor is not None:
        return _vendor
    from_env = vendor_from_env()
    if from_env is not None:
        return from_env
    if torch.cuda.is_available():
        return "amd" if torch.version.hip else "nvidia"
    return "cpu"
