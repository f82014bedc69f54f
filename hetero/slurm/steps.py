"""Commands run through srun at once, as `hetero-plan profile --slurm` runs its steps: their
progress lines relayed as they come, the first that fails stopping the others (SIGTERM to
srun, which cancels its job) and raised with the tail of its output; SIGTERM to this process
stops them too (as Ctrl-C does).
"""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from hetero.errors import HeteroError

TAIL_LINES = 30
KEPT_LINES = 400  # of a step's output, for the tail of its error
STOP_WAIT_S = 15.0  # after SIGTERM to srun (it cancels its job), before SIGKILL
# Left out of an error's tail, which would otherwise hide the rank's own error: Python and
# c10d warnings, and the frames of torchrun's own traceback (it re-raises a rank's failure).
NOISE = re.compile(r"^(.*Warning: |\s*warnings\.warn\(|\[W\d{4} )")
LAUNCHER_FRAME = re.compile(r'^(\s*)File "(<frozen runpy>|.*/torch/distributed/)')


class StepError(HeteroError):
    """A step failed; the message names it and ends with the tail of its output."""


@dataclass
class Step:
    name: str
    """what it is and where it runs, as progress lines and errors say it"""
    tag: str
    """the prefix of its relayed output lines"""
    command: list[str]
    lines: deque = field(default_factory=lambda: deque(maxlen=KEPT_LINES))

    def tail(self) -> list[str]:
        """The last TAIL_LINES of its output, warnings and torchrun's own traceback frames left out."""
        kept, frame_indent = [], None
        for line in self.lines:
            indent = len(line) - len(line.lstrip())
            if frame_indent is not None and indent > frame_indent:
                continue  # the source lines under a left-out frame
            frame_indent = None
            frame = LAUNCHER_FRAME.match(line)
            if frame:
                frame_indent = len(frame.group(1))
            elif not NOISE.match(line):
                kept.append(line)
        return kept[-TAIL_LINES:]


def run_steps(steps: list[Step], progress: Callable[[str], None], relayed: re.Pattern) -> None:
    """Runs the steps at once, relaying the lines of their output that `relayed` matches; the
    first that fails stops the others and is raised as a StepError with its output's tail."""
    lines: queue.Queue = queue.Queue()
    procs = []
    try:
        for index, step in enumerate(steps):
            # A session of its own: a Ctrl-C reaches us, and we stop srun (and so its job).
            proc = subprocess.Popen(step.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    stdin=subprocess.DEVNULL, start_new_session=True, errors="replace")
            procs.append(proc)
            threading.Thread(target=_pump, args=(proc, index, lines), daemon=True).start()
            progress(f"  {step.name}: started")
        running = len(steps)
        while running:
            index, line = lines.get()
            step = steps[index]
            if line is not None:
                step.lines.append(line)
                if relayed.match(line):
                    progress(f"  {step.tag} | {line}")
                continue
            running -= 1
            code = procs[index].wait()
            if code != 0:
                raise StepError(f"{step.name} failed (srun exited with {code}); the last lines of its output:\n"
                                + "\n".join(f"    {x}" for x in step.tail()))
            progress(f"  {step.name}: done")
    finally:
        _stop(procs)


def _pump(proc: subprocess.Popen, index: int, lines: queue.Queue) -> None:
    for line in proc.stdout:
        lines.put((index, line.rstrip("\n")))
    lines.put((index, None))


def _stop(procs: list[subprocess.Popen]) -> None:
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in running:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is so that the steps are stopped and nothing is written."""


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises Terminated (a KeyboardInterrupt) in the main thread while inside: the
    steps are stopped and what runs after them (writing files) does not happen."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
