"""One attempt of the job: every node's srun step started (steps.py), their output passed
on, and the steps watched until the job ends, fails (then: which nodes were lost, see
driver.py's docstring, "A lost node") or must stop for a returned node (readmission.py).

With --inprocess-restart (a supervisor: hetero.launch.recovery) an attempt outlives lost
and returned nodes: the nodes the survivors report lost (their LostRanks events since the
last re-plan) and the failed steps whose node runs no probe are re-planned for while the
survivors wait in their processes; a returned node gets one step that starts its processes
(a one-node torchrun), which join the running job at an iteration boundary."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from hetero.events import (CheckpointLoaded, CheckpointSaved, Iteration, LostRanks, StateRestored, of_kind,
                           read_events)
from hetero.launch.commands import NodeCommand, node_commands
from hetero.launch.elastic import AttemptResult, lost_hosts
from hetero.launch.inprocess import CONTROL_DIR, REJOIN, ready
from hetero.launch.recovery import InProcessSupervisor
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
    # In-process re-plans inside this attempt: {"time", "kind": "lost"|"returned", "nodes", "plan",
    # "epoch", and once the ranks report it "restored": where the state came from - "memory"
    # (the snapshots), "disk" (every copy of some shard was lost: the last checkpoint) or "none"}
    replans: list[dict] = field(default_factory=list)


class SlurmRunner:
    """hetero.launch.elastic's NodeRunner on a Slurm allocation: one srun step per node."""

    def __init__(self, driver: SlurmJob):
        self.driver = driver
        self.readmission: Readmission | None = None
        self.supervisor: InProcessSupervisor | None = None

    def run(self, plan: Plan, plan_path: str, train_args: list[str], attempt: int,
            supervisor: InProcessSupervisor | None = None) -> AttemptResult:
        driver = self.driver
        self.supervisor = supervisor
        events_dir = driver.run_dir / f"attempt-{attempt}-events"
        if events_dir.exists():
            for old in events_dir.iterdir():
                old.unlink()  # a file here would be read as this attempt's
        events_dir.mkdir(parents=True, exist_ok=True)
        hosts = [h for h, _ in plan.hosts()]
        master = driver.address(hosts[0])
        port = driver.master_port + attempt
        record = AttemptRecord(attempt, plan_path, hosts, f"{master}:{port}", time.time())
        self.replanned_at = record.started
        driver.record["attempts"].append(record.__dict__)
        driver.save()
        commands = node_commands(plan, plan_path, train_args, master, port, driver.script, driver.emulate_devices)
        lines: deque[str] = deque(maxlen=2000)
        procs: dict[str, subprocess.Popen] = {}
        readers: list[threading.Thread] = []
        self.readmission = None
        self.handed_over: set[str] = set()  # lost nodes the job went on without (in-process)
        self.first_waiting: float | None = None  # when survivors were first seen waiting for a re-plan
        dead: set[str] = set()  # nodes whose slurmd did not answer a probe step
        if supervisor is not None:
            supervisor.address_of = driver.address
            supervisor.lost_now = lambda: self._reported_lost(read_events(events_dir))
            supervisor.start_node = lambda host, epoch, new_plan: self._start_joiners(
                host, epoch, new_plan, train_args, attempt, events_dir, lines, procs, readers, record)
        # procs and dead fill as the steps start and the watch goes on, so that a stop half-way
        # (an error, the driver's own SIGTERM) still stops every step started.
        try:
            self._start_steps(commands, attempt, events_dir, lines, procs, readers)
            outcome = self._watch(plan, attempt, events_dir, procs, dead, record)
        except Stopped:
            record.__dict__.update(ended=time.time(), outcome="stopped")
            raise
        finally:
            still = [h for h, p in procs.items() if p.poll() is None]
            if still:
                driver.stop_steps({h: procs[h] for h in still}, attempt, dead | self.handed_over)
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
            self._start_step(command.host, argv, command.env, attempt, events_dir, lines, procs, readers)

    def _start_step(self, host: str, argv: list[str], node_env: dict, attempt: int, events_dir: Path,
                    lines: deque, procs: dict[str, subprocess.Popen], readers: list[threading.Thread]) -> None:
        driver = self.driver
        if self.supervisor is not None:
            node_env = {**node_env, CONTROL_DIR: str(self.supervisor.control_dir)}
        proc = subprocess.Popen(driver.srun(host, f"hetero-{attempt}") + argv, cwd=driver.workdir,
                                env=driver.step_env(host, node_env, events_dir),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs[host] = proc
        readers.append(threading.Thread(target=_pump, args=(proc, host, lines), daemon=True))
        readers[-1].start()

    def _start_joiners(self, host: str, epoch: int, plan: Plan, train_args: list[str], attempt: int,
                       events_dir: Path, lines: deque, procs: dict[str, subprocess.Popen],
                       readers: list[threading.Thread], record: AttemptRecord) -> None:
        """A returned node's processes for the running job's re-plan ``epoch``: one step running
        a one-node torchrun as a local starter (each process takes its launch variables
        from the re-plan), in place of the node's lost step."""
        driver = self.driver
        old = procs.pop(host, None)
        if old is not None and old.poll() is None:
            old.kill()  # the lost node's srun, waiting for a slurmstepd that is gone
            old.wait()
        (command,) = [c for c in node_commands(plan, "", [], script=driver.script,
                                               emulate_devices=driver.emulate_devices) if c.host == host]
        # torchrun on its own (one node, its store on the loopback: a node's name need not
        # resolve), only to start and watch the node's processes. Its port is drawn below
        # Linux's ephemeral range, where no outgoing connection on the node can hold it.
        argv = [driver.python, "-m", "megatron.hetero.launcher", "--nnodes=1", "--node-rank=0",
                "--master-addr=127.0.0.1", f"--master-port={random.randint(10000, 32767)}",
                f"--nproc-per-node={len(command.launch_ranks)}", driver.script, "--hetero-plan",
                str(self.supervisor.run_dir / f"plan-inprocess-{epoch}.json"), *train_args]
        self._start_step(host, argv, {**command.env, REJOIN: str(epoch)}, attempt, events_dir, lines, procs, readers)
        self.handed_over.discard(host)

    def _reported_lost(self, events: list) -> set[str]:
        """The hosts the ranks report lost (``events``: the attempt's) since the last in-process
        re-plan (by the current plan's launch ranks)."""
        plan = self.supervisor.plan
        since = self.replanned_at
        reports = [e for e in of_kind(events, LostRanks) if e.time >= since]
        return lost_hosts(AttemptResult(1, events=reports), plan) - self.handed_over

    def _watch(self, plan: Plan, attempt: int, events_dir: Path, procs: dict[str, subprocess.Popen],
               dead: set[str], record: AttemptRecord) -> str:
        """Waits for the steps: "finished" when all have ended (or a failure has stopped what
        is not lost), "readmit" when the job is to stop for a returned node; dead: the nodes
        whose slurmd did not answer a probe."""
        driver = self.driver
        first_failure: float | None = None
        next_check = time.monotonic() + driver.poll_s
        last_change, previous, probed = time.monotonic(), set(procs), set()
        while True:
            codes = {host: proc.poll() for host, proc in procs.items() if host not in self.handed_over}
            running = {h for h, c in codes.items() if c is None}
            if not running or (self.supervisor is not None and self.supervisor.done()):
                return "finished"
            now = time.monotonic()
            if running != previous:
                last_change, previous = now, running
            failed = sorted(h for h, c in codes.items() if c not in (None, 0))
            # The attempt's events, read once per turn for what the in-process path looks at.
            events = read_events(events_dir) if self.supervisor is not None else []
            if self.supervisor is not None and first_failure is None:
                reported = self._reported_lost(events)
                unexplained = [h for h in failed if h not in reported | probed]
                probed |= set(unexplained)  # a failed step on a node that still runs steps: a crash
                lost = reported | {h for h in unexplained if not driver.node_answers(h)}
                lost = lost or self._silent_while_others_wait(probed)
                if lost:
                    if not self._recover_in_process(lost, plan, record):
                        dead |= lost
                        return "finished"  # the job stops; the next attempt restarts it from disk
                    plan = self.supervisor.plan
                    probed.clear()  # the nodes of the new plan: probed afresh after a loss
                    continue
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
                if self.supervisor is not None:
                    self._admit_in_process(plan, events_dir, record)
                    plan = self.supervisor.plan
                elif self._readmit_now(plan, events_dir):
                    return "readmit"
            if self.supervisor is not None:
                self._note_restored(events, record)
            time.sleep(0.2)

    def _silent_while_others_wait(self, probed: set[str]) -> set[str]:
        """When survivors wait for a re-plan but none named a lost rank (the rendezvous
        store's host is gone, and with it what they read heartbeats from): after QUIET_S,
        of the hosts none of whose processes wait, those whose address the survivors'
        library errors name (their connections to it were reset), and of the others those
        whose node runs no probe step (a probe of a dead node takes up to PROBE_TIMEOUT_S;
        two nodes lost together may be named one only)."""
        supervisor = self.supervisor
        reports = [r for r in ready(supervisor.control_dir, supervisor.epoch + 1) if not r.get("joining")]
        waiting = {r["place"].rsplit(":", 1)[0] for r in reports}
        if not waiting:
            self.first_waiting = None
            return set()
        self.first_waiting = self.first_waiting or time.monotonic()
        if time.monotonic() - self.first_waiting < QUIET_S:
            return set()
        candidates = {h for h, _ in supervisor.plan.hosts()} - waiting - probed - self.handed_over
        named = {address for r in reports for address in r.get("named_peers", [])}
        reset = {h for h in candidates if self.driver.address(h) in named}
        unnamed = candidates - reset
        probed |= unnamed
        return reset | (self.driver.silent_nodes(sorted(unnamed)) if unnamed else set())

    def _recover_in_process(self, lost: set[str], plan: Plan, record: AttemptRecord) -> bool:
        """Lost nodes re-planned for while the survivors wait in their processes; False when the
        job cannot go on in them (the attempt then stops, and the next one resumes from disk)."""
        driver = self.driver
        driver.log(f"attempt {record.attempt}: lost {', '.join(sorted(lost))}; the survivors wait in their "
                   "processes for the re-plan (in-process restart)")
        if not self.supervisor.recover(lost):
            return False
        self.replanned_at = time.time()
        self.first_waiting = None
        self.handed_over |= lost
        record.replans.append(self._replan_entry("lost", sorted(lost)))
        driver.remove_nodes(lost)
        driver.save()
        return True

    def _replan_entry(self, kind: str, nodes: list[str]) -> dict:
        epoch = self.supervisor.epoch
        return {"time": self.replanned_at, "kind": kind, "nodes": nodes, "epoch": epoch,
                "plan": str(self.supervisor.run_dir / f"plan-inprocess-{epoch}.json")}

    def _note_restored(self, events: list, record: AttemptRecord) -> None:
        """Where each re-plan's state came from, once its ranks report it (StateRestored among
        the attempt's ``events``), into driver.json; a fall-back to the disk checkpoint said
        in the driver's log too."""
        pending = {r["epoch"]: r for r in record.replans if "restored" not in r}
        if not pending:
            return
        for restored in of_kind(events, StateRestored):
            replan = pending.pop(restored.epoch, None)
            if replan is None:
                continue
            replan["restored"] = {"source": restored.source, "iteration": restored.iteration,
                                  "seconds": round(restored.seconds, 3), "detail": restored.detail}
            if restored.source != "memory":
                self.driver.log(f"attempt {record.attempt}: every copy of some snapshot was on lost nodes "
                                f"({', '.join(replan['nodes'])}): " + (
                                    f"the state of iteration {restored.iteration} came from the last disk "
                                    f"checkpoint ({restored.detail})" if restored.source == "disk" else
                                    f"no disk checkpoint either, training starts over ({restored.detail})"))
            self.driver.save()

    def _admit_in_process(self, plan: Plan, events_dir: Path, record: AttemptRecord) -> None:
        """A returned node worth taking, taken into the running job at an iteration boundary."""
        driver = self.driver
        readmission = driver.consider_returned(plan, events_dir, in_process=True)
        if readmission is None:
            return
        if self.supervisor.admit(set(readmission.nodes), readmission.plan):
            self.replanned_at = time.time()
            for node in readmission.nodes:
                driver.lost.pop(node, None)
            record.replans.append(self._replan_entry("returned", list(readmission.nodes)))
            driver.save()
        else:
            driver.declined |= set(readmission.nodes)

    def _result(self, plan: Plan, procs: dict[str, subprocess.Popen], outcome: str, dead: set[str],
                lines: deque, events_dir: Path, record: AttemptRecord) -> AttemptResult:
        """How the attempt ended, recorded (driver.json): exit code, outcome, lost nodes, iterations."""
        driver = self.driver
        codes = {h: p.returncode for h, p in procs.items() if h not in self.handed_over}
        returncode = next((c for c in codes.values() if c not in (0, None)), 0)
        if self.supervisor is not None and self.supervisor.done():
            returncode = 0  # the steps left were torchrun agents waiting for lost peers: stopped
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
        if self.supervisor is not None:
            self._note_restored(events, record)
            plan = self.supervisor.plan
            result.events = [e for e in events if e.time >= self.replanned_at]  # of the current plan
        lost = sorted(lost_hosts(result, plan)) if outcome == "failed" else []
        result.events = events
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
