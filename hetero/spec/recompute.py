"""Activation recomputation as the cost model names it: one string per stage or job.

"none", "full", or selective recomputation of megatron-core's modules
(TransformerConfig.recompute_modules): "selective" alone is Megatron's default module,
core_attn; "selective:layernorm,moe_act" names the modules (sorted, so one setting has one
name and one cache key).
"""

from __future__ import annotations

from typing import Iterable

from hetero.errors import HeteroError

MODES = ("none", "selective", "full")
MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""megatron-core 0.16's choices for --recompute-modules."""
DEFAULT_MODULES = frozenset({"core_attn"})


def selective(modules: Iterable[str] | None) -> str:
    """The name of selective recomputation of these modules (None: Megatron's default)."""
    chosen = DEFAULT_MODULES if modules is None else frozenset(modules)
    unknown = sorted(chosen - set(MODULES))
    if unknown:
        raise HeteroError(f"recompute modules {', '.join(unknown)}: megatron-core knows "
                          f"{', '.join(MODULES)}")
    if chosen == DEFAULT_MODULES:
        return "selective"
    return "selective:" + ",".join(sorted(chosen))


def mode(recompute: str) -> str:
    """none, selective or full."""
    name = recompute.split(":", 1)[0]
    if name not in MODES or (name != "selective" and ":" in recompute):
        raise HeteroError(f"recompute {recompute!r} is not one of none, full, selective or "
                          f"selective:MODULE,... (modules: {', '.join(MODULES)})")
    return name


def modules(recompute: str) -> frozenset[str]:
    """The modules a setting recomputes in every layer (empty for none and full)."""
    if mode(recompute) != "selective":
        return frozenset()
    if ":" not in recompute:
        return DEFAULT_MODULES
    chosen = frozenset(recompute.split(":", 1)[1].split(","))
    selective(chosen)  # names only modules megatron-core knows
    return chosen


def check(recompute: str) -> str:
    """The setting, after checking its name (a HeteroError that lists the choices)."""
    modules(recompute)
    return recompute
