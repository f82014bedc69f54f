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
