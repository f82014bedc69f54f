"""A yes or no that every rank answers alike: one scalar all-reduce over the job (or a group),
on the compute device, since NCCL reduces GPU tensors only. Every rank must call it at the
same point, as any collective."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.hetero.identity import compute_device


def any_rank(yes: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True when some rank says yes."""
    return _reduced(yes, dist.ReduceOp.MAX, group)


def every_rank(yes: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True when every rank says yes."""
    return _reduced(yes, dist.ReduceOp.MIN, group)


def _reduced(yes: bool, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> bool:
    flag = torch.tensor([1 if yes else 0], dtype=torch.int32, device=compute_device())
    dist.all_reduce(flag, op=op, group=group)
    return bool(flag.item())
