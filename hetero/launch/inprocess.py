"""In-process restart: how a supervisor tells a running job's processes to carry on under a
new plan, without restarting them.

A job started with ``--inprocess-restart`` keeps its state in memory (snapshots, replicated
to peers on other nodes). When a node is lost, the surviving processes stop at the failed
iteration and wait; when a node comes back, every process finishes its iteration and waits.
The supervisor (the elastic runner, the emulator's ``--elastic``, the Slurm driver) plans the
job again for the nodes it has, hosts a fresh rendezvous store, and writes a ``Rejoin`` into
the job's control directory (``HETERO_CONTROL_DIR``): the new plan, the store's address, and
each process's new launch rank by where it runs (host and local rank). Processes not named
there leave; new processes of a returned node start with ``HETERO_REJOIN`` set and join.
Each process then rebuilds its process groups and its stage of the new plan in place and
restores its state from the survivors' snapshots (megatron/hetero/restart.py).

The control directory holds, per epoch (each re-plan of the job counts one up):
``epoch-N/rejoin.json`` (written by the supervisor, atomically) and ``epoch-N/ready/*.json``
(one per process that reached the point where it waits: its place and newest snapshot).
Torch-free: the supervisors import it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hetero import env
from hetero.errors import HeteroError
from hetero.io import write_json_atomic

if TYPE_CHECKING:
    from hetero.plan import Plan

CONTROL_DIR = "HETERO_CONTROL_DIR"
"""The job's control directory (set by the supervisor for every process of the job)."""
REJOIN = "HETERO_REJOIN"
"""Set to an epoch for the processes of a returned node: they join that epoch's plan."""


def place(host: str, local_rank: int) -> str:
    """A process's place in the cluster: its host and its local rank there."""
    return f"{host}:{local_rank}"


def places(plan: "Plan") -> dict[str, int]:
    """place(host, local rank) -> launch rank, for every process of the plan."""
    seen: dict[str, int] = {}
    found = {}
    for rank, device in enumerate(plan.devices):
        local = seen.get(device.host, 0)
        seen[device.host] = local + 1
        found[place(device.host, local)] = rank
    return found


@dataclass(frozen=True)
class Rejoin:
    """What every process of the job does next (module docstring)."""

    epoch: int
    plan: str
    """The plan to carry on under (a path every process can read)."""
    store_host: str
    store_port: int
    ranks: dict[str, int]
    """place(host, local rank) -> launch rank under the new plan; a process not named leaves."""
    after_iteration: int | None = None
    """A planned re-plan (a node returned): switch after this iteration; None: after a loss,
    from the newest snapshot the survivors hold."""

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def save(self, control_dir: str | os.PathLike) -> Path:
        path = Path(control_dir) / f"epoch-{self.epoch}" / "rejoin.json"
        write_json_atomic(path, asdict(self))
        return path

    @classmethod
    def load(cls, control_dir: str | os.PathLike, epoch: int) -> "Rejoin | None":
        path = Path(control_dir) / f"epoch-{epoch}" / "rejoin.json"
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as err:
            raise HeteroError(f"{path}: not a readable re-plan of the job ({err})") from None


def launch_environment(rejoin: Rejoin, where: str) -> dict | None:
    """The torchrun-style variables of the process at ``where`` under ``rejoin`` (None: it
    leaves the job). The new launch rank 0 hosts the rendezvous store."""
    if where not in rejoin.ranks:
        return None
    rank = rejoin.ranks[where]
    host = where.rsplit(":", 1)[0]
    local = sorted(r for p, r in rejoin.ranks.items() if p.rsplit(":", 1)[0] == host)
    return {env.RANK: str(rank), env.WORLD_SIZE: str(rejoin.world_size), env.LOCAL_RANK: str(local.index(rank)),
            env.LOCAL_WORLD_SIZE: str(len(local)), env.MASTER_ADDR: rejoin.store_host,
            env.MASTER_PORT: str(rejoin.store_port),
            # torchrun's agent hosted the first store; the new one is hosted by the new rank 0
            "TORCHELASTIC_USE_AGENT_STORE": "False"}


def report_returned(control_dir: str | os.PathLike, host: str) -> None:
    """A lost node is back and may take part again (written by whoever brings it back: an
    operator, the emulator's fault script; the Slurm driver sees it in Slurm's node states)."""
    write_json_atomic(Path(control_dir) / "returned" / f"{host}.json", {"host": host, "at": time.time()})


def returned(control_dir: str | os.PathLike) -> set[str]:
    """The hosts reported back (report_returned) and not yet taken in."""
    folder = Path(control_dir) / "returned"
    return {path.stem for path in folder.glob("*.json")} if folder.is_dir() else set()


def taken_back(control_dir: str | os.PathLike, hosts: set[str]) -> None:
    """Clears the return reports of hosts the job took in again."""
    for host in hosts:
        (Path(control_dir) / "returned" / f"{host}.json").unlink(missing_ok=True)


def report_ready(control_dir: str | os.PathLike, epoch: int, where: str, facts: dict) -> None:
    """A process waits for epoch's Rejoin: its place and what it holds (snapshot iteration)."""
    write_json_atomic(Path(control_dir) / f"epoch-{epoch}" / "ready" / f"{where.replace(':', '-')}.json",
                      {"place": where, "pid": os.getpid(), **facts})


def report_finished(control_dir: str | os.PathLike, epoch: int, where: str) -> None:
    """A process finished training under epoch's plan (torchrun's agent may then wait for
    agents that are gone: the supervisor ends it)."""
    write_json_atomic(Path(control_dir) / f"epoch-{epoch}" / "finished" / f"{where.replace(':', '-')}.json",
                      {"place": where, "pid": os.getpid()})


def finished(control_dir: str | os.PathLike, epoch: int) -> set[str]:
    """The places that finished training under epoch's plan."""
    return {report["place"] for report in _reports(control_dir, epoch, "finished")}


def ready(control_dir: str | os.PathLike, epoch: int) -> list[dict]:
    """The processes waiting for epoch's Rejoin."""
    return _reports(control_dir, epoch, "ready")


def _reports(control_dir: str | os.PathLike, epoch: int, kind: str) -> list[dict]:
    folder = Path(control_dir) / f"epoch-{epoch}" / kind
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being written: seen at the next look
    return found


def wait_for_rejoin(control_dir: str | os.PathLike, epoch: int, timeout_s: float, poll_s: float = 0.05) -> Rejoin:
    """Waits for the supervisor's Rejoin of ``epoch``."""
    deadline = time.monotonic() + timeout_s
    while True:
        rejoin = Rejoin.load(control_dir, epoch)
        if rejoin is not None:
            return rejoin
        if time.monotonic() > deadline:
            raise HeteroError(f"no re-plan of the job arrived in {control_dir} within {timeout_s:.0f} s "
                              f"(epoch {epoch}); is the job's supervisor running? Resume from the last "
                              "checkpoint with --load")
        time.sleep(poll_s)
