"""Helpers that launch real pretrain_gpt.py jobs (gloo on 127.0.0.1; forked ranks or torchrun)
and read their logs."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from hetero.env import EVENTS_DIR
from hetero.events import Event, Iteration, Memory, of_kind, read_events

REPO = Path(__file__).resolve().parent.parent

# A GPT-2 style model (tied embeddings, LayerNorm, learned positions, GELU) ...
GPT_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
]
# ... and a Llama style one (SwiGLU, RMSNorm, RoPE, grouped-query attention, untied).
LLAMA_MODEL = GPT_MODEL + [
    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--group-query-attention", "--num-query-groups", "2",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]
TRAINING = [
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "5",
    "--lr", "1e-3", "--lr-decay-style", "cosine",  # no warm-up: every step updates
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
    "--seed", "1234", "--log-params-norm",
]

# An iteration line's figures, by the name the line gives them, as Iteration events hold
# them; any other name is one of the line's losses ("lm loss", "load_balancing_loss", ...).
_ITERATION_FIGURES = {"learning rate": "learning_rate", "params norm": "params_norm", "grad norm": "grad_norm",
                      "loss scale": "loss_scale", "global batch size": "global_batch_size",
                      "consumed samples": "consumed_samples", "tokens per second": "tokens_per_s"}


@functools.cache
def _starts_clusters(path: Path) -> bool:
    """Whether a test file starts emulated or Slurm clusters (it uses tools.emulator)."""
    return path.suffix == ".py" and "tools.emulator" in path.read_text()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`make test` runs the suite on every core (pytest-xdist). The tests that start emulated
    or Slurm clusters go to one worker, one after another: they share the machine's host
    names (kill_node kills a host's processes in every emulated job), its Slurm daemons and
    its CPU quotas, which the emulator sizes for the machine as a whole. Every other test is
    a unit of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class ClustersTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "clusters" if _starts_clusters(config.rootpath / nodeid.split("::")[0]) else nodeid

    return ClustersTogether(config, log)


def iteration_figure(event: Iteration, name: str) -> float:
    attribute = _ITERATION_FIGURES.get(name)
    value = getattr(event, attribute) if attribute else event.losses.get(name)
    assert value is not None, f"iteration {event.iteration} recorded no {name!r}"
    return value


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    events: list[Event] = field(default_factory=list)  # what the job recorded (hetero.events)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def series(self, name: str) -> list[float]:
        """One figure of every logged iteration (log interval 1), in order: "lm loss",
        "params norm", "learning rate", ... (the names of Megatron's iteration line)."""
        iterations = of_kind(self.events, Iteration)
        assert [e.iteration for e in iterations] == list(range(1, len(iterations) + 1)), self.output[-3000:]
        return [iteration_figure(e, name) for e in iterations]

    def losses(self) -> list[float]:
        return self.series("lm loss")

    def iteration_losses(self, name: str = "lm loss") -> dict[int, float]:
        """iteration -> its logged loss (a resumed run starts past 1)."""
        return {e.iteration: iteration_figure(e, name) for e in of_kind(self.events, Iteration)}

    def peak_memory_mb(self) -> dict[tuple[int, int], float]:
        """(logical rank, iteration) -> the job's own peak memory (MB) of every rank that
        reports it (one per stage): max allocated, or on the CPU max rss less mapped files."""
        return {(m.logical_rank, m.iteration): m.peak_mb for m in of_kind(self.events, Memory)}


def _events_dir(env: dict) -> tuple[str, bool]:
    """The job's events directory: the one the test gives (HETERO_EVENTS_DIR in env), else a
    fresh temporary one (True: to remove once read); never the suite's own environment's,
    which every job would share."""
    if env.get(EVENTS_DIR):
        return env[EVENTS_DIR], False
    return tempfile.mkdtemp(prefix="hetero-events."), True


def _with_events(run: Callable[[], RunResult], directory: str, own: bool) -> RunResult:
    """run(), and the events its job wrote in directory."""
    try:
        result = run()
        result.events = read_events(directory)
        return result
    finally:
        if own:
            shutil.rmtree(directory, ignore_errors=True)


def cpu_devices(n: int, host: str = "localhost") -> list[dict]:
    return [{"host": host, "device_type": "cpu", "vendor": "cpu", "nic": "loopback"}] * n


def make_plan(tp: int, pp: int, dp: int, stages, replicas, rank_order, devices=None, mbs: int = 2,
              stage_tp: list[int] | None = None) -> dict:
    """A plan dict; stage_tp gives each stage its own tensor-parallel degree (version 3)."""
    plan = {
        "version": 1,
        "tensor_parallel": tp,
        "pipeline_parallel": pp,
        "data_parallel": dp,
        "micro_batch_size": mbs,
        "stages": [{"num_layers": n} for n in stages],
        "replicas": [{"num_micro_batches": n} for n in replicas],
        "rank_order": rank_order,
        "devices": devices or cpu_devices(dp * (sum(stage_tp) if stage_tp else tp * pp)),
    }
    if stage_tp:
        plan["version"] = 3
        for stage, degree in zip(plan["stages"], stage_tp):
            stage["tensor_parallel"] = degree
    return plan


class JobServer:
    """tests/forkrun.py --serve: forks training jobs from one process that imported the
    runtime once (started at the first job of the session, stopped at its end)."""

    def __init__(self) -> None:
        self.path = os.path.join(tempfile.mkdtemp(prefix="forkrun."), "socket")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "forkrun.py"), "--serve",
                                      self.path], cwd=REPO, env=env)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            assert self.proc.poll() is None, "tests/forkrun.py --serve did not start"
            assert time.monotonic() < deadline, "tests/forkrun.py --serve did not start in 120 s"
            time.sleep(0.05)
        atexit.register(self.close)

    def run(self, nproc: int, argv: list[str], env: dict, timeout: float) -> RunResult:
        outputs = tempfile.mkdtemp(prefix="forkrun-job.")
        request = {"nproc": nproc, "argv": argv, "env": env, "cwd": str(REPO),
                   "stdout": os.path.join(outputs, "stdout"), "stderr": os.path.join(outputs, "stderr")}
        with socket.socket(socket.AF_UNIX) as connection:
            connection.connect(self.path)
            connection.settimeout(timeout)
            connection.sendall(json.dumps(request).encode() + b"\n")
            replies = connection.makefile()
            leader = json.loads(replies.readline())["pid"]
            try:
                exit_code = json.loads(replies.readline())["exit"]
            except (TimeoutError, socket.timeout):
                os.killpg(leader, signal.SIGUSR1)  # every process prints its stacks (forkrun.py)
                time.sleep(3)
                os.killpg(leader, signal.SIGKILL)
                read = self._read_outputs(request, outputs)
                pytest.fail(f"the job ({nproc} processes) did not end in {timeout:.0f} s: "
                            f"{' '.join(argv)}\n--- its stdout, last lines:\n{read['stdout'][-4000:]}"
                            f"\n--- its stderr, last lines (stacks at the timeout):\n{read['stderr'][-12000:]}",
                            pytrace=False)
        read = self._read_outputs(request, outputs)
        return RunResult(exit_code, read["stdout"], read["stderr"])

    @staticmethod
    def _read_outputs(request: dict, outputs: str) -> dict[str, str]:
        read = {name: Path(request[name]).read_text(errors="replace") for name in ("stdout", "stderr")}
        shutil.rmtree(outputs, ignore_errors=True)
        return read

    def close(self) -> None:
        if self.proc.poll() is None:
            with socket.socket(socket.AF_UNIX) as connection:
                connection.connect(self.path)
                connection.sendall(b'{"stop": true}\n')
            self.proc.wait(timeout=30)
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


_job_server: JobServer | None = None


def run_pretrain(
    args: list[str],
    nproc: int = 1,
    plan: dict | None = None,
    tmp_path: Path | None = None,
    env: dict | None = None,
    timeout: float = 600,
    script: Path = REPO / "pretrain_gpt.py",
    launcher: str = "fork",
) -> RunResult:
    """Runs pretrain_gpt.py: by default as a job forked from the suite's job server
    (tests/forkrun.py); with launcher="torchrun" (or another script, which runs it) under
    torchrun, or plain python for one process."""
    global _job_server
    args = list(args)
    if plan is not None:
        assert tmp_path is not None
        plan_path = tmp_path / f"plan_{len(list(tmp_path.glob('plan_*.json')))}.json"
        plan_path.write_text(json.dumps(plan))
        args += ["--hetero-plan", str(plan_path)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(variable, None)
    events_dir, own_events = _events_dir(env or {})
    full_env[EVENTS_DIR] = events_dir
    if launcher == "fork" and script == REPO / "pretrain_gpt.py":
        if _job_server is None:
            _job_server = JobServer()
        server = _job_server
        return _with_events(lambda: server.run(nproc, args, full_env, timeout), events_dir, own_events)
    if nproc == 1:
        command = [sys.executable, str(script), *args]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(script), *args,
        ]

    def run() -> RunResult:
        proc = subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
        return RunResult(proc.returncode, proc.stdout, proc.stderr)

    return _with_events(run, events_dir, own_events)


def assert_same_training(reference: RunResult, candidate: RunResult, rtol: float = 1e-4) -> None:
    """Same lm loss and params norm at every iteration, up to rtol (relative)."""
    assert candidate.returncode == 0, candidate.output[-3000:]
    for name in ("lm loss", "params norm"):
        ref, got = reference.series(name), candidate.series(name)
        assert len(ref) == len(got) > 0, (name, ref, got)
        for i, (a, b) in enumerate(zip(ref, got), start=1):
            assert abs(a - b) <= rtol * abs(a), f"{name} at iteration {i}: {a} vs {b} ({ref} vs {got})"


def _reference(model: list[str]) -> RunResult:
    result = run_pretrain(model + TRAINING)
    assert result.returncode == 0, result.output[-3000:]
    return result


@pytest.fixture(scope="session")
def gpt_reference() -> RunResult:
    """The GPT model trained by one process without a plan, fp32."""
    return _reference(GPT_MODEL)


@pytest.fixture(scope="session")
def llama_reference() -> RunResult:
    return _reference(LLAMA_MODEL)


def live_command(pid: int) -> str | None:
    """The command line of a live process; None when it is gone or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, IndexError):
        return None
    return None if state == "Z" else command


def processes_mentioning(fragment: str) -> list[str]:
    """'pid command' of every live process whose command line contains fragment."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            command = live_command(int(entry.name))
            if command is not None and fragment in command:
                found.append(f"{entry.name} {command[:200]}")
    return found


def assert_nothing_left(fragment: str, within_s: float = 20) -> None:
    """No process whose command line contains fragment (a test's tmp_path) is alive
    within_s from now: a job never leaves a process behind."""
    import time

    deadline = time.monotonic() + within_s
    while processes_mentioning(fragment) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = processes_mentioning(fragment)
    assert not left, "the job left processes behind:\n" + "\n".join(left)


class LiveJob:
    """A pretrain_gpt.py job running in the background whose output can be watched."""

    def __init__(self, args: list[str], nproc: int, env: dict | None = None):
        import threading

        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", str(REPO / "pretrain_gpt.py"), *args]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            full_env.pop(variable, None)
        self.events_dir, own_events = _events_dir(env or {})
        full_env[EVENTS_DIR] = self.events_dir
        if own_events:
            atexit.register(shutil.rmtree, self.events_dir, ignore_errors=True)
        self.proc = subprocess.Popen(command, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._seen: set[int] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def events(self) -> list[Event]:
        """What the job recorded so far (hetero.events)."""
        return read_events(self.events_dir)

    def wait_for(self, fragment: str, timeout: float = 300) -> None:
        import time

        deadline = time.monotonic() + timeout
        while fragment not in self.output:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"never saw {fragment!r}:\n{self.output[-3000:]}")
            time.sleep(0.02)
        self._seen.update(self._descendants())

    def worker_pid(self, launch_rank: int) -> int:
        """The pid of the worker torchrun started as RANK=launch_rank."""
        self._seen.update(self._descendants())
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                status = (entry / "status").read_text()
            except OSError:
                continue
            parent = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))
            if parent == self.proc.pid and f"RANK={launch_rank}".encode() in environ:
                return int(entry.name)
        raise AssertionError(f"no worker with RANK={launch_rank}")

    def _descendants(self) -> list[int]:
        from tools.emulator.cluster import descendants

        return descendants([self.proc.pid])

    def _alive(self) -> list[int]:
        return [pid for pid in self._seen if live_command(pid) is not None]

    def kill_everything(self) -> None:
        """SIGKILL to the launcher and every worker: torchrun starts each worker in a session
        of its own, so killing the launcher's process group alone would leave them running.
        Processes seen earlier count too: orphans are no longer our descendants."""
        import signal

        self._seen.update(self._descendants())
        for pid in [self.proc.pid, *self._seen]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def finish(self, timeout: float, left_behind_s: float = 20) -> int:
        """The launcher's exit code. Raises if any process of the job (a worker, a helper a
        worker started) is still alive left_behind_s after the launcher exited: a job never
        leaves a process behind."""
        import time

        try:
            self._seen.update(self._descendants())
            code = self.proc.wait(timeout=timeout)
            deadline = time.monotonic() + left_behind_s
            while self._alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            left = self._alive()
            assert not left, "the job left processes behind: " + "; ".join(
                f"{pid} ({(live_command(pid) or '?')[:120]})" for pid in left)
            return code
        finally:
            self.kill_everything()
            self._reader.join(timeout=5)

