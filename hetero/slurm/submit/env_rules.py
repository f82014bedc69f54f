"""`--env [SELECTOR:]NAME=VALUE`: environment variables for the nodes a selector names (a node,
a device type, a feature or a NIC kind), and which rule wins on a node."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from hetero.errors import HeteroError
from hetero.spec.catalog import NIC_KINDS

_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class EnvRule:
    """`--env [SELECTOR:]NAME=VALUE`: a variable for the nodes the selector names (none:
    every node). SELECTOR is a node name, a device type, a feature or a NIC kind (ib, roce,
    ethernet, as the plan's cluster records the node's NIC)."""

    selector: str
    name: str
    value: str

    @classmethod
    def parse(cls, text: str) -> EnvRule:
        head, equals, value = text.partition("=")
        selector, _, name = head.rpartition(":")
        if not equals or not _VARIABLE.match(name):
            raise HeteroError(f"--env {text}: expected [SELECTOR:]NAME=VALUE, e.g. --env GLOO_SOCKET_IFNAME=eth0 "
                              "or --env ib:NCCL_IB_HCA=mlx5_0,mlx5_1 (SELECTOR: a node, device type, feature or "
                              f"NIC kind: {', '.join(NIC_KINDS)})")
        return cls(selector, name, value)

    def text(self) -> str:
        return f"{self.selector + ':' if self.selector else ''}{self.name}={self.value}"

    def precedence(self, node: str, device: str, nic: str | None, features: Sequence[str]) -> int | None:
        """How specifically the rule names the node (higher wins), None when it does not."""
        selector = self.selector.lower()
        if not selector:
            return 0
        if selector == node.lower():
            return 3
        if selector == device.lower() or selector in (f.lower() for f in features):
            return 2
        if nic is not None and selector == nic.lower():
            return 1
        return None


def env_for_node(rules: Sequence[EnvRule], node: str, device: str, nic: str | None,
                 features: Sequence[str]) -> dict[str, str]:
    """The variables the rules give one node: the most specific rule of each name wins (a
    node over a device type or feature, over a NIC kind, over every node), the later of
    two equally specific ones."""
    chosen: dict[str, tuple[int, str]] = {}
    for rule in rules:
        rank = rule.precedence(node, device, nic, features)
        if rank is not None and rank >= chosen.get(rule.name, (-1, ""))[0]:
            chosen[rule.name] = (rank, rule.value)
    return {name: value for name, (_, value) in chosen.items()}
