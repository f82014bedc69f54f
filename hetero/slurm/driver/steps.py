"""One node's srun step (see driver.py's docstring, "Starting", for why one step per node):
its srun command line, its environment, a probe whether the node's slurmd still runs steps,
and stopping an attempt's steps."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

from hetero import env as hetero_env
from hetero.slurm.submit.env_rules import env_for_node

# Device visibility and srun's per-job inputs: what the batch environment holds for
# component 0 alone (driver.py's docstring: "Starting").
LEAKED = {
    "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",
    "ZE_AFFINITY_MASK", "ASCEND_RT_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE",
    "SLURM_CPUS_PER_TASK", "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU",
    "SLURM_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_SOCKET", "SLURM_TRES_PER_TASK",
    "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_DISTRIBUTION",
    "SLURM_CPU_BIND", "SLURM_CPU_BIND_LIST", "SLURM_CPU_BIND_TYPE", "SLURM_CPU_BIND_VERBOSE", "SLURM_GRES",
}
STOP_WAIT_S = 5.0  # after SIGTERM to the steps, before SIGKILL and scancel
PROBE_TIMEOUT_S = 10.0


def step_environment(environ: dict[str, str], own_allocation: bool = False) -> dict[str, str]:
    """What a step's srun gets of the driver's environment: not what belongs to component 0
    alone (LEAKED); for a step of the driver's own allocation none of the main job's Slurm
    variables either (srun would take SLURM_HET_SIZE and the rest for that job's)."""
    return {k: v for k, v in environ.items()
            if k not in LEAKED and not (own_allocation and k.startswith("SLURM") and k != "SLURM_CONF")}


def _signal(proc: subprocess.Popen, signum: int) -> None:
    """Signals the step's srun, which may have ended meanwhile."""
    try:
        proc.send_signal(signum)
    except ProcessLookupError:
        pass


class NodeSteps:
    """The step methods of the driver's job (SlurmJob, job.py), which holds the state they
    read: slots, allocation, second_allocations, environ, env rules, the nodes' devices."""

    def srun(self, node: str, name: str) -> list[str]:
        """srun's command line for a step on the node: in its component (--het-group), in the
        driver's own allocation of it (--jobid), or in the one job of --layout single."""
        slot = self.slots[node]
        where = (["--het-group", str(slot.het_group)] if slot.het_group is not None else
                 [f"--jobid={slot.job_id}"] if slot.job_id != self.allocation.job_id else [])
        return ["srun", *where, "-w", node, "-N1", "-n1", "--overlap", "--kill-on-bad-exit=0",
                "-J", name, f"--chdir={self.workdir}"]

    def _base_env(self, node: str) -> dict[str, str]:
        return step_environment(self.environ, self.slots[node].job_id in self.second_allocations.values())

    def node_answers(self, node: str) -> bool:
        """Whether the node's slurmd runs a step now (a crashed node's does not)."""
        try:
            done = subprocess.run(self.srun(node, "hetero-probe") + ["true"], env=self._base_env(node),
                                  capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def silent_nodes(self, nodes: list[str]) -> set[str]:
        """Of these nodes, those whose slurmd runs no probe step (all probed at once)."""
        answers: dict[str, bool] = {}
        probes = [threading.Thread(target=lambda n=n: answers.__setitem__(n, self.node_answers(n)), daemon=True)
                  for n in nodes if n in self.slots]
        for probe in probes:
            probe.start()
        for probe in probes:
            probe.join(PROBE_TIMEOUT_S + 5)
        return {n for n in nodes if n in self.slots and not answers.get(n, False)}

    def step_env(self, node: str, node_env: dict[str, str], events_dir: Path) -> dict[str, str]:
        env = self._base_env(node)
        info = self._node_info.get(node)
        device = self.device_of.get(node, "")
        env.update(env_for_node(self.env_rules, node, device, self.nic_of.get(node),
                                info.features if info is not None else ()))
        env.update(node_env)
        env[hetero_env.EVENTS_DIR] = str(events_dir)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def stop_steps(self, procs: dict[str, subprocess.Popen], attempt: int, dead: set[str] = frozenset()) -> None:
        """SIGTERM to the srun processes (srun passes it to the node's torchrun and ranks);
        what is left after STOP_WAIT_S: SIGKILL, and scancel of the attempt's steps. A dead
        node's srun gets SIGKILL at once: there is nothing left to pass a signal to."""
        for host, proc in procs.items():
            _signal(proc, signal.SIGKILL if host in dead else signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [h for h, p in procs.items() if p.poll() is None]
        for host in left:
            _signal(procs[host], signal.SIGKILL)
        for proc in procs.values():
            proc.wait()
        if left:
            jobs = sorted({self.slots[h].job_id for h in left if h in self.slots} | {self.allocation.job_id})
            names = {f"hetero-{attempt}"}
            self.slurm.cancel(*[step for step, name in self.slurm.steps(jobs) if name in names])
