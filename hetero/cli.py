"""hetero-plan: plan a job for a cluster, or explain an existing plan.

    hetero-plan --cluster C.yaml --model llama2-7b --global-batch-size 512 --seq-length 4096 \\
        [--profiles DIR] -o plan.json [--timeline plan.png]
    hetero-plan --cluster C.yaml -o plan.json -- <pretrain_gpt.py's flags>
    hetero-plan --cluster C.yaml -o plan.json --megatron-script train.sh [-- <the script's arguments>]
    hetero-plan explain plan.json [--timeline plan.png] [--memory]
    hetero-plan discover --slurm [--partition P ...] [--device-map FEATURE=NAME ...] -o cluster.yaml
    hetero-plan profile --slurm --cluster cluster.yaml -o profiles/ -- <the model's Megatron flags>

(also `python -m hetero ...`)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Sequence

from hetero.errors import HeteroError
from hetero.job import Job, Objective
from hetero.jobs import explain, plan_for
from hetero.plan import Plan
from hetero.predict.training_setup import TrainingSetup
from hetero.spec.recompute import MODES as RECOMPUTE_MODES, mode as recompute_mode
from hetero.report import (measured_against_predicted, measured_iteration_times_s, memory_table, summary,
                           timeline_png)
from hetero.search.planner import PlannerOptions
from hetero.slurm import discover, profile as profile_slurm
from hetero.spec.cluster import Cluster
from hetero.spec.launch_script import pretrain_flags_of_script
from hetero.spec.megatron_args import FlagsJob, job_of_flags
from hetero.spec.model import ModelSpec
from hetero.spec.presets import load_model
from hetero.spec.profiles import Profiles


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True, help="cluster spec YAML")
    p.add_argument("--model", default=None,
                   help="preset name or model YAML (Megatron field names); or give pretrain_gpt.py's "
                        "flags after `--`, or --megatron-script")
    p.add_argument("--megatron-script", default=None, metavar="SCRIPT",
                   help="a bash launch script: the model and training set-up from the flags it passes to "
                        "pretrain_gpt.py (what follows `--`: the script's arguments)")
    p.add_argument("--tokenizer-vocab-size", type=int, default=None, metavar="N",
                   help="with Megatron flags: the size the tokenizer reports, for tokenizer types "
                        "hetero-plan does not count (it pads it as the run does)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="required with --model; with Megatron flags, when they leave it out")
    p.add_argument("--seq-length", type=int, default=None, help="required with --model")
    p.add_argument("--vocab-size", type=int, default=None, help="with --model: padded vocabulary "
                                                                "(default: the model's)")
    p.add_argument("--profiles", default=None, help="directory of measured profiles (tools/)")
    p.add_argument("--roofline-for-missing", action="store_true",
                   help="with --profiles: estimate device types that have no profile")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp8", "fp32"], default=None,
                   help="default: bf16 if every device has it, else the faster of fp16 on all "
                        "devices and bf16 without the devices that lack it")
    p.add_argument("--recompute", choices=["auto", "none", "selective", "full"], default=None,
                   help="auto (default): per stage, the cheapest that fits")
    p.add_argument("--sequence-parallel", choices=["auto", "on", "off"], default=None,
                   help="auto (default): on whenever TP > 1")
    p.add_argument("--virtual-stages", type=_int_list, default=None,
                   help="interleaving degrees to try (1: plain 1F1B; default 1,2)")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--tp-comm-overlap", action="store_true",
                   help="price tensor-parallel communication as overlapped with the GEMMs (transformer-engine "
                        "userbuffers); the runtime does not switch it on yet")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument("--grad-reduce-in-bf16", action="store_true")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--no-fused-kernels", action="store_true",
                   help="megatron-core's local layers (CPU runs): attention keeps its score "
                        "matrix, SwiGLU its intermediate tensors")
    p.add_argument("--no-dropout", action="store_true",
                   help="the recipe sets hidden and attention dropout to 0 (no masks kept)")
    p.add_argument("--no-templates", action="store_true",
                   help="plans of one pipeline shape only (no replica templates, plan version 4)")
    p.add_argument("--tensor-parallel", type=_int_list, default=None, help="degrees to try (default 1,2,4,8)")
    p.add_argument("--micro-batch-size", type=_int_list, default=None, help="sizes to try (default 1,2,4,8)")
    p.add_argument("--expert-parallel", type=_int_list, default=None,
                   help="mixtures of experts: expert-parallel degrees to try (default 1 and every divisor "
                        "of the expert count that fits in one node)")
    p.add_argument("--objective", choices=["throughput", "cost", "energy"], default="throughput",
                   help="throughput: the most tokens/s; cost: the fewest $ per token (prices: the "
                        "cluster spec's prices_per_hour); energy: the fewest J per token (board power)")
    p.add_argument("--min-tokens-per-s", type=float, default=None, metavar="T",
                   help="with --objective cost/energy: a throughput floor")
    p.add_argument("--max-dollars-per-hour", type=float, default=None, metavar="D",
                   help="a budget: the rent of the devices the plan uses, $ per hour")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--skip-upper-bound", action="store_true")
    p.add_argument("-o", "--output", required=True, help="plan.json to write")
    p.add_argument("--timeline", default=None, help="also draw the predicted iteration (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress")
    return p


# hetero-plan's options that Megatron's flags state in their own words.
_STATED_BY_FLAGS = {
    "model": "the model flags", "seq_length": "--seq-length", "vocab_size": "the tokenizer flags",
    "precision": "--bf16 / --fp16", "overlap_grad_reduce": "--overlap-grad-reduce",
    "overlap_param_gather": "--overlap-param-gather", "grad_reduce_in_bf16": "--grad-reduce-in-bf16",
    "no_distributed_optimizer": "--use-distributed-optimizer", "no_dropout": "--hidden-dropout/--attention-dropout",
}


def _search_options(args: argparse.Namespace, setup: TrainingSetup, **fixed) -> PlannerOptions:
    recompute = fixed.get("recompute") or args.recompute or "auto"
    sequence_parallel = fixed.get("sequence_parallel") or args.sequence_parallel or "auto"
    return PlannerOptions(
        tensor_parallel=fixed.get("tensor_parallel") or args.tensor_parallel or (1, 2, 4, 8),
        micro_batch_sizes=fixed.get("micro_batch_sizes") or args.micro_batch_size or (1, 2, 4, 8), setup=setup,
        recompute_modes=RECOMPUTE_MODES if recompute == "auto" else (recompute,),
        sequence_parallel={"auto": None, "on": True, "off": False}[sequence_parallel],
        virtual_stages=fixed.get("virtual_stages") or args.virtual_stages or (1, 2),
        pipeline_parallel=fixed.get("pipeline_parallel"),
        expert_parallel=fixed.get("expert_parallel") or args.expert_parallel,
        expert_tensor_parallel=fixed.get("expert_tensor_parallel"), templates=not args.no_templates)


def _model_job(args: argparse.Namespace, cluster: Cluster) -> Job:
    missing = [flag for flag, value in (("--global-batch-size", args.global_batch_size),
                                        ("--seq-length", args.seq_length)) if value is None]
    if missing:
        raise HeteroError(f"--model needs {' and '.join(missing)}")
    model = load_model(args.model).with_seq_length(args.seq_length)
    if args.vocab_size:
        model = ModelSpec(**{**model.to_dict(), "vocab_size": args.vocab_size})
    setup = TrainingSetup(precision=args.precision or "bf16",
                          distributed_optimizer=not args.no_distributed_optimizer,
                          fused_kernels=not args.no_fused_kernels, dropout=not args.no_dropout,
                          overlap_grad_reduce=args.overlap_grad_reduce,
                          overlap_param_gather=args.overlap_param_gather, tp_comm_overlap=args.tp_comm_overlap,
                          grad_reduce_dtype="bf16" if args.grad_reduce_in_bf16 else None)
    return Job(cluster, model, args.global_batch_size, _search_options(args, setup), precision=args.precision)


def _fixed(option: str, ours: tuple[int, ...] | None, flag: str, theirs: int | None) -> tuple[int, ...] | None:
    """The candidates of a search dimension the flags may fix: then only their value (the
    run refuses a plan that contradicts its flags); hetero-plan's own list may repeat it."""
    if theirs is None:
        return ours
    if ours is not None and ours != (theirs,):
        raise HeteroError(f"{option} {','.join(map(str, ours))} contradicts the flags' {flag} {theirs}; "
                          "give it in one place")
    return (theirs,)


def _check_expert_tensor_parallel(job: FlagsJob, options: PlannerOptions) -> None:
    """A fixed expert tensor-parallel degree the search can honour: at EP 1 megatron-core
    trains experts correctly only when they are split like the rest of the layer (ETP = TP)."""
    fixed = job.expert_tensor_parallel
    if fixed is None or not job.model.is_moe or options.expert_parallel != (1,):
        return
    if fixed not in options.tensor_parallel:
        raise HeteroError(
            f"--expert-tensor-parallel-size {fixed} with --expert-model-parallel-size 1 must equal the "
            f"tensor-parallel degree (megatron-core reduces expert gradients correctly only then), and the "
            f"plan's TP is one of {','.join(map(str, options.tensor_parallel))}; set --expert-tensor-parallel-size "
            "to the TP degree (or drop it), or raise --expert-model-parallel-size")


def _flags_job(args: argparse.Namespace, job: FlagsJob, cluster: Cluster) -> Job:
    stated = [f"--{name.replace('_', '-')} ({flags})" for name, flags in _STATED_BY_FLAGS.items()
              if getattr(args, name) not in (None, False)]
    if stated:
        raise HeteroError(f"{', '.join(stated)}: with Megatron flags, the flags in parentheses say this; "
                          "drop the hetero-plan option(s) and set it in the flags")
    global_batch = job.global_batch_size or args.global_batch_size
    if None not in (job.global_batch_size, args.global_batch_size) and job.global_batch_size != args.global_batch_size:
        raise HeteroError(f"--global-batch-size {args.global_batch_size} contradicts the flags' "
                          f"--global-batch-size {job.global_batch_size}; give it in one place")
    if global_batch is None:
        raise HeteroError("the flags leave out --global-batch-size: add it to them (or give hetero-plan "
                          "--global-batch-size); the plan splits it between the replicas")
    if job.recompute and args.recompute not in (None, recompute_mode(job.recompute)):
        raise HeteroError(f"--recompute {args.recompute} contradicts the flags' recomputation ({job.recompute})")
    if job.sequence_parallel and args.sequence_parallel == "off":
        raise HeteroError("--sequence-parallel off contradicts the flags' --sequence-parallel")
    setup = TrainingSetup(precision=job.precision, distributed_optimizer=job.distributed_optimizer,
                          fused_kernels=job.fused_kernels and not args.no_fused_kernels, dropout=job.dropout,
                          overlap_grad_reduce=job.overlap_grad_reduce, overlap_param_gather=job.overlap_param_gather,
                          grad_reduce_dtype=job.grad_reduce_dtype, tp_comm_overlap=args.tp_comm_overlap)
    options = _search_options(
        args, setup,
        tensor_parallel=_fixed("--tensor-parallel", args.tensor_parallel, "--tensor-model-parallel-size",
                               job.tensor_parallel),
        micro_batch_sizes=_fixed("--micro-batch-size", args.micro_batch_size, "--micro-batch-size",
                                 job.micro_batch_size),
        virtual_stages=_fixed("--virtual-stages", args.virtual_stages, "--num-virtual-stages-per-pipeline-rank",
                              job.virtual_stages),
        recompute=job.recompute, sequence_parallel="on" if job.sequence_parallel else None,
        pipeline_parallel=(job.pipeline_parallel,) if job.pipeline_parallel else None,
        expert_parallel=_fixed("--expert-parallel", args.expert_parallel, "--expert-model-parallel-size",
                               job.expert_parallel),
        expert_tensor_parallel=job.expert_tensor_parallel)
    _check_expert_tensor_parallel(job, options)
    return Job(cluster, job.model, global_batch, options, precision=job.precision, vocabulary=job.vocabulary,
               pipeline_parallel=job.pipeline_parallel)


def _plan_command(argv: Sequence[str]) -> int:
    own, rest = (argv[:argv.index("--")], list(argv[argv.index("--") + 1:])) if "--" in argv else (argv, [])
    args = _plan_parser().parse_args(own)
    if args.model is not None:
        if rest or args.megatron_script:
            raise HeteroError("give the model once: --model, or Megatron flags (after `--` or in --megatron-script)")
        if args.tokenizer_vocab_size is not None:
            raise HeteroError("--tokenizer-vocab-size is for Megatron flags; with --model, --vocab-size gives "
                              "the padded vocabulary")
        cluster = Cluster.load(args.cluster)
        job = _model_job(args, cluster)
    else:
        notes: list[str] = []
        flags = pretrain_flags_of_script(args.megatron_script, rest, notes=notes) if args.megatron_script else rest
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        if not flags:
            raise HeteroError("no model: give --model NAME|YAML, pretrain_gpt.py's flags after `--`, "
                              "or --megatron-script train.sh")
        flags_job = job_of_flags(flags, args.tokenizer_vocab_size)
        cluster = Cluster.load(args.cluster)
        job = _flags_job(args, flags_job, cluster)
    job = dataclasses.replace(job, objective=Objective(args.objective, args.min_tokens_per_s,
                                                       args.max_dollars_per_hour))
    if args.profiles:
        job = dataclasses.replace(job, profiles=Profiles.load_dir(args.profiles), profiles_source=args.profiles)
        profiled = job.precision if job.precision not in (None, "from-options") else "bf16"
        model = job.model_for(job.options.tensor_parallel)
        missing = job.profiles_for(model).missing(list(cluster.device_counts()), model, profiled)
        if missing and not args.roofline_for_missing:
            raise HeteroError(
                f"--profiles {args.profiles} has no {profiled} compute profile of this model "
                f"shape for {', '.join(missing)}; measure them with `hetero-plan profile --slurm` (or "
                "python -m megatron.hetero.profiling.compute), or pass --roofline-for-missing to estimate "
                "them from the catalog"
            )

    def progress(step: str) -> None:
        print(f"  searching {step} ...", file=sys.stderr, flush=True)

    planned = plan_for(job, progress=None if args.quiet else progress, with_baseline=not args.skip_baseline,
                       with_upper_bound=not args.skip_upper_bound)
    planned.plan.save(args.output)
    print(summary(planned.plan, planned.prediction, cluster, f"hetero-plan: wrote {args.output}"))
    if args.model is None:
        print(f"run        pretrain_gpt.py --hetero-plan {args.output} with the same flags (TP, PP, micro-batch "
              f"and global batch come from the plan; padded vocabulary {planned.plan.model.vocab_size})")
    if args.timeline:
        print(f"timeline   {timeline_png(planned.plan, planned.prediction, args.timeline)}")
    return 0


def _explain_command(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="hetero-plan explain", description="Summarise an existing plan.")
    p.add_argument("plan")
    p.add_argument("--timeline", default=None, help="draw the predicted iteration (PNG)")
    p.add_argument("--memory", action="store_true", help="per-stage memory breakdown")
    p.add_argument("--measured", default=None, metavar="LOG",
                   help="a training log of this plan, or its run's events directory "
                        "(HETERO_EVENTS_DIR): its iteration time against the prediction")
    args = p.parse_args(argv)
    plan = Plan.load(args.plan)
    prediction, cluster = explain(plan, args.plan)
    print(summary(plan, prediction, cluster, f"hetero-plan explain {args.plan}"))
    if args.memory:
        print(memory_table(prediction))
    if args.measured:
        print(measured_against_predicted(measured_iteration_times_s(args.measured), prediction.iteration_time_s))
    if args.timeline:
        print(f"timeline   {timeline_png(plan, prediction, args.timeline)}")
    return 0


def _discover_command(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="hetero-plan discover",
        description="Write the cluster spec of the cluster itself (how each field is found: docs/slurm.md).")
    p.add_argument("--slurm", action="store_true", required=True,
                   help="read the Slurm cluster that scontrol/srun on PATH talk to (SLURM_CONF)")
    p.add_argument("--partition", action="append", default=[], metavar="P",
                   help="only nodes of these partitions (repeat; default: every partition)")
    p.add_argument("--device-map", action="append", default=[], metavar="FEATURE=NAME",
                   help="a node feature, GRES type or GPU name -> a catalog device, e.g. a100=A100-80GB")
    p.add_argument("--nic", action="append", default=[], metavar="[SELECTOR=]KIND:GBPS",
                   help="NIC of every node, or of a node, partition or feature (ib|roce|ethernet), "
                        "instead of what the probe finds")
    p.add_argument("--intra-link", action="append", default=[], metavar="DEVICE=LINK",
                   help="intra-node link of a device type (default: its usual board)")
    p.add_argument("--inter-group", default=None, metavar="KIND:GBPS",
                   help="link between every two groups (default: ethernet at the slower node NIC)")
    p.add_argument("--group-by", choices=discover.GROUP_RULES, default="auto",
                   help="auto: Slurm's topology where it has one, else partition")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="for nodes without a gpu GRES whose probe saw no GPU")
    p.add_argument("--exclude-nodes", action="append", default=[], metavar="NAMES",
                   help="leave out these nodes (comma-separated or a Slurm host list, e.g. cpu[01-02]; repeat)")
    p.add_argument("--exclude-feature", action="append", default=[], metavar="F",
                   help="leave out every node with this Slurm feature (repeat)")
    p.add_argument("--no-probe", action="store_true", help="run nothing on the nodes (NICs: --nic or default)")
    p.add_argument("--probe-timeout", type=float, default=120.0, help="seconds to wait for each node's probe")
    p.add_argument("--name", default=None, help="cluster name (default: Slurm's ClusterName)")
    p.add_argument("-o", "--output", default=None, help="cluster.yaml to write (default: print it)")
    args = p.parse_args(argv)
    inter = discover.parse_nic(args.inter_group)[1] if args.inter_group else None
    options = discover.DiscoverOptions(
        partitions=args.partition,
        device_map=dict(discover.parse_mapping("--device-map", m) for m in args.device_map),
        nics=dict(discover.parse_nic(n) for n in args.nic),
        intra_links=dict(discover.parse_mapping("--intra-link", m) for m in args.intra_link),
        inter_group=inter, gpus_per_node=args.gpus_per_node, exclude_nodes=args.exclude_nodes,
        exclude_features=args.exclude_feature, group_by=args.group_by,
        probe=not args.no_probe, probe_timeout_s=args.probe_timeout, name=args.name)
    found = discover.discover_slurm(options)
    text = discover.spec_yaml(found, " ".join(["hetero-plan discover", *argv]))
    for line in found.table:
        print(line, file=sys.stderr)
    for note in found.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text)
        print(f"hetero-plan discover: wrote {args.output} ({len(found.table) - 1} nodes)", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def _profile_command(argv: Sequence[str]) -> int:
    own, model_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(
        prog="hetero-plan profile",
        description="Measure the profiles --profiles reads on one node of each device class of a Slurm cluster "
                    "(hetero/slurm/profile.py, docs/slurm.md). The model's Megatron flags follow `--`.")
    p.add_argument("--slurm", action="store_true", required=True,
                   help="run the profilers through srun on the cluster that scontrol/srun on PATH talk to")
    p.add_argument("--cluster", required=True, help="cluster spec whose hosts are Slurm nodes (discover --slurm)")
    p.add_argument("-o", "--output-dir", required=True, help="profile directory, on storage every node sees")
    p.add_argument("--partition", action="append", default=[], metavar="P",
                   help="repeat: each node runs in the first of these that holds it (default: Slurm's default "
                        "partition, else the node's first)")
    p.add_argument("--account", default=None)
    p.add_argument("--time", default=None, help="time limit of every step (srun --time)")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tensor-parallel", type=int, nargs="+", default=[1],
                   help="degrees to profile (each node: those dividing its devices)")
    p.add_argument("--repeats", type=int, default=16, help="timed rounds of every layer count (median)")
    p.add_argument("--one-size-at-a-time", action="store_true",
                   help="one micro-batch size's models in memory at a time")
    p.add_argument("--message-mib", type=float, default=8.0, help="link bandwidth message size")
    p.add_argument("--rounds", type=int, default=5, help="link measurement rounds")
    p.add_argument("--master-port", type=int, default=29500, help="the profilers' rendezvous port (and the next)")
    p.add_argument("--python", default=sys.executable, help="the Python of the environment on the nodes")
    args = p.parse_args(own)
    options = profile_slurm.ProfileOptions(
        cluster=args.cluster, output_dir=args.output_dir, model_flags=model_flags, partitions=args.partition,
        account=args.account, time=args.time, micro_batch_sizes=tuple(args.micro_batch_sizes),
        tensor_parallel=tuple(args.tensor_parallel), repeats=args.repeats,
        one_size_at_a_time=args.one_size_at_a_time, message_mib=args.message_mib, rounds=args.rounds,
        master_port=args.master_port, python=args.python)
    try:
        written = profile_slurm.profile_slurm(options, progress=lambda line: print(line, file=sys.stderr,
                                                                                   flush=True))
    except KeyboardInterrupt:
        print("hetero-plan profile: stopped; the steps were cancelled and nothing was written", file=sys.stderr)
        return 130
    print(f"hetero-plan profile: wrote {', '.join(str(path) for path in written)}; plan with "
          f"--cluster {args.cluster} --profiles {args.output_dir}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "explain":
            return _explain_command(argv[1:])
        if argv and argv[0] == "discover":
            return _discover_command(argv[1:])
        if argv and argv[0] == "profile":
            return _profile_command(argv[1:])
        return _plan_command(argv)
    except HeteroError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
