"""The megatron-core releases the runtime runs on: the start-up check, each patch's releases,
setup.py's range. Runs on every tested release (`make test` runs it on both)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.errors import HeteroError
from megatron.hetero.core_version import (
    ALLOW_UNTESTED_FLAG,
    TESTED_MEGATRON_CORE,
    check_megatron_core_version,
    installed_megatron_core,
    patches_release,
)

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.core019


def test_the_installed_release_is_tested_and_read_without_a_git_hash():
    # megatron-core 0.17+ appends '+<git hash>' to __version__ when it lies in a git checkout
    assert installed_megatron_core() in TESTED_MEGATRON_CORE
    assert check_megatron_core_version() == installed_megatron_core()


def test_an_untested_release_is_refused_with_the_tested_ones_and_the_override(monkeypatch):
    monkeypatch.delenv("HETERO_ALLOW_UNTESTED_MEGATRON_CORE", raising=False)
    with pytest.raises(HeteroError) as refused:
        check_megatron_core_version(version="0.18.2")
    message = str(refused.value)
    assert "megatron-core 0.18.2 is installed" in message
    assert all(release in message for release in TESTED_MEGATRON_CORE)
    assert ALLOW_UNTESTED_FLAG in message and "HETERO_ALLOW_UNTESTED_MEGATRON_CORE=1" in message


@pytest.mark.parametrize("allow", ["flag", "environment"])
def test_the_override_runs_an_untested_release_with_a_warning(allow, monkeypatch):
    if allow == "environment":
        monkeypatch.setenv("HETERO_ALLOW_UNTESTED_MEGATRON_CORE", "1")
    with pytest.warns(UserWarning, match="megatron-core 0.20.0 is installed.*patches of 0.19.2"):
        assert check_megatron_core_version(allow_untested=allow == "flag", version="0.20.0") == "0.20.0"


def test_an_untested_release_takes_the_patches_of_the_nearest_tested_one_below():
    assert patches_release("0.16.1") == "0.16.1"
    assert patches_release("0.18.2") == "0.16.1"
    assert patches_release("0.19.3") == "0.19.2"
    assert patches_release("0.20.0rc1") == "0.19.2"
    assert patches_release("0.15.0") == "0.16.1"  # older than all: the oldest


def test_every_patch_states_tested_releases_and_each_release_has_its_own_set():
    from megatron.hetero.patches import PATCHES, patches_for

    for patch in PATCHES:
        assert patch.versions and set(patch.versions) <= set(TESTED_MEGATRON_CORE), patch.name
    writers = "checkpoint-writers-die-with-rank"  # megatron-core 0.17+ writes with threads
    assert writers in [p.name for p in patches_for("0.16.1")]
    assert writers not in [p.name for p in patches_for("0.19.2")]


def test_setup_accepts_the_tested_releases_and_no_untested_line():
    from packaging.specifiers import SpecifierSet

    spec = re.search(r'"megatron-core([^"]*)"', (REPO / "setup.py").read_text()).group(1)
    accepted = SpecifierSet(spec)
    assert all(release in accepted for release in TESTED_MEGATRON_CORE)
    assert not any(release in accepted for release in ("0.16.0", "0.17.1", "0.18.2", "0.19.1", "0.20.0"))


def test_the_patch_list_names_the_release_and_its_patches():
    listed = subprocess.run([sys.executable, "-m", "megatron.hetero.patches"], cwd=REPO, text=True,
                            capture_output=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith(f"megatron-core {installed_megatron_core()} (tested: ")
    assert "checkpoint-writers-die-with-rank (" in listed.stdout
