"""Megatron-Hetero's environment: every variable it reads, what it means and how it is parsed.

Nothing else reads ``os.environ`` for these names; it asks here. Three kinds:

- the launch, as torchrun sets it: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE`` (``launch()``), ``TORCHELASTIC_RUN_ID`` (``under_torchrun_agent()``);
- one entry per local rank: ``HETERO_DEVICE``, ``HETERO_VENDOR``,
  ``HETERO_EMULATOR_CGROUPS``, ``HETERO_EMULATOR_CPUS``. torchrun gives every local rank of
  a node the same environment, so a node-wide value is one entry (every local rank's) or a
  comma-separated list indexed by ``LOCAL_RANK`` (``per_local_rank()``);
- settings: the rest of ``VARIABLES``.

Every function reads the environment when called, never at import: a process forked from
one that imported this module (the test suite's job server) has an environment of its own.
A bad value is an ``EnvError`` naming the variable, the value and the fix.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping, Sequence

from hetero.errors import HeteroError

# ----- names --------------------------------------------------------------------------------

# torchrun's
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
OMP_NUM_THREADS = "OMP_NUM_THREADS"

# Megatron-Hetero's
DEVICE = "HETERO_DEVICE"
VENDOR = "HETERO_VENDOR"
EMULATED_HOST = "HETERO_EMULATED_HOST"
EMULATOR_CGROUPS = "HETERO_EMULATOR_CGROUPS"
EMULATOR_HOST_CGROUPS = "HETERO_EMULATOR_HOST_CGROUPS"
EMULATOR_CPUS = "HETERO_EMULATOR_CPUS"
CPU_KEEP_FREED_MEMORY = "HETERO_CPU_KEEP_FREED_MEMORY"
TRACE_DIR = "HETERO_TRACE_DIR"
TRACE_ITERATION = "HETERO_TRACE_ITERATION"
EVENTS_DIR = "HETERO_EVENTS_DIR"
COMM_CHUNK_BYTES = "HETERO_COMM_CHUNK_BYTES"
COMM_WRAP_SINGLE_VENDOR = "HETERO_COMM_WRAP_SINGLE_VENDOR"
ALLOW_UNTESTED_MEGATRON_CORE = "HETERO_ALLOW_UNTESTED_MEGATRON_CORE"
PEER_TIMEOUT_S = "HETERO_PEER_TIMEOUT_S"
FAULT_SAVE_PAUSE_S = "HETERO_FAULT_SAVE_PAUSE_S"

VARIABLES: dict[str, str] = {
    RANK: "this process's launch rank (torchrun)",
    WORLD_SIZE: "processes in the job (torchrun)",
    LOCAL_RANK: "this process's rank on its node (torchrun; default 0)",
    LOCAL_WORLD_SIZE: "processes on this node (torchrun)",
    MASTER_ADDR: "the rendezvous host (torchrun)",
    MASTER_PORT: "the rendezvous port (torchrun)",
    TORCHELASTIC_RUN_ID: "set for workers of torchrun's agent: they have a launcher to lose",
    TORCHELASTIC_ERROR_FILE: "where torchrun's agent reads a failed worker's error (its failure summary shows it)",
    OMP_NUM_THREADS: "CPU threads of one process (the profilers follow it)",
    DEVICE: "the device type this process stands in for (emulation), per local rank",
    VENDOR: "this process's vendor for --distributed-backend hetero, per local rank",
    EMULATED_HOST: "the host the job knows this process by (set by tools/emulator)",
    EMULATOR_CGROUPS: "the CPU-quota cgroup each local rank joins (set by tools/emulator)",
    EMULATOR_HOST_CGROUPS: "the cgroup without quota for each local rank's host-side work (set by tools/emulator)",
    EMULATOR_CPUS: "the core each local rank is pinned to (set by tools/emulator)",
    CPU_KEEP_FREED_MEMORY: "1: CPU ranks keep freed memory for reuse as a GPU's allocator does; "
                           "0 (default): it goes back to the OS",
    TRACE_DIR: "record one iteration's timeline of every rank there (megatron.hetero.tracing)",
    TRACE_ITERATION: "the iteration HETERO_TRACE_DIR records (default 3)",
    EVENTS_DIR: "every process appends its structured events (hetero.events) to a file there",
    COMM_CHUNK_BYTES: "pipeline chunk of the hetero backend's cross-vendor collectives (default 4 MiB)",
    COMM_WRAP_SINGLE_VENDOR: "1: one-vendor groups run on the hetero backend's C++ pass-through "
                             "even without GPUs (tests, overhead benchmarks)",
    ALLOW_UNTESTED_MEGATRON_CORE: "1: run on a megatron-core version the patches were not tested with",
    PEER_TIMEOUT_S: "seconds without a heartbeat before the watchdog takes a neighbour rank "
                    "(or the rendezvous store) for lost (default 10)",
    FAULT_SAVE_PAUSE_S: "fault drills: every rank pauses this long inside each checkpoint write, after "
                        "writing its files and before the write is complete (a node lost there is lost "
                        "during a checkpoint write)",
}

DEFAULT_TRACE_ITERATION = 3
DEFAULT_COMM_CHUNK_BYTES = 4 << 20
DEFAULT_PEER_TIMEOUT_S = 10

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(HeteroError):
    """An environment variable set to a value it cannot have."""


# ----- parsing --------------------------------------------------------------------------------


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, stripped; None when unset or blank."""
    value = _environ(environ).get(name, "").strip()
    return value or None


def flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """An on/off variable: 1/true/yes/on or 0/false/no/off; unset or blank: default."""
    value = get(name, environ)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise EnvError(f"{name}={value!r} is neither on nor off; set {name}=1 or {name}=0 "
                   f"(or unset it: {'on' if default else 'off'})")


def integer(name: str, default: int | None = None, minimum: int | None = None,
            environ: Mapping[str, str] | None = None, what: str = "a whole number") -> int | None:
    """A whole-number variable, at least minimum; unset or blank: default."""
    value = get(name, environ)
    if value is None:
        return default
    try:
        parsed = int(value)
    except ValueError:
        parsed = None
    if parsed is None or (minimum is not None and parsed < minimum):
        bound = f" of at least {minimum}" if minimum is not None else ""
        raise EnvError(f"{name}={value!r}: give {what}{bound}, e.g. {name}={default or minimum or 1}")
    return parsed


def entries(name: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """Every entry of a comma-separated variable ([] when unset)."""
    value = get(name, environ)
    if value is None:
        return []
    listed = [v.strip() for v in value.split(",")]
    if not all(listed):
        raise EnvError(f"{name}={value!r} has an empty entry; give one entry per local rank, "
                       f"comma-separated (e.g. {name}=a,b), or one for all")
    return listed


def per_local_rank(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """This process's entry of a per-local-rank variable: the only entry, or the LOCAL_RANK-th
    of a list of one per local rank; None when unset."""
    listed = entries(name, environ)
    if len(listed) <= 1:
        return listed[0] if listed else None
    local = local_rank(environ)
    local_size = integer(LOCAL_WORLD_SIZE, None, 1, environ)
    if local >= len(listed) or (local_size is not None and local_size != len(listed)):
        size = f"{local_size} local ranks (LOCAL_WORLD_SIZE)" if local_size is not None else \
            f"LOCAL_RANK {local}"
        raise EnvError(f"{name}={get(name, environ)} lists {len(listed)} entries but this node has "
                       f"{size}; give one entry per local rank (torchrun's --nproc-per-node), "
                       "or one for all of them")
    return listed[local]


def per_local_rank_value(values: Sequence[str], name: str = "a per-local-rank variable") -> str:
    """The value of a per-local-rank variable that gives local rank i values[i]."""
    bad = [v for v in values if not v.strip() or "," in v]
    if bad or not values:
        raise EnvError(f"{name}: entries are non-empty names without commas, got {list(values)!r}")
    return ",".join(v.strip() for v in values)


# ----- which process am I ---------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """What the launcher (torchrun) told this process."""

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int | None = None  # None: the launcher did not say


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    return integer(LOCAL_RANK, 0, 0, environ, "this process's rank on its node")


def launch(environ: Mapping[str, str] | None = None) -> Launch | None:
    """This process's place in the job as the launcher set it; None without RANK (a bare
    ``python``, a world of one to be made up by the caller)."""
    if get(RANK, environ) is None:
        return None
    rank = integer(RANK, None, 0, environ, "this process's launch rank")
    if get(WORLD_SIZE, environ) is None:
        raise EnvError(f"RANK={rank} is set but WORLD_SIZE is not; launch with torchrun, which sets "
                       "both, or set WORLD_SIZE to the number of processes")
    world_size = integer(WORLD_SIZE, None, 1, environ, "the number of processes")
    if rank >= world_size:
        raise EnvError(f"RANK={rank} is outside WORLD_SIZE={world_size} (ranks 0..{world_size - 1}); "
                       "launch with torchrun, or fix the two variables")
    local = local_rank(environ)
    local_size = integer(LOCAL_WORLD_SIZE, None, 1, environ, "the number of processes on this node")
    if local_size is not None and local >= local_size:
        raise EnvError(f"LOCAL_RANK={local} is outside LOCAL_WORLD_SIZE={local_size}; launch with "
                       "torchrun, or fix the two variables")
    return Launch(rank, world_size, local, local_size)


def unused_port(host: str = "127.0.0.1") -> int:
    """A TCP port for a job's store (MASTER_PORT) that nothing on `host` holds now.

    Chosen at random below the kernel's ephemeral range, never by binding port 0: that
    port is an ephemeral one, which any process's outgoing connection (gloo opens many) may
    take between our check and the store's listen, and the store then fails with
    EADDRINUSE. Random, so two jobs started at once rarely try the same one.
    """
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default start
    first = 10000 if low > 12000 else 1024
    for port in random.sample(range(first, max(low, first + 1)), k=min(200, max(low - first, 1))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise HeteroError(f"no TCP port free on {host} in {first}-{low - 1} for the job's store; "
                      f"set {MASTER_PORT} to a port that is free")


def launch_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's launch rank (0 for a process outside a launch)."""
    found = launch(environ)
    return found.rank if found else 0


def under_torchrun_agent(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun's agent started this process (a worker with a launcher to lose)."""
    return TORCHELASTIC_RUN_ID in _environ(environ)


def device(environ: Mapping[str, str] | None = None) -> str | None:
    """The device type this process stands in for (HETERO_DEVICE), None when not emulating."""
    return per_local_rank(DEVICE, environ)


def vendor(environ: Mapping[str, str] | None = None) -> str | None:
    """This process's vendor as HETERO_VENDOR gives it (lower case), None when not given."""
    found = per_local_rank(VENDOR, environ)
    return found.lower() if found else None


def emulated_host(environ: Mapping[str, str] | None = None) -> str | None:
    return get(EMULATED_HOST, environ)


def host(environ: Mapping[str, str] | None = None) -> str:
    """The host the job knows this process by: an emulated node's name, else the machine's."""
    return emulated_host(environ) or socket.gethostname()


def emulator_cgroup(environ: Mapping[str, str] | None = None) -> str | None:
    """The cgroup directory this local rank joins on an emulated node."""
    return per_local_rank(EMULATOR_CGROUPS, environ)


def emulator_host_cgroup(environ: Mapping[str, str] | None = None) -> str | None:
    """The cgroup this local rank's host-side work runs in on an emulated node (no quota)."""
    return per_local_rank(EMULATOR_HOST_CGROUPS, environ)


def emulator_cpu(environ: Mapping[str, str] | None = None) -> int | None:
    """The core this local rank is pinned to on an emulated node."""
    value = per_local_rank(EMULATOR_CPUS, environ)
    if value is None:
        return None
    if not value.isdigit():
        raise EnvError(f"{EMULATOR_CPUS}={get(EMULATOR_CPUS, environ)}: entries are core numbers "
                       "(tools/emulator sets this variable; unset it to run without pinning)")
    return int(value)


@dataclass(frozen=True)
class Process:
    """Which process this is, all the environment says of it."""

    launch: Launch | None
    host: str
    device: str | None  # stands in for this device type (None: the real one)
    vendor: str | None


def this_process(environ: Mapping[str, str] | None = None) -> Process:
    return Process(launch(environ), host(environ), device(environ), vendor(environ))


# ----- settings -------------------------------------------------------------------------------


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    return flag(CPU_KEEP_FREED_MEMORY, False, environ)


def trace_dir(environ: Mapping[str, str] | None = None) -> str | None:
    return get(TRACE_DIR, environ)


def trace_iteration(environ: Mapping[str, str] | None = None) -> int:
    return integer(TRACE_ITERATION, DEFAULT_TRACE_ITERATION, 1, environ, "an iteration number")


def events_dir(environ: Mapping[str, str] | None = None) -> str | None:
    return get(EVENTS_DIR, environ)


def comm_chunk_bytes(environ: Mapping[str, str] | None = None) -> int:
    return integer(COMM_CHUNK_BYTES, DEFAULT_COMM_CHUNK_BYTES, 1, environ, "a number of bytes")


def comm_wrap_single_vendor(environ: Mapping[str, str] | None = None) -> bool:
    return flag(COMM_WRAP_SINGLE_VENDOR, False, environ)


def allow_untested_megatron_core(environ: Mapping[str, str] | None = None) -> bool:
    return flag(ALLOW_UNTESTED_MEGATRON_CORE, False, environ)


def fault_save_pause_s(environ: Mapping[str, str] | None = None) -> float:
    value = get(FAULT_SAVE_PAUSE_S, environ)
    try:
        return float(value) if value else 0.0
    except ValueError:
        raise EnvError(f"{FAULT_SAVE_PAUSE_S}={value!r}: give seconds (a number), or unset it") from None


def peer_timeout_s(environ: Mapping[str, str] | None = None) -> int:
    # At least 2 heartbeats (1 s apart) must be missed: a shorter bound would take a busy
    # but healthy rank for dead.
    return integer(PEER_TIMEOUT_S, DEFAULT_PEER_TIMEOUT_S, 2, environ, "a number of seconds")


def omp_num_threads(environ: Mapping[str, str] | None = None) -> int | None:
    return integer(OMP_NUM_THREADS, None, 1, environ, "a number of threads")
