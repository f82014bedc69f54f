"""Writes the facts of every flag Megatron-LM's pretrain_gpt.py defines, by running its own parser.

Many of Megatron-LM's flags are generated from dataclasses (``ArgumentGroupFactory``), so
reading its source by eye misses some; building its parser does not. The output is the
interface only (names, defaults, value kinds, group titles), never help texts or code:

    git -C /work/.mirror/NVIDIA+Megatron-LM/repo archive core_v0.16.1 | tar -x -C /tmp/mlm
    python tools/extract_megatron_flags.py /tmp/mlm --tag core_v0.16.1 \\
        > hetero/spec/megatron_lm_flags.json
    # core_v0.19.0, with megatron-core 0.19.2 installed in .core019 (make test's)
    PYTHONPATH=.core019 python tools/extract_megatron_flags.py /tmp/mlm019 --tag core_v0.19.0 \\
        > hetero/spec/megatron_lm_flags.core_v0.19.0.json

``megatron.core`` is the installed megatron-core (same release as the tag); only
``megatron.training`` and ``megatron.post_training`` come from the checkout. pretrain_gpt.py
adds no flags of its own except nvidia-modelopt's post-training flags when that package is
installed; those are read from megatron/post_training/arguments.py and marked as such.
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib
import json
import importlib.abc
import importlib.machinery
import sys
import types
import typing
import unittest.mock
from pathlib import Path
from typing import Any

# argparse's action classes, by the name Megatron's recipes know them.
_ACTION_KINDS = {
    argparse._StoreAction: "store",
    argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false",
    argparse._StoreConstAction: "store_const",
    argparse._AppendAction: "append",
    argparse._CountAction: "count",
}
MODELOPT_GROUP_NOTE = "only with nvidia-modelopt installed"


def _json_value(value: Any) -> Any:
    """A default or choice as JSON: enums by member name, dtypes by name, the rest as-is."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _type_name(action: argparse.Action) -> str | None:
    kind = action.type
    if kind is None:
        return None
    if kind in (int, float, str):
        return kind.__name__
    if action.choices and all(isinstance(c, enum.Enum) for c in action.choices):
        return "enum"
    return getattr(kind, "__name__", type(kind).__name__)


def _group_titles(parser: argparse.ArgumentParser) -> dict[int, str]:
    return {id(a): group.title for group in parser._action_groups for a in group._group_actions}


def flag_facts(parser: argparse.ArgumentParser, source: str) -> list[dict[str, Any]]:
    titles = _group_titles(parser)
    facts = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        kind = _ACTION_KINDS.get(type(action), type(action).__name__)
        facts.append({
            "option_strings": list(action.option_strings),
            "dest": action.dest,
            "action": kind,
            "default": _json_value(action.default),
            "const": _json_value(action.const) if kind in ("store_const", "append_const") else None,
            "nargs": action.nargs,
            "type": _type_name(action),
            "choices": _json_value(list(action.choices)) if action.choices is not None else None,
            "group": titles.get(id(action)),
            "source": source,
        })
    return facts


class _StubModule(types.ModuleType):
    """Stands in for an optional package that is not installed: any attribute exists."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return unittest.mock.MagicMock(name=f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves stubs for the named top-level packages and all their submodules."""

    def __init__(self) -> None:
        self.packages: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 (importlib's API)
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: ANN001
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:  # noqa: ANN001
        pass


def _import_stubbing_missing(name: str) -> Any:
    """Imports a module; an optional third-party package that is not installed here and
    that megatron.training imports at module level (six, regex, triton on a CPU machine) is
    replaced by a stub. None of them decides which flags exist: the one conditional group,
    kitchen quantization's two flags, needs megatron-core's kitchen extension, which the
    public megatron-core 0.16.1 ships as a stub (HAVE_KITCHEN = False), so Megatron-LM never
    defines them either."""
    finder = _StubFinder()
    sys.meta_path.append(finder)
    while True:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            missing = (err.name or "").split(".")[0]
            if not missing or missing == "megatron" or missing in finder.packages:
                raise
            print(f"stubbing missing optional package {missing}", file=sys.stderr)
            finder.packages.add(missing)
            for stale in [m for m in sys.modules if m.startswith(("megatron.training",
                                                                  "megatron.post_training"))]:
                del sys.modules[stale]


def _megatron_parser(checkout: Path) -> argparse.ArgumentParser:
    # After site-packages: megatron.core stays the installed release, megatron.training and
    # megatron.post_training come from the checkout (``megatron`` is a namespace package).
    sys.path.append(str(checkout))
    if not hasattr(typing, "override"):  # Python 3.12's; core_v0.19.0's megatron.training imports it
        typing.override = lambda function: function
    arguments = _import_stubbing_missing("megatron.training.arguments")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    return parser


def _modelopt_parser(checkout: Path) -> argparse.ArgumentParser | None:
    """nvidia-modelopt's flags; its module imports nothing heavy at the top."""
    try:
        module = importlib.import_module("megatron.post_training.arguments")
    except ImportError as err:
        print(f"skipping post-training flags: {err}", file=sys.stderr)
        return None
    parser = argparse.ArgumentParser(allow_abbrev=False)
    module.add_modelopt_args(parser)
    return parser


def program_defaults(program: Path) -> dict[str, Any]:
    """The ``args_defaults`` a program passes to Megatron-LM's ``pretrain()`` (they replace
    the parser's default when the flag is not given), read from its syntax tree."""
    for node in ast.walk(ast.parse(program.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "pretrain":
            for keyword in node.keywords:
                if keyword.arg == "args_defaults":
                    return ast.literal_eval(keyword.value)
    return {}


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("checkout", type=Path, help="a Megatron-LM source tree (git archive of the tag)")
    cli.add_argument("--tag", required=True, help="the tag the checkout is, recorded in the output")
    options = cli.parse_args(argv)
    facts = flag_facts(_megatron_parser(options.checkout), "megatron.training.arguments")
    for dest, default in program_defaults(options.checkout / "pretrain_gpt.py").items():
        for fact in facts:
            if fact["dest"] == dest:
                fact["default"] = _json_value(default)
                fact["source"] += " (default from pretrain_gpt.py's args_defaults)"
    modelopt = _modelopt_parser(options.checkout)
    if modelopt is not None:
        known = {s for f in facts for s in f["option_strings"]}
        facts += [f for f in flag_facts(modelopt, f"post_training ({MODELOPT_GROUP_NOTE})")
                  if not known & set(f["option_strings"])]
    import megatron.core

    document = {
        "megatron_lm_tag": options.tag,
        "megatron_core_version": megatron.core.__version__.split("+")[0],  # 0.17+ appends "+<git hash>"
        "program": "pretrain_gpt.py",
        "flags": facts,
    }
    # One flag per line: reviewable diffs when the pinned tag moves.
    header = {k: v for k, v in document.items() if k != "flags"}
    lines = [json.dumps(header, sort_keys=True)[:-1] + ', "flags": [']
    lines += [" " + json.dumps(f, sort_keys=True) + "," for f in facts]
    lines[-1] = lines[-1].rstrip(",")
    sys.stdout.write("\n".join(lines) + "\n]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
