"""Builds the backend of one process group: vendors from the store, then the inner groups.

torch calls ``create_backend`` on every member of a new group (the default group and each
``new_group``). The members publish their vendor in the group's store and read each
other's, so every member reaches the same layout without a collective:

- all members on one vendor: on a machine without GPUs, plain ``ProcessGroupGloo`` is
  returned (exactly what ``backend="gloo"`` builds: no overhead at all); with GPUs, the C++
  backend in pass-through mode, forwarding each call to NCCL/RCCL (CUDA tensors) or gloo
  (CPU tensors);
- several vendors: the C++ backend over an inner gloo group (and an NCCL/RCCL one with
  GPUs) per vendor, a gloo bridge among the vendor leaders and a whole-group gloo backend.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from hetero import env
from hetero_comm.vendor import get_vendor

DEFAULT_CHUNK_BYTES = env.DEFAULT_COMM_CHUNK_BYTES

# group name -> what create_backend decided, for describe()
_layouts: dict[str, dict] = {}


def chunk_bytes() -> int:
    """Pipeline chunk of the cross-vendor collectives: HETERO_COMM_CHUNK_BYTES (default 4 MiB)."""
    return env.comm_chunk_bytes()


def _wrap_single_vendor() -> bool:
    """HETERO_COMM_WRAP_SINGLE_VENDOR=1: one-vendor groups get the C++ pass-through backend
    even without GPUs (to test it, or to measure its overhead against plain gloo)."""
    return env.comm_wrap_single_vendor()


def load_extension():
    try:
        from hetero_comm import _comm_ext
    except ImportError as err:
        raise ImportError(
            "hetero_comm needs the C++ extension hetero_comm._comm_ext, which is not built "
            f"({err}); build it with `pip install --no-build-isolation -e .` in the "
            "Megatron-Hetero checkout (`make setup` does this)"
        ) from err
    return _comm_ext


def exchange_vendors(store: dist.Store, rank: int, size: int, timeout: timedelta) -> list[str]:
    """Every member writes its vendor under its group rank and reads everyone's."""
    vendors = dist.PrefixStore("vendor/", store)
    vendors.set(str(rank), get_vendor())
    keys = [str(r) for r in range(size)]
    vendors.wait(keys, timeout)
    return [v.decode() for v in vendors.multi_get(keys)]


def number_vendors(vendors: list[str]) -> list[int]:
    """Vendor names -> 0, 1, ... in order of first appearance (the C++ layout's numbering)."""
    numbers: dict[str, int] = {}
    return [numbers.setdefault(v, len(numbers)) for v in vendors]


def _gloo(store, prefix, rank, size, timeout, global_ranks, group_name):
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)
    pg.options.global_ranks_in_group = global_ranks
    pg.options.group_name = group_name
    return pg


def _nccl(store, prefix, rank, size, timeout, global_ranks, group_name):
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    options.global_ranks_in_group = global_ranks
    options.group_name = group_name
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, options)


def create_backend(opts, backend_options=None):
    """The creator registered with torch.distributed (extended API). backend_options
    (``pg_options`` of new_group) are not used: the inner groups get default options."""
    store, rank, size, timeout = opts.store, opts.group_rank, opts.group_size, opts.timeout
    group_name = opts.group_id
    global_ranks = list(opts.global_ranks_in_group) or list(range(size))
    own = dist.PrefixStore("hetero/", store)
    vendors = exchange_vendors(own, rank, size, timeout)
    numbers = number_vendors(vendors)
    mixed = max(numbers) > 0
    ext = load_extension()
    on_gpu = torch.cuda.is_available() and ext.built_with_cuda()
    _layouts[group_name] = {"vendors": vendors, "global_ranks": global_ranks}

    if not mixed and not on_gpu and not _wrap_single_vendor():
        _layouts[group_name]["mode"] = "native"
        pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        pg.options.global_ranks_in_group = global_ranks
        pg.options.group_name = group_name
        pg._set_sequence_number_for_group()
        return pg

    me = numbers[rank]
    members = [r for r in range(size) if numbers[r] == me]
    local_rank, local_size = members.index(rank), len(members)
    member_ranks = [global_ranks[r] for r in members]
    host_intra = device_intra = bridge = full = None
    # Creation order (own vendor, bridge, whole group) is the same on every member.
    if local_size > 1 or not mixed:
        args = (own, f"intra/{me}/", local_rank, local_size, timeout, member_ranks,
                f"{group_name}:hetero-{vendors[rank]}")
        host_intra = _gloo(*args)
        if on_gpu:
            device_intra = _nccl(*args)
    if mixed:
        leaders = [numbers.index(v) for v in range(max(numbers) + 1)]
        if rank in leaders:
            bridge = _gloo(own, "bridge/", me, len(leaders), timeout,
                           [global_ranks[r] for r in leaders], f"{group_name}:hetero-bridge")
        full = _gloo(own, "full/", rank, size, timeout, global_ranks, f"{group_name}:hetero-full")
    _layouts[group_name]["mode"] = "hierarchical" if mixed else "pass-through"
    return ext.HeteroBackend(rank, size, numbers, host_intra, device_intra, bridge, full,
                             chunk_bytes())


def describe(group=None) -> dict:
    """How the hetero backend runs ``group`` (default: the world): its mode ("native",
    "pass-through" or "hierarchical"), every member's vendor and the chunk size."""
    group = group or dist.group.WORLD
    name = group.group_name
    if name not in _layouts:
        raise ValueError(f"process group {name!r} was not created by the hetero backend")
    info = dict(_layouts[name])
    backend = group._get_backend(torch.device("cpu"))
    info["chunk_bytes"] = getattr(backend, "chunk_bytes", None)
    return info
