"""How a Megatron-Hetero process starts, written once: from Megatron-LM's flags to the model.

Every process that starts from pretrain_gpt.py's flags takes these steps, in this order, and
each step is one function below:

1. ``prepare_process``: what must precede everything else (environment, fault handler,
   warnings, the CPU allocator);
2. ``configure``: Megatron-LM's flags parsed (refused flags named), the plan (or Megatron's
   uniform one) applied to them, then validated: Megatron-LM's derived defaults, the model
   against the plan, the performance features, the batch schedule; for a process of a job,
   also the launch: the world size and every rank's device (the checks of step 4, through the
   rendezvous store), the data files, the tokenizer (step 5) and the checkpoint to resume.
   No process group and no patched megatron-core yet, so a bad launch fails in seconds, on
   every rank alike, with every problem found in one error (problems.py);
   ``model_args`` is this step for a model that is built or described but not trained;
3. ``start_megatron_core``: megatron-core imported and patched (patches/);
4. ``init_distributed``: the launch checked against the plan (once per process), then the
   process groups;
5. ``build_tokenizer``: the vocabulary padded as Megatron-LM pads it, checked against the plan;
6. ``build_model``: this rank's model chunks (TransformerConfig, GPT stages, DDP).

Who runs which: pretrain_gpt.py (``pretrain.main``) runs 1-2, then ``training.run`` runs 3-4,
starts its watchdog (which reports any later failure to every rank), runs 5-6 and trains
(step 5 again: configure's tokenizer was a check);
``profiling.compute`` runs 1, ``model_args``, 3, its own world of profiling processes, then 6
per probed depth; ``model_spec_of_flags`` (benches that predict a run before
launching it) runs ``model_args`` only.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence

import torch

from hetero.env import Launch
from hetero.errors import HeteroError
from hetero.grid import TP_PP_DP_ORDER
from hetero.plan import DeviceEntry, Plan
from hetero.pipeline_layout import SplitFlags, parse_layout, split_disagreement
from hetero.spec.model import ModelSpec
from megatron.hetero.arguments import (
    apply_plan,
    build_parser,
    check_plan_model,
    padded_vocab_size,
    vocab_divisor_giving,
    parse_args,
    validate_args,
)
from megatron.hetero import distributed
from megatron.hetero.batch_schedule import batch_schedule
from megatron.hetero.identity import RankIdentity
from megatron.hetero.performance import check_performance_flags, performance_on_plan
from megatron.hetero.problems import Problems

if TYPE_CHECKING:  # importing it here would import megatron-core before step 3
    from megatron.core.transformer.transformer_config import TransformerConfig

# Training flags pretrain_gpt.py's parser insists on and a model does not depend on, given
# before the caller's flags (which win) by ``model_args``.
TRAINING_PLACEHOLDERS = ("--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                         "--lr", "1e-4")


# ----- 1. the process --------------------------------------------------------------------


def prepare_process(launch_rank: int) -> None:
    """Process-wide settings, before flags are parsed or any tensor is allocated."""
    # Megatron's recipes set this: tensor-parallel collectives must keep their launch order.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # A rank killed by SIGSEGV/SIGBUS otherwise dies silently; its peers only see a closed socket.
    faulthandler.enable()
    quiet_expected_warnings(launch_rank)
    if not torch.cuda.is_available():
        from megatron.hetero.cpu_device import configure_host_allocator

        configure_host_allocator()  # before the first tensor: it decides where freed ones go


def quiet_expected_warnings(launch_rank: int) -> None:
    # Missing apex / transformer-engine is the normal state on CPU machines.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    # megatron-core 0.16.1 calls torch APIs that torch 2.13 deprecates, and touches .grad of
    # non-leaf tensors in its distributed optimizer; upstream noise, not the user's doing.
    warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*\.grad attribute of a Tensor that is not a leaf.*")
    # megatron-core 0.19 at import (its MIMO package) and at every GPTModel it builds (HybridModel
    # is upstream's successor; Megatron-LM 0.19's pretrain_gpt.py still builds GPTModel).
    warnings.filterwarnings("ignore", message=r"MimoModelConfig is experimental.*")
    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(
        lambda record: "GPTModel IS DEPRECATED" not in record.getMessage())
    if not torch.cuda.is_available():
        # On the CPU the tensor-parallel "cuda" RNG is the CPU generator, so every dropout
        # inside its fork trips megatron-core's check that the CPU state did not change.
        logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    if launch_rank != 0:  # as Megatron-LM: rank 0 speaks for everyone
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)


# ----- 2. flags and plan -----------------------------------------------------------------


@dataclass(frozen=True)
class Configured:
    """The job as the command line and the plan file give it, validated."""

    args: argparse.Namespace
    plan: Plan
    plan_source: str | None  # the plan file; None for Megatron's uniform plan


def configure(argv: Sequence[str], world_size: int, launch: Launch | None = None) -> Configured:
    """Megatron-LM's flags and the plan, checked before megatron-core or any process group;
    with ``launch`` (a process of a job), also the launch: the world size, every rank's
    device against the plan (through the rendezvous store, not a collective), the data
    files, the tokenizer against the plan's vocabulary and the checkpoint --load resumes.
    Every problem found is in the one HeteroError raised, the same on every rank."""
    problems = Problems()
    refusals: list[HeteroError] = []
    args = parse_args(argv, refusals)              # refused and unknown flags named here
    for refusal in refusals:
        problems.add(str(refusal), refusal=True)
    if args.use_checkpoint_args:                   # the model flags from the checkpoint, as Megatron-LM
        from megatron.hetero.arguments import honoured_dests
        from megatron.hetero.checkpoint_args import apply_checkpoint_args

        _, args.checkpoint_arg_notes = problems.attempt(apply_checkpoint_args, args, honoured_dests())
    plan, plan_source = None, None
    if args.hetero_plan or not _missing_layout_flags(args):  # missing ones: validate_args names them
        _, loaded = problems.attempt(load_plan, args, world_size)
        plan, plan_source = loaded or (None, None)
    if plan is not None:                           # the plan's layout into the flags, even on a conflict
        problems.attempt(apply_plan, args, plan, _template_of(plan, launch))
    else:                                          # the flags' own layout for the checks below
        args.tensor_model_parallel_size = args.tensor_model_parallel_size or 1
        args.pipeline_model_parallel_size = args.pipeline_model_parallel_size or 1
        args.stage_tensor_parallel_sizes = None
    # Megatron-LM's derived defaults and checks: the flags' own problems, listed before the plan's
    validated, _ = problems.attempt(validate_args, args, refusal=True)
    # validate_args fills every default before it raises, unless a required flag is missing.
    defaults_filled = getattr(args, "params_dtype", None) is not None
    if defaults_filled:  # a refused performance flag stops the launch whatever the plan: first
        problems.attempt(check_performance_flags, args, refusal=True)
    if defaults_filled and plan is not None:
        problems.attempt(check_plan_model, args, plan)  # the model the plan was made for
        performed, configured_plan = problems.attempt(performance_on_plan, args, plan)
        if performed and validated:
            plan = configured_plan                 # virtual stages filled in from the flags
            problems.attempt(batch_schedule, args, plan)  # --train-samples -> iterations; ramp steps
    if launch is not None:
        _check_launch(problems, args, plan, plan_source, launch, defaults_filled)
    problems.raise_if_any()
    return Configured(args, plan, plan_source)


def _template_of(plan: Plan, launch: Launch | None) -> int:
    """The replica template this process runs (0 before a launch, or when the launch does not
    fit the plan: the world-size check names that)."""
    if plan.num_templates == 1 or launch is None or launch.world_size != plan.world_size:
        return 0
    return plan.grid.coords(plan.logical_rank(launch.rank)).template


def _missing_layout_flags(args: argparse.Namespace) -> bool:
    return any(getattr(args, flag) is None for flag in ("num_layers", "micro_batch_size", "global_batch_size"))


def _check_launch(problems: Problems, args: argparse.Namespace, plan: Plan | None, plan_source: str | None,
                  launch: Launch, defaults_filled: bool) -> None:
    """Configure's launch-side checks (steps 4 and 5, done early so their problems join the
    others): every rank exchanges its device whatever else failed, so that none waits."""
    judged = None
    if plan is not None and plan_source is not None:  # the uniform plan expects no device
        sized, _ = problems.attempt(distributed.check_world_size, plan, launch, plan_source)
        judged = plan if sized else None
    if args.hetero_plan:  # every rank of a planned launch, whether its plan loaded or not
        timeout = timedelta(minutes=args.distributed_timeout_minutes)
        problems.attempt(distributed.check_launch_devices, judged, launch, timeout)
    if defaults_filled:  # the files and vocabulary the flags name
        from megatron.hetero import data  # imports megatron-core (not patched yet: step 3)

        problems.attempt(data.check_data_paths, args)
        tokenized, _ = problems.attempt(build_tokenizer, args, plan)
        if tokenized and args.load:
            problems.attempt(check_resume_shape, args)


def check_resume_shape(args: argparse.Namespace) -> None:
    """The checkpoint --load resumes against the model the flags build, before any process
    group: a difference is named with the flags that build the checkpoint's model. The
    vocabulary is left to the load itself (checkpointing/load.py), which explains its padding."""
    from megatron.core import dist_checkpointing
    from megatron.hetero import checkpointing

    iteration = args.ckpt_step if args.ckpt_step is not None else checkpointing.latest_iteration(args.load)
    directory = checkpointing.iteration_dir(args.load, iteration) if iteration is not None else None
    if directory is None or not (directory / "metadata.json").exists():
        return  # nothing to resume, or an incomplete one: the load says which
    try:
        saved = dist_checkpointing.load_common_state_dict(str(directory)).get("hetero", {})
    except Exception:  # unreadable: the load's manifest check names the damaged file
        return
    theirs, ours = saved.get("model_shape", {}), checkpointing.model_shape(args)
    different = [key for key in ours if key in theirs and theirs[key] != ours[key]
                 and key not in ("vocab_size", "padded_vocab_size")]
    if different:
        parser = build_parser()
        fixes = [flag_giving(parser, key, theirs[key], ours[key], theirs) for key in different]
        raise HeteroError(
            f"the checkpoint in {directory} is of another model ("
            + "; ".join(f"{key}: checkpoint {theirs[key]!r}, this run {ours[key]!r}" for key in different)
            + f"); to resume it, give the flags that build its model: {', '.join(fixes)} (or point "
            "--load at a checkpoint of this model)")


def flag_giving(parser: argparse.ArgumentParser, field: str, value: Any, run_value: Any, shape: dict) -> str:
    """The pretrain_gpt.py flag that sets a model field (ModelSpec's names, Megatron-LM's
    dests) to ``value`` where this run has ``run_value``: "--hidden-size 64", "drop --swiglu"."""
    if field == "params_dtype":
        return f"--{value}" if value in ("bf16", "fp16") else f"drop --{run_value}"
    action = next((a for a in parser._actions if a.dest == field and a.option_strings), None)
    if action is None:
        return f"{field} {value!r}"
    flag = action.option_strings[0]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        on = value if isinstance(action, argparse._StoreTrueAction) else not value
        return flag if on else f"drop {flag}"
    if value is None:
        return f"drop {flag}"
    if field == "num_query_groups" and value != shape.get("num_attention_heads"):
        return f"--group-query-attention {flag} {value}"
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def load_plan(args: argparse.Namespace, world_size: int) -> tuple[Plan, str | None]:
    """The plan file, or the uniform plan stock Megatron would run on this launch."""
    split_flags = SplitFlags.of_args(args)  # Megatron-LM's uneven-pipeline flags
    if split_flags.layout is not None:
        placed = "".join(parse_layout(split_flags.layout)).count("m")
        if placed != (args.mtp_num_layers or 0):
            raise HeteroError(
                f"--pipeline-model-parallel-layout {split_flags.layout!r} places {placed} multi-token-"
                f"prediction layers (m) and --mtp-num-layers is {args.mtp_num_layers}: make them agree "
                "(megatron-core's rule)")
    if args.hetero_plan:
        plan = Plan.load(args.hetero_plan)
        if plan.num_templates > 1:
            given = split_flags.given()
            if given:
                raise HeteroError(f"{', '.join(given)} describe one pipeline; the plan runs {plan.num_templates} "
                                  "replica templates, each with its own stages: drop the flags (the plan splits the layers)")
        elif args.num_layers is None or args.num_layers == plan.num_layers:  # else apply_plan names --num-layers
            planned = [stage.virtual_stages or [stage.num_layers] for stage in plan.stages]
            disagreement = split_disagreement(planned, plan.num_layers, split_flags)
            if disagreement:
                raise HeteroError(disagreement)
        if args.use_tp_pp_dp_mapping and plan.rank_order != tp_pp_dp_rank_order(plan):
            raise HeteroError(
                f"--use-tp-pp-dp-mapping asks for Megatron-LM's tp-pp-dp rank order, and the plan's "
                f"rank_order places the ranks otherwise; drop the flag (the plan's rank_order decides) "
                f"or give the plan rank_order {tp_pp_dp_rank_order(plan)}")
        return plan, args.hetero_plan
    tp = args.tensor_model_parallel_size or 1
    pp = args.pipeline_model_parallel_size or 1
    cp = args.context_parallel_size or 1
    if world_size % (tp * pp * cp):
        raise HeteroError(
            f"world size {world_size} is not divisible by tensor x pipeline x context parallel size "
            f"({tp} x {pp} x {cp})"
        )
    for flag in ("num_layers", "micro_batch_size", "global_batch_size"):
        if getattr(args, flag) is None:
            raise HeteroError(f"missing --{flag.replace('_', '-')} (or give a --hetero-plan)")
    per_step = args.micro_batch_size * (world_size // (tp * pp * cp))
    if args.decrease_batch_size_if_needed and args.global_batch_size % per_step:
        # As Megatron-LM's micro-batch calculator: down to a multiple of micro-batch x replicas.
        decreased = args.global_batch_size // per_step * per_step
        if decreased < 1:
            raise HeteroError(f"--decrease-batch-size-if-needed: --global-batch-size {args.global_batch_size} is "
                              f"below one micro-batch per replica ({per_step}); raise it")
        args.decreased_global_batch_size = (args.global_batch_size, decreased)
        args.global_batch_size = decreased
    unplanned = DeviceEntry(host="unplanned", device_type="unplanned", vendor="unplanned")
    plan = Plan.uniform(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=world_size // (tp * pp * cp),
        micro_batch_size=args.micro_batch_size,
        num_layers=args.num_layers,
        global_batch_size=args.global_batch_size,
        devices=[unplanned] * world_size,
        # A model without experts (no --num-experts) has no parameter the expert layout
        # shapes: megatron-core builds its groups and nothing uses them. The plan takes none.
        expert_parallel=(args.expert_model_parallel_size or 1) if args.num_experts else 1,
        expert_tensor_parallel=args.expert_tensor_parallel_size if args.num_experts else None,
        split_flags=split_flags,
        context_parallel=cp,
    )
    if args.use_tp_pp_dp_mapping:
        plan = plan.model_copy(update={"rank_order": tp_pp_dp_rank_order(plan)})
    return plan, None


def tp_pp_dp_rank_order(plan: Plan) -> list[int]:
    """Megatron-LM's --use-tp-pp-dp-mapping as a plan's rank_order: the launch rank of each
    logical rank is its place when the grid is enumerated in megatron-core's order
    "tp-cp-ep-pp-dp" instead of its default "tp-cp-ep-dp-pp" (tensor rank tp, context rank cp
    of replica dp in stage pp: tp + TP * (cp + CP * (pp + PP * dp)); the expert axis lives in
    its expert grid)."""
    return plan.grid.positions(TP_PP_DP_ORDER)


def model_args(flags: Sequence[str], tensor_parallel: int = 1) -> argparse.Namespace:
    """Step 2 for a model that is built or described but not trained: the caller's
    pretrain_gpt.py flags (training flags it leaves out take placeholders), one pipeline stage
    at ``tensor_parallel`` (the divisibility checks and the vocabulary padding use it), and
    the vocabulary padded as the run pads it (step 5)."""
    args = parse_args([*TRAINING_PLACEHOLDERS, *flags])
    args.tensor_model_parallel_size = tensor_parallel
    args.pipeline_model_parallel_size = 1
    validate_args(args)
    build_tokenizer(args)
    return args


def model_spec_of_flags(flags: Sequence[str]) -> ModelSpec:
    """The model pretrain_gpt.py builds from these model and data flags, its vocabulary
    padded as the run pads it: for benches that predict a run before launching it."""
    return ModelSpec.from_megatron_args(model_args(flags))


# ----- 3. megatron-core ------------------------------------------------------------------


def start_megatron_core(allow_untested: bool = False) -> list[str]:
    """Imports megatron-core (its import-time compiles deferred), checks its release and
    applies the patches this process needs (patches/); returns their names.
    ``allow_untested``: --hetero-allow-untested-megatron-core."""
    from megatron.hetero.patches import apply_patches

    return apply_patches(allow_untested)


# ----- 4. process groups -----------------------------------------------------------------


def init_distributed(args: argparse.Namespace, plan: Plan, plan_source: str | None) -> RankIdentity:
    """The launch checked against the plan (world size, each rank's device), then the
    process groups, this process at the logical rank the plan gives it."""
    return distributed.initialize(
        plan,
        plan_source or "(uniform)",
        args.distributed_backend,
        timedelta(minutes=args.distributed_timeout_minutes),
        check_devices=plan_source is not None,  # the uniform plan expects no device
        sequence_parallel=args.sequence_parallel,
        group_options=distributed.group_options(args),
    )


# ----- 5. tokenizer ----------------------------------------------------------------------


def build_tokenizer(args: argparse.Namespace, plan: Plan | None = None) -> Any:
    """The run's tokenizer; sets ``args.padded_vocab_size`` (Megatron-LM's padding) and
    checks it against the vocabulary the plan was made for."""
    from megatron.hetero import data  # imports megatron-core

    built = data.build_tokenizer(args)
    args.padded_vocab_size = padded_vocab_size(built.vocab_size, args)
    args.tokenizer_vocab_size = built.vocab_size  # before padding: names the padding flag a checkpoint needs
    planned_vocab = plan.model.vocab_size if plan is not None and plan.model is not None else None
    if planned_vocab is not None and planned_vocab != args.padded_vocab_size:
        divisor = vocab_divisor_giving(planned_vocab, built.vocab_size, args)
        fix = (f"--make-vocab-size-divisible-by {divisor} pads it to the plan's" if divisor is not None else
               f"regenerate the plan with hetero-plan --vocab-size {args.padded_vocab_size}")
        raise HeteroError(
            f"the plan was made for a vocabulary of {planned_vocab}, this run pads its tokenizer's "
            f"{built.vocab_size} to {args.padded_vocab_size}; {fix}"
        )
    return built


# ----- 6. the model ----------------------------------------------------------------------


def build_model(args: argparse.Namespace, plan: Plan, timers: Any = None) -> tuple[TransformerConfig, list]:
    """This rank's model chunks of the plan (one per virtual stage, else one), initialised
    independently of the plan and wrapped for data parallelism, with their config."""
    from megatron.hetero import model  # imports megatron-core
    from megatron.hetero.identity import this_rank

    # Under several templates the model is this rank's template's pipeline (its stages'
    # degrees, layers and recomputation); the whole plan's grid serves the groups.
    pipeline = plan.template_plan(this_rank().template) if plan.num_templates > 1 else plan
    config = model.transformer_config(args, pipeline)
    config.timers = timers  # megatron-core times its own steps at --timing-log-level 2
    return config, model.build_model(args, pipeline, config)
