"""The documents stay short, true to the tree and free of internal bookkeeping.

- README.md is a user guide of at most 250 lines;
- no internal references (issue/round/stop numbers) in README.md, docs/*.md and the
  folder READMEs, and no dates except in docs/results.md;
- every relative link points to an existing file;
- every `python -m X` names a module that exists, every repository path named exists,
  every `make X` is a Makefile target, every top-level folder is in README's layout;
- every patch named in the documents is one of megatron/hetero/patches/, and the
  generated patch list of docs/compatibility.md is what `python -m tools.patches_doc` renders.

Reads files only: no torch, no megatron-core.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from tools import patches_doc

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
FOLDER_READMES = [REPO / "csrc" / "README.md", REPO / "tools" / "README.md"]
ALL_DOCS = [README, *DOCS, *FOLDER_READMES]
# Written by hand by this project's documentation (the generated flags.md and the plan
# format's own page are checked for links and bookkeeping only).
OWN_DOCS = [README, *FOLDER_READMES,
            *(REPO / "docs" / name for name in ("results.md", "compatibility.md", "faults.md",
                                                 "architecture.md"))]
RESULTS = REPO / "docs" / "results.md"
TOP_LEVEL = ("hetero", "hetero_comm", "megatron", "tools", "bench", "tests", "examples", "docs", "csrc")

INTERNAL = re.compile(r"\b(issue|round|stop)\s+#?\d", re.IGNORECASE)
DATE = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
MODULE_RUN = re.compile(r"(?:\bpython[\w.]*|\s--)\s+-m\s+([A-Za-z_][\w.]*)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*-]*)" % "|".join(TOP_LEVEL))
BARE_PY = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.py)\b")
MAKE_TARGET = re.compile(r"\bmake\s+([a-z][\w-]*)")
NAMED_PATCH = re.compile(r"\bpatch(?:es)?\s+`([a-z0-9-]+)`")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _existing(paths: list[Path]) -> list[Path]:
    return [p for p in paths if p.exists()]


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text()


# ---- size and bookkeeping --------------------------------------------------------------------

def test_readme_is_a_short_user_guide(readme):
    lines = readme.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move details to docs/ (at most 250)"
    for command in ("make demo", "make test", "hetero-plan", "--hetero-plan", "python -m hetero.launch"):
        assert command in readme, f"README.md no longer says how to use {command}"


@pytest.mark.parametrize("doc", _existing(ALL_DOCS), ids=_rel)
def test_no_internal_references(doc):
    found = [f"{_rel(doc)}:{n}: {line.strip()}" for n, line in enumerate(doc.read_text().splitlines(), 1)
             if INTERNAL.search(line)]
    assert not found, ("internal references (issue/round/stop numbers) mean nothing to a user; "
                       "say what the thing is instead:\n" + "\n".join(found))


@pytest.mark.parametrize("doc", [d for d in _existing(ALL_DOCS) if d != RESULTS], ids=_rel)
def test_no_dated_lines(doc):
    found = [f"{_rel(doc)}:{n}: {line.strip()}" for n, line in enumerate(doc.read_text().splitlines(), 1)
             if DATE.search(line)]
    assert not found, ("dated lines belong to git history (a measurement's date, if needed, to "
                       "docs/results.md):\n" + "\n".join(found))


# ---- links and names point at something real ----------------------------------------------------

def _targets(text: str) -> list[str]:
    targets = LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [t for t in targets if not re.match(r"^(?:[a-z][a-z0-9+.-]*:|#)", t, re.IGNORECASE)]


@pytest.mark.parametrize("doc", _existing(ALL_DOCS), ids=_rel)
def test_relative_links_point_to_existing_files(doc):
    broken = []
    for target in _targets(doc.read_text()):
        path = target.split("#", 1)[0]
        if path and not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{_rel(doc)} links to missing files: {broken}"


def _module_exists(name: str) -> bool:
    parts = name.split(".")
    base = REPO.joinpath(*parts)
    if (REPO / parts[0]).exists() or (REPO / f"{parts[0]}.py").exists():
        return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()
    if parts[0] == "megatron":  # megatron-core: a namespace shared with this repository
        return False
    return importlib.util.find_spec(parts[0]) is not None


@pytest.mark.parametrize("doc", _existing(OWN_DOCS), ids=_rel)
def test_python_dash_m_modules_exist(doc):
    text = doc.read_text()
    missing = sorted({m for m in MODULE_RUN.findall(text) if not _module_exists(m)})
    assert not missing, f"{_rel(doc)} runs modules that do not exist: {missing}"


def _path_exists(path: str) -> bool:
    path = path.rstrip(".,:;")
    if any(c in path for c in "*?["):
        return any(REPO.glob(path))
    return (REPO / path).exists()


@pytest.mark.parametrize("doc", _existing(OWN_DOCS), ids=_rel)
def test_named_repository_paths_exist(doc):
    text = doc.read_text()
    missing = sorted({p for p in REPO_PATH.findall(text) if not _path_exists(p)})
    assert not missing, f"{_rel(doc)} names paths that do not exist: {missing}"


def _python_files() -> set[str]:
    skip = {".venv", "build", "runs", ".git"}
    return {p.name for p in REPO.rglob("*.py") if not skip & set(p.relative_to(REPO).parts)}


@pytest.mark.parametrize("doc", _existing(OWN_DOCS), ids=_rel)
def test_named_python_files_exist(doc):
    """A file named without its folder (`cpu_device.py` in the layout table) exists somewhere."""
    known = _python_files()
    missing = sorted({name for name in BARE_PY.findall(doc.read_text()) if name not in known})
    assert not missing, f"{_rel(doc)} names Python files that do not exist: {missing}"


def test_make_targets_exist(readme):
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    for doc in _existing(OWN_DOCS):
        named = set(MAKE_TARGET.findall(doc.read_text()))
        assert named <= targets, f"{_rel(doc)} names make targets the Makefile lacks: {sorted(named - targets)}"


def test_readme_layout_covers_every_top_level_folder(readme):
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    folders = {line.split("/", 1)[0] for line in tracked if "/" in line and not line.startswith(".")}
    folders = {f for f in folders if (REPO / f).is_dir()}
    layout = readme.split("## Where things are", 1)
    assert len(layout) == 2, "README.md has no '## Where things are' section"
    section = layout[1].split("\n## ", 1)[0]
    missing = sorted(f for f in folders if f"`{f}/" not in section)
    assert not missing, f"README.md's 'Where things are' leaves out {missing}"


# ---- the patch list ----------------------------------------------------------------------------

def test_patch_names_in_the_documents_are_real():
    names = {p.name for p in patches_doc.read_patches()}
    for doc in _existing(ALL_DOCS):
        named = set(NAMED_PATCH.findall(doc.read_text()))
        assert named <= names, (f"{_rel(doc)} names patches megatron/hetero/patches/ does not have: "
                                f"{sorted(named - names)}")


def test_the_patch_list_reads_every_patch():
    patches = patches_doc.read_patches()
    assert patches, "no patches read from megatron/hetero/patches/"
    for patch in patches:
        assert patch.why and patch.versions and patch.what, patch


def test_compatibility_patch_list_is_up_to_date():
    text = patches_doc.DOC_FILE.read_text()
    block = patches_doc.current_block(text)
    assert block is not None, "docs/compatibility.md lost its generated patch list (the BEGIN/END lines)"
    assert block == patches_doc.render(), (
        "docs/compatibility.md's patch list is out of date: run `python -m tools.patches_doc`")
