"""The ``hetero`` torch.distributed backend: native libraries inside a vendor, a bridge across.

Importing this package registers the backend (devices cpu and cuda)::

    import hetero_comm
    hetero_comm.set_vendor("amd")               # optional; else HETERO_VENDOR, else detected
    dist.init_process_group(backend="hetero")   # every new_group then uses it too

A group whose members share one vendor runs on the native library (gloo on the CPU,
NCCL/RCCL on GPUs); a group spanning vendors runs hierarchical collectives (C++,
csrc/README.md). Python decides the layout (hetero_comm.creator); C++ moves the data.

Environment (parsed in hetero.env): HETERO_VENDOR (see hetero_comm.vendor),
HETERO_COMM_CHUNK_BYTES (pipeline chunk of cross-vendor collectives, default 4 MiB),
HETERO_COMM_WRAP_SINGLE_VENDOR=1 (one-vendor groups on the C++ pass-through backend even
without GPUs; for tests and overhead benchmarks).

Unlike the rest of the ``hetero`` package, this one needs torch (and the built extension).
"""

import torch.distributed as dist

from hetero_comm.creator import DEFAULT_CHUNK_BYTES, chunk_bytes, create_backend, describe, load_extension
from hetero_comm.vendor import get_vendor, set_vendor

BACKEND_NAME = "hetero"

load_extension()  # fail at import, with the build command, if the extension is missing
if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(
        BACKEND_NAME, create_backend, extended_api=True, devices=["cpu", "cuda"]
    )

__all__ = [
    "BACKEND_NAME",
    "DEFAULT_CHUNK_BYTES",
    "chunk_bytes",
    "describe",
    "get_vendor",
    "set_vendor",
]
