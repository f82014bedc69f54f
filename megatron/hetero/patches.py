"""Every change Megatron-Hetero makes to the installed megatron-core, in one place.

Run ``python -m megatron.hetero.patches`` to list them. Each patch is small, named, says
why it exists, and is applied only by ``apply_patches`` after the version check.

What needs no patch, and why:
- the plan's rank order: the process that the plan puts at logical rank i joins the
  default process group as rank i (``megatron.hetero.distributed``), so megatron-core's
  own group construction already follows the plan;
- uneven stages: megatron-core's ``pipeline_model_parallel_layout`` takes any split;
- replicas with unequal micro-batch counts: each replica calls the 1F1B schedule with its
  own count and ``calculate_per_token_loss`` weights gradients by tokens globally.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

from hetero.errors import HeteroError

TESTED_MEGATRON_CORE = ("0.16.1",)


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    needed: Callable[[], bool]
    apply: Callable[[], object]


def _no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def _apply_cpu_device() -> object:
    from megatron.hetero.cpu_device import enable_cpu_device

    return enable_cpu_device()


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="cuda-as-cpu",
        why=(
            "megatron-core hard-codes the CUDA device (~130 sites in schedules, p2p, DDP, "
            "optimizer, RNG tracker); on a process without a GPU, 'cuda' is mapped to the CPU"
        ),
        needed=_no_gpu,
        apply=_apply_cpu_device,
    ),
)

_applied: list[str] = []


def check_megatron_core_version() -> str:
    from megatron.core.package_info import __version__

    if __version__ not in TESTED_MEGATRON_CORE:
        message = (
            f"megatron-core {__version__} is installed but Megatron-Hetero's patches were "
            f"written and tested against {', '.join(TESTED_MEGATRON_CORE)}; install "
            f"megatron-core=={TESTED_MEGATRON_CORE[-1]}"
        )
        if os.environ.get("HETERO_ALLOW_UNTESTED_MEGATRON_CORE") != "1":
            raise HeteroError(message + " (or set HETERO_ALLOW_UNTESTED_MEGATRON_CORE=1 to try)")
        warnings.warn(message)
    return __version__


def apply_patches() -> list[str]:
    """Applies the patches this process needs, once; returns their names."""
    if not _applied:
        check_megatron_core_version()
        for patch in PATCHES:
            if patch.needed():
                patch.apply()
                _applied.append(patch.name)
    return list(_applied)


def describe() -> str:
    version = check_megatron_core_version()
    lines = [f"megatron-core {version}: patches applied by megatron.hetero.patches.apply_patches()"]
    for patch in PATCHES:
        state = "applies here" if patch.needed() else "not needed here"
        lines.append(f"- {patch.name} ({state}): {patch.why}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
