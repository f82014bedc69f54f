"""CPU quotas (cgroup v1 cpu controller) that make a rank as slow as its device type.

A rank joins its cgroup itself before it starts the training script (rank_entry.py), so
every thread it creates - gloo's included - counts against the quota.

Each rank also has a host cgroup beside it, an ordinary process's weight and no quota (it
runs when the devices leave a core free, never in their time): the work a GPU's
host does while the GPU computes (a snapshot's copy to host memory and its messages to
other nodes: DMA engines, the CPU and the NIC, not the device's cores) runs there on the
emulator (megatron.hetero.cpu_device.host_work moves a thread in and out), so that it is not
charged to the emulated device's speed.
"""

from __future__ import annotations

import errno
import math
import os
import time
from pathlib import Path

from hetero.errors import HeteroError

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
# A rank over its quota waits for the next period: a message to a throttled peer (a tensor-
# parallel all-reduce, a dozen per micro-batch) waits up to a period minus the quota. The
# kernel's 100 ms default added tens of milliseconds to each; at 10 ms a quarter-speed
# tensor-parallel pair still ran its layers 16-25% slower in training than in its profile
# (the partners' throttled phases fall differently), at 5 ms 8-16%. The period is the
# shortest at which every quota stays at the kernel's floor of 1 ms or more, within these.
SHORTEST_PERIOD_US, LONGEST_PERIOD_US = 5_000, 10_000
MIN_QUOTA_US = 1_000
# A rank's claim on the CPU beside the machine's other processes (cgroup v1 cpu.shares; a
# process outside the ranks' cgroups weighs 1024). A device is its job's alone, so its
# rank should get the whole of its quota even on a busy machine: at the kernel's default
# 1024 each rank weighed no more than any one other process, and on a machine shared with
# other work (load 8-20 on 2 cores) the ranks got a fraction of their quotas, varying from
# run to run. The quota still caps each rank. 0 keeps the kernel's default.
DEFAULT_CPU_SHARES = 262_144
REMOVE_WAIT_S = 10.0  # for killed ranks to finish exiting


def missing_prerequisites() -> list[str]:
    if not (CPU_CGROUP / "cgroup.procs").exists():
        return [f"no cgroup v1 cpu controller at {CPU_CGROUP} (CPU quotas cannot be set)"]
    if not os.access(CPU_CGROUP, os.W_OK):
        return [f"{CPU_CGROUP} is not writable (CPU quotas need root)"]
    return []


def period_us(fractions: list[float]) -> int:
    """The CFS period for ranks of these core fractions (see SHORTEST_PERIOD_US)."""
    floor = math.ceil(MIN_QUOTA_US / min(fractions)) if fractions else SHORTEST_PERIOD_US
    return min(LONGEST_PERIOD_US, max(SHORTEST_PERIOD_US, floor))


class CpuQuotas:
    """One cgroup per rank, named hetero-<run id>-r<launch rank>; removed on exit."""

    def __init__(self, run_id: int, fractions: list[float], shares: int = DEFAULT_CPU_SHARES):
        self.run_id = run_id
        self.fractions = fractions
        self.shares = shares
        self.period_us = period_us(fractions)
        self.paths: list[Path] = []

    def path(self, launch_rank: int) -> Path:
        return CPU_CGROUP / f"hetero-{self.run_id}-r{launch_rank}"

    def host_path(self, launch_rank: int) -> Path:
        """The rank's host cgroup (module docstring): no quota, the kernel's weight."""
        return CPU_CGROUP / f"hetero-{self.run_id}-r{launch_rank}-host"

    def __enter__(self) -> "CpuQuotas":
        try:
            for rank, fraction in enumerate(self.fractions):
                path = self.path(rank)
                path.mkdir()
                self.paths.append(path)
                quota = max(MIN_QUOTA_US, int(fraction * self.period_us))
                (path / "cpu.cfs_period_us").write_text(str(self.period_us))
                (path / "cpu.cfs_quota_us").write_text(str(quota))
                if self.shares:
                    (path / "cpu.shares").write_text(str(self.shares))
                self.host_path(rank).mkdir()  # the kernel's weight: below every device's
                self.paths.append(self.host_path(rank))
        except OSError as err:
            self.remove()
            raise HeteroError(f"emulator: cannot create CPU cgroups under {CPU_CGROUP}: {err}") from None
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        root_tasks = CPU_CGROUP / "tasks"
        deadline = time.monotonic() + REMOVE_WAIT_S
        for path in reversed(self.paths):
            while True:
                try:
                    # Thread by thread: a host cgroup holds single threads of a rank.
                    for tid in (path / "tasks").read_text().split():
                        try:
                            root_tasks.write_text(tid)
                        except OSError:  # exited meanwhile
                            pass
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as err:
                    # EBUSY while a SIGKILLed rank's children are still exiting: they
                    # cannot be moved out, and the cgroup stayed behind after Ctrl-C.
                    if err.errno != errno.EBUSY or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
        self.paths.clear()


def join(cgroup: str | os.PathLike) -> None:
    """Moves the calling process into the cgroup (its future threads and children follow)."""
    (Path(cgroup) / "cgroup.procs").write_text(str(os.getpid()))
