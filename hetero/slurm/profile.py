"""`hetero-plan profile --slurm`: the profiles `hetero-plan --profiles DIR` reads, measured on
the nodes of a Slurm cluster by one command.

    hetero-plan profile --slurm --cluster cluster.yaml -o profiles/ [--partition P ...] [--time T] \\
        [--micro-batch-sizes 1 2] [--tensor-parallel 1 2] -- <the model's Megatron flags>

The cluster spec names Slurm's nodes as its hosts (`hetero-plan discover --slurm` writes it
so). The nodes of one device type run alike, so one node of each is profiled:

1. Compute, one step per device type, all at once (each on its own node): on the first host
   of that type in the spec that Slurm can run a job on (not down or drained, in one of the
   --partition given), `srun -w NODE -N1 -n1 --exclusive --mem=0 --partition=P
   [--gres=gpu:N]` runs torchrun, which starts one rank per device of
   megatron.hetero.profiling.compute (--device-type: the spec's name). One srun task
   running torchrun, not one srun task per rank: the ranks start as a training job's do
   (hetero-launch --slurm runs torchrun per node too), each taking its device by LOCAL_RANK
   among the GPUs the step holds, and torchrun stops the node's other ranks when one fails.
2. Links, one step: one node of every node class (hosts of one group, device type, device
   count and NIC) and a second node of each class that has several, in one heterogeneous
   srun job (co-scheduled, one component per node with its own command line: its node
   rank, its Slurm name as --host, the rendezvous at the first node's NodeAddr, since node
   names need not resolve), run megatron.hetero.profiling.network: every pair of these
   nodes, and a node with itself where it has two devices or more.
3. Merge: the profiles are checked, every pair of the spec's hosts gets the link measured
   between nodes of its two classes, and the files are written to -o, each atomically and
   none before every step has succeeded. The steps write into a hidden folder under -o,
   which must therefore be on storage every node sees (as a training job's checkpoints);
   it is removed on success and on failure.

srun hands the caller's environment to every step: set there what the ranks need (e.g.
GLOO_SOCKET_IFNAME=eth0 where host names do not resolve). A failed step stops the others
(SIGTERM to srun, which cancels its job) and is an error naming its node and ending with
its output's tail.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from hetero.errors import HeteroError
from hetero.io import write_json_atomic
from hetero.slurm import text as slurm_text
from hetero.spec.cluster import Cluster, Node
from hetero.spec.profiles import ComputeProfile, LinkProfile
from hetero.slurm.steps import Step, StepError, run_steps, terminate_as_interrupt

PROFILERS = "megatron.hetero.profiling"
JOB_NAME = "hetero-profile"
# What of a step's output is progress: the profilers' lines and srun's own (queued, errors).
PROGRESS = re.compile(r"^(\[(profile|links|allreduce)\b|srun: )")


class ProfileError(HeteroError):
    """A profiling step failed or wrote no valid profile; the message names its node."""


@dataclass
class ProfileOptions:
    cluster: str
    """the cluster spec (YAML) whose hosts are Slurm's node names"""
    output_dir: str
    model_flags: list[str]
    """the model's Megatron flags (pretrain_gpt.py's), as training will get them"""
    partitions: list[str] = field(default_factory=list)
    """each node's steps run in the first of these that holds it (none: Slurm's default
    partition where it holds the node, else the node's first)"""
    account: str | None = None
    time: str | None = None
    """srun --time of every step"""
    micro_batch_sizes: tuple[int, ...] = (1, 2)
    tensor_parallel: tuple[int, ...] = (1,)
    """degrees to profile; a node profiles those that divide its device count"""
    repeats: int = 16
    one_size_at_a_time: bool = False
    message_mib: float = 8.0
    rounds: int = 5
    master_port: int = 29500
    python: str = sys.executable
    """the Python of the environment on the nodes"""


@dataclass(frozen=True)
class Chosen:
    """A node that stands for the others of its class: the spec's facts and Slurm's."""

    host: str
    device: str
    count: int
    address: str
    partition: str
    gpus: int
    """GPU GRES Slurm lists on the node (0: none, no --gres)"""


# ----- which nodes ------------------------------------------------------------------------------


def node_class(node: Node) -> tuple:
    """What makes two nodes' links alike: group (fabric), device type, device count, NIC."""
    return node.group, node.device.name, node.count, node.nic.kind.name, node.nic.gbps


def default_partition(partitions_text: str) -> str | None:
    """Slurm's default partition, from `scontrol show partition -o`."""
    for line in partitions_text.splitlines():
        fields = slurm_text.parse_fields(line) if line.startswith("PartitionName=") else {}
        if fields.get("Default") == "YES":
            return fields["PartitionName"]
    return None


def choose_nodes(cluster: Cluster, slurm: Sequence[slurm_text.SlurmNode], partitions: Sequence[str],
                 default: str | None, notes: list[str]
                 ) -> tuple[list[Chosen], list[Chosen], dict[tuple, list[str]]]:
    """(one node per device type for the compute steps, the nodes of the links step, node
    class -> its chosen hosts: the first and, where the class has several, a second).
    A node runs in the first of `partitions` that holds it; none given: in `default` (Slurm's
    default partition) where it holds the node, else in the node's first."""
    by_name = {n.name: n for n in slurm}
    unknown = [n.host for n in cluster.nodes if n.host not in by_name]
    if unknown:
        raise HeteroError(f"{cluster.source}: host{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                          "not a node of this Slurm cluster: profile --slurm runs on the spec's hosts by name; "
                          "write the spec with `hetero-plan discover --slurm`")

    def partition(node: Node) -> str | None:
        held = by_name[node.host].partitions
        if partitions:
            return next((p for p in partitions if p in held), None)
        return default if default in held else next(iter(held), None)

    def usable(node: Node) -> bool:
        return by_name[node.host].available and partition(node) is not None

    def chosen(node: Node) -> Chosen:
        info = by_name[node.host]
        if info.gpus and sum(g.count for g in info.gpus) < node.count:
            raise HeteroError(f"{cluster.source}: {node.host} has {node.count} devices in the spec but Slurm lists "
                              f"{sum(g.count for g in info.gpus)} GPU(s) there; write the spec again with "
                              "`hetero-plan discover --slurm`")
        return Chosen(node.host, node.device.name, node.count, info.address or node.host, partition(node),
                      sum(g.count for g in info.gpus))

    where = f" in partition {', '.join(partitions)}" if partitions else ""
    compute: dict[str, Chosen] = {}
    classes: dict[tuple, list[str]] = {}
    for device in cluster.device_counts():
        nodes = [n for n in cluster.nodes if n.device.name == device]
        first = next((n for n in nodes if usable(n)), None)
        if first is None:
            states = ", ".join(f"{n.host} ({by_name[n.host].state}, partitions "
                               f"{','.join(by_name[n.host].partitions) or 'none'})" for n in nodes)
            raise HeteroError(f"no {device} node can take a job{where}: {states}; bring one back (scontrol "
                              "update nodename=... state=resume) or pick its partition with --partition")
        compute[device] = chosen(first)
    for node in cluster.nodes:
        hosts = classes.setdefault(node_class(node), [])
        if usable(node):
            hosts.append(node.host)
    profiled = {n.host for n in compute.values()}
    for key, hosts in classes.items():
        if not hosts:
            notes.append(f"no node of {key[1]} x{key[2]} in group {key[0]} can take a job{where}: its links stay "
                         "the spec's")
        # A compute step's node first: its links are measured where its layers were.
        hosts[:] = ([h for h in hosts if h in profiled] + [h for h in hosts if h not in profiled])[:2]
    links = [chosen(cluster.node(h)) for hosts in classes.values() for h in hosts]
    return list(compute.values()), links, {k: h for k, h in classes.items() if h}


# ----- the steps --------------------------------------------------------------------------------


def _srun_options(node: Chosen, options: ProfileOptions) -> list[str]:
    # The whole node, so that no other job's work is in the measurement; its GPUs by GRES,
    # which the step must hold to see them where Slurm constrains devices.
    result = ["-w", node.host, "-N1", "-n1", "--exclusive", "--mem=0", f"--partition={node.partition}"]
    if node.gpus:
        result.append(f"--gres=gpu:{node.gpus}")
    for flag, value in (("--account", options.account), ("--time", options.time)):
        if value:
            result.append(f"{flag}={value}")
    return result


def _torchrun(options: ProfileOptions, nodes: int, node_rank: int, ranks: int, master: str, port: int) -> list[str]:
    return [options.python, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={ranks}", f"--master-addr={master}", f"--master-port={port}"]


def compute_step(node: Chosen, options: ProfileOptions, out: Path) -> Step:
    degrees = [t for t in options.tensor_parallel if node.count % t == 0]
    if not degrees:
        raise HeteroError(f"--tensor-parallel {' '.join(map(str, options.tensor_parallel))}: none divides the "
                          f"{node.count} devices of {node.host} ({node.device}); add 1")
    profiler = ["-m", f"{PROFILERS}.compute", "-o", str(out), "--device-type", node.device,
                "--micro-batch-sizes", *map(str, options.micro_batch_sizes),
                "--tensor-parallel", *map(str, degrees), "--repeats", str(options.repeats)]
    if options.one_size_at_a_time:
        profiler.append("--one-size-at-a-time")
    # One node: the rendezvous on its loopback (its host name need not resolve).
    command = ["srun", "-J", JOB_NAME, "--kill-on-bad-exit=1", *_srun_options(node, options),
               *_torchrun(options, 1, 0, node.count, "127.0.0.1", options.master_port),
               *profiler, "--", *options.model_flags]
    ranks = f"{node.count} rank{'s' if node.count > 1 else ''}"
    return Step(f"compute of {node.device} on {node.host} ({ranks}, tp {' '.join(map(str, degrees))})",
                node.host, command)


def links_step(nodes: list[Chosen], options: ProfileOptions, out: Path) -> Step | None:
    """The heterogeneous srun of the links step; None when there is nothing to measure (one
    node with one device)."""
    if len(nodes) < 2 and all(n.count < 2 for n in nodes):
        return None
    command = ["srun", "-J", JOB_NAME, "--kill-on-bad-exit=1"]
    for rank, node in enumerate(nodes):
        if rank:
            command.append(":")
        command += [*_srun_options(node, options),
                    *_torchrun(options, len(nodes), rank, node.count, nodes[0].address, options.master_port + 1),
                    "-m", f"{PROFILERS}.network", "-o", str(out), "--host", node.host,
                    "--message-mib", f"{options.message_mib:g}", "--rounds", str(options.rounds)]
    return Step(f"links between {', '.join(n.host for n in nodes)}", "links", command)


# ----- the profiles directory ------------------------------------------------------------------


def _load(path: Path, schema: type[ComputeProfile] | type[LinkProfile], step: str) -> ComputeProfile | LinkProfile:
    """The profile a step wrote, checked against its schema."""
    if not path.is_file():
        raise ProfileError(f"{step} ended without writing {path.name} to {path.parent}: the nodes write where -o "
                           "is, so -o must be on storage every node sees (as a training job's checkpoints)")
    try:
        return schema.model_validate(json.loads(path.read_text()))
    except ValueError as err:  # pydantic's ValidationError and json's JSONDecodeError are ValueErrors
        raise ProfileError(f"{step} wrote an invalid {path.name}: {err}") from None


def every_link(measured: LinkProfile, cluster: Cluster, classes: dict[tuple, list[str]]) -> dict:
    """The links profile for every pair of the spec's hosts (and every host with itself that
    has two devices or more): the measured link where there is one, else the link measured
    between the chosen nodes of the two hosts' classes."""
    found = {frozenset(link.hosts): link.model_dump(mode="json") for link in measured.links}

    def stand_in(a: Node, b: Node) -> dict | None:
        first, second = classes.get(node_class(a), []), classes.get(node_class(b), [])
        if not first or not second:
            return None
        if a.host == b.host:
            pair = (first[0], first[0])
        elif node_class(a) == node_class(b):
            pair = tuple(first[:2]) if len(first) == 2 else None
        else:
            pair = (first[0], second[0])
        return found.get(frozenset(pair)) if pair else None

    links, stand_ins = [], 0
    for i, a in enumerate(cluster.nodes):
        for b in cluster.nodes[i if a.count >= 2 else i + 1:]:
            link = found.get(frozenset((a.host, b.host)))
            if link is None:
                link = stand_in(a, b)
                stand_ins += link is not None
            if link is not None:
                links.append({**link, "hosts": [a.host, b.host]})
    note = measured.measured_on or ""
    if stand_ins:
        note += (f"; {stand_ins} more pair(s) of hosts given the link measured between nodes of their node classes "
                 "(group, device, device count, NIC) by hetero-plan profile --slurm")
    return {**measured.model_dump(mode="json"), "links": links, "measured_on": note}


def profile_slurm(options: ProfileOptions, progress: Callable[[str], None] = print) -> list[Path]:
    """Profiles the cluster (module docstring); the files written."""
    missing = [c for c in ("srun", "scontrol") if shutil.which(c) is None]
    if missing:
        raise HeteroError(f"profile --slurm needs Slurm's {' and '.join(missing)} on PATH: run it on a login node "
                          "of the cluster, or install the Slurm client (Debian: slurm-client) and point SLURM_CONF "
                          "at the cluster's slurm.conf")
    if not options.model_flags:
        raise HeteroError("give the model's Megatron flags after `--` (e.g. -- --num-layers 32 --hidden-size 4096 "
                          "...), as training will get them: the profile is of that model's layers")
    cluster = Cluster.load(options.cluster)
    partitions = slurm_text.scontrol_show("partition")
    known = slurm_text.parse_partitions(partitions)
    unknown = [p for p in options.partitions if p not in known]
    if unknown:
        raise HeteroError(f"partition {', '.join(unknown)} does not exist in this Slurm cluster; its partitions: "
                          f"{', '.join(known) or 'none'} (sinfo -s lists them)")
    notes: list[str] = []
    compute, link_nodes, classes = choose_nodes(cluster, slurm_text.parse_nodes(slurm_text.scontrol_show("node")),
                                                options.partitions, default_partition(partitions), notes)
    out = Path(options.output_dir).absolute()
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=out))
    except OSError as err:
        raise HeteroError(f"cannot write the profile directory {out}: {err}; pick another -o") from None
    try:
        with terminate_as_interrupt():
            files = _profile(options, cluster, compute, link_nodes, classes, staging, notes, progress)
    except (StepError, ProfileError) as err:
        raise ProfileError(f"{err}\nnothing was written to {out}; fix the problem above and run again") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for name, data in files.items():
        try:
            write_json_atomic(out / name, data)
        except OSError as err:
            raise HeteroError(f"cannot write {out / name}: {err}; free space or pick another -o") from None
    return [out / name for name in files]


def _profile(options: ProfileOptions, cluster: Cluster, compute: list[Chosen], link_nodes: list[Chosen],
             classes: dict[tuple, list[str]], staging: Path, notes: list[str],
             progress: Callable[[str], None]) -> dict[str, dict]:
    """Runs the steps into staging; file name -> the profile to write."""
    steps = [compute_step(node, options, staging / f"compute-{node.host}") for node in compute]
    links = links_step(link_nodes, options, staging / "links")
    progress(f"hetero-plan profile: {', '.join(f'{n.device} on {n.host}' for n in compute)}; links "
             + (f"between {', '.join(n.host for n in link_nodes)}" if links else "none (one node with one device)"))
    for note in notes:
        progress(f"note: {note}")
    started = time.monotonic()
    progress(f"[1/2] compute: {len(steps)} step{'s' if len(steps) > 1 else ''}, one per device type, at once")
    run_steps(steps, progress, PROGRESS)
    files = {}
    for node in compute:
        path = staging / f"compute-{node.host}" / f"compute-{node.device}.json"
        _load(path, ComputeProfile, f"the compute step on {node.host}")
        files[path.name] = json.loads(path.read_text())
    if links is None:
        return files
    progress(f"[2/2] links: one step over {len(link_nodes)} nodes ({time.monotonic() - started:.0f} s so far)")
    run_steps([links], progress, PROGRESS)
    measured = _load(staging / "links" / "links.json", LinkProfile, links.name)
    files["links.json"] = every_link(measured, cluster, classes)
    progress(f"profiled in {time.monotonic() - started:.0f} s")
    return files


