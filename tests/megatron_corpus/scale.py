"""The one scale-down rule every corpus recipe runs under: sizes, length, data and paths
change; the parallel layout, the kernels, the precision and every other flag stay as the
recipe gives them (GPU-only kernel choices are the runtime's to substitute on the CPU).

1. Layout (kept): TP, PP, CP, EP, virtual stages as the recipe sets them; the launch has
   TP x PP x CP x DP processes, DP = EP where the recipe spreads experts (megatron-core
   places expert groups inside data parallelism), else 1; twice that where TP x PP x CP x
   EP is at most 2 (Megatron-LM's CI runs the recipes on 8 GPUs, so they train data-parallel
   there too; the launch stays at 4 processes at most).
2. Sizes: heads 4 (2 x TP past TP 2), 16 channels a head (hidden = 16 x heads); query
   groups max(2, TP) where the recipe groups queries; FFN 2 x hidden; MoE FFN and shared
   expert = hidden; experts max(4, EP, top-k); layers 2 a (virtual) stage, so that a plan
   can move one between stages (plans.py), at least 2 - one a virtual stage where the recipe
   counts layers per virtual stage, 1 on a stage --decoder-first/last-pipeline-num-layers
   names, one fewer on the stage where --account-for-embedding/loss-in-pipeline-split counts
   the embedding or the loss as a layer (the recipe's uneven split stays uneven); the
   recipe's own count where its --pipeline-model-parallel-layout places every layer;
   sequence 32; micro-batch at most 2, micro-batches max(2, PP) a replica, rounded up to a
   whole number of the interleaved schedule's unit where the recipe interleaves (Layout.
   replica_unit: PP, or lcm(PP, N) where it sets --microbatch-group-size-per-virtual-pipeline-
   stage N; megatron-core runs such counts in training and in evaluation, which runs the whole
   global batch too); vocabulary 1000.
3. Length: 3 iterations (3 global batches of samples); decay over them, warm-up 1; log
   every iteration, evaluate at 2 on 1 batch (none where the recipe evaluates none).
4. Data and files: --data-path -> --mock-data; tokenizer files of the recipe's type built
   tiny (tests/tiny_tokenizers.py); every ${VARIABLE} path -> a folder of the test's;
   Weights & Biases offline (WANDB_MODE=offline, set by report.py).

Each recipe also runs under a heterogeneous plan of the same layout, made from these flags
by the one rule in plans.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import tiny_tokenizers
from hetero.pipeline_layout import parse_layout

SEQ = 32
VOCAB = 1000
ITERS = 3


@dataclass(frozen=True)
class Layout:
    """A recipe's own parallel layout, and the launch it needs."""

    tp: int
    pp: int
    cp: int
    ep: int
    virtual: int  # model chunks a pipeline rank holds
    group: int | None = None  # --microbatch-group-size-per-virtual-pipeline-stage
    etp: int | None = None  # --expert-tensor-parallel-size (None: TP)

    @property
    def replica_unit(self) -> int:
        """A replica's micro-batches are a whole number of these. The interleaved schedule
        runs them in groups of N (the recipe's group size, else PP) and megatron-core refuses
        fewer than N or a last group shorter than PP; a plan's counts are multiples of PP.
        Every multiple of lcm(PP, N) is all of these (N < PP: refused whatever the count)."""
        if self.virtual == 1:
            return 1
        return math.lcm(self.pp, self.group) if self.group and self.group >= self.pp else self.pp

    @property
    def dp(self) -> int:
        # Megatron-LM's CI runs these recipes on 8 GPUs, so data parallelism is part of their
        # layout; kept (at 2) where the launch stays at 4 processes or fewer. Experts spread
        # over EP x ETP ranks: over data-parallel ranks, unless a replica's TP x CP ranks hold
        # the whole expert grid (TP 4 with EP 2 x ETP 2 runs on 8 GPUs at PP 2).
        if self.ep > 1 and (self.tp * self.cp) % (self.ep * (self.etp or self.tp)) == 0:
            return 2 if self.tp * self.pp * self.cp <= 2 else 1
        model_parallel = self.tp * self.pp * self.cp * max(1, self.ep)
        return max(1, self.ep) * (2 if model_parallel <= 2 else 1)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        parts += [f"VP{self.virtual}"] if self.virtual > 1 else []
        parts += [f"CP{self.cp}"] if self.cp > 1 else []
        parts += [f"EP{self.ep}"] if self.ep > 1 else []
        return " ".join(parts)


def _int(flags: dict[str, str | None], flag: str, default: int) -> int:
    value = flags.get(flag)
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def layout_stages(text: str) -> list[str]:
    """The (virtual) stages of a --pipeline-model-parallel-layout, in model order, as
    megatron-core reads it (hetero.pipeline_layout.parse_layout); the recipe's shell escapes
    (backslashes) dropped."""
    return parse_layout(text.replace("\\", ""))


def layout_of(pairs: list[list[str]]) -> Layout:
    flags = {p[0]: (p[1] if len(p) > 1 else None) for p in pairs}
    pp = _int(flags, "--pipeline-model-parallel-size", 1)
    virtual = _int(flags, "--num-virtual-stages-per-pipeline-rank", 1)
    if flags.get("--pipeline-model-parallel-layout"):
        virtual = max(1, len(layout_stages(flags["--pipeline-model-parallel-layout"])) // pp)
    per_stage = _int(flags, "--num-layers-per-virtual-pipeline-stage", 0)
    if per_stage:
        virtual = max(1, _int(flags, "--num-layers", pp) // (pp * per_stage))
    group = _int(flags, "--microbatch-group-size-per-virtual-pipeline-stage", 0) or None
    return Layout(tp=_int(flags, "--tensor-model-parallel-size", 1), pp=pp,
                  cp=_int(flags, "--context-parallel-size", 1),
                  ep=_int(flags, "--expert-model-parallel-size", 1), virtual=virtual, group=group,
                  etp=_int(flags, "--expert-tensor-parallel-size", 0) or None)


def _num_layers(flags: dict[str, str | None], lay: Layout) -> int:
    """Rule 2's layers: 2 a (virtual) stage but where the recipe fixes a stage's count."""
    chunks = lay.pp * lay.virtual
    if flags.get("--pipeline-model-parallel-layout"):  # the layout places every layer itself
        return sum(stage.count("t") for stage in layout_stages(flags["--pipeline-model-parallel-layout"]))
    if "--num-layers-per-virtual-pipeline-stage" in flags:
        return max(2, chunks)
    if chunks == 1:
        return 2
    pinned_to_one = [f for f in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                                 "--account-for-embedding-in-pipeline-split",
                                 "--account-for-loss-in-pipeline-split") if f in flags]
    return 2 * chunks - len(pinned_to_one)


def sizes(pairs: list[list[str]]) -> dict[str, str]:
    """Tiny values for the size and length flags, kept divisible by the recipe's layout."""
    flags = {p[0]: (p[1] if len(p) > 1 else None) for p in pairs}
    lay = layout_of(pairs)
    heads = 4 if lay.tp <= 2 else 2 * lay.tp
    hidden = 16 * heads
    topk = _int(flags, "--moe-router-topk", 2)
    micro = min(2, _int(flags, "--micro-batch-size", 1))
    per_replica = -(-max(2, lay.pp) // lay.replica_unit) * lay.replica_unit
    global_batch = micro * lay.dp * per_replica
    layers = _num_layers(flags, lay)
    warmup_samples = global_batch if _int(flags, "--lr-warmup-samples", 0) else 0
    return {
        "--num-layers": str(layers), "--hidden-size": str(hidden),
        "--num-attention-heads": str(heads), "--kv-channels": "16",
        "--num-query-groups": str(min(heads, max(2, lay.tp))),
        "--ffn-hidden-size": str(2 * hidden), "--moe-ffn-hidden-size": str(hidden),
        "--moe-shared-expert-intermediate-size": str(hidden),
        "--num-experts": str(max(4, lay.ep, topk)),
        "--num-layers-per-virtual-pipeline-stage": "1",
        "--decoder-first-pipeline-num-layers": "1", "--decoder-last-pipeline-num-layers": "1",
        "--seq-length": str(SEQ), "--max-position-embeddings": str(SEQ),
        "--vocab-size": str(VOCAB), "--micro-batch-size": str(micro),
        "--global-batch-size": str(global_batch),
        "--rampup-batch-size": f"{micro * lay.dp} {micro * lay.dp} {global_batch}",
        "--train-iters": str(ITERS), "--train-samples": str(ITERS * global_batch),
        "--lr-decay-iters": str(ITERS), "--lr-decay-samples": str(ITERS * global_batch),
        "--lr-warmup-iters": "1", "--lr-warmup-samples": str(warmup_samples),
        "--lr-wsd-decay-iters": "1", "--exit-interval": str(ITERS),
        "--log-interval": "1", "--eval-interval": "2",
        "--eval-iters": "0" if flags.get("--eval-iters") == "0" else "1",
        "--save-interval": "1000", "--save-retain-interval": "1000", "--num-workers": "0", "--seed": "1234",
        "--inference-max-seq-length": str(SEQ),
    }


# Flags whose value has spaces yet is one argument (the recipe quotes it): kept whole, not
# split into words as a list value is (core_v0.19's "0:384 200B:768 400B:1152").
ONE_ARGUMENT = frozenset({"--step-batch-size-schedule"})


def scale_down(pairs: list[list[str]], workdir: Path) -> list[str]:
    """The recipe's command line under the rule above (the layout flags untouched)."""
    flags = {p[0]: (p[1] if len(p) > 1 else None) for p in pairs}
    table = sizes(pairs)
    files = tiny_tokenizers.files_for(flags.get("--tokenizer-type") or "GPT2BPETokenizer", workdir)
    out: list[str] = []
    for pair in pairs:
        flag, value = pair[0], (pair[1] if len(pair) > 1 else None)
        if flag == "--data-path":
            out.append("--mock-data")
        elif flag == "--pipeline-model-parallel-layout" and value is not None:
            out += [flag, value.replace("\\", "")]  # the shell escapes of the CI's YAML
        elif flag in ONE_ARGUMENT and value is not None:
            out += [flag, value]  # a quoted value with spaces: one argument, kept whole
        elif flag in files:
            out += [flag, files[flag]]
        elif flag in table and value is not None:
            out += [flag, *table[flag].split()]
        elif value is not None and "$" in value:  # a path of Megatron's CI harness
            name = flag.strip("-").replace("-", "_")
            out += [flag, str(workdir / name)]
        else:
            out += [flag] if value is None else [flag, *value.strip("[]").split()]
    for flag, value in files.items():  # a recipe naming no tokenizer file still needs one
        if flag not in flags:
            out += [flag, value]
    return out


def check_divisible(layout: Layout, argv: list[str]) -> None:
    """The scaled sizes divide as the recipe's layout needs (a bug in this rule otherwise)."""
    values = dict(zip(argv, argv[1:]))
    if "--num-attention-heads" not in values:  # a recipe without MODEL_ARGS: nothing scaled
        return
    heads = int(values["--num-attention-heads"])
    assert heads % layout.tp == 0
    assert math.gcd(heads, layout.tp) == layout.tp
