"""Every Megatron-LM flag is known: honoured, a no-op where Megatron-LM ignores it, or
refused by name with a reason (megatron/hetero/flags/)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from conftest import GPT_MODEL, REPO, TRAINING, run_pretrain
from hetero.errors import HeteroError
from megatron.hetero import flags
from megatron.hetero.flags import catalog
from megatron.hetero.arguments import build_parser, parse_args
from megatron.hetero.startup import configure
from tools.flags_doc import readme_block, render

BASE = GPT_MODEL + TRAINING
PARSER = build_parser()
TABLE = flags.rulings(flags.defined_options(PARSER))


def _of(status: flags.Status) -> list[flags.Ruling]:
    return [r for r in TABLE.values() if r.status is status]


def _non_default_value(flag: flags.MegatronFlag) -> list[str]:
    """Command-line values that parse with Megatron-LM's syntax and differ from its default."""
    if not flag.takes_value:
        return []
    if flag.choices:
        value = next(c for c in flag.choices if c != flag.default and [c] != flag.default)
    elif flag.type == "int":
        value = (flag.default + 1) if isinstance(flag.default, int) else 3
    elif flag.type == "float":
        value = (flag.default + 0.5) if isinstance(flag.default, float) else 0.25
    else:
        value = "x"
    count = flag.nargs if isinstance(flag.nargs, int) else 1
    return [str(value)] * count


def _refused_cases() -> list[tuple[str, flags.Ruling]]:
    """Every option string of the flags refused while parsing (not the DEFAULT_ONLY ones,
    which arguments/ defines and validation refuses)."""
    return [(option, r) for r in _of(flags.Status.REFUSED) if not r.default_only
            for option in r.flag.option_strings
            if not option.startswith("--no-") or r.flag.action != "BooleanOptionalAction"]


# ---- the facts and the registry --------------------------------------------------------

def test_facts_are_megatron_lms_whole_parser():
    facts = flags.megatron_flags()
    assert flags.megatron_tag() == "core_v0.16.1"
    options = [s for f in facts for s in f.option_strings]
    assert len(options) == len(set(options)), "an option string belongs to two flags"
    assert len(facts) == 669 and len(options) == 698  # 651 + 18 nvidia-modelopt actions
    assert {"--fp8-format", "--use-mcore-models", "--sequence-parallel", "--hidden-size",
            "--moe-router-topk", "--export-kd-cfg"} <= set(options)


def test_every_flag_has_exactly_one_status():
    assert set(TABLE) == {f.name for f in flags.megatron_flags()}
    number = flags.counts(TABLE)
    assert sum(number.values()) == len(TABLE)
    assert number[flags.Status.HONOURED] >= 102  # what pretrain_gpt.py knew before
    # every flag's option strings are in --help exactly once, in one group
    seen = [s for group in PARSER._action_groups for a in group._group_actions
            for s in a.option_strings]
    for flag in flags.megatron_flags():
        for option in flag.option_strings:
            assert seen.count(option) == 1, option


def test_our_own_flags_are_megatrons_or_listed_as_ours():
    megatron = {s for f in flags.megatron_flags() for s in f.option_strings}
    ours = flags.defined_options(PARSER) - megatron - {"-h", "--help"}
    assert ours == set(flags.HETERO_FLAGS)


@pytest.mark.parametrize("flag", ["--fp8-format", "--use-mcore-models", "--tp-comm-overlap-cfg"])
def test_a_flag_both_honoured_and_catalogued_is_an_error(flag):
    """Defining a flag in arguments/ while its catalog entry stays is caught, naming it."""
    honoured = flags.defined_options(PARSER) | {flag}
    with pytest.raises(RuntimeError, match=f"honoured by arguments/ AND listed.*{flag}"):
        flags.check_registry(honoured)
    parser = argparse.ArgumentParser(add_help=False)  # the honoured flags, and this one
    for option in sorted(honoured - {"-h", "--help"}):
        parser.add_argument(option, action="store_true")
    with pytest.raises(RuntimeError, match=flag):
        flags.add_megatron_flags(parser)


def test_a_flag_neither_honoured_nor_catalogued_is_an_error():
    honoured = flags.defined_options(PARSER) - {"--hidden-size"}
    with pytest.raises(RuntimeError, match="neither honoured nor in flags/catalog.py: --hidden-size"):
        flags.check_registry(honoured)


def test_honoured_defaults_are_megatrons_or_documented():
    assert set(flags.default_differences(PARSER)) == set(flags.DEFAULT_DIFFERENCES)


def test_catalog_themes_are_all_used():
    used = {r.theme for r in _of(flags.Status.REFUSED)}
    # Themes of flags only another tag has are used under that tag (and "unreviewed" only by
    # a later tag's flags nothing rules on: none, at the reference tag).
    other_tags = {theme for name, theme in catalog.theme_of_flags({}).items() if name not in TABLE}
    assert set(catalog.THEMES) - other_tags - {"unreviewed"} <= used


# ---- refused, by name ------------------------------------------------------------------

@pytest.mark.parametrize("option, ruling", _refused_cases(), ids=lambda c: getattr(c, "name", c))
def test_every_refused_flag_is_named_with_a_reason(option, ruling):
    with pytest.raises(HeteroError) as err:
        parse_args(BASE + [option, *_non_default_value(ruling.flag)])
    lines = str(err.value).splitlines()
    assert len(lines) == 3 and lines[1].startswith(f"  {option}: ")
    reason = lines[1].split(": ", 1)[1]
    assert reason == ruling.reason  # the reason docs/flags.md gives
    assert "remove it" in reason or "use --" in reason
    assert "unknown" not in reason and "did you mean" not in reason


PERFORMANCE_FLAGS = [
    ["--recompute-granularity", "full"], ["--recompute-method", "uniform"],
    ["--recompute-num-layers", "1"], ["--recompute-activations"], ["--overlap-grad-reduce"],
    ["--overlap-param-gather"], ["--num-layers-per-virtual-pipeline-stage", "2"],
    ["--num-virtual-stages-per-pipeline-rank", "2"],
    ["--attention-backend", "flash"], ["--cross-entropy-loss-fusion"],
    ["--grad-reduce-in-bf16"], ["--ddp-bucket-size", "1000"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
]


@pytest.mark.parametrize("given", PERFORMANCE_FLAGS, ids=lambda g: g[-1] if len(g) > 2 else g[0])
def test_performance_flags_are_honoured(given):
    """Megatron-LM's performance flags parse as Megatron-LM's; whether a combination runs
    here (transformer-engine for --attention-backend flash, a plan for interleaving) is
    performance/checks.py's to say."""
    flag = next(g for g in reversed(given) if g.startswith("--"))
    assert TABLE[flag].status is flags.Status.HONOURED
    parse_args(BASE + given)


def test_fp8_names_transformer_engine():
    with pytest.raises(HeteroError, match="--fp8-format: FP8/FP4 training needs transformer-engine "
                                          "on Hopper/Ada/Blackwell/MI300 GPUs; not supported yet - remove it"):
        parse_args(BASE + ["--fp8-format", "hybrid"])


def test_all_refused_and_unknown_flags_are_reported_in_one_error():
    with pytest.raises(HeteroError) as err:
        parse_args(BASE + ["--fp8-format", "hybrid", "--log-energy", "--tp-comm-overlap-cfg",
                           "userbuffers.yaml", "--batch-size", "4", "--hiden-size", "8"])
    message = str(err.value)
    assert message.startswith("5 flag(s) Megatron-Hetero cannot run:")
    for expected in ("--fp8-format: FP8", "--log-energy: a logging or timing option",
                     "--tp-comm-overlap-cfg: a communication-overlap variant",
                     "--batch-size: removed from Megatron-LM; use --micro-batch-size",
                     "unknown flag --hiden-size (did you mean --hidden-size?)"):
        assert expected in message
    assert "userbuffers.yaml" not in message  # the value was parsed as Megatron-LM parses it


REFUSED_VALUES = [(a.option_strings[0], value) for a in PARSER._actions
                  for value in getattr(a, "refused_values", {})]


@pytest.mark.parametrize("option, value", REFUSED_VALUES)
def test_megatron_values_of_honoured_flags_are_refused_by_name(option, value):
    with pytest.raises(HeteroError, match=rf"\n  {option} {value}: \S.*\n"):
        parse_args(BASE + [option, value])


def test_refused_values_are_megatrons_and_not_ours():
    megatron = {f.name: f.choices for f in flags.megatron_flags()}
    assert {o for o, _ in REFUSED_VALUES} >= {"--ckpt-format", "--optimizer", "--tokenizer-type"}
    for option, values in catalog.REFUSED_VALUES.items():
        action = PARSER._option_string_actions[option]
        for value in values:  # stale once arguments/ runs the value: delete the entry
            assert value in megatron[option] and value in action.refused_values, (option, value)


def test_refused_flags_take_megatrons_value_syntax():
    # argparse's words, as Megatron-LM says it, reported as bad input (exit 2, no usage dump)
    with pytest.raises(HeteroError, match="argument --fp8-format: invalid choice: 'fp9'"):
        parse_args(BASE + ["--fp8-format", "fp9"])
    with pytest.raises(HeteroError, match="--rampup-batch-size: expected 3 arguments"):
        parse_args(BASE + ["--rampup-batch-size", "16", "16"])


# ---- no-ops ----------------------------------------------------------------------------

@pytest.mark.parametrize("ruling", _of(flags.Status.NOOP), ids=lambda r: r.flag.name)
def test_noops_are_accepted_and_said(ruling):
    option = ruling.flag.option_strings[-1]
    args = parse_args(BASE + [option, *_non_default_value(ruling.flag)])
    assert [m for m in args.noop_flags if m.startswith(f"{option}: no-op, ")], args.noop_flags


@pytest.mark.parametrize("given", [["--cuda-graph-impl", "none"], ["--cp-comm-type", "p2p"]])
def test_a_refused_flag_at_megatrons_default_changes_nothing(given):
    args = parse_args(BASE + given)
    assert args.noop_flags == [f"{' '.join(given)}: Megatron-LM's default value; no effect"]


def test_megatrons_second_name_of_an_honoured_flag_is_honoured():
    assert parse_args(BASE + ["--persistent-save-interval", "7"]).save_interval == 7


# ---- "did you mean" only for a real typo -----------------------------------------------

@pytest.mark.parametrize("typo, meant", [
    ("--hiden-size", "--hidden-size"), ("--hidden_size", "--hidden-size"),
    ("--hiddensize", "--hidden-size"), ("--train-iter", "--train-iters"),
    ("--ckpt-formatt", "--ckpt-format"), ("--lr-warmup-sample", "--lr-warmup-samples"),
    ("--micro-bach-size", "--micro-batch-size"),
    ("--tensor-parallel-size", "--tensor-model-parallel-size"),
])
def test_a_typo_suggests_the_flag(typo, meant):
    with pytest.raises(HeteroError, match=rf"unknown flag {typo} \(did you mean {meant}\?\)"):
        parse_args(BASE + [typo, "1"])


@pytest.mark.parametrize("given", ["--lr-warmup-tokens", "--train-tokens", "--lr-decay-steps",
                                   "--fp16-format", "--decoder-hidden-size", "--max-lr",
                                   "--exit-duration-in-seconds", "--load-optim",
                                   "--lr-warmup", "--first-pipeline-num-layers"])
def test_another_unit_or_feature_is_never_suggested(given):
    with pytest.raises(HeteroError) as err:
        parse_args(BASE + [given, "1"])
    assert f"unknown flag {given}:" in str(err.value) and "did you mean" not in str(err.value)


@pytest.mark.parametrize("flag", ["--lr-warmup-samples", "--fp8-format", "--train-samples"])
def test_megatron_flags_are_never_unknown(flag):
    """The old parser suggested --lr-warmup-iters (another unit) and --ckpt-format."""
    try:
        parse_args(BASE + [flag, "hybrid" if flag == "--fp8-format" else "10"])
    except HeteroError as err:  # refused: named with its reason
        assert f"  {flag}: " in str(err)
        assert "unknown" not in str(err) and "did you mean" not in str(err)


def test_typo_rule():
    assert flags.is_typo("--hiden-size", "--hidden-size")
    assert not flags.is_typo("--lr-warmup-samples", "--lr-warmup-iters")
    assert not flags.is_typo("--fp8-format", "--ckpt-format")
    assert not flags.is_typo("--encoder-num-layers", "--decoder-num-layers")
    assert not flags.is_typo("--min-lr", "--max-lr")
    assert not flags.is_typo("--load-optim", "--no-load-optim")  # the opposite
    assert flags.is_typo("--tensor-parallel-size", "--tensor-model-parallel-size")


# ---- --help and docs/flags.md ----------------------------------------------------------

def test_docs_flags_md_is_generated_from_the_registry():
    committed = (REPO / "docs" / "flags.md").read_text()
    assert committed == render(), "docs/flags.md is stale: python -m tools.flags_doc > docs/flags.md"


def test_readme_states_only_the_generated_flag_counts():
    """Counts of flags come from one function (flags.flag_counts); README.md states them only
    in the block `python -m tools.flags_doc --readme` writes."""
    readme = (REPO / "README.md").read_text()
    if flags.docs.README_BEGIN in readme:
        start = readme.index(flags.docs.README_BEGIN)
        end = readme.index(flags.docs.README_END) + len(flags.docs.README_END)
        assert readme[start:end] == readme_block(), "run: python -m tools.flags_doc --readme"
    c = flags.flag_counts(PARSER)
    assert (c.honoured + c.noop + c.refused, c.total) == (c.total, len(flags.megatron_flags()))


# ---- docs/flags.md agrees with what the runtime does -----------------------------------
# Each flag's status is read from the committed docs/flags.md, then checked at start-up
# (parsing and validation, startup.configure: no process group, no training):
# honoured -> runs with a value other than Megatron-LM's default; refused -> named with the
# reason docs/flags.md gives; no-op -> accepted and said.

def _statuses_in_docs() -> dict[str, list[str]]:
    """Each flag's statuses as docs/flags.md lists it (once, if the page is right)."""
    text = (REPO / "docs" / "flags.md").read_text()
    sections = {"honoured": text.split("\n## Honoured\n")[1].split("\n## No-ops\n")[0],
                "no-op": text.split("\n## No-ops\n")[1].split("\n## Refused\n")[0],
                "refused": text.split("\n## Refused\n")[1].split("\n## Megatron-Hetero's own flags")[0]}
    found: dict[str, list[str]] = {}
    for status, section in sections.items():
        for line in section.splitlines():
            table_row = re.match(r"^\| `(--[^`]+)`", line)
            list_item = re.match(r"^- `(--[^` ]+)`", line)
            # Honoured flags' refused values are listed as "- `--flag value`": not the flag's status.
            match = table_row or (list_item if status == "refused" else None)
            if match:
                found.setdefault(match.group(1), []).append(status)
    return found


DOC_STATUS = _statuses_in_docs()


def test_docs_flags_md_gives_every_flag_one_status():
    assert set(DOC_STATUS) == set(TABLE)
    assert {flag: s for flag, s in DOC_STATUS.items() if len(s) != 1} == {}
    assert {flag: s[0] for flag, s in DOC_STATUS.items()} == {
        flag: ruling.status.value for flag, ruling in TABLE.items()}


# Honoured flags whose sample needs other flags (or another value) to make a valid run; the
# rest get _non_default_value. Values other than Megatron-LM's default, so each one asks for
# something.
HONOURED_SAMPLES = {
    # Flags with their companions ({tmp}: the test's directory, holding the data-args files).
    "--profile": ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "{tmp}/tb"],
    "--save-retain-interval": ["--save", "{tmp}/ckpt", "--save-interval", "2", "--save-retain-interval", "4"],
    "--use-checkpoint-args": ["--use-checkpoint-args", "--load", "{tmp}/ckpt"],
    "--non-persistent-save-interval": ["--save", "{tmp}/ckpt", "--non-persistent-ckpt-type", "global",
                                       "--non-persistent-save-interval", "2"],
    "--ckpt-convert-format": ["--load", "{tmp}/ckpt", "--ckpt-convert-format", "torch_dist",
                              "--ckpt-convert-save", "{tmp}/converted"],
    "--overlap-param-gather-with-optimizer-step": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                                   "--overlap-param-gather",
                                                   "--overlap-param-gather-with-optimizer-step"],
    "--data-args-path": ["--data-args-path", "{tmp}/data_args"],
    "--per-split-data-args-path": ["--per-split-data-args-path", "{tmp}/splits.json"],
    # One process here: degree 1 (the plan-made degrees are tested with several processes).
    "--expert-model-parallel-size": ["--num-experts", "4", "--disable-bias-linear",
                                     "--expert-model-parallel-size", "1"],
    "--expert-tensor-parallel-size": ["--num-experts", "4", "--disable-bias-linear",
                                      "--expert-tensor-parallel-size", "1"],
    "--fp32-residual-connection": ["--fp32-residual-connection", "--bf16"],
    "--fp16-lm-cross-entropy": ["--fp16-lm-cross-entropy", "--fp16"],
    "--encoder-num-layers": ["--encoder-num-layers", "4"],
    "--encoder-seq-length": ["--encoder-seq-length", "32"],
    "--window-size": ["--window-size", "4,0"],
    "--window-attn-skip-freq": ["--window-size", "4,0", "--window-attn-skip-freq", "2"],
    "--no-rope-freq": ["--position-embedding-type", "rope", "--no-rope-freq", "2"],
    "--moe-layer-freq": ["--num-experts", "4", "--disable-bias-linear", "--moe-layer-freq", "([0]+[1]*3)"],
    "--dataloader-fast-cache-load": ["--dataloader-fast-cache-load", "--data-cache-path", "/nonexistent/cache"],
    "--dataloader-defer-npy-index-mmap": ["--dataloader-defer-npy-index-mmap", "--data-cache-path",
                                          "/nonexistent/cache"],
    "--tensor-model-parallel-size": ["--tensor-model-parallel-size", "2"],
    "--pipeline-model-parallel-size": ["--pipeline-model-parallel-size", "2"],
    "--hidden-size": ["--hidden-size", "128"],
    "--num-attention-heads": ["--num-attention-heads", "8"],
    "--max-position-embeddings": ["--max-position-embeddings", "64"],
    "--no-position-embedding": ["--position-embedding-type", "rope", "--no-position-embedding"],
    "--micro-batch-size": ["--micro-batch-size", "4"],
    "--global-batch-size": ["--global-batch-size", "32"],
    "--rampup-batch-size": ["--rampup-batch-size", "4", "4", "16"],
    "--train-samples": ["--train-samples", "80"],
    "--lr-decay-samples": ["--train-samples", "80", "--lr-decay-samples", "64"],
    "--lr-wsd-decay-samples": ["--train-samples", "80", "--lr-wsd-decay-samples", "16"],
    "--lr-warmup-samples": ["--train-samples", "80", "--lr-warmup-samples", "16"],
    "--save-interval": ["--save", "/nonexistent/ckpt", "--save-interval", "3"],
    "--ckpt-format": ["--ckpt-format", "torch_dist"],  # Megatron-LM's default: the one we run
    "--tokenizer-type": ["--tokenizer-type", "NullTokenizer"],
    "--data-path": ["--data-path", "/nonexistent/prefix"],  # the files are checked later, per rank
    "--tiktoken-pattern": ["--tiktoken-pattern", "v1"],
    "--num-experts": ["--num-experts", "4", "--disable-bias-linear"],
    "--wandb-project": ["--wandb-project", "p", "--wandb-save-dir", "/nonexistent/wandb"],
    "--attention-backend": ["--attention-backend", "local", "--transformer-impl", "local"],
    "--recompute-granularity": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                "--recompute-num-layers", "1"],
    "--recompute-method": ["--recompute-granularity", "full", "--recompute-method", "block",
                           "--recompute-num-layers", "1"],
    "--recompute-num-layers": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                               "--recompute-num-layers", "2"],
    "--recompute-modules": ["--recompute-granularity", "selective", "--recompute-modules", "mlp"],
    "--num-layers-per-virtual-pipeline-stage": ["--pipeline-model-parallel-size", "2",
                                                "--num-layers-per-virtual-pipeline-stage", "1"],
    "--num-virtual-stages-per-pipeline-rank": ["--pipeline-model-parallel-size", "2",
                                               "--num-virtual-stages-per-pipeline-rank", "2"],
    "--overlap-param-gather": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                               "--overlap-param-gather"],
    "--decoder-first-pipeline-num-layers": ["--pipeline-model-parallel-size", "2",
                                            "--decoder-first-pipeline-num-layers", "1"],
    "--decoder-last-pipeline-num-layers": ["--pipeline-model-parallel-size", "2",
                                           "--decoder-last-pipeline-num-layers", "3"],
    "--pipeline-model-parallel-layout": ["--pipeline-model-parallel-size", "2",
                                         "--pipeline-model-parallel-layout", "Et|t*3L"],
    "--account-for-embedding-in-pipeline-split": ["--pipeline-model-parallel-size", "2",
                                                  "--num-layers", "3", "--account-for-embedding-in-pipeline-split"],
    "--account-for-loss-in-pipeline-split": ["--pipeline-model-parallel-size", "2", "--num-layers", "3",
                                             "--account-for-loss-in-pipeline-split"],
}
# Values that need hardware this machine may lack: checked where it has it.
GPU_ONLY = {"--transformer-impl": "transformer_engine", "--distributed-backend": "nccl"}
# Flags that need a GPU whatever their value (their CPU refusal: tests/test_flags_honoured.py).
CUDA_ONLY_FLAGS = {"--record-memory-history", "--log-device-memory-used"}
DATA_FLAGS = {"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path",
              "--per-split-data-args-path"}


def _base_for(given: list[str]) -> list[str]:
    """BASE without the flags ``given`` replaces (one unit of training length, one data source)."""
    drop = set()
    if "--train-samples" in given:
        drop.add("--train-iters")
    for alias, flag in (("--encoder-num-layers", "--num-layers"), ("--encoder-seq-length", "--seq-length")):
        if alias in given:
            drop.add(flag)
    if DATA_FLAGS & set(given):
        drop.add("--mock-data")
    out, skip = [], 0
    for i, arg in enumerate(BASE):
        if skip:
            skip -= 1
        elif arg in drop:
            skip = 1 if arg in ("--train-iters", "--num-layers", "--seq-length") else 0
        else:
            out.append(arg)
    return out


def _honoured_sample(ruling: flags.Ruling) -> list[str]:
    flag = ruling.flag
    if flag.name in HONOURED_SAMPLES:
        return HONOURED_SAMPLES[flag.name]
    option = flag.option_strings[-1]
    action = PARSER._option_string_actions[option]
    if flag.choices:  # a value we run, other than Megatron-LM's default
        skip = {flag.default, *getattr(action, "refused_values", {}), GPU_ONLY.get(flag.name)}
        value = next(c for c in action.choices if c not in skip and [c] != flag.default)
        return [option, str(value)]
    return [option, *_non_default_value(flag)]


@pytest.mark.parametrize("flag", [f for f, s in DOC_STATUS.items() if s == ["honoured"]])
def test_a_flag_docs_call_honoured_runs(flag, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # W&B without an account, as --wandb-project's error advises
    if flag in CUDA_ONLY_FLAGS and not __import__("torch").cuda.is_available():
        pytest.skip("needs a GPU")
    given = [arg.replace("{tmp}", str(tmp_path)) for arg in _honoured_sample(TABLE[flag])]
    (tmp_path / "data_args").write_text("prefix")
    (tmp_path / "splits.json").write_text('{"train": ["prefix"], "valid": [], "test": []}')
    world = 2 if {"--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                  "--context-parallel-size"} & set(given) else 1
    job = configure(_base_for(given) + given, world)
    assert job.args.noop_flags == []


DEFAULT_ONLY = [r for r in _of(flags.Status.REFUSED) if r.default_only]


def test_default_only_flags_are_listed_as_refused():
    assert {r.flag.name for r in DEFAULT_ONLY} == set(catalog.DEFAULT_ONLY)
    assert all(DOC_STATUS[r.flag.name] == ["refused"] for r in DEFAULT_ONLY)


@pytest.mark.parametrize("ruling", DEFAULT_ONLY, ids=lambda r: r.flag.name)
def test_a_refused_flag_the_runtime_reads_runs_only_at_megatrons_default(ruling):
    """Refused flags arguments/ defines: start-up names any other value, with the way out."""
    option, default = ruling.flag.name, ruling.flag.default
    given = [option, *_non_default_value(ruling.flag)]
    with pytest.raises(HeteroError) as err:
        configure(BASE + given, 1)
    message = str(err.value)
    assert message.startswith(option), message
    assert f"{option} {default}" in message or "drop the flag" in message or "remove" in message
    if ruling.flag.takes_value and default is not None:  # at Megatron-LM's default it runs (None: not writable)
        configure(BASE + [option, str(default)], 1)


def _help_sections(text: str) -> dict[str, str]:
    parts = re.split(r"^(\S[^\n]*):\n", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_help_groups_every_flag_by_status_and_theme():
    result = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), "--help-all"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    sections = _help_sections(result.stdout)
    assert "honoured: Megatron-LM's meaning and default" in sections["model"]
    assert "--use-mcore-models" in sections["no-op (accepted; Megatron-LM ignores these too)"]
    fp8 = sections["refused: FP8 and FP4 training"]
    assert "FP8/FP4 training needs transformer-engine" in fp8 and "--fp8-format" in fp8
    for flag in flags.megatron_flags():
        assert re.search(rf"^  (\S+, )*{re.escape(flag.name)}\b", result.stdout, re.MULTILINE), flag.name


def test_flags_of_the_namespace_are_megatrons_dests_only():
    """Non-honoured flags leave nothing behind on args (the start-up log prints every arg)."""
    args = parse_args(BASE + ["--use-mcore-models"])
    assert not hasattr(args, flags.GIVEN)
    assert isinstance(args, argparse.Namespace) and not hasattr(args, "fp8_format")


def test_a_real_launch_names_every_refused_flag_and_stops():
    result = run_pretrain(BASE + ["--use-mcore-models", "--fp8-format", "hybrid",
                                  "--overlap-grad-reduce", "--tensor-model-parallel-size", "1",
                                  "--sequence-parallel"], timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert "[launch rank 0] error: 1 flag(s) Megatron-Hetero cannot run:" in result.stderr
    assert "  --fp8-format: FP8/FP4 training needs transformer-engine" in result.stderr
    assert "--sequence-parallel" not in result.stderr and "Traceback" not in result.output


# ----- GPU-only choices on the CPU: substituted, one note ---------------------------------

GPU_CHOICES = ["--transformer-impl", "transformer_engine", "--attention-backend", "flash",
               "--distributed-backend", "nccl", "--no-bias-gelu-fusion",
               "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"]
MOE_GPU_CHOICES = ["--num-experts", "4", "--disable-bias-linear", "--moe-grouped-gemm",
                   "--moe-permute-fusion", "--moe-router-fusion"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU's substitutions")
def test_gpu_only_choices_run_as_their_cpu_equivalents():
    args = configure(BASE + GPU_CHOICES + MOE_GPU_CHOICES, 1).args
    assert (args.transformer_impl, args.attention_backend, args.distributed_backend,
            args.cross_entropy_fusion_impl) == ("local", "local", "gloo", "native")
    assert not (args.moe_grouped_gemm or args.moe_permute_fusion or args.moe_router_fusion)
    from megatron.hetero.cpu_device import substitution_note

    note = substitution_note(args.cpu_substitutions)
    for said in ("--transformer-impl transformer_engine -> local", "--attention-backend flash -> local",
                 "--distributed-backend nccl -> gloo", "--cross-entropy-fusion-impl te -> native",
                 "--moe-grouped-gemm ->", "--moe-permute-fusion ->", "--moe-router-fusion ->",
                 "--no-bias-gelu-fusion: no effect"):
        assert said in note
    assert substitution_note(configure(BASE, 1).args.cpu_substitutions) is None


@pytest.mark.parametrize("flag", ["--fp8-format", "--cuda-graph-impl", "--tp-comm-overlap-cfg",
                                  "--te-rng-tracker", "--use-nccl-ub"])
def test_gpu_only_choices_without_a_cpu_equivalent_stay_refused(flag):
    assert TABLE[flag].status is flags.Status.REFUSED
    assert TABLE[flag].theme in ("low_precision", "gpu_runtime", "overlap")


# ---- the general rules: flags Megatron-LM never reads, flags that are config fields ------

def test_a_flag_megatron_never_reads_is_a_noop_saying_why():
    """The no-op rule follows Megatron-LM's code (flags/reads.py): read nowhere, or only
    under a switch that stays refused (named in the reason)."""
    assert "read nowhere" in TABLE["--dino-teacher-temp"].reason
    fim_rate = TABLE["--fim-rate"]
    assert fim_rate.status is flags.Status.NOOP and "--fim-data" in fim_rate.reason
    assert TABLE["--fim-data"].status is flags.Status.REFUSED   # the switch itself
    # A flag read by an assertion only (a check, never an effect) is a no-op too.
    assert TABLE["--moe-pad-experts-for-cuda-graph-inference"].status is flags.Status.NOOP
    args = parse_args(BASE + ["--fim-rate", "0.5", "--dino-teacher-temp", "0.1"])
    assert [m.split(":")[0] for m in args.noop_flags] == ["--fim-rate", "--dino-teacher-temp"]


def test_a_catalog_entry_for_a_flag_megatron_never_reads_is_an_error(monkeypatch):
    monkeypatch.setitem(catalog.THEME_FLAGS, "legacy", (*catalog.THEME_FLAGS["legacy"], "--fim-rate"))
    with pytest.raises(RuntimeError, match="never acts on it.*--fim-rate"):
        flags.check_registry(flags.defined_options(PARSER))


def test_the_reads_scanner_follows_gates_checks_and_early_returns():
    """tools/megatron_flag_reads.py's rules, on a small program of Megatron-LM's shape."""
    import ast

    from tools.megatron_flag_reads import _Reads

    source = '''
def train(args):
    if args.fim_data and args.fim_rate > 0:
        use(args.fim_spm_rate)
    assert args.checked_only > 0
    if args.plain:
        assert args.also_checked
    use(args.always)
def setup(args):
    if not args.enable_ft:
        return
    use(args.ft_interval)
'''
    visitor = _Reads("megatron/training/x.py", {"fim_rate", "fim_spm_rate", "checked_only", "also_checked",
                                                  "always", "ft_interval"})
    visitor.visit(ast.parse(source))
    found = {dest: [(r["gated_by"], r["check"]) for r in reads] for dest, reads in visitor.found.items()}
    assert found == {"fim_rate": [(["fim_data"], False)], "fim_spm_rate": [(["fim_data"], False)],
                     "checked_only": [([], True)], "also_checked": [([], True)], "always": [([], False)],
                     "ft_interval": [(["enable_ft"], False)]}


def test_config_field_flags_are_declared_from_megatrons_facts():
    """Honouring a megatron-core config field is listing it (arguments.CONFIG_FIELD_FLAGS):
    its names, default and value syntax are Megatron-LM's."""
    from megatron.hetero.arguments import CONFIG_FIELD_FLAGS, honoured_config_values

    by_name = {f.name: f for f in flags.megatron_flags()}
    args = parse_args(BASE)
    for names in CONFIG_FIELD_FLAGS.values():
        for name in (n for n in names if n in by_name):  # another tag's flag: not declared here
            assert TABLE[name].status is flags.Status.HONOURED, name
            assert getattr(args, by_name[name].dest) == by_name[name].default, name
    given = parse_args(BASE + ["--moe-layer-freq", "([0]+[1]*3)", "--window-size", "(4,0)",
                               "--no-rope-freq", "2"])
    values = honoured_config_values(given, {"moe_layer_freq", "window_size", "no_rope_freq", "hidden_size"})
    assert values == {"moe_layer_freq": [0, 1, 1, 1], "window_size": (4, 0), "no_rope_freq": 2,
                      "hidden_size": 64}
    with pytest.raises(HeteroError, match="not a layer pattern"):
        parse_args(BASE + ["--moe-layer-freq", "[1]*__import__('os').getpid()"])


def test_tokenizer_flags_reach_megatron_cores_tokenizer(tmp_path):
    import tiny_tokenizers
    from megatron.hetero.data import build_tokenizer

    model = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
             str(tiny_tokenizers.huggingface_dir(tmp_path))]
    plain = build_tokenizer(parse_args(BASE + model))
    special = build_tokenizer(parse_args(BASE + model + ["--tokenizer-special-tokens", "<fim>"]))
    assert special.vocab_size == plain.vocab_size + 1
    assert special.tokenize("<fim>") == [plain.vocab_size] != plain.tokenize("<fim>")


def test_moe_dispatcher_flex_is_refused_by_name():
    with pytest.raises(HeteroError, match="--moe-token-dispatcher-type flex: the flex dispatcher runs on DeepEP"):
        parse_args(BASE + ["--num-experts", "4", "--moe-token-dispatcher-type", "flex"])


def test_a_config_field_only_a_refused_feature_reads_is_a_noop():
    """megatron-core code that only one feature builds (flags/reads.py CORE_FEATURES): its
    switch stays refused, so the fields only it reads are no-ops naming it."""
    from megatron.hetero.flags.reads import CORE_FEATURES

    for switch in set(CORE_FEATURES.values()):
        option, *value = switch.split()
        if value:
            assert value[0] in catalog.REFUSED_VALUES[option], switch
        else:
            assert TABLE[option].status is flags.Status.REFUSED, switch
    assert TABLE["--fsdp-double-buffer"].status is flags.Status.NOOP
    assert "--use-megatron-fsdp" in TABLE["--fsdp-double-buffer"].reason
    assert "--optimizer muon" in TABLE["--muon-momentum"].reason


def test_timing_log_option_takes_effect():
    """--timing-log-option max prints one number per timer (megatron-core's Timers), where
    Megatron-LM's default, minmax, prints the (min, max) pair."""
    result = run_pretrain(BASE + ["--timing-log-level", "1", "--timing-log-option", "max",
                                  "--train-iters", "1", "--eval-iters", "0"])
    assert result.returncode == 0, result.output[-3000:]
    lines = [line for line in result.output.splitlines() if "forward-backward ...." in line]
    assert lines and all(re.search(r"forward-backward \.+: [\d.]+$", line) for line in lines), lines


def test_the_reads_scan_is_of_the_facts_tag_and_every_flag():
    from megatron.hetero.flags import reads

    assert reads.scanned_tag() == flags.megatron_tag()
    assert {f.dest for f in flags.megatron_flags()} <= reads.scanned_dests()
