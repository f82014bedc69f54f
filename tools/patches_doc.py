"""Renders the list of megatron-core patches into docs/compatibility.md.

    python -m tools.patches_doc            # rewrite the generated block of docs/compatibility.md
    python -m tools.patches_doc --check    # exit 1 if that block is out of date
    python -m tools.patches_doc --print    # print the block

The source is the package megatron/hetero/patches/: the ``PATCHES`` tuple of its
``__init__.py`` (``Patch(name=..., why=..., needed=..., apply=..., versions=...)``), the
functions its modules define, and the tested releases of
megatron/hetero/core_version.py (``TESTED_MEGATRON_CORE``). The files are read with ``ast`` and
never imported: importing ``megatron.hetero`` imports megatron-core and torch. For each
patch the block gives its name, when it applies (the ``needed`` predicate), what it
changes (the megatron-core or torch attributes its ``apply`` function replaces, or the
module it hands the work to), why, and the megatron-core versions it was written for (every
patch states them). A string field ``what`` is used as written.

tests/test_docs.py checks that the committed block is what this renders.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATCHES_DIR = REPO / "megatron" / "hetero" / "patches"
PATCHES_FILE = PATCHES_DIR / "__init__.py"  # the Patch class and the PATCHES tuple
VERSIONS_FILE = REPO / "megatron" / "hetero" / "core_version.py"
DOC_FILE = REPO / "docs" / "compatibility.md"
BEGIN = ("<!-- BEGIN generated patch list: `python -m tools.patches_doc` renders it from "
         "megatron/hetero/patches/; do not edit by hand -->")
END = "<!-- END generated patch list -->"


@dataclass(frozen=True)
class PatchDoc:
    name: str
    when: str
    what: list[str]
    why: str
    versions: tuple[str, ...]


# ---- reading megatron/hetero/patches/ ----------------------------------------------------

def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _package_functions() -> dict[str, ast.FunctionDef]:
    """The functions of every module of the patches package (the ``needed`` and ``apply``
    functions PATCHES names are defined in its modules by concept)."""
    functions = {}
    for path in sorted(PATCHES_DIR.glob("*.py")):
        functions.update(_functions(ast.parse(path.read_text())))
    return functions


def _module_value(tree: ast.Module, name: str) -> ast.expr | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node.value
    return None


def _patch_fields(tree: ast.Module) -> list[str]:
    """The Patch dataclass's fields in order (for positional arguments)."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Patch":
            return [s.target.id for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    raise ValueError(f"{PATCHES_FILE}: no `class Patch`")


def _local_imports(function: ast.FunctionDef) -> dict[str, str]:
    """Names a function imports for itself -> their dotted origin."""
    names = {}
    for node in ast.walk(function):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
    return names


def _dotted(node: ast.expr, imports: dict[str, str]) -> str | None:
    """`moe_utils.te_general_gemm` -> megatron.core.transformer.moe.moe_utils.te_general_gemm."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in imports:
        return None
    return ".".join([imports[node.id], *reversed(parts)])


def _replaced(function: ast.FunctionDef) -> list[str]:
    """What an apply function changes: attributes it assigns in its own body (not in the
    functions it defines), else the calls it hands the work to."""
    imports = _local_imports(function)
    replaced = []
    for statement in function.body:
        if isinstance(statement, ast.Assign):
            for target in statement.targets:
                if isinstance(target, ast.Attribute) and (name := _dotted(target, imports)):
                    replaced.append(f"`{name}`")
    if replaced:
        return replaced
    delegated = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and (name := _dotted(node.func, imports)):
            module = name.rsplit(".", 1)[0]
            path = Path(*module.split(".")).with_suffix(".py")
            where = f" (`{path.as_posix()}`)" if (REPO / path).is_file() else ""
            delegated.append(f"what `{name}()` sets up{where}")
    return delegated


def _condition(node: ast.expr, functions: dict[str, ast.FunctionDef]) -> str:
    """When a patch applies, from its ``needed`` predicate."""
    if isinstance(node, ast.Lambda):
        body = node.body
        if isinstance(body, ast.Constant) and body.value is True:
            return "always"
        return f"when `{ast.unparse(body)}`"
    if isinstance(node, ast.Name) and node.id in functions:
        function = functions[node.id]
        doc = ast.get_docstring(function)
        if doc:
            return doc.strip().split("\n\n")[0].replace("\n", " ")
        returns = [s for s in function.body if isinstance(s, ast.Return) and s.value is not None]
        if len(returns) == 1:
            return f"when `{ast.unparse(returns[0].value)}`"
        return f"when `{node.id}()` is true"
    return f"when `{ast.unparse(node)}()` is true"


def _string(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def read_patches(source: str | None = None) -> list[PatchDoc]:
    tree = ast.parse(PATCHES_FILE.read_text() if source is None else source)
    functions = {**_package_functions(), **_functions(tree)}
    fields = _patch_fields(tree)
    tested = tested_releases()
    patches = _module_value(tree, "PATCHES")
    if not isinstance(patches, (ast.Tuple, ast.List)):
        raise ValueError(f"{PATCHES_FILE}: PATCHES is not a literal tuple of Patch(...)")
    docs = []
    for call in patches.elts:
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Patch"):
            raise ValueError(f"{PATCHES_FILE}:{call.lineno}: PATCHES holds something else than Patch(...)")
        given = dict(zip(fields, call.args))
        given.update({k.arg: k.value for k in call.keywords if k.arg})
        name = _string(given.get("name"))
        if name is None:
            raise ValueError(f"{PATCHES_FILE}:{call.lineno}: a Patch without a literal name")
        apply = given.get("apply")
        what = _string(given.get("what"))
        if what is not None:
            changes = [what]
        elif isinstance(apply, ast.Name) and apply.id in functions:
            changes = _replaced(functions[apply.id])
        else:
            changes = []
        versions = given.get("versions")
        if versions is None:
            raise ValueError(f"{PATCHES_FILE}:{call.lineno}: the patch {name} states no versions=(...): "
                             f"give the megatron-core releases it is written for ({', '.join(tested)})")
        versions = tuple(ast.literal_eval(versions))
        if not set(versions) <= set(tested):
            raise ValueError(f"{PATCHES_FILE}:{call.lineno}: the patch {name} names an untested megatron-core "
                             f"in {versions}: the tested ones are {', '.join(tested)} (core_version.py)")
        docs.append(PatchDoc(
            name=name,
            when=_condition(given["needed"], functions) if "needed" in given else "always",
            what=changes,
            why=" ".join((_string(given.get("why")) or "").split()),
            versions=versions,
        ))
    return docs


def tested_releases() -> tuple[str, ...]:
    """core_version.TESTED_MEGATRON_CORE, read without importing it."""
    value = _module_value(ast.parse(VERSIONS_FILE.read_text()), "TESTED_MEGATRON_CORE")
    if value is None:
        raise ValueError(f"{VERSIONS_FILE}: no TESTED_MEGATRON_CORE")
    return tuple(ast.literal_eval(value))


# ---- the block ---------------------------------------------------------------------------

def render(source: str | None = None) -> str:
    """The generated block, markers included."""
    patches = read_patches(source)
    tested = tested_releases()
    lines = [BEGIN, "", f"{len(patches)} patches, in the order they are applied; each under the tested "
             f"megatron-core releases it names ({' and '.join(tested)} are tested).", ""]
    for patch in patches:
        lines += [
            f"### `{patch.name}`",
            "",
            f"- **applies:** {patch.when}",
            f"- **changes:** {'; '.join(patch.what) if patch.what else 'see megatron/hetero/patches/'}",
            f"- **why:** {patch.why}",
            f"- **megatron-core:** {', '.join(patch.versions) or 'any'}",
            "",
        ]
    lines.append(END)
    return "\n".join(lines)


def current_block(text: str) -> str | None:
    """The generated block of a document, markers included, or None if it has none."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(END)]


def updated(text: str) -> str:
    block = current_block(text)
    if block is None:
        raise ValueError(f"{DOC_FILE} has no generated block (the line {BEGIN!r} ... {END!r})")
    return text.replace(block, render(), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.patches_doc", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/compatibility.md is out of date")
    mode.add_argument("--print", action="store_true", help="print the block instead of writing it")
    options = parser.parse_args(argv)
    if options.print:
        print(render())
        return 0
    text = DOC_FILE.read_text()
    new = updated(text)
    if options.check:
        if new != text:
            print(f"{DOC_FILE.relative_to(REPO)} is out of date: run python -m tools.patches_doc", file=sys.stderr)
            return 1
        return 0
    if new != text:
        tmp = DOC_FILE.with_name(f".{DOC_FILE.name}.tmp")
        tmp.write_text(new)
        os.replace(tmp, DOC_FILE)
        print(f"wrote {DOC_FILE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
