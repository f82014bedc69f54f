"""The one scale-down rule every corpus recipe runs under: sizes, length, data and paths
change; the parallel layout, the kernels, the precision and every other flag stay as the
recipe gives them (GPU-only kernel choices are the runtime's to substitute on the CPU).

1. Layout (kept): TP, PP, CP, EP, virtual stages as the recipe sets them; the launch has
   TP x PP x CP x DP processes, DP = EP where the recipe spreads experts (megatron-core
   places expert groups inside data parallelism), else 1.
2. Sizes: heads 4 (2 x TP past TP 2), 16 channels a head (hidden = 16 x heads); query
   groups max(2, TP) where the recipe groups queries; FFN 2 x hidden; MoE FFN and shared
   expert = hidden; experts max(4, EP, top-k); layers PP x virtual stages (at least 2),
   one layer a virtual stage where the recipe counts layers per virtual stage; sequence 32;
   micro-batch at most 2, micro-batches max(2, PP) a replica; vocabulary 1000.
3. Length: 3 iterations (3 global batches of samples); decay over them, warm-up 1; log
   every iteration, evaluate at 2 on 1 batch (none where the recipe evaluates none).
4. Data and files: --data-path -> --mock-data; tokenizer files of the recipe's type built
   tiny (tests/tiny_tokenizers.py); every ${VARIABLE} path -> a folder of the test's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import tiny_tokenizers

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

    @property
    def dp(self) -> int:
        return max(1, self.ep)

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


def layout_of(pairs: list[list[str]]) -> Layout:
    flags = {p[0]: (p[1] if len(p) > 1 else None) for p in pairs}
    pp = _int(flags, "--pipeline-model-parallel-size", 1)
    virtual = _int(flags, "--num-virtual-stages-per-pipeline-rank", 1)
    per_stage = _int(flags, "--num-layers-per-virtual-pipeline-stage", 0)
    if per_stage:
        virtual = max(1, _int(flags, "--num-layers", pp) // (pp * per_stage))
    return Layout(tp=_int(flags, "--tensor-model-parallel-size", 1), pp=pp,
                  cp=_int(flags, "--context-parallel-size", 1),
                  ep=_int(flags, "--expert-model-parallel-size", 1), virtual=virtual)


def sizes(pairs: list[list[str]]) -> dict[str, str]:
    """Tiny values for the size and length flags, kept divisible by the recipe's layout."""
    flags = {p[0]: (p[1] if len(p) > 1 else None) for p in pairs}
    lay = layout_of(pairs)
    heads = 4 if lay.tp <= 2 else 2 * lay.tp
    hidden = 16 * heads
    topk = _int(flags, "--moe-router-topk", 2)
    micro = min(2, _int(flags, "--micro-batch-size", 1))
    global_batch = micro * lay.dp * max(2, lay.pp)
    layers = max(2, lay.pp * lay.virtual)
    warmup_samples = global_batch if _int(flags, "--lr-warmup-samples", 0) else 0
    return {
        "--num-layers": str(layers), "--hidden-size": str(hidden),
        "--num-attention-heads": str(heads), "--kv-channels": "16",
        "--num-query-groups": str(min(heads, max(2, lay.tp))),
        "--ffn-hidden-size": str(2 * hidden), "--moe-ffn-hidden-size": str(hidden),
        "--moe-shared-expert-intermediate-size": str(hidden),
        "--num-experts": str(max(4, lay.ep, topk)),
        "--num-layers-per-virtual-pipeline-stage": "1",
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
        "--save-interval": "1000", "--num-workers": "0", "--seed": "1234",
        "--inference-max-seq-length": str(SEQ),
    }


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
    assert heads % layout.tp == 0 and int(values["--num-layers"]) % (layout.pp * layout.virtual) == 0
    assert math.gcd(heads, layout.tp) == layout.tp
