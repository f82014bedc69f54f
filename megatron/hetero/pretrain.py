"""pretrain_gpt.py's body: the start-up steps of ``startup``, then the run.

Everything that can be decided from the command line, the plan file and the launch is
checked first (``startup.configure``), before megatron-core is patched or any process group
exists, so a bad launch fails within seconds, with every problem in one message, and
identically on every rank.

Exit codes (docs/faults.md): 0 done, 1 a lost rank or a crash, 2 bad input, 128 + N the
rank that received stop signal N.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Sequence

from hetero import env
from hetero.errors import HeteroError
from hetero.launch.inprocess import (CONTROL_DIR, REJOIN, launch_environment, place, report_ready,
                                     wait_for_rejoin)
from megatron.hetero import startup
from megatron.hetero.distributed import Launch, node_leader_error, read_launch, wait_for_peers_to_fail
from megatron.hetero.log import error

BAD_INPUT = 2
JOIN_TIMEOUT_S = 600  # a returned node's processes wait this long for the running job's re-plan


def main(argv: Sequence[str]) -> int:
    """Returns the process exit code: 0, or 2 for bad input (reported on every rank)."""
    try:
        argv = _join_running_job(argv)
        if argv is None:
            return 0
        launch = read_launch()
    except HeteroError as err:  # a launch variable is malformed: no rank to name yet
        print(f"error: {err}", file=sys.stderr, flush=True)
        return BAD_INPUT
    startup.prepare_process(launch.rank)                              # 1. the process
    try:
        job = startup.configure(argv, launch.world_size, launch)      # 2. flags, plan, launch
    except HeteroError as err:
        # Every rank found the same problems: each node's first rank prints them, the
        # others only an error of their own.
        if node_leader_error(launch, str(err)) != str(err):
            error(launch.rank, str(err))
        return _stop_on_bad_input(launch)
    try:
        from megatron.hetero.training import run  # imports megatron-core: after the checks

        run(job.args, job.plan, job.plan_source, launch, argv)        # 3-6 (startup), training
    except HeteroError as err:
        error(launch.rank, str(err))
        return _stop_on_bad_input(launch)
    return 0


def _join_running_job(argv: Sequence[str]) -> list[str] | None:
    """A returned node's process (HETERO_REJOIN=epoch, started by the job's supervisor): set
    up first, then say so and wait for the job's re-plan, which gives this process its launch
    variables and the plan (hetero/launch/recovery.py). None: the re-plan left it out."""
    epoch = env.get(REJOIN)
    if epoch is None:
        return list(argv)
    from megatron.hetero import training  # noqa: F401  (imports megatron-core before the job waits)

    control_dir = env.get(CONTROL_DIR)
    if not control_dir:
        raise HeteroError(f"{REJOIN} is set without {CONTROL_DIR}: a process joins a running job only when "
                          "the job's supervisor starts it")
    where = place(env.host(), env.local_rank())
    report_ready(control_dir, int(epoch), where, {"joining": True})
    rejoin = wait_for_rejoin(control_dir, int(epoch), timeout_s=JOIN_TIMEOUT_S)
    variables = launch_environment(rejoin, where)
    if variables is None:
        print(f"[{where}] the job's re-plan (epoch {epoch}) leaves this returned process out; it ends", flush=True)
        return None
    os.environ.update(variables)
    from megatron.hetero.training.run import _with_plan

    return _with_plan(argv, rejoin.plan)


def _stop_on_bad_input(launch: Launch) -> int:
    _tell_torchrun(launch)
    wait_for_peers_to_fail(launch)
    return BAD_INPUT


def _tell_torchrun(launch: Launch) -> None:
    """torchrun's failure summary shows a worker's error file in place of "To enable
    traceback see: ...": point it at the message printed above (torchrun still prints its
    own traceback; ``python -m megatron.hetero.launcher`` is torchrun without it)."""
    path = env.get(env.TORCHELASTIC_ERROR_FILE)
    if path is None:
        return
    leader = launch.rank - launch.local_rank
    note = (f"bad input (exit code {BAD_INPUT}), not a crash: the problems and their fixes are printed "
            f"above as '[launch rank {leader}] error: ...'")
    try:
        with open(path, "w") as handle:
            # The format of torch's own error handler: the summary shows "py_callstack".
            json.dump({"message": {"message": note, "extraInfo": {"py_callstack": note,
                                                                  "timestamp": str(int(time.time()))}}}, handle)
    except OSError:  # only torchrun's summary loses the pointer
        pass
