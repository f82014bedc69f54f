"""The job stops together: a lost process, launcher or signal ends every rank within seconds.

Each rank records its host and pid in the rendezvous store and writes a heartbeat every
second from a thread of its own. The same thread watches:
- the ranks this one exchanges data with (its tensor-parallel group, pipeline and
  data-parallel neighbours): a neighbour whose process is gone (same host) or whose
  heartbeat stopped (a frozen process, a dropped link) is lost. A frozen neighbour on this
  host is killed, so that nothing of the job is left behind;
- its launcher (torchrun's agent): a worker whose agent died is orphaned and stops;
- the store itself: unreachable for longer than a heartbeat timeout, the job is gone;
- signals. SIGTERM/SIGINT on any rank reach every rank through the store and stop the
  job at once, the signal named. With --exit-signal-handler (Megatron-LM's flag) the
  exit signal instead asks the training loop to finish its iteration, save and exit 0:
  ``exit_requested()`` is Megatron's once-per-iteration agreement over all ranks.
The thread acts even while the main thread is stuck in a collective that will never end.

Then, once per process: find every lost rank, print which (launch rank, logical rank,
host, pid) and the last complete checkpoint, record them (a LostRanks event, hetero.events:
what the elastic supervisor reads), and exit. The main thread takes the same
path when its communication library reports the death first (a peer's socket closed, a
collective timed out after --distributed-timeout-minutes).
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from hetero import env, events
from hetero.events import LostRank
from hetero.plan import Plan
from megatron.hetero.agreement import any_rank
from megatron.hetero.distributed import announce_stopped
from megatron.hetero.log import error

HEARTBEAT_S = 1.0
# After a communication error under in-process restart: a peer silent this long is lost. A
# live peer beats every HEARTBEAT_S; one whose connection closed and that stopped beating is
# gone, and its node need not be waited for until --inprocess-heartbeat-timeout (on another
# machine its pid cannot be looked up).
SILENT_AFTER_ERROR_S = 3 * HEARTBEAT_S
# ...and a peer the library's error names (its address: "Read error [10.0.0.2]:4321:
# Connection reset by peer") is lost once it missed one beat: its connection is already gone,
# and a survivor that closes its connections to re-plan publishes that first.
NAMED_SILENT_AFTER_ERROR_S = 1.5 * HEARTBEAT_S
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
EXIT_CODE = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Watchdog:
    def __init__(self, store: dist.Store, launch_rank: int, plan: Plan,
                 resume_hint: Callable[[], str] = lambda: "",
                 exit_signal: signal.Signals | None = None, recover: bool = False,
                 peer_timeout_s: float | None = None):
        """exit_signal: the signal that asks for save-and-exit (--exit-signal-handler);
        None: every stop signal stops the job at once. recover (--inprocess-restart): a lost
        rank does not end this process: it is reported, and the training loop, whose next
        collective fails, waits for the job's re-plan (restart.py)."""
        self.recover = recover
        self.recovering = False  # a lost rank was found (recover mode)
        self.job_store = store
        self.store = dist.PrefixStore("hetero/watchdog", store)
        self.launch_rank, self.plan = launch_rank, plan
        self.resume_hint = resume_hint
        self.exit_signal = exit_signal
        # A neighbour silent this long is taken for dead (its heartbeat is independent of how
        # long collectives or checkpoints take).
        self.peer_timeout_s = float(peer_timeout_s if peer_timeout_s is not None else env.peer_timeout_s())
        self.machine = socket.gethostname()  # where a pid means something
        # The host the job knows this rank by: an emulated node's name (tools/emulator) or
        # the machine's.
        self.host = env.emulated_host() or self.machine
        self.neighbours = neighbours(plan, launch_rank)
        # Only a worker of torchrun's agent has a launcher to lose; a bare `python
        # pretrain_gpt.py` belongs to whatever shell started it.
        self.launcher_pid = os.getppid() if env.under_torchrun_agent() else None
        self._exit_received = False
        self._lost: dict[int, str] = {}  # launch rank -> how it was first found lost
        # The peer addresses the communication library's error named (handle): a hint for the
        # job's supervisor when no lost rank could be found (the store's host is gone).
        self.named_peers: set[str] = set()
        self._stop = threading.Event()
        self._handling = threading.Lock()
        self._wakeup: socket.socket | None = None

    # ----- lifecycle ----------------------------------------------------------------------

    def start(self) -> "Watchdog":
        self.store.set(f"where/{self.launch_rank}", f"{self.host} {os.getpid()} {self.machine} {_own_address()}")
        self.store.set(f"done/{self.launch_rank}", "0")
        self._beat()
        if threading.current_thread() is threading.main_thread():
            # Signals reach the watching thread through this socket even while the main
            # thread waits inside a collective; the Python-level handler does nothing.
            receive, send = socket.socketpair()
            send.setblocking(False)
            signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
            for signum in {*STOP_SIGNALS, *([self.exit_signal] if self.exit_signal else [])}:
                signal.signal(signum, lambda signum, frame: None)
            self._wakeup, self._wakeup_send = receive, send
        threading.Thread(target=self._run, name="hetero-watchdog", daemon=True).start()
        return self

    def exit_requested(self) -> bool:
        """Whether any rank received the exit signal: the same answer on every rank (a
        collective over the world, as Megatron-LM's signal handler), so all of them
        finish the same iteration and save it together."""
        return any_rank(self._exit_received)

    def stop(self) -> None:
        self._stop.set()

    def finish(self) -> None:
        """This rank ends normally: its exit is not a failure to its neighbours."""
        self.stop()
        self._mark("finished")
        if self._wakeup is not None and threading.current_thread() is threading.main_thread():
            # The socket goes with this object; a signal after it (a DataLoader worker's
            # SIGCHLD at exit) must not be written to its closed descriptor.
            signal.set_wakeup_fd(-1)

    def _mark(self, state: str) -> None:
        try:
            self.store.set(f"done/{self.launch_rank}", state)
        except Exception:
            pass

    # ----- the watching thread ------------------------------------------------------------

    def _beat(self) -> None:
        self.store.set(f"alive/{self.launch_rank}", repr(time.time()))

    def _run(self) -> None:
        store_lost_since = None
        while not self._stop.is_set():
            if self._wakeup is not None:
                # poll, not select: a process that re-planned in place several times (in-process
                # restart) may hold descriptors past select's limit of 1024
                waiting = select.poll()
                waiting.register(self._wakeup, select.POLLIN)
                if waiting.poll(HEARTBEAT_S * 1000):
                    self._on_signals(self._wakeup.recv(64))
            else:
                time.sleep(HEARTBEAT_S)
            if self._stop.is_set():
                return
            if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
                self._stop_alone(f"its launcher (torchrun agent, pid {self.launcher_pid}) is gone")
            try:
                self._beat()
                stopped_by = self._stop_requested_by()
                lost = self._find_lost(self.neighbours)
                store_lost_since = None
            except Exception:  # the store is unreachable: its host or launcher may be gone
                store_lost_since = store_lost_since or time.monotonic()
                if time.monotonic() - store_lost_since > self.peer_timeout_s:
                    self._stop_alone(f"the job's rendezvous store has been unreachable for "
                                     f"{self.peer_timeout_s:.0f} s (its launcher or host is gone)")
                continue
            if stopped_by:
                self.handle(stopped_by)
            if lost:
                self.handle("a neighbour stopped answering")

    def _on_signals(self, received: bytes) -> None:
        for signum in map(signal.Signals, received):
            if signum == self.exit_signal and not self._exit_received:
                self._exit_received = True
                error(self.launch_rank, f"received {signum.name}: the job saves after this "
                                        "iteration and exits (--exit-signal-handler)")
            elif signum in STOP_SIGNALS or signum == self.exit_signal:
                cause = f"launch rank {self.launch_rank} ({self.host}, pid {os.getpid()}) received {signum.name}"
                self.handle(self.publish_stop(cause), signum=signum)

    def defer_to_published_stop(self) -> None:
        """Ends the process as handle() does when another rank already published why the job
        stops (a signal it received, its own error): a local error that only follows from
        it (the stopped peer's socket closed in the middle of a save) is not the cause."""
        try:
            published = self._stop_requested_by()
        except Exception:
            return
        if published:
            self.handle(published)

    def publish_stop(self, cause: str) -> str:
        """Tells every rank why the job stops, so that ranks waiting in a collective for
        this one stop too; the first cause published wins (the launcher's SIGTERM that
        follows a failure is not news). Returns the cause that stands."""
        try:
            return self.store.compare_set("stop", "", cause).decode()
        except Exception:
            return cause

    def publish_recovering(self) -> None:
        """Tells every rank that the survivors are leaving their process groups to re-plan
        (in-process restart): a collective that fails for that is no new failure."""
        try:
            self.store.set("recovering", "1")
        except Exception:
            pass

    def _recovery_under_way(self) -> bool:
        """A survivor published the recovery, or the store's host itself is gone."""
        try:
            self.store.set_timeout(timedelta(seconds=2))
            return self.store.check(["recovering"])
        except Exception:
            return True

    def _stop_requested_by(self) -> str | None:
        """The cause another rank published."""
        if not self.store.check(["stop"]):
            return None
        return self.store.get("stop").decode()

    def _stop_alone(self, cause: str) -> None:
        """Ends this process when the job's shared state cannot be read any more (in recover
        mode: stops watching; the store's host is lost, which the training loop finds)."""
        if self.recover:
            self.recovering = True
            self.stop()
            return
        events.emit(events.Stopped(launch_rank=self.launch_rank, cause=cause, alone=True))
        error(self.launch_rank, f"stopping: {cause}.{self.resume_hint()}")
        os._exit(EXIT_CODE)

    # ----- reporting (either thread) ------------------------------------------------------------

    def handle(self, cause: str, signum: signal.Signals | None = None, error_text: str = "") -> None:
        """Reports lost ranks and ends the process; returns only if none is lost (and no
        signal stops the job), so that the caller can raise its own error. Whichever
        thread comes first reports; the other waits for the exit. error_text: the
        communication library's whole message, whose peer addresses are suspected first."""
        self.named_peers |= set(_PEER_ADDRESS.findall(error_text))
        if not self._handling.acquire(blocking=False):
            if not self.recover:
                while True:  # the other thread reports and ends the process
                    time.sleep(60)
            self._handling.acquire()  # the other thread finds whether the job recovers
            if self.recovering:
                self._handling.release()
                return
        self.stop()
        if self.recover and self._recovery_under_way():
            self.recovering = True  # another survivor found the loss first and left its groups
            self._handling.release()
            return
        if self.recover and signum is None:  # a library error: wait for the lost peer to fall silent
            lost = self._settle(self.peer_timeout_s + 2 * HEARTBEAT_S, silence_s=SILENT_AFTER_ERROR_S)
            if not lost and self._recovery_under_way():
                self.recovering = True
                self._handling.release()
                return
        else:
            lost = self._settle()
        if lost and self.recover:
            self.publish_recovering()
            self.recovering = True
            events.emit(events.LostRanks(launch_rank=self.launch_rank, host=self.host, lost=lost, cause=cause))
            error(self.launch_rank, f"the job lost {'; '.join(map(describe_lost, lost))}; this process waits for "
                                    "the job's re-plan (in-process restart)")
            self._handling.release()
            return
        if lost:
            events.emit(events.LostRanks(launch_rank=self.launch_rank, host=self.host, lost=lost, cause=cause))
            error(self.launch_rank, f"the job lost {'; '.join(map(describe_lost, lost))}. This process "
                                    f"stops too ({cause}).{self.resume_hint()}")
            self._mark("stopped")  # our own exit is not news to the other survivors
            os._exit(EXIT_CODE)
        try:
            published = self._stop_requested_by()
        except Exception:
            published = None
        if signum is not None or published:
            events.emit(events.Stopped(launch_rank=self.launch_rank, cause=published or cause,
                                       signal=signum.name if signum is not None else None))
            error(self.launch_rank, f"stopped: {published or cause}; no process of the job was lost."
                                    f"{self.resume_hint()}")
            self._mark("stopped")
            try:
                announce_stopped(self.job_store)
            except Exception:
                pass
            os._exit(128 + signum if signum is not None else EXIT_CODE)
        self._handling.release()

    def _settle(self, settle_s: float = 2.0, silence_s: float | None = None) -> list[LostRank]:
        """Every lost rank; waits up to settle_s for the launcher to reap dead processes (and,
        with silence_s, for a peer to be silent that long; NAMED_SILENT_AFTER_ERROR_S for one
        at an address in named_peers). In recover mode it stops waiting when another survivor
        has published the recovery."""
        deadline = time.monotonic() + settle_s
        everyone = [r for r in range(self.plan.world_size) if r != self.launch_rank]
        while True:
            try:
                if silence_s is not None:
                    self._beat()  # the watching thread is stopped: a survivor settling is no silent peer
                lost = self._find_lost(everyone, silence_s)
            except Exception:
                lost = []
            if lost or time.monotonic() >= deadline:
                return lost
            if silence_s is not None and self._recovery_under_way():
                return lost
            time.sleep(0.2)

    def _find_lost(self, ranks: list[int], silence_s: float | None = None) -> list[LostRank]:
        if not ranks:
            return []
        self.store.set_timeout(timedelta(seconds=5))
        keys = [f"{kind}/{r}" for kind in ("where", "alive", "done") for r in ranks]
        values = dict(zip(keys, self.store.multi_get(keys)))
        now, suspects = time.time(), []
        for r in ranks:
            if values[f"done/{r}"] != b"0":  # finished, or stopped on a failure it reported
                continue
            host, pid, machine, address = values[f"where/{r}"].decode().split()
            age = now - float(values[f"alive/{r}"].decode())
            gone = machine == self.machine and not _process_exists(int(pid))
            silent_s = min(self.peer_timeout_s, silence_s or self.peer_timeout_s)
            if silence_s is not None and address in self.named_peers and machine != self.machine:
                silent_s = min(silent_s, NAMED_SILENT_AFTER_ERROR_S)
            if r in self._lost or gone or age > silent_s:
                suspects.append((r, host, int(pid), machine, age, gone))
        # A rank that stops on its own marks itself done, then exits: read the marks again
        # after seeing a process gone, or one that marked in between (on a loaded machine)
        # would be taken for lost.
        marks = self.store.multi_get([f"done/{r}" for r, *_ in suspects]) if suspects else []
        lost = []
        for (r, host, pid, machine, age, gone), mark in zip(suspects, marks):
            if mark != b"0" and r not in self._lost:
                continue
            if r not in self._lost:  # later looks may see only the aftermath (a kill)
                why = "its process is gone" if gone else f"no heartbeat for {age:.0f} s"
                if not gone and machine == self.machine:
                    why += _kill_frozen(pid)
                self._lost[r] = why
            lost.append(LostRank(launch_rank=r, logical_rank=self.plan.logical_rank(r), host=host,
                                 pid=pid, why=self._lost[r]))
        return lost


def describe_lost(rank: LostRank) -> str:
    return (f"launch rank {rank.launch_rank} (logical rank {rank.logical_rank}, host {rank.host}, "
            f"pid {rank.pid}): {rank.why}")


def neighbours(plan: Plan, launch_rank: int) -> list[int]:
    """Launch ranks this one exchanges data with directly."""
    me = plan.grid.coords(plan.logical_rank(launch_rank))
    logical = set(plan.grid.tensor_group(me.dp_rank, me.pp_rank, me.cp_rank))
    logical.update(plan.grid.context_group(me.tp_rank, me.dp_rank, me.pp_rank))
    pipeline = plan.grid.pipeline_group(me.tp_rank, me.dp_rank, me.cp_rank)
    logical.update(pipeline[max(0, me.pp_rank - 1): me.pp_rank + 2])
    data = plan.grid.data_group(me.tp_rank, me.pp_rank, me.cp_rank, me.template)
    logical.update(data[(me.local_dp_rank + step) % len(data)] for step in (-1, 1))
    return sorted(plan.launch_rank(r) for r in logical if plan.launch_rank(r) != launch_rank)


def _own_address() -> str:
    """The address this host reaches the rendezvous store from: what a peer's connection
    error names (one interface per node: the emulator's and Slurm's namespaces, most clusters'
    data NIC); "-" when unknown."""
    master = os.environ.get("MASTER_ADDR", "")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # no packet is sent: only the route is looked up
            return probe.getsockname()[0]
    except OSError:
        return "-"


def _kill_frozen(pid: int) -> str:
    """A process that lives but stopped beating (SIGSTOP, a hang holding the interpreter)
    would outlive the job: its launcher's SIGTERM cannot reach a stopped process."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return ""
    return " (frozen; killed)"


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
