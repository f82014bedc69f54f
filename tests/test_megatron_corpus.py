"""Megatron-LM's own GPT and MoE recipes (tests/megatron_corpus/: every functional-test
recipe at core_v0.16.1 and the example launch scripts), run under one scale-down rule at
their own parallel layout, both without a plan and under a heterogeneous plan of the same
layout made from their flags (plans.py): each trains, or is refused with the runtime's
reason naming a flag - never a traceback. docs/megatron-recipes.md is the table of the
recorded statuses (statuses.json, written by python -m tests.megatron_corpus.report).

Every recipe is configured in-process both ways (where refusals are decided) on every run.
Launched both ways: a stable sample by hash of the recipes that train (every recipe runs
data-parallel or model-parallel, so each launch is 2-8 processes); all of them with
MEGATRON_CORPUS=all (python -m tests.megatron_corpus.report runs them all and records them).

The same corpus at core_v0.19.0 (corpus.core_v0.19.0.json, tests/recipes/core_v0.19.0/),
recorded on megatron-core 0.19.2 (statuses.core_v0.19.0.json,
docs/megatron-recipes-core_v0.19.0.md): its table is checked here on every run, and a stable
sample of its recipes is launched both ways in make test's megatron-core 0.19.2 pass.
"""

from __future__ import annotations

import os
import re
from importlib.metadata import version

import pytest

import tiny_tokenizers
from conftest import run_pretrain
from megatron.hetero.startup import tp_pp_dp_rank_order
from tests.megatron_corpus import report
from tests.megatron_corpus.corpus import DEFAULT_TAG, TAGS, recipes
from tests.megatron_corpus.plans import PINNING_FLAGS, megatron_split, plan_for
from tests.megatron_corpus.scale import check_divisible, layout_of, scale_down

RECIPES = recipes()
BY_NAME = {r.name: r for r in RECIPES}
RECORDED = report.load_statuses()
SAMPLE = 4  # recipes launched both ways by default (3-5 s a launch on 2 cores)
CORE019_SAMPLE = 1  # of those, launched again in make test's megatron-core 0.19.2 pass
CORE019_TAG = "core_v0.19.0"  # the corpus recorded on megatron-core 0.19.2
RECIPES_019 = recipes(CORE019_TAG)
RECORDED_019 = report.load_statuses(CORE019_TAG)
CORPORA = {DEFAULT_TAG: (RECIPES, RECORDED), CORE019_TAG: (RECIPES_019, RECORDED_019)}
CORE019_CORPUS_SAMPLE = 1  # core_v0.19.0 recipes launched both ways in the 0.19.2 pass
ON_CORE019 = version("megatron-core").split(".")[:2] == report.CORE_RELEASE[CORE019_TAG].split(".")[:2]


def _launched() -> list[tuple]:
    """(recipe, way) pairs launched: each way the record says trains."""
    by_hash = sorted(RECIPES, key=lambda r: r.sample_key())
    training = [r for r in by_hash if r.name in RECORDED
                and any(getattr(RECORDED[r.name], w).status == "trained" for w in report.WAYS)]
    chosen = by_hash if os.environ.get("MEGATRON_CORPUS") == "all" else training[:SAMPLE]
    again = {r.name for r in training[:CORE019_SAMPLE]}
    return [pytest.param(r, w, id=f"{r.name}-{w}", marks=[pytest.mark.core019] if r.name in again else [])
            for r in chosen if r.name in RECORDED
            for w in report.WAYS if getattr(RECORDED[r.name], w).status == "trained"]


def _launched_core019() -> list:
    """The core_v0.19.0 recipes the 0.19.2 pass launches, both ways: by the same stable hash,
    the first that the record says train both ways, of those new or changed since core_v0.16.1
    (an unchanged one repeats what the core_v0.16.1 sample launches)."""
    before = {r.name: r.flags for r in RECIPES}
    by_hash = sorted((r for r in RECIPES_019 if before.get(r.name) != r.flags), key=lambda r: r.sample_key())
    training = [r for r in by_hash if r.name in RECORDED_019
                and all(getattr(RECORDED_019[r.name], w).status == "trained" for w in report.WAYS)]
    return [pytest.param(r, w, id=f"{CORE019_TAG}:{r.name}-{w}")
            for r in training[:CORE019_CORPUS_SAMPLE] for w in report.WAYS]


def test_corpus_holds_every_gpt_and_moe_recipe():
    assert len(RECIPES) == len(BY_NAME) == 187  # 184 functional tests + 3 example scripts
    assert sum(r.source.startswith("tests/functional_tests/test_cases/moe/") for r in RECIPES) == 42
    assert {r.source for r in RECIPES if r.name.startswith("examples/")} == {
        "examples/gpt3/train_gpt3_175b_distributed.sh", "examples/llama/train_llama3_8b_h100_fp8.sh",
        "examples/mixtral/train_mixtral_8x7b_distributed.sh"}
    assert set(RECORDED) == set(BY_NAME), "rerun python -m tests.megatron_corpus.report --run-all"


def test_the_core_v0_19_0_corpus_holds_every_gpt_and_moe_recipe():
    """At core_v0.19.0 the recipes live where they did (test_cases/{gpt,moe}), 84 more."""
    assert len(RECIPES_019) == len({r.name for r in RECIPES_019}) == 271  # 268 functional tests + 3 examples
    assert sum(r.source.startswith("tests/functional_tests/test_cases/moe/") for r in RECIPES_019) == 63
    assert {r.source for r in RECIPES_019 if r.name.startswith("examples/")} == {
        r.source for r in RECIPES if r.name.startswith("examples/")}
    assert set(RECORDED_019) == {r.name for r in RECIPES_019}, (
        f"rerun PYTHONPATH=.core019 python -m tests.megatron_corpus.report --tag {CORE019_TAG} --run-all")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_scale_down_keeps_the_layout_and_the_plan_agrees(recipe, tmp_path):
    argv = scale_down(recipe.flags, tmp_path)
    given = {p[0]: p[1] if len(p) > 1 else None for p in recipe.flags}
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--context-parallel-size", "--expert-model-parallel-size",
                 "--num-virtual-stages-per-pipeline-rank", "--sequence-parallel",
                 "--use-distributed-optimizer", "--transformer-impl", "--attention-backend"):
        if flag in given:
            index = argv.index(flag)
            assert given[flag] is None or argv[index + 1] == given[flag], flag
    layout = layout_of(recipe.flags)
    check_divisible(layout, argv)
    assert not any("$" in a for a in argv)
    made = plan_for(recipe.flags, argv, layout)
    if made.plan is None:  # the recipe gives no model size, a split no plan holds, a refused expert layout
        assert ("--num-layers" not in argv or "--pipeline-model-parallel-layout" in argv
                or "expert_tensor_parallel" in made.note
                or "context parallelism with expert parallelism" in made.note), made.note
        return
    plan, values = made.plan, dict(zip(argv, argv[1:]))
    split = megatron_split(argv, layout)
    # The recipe's own layout: every flag the plan also fixes agrees with it.
    assert plan.world_size == layout.world_size and plan.context_parallel == layout.cp
    assert (plan.tensor_parallel, plan.pipeline_parallel, plan.data_parallel) == (layout.tp, layout.pp, layout.dp)
    assert (plan.virtual_pipeline_size or 1) == layout.virtual
    assert plan.micro_batch_size == int(values["--micro-batch-size"])
    assert plan.global_batch_size == int(values.get("--global-batch-size", plan.micro_batch_size * layout.dp))
    assert plan.num_layers == int(values["--num-layers"]) == sum(map(sum, split))
    # Heterogeneous wherever the layout leaves room: stages, replicas, ranks.
    pinned = any(flag in given for flag in PINNING_FLAGS)
    stages = [s.virtual_stages or [s.num_layers] for s in plan.stages]
    assert (stages == split) == (layout.pp == 1 or pinned), (stages, split)
    counts = [r.num_micro_batches for r in plan.replicas]
    groups = plan.num_micro_batches // (layout.pp if layout.virtual > 1 else 1)  # what can be shared
    expert_bound = len(plan.grid.expert_replica_blocks) < plan.data_parallel  # equal within an expert group
    assert layout.dp == 1 or groups <= layout.dp or expert_bound or len(set(counts)) > 1, counts
    assert plan.expert_parallel == layout.ep
    if "--use-tp-pp-dp-mapping" in argv:  # the recipe orders its ranks itself
        assert plan.rank_order == tp_pp_dp_rank_order(plan)
    else:
        assert plan.world_size == 1 or plan.rank_order != sorted(plan.rank_order)


def test_a_quoted_value_with_spaces_stays_one_argument(tmp_path):
    """core_v0.19's --step-batch-size-schedule "0:16 2.4B:320 ..." is one argument, as the
    recipe quotes it: scaled down whole, not split into words as a list value is."""
    recipe = next(r for r in RECIPES_019 if r.name == "examples/gpt3_175b")
    given = dict(p for p in recipe.flags if len(p) == 2)["--step-batch-size-schedule"]
    argv = scale_down(recipe.flags, tmp_path)
    index = argv.index("--step-batch-size-schedule")
    assert argv[index + 1] == given == "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
    assert argv[index + 2].startswith("--")


def test_a_refusal_of_several_problems_is_grouped_by_its_first():
    """Not under "2 problems with this launch": the first problem's group, an unknown flag's
    without the flag's name (the inference recipes' --temperature, --top_k, ...)."""
    unknown = ("2 problems with this launch (each with its fix):\n"
               "  1. unknown flag --temperature: not a flag of Megatron-LM's pretrain_gpt.py nor of "
               "Megatron-Hetero; unknown flag --top_k: not a flag of Megatron-LM's pretrain_gpt.py\n"
               "  2. missing required flag(s): --global-batch-size")
    assert report.group_of(unknown) == "unknown flag"
    missing = "2 problems with this launch (each with its fix):\n  1. missing required flag(s): --seq-length\n  2. x"
    assert report.group_of(missing) == "missing required flag"


def test_the_plan_rule_worked_by_hand(tmp_path):
    """plans.py's rule on three recipes, its numbers worked out by hand."""
    def plan_of(name):
        recipe = BY_NAME[name]
        return plan_for(recipe.flags, scale_down(recipe.flags, tmp_path), layout_of(recipe.flags)).plan

    # PP4, 2 layers a stage: one moved from the first stage to the last; ranks reversed.
    plan = plan_of("gpt/gpt3_mcore_tp1_pp4")
    assert [s.num_layers for s in plan.stages] == [1, 2, 2, 3] and plan.rank_order == [3, 2, 1, 0]
    # EP8 -> DP8, every replica in the one expert-parallel group: 16 micro-batches, 2 each.
    plan = plan_of("moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer")
    assert [r.num_micro_batches for r in plan.replicas] == [2] * 8 and plan.expert_parallel == 8
    # TP1 PP1 -> DP2: 4 micro-batches shared 2:1 = 2.67, 1.33 -> 3, 1.
    plan = plan_of("gpt/gpt3_mcore_te_tp1_pp1_uniform_full_recompute")
    assert [r.num_micro_batches for r in plan.replicas] == [3, 1] and plan.rank_order == [1, 0]
    # TP1 PP2 -> DP2, 4 processes: 2 layers a stage -> 1, 3; 4 micro-batches -> 3, 1.
    plan = plan_of("gpt/gpt3_mcore_te_tp1_pp2_rope_embeddings")
    assert [s.num_layers for s in plan.stages] == [1, 3]
    assert [r.num_micro_batches for r in plan.replicas] == [3, 1] and plan.rank_order == [3, 2, 1, 0]
    # --account-for-embedding/loss-in-pipeline-split, PP4 x VP2: 14 layers + 2 counted = 2 a
    # virtual stage, the first and the last one fewer; the recipe's split kept.
    plan = plan_of("gpt/gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split")
    assert [s.virtual_stages for s in plan.stages] == [[1, 2], [2, 2], [2, 2], [2, 1]]
    # PP4 x VP3 with --microbatch-group-size-per-virtual-pipeline-stage 5: micro-batches a
    # replica in whole units of lcm(4, 5) = 20 (4 would be fewer than one group of 5; 8, 12
    # and 16 leave a last group shorter than PP 4), in training and evaluation: a global batch of 40.
    recipe = BY_NAME["gpt/gpt3_mcore_te_tp1_pp4_vp1_tunable_overlap"]
    argv = scale_down(recipe.flags, tmp_path)
    assert argv[argv.index("--global-batch-size") + 1] == "40"
    assert [r.num_micro_batches for r in plan_of(recipe.name).replicas] == [20]


def test_every_recipe_configures_or_is_refused_by_name_both_ways(tmp_path):
    """Every recipe, in-process, both ways: the refusal (or none) the table records, naming a flag."""
    changed = []
    for recipe in RECIPES:
        for planned, recorded_way in ((False, "without_plan"), (True, "under_plan")):
            workdir = tmp_path / re.sub(r"\W", "_", recipe.name) / recorded_way
            got = report.configure_outcome(recipe, workdir, planned)
            recorded = getattr(RECORDED[recipe.name], recorded_way)
            if got is None:
                assert recorded.status != "failed", f"{recipe.name} {recorded_way}: {recorded.reason[-1500:]}"
                if recorded.status == "refused":
                    changed.append(f"{recipe.name} {recorded_way}: now configures (recorded refused)")
                continue
            assert got.status == "refused" and "Traceback" not in got.reason, (recipe.name, got)
            named = report.refused_flags(got.reason)
            # A flag the recipe gives, or one it lacks (an inference recipe gives no MODEL_ARGS).
            assert set(named) & {p[0] for p in recipe.flags} or got.reason.startswith("missing "), (
                f"{recipe.name} {recorded_way}: the refusal names none of the recipe's flags: {got.reason}")
            # Compared by what is refused (the flags named), not by the wording.
            if recorded.status != "refused" or report.refusal_key(recorded.reason) != report.refusal_key(got.reason):
                changed.append(f"{recipe.name} {recorded_way}: refused now with {got.reason!r}, recorded "
                               f"{recorded.status} {recorded.reason!r}")
    assert not changed, ("statuses changed; rerun python -m tests.megatron_corpus.report --only NAME...:\n"
                         + "\n".join(changed))


@pytest.mark.parametrize("tag", TAGS)
def test_no_recipe_fails_and_the_table_is_up_to_date(tag):
    found, recorded = CORPORA[tag]
    failed = {f"{n} {w}": getattr(s, w).reason[-800:] for n, s in recorded.items() for w in report.WAYS
              if getattr(s, w).status in ("failed", "not run")}
    assert not failed, failed
    run = "PYTHONPATH=.core019 " * (tag == CORE019_TAG) + f"python -m tests.megatron_corpus.report --tag {tag}"
    assert set(recorded) == {r.name for r in found}, f"statuses missing or stale: {run} --run-all"
    doc = report.doc_path(tag)
    assert doc.read_text() == report.markdown(found, recorded, tag), (
        f"docs/{doc.name} is stale: {run} --table")


@pytest.mark.slow
@pytest.mark.parametrize("recipe, way", _launched())
def test_recipe_trains_both_ways(recipe, way, tmp_path):
    got = report.launch_outcome(recipe, tmp_path, planned=way == "under_plan")
    assert got.status == "trained", got.reason


@pytest.mark.slow
@pytest.mark.core019
@pytest.mark.skipif(not ON_CORE019, reason=f"the {CORE019_TAG} corpus is recorded on megatron-core "
                    f"{report.CORE_RELEASE[CORE019_TAG]}: make test's core019 pass launches it")
@pytest.mark.parametrize("recipe, way", _launched_core019())
def test_a_core_v0_19_0_recipe_trains_both_ways(recipe, way, tmp_path):
    got = report.launch_outcome(recipe, tmp_path, planned=way == "under_plan")
    assert got.status == "trained", got.reason


@pytest.mark.slow
def test_evaluation_of_the_interleaved_schedule_with_overlapped_warm_up_ends(tmp_path):
    """The one recipe whose evaluation runs the interleaved schedule forward-only with
    --overlap-p2p-communication-warmup-flush (its last send is left unwaited: patch
    overlapped-pipeline-sends-finished), under its plan; it evaluates at iteration 2."""
    recipe = BY_NAME["gpt/gpt3_mcore_te_tp1_pp4_vp1_tunable_overlap"]
    assert "--overlap-p2p-communication-warmup-flush" in {p[0] for p in recipe.flags}
    got = report.launch_outcome(recipe, tmp_path, planned=True)
    assert got.status == "trained", got.reason


# A typical GPU launch script: only the sizes are scaled; its GPU-only choices must run on
# the CPU as their equivalents, said in one start-up note.
GPU_SCRIPT = [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--sequence-parallel", "--use-distributed-optimizer", "--bf16",
    "--transformer-impl", "transformer_engine", "--attention-backend", "fused",
    "--distributed-backend", "nccl", "--no-gradient-accumulation-fusion",
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "1",
    "--lr", "1e-4", "--lr-decay-style", "cosine", "--log-interval", "1",
    "--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
]


@pytest.mark.slow
def test_a_gpu_launch_script_starts_on_four_cpu_processes(tmp_path):
    vocab, merges = tiny_tokenizers.gpt2_bpe_files(tmp_path / "gpt2")
    result = run_pretrain(GPU_SCRIPT + ["--vocab-file", str(vocab), "--merge-file", str(merges)],
                          nproc=4, tmp_path=tmp_path, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    assert len(result.losses()) == 2
    notes = [line for line in result.output.splitlines() if "GPU-only choices run as" in line]
    assert len(notes) == 1, notes
    for said in ("--transformer-impl transformer_engine -> local", "--attention-backend fused -> local",
                 "--distributed-backend nccl -> gloo", "--no-gradient-accumulation-fusion"):
        assert said in notes[0]


@pytest.mark.core019
def test_a_gpu_launch_script_runs_under_a_plan_made_from_it(tmp_path):
    """The same script, planned for a CPU cluster of two speeds FROM its own flags
    (hetero-plan -- <flags>), then run with one change: --hetero-plan added."""
    from hetero.cli import main
    from hetero.plan import Plan

    vocab, merges = tiny_tokenizers.gpt2_bpe_files(tmp_path / "gpt2")
    script = GPU_SCRIPT + ["--vocab-file", str(vocab), "--merge-file", str(merges)]
    out = tmp_path / "plan.json"
    cluster = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "cpu_demo.yaml")
    assert main(["--cluster", cluster, "-o", str(out), "--quiet", "--", *script]) == 0
    plan = Plan.load(out)
    assert (plan.tensor_parallel, plan.pipeline_parallel, plan.micro_batch_size) == (2, 2, 1)
    env = {"HETERO_DEVICE": ",".join(d.device_type for d in plan.devices),
           "HETERO_VENDOR": ",".join(d.vendor for d in plan.devices)}
    result = run_pretrain(script + ["--hetero-plan", str(out)], nproc=4, tmp_path=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    assert len(result.losses()) == 2
