"""Every change Megatron-Hetero makes to the installed megatron-core, in one place.

Run ``python -m megatron.hetero.patches`` to list them. Each patch is small, named, says
why it exists and which megatron-core releases it is written for (``versions``), and is
applied only by ``apply_patches`` after the version check (core_version.py).

This module holds the registry (``Patch``, ``PATCHES`` in the order they are applied,
``patches_for``, ``apply_patches``); the patches themselves are in its modules by concept:
``cpu`` (no GPU), ``fusions`` (megatron-core's import and its JIT-fused helpers),
``checkpoint`` (optimizer state dicts, checkpoint writers), ``parallel`` (groups, pipeline
p2p, gloo's collectives) and ``layers`` (MoE, norms, attention, MLA, MTP).

What needs no patch, and why:
- the plan's rank order: the process that the plan puts at logical rank i joins the
  default process group as rank i (``megatron.hetero.distributed``), so megatron-core's
  own group construction already follows the plan;
- uneven stages: megatron-core's ``pipeline_model_parallel_layout`` takes any split;
- replicas with unequal micro-batch counts: each replica calls the 1F1B schedule with its
  own count and ``calculate_per_token_loss`` weights gradients by tokens globally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hetero.errors import HeteroError
from megatron.hetero.core_version import TESTED_MEGATRON_CORE, check_megatron_core_version, patches_release

# The patches (names ``_apply_*`` and their ``needed`` predicates), and the names other modules
# import from here: import_megatron_core, compiles_fusions, disable_jit_fuser (and its
# _JIT_FUSER), snapshot_in_progress; _no_gpu is the one compiles_fusions asks.
from megatron.hetero.patches.checkpoint import (
    _SNAPSHOT,
    _apply_checkpoint_queue_dies_with_rank,
    _apply_checkpoint_writers_die_with_rank,
    _apply_distributed_optimizer_load,
    _apply_optimizer_state_for_snapshots,
    _apply_reshardable_offsets,
    _checkpoint_writers_are_processes,
    _torch_adam_fallback,
    snapshot_in_progress,
)
from megatron.hetero.patches.cpu import _apply_cpu_device, _apply_cpu_device_in_backward, _no_gpu
from megatron.hetero.patches.fusions import (
    _JIT_FUSER,
    _apply_jit_fusions_compiled_on_first_call,
    compiles_fusions,
    disable_jit_fuser,
    import_megatron_core,
)
from megatron.hetero.patches.layers import (
    _apply_host_split_sizes,
    _apply_local_attention_context_parallel,
    _apply_local_attention_separate_value_head,
    _apply_mla_knows_transformer_engine_missing,
    _apply_moe_router_without_te,
    _apply_mtp_stage_without_output_weight,
    _apply_sequence_parallel_torch_norm,
    _apply_yarn_rope_on_cpu,
    _apply_zero_centered_torch_norm,
    _moe_router_without_te,
    _torch_norm_in_use,
    _torch_norm_lacks_zero_centered_gamma,
    _transformer_engine_missing,
)
from megatron.hetero.patches.parallel import (
    _apply_grad_stats_agree_across_templates,
    _apply_overlapped_sends_kept,
    _apply_plan_rank_generator,
    _apply_resharding_p2p,
    _apply_schedule_trace,
    _apply_uneven_sequence_gather_on_gloo,
)

__all__ = ["PATCHES", "Patch", "apply_patches", "compiles_fusions", "describe", "disable_jit_fuser",
           "import_megatron_core", "patches_for", "snapshot_in_progress"]


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    needed: Callable[[], bool]
    apply: Callable[[], object]
    # The megatron-core releases (of TESTED_MEGATRON_CORE) it is written for and tested with;
    # under another tested release it is not applied.
    versions: tuple[str, ...]


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="cuda-as-cpu",
        why=(
            "megatron-core hard-codes the CUDA device (~130 sites in schedules, p2p, DDP, "
            "optimizer, RNG tracker); on a process without a GPU, 'cuda' is mapped to the CPU"
        ),
        needed=_no_gpu,
        apply=_apply_cpu_device,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="cuda-as-cpu-in-backward",
        why=(
            "the autograd engine runs custom backward functions without the caller's torch "
            "function modes, so megatron-core's backward passes that allocate on "
            "torch.cuda.current_device() (sequence parallelism's reduce-scatter, recomputation's "
            "re-run forward) escaped the cuda-as-cpu mapping; it is entered again around them"
        ),
        needed=_no_gpu,
        apply=_apply_cpu_device_in_backward,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="distributed-optimizer-load-without-apex",
        why=(
            "without apex/transformer-engine the distributed optimizer wraps torch's Adam, and "
            "loading a re-shardable checkpoint goes wrong three ways: Adam has no per-parameter "
            "state before its first step (filled first, as megatron-core does for FSDP); the "
            "per-parameter copy expects a 'step' the format keeps in the param groups; and the "
            "restored 'step' is one tensor shared by all parameters, which Adam increments once "
            "per parameter (each gets its own). Saving before Adam's first step (fp16 skips "
            "its first steps while the loss scale comes down) fails megatron-core's read of "
            "each state's 'step': the states Adam would create (zeros, step 0) are filled first"
        ),
        needed=_torch_adam_fallback,
        apply=_apply_distributed_optimizer_load,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="distributed-optimizer-reshardable-offsets",
        why=(
            "the distributed optimizer's re-shardable checkpoint gathers each buffer's state "
            "without the padding between buckets, then slices it with offsets that include "
            "it: every parameter past the first bucket (any model above the 40M-parameter "
            "bucket size, or a tied embedding split across stages) is saved and restored from "
            "the wrong place; the slicing is given the gathered layout's offsets"
        ),
        needed=lambda: True,
        apply=_apply_reshardable_offsets,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="checkpoint-results-queue-dies-with-rank",
        why=(
            "megatron-core's checkpoint writer collects its results through a multiprocessing "
            "Manager, whose server process outlives a killed rank (a lost node, a stopped "
            "attempt) and ignores SIGTERM: the job would leave processes behind. The server is "
            "started to die with its rank. Without a GPU it is also forked instead of spawned "
            "(a new interpreter importing torch: ~10 s of the first save on 2 cores)"
        ),
        needed=lambda: True,
        apply=_apply_checkpoint_queue_dies_with_rank,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="checkpoint-writers-die-with-rank",
        why=(
            "megatron-core forks one writer process per checkpoint write bucket; a rank stopped "
            "mid-save (a lost peer, SIGTERM) left its writers blocked forever on the results "
            "queue's lock, holding the rank's memory (seen after the fault tests). Each writer "
            "now gets SIGKILL when its rank ends (PR_SET_PDEATHSIG), or exits if it already has. "
            "Not needed from megatron-core 0.17 on, whose writers are threads"
        ),
        needed=_checkpoint_writers_are_processes,
        apply=_apply_checkpoint_writers_die_with_rank,
        versions=("0.16.1",),
    ),
    Patch(
        name="moe-router-without-te",
        why=(
            "the MoE router's gating GEMM tests `te_general_gemm is not None`, a name megatron-core "
            "only defines when transformer-engine imports; without it every MoE forward raises "
            "NameError. The name is defined as None, which selects megatron-core's own torch.mm path"
        ),
        needed=_moe_router_without_te,
        apply=_apply_moe_router_without_te,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="zero-centered-gamma-torch-norm",
        why=(
            "--apply-layernorm-1p (layernorm_zero_centered_gamma) exists in megatron-core only "
            "in transformer-engine's and apex's norms; its torch fallback (WrappedTorchNorm, used "
            "on the CPU and without apex) asserts. With it set, the fallback builds the same "
            "LayerNorm/RMSNorm with its scale stored as gamma - 1"
        ),
        needed=_torch_norm_lacks_zero_centered_gamma,
        apply=_apply_zero_centered_torch_norm,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="sequence-parallel-torch-norm",
        why=(
            "without apex/transformer-engine megatron-core's local layers use torch's norms, "
            "whose wrapper refuses --sequence-parallel only because it does not mark its "
            "weights for the tensor-parallel gradient sum; the norm is built as usual and its "
            "weights marked sequence_parallel, as apex's FusedLayerNorm and TE's norms do"
        ),
        needed=_torch_norm_in_use,
        apply=_apply_sequence_parallel_torch_norm,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="jit-fusions-compiled-on-first-call",
        why=(
            "megatron-core's fused helpers (bias-GeLU/SwiGLU, RMSNorm, cross-entropy, ...) are "
            "torch.compile'd by decorators run at import, which imports TorchDynamo and "
            "Inductor into every process (~2 s and ~60 MB on 2 cores) before any of them runs. "
            "Applied while megatron.hetero imports megatron-core: each is compiled at its first "
            "call instead; without a GPU it runs eagerly (the same arithmetic: compiling it to "
            "C++ took ~2 minutes of the first iteration on 2 cores for no kernel a CPU lacks)"
        ),
        needed=lambda: True,
        apply=_apply_jit_fusions_compiled_on_first_call,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="schedule-step-timing",
        why=(
            "times each forward and backward micro-batch step of the pipeline schedule (two "
            "clock reads a step): the measured iteration timeline (tracing.py) and the stage "
            "times --hetero-adapt balances"
        ),
        needed=lambda: True,
        apply=_apply_schedule_trace,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="parallel-state-groups-from-per-stage-grid",
        why=(
            "megatron-core builds every process group from one TP x DP x PP grid; a plan whose "
            "stages differ in tensor-parallel degree has none. RankGenerator.get_ranks answers "
            "from the plan's grid instead (stage_tensor_parallel.rank_groups), so "
            "initialize_model_parallel builds the TP, DP, pipeline, model-parallel and embedding "
            "groups of each stage itself; under several replica templates, each template's groups "
            "side by side. Inert unless such a plan is installed"
        ),
        needed=lambda: True,
        apply=_apply_plan_rank_generator,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="p2p-reshards-between-stage-degrees",
        why=(
            "megatron-core's P2PCommunicator sends a stage's whole activation to one rank of the "
            "next stage; between stages of different tensor-parallel degree each receiving rank "
            "needs its own slice (sequence parallel) or a copy from one sending rank. Its "
            "_communicate moves those pieces under a per-stage plan (stage_tensor_parallel.py), "
            "and is megatron-core's own otherwise"
        ),
        needed=lambda: True,
        apply=_apply_resharding_p2p,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="grad-stats-agree-across-templates",
        why=(
            "under a plan of several replica templates each template's optimizer computes the "
            "gradient norm (and zero count) over its own ranks: the same sum in another order, "
            "which may round differently, so the templates would clip by different factors and "
            "their copies of the weights drift apart. The value template 0 computes is given to "
            "every rank (template_reduction.agreed_across_templates). Inert under one template"
        ),
        needed=lambda: True,
        apply=_apply_grad_stats_agree_across_templates,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="alltoall-split-sizes-on-cpu",
        why=(
            "the alltoall token dispatcher of expert parallelism turns its per-rank split sizes "
            "into host numbers only when they live on a GPU; on the CPU they stayed tensors, "
            "which torch's all_to_all_single refuses. They are converted on the CPU as well"
        ),
        needed=_no_gpu,
        apply=_apply_host_split_sizes,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="overlapped-pipeline-sends-finished",
        why=(
            "the interleaved schedule with --overlap-p2p-communication-warmup-flush leaves the "
            "last forward send of a forward-only pass (evaluation) unwaited and drops its "
            "handle; NCCL still delivers it, but gloo (CPU processes) cancels a send whose "
            "handle is freed before the receiver posts its receive, and the next stage waited "
            "forever. Overlapped pipeline sends are held until done and finished before the "
            "schedule returns"
        ),
        needed=_no_gpu,
        apply=_apply_overlapped_sends_kept,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="local-attention-separate-value-head",
        why=(
            "multi-latent attention (--multi-latent-attention) builds its core attention with a "
            "key head size (qk_head_dim + qk_pos_emb_head_dim) different from its value head size "
            "(v_head_dim), which transformer-engine's attention takes and megatron-core's local "
            "DotProductAttention refused (no k_channels/v_channels arguments; its output width "
            "is kv_channels x heads). The local class takes both: scores Q K^T use the key size "
            "under MLA's own softmax scale, and the output is heads x v_head_dim wide. Inert "
            "when neither is given"
        ),
        needed=lambda: True,
        apply=_apply_local_attention_separate_value_head,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="yarn-rope-tables-on-cpu",
        why=(
            "multi-latent attention builds its YarnRotaryEmbedding (--rope-type yarn, MLA's "
            "default) without the config's use_cpu_initialization, so it opens "
            "torch.device(torch.cuda.current_device()), which fails without a GPU. Without one "
            "the tables are built on the CPU, where every tensor lives anyway"
        ),
        needed=_no_gpu,
        apply=_apply_yarn_rope_on_cpu,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="mla-knows-transformer-engine-missing",
        why=(
            "megatron-core's multi_latent_attention imports its transformer-engine classes "
            "through megatron-core's extensions module, which without transformer-engine "
            "hands back placeholder objects instead of failing; MLA then believes "
            "transformer-engine present (HAVE_TE) and isinstance() against the placeholder "
            "TELinear raises while building every MLA layer. Without transformer-engine its "
            "HAVE_TE says so"
        ),
        needed=_transformer_engine_missing,
        apply=_apply_mla_knows_transformer_engine_missing,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="uneven-sequence-gather-on-gloo",
        why=(
            "with expert tensor parallelism (--expert-tensor-parallel-size > 1) the all-to-all "
            "dispatcher gathers each expert tensor rank's routed tokens, a different count on "
            "each, with torch.distributed.all_gather of unequal tensors (and reduce-scatters them "
            "back unequally); NCCL takes that, gloo (CPU processes) refuses unequal sizes, and the "
            "run crashed. Without a GPU the rows are padded to the longest, gathered, and the "
            "padding dropped; the way back all-reduces the whole tensor and keeps this rank's rows "
            "(the same sums)"
        ),
        needed=_no_gpu,
        apply=_apply_uneven_sequence_gather_on_gloo,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="mtp-stage-without-output-weight",
        why=(
            "with tied embeddings, a pipeline stage that runs multi-token-prediction layers but "
            "not the embedding (the last one) computes its logits, the main loss's and the MTP "
            "layers', with its copy of the word embeddings, kept in step with the first stage's; "
            "megatron-core still allocates an output-layer weight there, which nothing reads. "
            "It is counted in the params norm (one process has no such weight) and breaks the "
            "checkpoint (megatron-core's sharded_state_dict asserts the stage has no output "
            "weight). The stage's output layer gets no weight of its own, as megatron-core's "
            "comments describe"
        ),
        needed=lambda: True,
        apply=_apply_mtp_stage_without_output_weight,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="local-attention-context-parallel",
        why=(
            "megatron-core's local DotProductAttention asserts --context-parallel-size 1 (its "
            "context parallelism lives in transformer-engine's attention only). Each layer of a "
            "CP > 1 run all-gathers the keys and values over the context-parallel group (gradients "
            "reduce-scattered back), puts them in sequence order and masks them causally by the "
            "true positions of this rank's load-balanced chunks (context_parallel.py): exactly "
            "full attention. Inert at CP 1"
        ),
        needed=lambda: True,
        apply=_apply_local_attention_context_parallel,
        versions=("0.16.1", "0.19.2"),
    ),
    Patch(
        name="optimizer-state-for-snapshots",
        why=(
            "the distributed optimizer's fully reshardable state dict gathers every data-parallel "
            "rank's optimizer shard onto each of them, then runs a full garbage collection (for runs "
            "with the collector disabled), ~0.2 s with megatron-core loaded: most of an in-memory "
            "snapshot's cost (--inprocess-restart), where each rank keeps only its own shard. While a "
            "snapshot is taken, each rank's state holds its own shard only (no gather; where it lies "
            "is recorded for the snapshot) and only the youngest generation is collected; "
            "checkpoints keep the gather and the full collection"
        ),
        needed=lambda: True,
        apply=_apply_optimizer_state_for_snapshots,
        versions=("0.16.1", "0.19.2"),
    ),
)

_applied: list[str] = []


def patches_for(version: str) -> tuple[Patch, ...]:
    """The patches written for ``version``'s tested release (core_version.patches_release)."""
    release = patches_release(version)
    return tuple(patch for patch in PATCHES if release in patch.versions)


def apply_patches(allow_untested: bool = False) -> list[str]:
    """Checks the installed megatron-core's release (core_version), then applies the patches
    written for it that this process needs, once; returns their names. ``allow_untested``:
    the user's --hetero-allow-untested-megatron-core."""
    if not _applied:
        import_megatron_core()  # the version check imports it: its compiles deferred first
        version = check_megatron_core_version(allow_untested)
        for patch in patches_for(version):
            if not patch.needed():
                continue
            try:
                patch.apply()
            except (AttributeError, ImportError) as err:  # what it replaces moved or is gone
                raise HeteroError(
                    f"the patch {patch.name} does not apply to megatron-core {version} ({err}); it is "
                    f"written for megatron-core {', '.join(patch.versions)}: install one of those"
                ) from err
            _applied.append(patch.name)
    return list(_applied)


def describe(allow_untested: bool = False) -> str:
    import_megatron_core()
    version = check_megatron_core_version(allow_untested)
    mine = patches_for(version)
    lines = [f"megatron-core {version} (tested: {', '.join(TESTED_MEGATRON_CORE)}): patches applied by "
             "megatron.hetero.patches.apply_patches()"]
    for patch in PATCHES:
        if patch not in mine:
            state = f"for megatron-core {', '.join(patch.versions)} only"
        else:
            state = "applies here" if patch.needed() else "not needed here"
        lines.append(f"- {patch.name} ({state}): {patch.why}")
    return "\n".join(lines)
