"""This process's identity in the job, decided once at start-up: its launch rank, the logical
rank the plan gives it, its coordinates in the plan's rank grid (template, replica, stage,
tensor and context rank), its compute device and its vendor.

``distributed.initialize`` builds it (after the launch is checked and the process groups
exist) and publishes it with ``set_this_rank``; everything afterwards asks ``this_rank()``
(or, before start-up or outside a job, ``compute_device()``) instead of working it out again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero.env import Launch
from hetero.grid import RankCoords


def compute_device() -> torch.device:
    """The device this process computes on: the CUDA (or ROCm) device start-up selected, else
    the CPU. The one place that decides it."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class RankIdentity:
    """Who this process is (module docstring)."""

    launch: Launch
    logical_rank: int
    coords: RankCoords
    device: torch.device
    vendor: str

    @property
    def template(self) -> int:
        return self.coords.template

    @property
    def replica(self) -> int:
        """This rank's replica, counted over every template (the plan's ``replicas`` index)."""
        return self.coords.dp_rank

    @property
    def stage(self) -> int:
        """Its pipeline stage within its template."""
        return self.coords.pp_rank


_this_rank: RankIdentity | None = None


def set_this_rank(identity: RankIdentity | None) -> None:
    global _this_rank
    _this_rank = identity


def this_rank() -> RankIdentity:
    """This process's identity (after start-up's process groups)."""
    if _this_rank is None:
        raise RuntimeError("this_rank() before distributed.initialize(): the identity is built at start-up")
    return _this_rank
