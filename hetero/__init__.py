"""Megatron-Hetero's planning side: cluster and model specs, plan format, predictor, planner.

Framework-agnostic: nothing here imports torch or megatron.
"""

from hetero.errors import HeteroError, PlanError
from hetero.spec.model import ModelSpec
from hetero.plan import Plan

__all__ = ["HeteroError", "PlanError", "ModelSpec", "Plan"]
