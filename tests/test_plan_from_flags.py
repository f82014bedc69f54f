"""hetero-plan from pretrain_gpt.py's own flags (hetero/spec/megatron_args.py) and from a bash
launch script (hetero/spec/launch_script.py): the model, the padded vocabulary and the
launch flags are the ones the run reads, checked against the runtime and against bash."""

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import tiny_tokenizers  # noqa: E402
from hetero.errors import HeteroError  # noqa: E402
from hetero.spec.launch_script import pretrain_flags_of_script  # noqa: E402
from hetero.spec.megatron_args import (  # noqa: E402
    HETERO_FLAGS,
    job_of_flags,
    VocabularyPadding,
    parse_megatron_flags,
)
from hetero.spec.model import ModelSpec  # noqa: E402
from hetero.spec.presets import PRESETS  # noqa: E402
from megatron_corpus.corpus import recipes  # noqa: E402
from megatron_corpus.scale import scale_down  # noqa: E402

# The flags a model (and its vocabulary) depends on: what the runtime side is given.
MODEL_FLAGS = {
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--kv-channels",
    "--group-query-attention", "--num-query-groups", "--seq-length", "--max-position-embeddings",
    "--position-embedding-type", "--use-rotary-position-embeddings", "--normalization", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-experts", "--moe-router-topk",
    "--moe-ffn-hidden-size", "--make-vocab-size-divisible-by", "--tokenizer-type", "--vocab-size",
    "--vocab-file", "--merge-file", "--tokenizer-model", "--moe-shared-expert-intermediate-size",
    "--moe-layer-freq", "--mtp-num-layers", "--moe-router-num-groups", "--moe-router-group-topk",
    "--window-size", "--window-attn-skip-freq", "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank",
    "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",
}


def _model_flags(argv: list[str]) -> list[str]:
    """The model flags of a command line, each with the values that follow it."""
    kept, keep = ["--mock-data"], False
    for token in argv:
        if token.startswith("--"):
            keep = token in MODEL_FLAGS
        if keep:
            kept.append(token)
    return kept


# Real recipes (tests/megatron_corpus): the tokenizer each names, with tiny files of its type,
# and the tensor-parallel degree its vocabulary is padded for.
RECIPE_CASES = [
    ("examples/gpt3_175b", 2),                           # GPT2BPETokenizer by default, learned positions
    ("gpt/gpt3_mcore_reruns_reshard", 2),                # GQA, SwiGLU's default FFN, RMSNorm, RoPE
    ("gpt/gpt3_mcore_te_tp1_pp4_swiglu", 1),             # SwiGLU's default FFN, tied embeddings
    ("moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed", 2),  # MoE, --make-vocab-size-divisible-by 3232
    ("gpt/gpt3_7b_tp4_pp1_memory_speed", 4),             # NullTokenizer
    ("gpt/gpt_grpo_tp4_pp1_dp2_8b_throughput", 2),       # HuggingFaceTokenizer
    ("examples/llama3_8b_fp8", 1),                       # Llama 3: GQA, kv-channels, NullTokenizer
]


@pytest.mark.parametrize("name,tensor_parallel", RECIPE_CASES, ids=[c[0] for c in RECIPE_CASES])
def test_the_model_of_a_recipe_is_the_one_the_run_builds(name, tensor_parallel, tmp_path):
    from megatron.hetero.startup import model_args

    recipe = next(r for r in recipes() if r.name == name)
    argv = scale_down(recipe.flags, tmp_path)  # every flag of the recipe, tiny sizes and files
    job = job_of_flags(argv)
    planned = dataclasses.replace(job.model, vocab_size=job.vocabulary.padded((tensor_parallel,)))
    built = ModelSpec.from_megatron_args(model_args(_model_flags(argv), tensor_parallel))
    assert planned.differences(built) == []
    assert planned.vocab_size % (tensor_parallel * job.flags["make_vocab_size_divisible_by"]) == 0


def test_gpt2_vocabulary_and_padding_per_stage_degrees(tmp_path):
    """A vocab.json with <|endoftext|> counts its entries; one without gets it added (as the
    run's tokenizer does); the padding follows the plan's degrees (their least common
    multiple where stages differ), as the runtime's padded_vocab_size."""
    import argparse

    from megatron.hetero import data
    from megatron.hetero.arguments import padded_vocab_size as runtime_padding

    vocab, merges = tiny_tokenizers.gpt2_bpe_files(tmp_path / "gpt2")
    entries = json.loads(vocab.read_text())
    without_end = tmp_path / "no-end.json"
    without_end.write_text(json.dumps({t: i for i, t in enumerate(t for t in entries if t != "<|endoftext|>")}))
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
    for vocab_file in (vocab, without_end):
        flags = [*model, "--vocab-file", str(vocab_file), "--merge-file", str(merges),
                 "--make-vocab-size-divisible-by", "96"]
        job = job_of_flags(flags)
        namespace = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab_file),
                                       merge_file=str(merges), vocab_size=None, tokenizer_model=None,
                                       tiktoken_pattern=None, tiktoken_num_special_tokens=1000)
        assert job.tokenizer_vocab == data.build_tokenizer(namespace).vocab_size
        for stages in ([1], [2], [4], [2, 4], [4, 8, 8]):
            runtime = runtime_padding(job.tokenizer_vocab, argparse.Namespace(
                make_vocab_size_divisible_by=96, tensor_model_parallel_size=max(stages),
                stage_tensor_parallel_sizes=stages))
            assert job.vocabulary.padded(stages) == runtime
    assert VocabularyPadding(400, 96).padded([4, 8]) == 768 and VocabularyPadding(400, 96).padded([1]) == 480
    assert VocabularyPadding(400, 96).divisor_giving(768, [4]) == 96
    assert VocabularyPadding(400, 96).divisor_giving(600, [4]) is None  # no divisor pads 400 to 600 at TP 4
    assert VocabularyPadding(1100, 128).divisor_giving(1152, [2]) == 64


def test_the_flag_table_knows_the_runtimes_own_flags():
    """hetero-plan skips pretrain_gpt.py's Megatron-Hetero flags with their arity."""
    from megatron.hetero.arguments import build_parser
    from megatron.hetero.flags import HETERO_FLAGS as RUNTIME_FLAGS

    assert set(HETERO_FLAGS) == set(RUNTIME_FLAGS)
    actions = {s: a for a in build_parser()._actions for s in a.option_strings}
    assert {flag: 0 if actions[flag].nargs == 0 else 1 for flag in RUNTIME_FLAGS} == HETERO_FLAGS


def test_megatron_defaults_and_arity():
    flags = parse_megatron_flags([
        "--num-layers", "2", "--hidden-size=128", "--num-attention-heads", "4", "--seq-length", "64",
        "--rampup-batch-size", "16", "16", "1000", "--data-path", "0.3", "a", "0.7", "b", "--swiglu",
        "--hetero-plan", "plan.json", "--adam-eps", "-1e-8", "--recompute-activations"])
    assert flags["rampup_batch_size"] == [16, 16, 1000] and flags["data_path"] == ["0.3", "a", "0.7", "b"]
    assert flags["hidden_size"] == 128 and flags["adam_eps"] == -1e-8
    assert flags["tensor_model_parallel_size"] == 1 and "tensor_model_parallel_size" not in flags.given
    job = job_of_flags(["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
                        "--seq-length", "64", "--swiglu", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99",
                        "--recompute-activations", "--bf16"])
    assert job.model.ffn_hidden_size == 320  # 2/3 of 4h, down to a multiple of 64
    assert job.model.num_query_groups == 4  # no --group-query-attention: one group per head
    assert job.model.max_position_embeddings == 64
    assert (job.tokenizer_vocab, job.model_for((1,)).vocab_size) == (100, 128)
    assert (job.recompute, job.precision, job.distributed_optimizer, job.dropout) == ("selective", "bf16", False, True)
    assert job.micro_batch_size is None and job.global_batch_size is None  # left to the plan
    assert job.expert_parallel is None and job.expert_tensor_parallel is None
    moe = job_of_flags(["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
                        "--seq-length", "64", "--num-experts", "4", "--tokenizer-type", "NullTokenizer",
                        "--vocab-size", "99", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"])
    assert (moe.expert_parallel, moe.expert_tensor_parallel) == (4, 1)  # the plan must keep them


@pytest.mark.parametrize("argv,fragments", [
    (["--num-layers", "2", "--hiden-size", "64", "--bogus"], ["--hiden-size (did you mean --hidden-size?)", "--bogus"]),
    (["--num-layers", "2", "64"], ["values that follow no flag: 64"]),
    (["--num-layers"], ["--num-layers needs a value"]),
    (["--num-layers", "two"], ["--num-layers 'two': expected an integer"]),
    (["--rampup-batch-size", "1", "2"], ["--rampup-batch-size needs 3 values"]),
    (["--normalization", "BatchNorm"], ["takes one of LayerNorm, RMSNorm"]),
    (["--num-layers", "2", "--hidden-size", "64"], ["--num-attention-heads, --seq-length"]),
    (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "8",
      "--tokenizer-type", "TikTokenizer", "--tokenizer-model", "t.json"], ["--tokenizer-vocab-size N"]),
    (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "8"],
     ["GPT2BPETokenizer (Megatron-LM's default) needs --vocab-file"]),
    # Megatron's own uneven split would hold the run to a split the plan cannot choose.
    (["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "8",
      "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--decoder-first-pipeline-num-layers", "1"],
     ["--decoder-first-pipeline-num-layers 1: the plan decides how the layers split", "stages[s].num_layers"]),
])
def test_bad_flags_are_named(argv, fragments):
    with pytest.raises(HeteroError) as error:
        job_of_flags(argv)
    for fragment in fragments:
        assert fragment in str(error.value)


SCRIPT = r"""#!/bin/bash
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS=${GPUS_PER_NODE:-4}
CHECKPOINT=${1:-"runs/ckpt"}   # where to save
VOCAB=${2:-}
MICRO=2; LAYERS=$(( 2 * 2 ))
[[ -z "${FEW:-}" ]] || LAYERS=2
MODEL_ARGS=(
    --num-layers $LAYERS   # decoder layers
    --hidden-size 64 --num-attention-heads 4
    --seq-length 32 \
    --max-position-embeddings 32
)
if [[ "$VOCAB" == "null" ]] || [[ -z "$VOCAB" ]]; then
    TOKENIZER=("--tokenizer-type NullTokenizer" "--vocab-size 1000")
elif [ -f "$VOCAB" ]; then
    TOKENIZER=(--vocab-file "$VOCAB")
else
    echo "no vocabulary"; exit 1
fi
TRAINING_ARGS="--micro-batch-size $MICRO --global-batch-size $((MICRO * 8))"
TRAINING_ARGS+=" --train-iters 3"
EXTRA=()
EXTRA+=("--lr" "1e-3")
[ -n "${DEBUG:-}" ] && EXTRA+=(--log-interval 1) || EXTRA+=(--log-interval 10)
mkdir -p "$(dirname "$CHECKPOINT")"
echo "launching pretrain_gpt.py"
torchrun --nproc-per-node $GPUS ${MEGATRON:-.}/pretrain_gpt.py \
    "${MODEL_ARGS[@]}" ${TOKENIZER[@]} $TRAINING_ARGS "${EXTRA[@]}" \
    --save "$CHECKPOINT" --split '99,1,0' --mock-data 2>&1 | tee "$CHECKPOINT.log"
"""


def _bash_argv(script: Path, arguments: list[str], tmp_path: Path, environ: dict) -> list[str]:
    """What bash itself hands pretrain_gpt.py: torchrun replaced by a program printing its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "torchrun"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(script), *arguments], capture_output=True, text=True, env=env,
                         cwd=tmp_path, check=True).stdout
    argv = json.loads(out.strip().splitlines()[-1])
    return argv[argv.index(next(a for a in argv if a.endswith("pretrain_gpt.py"))) + 1:]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("arguments,environ", [
    ([], {}), (["ckpt/a", "null"], {"GPUS_PER_NODE": "2", "MEGATRON": "/opt/m", "DEBUG": "1"}),
    (["c", "vocab.json"], {"FEW": "yes"}),
])
def test_a_launch_script_reads_as_bash_runs_it(arguments, environ, tmp_path, monkeypatch):
    (tmp_path / "vocab.json").write_text("{}")
    script = tmp_path / "train.sh"
    script.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)  # [ -f "$VOCAB" ] is relative to where the script runs, as in bash
    base = {k: v for k, v in os.environ.items() if k not in ("GPUS_PER_NODE", "MEGATRON", "DEBUG", "FEW")}
    read = pretrain_flags_of_script(script, arguments, {**base, **environ})
    assert read == _bash_argv(script, arguments, tmp_path, {**base, **environ})
    assert read[read.index("--num-layers") + 1] == ("2" if "FEW" in environ else "4")


@pytest.mark.parametrize("text,arguments,fragment", [
    ("python train.py --num-layers 2\n", [], "no command runs pretrain_gpt.py"),
    ("python pretrain_gpt.py --save ${OUT_DIR_UNSET:?give OUT_DIR}\n", [],
     "train.sh:1: the pretrain_gpt.py line uses what hetero-plan cannot read: $OUT_DIR_UNSET (give OUT_DIR)"),
    ("A=$(date)\npython pretrain_gpt.py --save $A\n", [], "$A (set on line 1 from $(date) (command substitution"),
    ("for x in 1 2; do\n  L=$x\ndone\npython pretrain_gpt.py --num-layers $L\n", [], "$L (set on line 2 under a condition"),
    ("python pretrain_gpt.py --a\npython pretrain_gpt.py --b\n", [], "runs on several lines (1, 2)"),
])
def test_unreadable_scripts_are_named(text, arguments, fragment, tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(text)
    with pytest.raises(HeteroError) as error:
        pretrain_flags_of_script(script, arguments, {})
    assert fragment in str(error.value)


UNSET_SCRIPT = """\
MODEL_ARGS=(--num-layers 2 --hidden-size 64)
PREFIX=$UNSET_ROOT
torchrun pretrain_gpt.py "${MODEL_ARGS[@]}" "${PROFILE_ARGS[@]}" ${EXTRA_ARGS[@]} $UNSET_FLAG \\
    --save "$PREFIX/ckpt"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_what_a_script_never_sets_expands_to_nothing_as_in_bash_with_a_note(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(UNSET_SCRIPT)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("UNSET_")}
    notes: list[str] = []
    read = pretrain_flags_of_script(script, [], environ, notes=notes)
    assert read == _bash_argv(script, [], tmp_path, environ) == [
        "--num-layers", "2", "--hidden-size", "64", "--save", "/ckpt"]
    assert [note.split(" is set nowhere")[0] for note in notes] == [
        f"{script}:2: $UNSET_ROOT", f"{script}:3: ${{PROFILE_ARGS[@]}}", f"{script}:3: ${{EXTRA_ARGS[@]}}",
        f"{script}:3: $UNSET_FLAG"]
    assert all(note.endswith("it expands to nothing, as in bash") for note in notes)


LLAMA3_FLAGS = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                "--rotary-base", "500000", "--group-query-attention", "--num-query-groups", "8",
                "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--seq-length", "8192",
                "--max-position-embeddings", "8192", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128255"]


@pytest.mark.parametrize("preset,shape,billions", [
    ("llama3-8b", (32, 4096, 32, 14336), 8.03), ("llama3-70b", (80, 8192, 64, 28672), 70.55),
    ("llama3-405b", (126, 16384, 128, 53248), 405.85),
])
def test_llama3_presets_are_the_models_of_their_flags(preset, shape, billions):
    layers, hidden, heads, ffn = shape
    job = job_of_flags(["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
                        str(heads), "--ffn-hidden-size", str(ffn), *LLAMA3_FLAGS])
    # NullTokenizer adds its end-of-document id: 128,256 ids, a multiple of 128 x 2
    assert job.model_for((2,)) == PRESETS[preset]
    assert job.model_for((8,)).vocab_size == 129024
    assert round(PRESETS[preset].total_params() / 1e9, 2) == billions  # the published sizes
