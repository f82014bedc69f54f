"""Runs the corpus both ways and writes statuses.json and docs/megatron-recipes.md.

    python -m tests.megatron_corpus.report --run-all [--jobs 2]   # every recipe, both ways
    python -m tests.megatron_corpus.report --only NAME ...         # rerun some, keep the rest
    python -m tests.megatron_corpus.report --check                 # exit 1 if the table is stale
    python -m tests.megatron_corpus.report --table                 # the table from statuses.json
    PYTHONPATH=.core019 python -m tests.megatron_corpus.report --tag core_v0.19.0 --run-all

--tag picks the corpus (corpus.py): core_v0.16.1 (the default; statuses.json,
docs/megatron-recipes.md, run with megatron-core 0.16.1) or core_v0.19.0
(statuses.core_v0.19.0.json, docs/megatron-recipes-core_v0.19.0.md, run with megatron-core
0.19.2 - a run refuses to start on another release).

Each recipe, scaled down (scale.py), runs twice: at its own layout without a plan, and
under the heterogeneous plan of the same layout that plans.py makes from its flags
(--hetero-plan, every flag unchanged). Each way is first configured in-process
(startup.configure: flags, plan, validation - where every refusal is decided, before
megatron-core loads); a way that configures is launched and must train its iterations.

--run-all is resumable: every finished recipe is recorded at once in
runs/megatron-corpus/progress.json, and a run that stopped continues where it left off
(--restart discards it); statuses.json and the table are written when every recipe is done.
A lock file keeps two runs (or a run and an --only) from writing at once.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

# Megatron-LM's CI logs in to Weights & Biases; the corpus keeps a recipe's W&B logs in its
# run folder instead (part of the scale-down rule's data and paths).
os.environ.setdefault("WANDB_MODE", "offline")
TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
if str(TESTS) not in sys.path:  # tiny_tokenizers and conftest live beside the tests
    sys.path.insert(0, str(TESTS))

from hetero.io import write_json_atomic
from tests.megatron_corpus.corpus import DEFAULT_TAG, TAGS, Recipe, recipes
from tests.megatron_corpus.plans import RecipePlan, plan_for
from tests.megatron_corpus.scale import layout_of, scale_down

DOC = REPO / "docs" / "megatron-recipes.md"
STATUSES = REPO / "tests" / "megatron_corpus" / "statuses.json"
PROGRESS = REPO / "runs" / "megatron-corpus" / "progress.json"
LOCK = REPO / "runs" / "megatron-corpus" / "lock"
# The megatron-core release each tag's corpus runs with (its major.minor must be installed).
CORE_RELEASE = {"core_v0.16.1": "0.16.1", "core_v0.19.0": "0.19.2"}
TIMEOUT_S = 120  # a 3-iteration tiny run takes seconds; a hang costs no more than this
MAX_PROCESSES = 8  # a 2-core machine hosts 8 tiny ranks; gpt3_175b's TP8 x PP16 is 128
# Megatron's log line of the last iteration (fp16 runs skip their first steps while the loss
# scale comes down, so an iteration may report no loss: its line is what says it ran).
ITERATION = re.compile(r"iteration\s+3/\s*\d+ \|")  # 3 of 3, or of more under a batch ramp-up
WAYS = ("without_plan", "under_plan")


def doc_path(tag: str = DEFAULT_TAG) -> Path:
    return DOC if tag == DEFAULT_TAG else DOC.with_name(f"megatron-recipes-{tag}.md")


def statuses_path(tag: str = DEFAULT_TAG) -> Path:
    return STATUSES if tag == DEFAULT_TAG else STATUSES.with_name(f"statuses.{tag}.json")


def _run_dir(tag: str) -> Path:
    return PROGRESS.parent if tag == DEFAULT_TAG else PROGRESS.parent / tag


@dataclass(frozen=True)
class Outcome:
    """How one way of running a recipe ended."""

    status: str        # "trained" | "refused" | "configured" (too many processes) | "failed"
    reason: str = ""   # refused: the runtime's message; configured: why not launched;
    #                    failed: the last lines


@dataclass(frozen=True)
class RecipeStatus:
    """A recipe at its own layout without a plan, and under its heterogeneous plan."""

    without_plan: Outcome
    under_plan: Outcome
    plan: str = ""  # what the plan makes heterogeneous (plans.py); empty where none was made

    @classmethod
    def from_json(cls, data: dict) -> "RecipeStatus":
        return cls(Outcome(**data["without_plan"]), Outcome(**data["under_plan"]), data.get("plan", ""))


@dataclass(frozen=True)
class Way:
    """One way of running a recipe: its command line and launch size."""

    argv: list[str]
    nproc: int
    plan_note: str | None  # None: without a plan


def refused_flags(message: str) -> list[str]:
    """The flags a refusal names, in its order."""
    return list(dict.fromkeys(re.findall(r"(--[a-z0-9][a-z0-9_-]*)", message)))


def refusal_key(reason: str) -> tuple[str, ...]:
    """What a refusal is about, without its wording: the flags it names (a hint in backticks,
    such as the pointer to --help, left out), else its first line."""
    flags = refused_flags(re.sub(r"`[^`]*`", "", reason))
    return tuple(flags) if flags else tuple(reason.strip().splitlines()[:1])


def plan_of(recipe: Recipe, argv: list[str], layout) -> RecipePlan:
    """plans.py's plan of the scaled recipe. A plan its rule makes and hetero.plan rejects is
    no plan, with the rejection as its note (a later tag's recipe the rule does not cover: one
    that sets its global batch only by core_v0.19's --step-batch-size-schedule gets one
    micro-batch a replica, fewer than its interleaved schedule's unit)."""
    try:
        return plan_for(recipe.flags, argv, layout)
    except ValueError as err:  # hetero.errors.PlanError, pydantic's ValidationError
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        said = next((line for line in lines if line.startswith("Value error, ")), lines[-1] if lines else "")
        said = said.removeprefix("Value error, ").split(" [type=")[0]
        return RecipePlan(None, f"no plan: plans.py's rule makes a plan hetero.plan rejects ({said})")


def way(recipe: Recipe, workdir: Path, planned: bool) -> Way | None:
    """The scaled recipe's command line, with --hetero-plan when planned; None when planned
    and the flags give nothing to plan for."""
    workdir.mkdir(parents=True, exist_ok=True)
    layout = layout_of(recipe.flags)
    argv = scale_down(recipe.flags, workdir)
    if not planned:
        return Way(argv, layout.world_size, None)
    made = plan_of(recipe, argv, layout)
    if made.plan is None:
        return None
    path = workdir / "plan.json"
    made.plan.save(path)
    return Way(argv + ["--hetero-plan", str(path)], made.plan.world_size, made.note)


def configure_outcome(recipe: Recipe, workdir: Path, planned: bool = False) -> Outcome | None:
    """The refusal decided before launch (None when the recipe configures)."""
    from hetero.errors import HeteroError
    from megatron.hetero import startup

    chosen = way(recipe, workdir, planned)
    if chosen is None:  # no plan (plans.py says why): refused as without one
        return configure_outcome(recipe, workdir, planned=False) or Outcome(
            "failed", "plans.py made no plan of a recipe that configures without one")
    try:
        startup.configure(chosen.argv, chosen.nproc)
    except HeteroError as err:
        return Outcome("refused", str(err))
    except Exception as err:  # a traceback where a clear error was due: recorded, the run goes on
        return Outcome("failed", f"start-up raised {type(err).__name__}: {str(err)[:1500]}")
    return None


def launch_outcome(recipe: Recipe, workdir: Path, planned: bool = False) -> Outcome:
    """Launches the scaled recipe at its own layout (under its plan when planned)."""
    from conftest import run_pretrain

    chosen = way(recipe, workdir, planned)
    assert chosen is not None, f"{recipe.name}: no plan to launch under"
    result = run_pretrain(chosen.argv, nproc=chosen.nproc, tmp_path=workdir, timeout=TIMEOUT_S)
    errors = [line for line in result.stderr.splitlines() if "] error: " in line]
    if result.returncode == 0 and ITERATION.search(result.stdout):
        return Outcome("trained")
    if result.returncode == 2 and errors and "Traceback" not in result.stderr:
        # The first error with its indented continuation lines (several problems: one each).
        lines = result.stderr.splitlines()
        first = lines.index(errors[0])
        block = [errors[0].split("] error: ", 1)[1]]
        block += _indented(lines[first + 1:])
        return Outcome("refused", "\n".join(block))
    return Outcome("failed", result.output[-2000:])


def _indented(lines: list[str]) -> list[str]:
    taken = []
    for line in lines:
        if not line.startswith(" "):
            break
        taken.append(line)
    return taken


_configuring = threading.Lock()  # startup.configure reads and sets module state: one at a time


def outcome(recipe: Recipe, workdir: Path, planned: bool) -> Outcome:
    with _configuring:
        refused = configure_outcome(recipe, workdir, planned)
    if refused is not None:
        return refused
    world = layout_of(recipe.flags).world_size
    if world > MAX_PROCESSES:  # configured at its own layout, too many processes to launch here
        return Outcome("configured", f"its layout needs {world} processes; launched only up to {MAX_PROCESSES}")
    try:
        return launch_outcome(recipe, workdir, planned)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # a job past its time (conftest fails it): recorded, the run goes on
        return Outcome("failed", str(err)[-2000:])


def recipe_status(recipe: Recipe) -> RecipeStatus:
    """Both ways, each in a directory of its own."""
    with tempfile.TemporaryDirectory(prefix="corpus.") as workdir:
        root = Path(workdir)
        note = plan_of(recipe, scale_down(recipe.flags, root), layout_of(recipe.flags)).note
        return RecipeStatus(outcome(recipe, root / "without-plan", planned=False),
                            outcome(recipe, root / "under-plan", planned=True), note)


def _short(reason: str) -> str:
    """The first refusal in full, the other refused flags by name (docs/flags.md has each)."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    refusals = [line for line in lines if line.startswith("--")] or lines[:1]
    others = [line.split(":", 1)[0] for line in refusals[1:]]
    text = refusals[0] + (f"<br>also: {', '.join(others)}" if others else "")
    return text.replace("|", "\\|")


@functools.lru_cache(maxsize=1)
def _rulings_by_option() -> dict:
    """option string -> the flag catalog's ruling (built once: every table groups its refusals)."""
    from megatron.hetero.arguments import build_parser
    from megatron.hetero.flags.parsing import defined_options
    from megatron.hetero.flags.rules import rulings

    table = rulings(defined_options(build_parser()))
    return {o: r for r in table.values() for o in r.flag.option_strings}


@functools.lru_cache(maxsize=None)
def _tag_themes(tag: str) -> dict[str, str]:
    """option string -> theme of the refused flags of Megatron-LM's parser at ``tag``, as the
    flag catalog rules them under that tag (flags/rules.py: catalogued, else - at a later tag
    than the reference one - "unreviewed"). For a flag the installed release's parser does not
    define: a tag's table reads the same whichever megatron-core renders it."""
    from megatron.hetero.flags import catalog
    from megatron.hetero.flags.facts import FACTS_FILES, megatron_flags

    flags = megatron_flags(tag)
    themes = catalog.theme_of_flags({f.name: f.group for f in flags})
    later = tag != next(iter(FACTS_FILES))
    return {o: themes.get(f.name, "unreviewed") for f in flags for o in f.option_strings
            if f.name in themes or later}


PROBLEMS = re.compile(r"\d+ problems with this launch")  # megatron/hetero/problems.py's header


def group_of(reason: str, tag: str = DEFAULT_TAG) -> str:
    """A refusal's group: the catalog theme of the first flag it names."""
    from megatron.hetero.flags import catalog

    by_option = _rulings_by_option()
    for flag in refused_flags(reason):
        ruling = by_option.get(flag)
        theme = ruling.theme if ruling is not None else _tag_themes(tag).get(flag)
        if theme:
            return catalog.THEMES[theme].title if theme in catalog.THEMES else theme
    # A refused value or combination: its message's first clause names it (of several
    # problems, the first problem's; an unknown flag's group without the flag's name).
    text = reason.strip()
    first = re.search(r"^\s*1\. (.+?)(?=^\s*2\. |\Z)", text, re.M | re.S) if PROBLEMS.match(text) else None
    text = first.group(1) if first else text
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("--")]
    clause = re.split(r"[;:(]", (lines or [text])[0], maxsplit=1)[0].strip()
    return re.sub(r"^unknown flag --\S+$", "unknown flag", clause)


def _counts(outcomes: list[Outcome]) -> str:
    counts = Counter(o.status for o in outcomes)
    return (f"**{counts['trained']} trained**, **{counts['refused']} refused** with the runtime's "
            f"reason, {counts['configured']} configured at a layout too large to launch here (more "
            f"than {MAX_PROCESSES} processes), {counts['failed']} failed otherwise")


def _eligible_counts(eligible: list[RecipeStatus]) -> str:
    ways = Counter((s.without_plan.status, s.under_plan.status) for s in eligible)
    both = ways[("trained", "trained")]
    refused = sum(n for (w, u), n in ways.items() if "refused" in (w, u) and "failed" not in (w, u))
    large = ways[("configured", "configured")]
    other = len(eligible) - both - refused - large
    return (f"{both} trained both ways, {refused} are refused by name (either way), {large} "
            f"configured both ways at a layout too large to launch here, {other} otherwise")


def _reason(status: RecipeStatus) -> str:
    """The table's reason: the refusal (or failure) without a plan, else the one under it."""
    for label, o in (("", status.without_plan), ("under the plan: ", status.under_plan)):
        if o.status in ("refused", "configured"):
            return label + _short(o.reason)
        if o.status == "failed":
            return label + "failed: " + _short(o.reason.strip().splitlines()[-1] if o.reason.strip() else "")
    return ""


def markdown(found: list[Recipe], statuses: dict[str, RecipeStatus], tag: str = DEFAULT_TAG) -> str:
    without = [statuses[r.name].without_plan for r in found]
    under = [statuses[r.name].under_plan for r in found]
    both = sum(s.without_plan.status == s.under_plan.status == "trained" for s in statuses.values())
    eligible = [r for r in found if layout_of(r.flags).ep <= 1]
    groups = Counter(group_of(s.without_plan.reason, tag) for s in statuses.values()
                     if s.without_plan.status == "refused")
    header = ("<!-- generated by `python -m tests.megatron_corpus.report`; "
              "tests/test_megatron_corpus.py checks it -->")
    intro = (
        f"Every GPT and MoE functional-test recipe of Megatron-LM at {tag} "
        "(`tests/functional_tests/test_cases/{gpt,moe}/*/model_config.yaml`, its MODEL_ARGS) "
        f"and its GPT/Llama/Mixtral example launch scripts: {len(found)} recipes "
        "(tests/megatron_corpus/). Each runs unchanged but for one scale-down rule "
        "(tests/megatron_corpus/scale.py: sizes, length, data and paths), at its own "
        "parallel layout (TP x PP x CP x DP processes: DP = EP where experts are spread over data-parallel ranks (1 where a replica's TP x CP ranks hold EP x expert TP), twice that where the model-parallel ranks are 2 or fewer, as Megatron-LM's 8-GPU CI runs them data-parallel), on CPU "
        "processes: GPU-only kernel choices run as their CPU equivalents, listed in one "
        "start-up note (docs/compatibility.md). A checkpoint-resume recipe runs its first "
        "training (3 iterations, saved at the end), not Megatron-LM's second, resuming run. "
        f"Run with megatron-core {CORE_RELEASE[tag]}.")
    others = [t for t in TAGS if t != tag]
    if tag == DEFAULT_TAG:
        versions = " ".join(f"The recipes at {t}, run the same way with megatron-core {CORE_RELEASE[t]}: "
                            f"[{doc_path(t).name}]({doc_path(t).name})." for t in others)
    else:
        versions = (f"The recipes at {DEFAULT_TAG}, run the same way with megatron-core {CORE_RELEASE[DEFAULT_TAG]}: "
                    f"[{doc_path(DEFAULT_TAG).name}]({doc_path(DEFAULT_TAG).name}).")
    planned = (
        "Each recipe runs twice: **without a plan** (the layout stock Megatron would run) and "
        "**under a plan** (`--hetero-plan`, every flag unchanged): a heterogeneous plan of "
        "the same world size, TP, PP, virtual stages, micro-batch size and global batch, made "
        "from the recipe's flags by one rule (tests/megatron_corpus/plans.py): one decoder "
        "layer moved from the first stage to the last where PP > 1 (a split the recipe pins "
        "with its own flags kept), micro-batches shared 2 : 1 : ... : 1 between the replicas "
        "where DP > 1, the rank order reversed (where DP = PP = 1 the plan has no other "
        "freedom; a recipe that orders its ranks with --use-tp-pp-dp-mapping keeps its order). "
        "The plan column says what it changed.")
    lines = [
        "# Megatron-LM's own recipes on Megatron-Hetero",
        "",
        header,
        "",
        intro,
        "",
        versions,
        "",
        planned,
        "",
        f"Without a plan: {_counts(without)}.",
        "",
        f"Under a plan: {_counts(under)}.",
        "",
        f"Both ways: **{both} trained**. Of the {len(eligible)} recipes without expert parallelism "
        f"> 1, {_eligible_counts([statuses[r.name] for r in eligible])}.",
        "",
        "Refusals without a plan, by the first refused flag's theme (docs/flags.md):",
        "",
        "| reason | recipes |",
        "|---|---|",
        *[f"| {group} | {n} |" for group, n in groups.most_common()],
        "",
        "| recipe | layout | processes | without a plan | under a plan | plan | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for recipe in found:
        status = statuses[recipe.name]
        layout = layout_of(recipe.flags)
        lines.append(f"| [{recipe.name}](https://github.com/NVIDIA/Megatron-LM/blob/{tag}/"
                     f"{recipe.source}) | {layout.describe()} | {layout.world_size} | "
                     f"{status.without_plan.status} | {status.under_plan.status} | {status.plan or '-'} | "
                     f"{_reason(status)} |")
    return "\n".join(lines) + "\n"


def _read(path: Path) -> dict[str, RecipeStatus]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {name: RecipeStatus.from_json(s) if "without_plan" in s else _one_way(s)
            for name, s in data.items()}


def _one_way(recorded: dict) -> RecipeStatus:
    """A status recorded before the runs under a plan: without a plan only."""
    return RecipeStatus(Outcome(recorded["status"], recorded.get("reason", "")),
                        Outcome("not run", "recorded before the runs under a plan"))


def load_statuses(tag: str = DEFAULT_TAG) -> dict[str, RecipeStatus]:
    return _read(statuses_path(tag))


def _write(path: Path, statuses: dict[str, RecipeStatus]) -> None:
    write_json_atomic(path, {name: asdict(s) for name, s in sorted(statuses.items())})


def save_statuses(statuses: dict[str, RecipeStatus], tag: str = DEFAULT_TAG) -> None:
    _write(statuses_path(tag), statuses)


@contextmanager
def _locked(tag: str = DEFAULT_TAG) -> Iterator[None]:
    """One writer of a tag's statuses and progress file at a time."""
    lock = _run_dir(tag) / LOCK.name
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another corpus run holds {lock}; wait for it to finish") from None
        yield


def _check_release(tag: str) -> None:
    """A run records statuses only on the megatron-core release its tag's corpus runs with."""
    from importlib.metadata import version

    installed = version("megatron-core")  # the one on the path, without importing it
    wanted = CORE_RELEASE[tag]
    if installed.split(".")[:2] != wanted.split(".")[:2]:
        hint = " (PYTHONPATH=.core019)" if wanted.startswith("0.19") else ""
        raise SystemExit(f"the {tag} corpus runs with megatron-core {wanted}{hint}; "
                         f"megatron-core {installed} is installed")


def _run(todo: list[Recipe], jobs: int, record) -> None:
    """Runs the recipes, `jobs` at a time, calling record(name, status) as each ends."""
    import conftest

    if conftest._job_server is None:  # started once here, not by two threads at once
        conftest._job_server = conftest.JobServer()
    start, done = time.monotonic(), 0
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        running = {pool.submit(recipe_status, recipe): recipe for recipe in todo}
        for finished in as_completed(running):
            recipe = running[finished]
            try:
                status = finished.result()
            except Exception as err:  # the harness itself (scale.py, plans.py): recorded as failed, the run goes on
                failed = Outcome("failed", f"the corpus harness raised {type(err).__name__}: {str(err)[-1500:]}")
                status = RecipeStatus(failed, failed)
            record(recipe.name, status)
            done += 1
            elapsed = round(time.monotonic() - start)
            left = round(elapsed / done * (len(todo) - done))
            reason = _reason(status).split("<br>")[0][:100]
            print(f"[{done}/{len(todo)} {elapsed // 60}:{elapsed % 60:02} elapsed, "
                  f"~{left // 60}:{left % 60:02} left] "
                  f"{status.without_plan.status:10} {status.under_plan.status:10} {recipe.name}  {reason}",
                  flush=True)
    finally:  # stopped (Ctrl-C, SIGTERM): the recipes not started are dropped, the finished kept
        pool.shutdown(wait=True, cancel_futures=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.megatron_corpus.report")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--run-all", action="store_true",
                      help="run every recipe both ways (resumes an unfinished run), then write "
                           "statuses.json and the table (the default)")
    mode.add_argument("--only", nargs="+", default=None, metavar="NAME", help="recipe names to rerun")
    mode.add_argument("--check", action="store_true",
                      help="only compare the table with the recorded statuses")
    mode.add_argument("--table", action="store_true",
                      help="only rewrite the table from the recorded statuses")
    parser.add_argument("--tag", choices=TAGS, default=DEFAULT_TAG,
                        help=f"the Megatron-LM tag's corpus (default {DEFAULT_TAG})")
    parser.add_argument("--jobs", type=int, default=1, help="recipes run at once (default 1)")
    parser.add_argument("--restart", action="store_true",
                        help="with --run-all: discard an unfinished run's progress")
    options = parser.parse_args(argv)
    # SIGTERM ends the run as Ctrl-C does: the job server stops, the progress is kept.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tag = options.tag
    found, doc, progress = recipes(tag), doc_path(tag), _run_dir(tag) / PROGRESS.name
    if options.check:
        statuses = load_statuses(tag)
        stale = (set(statuses) != {r.name for r in found} or not doc.exists()
                 or doc.read_text() != markdown(found, statuses, tag))
        print(f"docs/{doc.name} is " + ("stale" if stale else "up to date"))
        return int(stale)
    with _locked(tag):
        if options.table:
            doc.write_text(markdown(found, load_statuses(tag), tag))
            return 0
        _check_release(tag)
        if options.only is not None:
            unknown = sorted(set(options.only) - {r.name for r in found})
            if unknown:
                parser.error(f"no such recipe: {', '.join(unknown)}")
            statuses = load_statuses(tag)

            def record(name: str, status: RecipeStatus) -> None:
                statuses[name] = status
                save_statuses(statuses, tag)

            _run([r for r in found if r.name in options.only], options.jobs, record)
        else:
            if options.restart:
                progress.unlink(missing_ok=True)
            statuses = _read(progress)
            if statuses:
                print(f"resuming: {len(statuses)} of {len(found)} recipes done ({progress})", flush=True)

            def record(name: str, status: RecipeStatus) -> None:
                statuses[name] = status
                _write(progress, statuses)

            _run([r for r in found if r.name not in statuses], options.jobs, record)
            save_statuses(statuses, tag)
            progress.unlink(missing_ok=True)
        if set(statuses) == {r.name for r in found}:
            doc.write_text(markdown(found, statuses, tag))
            print(f"{doc}: without a plan {dict(Counter(s.without_plan.status for s in statuses.values()))}; "
                  f"under a plan {dict(Counter(s.under_plan.status for s in statuses.values()))}")
        else:
            print(f"{doc} not written: {statuses_path(tag).name} lacks recipes; run --run-all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
