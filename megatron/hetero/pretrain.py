"""pretrain_gpt.py's body: the start-up steps of ``startup``, then the run.

Everything that can be decided from the command line and the plan file is checked first
(``startup.configure``), before megatron-core is imported or any process group exists, so
a bad launch fails within seconds and identically on every rank.
"""

from __future__ import annotations

import sys
from typing import Sequence

from hetero.errors import HeteroError
from megatron.hetero import startup
from megatron.hetero.distributed import read_launch, wait_for_peers_to_fail
from megatron.hetero.log import error


def main(argv: Sequence[str]) -> int:
    """Returns the process exit code: 0, or 2 for bad input (reported on every rank)."""
    try:
        launch = read_launch()
    except HeteroError as err:  # a launch variable is malformed: no rank to name yet
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    startup.prepare_process(launch.rank)                              # 1. the process
    try:
        job = startup.configure(argv, launch.world_size)              # 2. flags and plan
        from megatron.hetero.training import run  # imports megatron-core: after the checks

        run(job.args, job.plan, job.plan_source, launch)              # 3-6 (startup), training
    except HeteroError as err:
        error(launch.rank, str(err))
        wait_for_peers_to_fail(launch)
        return 2
    return 0
