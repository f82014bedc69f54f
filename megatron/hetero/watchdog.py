"""When a process of the job dies, every survivor says which one, where to resume, and stops.

Each rank records its host and pid in the rendezvous store and writes a heartbeat every
second from a thread of its own. The same thread watches the ranks this one exchanges
data with (its tensor-parallel group, pipeline neighbours and data-parallel neighbours):
a neighbour whose process is gone (same host) or whose heartbeat stopped is a death. It
also receives the launcher's SIGTERM (torchrun stops all workers once one failed), even
while the main thread is stuck in a collective that will never finish.

Then, once per process: find every lost rank, print which (launch rank, logical rank,
host, pid) and the last complete checkpoint, and exit. The main thread takes the same
path when its communication library reports the death first (a peer's socket closed, a
collective timed out after --distributed-timeout-minutes).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from hetero.plan import Plan
from megatron.hetero.log import error

HEARTBEAT_S = 1.0
PEER_TIMEOUT_S = 10.0
"""A neighbour silent this long is taken for dead (its heartbeat is independent of how
long collectives or checkpoints take)."""
EXIT_CODE = 1


class Watchdog:
    def __init__(self, store: dist.Store, launch_rank: int, plan: Plan,
                 resume_hint: Callable[[], str] = lambda: ""):
        self.store = dist.PrefixStore("hetero/watchdog", store)
        self.launch_rank, self.plan = launch_rank, plan
        self.resume_hint = resume_hint
        self.host = socket.gethostname()
        self.neighbours = neighbours(plan, launch_rank)
        self._stop = threading.Event()
        self._handling = threading.Lock()
        self._wakeup: socket.socket | None = None

    # ----- lifecycle ----------------------------------------------------------------------

    def start(self) -> "Watchdog":
        self.store.set(f"where/{self.launch_rank}", f"{self.host} {os.getpid()}")
        self.store.set(f"done/{self.launch_rank}", "0")
        self._beat()
        if threading.current_thread() is threading.main_thread():
            # SIGTERM reaches the watching thread through this socket even while the main
            # thread waits inside a collective; the Python-level handler does nothing.
            receive, send = socket.socketpair()
            send.setblocking(False)
            signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
            signal.signal(signal.SIGTERM, lambda signum, frame: None)
            self._wakeup, self._wakeup_send = receive, send
        threading.Thread(target=self._run, name="hetero-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def finish(self) -> None:
        """This rank ends normally: its exit is not a failure to its neighbours."""
        self.stop()
        self._mark("finished")

    def _mark(self, state: str) -> None:
        try:
            self.store.set(f"done/{self.launch_rank}", state)
        except Exception:
            pass

    # ----- the watching thread ------------------------------------------------------------

    def _beat(self) -> None:
        self.store.set(f"alive/{self.launch_rank}", repr(time.time()))

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wakeup is not None:
                ready, _, _ = select.select([self._wakeup], [], [], HEARTBEAT_S)
                if ready and signal.SIGTERM in self._wakeup.recv(64):
                    self.handle("the launcher sent SIGTERM", sigterm=True)
            else:
                time.sleep(HEARTBEAT_S)
            if self._stop.is_set():
                return
            try:
                self._beat()
                lost = self._find_lost(self.neighbours)
            except Exception:  # the store is gone: the launcher is tearing the job down
                return
            if lost:
                self.handle("a neighbour stopped answering")

    # ----- reporting (either thread) ------------------------------------------------------------

    def handle(self, cause: str, sigterm: bool = False) -> None:
        """Reports lost ranks and ends the process; returns only if none is lost (and this
        was no SIGTERM), so that the caller can raise its own error. Whichever thread
        comes first reports; the other waits for the exit."""
        if not self._handling.acquire(blocking=False):
            while True:
                time.sleep(60)
        self.stop()
        lost = self._settle()
        if lost:
            error(self.launch_rank, f"the job lost {'; '.join(lost)}. This process stops too "
                                    f"({cause}).{self.resume_hint()}")
            self._mark("stopped")  # our own exit is not news to the other survivors
            os._exit(EXIT_CODE)
        if sigterm:
            error(self.launch_rank, f"stopped by SIGTERM; no process of the job was lost.{self.resume_hint()}")
            os._exit(128 + signal.SIGTERM)
        self._handling.release()

    def _settle(self, settle_s: float = 2.0) -> list[str]:
        """Every lost rank; waits up to settle_s for the launcher to reap dead processes."""
        deadline = time.monotonic() + settle_s
        everyone = [r for r in range(self.plan.world_size) if r != self.launch_rank]
        while True:
            try:
                lost = self._find_lost(everyone)
            except Exception:
                lost = []
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.2)

    def _find_lost(self, ranks: list[int]) -> list[str]:
        if not ranks:
            return []
        self.store.set_timeout(timedelta(seconds=5))
        keys = [f"{kind}/{r}" for kind in ("where", "alive", "done") for r in ranks]
        values = dict(zip(keys, self.store.multi_get(keys)))
        now, lost = time.time(), []
        for r in ranks:
            if values[f"done/{r}"] != b"0":  # finished, or stopped on a failure it reported
                continue
            host, pid = values[f"where/{r}"].decode().split()
            age = now - float(values[f"alive/{r}"].decode())
            gone = host == self.host and not _process_exists(int(pid))
            if gone or age > PEER_TIMEOUT_S:
                why = "its process is gone" if gone else f"no heartbeat for {age:.0f} s"
                lost.append(f"launch rank {r} (logical rank {self.plan.logical_rank(r)}, host {host}, "
                            f"pid {pid}): {why}")
        return lost


def neighbours(plan: Plan, launch_rank: int) -> list[int]:
    """Launch ranks this one exchanges data with directly."""
    me = plan.coords(plan.logical_rank(launch_rank))
    logical = set(plan.tensor_group(me.dp_rank, me.pp_rank))
    pipeline = plan.pipeline_group(me.tp_rank, me.dp_rank)
    logical.update(pipeline[max(0, me.pp_rank - 1): me.pp_rank + 2])
    data = plan.data_group(me.tp_rank, me.pp_rank)
    logical.update(data[(me.dp_rank + step) % len(data)] for step in (-1, 1))
    return sorted(plan.launch_rank(r) for r in logical if plan.launch_rank(r) != launch_rank)


def _process_exists(pid: int) -> bool:
    """Alive, and not a zombie waiting for its parent (the launcher) to reap it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: signal 0 is all we know
