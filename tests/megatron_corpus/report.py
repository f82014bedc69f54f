"""Runs the corpus and writes docs/megatron-recipes.md (the table the tests check).

    python -m tests.megatron_corpus.report            # every recipe: a few minutes a dozen
    python -m tests.megatron_corpus.report --check    # exit 1 if the table is stale

Each recipe, scaled down (scale.py), is first configured in-process (startup.configure:
flags, plan, validation - where every refusal is decided, before megatron-core loads); a
recipe that passes is launched at its own layout and must train its iterations.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
if str(TESTS) not in sys.path:  # tiny_tokenizers and conftest live beside the tests
    sys.path.insert(0, str(TESTS))

from tests.megatron_corpus.corpus import Recipe, recipes
from tests.megatron_corpus.scale import layout_of, scale_down

DOC = REPO / "docs" / "megatron-recipes.md"
STATUSES = REPO / "tests" / "megatron_corpus" / "statuses.json"
TIMEOUT_S = 300
MAX_PROCESSES = 8  # a 2-core machine hosts 8 tiny ranks; gpt3_175b's TP8 x PP16 is 128
# Megatron's log line of the last iteration (fp16 runs skip their first steps while the loss
# scale comes down, so an iteration may report no loss: its line is what says it ran).
ITERATION = re.compile(r"iteration\s+3/\s*3 \|")


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str        # "trained" | "refused" | "configured" (too many processes) | "failed"
    reason: str = ""   # refused: the runtime's message; configured: why not launched;
    #                    failed: the last lines


def refused_flags(message: str) -> list[str]:
    """The flags a refusal names, in its order."""
    return list(dict.fromkeys(re.findall(r"(--[a-z0-9][a-z0-9_-]*)", message)))


def configure_outcome(recipe: Recipe, workdir: Path) -> Outcome | None:
    """The refusal decided before launch (None when the recipe configures)."""
    from hetero.errors import HeteroError
    from megatron.hetero import startup

    argv = scale_down(recipe.flags, workdir)
    try:
        startup.configure(argv, layout_of(recipe.flags).world_size)
    except HeteroError as err:
        return Outcome(recipe.name, "refused", str(err))
    return None


def launch_outcome(recipe: Recipe, workdir: Path) -> Outcome:
    """Launches the scaled recipe at its own layout."""
    from conftest import run_pretrain

    argv = scale_down(recipe.flags, workdir)
    result = run_pretrain(argv, nproc=layout_of(recipe.flags).world_size, tmp_path=workdir,
                          timeout=TIMEOUT_S)
    errors = [line for line in result.stderr.splitlines() if "] error: " in line]
    if result.returncode == 0 and ITERATION.search(result.stdout):
        return Outcome(recipe.name, "trained")
    if result.returncode == 2 and errors and "Traceback" not in result.stderr:
        return Outcome(recipe.name, "refused", errors[0].split("] error: ", 1)[1])
    return Outcome(recipe.name, "failed", result.output[-2000:])


def outcome(recipe: Recipe, workdir: Path) -> Outcome:
    refused = configure_outcome(recipe, workdir)
    if refused is not None:
        return refused
    world = layout_of(recipe.flags).world_size
    if world > MAX_PROCESSES:  # configured at its own layout, too many processes to launch here
        return Outcome(recipe.name, "configured",
                       f"its layout needs {world} processes; launched only up to {MAX_PROCESSES}")
    return launch_outcome(recipe, workdir)


def _short(reason: str) -> str:
    """The first refusal in full, the other refused flags by name (docs/flags.md has each)."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    refusals = [line for line in lines if line.startswith("--")] or lines[:1]
    others = [line.split(":", 1)[0] for line in refusals[1:]]
    text = refusals[0] + (f"<br>also: {', '.join(others)}" if others else "")
    return text.replace("|", "\\|")


def group_of(reason: str) -> str:
    """A refusal's group: the catalog theme of the first flag it names."""
    from megatron.hetero.arguments import build_parser
    from megatron.hetero.flags import catalog
    from megatron.hetero.flags.parsing import defined_options
    from megatron.hetero.flags.rules import rulings

    table = rulings(defined_options(build_parser()))
    by_option = {o: r for r in table.values() for o in r.flag.option_strings}
    for flag in refused_flags(reason):
        ruling = by_option.get(flag)
        if ruling is not None and ruling.theme:
            return catalog.THEMES[ruling.theme].title if ruling.theme in catalog.THEMES else ruling.theme
    # A refused value or combination: its message's first clause names it.
    lines = [line.strip() for line in reason.splitlines() if line.strip().startswith("--")]
    return re.split(r"[;:(]", (lines or [reason.strip()])[0], maxsplit=1)[0].strip()


def markdown(found: list[Recipe], outcomes: dict[str, Outcome]) -> str:
    counts = Counter(o.status for o in outcomes.values())
    groups = Counter(group_of(o.reason) for o in outcomes.values() if o.status == "refused")
    header = ("<!-- generated by `python -m tests.megatron_corpus.report`; "
              "tests/test_megatron_corpus.py checks it -->")
    intro = (
        "Every GPT and MoE functional-test recipe of Megatron-LM at core_v0.16.1 "
        "(`tests/functional_tests/test_cases/{gpt,moe}/*/model_config.yaml`, its MODEL_ARGS) "
        f"and its GPT/Llama/Mixtral example launch scripts: {len(found)} recipes "
        "(tests/megatron_corpus/). Each runs unchanged but for one scale-down rule "
        "(tests/megatron_corpus/scale.py: sizes, length, data and paths), at its own "
        "parallel layout (TP x PP x CP processes, x EP where experts are spread), on CPU "
        "processes: GPU-only kernel choices run as their CPU equivalents, listed in one "
        "start-up note (docs/compatibility.md). A checkpoint-resume recipe runs its first "
        "training (3 iterations, saved at the end), not Megatron-LM's second, resuming run.")
    summary = (
        f"**{counts['trained']} trained** at their own layout, **{counts['refused']} refused** "
        f"with the runtime's reason, {counts['configured']} configured at a layout too large "
        f"to launch here (more than {MAX_PROCESSES} processes), {counts['failed']} failed "
        "otherwise.")
    lines = [
        "# Megatron-LM's own recipes on Megatron-Hetero",
        "",
        header,
        "",
        intro,
        "",
        summary,
        "",
        "Refusals by the first refused flag's theme (docs/flags.md):",
        "",
        "| reason | recipes |",
        "|---|---|",
        *[f"| {group} | {n} |" for group, n in groups.most_common()],
        "",
        "| recipe | layout | processes | status | reason |",
        "|---|---|---|---|---|",
    ]
    for recipe in found:
        o = outcomes[recipe.name]
        layout = layout_of(recipe.flags)
        lines.append(f"| [{recipe.name}](https://github.com/NVIDIA/Megatron-LM/blob/core_v0.16.1/"
                     f"{recipe.source}) | {layout.describe()} | {layout.world_size} | {o.status} | "
                     f"{_short(o.reason) if o.status != 'trained' else ''} |")
    return "\n".join(lines) + "\n"


def load_statuses() -> dict[str, Outcome]:
    if not STATUSES.exists():
        return {}
    return {name: Outcome(**o) for name, o in json.loads(STATUSES.read_text()).items()}


def save_statuses(outcomes: dict[str, Outcome]) -> None:
    STATUSES.write_text(json.dumps({n: asdict(o) for n, o in sorted(outcomes.items())}, indent=1) + "\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.megatron_corpus.report")
    parser.add_argument("--check", action="store_true",
                        help="only compare the table with the recorded statuses")
    parser.add_argument("--only", nargs="*", default=None, help="recipe names to rerun")
    parser.add_argument("--table", action="store_true",
                        help="only rewrite the table from the recorded statuses")
    options = parser.parse_args(argv)
    found = recipes()
    outcomes = load_statuses()
    if options.check:
        stale = DOC.read_text() != markdown(found, outcomes) if DOC.exists() else True
        print("docs/megatron-recipes.md is " + ("stale" if stale else "up to date"))
        return int(stale)
    for recipe in found:
        if options.table or (options.only is not None and recipe.name not in options.only):
            continue
        with tempfile.TemporaryDirectory(prefix="corpus.") as workdir:
            outcomes[recipe.name] = outcome(recipe, Path(workdir))
        o = outcomes[recipe.name]
        print(f"{o.status:8} {recipe.name}  {o.reason.splitlines()[0][:150] if o.reason else ''}",
              flush=True)
        save_statuses(outcomes)
    DOC.write_text(markdown(found, outcomes))
    print(f"{DOC}: {Counter(o.status for o in outcomes.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
