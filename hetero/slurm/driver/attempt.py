"""One attempt of the job: every node's srun step started (steps.py), their output passed
on, and the steps watched until the job ends, fails (then: which nodes were lost, see
driver.py's docstring, "A lost node") or must stop for a returned node (readmission.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from hetero.events import CheckpointLoaded, CheckpointSaved, Iteration, of_kind, read_events
from hetero.launch.commands import NodeCommand, node_commands
from hetero.launch.elastic import AttemptResult, lost_hosts
from hetero.slurm.driver.job import SlurmJob
from hetero.slurm.driver.readmission import Readmission
from hetero.plan import Plan

QUIET_S = 2.0  # no step ended for this long after a failure: probe the nodes still running


class Stopped(Exception):
    """The driver got SIGTERM (scancel, the time limit, Slurm ending the job) or SIGINT."""


@dataclass
class AttemptRecord:
    attempt: int
    plan: str
    nodes: list[str]
    master: str
    started: float
    ended: float | None = None
    returncode: int | None = None
    outcome: str | None = None
    lost: list[str] = field(default_factory=list)
    first_iteration: int | None = None
    first_iteration_time: float | None = None
    checkpoint_loaded: int | None = None
    last_iteration: int | None = None


class SlurmRunner:
    """hetero.launch.elastic's NodeRunner on a Slurm allocation: one srun step per node."""

    def __init__(self, driver: SlurmJob):
        self.driver = driver
        self.readmission: Readmission | None = None

    def run(self, plan: Plan, plan_path: str, train_args: list[str], attempt: int) -> AttemptResult:
        driver = self.driver
        events_dir = driver.run_dir / f"attempt-{attempt}-events"
        if events_dir.exists():
            for old in events_dir.iterdir():
                old.unlink()  # a file here would be read as this attempt's
        events_dir.mkdir(parents=True, exist_ok=True)
        hosts = [h for h, _ in plan.hosts()]
        master = driver.address(hosts[0])
        port = driver.master_port + attempt
        record = AttemptRecord(attempt, plan_path, hosts, f"{master}:{port}", time.time())
        driver.record["attempts"].append(record.__dict__)
        driver.save()
        commands = node_commands(plan, plan_path, train_args, master, port, driver.script, driver.emulate_devices)
        lines: deque[str] = deque(maxlen=2000)
        procs: dict[str, subprocess.Popen] = {}
        readers: list[threading.Thread] = []
        self.readmission = None
        dead: set[str] = set()  # nodes whose slurmd did not answer a probe step
        # procs and dead fill as the steps start and the watch goes on, so that a stop half-way
        # (an error, the driver's own SIGTERM) still stops every step started.
        try:
            self._start_steps(commands, attempt, events_dir, lines, procs, readers)
            outcome = self._watch(plan, attempt, events_dir, procs, dead)
        except Stopped:
            record.__dict__.update(ended=time.time(), outcome="stopped")
            raise
        finally:
            still = [h for h, p in procs.items() if p.poll() is None]
            if still:
                driver.stop_steps({h: procs[h] for h in still}, attempt, dead)
            for reader in readers:
                reader.join(timeout=5)
        return self._result(plan, procs, outcome, dead, lines, events_dir, record)

    def _start_steps(self, commands: list[NodeCommand], attempt: int, events_dir: Path, lines: deque,
                     procs: dict[str, subprocess.Popen], readers: list[threading.Thread]) -> None:
        """One srun step per node, running the node's torchrun; its output read into lines."""
        driver = self.driver
        for command in commands:
            # torchrun's launch, ending without torchrun's traceback (megatron/hetero/launcher.py)
            argv = [driver.python, "-m", "megatron.hetero.launcher", *command.argv[1:]]
            proc = subprocess.Popen(driver.srun(command.host, f"hetero-{attempt}") + argv, cwd=driver.workdir,
                                    env=driver.step_env(command.host, command.env, events_dir),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            procs[command.host] = proc
            readers.append(threading.Thread(target=_pump, args=(proc, command.host, lines), daemon=True))
            readers[-1].start()

    def _watch(self, plan: Plan, attempt: int, events_dir: Path, procs: dict[str, subprocess.Popen],
               dead: set[str]) -> str:
        """Waits for the steps: "finished" when all have ended (or a failure has stopped what
        is not lost), "readmit" when the job is to stop for a returned node; dead: the nodes
        whose slurmd did not answer a probe."""
        driver = self.driver
        first_failure: float | None = None
        next_check = time.monotonic() + driver.poll_s
        last_change, previous, probed = time.monotonic(), set(procs), set()
        while True:
            codes = {host: proc.poll() for host, proc in procs.items()}
            running = {h for h, c in codes.items() if c is None}
            if not running:
                return "finished"
            now = time.monotonic()
            if running != previous:
                last_change, previous = now, running
            failed = sorted(h for h, c in codes.items() if c not in (None, 0))
            if failed and first_failure is None:
                first_failure = now
                driver.log(f"attempt {attempt}: the step on {', '.join(failed)} exited with "
                           f"{codes[failed[0]]}; stopping the attempt")
            if first_failure is not None:
                reported = lost_hosts(AttemptResult(1, events=read_events(events_dir)), plan)
                # The ranks of a crashed node's peers may stop on their library's error
                # before the watchdog names it: once the others have exited and the rest
                # has been quiet a moment, ask the rest's slurmd directly.
                if now - last_change > QUIET_S and len(running) < len(procs):
                    for host in sorted(running - reported - probed):
                        probed.add(host)
                        if not driver.node_answers(host):
                            dead.add(host)
                if running <= reported | dead or now - first_failure > driver.stop_grace_s:
                    return "finished"
            elif self.readmission is not None or now >= next_check:
                # Looking for returned nodes: every poll_s; once one is taken, for the
                # next checkpoint at every turn (a late stop loses what came after it).
                if self.readmission is None:
                    next_check = now + driver.poll_s
                if self._readmit_now(plan, events_dir):
                    return "readmit"
            time.sleep(0.2)

    def _result(self, plan: Plan, procs: dict[str, subprocess.Popen], outcome: str, dead: set[str],
                lines: deque, events_dir: Path, record: AttemptRecord) -> AttemptResult:
        """How the attempt ended, recorded (driver.json): exit code, outcome, lost nodes, iterations."""
        driver = self.driver
        codes = {h: p.returncode for h, p in procs.items()}
        returncode = next((c for c in codes.values() if c not in (0, None)), 0)
        if outcome == "readmit":
            returncode = returncode or 1
        elif returncode != 0:
            outcome = "failed"
        events = read_events(events_dir)
        result = AttemptResult(returncode, dead, list(lines), events)
        if outcome == "failed" and not lost_hosts(result, plan):
            # Every step ended and no rank named a lost peer (one that stopped on another
            # error first, e.g. inside a checkpoint write): ask every node's slurmd.
            silent = driver.silent_nodes([h for h, _ in plan.hosts()])
            if silent:
                driver.log(f"attempt {record.attempt}: no rank named a lost node, but {', '.join(sorted(silent))} "
                           "runs no step: lost")
                dead |= silent
                result = AttemptResult(returncode, dead, list(lines), events)
        lost = sorted(lost_hosts(result, plan)) if outcome == "failed" else []
        iterations = of_kind(events, Iteration)
        loaded = of_kind(events, CheckpointLoaded)
        record.__dict__.update(
            ended=time.time(), returncode=returncode, outcome=outcome, lost=lost,
            first_iteration=iterations[0].iteration if iterations else None,
            first_iteration_time=iterations[0].time if iterations else None,
            last_iteration=iterations[-1].iteration if iterations else None,
            checkpoint_loaded=loaded[0].iteration if loaded else None)
        driver.save()
        return result

    def _readmit_now(self, plan: Plan, events_dir: Path) -> bool:
        """Whether to stop now for a returned node: once one is taken (self.readmission), at
        the first checkpoint the job writes after that."""
        if self.readmission is None:
            self.readmission = self.driver.consider_returned(plan, events_dir)
            return False
        saved = [e.iteration for e in of_kind(read_events(events_dir), CheckpointSaved)]
        if saved and max(saved) > self.readmission.after_iteration:
            self.driver.log(f"checkpoint of iteration {max(saved)} written: stopping the job to take in "
                            f"{', '.join(self.readmission.nodes)}")
            return True
        return False


def _pump(proc: subprocess.Popen, host: str, lines: deque) -> None:
    for line in proc.stdout:
        lines.append(line)
        sys.stdout.write(f"[{host}] {line}")
        sys.stdout.flush()
