"""python tests/forkrun.py NPROC [pretrain_gpt.py flags]: NPROC ranks of one job on this host,
each a forked child of this process, which imported torch and megatron-core once.

The suite's launcher for jobs that test training, not launching: every rank is still its
own process in a real gloo job over 127.0.0.1, but the ~4 s of imports is paid once per
job instead of once per rank (and no torchrun agent starts). Tests of launching, signals
and launcher faults use torchrun itself. As torchrun: RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT per rank; when a rank fails the others get SIGTERM after a grace period;
the exit code is the first failure's. Children die with this process (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import signal
import socket
import sys
import time
import traceback

GRACE_S = 30.0  # what a failed rank's peers get to stop by themselves (the watchdog's bound)


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(rank: int, nproc: int, port: int, argv: list[str]) -> None:
    _die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from megatron.hetero.pretrain import main

    try:  # the child must never return into the parent's loop: it ends here, as python would
        code = main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> int:
    nproc, argv = int(sys.argv[1]), sys.argv[2:]
    import megatron.hetero.pretrain  # noqa: F401  (what every rank would import)
    import megatron.hetero.training  # noqa: F401

    gc.freeze()  # the children inherit these objects; no collection walks them again
    port = _free_port()
    children = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, nproc, port, argv)
        children[pid] = rank
    exit_code, failed_at = 0, None
    while children:
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for pid in children:
                os.kill(pid, signal.SIGTERM)
            failed_at = float("inf")
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and exit_code == 0:
            exit_code = code if code > 0 else 128 - code
            failed_at = time.monotonic()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
