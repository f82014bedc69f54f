"""Starting a planned job: per-node torchrun commands, and the elastic supervisor that
re-plans for the surviving nodes after a node is lost (given a runner that starts nodes)."""

from hetero.launch.commands import NodeCommand, main, node_commands, split_at_double_dash

__all__ = ["NodeCommand", "main", "node_commands", "split_at_double_dash"]
