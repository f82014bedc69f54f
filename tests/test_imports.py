"""The structure's promises, checked: import contracts (.importlinter) and a planner that
runs where torch and megatron cannot be imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Run before the planner: every import of torch or megatron (megatron-core or our runtime)
# fails, as on a laptop or login node that has neither.
WITHOUT_TORCH = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "megatron", "hetero_comm"):
            raise ImportError(f"{name} is not importable in this test")
        return None
sys.meta_path.insert(0, Refuse())
sys.argv = ["hetero-plan", *sys.argv[1:]]
from hetero.cli import main
sys.exit(main())
"""


def test_import_contracts_hold():
    """No torch/megatron/tools in hetero, hetero's layers, no cycles (.importlinter)."""
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), str(REPO / ".importlinter")], cwd=REPO, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_the_planner_runs_without_torch_or_megatron(tmp_path):
    plan = tmp_path / "plan.json"
    argv = ["--cluster", str(REPO / "examples/clusters/hethub_like.yaml"), "--model", "llama2-7b",
            "--global-batch-size", "256", "--seq-length", "2048", "--quiet", "-o", str(plan)]
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *argv], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert plan.exists() and "hetero-plan: wrote" in result.stdout
    explained = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "explain", str(plan)], cwd=tmp_path,
                               capture_output=True, text=True, timeout=300)
    assert explained.returncode == 0, explained.stderr[-3000:]


def test_the_blocker_really_blocks_torch():
    """The test above proves nothing if the blocker let torch through."""
    probe = WITHOUT_TORCH.split("sys.argv")[0] + "import torch\n"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "not importable in this test" in result.stderr


# What computes logical ranks: hetero/grid.py alone (a plan, the planner's placement, the
# runtime's groups and transfers ask its Grid).
RANK_ARITHMETIC = {"rank_at", "coords", "stage_offset", "logical_rank_at", "expert_local_rank", "expert_rank_at",
                   "tensor_group", "context_group", "data_group", "pipeline_group", "replica_ranks",
                   "expert_groups", "expert_data_groups", "expert_tensor_groups", "positions", "groups"}
GRID = "hetero.grid"


def _every_module() -> dict[str, Path]:
    modules = {}
    for package in ("hetero", "megatron/hetero", "hetero_comm", "tools"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name == "__main__.py":
                continue  # runs its command when imported
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            modules[module.removesuffix(".__init__")] = path
    return modules


def test_rank_arithmetic_lives_in_the_grid_alone():
    """Every module imported; none but hetero.grid defines a function or method of the grid's
    arithmetic (by name), and none writes Megatron's rank formula (t + tp * (d + ...))."""
    import ast
    import importlib
    import re

    formula = re.compile(r"\b(tp|tensor_parallel\w*|degree\w*)\s*\*\s*\(\s*\w+\s*\+\s*\w+\s*\*")
    found = []
    modules = _every_module()
    for name, path in modules.items():
        importlib.import_module(name)
        if name == GRID:
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in RANK_ARITHMETIC:
                found.append(f"{name}.{node.name} (line {node.lineno})")
        for number, line in enumerate(source.splitlines(), start=1):
            code = line.split("#")[0]
            if formula.search(code) and '"' not in code and "'" not in code:
                found.append(f"{name} line {number}: {line.strip()}")
    assert len(modules) > 100
    assert found == [], found
