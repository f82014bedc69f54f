"""Helpers that launch real pretrain_gpt.py jobs (gloo on 127.0.0.1; forked ranks or torchrun)
and read their logs."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

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

_ITERATION = re.compile(r"^ \[[^]]+\] iteration\s+(\d+)/\s*\d+ \|(.*)$", re.MULTILINE)


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def series(self, field: str) -> list[float]:
        """One field of every iteration line (log interval 1), in order."""
        lines = _ITERATION.findall(self.stdout)
        assert [int(i) for i, _ in lines] == list(range(1, len(lines) + 1)), self.output[-3000:]
        return [float(re.search(rf" {field}: ([0-9.E+-]+) \|", rest).group(1)) for _, rest in lines]

    def losses(self) -> list[float]:
        return self.series("lm loss")


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
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(variable, None)
    if launcher == "fork" and script == REPO / "pretrain_gpt.py":
        if _job_server is None:
            _job_server = JobServer()
        return _job_server.run(nproc, args, full_env, timeout)
    if nproc == 1:
        command = [sys.executable, str(script), *args]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(script), *args,
        ]
    proc = subprocess.run(
        command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    return RunResult(proc.returncode, proc.stdout, proc.stderr)


def assert_same_training(reference: RunResult, candidate: RunResult, rtol: float = 1e-4) -> None:
    """Same lm loss and params norm at every iteration, up to rtol (relative)."""
    assert candidate.returncode == 0, candidate.output[-3000:]
    for field in ("lm loss", "params norm"):
        ref, got = reference.series(field), candidate.series(field)
        assert len(ref) == len(got) > 0, (field, ref, got)
        for i, (a, b) in enumerate(zip(ref, got), start=1):
            assert abs(a - b) <= rtol * abs(a), f"{field} at iteration {i}: {a} vs {b} ({ref} vs {got})"


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
        for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            full_env.pop(variable, None)
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

