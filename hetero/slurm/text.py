"""What Slurm says, read: the one-line records of `scontrol show ... -o` (nodes, partitions,
GRES), host lists, the switch topology, and the Slurm commands run to get them (a failure
names the likely cause). Shared by discover, the profiler's node choice and the launcher's
driver."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import Callable, Sequence

from hetero.errors import HeteroError

Runner = Callable[[Sequence[str], float], subprocess.CompletedProcess]

# A node in any of these states cannot run the probe, nor the job the spec is planned for.
UNAVAILABLE = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "FUTURE", "NOT_RESPONDING",
               "POWERED_DOWN", "POWER_DOWN", "POWERING_DOWN", "POWERING_UP", "INVAL", "UNKNOWN",
               "REBOOT_REQUESTED", "REBOOT_ISSUED", "MAINTENANCE", "MAINT"}

@dataclass(frozen=True)
class Gres:
    name: str
    type: str | None
    count: int


@dataclass(frozen=True)
class SlurmNode:
    """One node as `scontrol show node -o` describes it."""

    name: str
    state: str
    features: tuple[str, ...]
    gres: tuple[Gres, ...]
    partitions: tuple[str, ...]
    address: str = ""

    @property
    def available(self) -> bool:
        return not (set(re.split(r"[+*]", self.state.upper())) & UNAVAILABLE) and not self.state.endswith("*")

    @property
    def gpus(self) -> tuple[Gres, ...]:
        return tuple(g for g in self.gres if g.name == "gpu")


_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z_/]*)=")


def parse_fields(line: str) -> dict[str, str]:
    """KEY=VALUE pairs of one `scontrol show ... -o` line (values may hold spaces, as OS= and
    Reason= do: a value runs up to the next KEY=)."""
    matches = list(_KEY.finditer(line))
    fields = {}
    for m, after in zip(matches, matches[1:] + [None]):
        fields[m.group(1)] = line[m.end():after.start() if after else len(line)].strip()
    return fields


def _split_top(text: str, separator: str = ",") -> list[str]:
    """Splits at separators outside brackets and parentheses."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        if char == separator and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _none(value: str | None) -> str:
    return "" if value in (None, "(null)", "N/A", "none", "") else value


def parse_gres(text: str | None) -> tuple[Gres, ...]:
    """`gpu:h100:4(S:0-1),gpu:2,nic:1` -> Gres entries (socket bindings dropped)."""
    found = []
    for item in _split_top(_none(text)):
        parts = re.sub(r"\(.*\)$", "", item).split(":")
        name, gtype, count = parts[0], None, "1"
        if len(parts) == 2:
            if parts[1].isdigit():
                count = parts[1]
            else:
                gtype = parts[1]
        elif len(parts) >= 3:
            gtype, count = parts[1], parts[2]
        digits = re.match(r"\d+", count)
        found.append(Gres(name, gtype, int(digits.group()) if digits else 1))
    return tuple(found)


def parse_nodes(text: str) -> list[SlurmNode]:
    """The nodes of `scontrol show node -o` (one node a line)."""
    nodes = []
    for line in text.splitlines():
        if not line.startswith("NodeName="):
            continue
        f = parse_fields(line)
        features = f.get("ActiveFeatures") or f.get("AvailableFeatures") or f.get("Features")
        nodes.append(SlurmNode(
            name=f["NodeName"],
            state=f.get("State", "UNKNOWN"),
            features=tuple(x for x in _split_top(_none(features)) if x),
            gres=parse_gres(f.get("Gres")),
            partitions=tuple(_split_top(_none(f.get("Partitions")))),
            address=_none(f.get("NodeAddr")),
        ))
    return nodes


def parse_partitions(text: str) -> list[str]:
    """Partition names of `scontrol show partition -o`, in Slurm's order."""
    return [parse_fields(line)["PartitionName"] for line in text.splitlines()
            if line.startswith("PartitionName=")]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's host list syntax: `node[0-2,5],gpu[01-02]-x` -> node0 node1 node2 node5 gpu01-x gpu02-x."""
    hosts: list[str] = []
    for item in _split_top(text):
        match = re.search(r"\[([^\]]*)\]", item)
        if not match:
            hosts.append(item)
            continue
        head, tail = item[:match.start()], item[match.end():]
        for piece in match.group(1).split(","):
            low, _, high = piece.partition("-")
            width = len(low)
            for i in range(int(low), int(high or low) + 1):
                hosts += expand_hostlist(f"{head}{i:0{width}d}{tail}")
    return hosts


def parse_topology(text: str) -> dict[str, str]:
    """node -> the top switch of its tree, from `scontrol show topology` (topology/tree).
    Switches joined through upper switches form one tree: one fabric."""
    switches: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if line.strip().startswith("SwitchName="):
            f = parse_fields(line.strip())
            switches[f["SwitchName"]] = f
    parent: dict[str, str] = {}
    for name, f in switches.items():
        for child in expand_hostlist(_none(f.get("Switches"))):
            parent[child] = name

    def top(switch: str) -> str:
        seen = set()
        while switch in parent and switch not in seen:
            seen.add(switch)
            switch = parent[switch]
        return switch

    islands = {}
    for name, f in switches.items():
        for node in expand_hostlist(_none(f.get("Nodes"))):
            islands.setdefault(node, top(name))
    return islands


def run_command(command: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(command), 124, "", f"no answer in {timeout:.0f} s")


def slurm_output(run: Runner, *command: str) -> str:
    done = run(command, 60)
    if done.returncode != 0:
        raise HeteroError(f"`{' '.join(command)}` failed: {(done.stderr or done.stdout).strip()[:500]}\n"
                          "check that slurmctld is up and that SLURM_CONF (or /etc/slurm/slurm.conf) is "
                          "this cluster's configuration")
    return done.stdout


def scontrol_show(what: str, run: Runner = run_command) -> str:
    """`scontrol show WHAT -o` of the Slurm cluster that scontrol on PATH talks to (node,
    partition: parse_nodes, parse_fields read it); a failure names the likely cause."""
    return slurm_output(run, "scontrol", "show", what, "-o")
