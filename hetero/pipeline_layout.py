"""Megatron-LM's split of the decoder layers over pipeline stages, from its own flags.

Megatron-LM (validate_args) and megatron-core 0.16.1 (TransformerConfig's checks,
``get_num_layers_to_build``, ``get_transformer_layer_offset``, ``PipelineParallelLayerLayout``)
decide how many decoder layers each pipeline rank and each of its virtual stages builds from:

- ``--pipeline-model-parallel-layout``: every (virtual) stage spelled out, e.g.
  "Et*3|(tt|)*29,m|L" (E embedding, t decoder layer, m multi-token-prediction layer, L loss,
  ``|`` between stages, ``(..)*n`` and ``x*n`` repeat, commas cosmetic); entry ``v*pp + s`` is
  virtual stage v of pipeline rank s;
- ``--decoder-first/last-pipeline-num-layers``: the first (last) rank's layers, the rest even;
- ``--account-for-embedding/loss-in-pipeline-split``: the embedding (loss) counts as a layer
  of the first (last) virtual stage in an otherwise even split;
- ``--num-layers-per-virtual-pipeline-stage`` / ``--num-virtual-stages-per-pipeline-rank``:
  each rank's layers cut into equal virtual stages.

``megatron_split`` is that arithmetic, once, with Megatron's checks (each error names the
flag and the fix). The uniform plan (``Plan.uniform``) and the runtime's check of a plan
against these flags both use it. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hetero.errors import PlanError

LAYER_CHARACTERS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
_REPEATS = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))  # (..)*n first, then x*n


@dataclass(frozen=True)
class SplitFlags:
    """Megatron-LM's flags that decide the split (None / False: not given)."""

    first_stage_layers: int | None = None        # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None         # --decoder-last-pipeline-num-layers
    layout: str | None = None                    # --pipeline-model-parallel-layout
    account_for_embedding: bool = False          # --account-for-embedding-in-pipeline-split
    account_for_loss: bool = False               # --account-for-loss-in-pipeline-split
    layers_per_virtual_stage: int | None = None  # --num-layers-per-virtual-pipeline-stage
    virtual_stages_per_rank: int | None = None   # --num-virtual-stages-per-pipeline-rank

    @classmethod
    def of_args(cls, args: object) -> "SplitFlags":
        """The flags of a parsed pretrain_gpt.py command line (Megatron-LM's dests)."""
        return cls(getattr(args, "decoder_first_pipeline_num_layers", None),
                   getattr(args, "decoder_last_pipeline_num_layers", None),
                   getattr(args, "pipeline_model_parallel_layout", None),
                   bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
                   bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
                   getattr(args, "num_layers_per_virtual_pipeline_stage", None),
                   getattr(args, "num_virtual_stages_per_pipeline_rank", None))

    @property
    def shapes_stages(self) -> bool:
        """Whether a flag other than the virtual-stage ones moves layers between stages."""
        return (self.first_stage_layers is not None or self.last_stage_layers is not None
                or self.layout is not None or self.account_for_embedding or self.account_for_loss)

    def given(self) -> list[str]:
        """The stage-shaping flags given, as typed on the command line."""
        named = [("--decoder-first-pipeline-num-layers", self.first_stage_layers),
                 ("--decoder-last-pipeline-num-layers", self.last_stage_layers),
                 ("--pipeline-model-parallel-layout", self.layout and repr(self.layout)),
                 ("--account-for-embedding-in-pipeline-split", self.account_for_embedding or None),
                 ("--account-for-loss-in-pipeline-split", self.account_for_loss or None)]
        return [flag if value is True else f"{flag} {value}" for flag, value in named if value is not None]


def parse_layout(text: str) -> list[str]:
    """The stages of a layout string in model order, each a string of layer characters:
    "E|(tt|)*2,L" -> ["E", "tt", "tt", "L"]. Repeats unroll as megatron-core unrolls them."""
    unrolled = text.replace(",", "")
    for pattern in _REPEATS:
        unrolled = pattern.sub(lambda m: m.group(1) * int(m.group(2)), unrolled)
    stages = unrolled.split("|")
    for stage in stages:
        unknown = sorted(set(stage) - set(LAYER_CHARACTERS))
        if unknown:
            raise PlanError(
                f"--pipeline-model-parallel-layout {text!r}: {', '.join(map(repr, unknown))} is not a layer "
                f"(known: {', '.join(f'{c} {n}' for c, n in LAYER_CHARACTERS.items())}; '|' between "
                "stages, (..)*n and x*n repeat); fix the layout string")
    return stages


def megatron_split(num_layers: int, pipeline_parallel: int, flags: SplitFlags) -> list[list[int]]:
    """Decoder layers of every virtual stage of every pipeline rank as Megatron-LM builds
    them: ``split[s][v]`` is virtual stage v of rank s (one entry per rank without
    interleaving). Megatron-LM's checks of these flags raise a PlanError naming the flag."""
    pp = pipeline_parallel
    interleaving = [f for f, v in (("--num-layers-per-virtual-pipeline-stage", flags.layers_per_virtual_stage),
                                   ("--num-virtual-stages-per-pipeline-rank", flags.virtual_stages_per_rank),
                                   ("--pipeline-model-parallel-layout", flags.layout)) if v is not None]
    if len(interleaving) > 1:
        raise PlanError(f"give at most one of {', '.join(interleaving)} (Megatron-LM: each sets the "
                        "virtual stages)")
    if flags.layout is not None:
        others = [f for f in flags.given() if not f.startswith("--pipeline-model-parallel-layout")]
        if others:
            raise PlanError(f"--pipeline-model-parallel-layout gives every stage's layers; drop "
                            f"{', '.join(others)} (megatron-core refuses them together)")
        return _layout_split(flags.layout, num_layers, pp)
    if (flags.first_stage_layers is not None or flags.last_stage_layers is not None) and (
            flags.account_for_embedding or flags.account_for_loss):
        raise PlanError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                        "--account-for-embedding/loss-in-pipeline-split (megatron-core refuses them "
                        "together); keep one way of moving layers")
    if flags.layers_per_virtual_stage is not None and (
            flags.first_stage_layers is not None or flags.last_stage_layers is not None):
        raise PlanError("--decoder-first/last-pipeline-num-layers with --num-layers-per-virtual-pipeline-"
                        "stage: give the interleaving as --num-virtual-stages-per-pipeline-rank "
                        "(as Megatron-LM asks)")
    counted = num_layers + flags.account_for_embedding + flags.account_for_loss
    virtual = _virtual_stages_per_rank(flags, counted, pp)
    if flags.first_stage_layers is not None or flags.last_stage_layers is not None:
        per_rank = _uneven_ends(flags, num_layers, pp, virtual)
    else:
        if counted % pp:
            accounted = " (the embedding and/or loss counted as layers)" if counted != num_layers else ""
            raise PlanError(f"num_layers ({num_layers}){accounted}: {counted} is not divisible by pipeline_parallel "
                            f"(--pipeline-model-parallel-size {pp}); change the layers, or give an uneven split "
                            "(--decoder-first/last-pipeline-num-layers, --pipeline-model-parallel-layout "
                            "or a --hetero-plan)")
        per_rank = [counted // pp] * pp
    split = []
    for rank, layers in enumerate(per_rank):
        if layers % virtual:
            raise PlanError(f"pipeline rank {rank} holds {layers} layers, which do not split into "
                            f"{virtual} equal virtual stages; change --num-virtual-stages-per-pipeline-rank "
                            "or the layers")
        split.append([layers // virtual] * virtual)
    if flags.account_for_embedding:
        split[0][0] -= 1    # the embedding takes a layer's place in the first virtual stage
    if flags.account_for_loss:
        split[-1][-1] -= 1  # and the loss in the last
    if min(map(min, split)) < 0:
        raise PlanError("--account-for-embedding/loss-in-pipeline-split leaves a virtual stage with "
                        "fewer than no decoder layers; use fewer virtual stages")
    return split


def _virtual_stages_per_rank(flags: SplitFlags, counted: int, pp: int) -> int:
    """Megatron-LM's virtual pipeline size (1 without interleaving)."""
    if flags.virtual_stages_per_rank is not None:
        if flags.virtual_stages_per_rank < 1:
            raise PlanError("--num-virtual-stages-per-pipeline-rank must be at least 1")
        return flags.virtual_stages_per_rank
    if flags.layers_per_virtual_stage is None:
        return 1
    if flags.layers_per_virtual_stage < 1:
        raise PlanError("--num-layers-per-virtual-pipeline-stage must be at least 1")
    if counted % pp or (counted // pp) % flags.layers_per_virtual_stage:
        raise PlanError(f"--num-layers-per-virtual-pipeline-stage {flags.layers_per_virtual_stage}: "
                        f"{counted} layers over {pp} pipeline ranks do not give each rank a whole number "
                        "of such virtual stages (Megatron-LM's rule); change the flag or the layers")
    return counted // pp // flags.layers_per_virtual_stage


def _uneven_ends(flags: SplitFlags, num_layers: int, pp: int, virtual: int) -> list[int]:
    """Layers per rank with --decoder-first/last-pipeline-num-layers (megatron-core's checks)."""
    if pp == 1 and flags.first_stage_layers is not None and flags.last_stage_layers is not None:
        raise PlanError("--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers both "
                        "name the only pipeline stage; drop one")
    fixed: dict[int, int] = {}
    names: dict[int, str] = {}
    for rank, flag, layers in ((0, "--decoder-first-pipeline-num-layers", flags.first_stage_layers),
                               (pp - 1, "--decoder-last-pipeline-num-layers", flags.last_stage_layers)):
        if layers is None:
            continue
        if layers <= 0:
            raise PlanError(f"{flag} {layers}: a stage needs at least one layer")
        if layers % virtual:
            raise PlanError(f"{flag} {layers} is not divisible by the {virtual} virtual stages per "
                            "pipeline rank; change one of the two")
        fixed[rank], names[rank] = layers, flag
    middle_ranks = pp - len(fixed)
    middle_layers = num_layers - sum(fixed.values())
    given = ", ".join(f"{names[r]} {n}" for r, n in fixed.items())
    if bool(middle_layers) != bool(middle_ranks) or middle_layers < 0:
        raise PlanError(f"--num-layers {num_layers} with {given}: {middle_layers} layers are left for "
                        f"{middle_ranks} other pipeline stage(s); make the layers add up")
    if middle_ranks and middle_layers % middle_ranks:
        raise PlanError(f"--num-layers {num_layers} with {given}: the {middle_layers} layers left do not "
                        f"split evenly over the other {middle_ranks} pipeline stages; change the flags")
    share = middle_layers // middle_ranks if middle_ranks else 0
    return [fixed.get(rank, share) for rank in range(pp)]


def _layout_split(text: str, num_layers: int, pp: int) -> list[list[int]]:
    """megatron-core's checks of a layout string, and its decoder layers per (rank, virtual stage)."""
    stages = parse_layout(text)
    if len(stages) % pp:
        raise PlanError(f"--pipeline-model-parallel-layout {text!r} has {len(stages)} stages, not a multiple "
                        f"of the pipeline-model-parallel size {pp}; give pp x virtual stages")
    flat = "".join(stages)
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        raise PlanError(f"--pipeline-model-parallel-layout {text!r}: the embedding (E) must come first and the "
                        "loss (L) last, once each (megatron-core's rule); fix the layout string")
    if flat.count("t") != num_layers:
        raise PlanError(f"--pipeline-model-parallel-layout {text!r} places {flat.count('t')} decoder layers (t), "
                        f"--num-layers is {num_layers}; make them agree")
    if "m" in flat and ("m" in "".join(stages[:-1]) or not stages[-1].rstrip("L").endswith("m")):
        raise PlanError(f"--pipeline-model-parallel-layout {text!r} places multi-token-prediction layers (m) "
                        "elsewhere than after the decoder layers of the last stage, beside the loss, where "
                        "heterogeneous plans keep them (megatron-core's default); end the layout with ...mL")
    virtual = len(stages) // pp
    return [[stages[v * pp + s].count("t") for v in range(virtual)] for s in range(pp)]


def split_disagreement(planned: list[list[int]], num_layers: int, flags: SplitFlags) -> str | None:
    """Where a plan's stages (``planned[s]``: stage s's virtual stages, or its one count)
    differ from the split Megatron-LM's flags ask for, as a sentence with the fix; None when
    they agree or no flag shapes the stages."""
    if not flags.shapes_stages:
        return None
    wanted = megatron_split(num_layers, len(planned), flags)
    for stage, (theirs, ours) in enumerate(zip(wanted, planned)):
        if sum(theirs) != sum(ours):
            return (f"{_asking_flags(flags, stage, len(planned))} asks for {sum(theirs)} layers on stage "
                    f"{stage}; the plan puts {sum(ours)} there (stages[{stage}].num_layers); drop the flag "
                    "or regenerate the plan")
    for stage, (theirs, ours) in enumerate(zip(wanted, planned)):
        if len(ours) > 1 and theirs != ours:
            return (f"{_asking_flags(flags, stage, len(planned))} asks for virtual stages of {theirs} layers "
                    f"on stage {stage}; the plan gives {ours} (stages[{stage}].virtual_stages); drop the flag "
                    "or regenerate the plan")
    return None


def _asking_flags(flags: SplitFlags, stage: int, pp: int) -> str:
    """The flag that decides stage ``stage``'s layers (all the shaping flags where several do)."""
    if stage == 0 and flags.first_stage_layers is not None:
        return f"--decoder-first-pipeline-num-layers {flags.first_stage_layers}"
    if stage == pp - 1 and flags.last_stage_layers is not None:
        return f"--decoder-last-pipeline-num-layers {flags.last_stage_layers}"
    return ", ".join(flags.given())
