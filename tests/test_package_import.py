"""Importing megatron.hetero changes nothing in megatron-core until the runtime starts.

Each check runs in a fresh interpreter: the test process has imported megatron-core long
before (other tests, conftest's helpers).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

REPORT = """
import json, sys
import torch
compile_before = torch.compile
{imports}
patches = sys.modules.get("megatron.hetero.patches")
core_jit = sys.modules.get("megatron.core.jit")
print(json.dumps({{
    "megatron_core": "megatron.core" in sys.modules,
    "applied": list(patches._applied) if patches else [],
    "torch_compile_restored": torch.compile is compile_before,
    "jit_fuser_is_torch_compile": core_jit is not None and core_jit.jit_fuser is compile_before,
}}))
"""


def _imported(*modules: str) -> dict:
    code = REPORT.format(imports="\n".join(f"import {m}" for m in modules))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_the_package_imports_no_megatron_core_and_applies_no_patch():
    state = _imported("megatron.hetero")
    assert state == {"megatron_core": False, "applied": [], "torch_compile_restored": True,
                     "jit_fuser_is_torch_compile": False}


def test_the_checks_before_start_up_import_no_megatron_core():
    """pretrain_gpt.py parses, plans and validates before megatron-core exists in the process
    (a bad launch fails in seconds); so do the flag tools."""
    state = _imported("megatron.hetero.pretrain", "megatron.hetero.startup", "megatron.hetero.arguments",
                      "megatron.hetero.flags", "tools.flags_doc")
    assert not state["megatron_core"] and state["applied"] == []


def test_a_module_that_needs_megatron_core_imports_it_with_compiles_deferred():
    """Importing the model imports megatron-core as patches.import_megatron_core does (its
    fused helpers compiled at their first call, not torch.compile'd at import), and still
    applies no patch: that is startup.start_megatron_core's."""
    state = _imported("megatron.hetero.model", "megatron.hetero.training")
    assert state == {"megatron_core": True, "applied": [], "torch_compile_restored": True,
                     "jit_fuser_is_torch_compile": False}
