"""Training jobs for the test suite, forked from one process that imported the runtime once.

Every rank is still its own process in a real gloo job over 127.0.0.1, running
pretrain_gpt.py's main; what changes is where the processes come from. Importing torch and
megatron-core costs ~4 s of CPU per process, more than most test jobs train, so:

- ``python tests/forkrun.py NPROC FLAGS...``: one job; its ranks are forks of this process.
- ``python tests/forkrun.py --serve SOCKET``: a server the suite starts once
  (conftest.run_pretrain); for each request (flags, process count, environment, working
  directory, output files) it forks a job leader that runs the job as above, and answers
  with the leader's pid and then its exit code.

Tests of launching, signals and launcher faults use torchrun itself. As torchrun: RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT per rank; when a rank fails the others get
SIGTERM after a grace period; the exit code is the first failure's. Ranks die with their
leader (PR_SET_PDEATHSIG); a leader is a process group of its own, to kill whole. SIGUSR1
to that group makes every process print its Python stacks to the job's stderr (what a test
that times out shows).
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import gc
import json
import os
import select
import signal
import socket
import sys
import time
import traceback

from hetero.env import unused_port

GRACE_S = 30.0  # what a failed rank's peers get to stop by themselves (the watchdog's bound)


def import_runtime() -> None:
    import megatron.hetero.pretrain  # noqa: F401  (what every rank imports)
    import megatron.hetero.training  # noqa: F401

    gc.freeze()  # forks inherit these objects; no collection walks them again


def _end_process(run) -> None:
    """Runs run() -> exit code as a process's whole life: never returns to the caller."""
    try:
        code = run()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _pretrain(argv: list[str]) -> int:
    from megatron.hetero.pretrain import main

    return main(argv)


def run_job(nproc: int, argv: list[str]) -> int:
    """The job's exit code; its ranks are forks of this process."""
    if nproc == 1:  # as `python pretrain_gpt.py`: no launcher variables
        return _pretrain(argv)
    port = unused_port()
    children = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                              LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            _end_process(lambda: _pretrain(argv))
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
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            print(f"forkrun: rank {rank} (pid {pid}) was killed by "
                  f"{signal.Signals(-code).name}", file=sys.stderr, flush=True)
        if code != 0 and exit_code == 0:
            exit_code = code if code > 0 else 128 - code
            failed_at = time.monotonic()
    return exit_code


def _lead(request: dict) -> None:
    """A job leader, just forked from the server: takes the request's world, runs the job."""
    os.setpgid(0, 0)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["pretrain_gpt.py", *request["argv"]]
    _end_process(lambda: run_job(request["nproc"], request["argv"]))


def serve(path: str) -> None:
    import_runtime()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    waiting: dict[int, socket.socket] = {}  # leader pid -> the connection that asked
    while True:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            connection, _ = listener.accept()
            request = json.loads(connection.makefile().readline())
            if request.get("stop"):
                return
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                _lead(request)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = connection
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = waiting.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:  # the test gave up on it (timeout)
                    pass
                connection.close()


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        import_runtime()
        sys.exit(run_job(int(sys.argv[1]), sys.argv[2:]))
