"""What torchrun starts inside an emulated node: join this rank's CPU cgroup, then become
the real script (exec keeps the pid, so the quota covers the whole rank).

    torchrun ... -m tools.emulator.rank_entry pretrain_gpt.py --hetero-plan ...

HETERO_EMULATOR_CGROUPS lists one cgroup directory per LOCAL_RANK (comma-separated),
HETERO_EMULATOR_CPUS the core each LOCAL_RANK is pinned to.
"""

import os
import sys

from hetero import env
from tools.emulator.cpu_quota import join


def main() -> None:
    cgroup = env.emulator_cgroup()
    if cgroup:
        join(cgroup)
    cpu = env.emulator_cpu()
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if len(sys.argv) < 2:
        sys.exit("usage: python -m tools.emulator.rank_entry SCRIPT [ARGS...]")
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


if __name__ == "__main__":
    main()
