"""The Slurm commands hetero-launch --slurm and its driver run (scontrol, sbatch, squeue,
scancel, salloc): each through a Runner (slurm_text.run_command: a command that does not
answer comes back as exit code 124, so that a hung slurmctld cannot hang us), the driver's
through one object (Slurm), so that a test can stand in for them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hetero.errors import HeteroError
from hetero.slurm import text as slurm_text
from hetero.slurm.text import Runner, run_command


# ----- before submitting: what Slurm has, and sbatch -------------------------------------------


@dataclass
class SlurmView:
    nodes: list[slurm_text.SlurmNode]
    partitions: list[str]
    default_partition: str | None


def read_slurm(run: Runner = run_command) -> SlurmView:
    """Nodes and partitions as `scontrol` reports them."""
    def scontrol(*what: str) -> str:
        done = run(["scontrol", "show", *what, "-o"], 60)
        if done.returncode != 0:
            raise HeteroError(f"`scontrol show {' '.join(what)}` failed: {(done.stderr or done.stdout).strip()[:400]}\n"
                              "check that slurmctld is up and that SLURM_CONF (or /etc/slurm/slurm.conf) is this "
                              "cluster's configuration")
        return done.stdout

    partitions_text = scontrol("partition")
    default = next((slurm_text.parse_fields(line)["PartitionName"] for line in partitions_text.splitlines()
                    if line.startswith("PartitionName=") and slurm_text.parse_fields(line).get("Default") == "YES"),
                   None)
    return SlurmView(slurm_text.parse_nodes(scontrol("node")), slurm_text.parse_partitions(partitions_text), default)


def submit(script: Path, run: Runner = run_command) -> str:
    """sbatch the script; the job id."""
    done = run(["sbatch", "--parsable", str(script)], 120)
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip()[:600]
        hint = ""
        if "Invalid feature" in reason:
            hint = "; a --constraint names a feature no node has (check --feature against sinfo -o '%N %f')"
        elif "node configuration is not available" in reason:
            hint = "; the partition cannot hold a component (too many nodes, GPUs or memory asked)"
        raise HeteroError(f"sbatch refused {script}: {reason}{hint}")
    return done.stdout.strip().split(";")[0]


# ----- inside the allocation: the driver's commands ----------------------------------------------


@dataclass
class JobView:
    nodes: list[str]  # held now (none once the job has ended)
    batch_host: str
    state: str


class Slurm:
    """The Slurm commands the driver uses (one place, so that a test can stand in for them)."""

    def __init__(self, run: Runner = run_command, workdir: str | None = None):
        self.run = run
        # `scontrol update` of a job's nodes writes slurm_job_<id>_resize.{sh,csh} into its
        # working directory: the run directory, not the user's checkout.
        self.workdir = workdir
        self.slurmd_started: dict[str, str] = {}

    def _checked(self, command: list[str], what: str, timeout: float = 60) -> str:
        done = self.run(command, timeout)
        if done.returncode != 0:
            raise HeteroError(f"{what}: `{' '.join(command)}` failed: {(done.stderr or done.stdout).strip()[:300]}")
        return done.stdout

    def nodes(self) -> dict[str, slurm_text.SlurmNode]:
        """Every node as `scontrol show node` reports it; slurmd_started: when each node's
        slurmd started (a node restarted since it was lost has a new one)."""
        text = self._checked(["scontrol", "show", "node", "-o"], "reading the nodes")
        self.slurmd_started = {fields["NodeName"]: fields.get("SlurmdStartTime", "")
                               for fields in map(slurm_text.parse_fields, text.splitlines()) if "NodeName" in fields}
        return {n.name: n for n in slurm_text.parse_nodes(text)}

    def job_nodes(self, job_id: str) -> list[str]:
        """The nodes a job (one component's job id) holds now; none once it has ended."""
        return self.job(job_id).nodes

    def job(self, job_id: str) -> JobView:
        """A job (one component's job id) as Slurm sees it now: the nodes it holds (none once
        it has ended: a component whose only node failed ends alone), its batch host, state."""
        text = self._checked(["scontrol", "show", "job", "-o", job_id], f"reading job {job_id}")
        for line in text.splitlines():
            fields = slurm_text.parse_fields(line)
            if fields.get("JobId") == job_id:
                state = fields.get("JobState", "")
                node_list = fields.get("NodeList", "")
                running = state in ("RUNNING", "SUSPENDED")
                nodes = [] if node_list in ("", "(null)") or not running else slurm_text.expand_hostlist(node_list)
                return JobView(nodes, fields.get("BatchHost", ""), state)
        return JobView([], "", "")

    def shrink(self, job_id: str, keep: list[str]) -> None:
        chdir = ["env", f"--chdir={self.workdir}"] if self.workdir else []
        self._checked([*chdir, "scontrol", "update", f"JobId={job_id}", f"NodeList={','.join(keep)}"],
                      f"taking lost nodes out of job {job_id}")

    def cancel(self, *ids: str) -> None:
        if ids:
            self.run(["scancel", *ids], 30)

    def steps(self, job_ids: Sequence[str]) -> list[tuple[str, str]]:
        """(step id, step name) of the jobs' running steps."""
        done = self.run(["squeue", "--steps", "-h", "-o", "%i|%j", "-j", ",".join(job_ids)], 30)
        return [tuple(line.split("|", 1)) for line in done.stdout.splitlines() if "|" in line]

    def time_left(self, job_id: str) -> str | None:
        """The job's remaining time as sbatch --time takes it; None when unlimited or unknown."""
        done = self.run(["squeue", "-h", "-j", job_id, "-o", "%L"], 30)
        left = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
        return left if left and left not in ("UNLIMITED", "INVALID", "NOT_SET") else None

    def allocate(self, node: str, options: list[str], name: str) -> tuple[str | None, str]:
        """A one-node allocation of node now (no waiting): (job id or None, what salloc said)."""
        done = self.run(["salloc", "--no-shell", "--immediate=10", "-J", name, "-N1", "-w", node, *options], 60)
        said = (done.stderr + done.stdout).strip()
        for line in said.splitlines():
            if "Granted job allocation" in line:
                return line.rsplit(" ", 1)[-1], said
        return None, said
