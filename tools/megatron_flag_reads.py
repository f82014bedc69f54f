"""Writes where Megatron-LM's pretrain_gpt.py training path reads each flag's value.

A flag Megatron-LM's pretrain_gpt.py never reads changes nothing there; Megatron-Hetero
accepts it as a no-op (megatron/hetero/flags/catalog.py: ``noops``). This tool makes that
ruling reproducible: it parses (never runs) the code pretrain_gpt.py runs at the pinned tag
and records, for each flag's ``dest``, every place ``args.<dest>`` (or the string
``'<dest>'``, for getattr) appears:

    python -m tools.megatron_flag_reads /work/.mirror/NVIDIA+Megatron-LM/repo \\
        > megatron/hetero/flags/megatron_lm_reads.json

The path scanned: pretrain_gpt.py, gpt_builders.py, model_provider.py,
megatron/core/tokenizers/ (pretrain_gpt.py's build_tokenizer(args)) and megatron/training/ (its parser definitions, the ``_add_*_args`` functions, excluded: they
define flags, they do not read them; yaml_arguments.py excluded: it runs only with --yaml-cfg).
The rest of megatron-core is not scanned: it reads config dataclasses, not the flags.

Each read is "file:function", with the flags whose positive ``if args.<gate>:`` encloses it
(``gated_by``): such a read runs only when that other flag is given. A read inside an
``assert``, or in the test of an ``if`` whose body only asserts, is a ``check``: it can stop
a run, never change one.

``core_reads`` lists, for each config-field dest, the files of the installed megatron-core
that read it (``.<dest>``, or ``'<dest>'`` for getattr): a field megatron-core never reads,
or reads only in a feature's own package (Megatron-FSDP, Mamba, Muon, ...), changes nothing
through the config without that feature. ``config_fields`` names the megatron-core config dataclass (of the installed release, the
tag's) each dest is a field of: Megatron-LM copies every args attribute named like a
TransformerConfig field into the model's config (core_transformer_config_from_args), and
likewise for OptimizerConfig and DistributedDataParallelConfig, so such a flag takes effect
through megatron-core even where no ``args.<dest>`` appears.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

FACTS = Path(__file__).resolve().parent.parent / "hetero" / "spec" / "megatron_lm_flags.json"
ROOT_FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")
# pretrain_gpt.py builds its tokenizer with megatron.core.tokenizers' build_tokenizer(args).
SCANNED_DIRS = ("megatron/training", "megatron/core/tokenizers")
SKIPPED = ("megatron/training/yaml_arguments.py",)
# Functions Megatron-LM calls only when a flag is given (initialize.py: load_args_from_checkpoint
# under ``if args.use_checkpoint_args``; inprocess_restart.py: inprocess_restart under ``if
# args.inprocess_restart``; training.py: num_floating_point_operations' calculate_layer_counts
# under ``if args.is_hybrid_model``): reads inside them are gated by that flag.
FUNCTION_GATES = {"load_args_from_checkpoint": "use_checkpoint_args",
                  "inprocess_restart": "inprocess_restart",
                  "calculate_layer_counts": "is_hybrid_model"}


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={repo}", *args], check=True, capture_output=True,
                          text=True).stdout


def _path_files(repo: str, tag: str) -> list[str]:
    listed = _git(repo, "ls-tree", "-r", "--name-only", tag, *SCANNED_DIRS, *ROOT_FILES).split()
    return [f for f in listed if f.endswith(".py") and f not in SKIPPED]


def _early_return_gate(statement: ast.stmt) -> set[str]:
    """``if not args.x: return``: the rest of the function runs only with x."""
    if (isinstance(statement, ast.If) and isinstance(statement.test, ast.UnaryOp)
            and isinstance(statement.test.op, ast.Not) and len(statement.body) == 1
            and isinstance(statement.body[0], ast.Return) and not statement.orelse):
        return _positive_gates(statement.test.operand)
    return set()


def _positive_gates(test: ast.expr) -> set[str]:
    """``args.x`` names an if-test requires to be true (``a and b``: both; ``not``: none)."""
    if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name) and test.value.id == "args":
        return {test.attr}
    if (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "getattr"
            and len(test.args) >= 2 and isinstance(test.args[0], ast.Name) and test.args[0].id == "args"
            and isinstance(test.args[1], ast.Constant)
            and not (len(test.args) > 2 and isinstance(test.args[2], ast.Constant) and test.args[2].value)):
        return {test.args[1].value}  # getattr(args, "x", False), not getattr(args, "x", True)
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return set().union(*(_positive_gates(v) for v in test.values))
    return set()


class _Reads(ast.NodeVisitor):
    def __init__(self, path: str, dests: set[str]):
        self.path, self.dests = path, dests
        self.function: list[str] = []
        self.gates: list[set[str]] = []
        self.checking = 0
        self.found: dict[str, list[dict]] = {}

    def _record(self, dest: str) -> None:
        if dest in self.dests:
            where = f"{self.path}:{self.function[0] if self.function else '<module>'}"
            gated = sorted(set().union(*self.gates))
            self.found.setdefault(dest, []).append({"at": where, "gated_by": gated,
                                                    "check": self.checking > 0})

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if not self.function and self.path.endswith("training/arguments.py") and node.name.startswith("_add_"):
            return  # the parser's own definitions
        self.function.append(node.name)
        gate = FUNCTION_GATES.get(node.name)
        self.gates.append({gate} if gate else set())
        pushed = 1
        for statement in node.body:
            self.visit(statement)
            if gates := _early_return_gate(statement):
                self.gates.append(gates)
                pushed += 1
        del self.gates[len(self.gates) - pushed:]
        self.function.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assert(self, node: ast.Assert) -> None:
        self.checking += 1
        self.generic_visit(node)
        self.checking -= 1

    def visit_If(self, node: ast.If) -> None:
        if not node.orelse and all(isinstance(child, ast.Assert) for child in node.body):
            self.visit_Assert(node)  # type: ignore[arg-type]  # only checks, test included
            return
        self.visit(node.test)
        self.gates.append(_positive_gates(node.test))
        for child in node.body:
            self.visit(child)
        self.gates.pop()
        for child in node.orelse:
            self.visit(child)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        """``args.a and args.b``: b is read only when a is true."""
        if not isinstance(node.op, ast.And):
            self.generic_visit(node)
            return
        pushed = 0
        for value in node.values:
            self.visit(value)
            self.gates.append(_positive_gates(value))
            pushed += 1
        del self.gates[len(self.gates) - pushed:]

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id == "args":
            self._record(node.attr)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and re.fullmatch(r"[a-z_][a-z0-9_]*", node.value, re.I):
            self._record(node.value)


def scan(repo: str, tag: str, dests: set[str]) -> dict[str, list[dict]]:
    reads: dict[str, list[dict]] = {}
    for path in _path_files(repo, tag):
        visitor = _Reads(path, dests)
        visitor.visit(ast.parse(_git(repo, "show", f"{tag}:{path}")))
        for dest, found in visitor.found.items():
            reads.setdefault(dest, []).extend(found)
    return reads


def config_fields(dests: set[str]) -> dict[str, str]:
    """dest -> the megatron-core config dataclass that has a field of that name."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    found: dict[str, str] = {}
    # MLATransformerConfig after TransformerConfig: its own fields only.
    for config in (DistributedDataParallelConfig, OptimizerConfig, MLATransformerConfig, TransformerConfig):
        for field in dataclasses.fields(config):
            if field.name in dests:
                found[field.name] = config.__name__
    return dict(sorted(found.items()))


def core_reads(dests: set[str]) -> dict[str, list[str]]:
    """dest -> the files of the installed megatron-core (relative to megatron/core) that read
    an attribute of that name; a config dataclass's own __post_init__ counts as a read."""
    import megatron.core

    root = Path(megatron.core.__file__).parent
    sources = {str(path.relative_to(root)): path.read_text() for path in sorted(root.rglob("*.py"))}
    return {dest: [name for name, text in sources.items()
                   if re.search(r"\.%s\b|['\"]%s['\"]" % (dest, dest), text)] for dest in sorted(dests)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.megatron_flag_reads",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("repo", help="Megatron-LM's git directory (a bare mirror is enough)")
    options = parser.parse_args(argv)
    facts = json.loads(FACTS.read_text())
    tag = facts["megatron_lm_tag"]
    dests = {f["dest"] for f in facts["flags"]}
    reads = scan(options.repo, tag, dests)
    document = {"megatron_lm_tag": tag, "scanned": [*ROOT_FILES, *SCANNED_DIRS],
                "config_fields": (fields := config_fields(dests)),
                "core_reads": core_reads(set(fields)),
                "reads": {d: reads.get(d, []) for d in sorted(dests)}}
    sys.stdout.write(json.dumps(document, indent=0, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
