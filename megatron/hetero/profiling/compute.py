"""Per-layer compute profile of a model shape on the local device, in the predictor's format.

    python -m megatron.hetero.profiling.compute --device-type cpu-fast -o profiles/ \\
        --micro-batch-sizes 1 2 4 -- --num-layers 2 --hidden-size 256 ... (pretrain_gpt.py flags)

The model is megatron-core's GPTModel built (and DDP-wrapped) as pretrain_gpt.py does, fed as
training feeds it (its forward step: megatron-core's dataset, the batch, the loss), at 1, 2, 3
and 4 decoder layers and every micro-batch size, all built at once and run in turns: every
round times each (size, depth) once, up one round and down the next. A line through a size's
four medians: its slope is a layer, its intercept the embedding, output layer, batch and loss
(the profile's "logits"); hooks on the embedding time the first pipeline stage's share of it
(the batch, the embedding). On a shared machine (or an emulated device under a CPU quota) one
round varies by 10-30%, and the machine's speed drifts by 10-30% over minutes: timed depth
after depth, a drift tilted the line (a depth measured 0-23% apart on the way up and down,
intercepts doubled between profiles); timed size after size, it set the sizes' ratio, which
the planner picks its micro-batch size by. In turns, it moves every depth and size alike.
Activation memory per layer is what autograd keeps for backward (saved-tensor hooks), on any
device. The four models (ten layers) of every size must fit at once, or of one size with
--one-size-at-a-time.

Run by torchrun (inside the emulator: `python -m tools.emulator --cluster C -- -m
megatron.hetero.profiling.compute ...`; on a Slurm cluster: `hetero-plan profile --slurm`)
every rank profiles its own device concurrently - the contention of a real job - and rank 0
writes one profile per device type, the median over that type's ranks. Every rank starts
the rounds together and keeps running them until the slowest has its own: a fast rank idling
while slow ones finish would hand them cores (or memory bandwidth) they do not get in
training, where every rank is busy.
--tensor-parallel T groups consecutive ranks (one host) T by T.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy
import torch
import torch.distributed as dist

from hetero import env
from hetero.errors import HeteroError
from hetero.launch import split_at_double_dash
from hetero.io import write_json_atomic
from hetero.spec.profiles import ComputeProfile, median_entry, model_shape
from megatron.hetero.identity import compute_device

PROBE_DEPTHS = (1, 2, 3, 4)
# Data flags the profile does not depend on, before the caller's (which win); startup.model_args
# adds the training flags' placeholders.
PLACEHOLDER_FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer"]


def _init_world() -> None:
    if env.launch() is None:  # one process: a world of one on a free local port
        os.environ.update({env.RANK: "0", env.LOCAL_RANK: "0", env.WORLD_SIZE: "1",
                           env.MASTER_ADDR: "127.0.0.1", env.MASTER_PORT: str(env.unused_port())})
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _device_type(override: str | None) -> str:
    from megatron.hetero.distributed import detect_device

    return override or detect_device(env.local_rank()).device_type


def _publish_identity() -> None:
    """The identity training's code asks for (identity.this_rank: the batch's device, the
    model's template): a replica of its own per rank, as the profile's models are built."""
    from hetero.grid import RankCoords
    from megatron.hetero.distributed import detect_device
    from megatron.hetero.identity import RankIdentity, set_this_rank

    rank, world = dist.get_rank(), dist.get_world_size()
    launch = env.launch() or env.Launch(rank=rank, world_size=world)
    set_this_rank(RankIdentity(launch=launch, logical_rank=rank, coords=RankCoords(tp_rank=0, dp_rank=rank, pp_rank=0),
                               device=compute_device(), vendor=detect_device(env.local_rank()).vendor or "cpu"))


def _micro_batches(dataset, micro_batch_size: int) -> Iterator[dict]:
    """Training's micro-batches, cycled: megatron-core's dataset, with the causal mask built
    in the loader where Megatron-LM's default builds it there."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=micro_batch_size)
    while True:
        yield from loader


class _Probe:
    """One model depth under test: megatron-core's GPTModel built (and DDP-wrapped: backward
    also accumulates every gradient into the reduction buffer, a per-micro-batch cost) as
    training builds it, fed and timed as training runs a micro-batch (reading the batch, the
    model, the loss). Hooks on the embedding time the first pipeline stage's share of what
    is not a decoder layer: reading the batch, the embedding's forward and backward."""

    def __init__(self, args, num_layers: int, micro_batch_size: int, batches: Iterator[dict]):
        from megatron.core import parallel_state
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        from hetero.plan import Plan
        from megatron.hetero.startup import build_model

        tp = parallel_state.get_tensor_model_parallel_world_size()
        plan = Plan.uniform(tensor_parallel=tp, pipeline_parallel=1,
                            data_parallel=dist.get_world_size() // tp, micro_batch_size=micro_batch_size,
                            num_layers=num_layers, global_batch_size=micro_batch_size * dist.get_world_size() // tp)
        layered = argparse.Namespace(**{**vars(args), "num_layers": num_layers})
        self.config, (self.model,) = build_model(layered, plan)
        self.plan = plan
        self.batches = batches
        self.marks: dict[str, float] = {}
        self.samples: dict[str, list[float]] = {k: [] for k in (
            "forward", "backward", "saved", "batch", "embedding_forward", "embedding_backward")}
        embedding = next(m for m in self.model.modules() if isinstance(m, LanguageModelEmbedding))
        embedding.register_forward_pre_hook(lambda module, inputs: self._mark("embedding_start"))
        embedding.register_forward_hook(self._embedding_done)

    def _mark(self, name: str) -> None:
        _sync()
        self.marks[name] = time.perf_counter()

    def _embedding_done(self, module, inputs, output: torch.Tensor) -> None:
        self._mark("embedding_end")
        if output.requires_grad:  # its gradient arriving starts the embedding's backward
            output.register_hook(lambda grad: self._mark("embedding_grad"))

    def step(self, timed: bool, keep_gradients: bool = False) -> None:
        from megatron.hetero.training import forward_step

        seen: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return tensor

        self._mark("start")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output, loss_of = forward_step(self.batches, self.model)
            loss = loss_of(output)[0]
        self._mark("middle")
        loss.backward()
        self._mark("end")
        if not keep_gradients:
            self.model.zero_grad_buffer()
        if timed:
            m = self.marks
            for key, value in (("forward", m["middle"] - m["start"]), ("backward", m["end"] - m["middle"]),
                               ("saved", sum(seen.values())), ("batch", m["embedding_start"] - m["start"]),
                               ("embedding_forward", m["embedding_end"] - m["embedding_start"]),
                               ("embedding_backward", m["end"] - m["embedding_grad"])):
                self.samples[key].append(value)

    def medians(self) -> dict[str, float]:
        """Every sample's median, and how much a whole micro-batch varied from round to round
        (standard deviation / mean of forward + backward)."""
        whole = [f + b for f, b in zip(self.samples["forward"], self.samples["backward"])]
        spread = statistics.stdev(whole) / statistics.fmean(whole) if len(whole) > 1 else 0.0
        return {**{key: statistics.median(values) for key, values in self.samples.items()}, "cv": spread}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_depths(args, micro_batch_sizes: list[int], repeats: int, everyone: dist.ProcessGroup,
                 dataset, time_optimizer: bool = False) -> tuple[dict[int, list[dict[str, float]]], dict | None]:
    """Medians of every PROBE_DEPTHS model's samples (_Probe) at each micro-batch size, at
    least `repeats` each. Every round runs each (size, depth) once, up one round and down the
    next, so a drift of the machine's speed moves all sizes and depths alike: timed size after
    size, a slower minute during one made it look dear against the others (a micro-batch of 2
    came out 2.25x one of 1 in one profile, 1.3-1.8x in short profiles around the runs), and
    the planner picks its micro-batch size by that ratio. Rounds go on until every rank of
    `everyone` has its `repeats` (two warm-up rounds first)."""
    from megatron.core import parallel_state

    probes = {mbs: [_Probe(args, n, mbs, _micro_batches(dataset, mbs)) for n in PROBE_DEPTHS]
              for mbs in micro_batch_sizes}
    in_turns = [probe for mbs in micro_batch_sizes for probe in probes[mbs]]
    device = compute_device()
    all_done = None  # every rank's `repeats` rounds timed
    dist.barrier(group=everyone)
    for repeat in itertools.count():
        for probe in in_turns if repeat % 2 == 0 else reversed(in_turns):
            probe.step(timed=repeat >= 2)
        if repeat == repeats + 1:
            all_done = dist.barrier(group=everyone, async_op=True)
        if all_done is not None:
            # Tensor-parallel partners run every round together, so they stop together.
            stop = torch.tensor([int(all_done.is_completed())], device=device)
            dist.all_reduce(stop, op=dist.ReduceOp.MIN, group=parallel_state.get_tensor_model_parallel_group())
            if stop.item():
                break
    all_done.wait()
    step = _time_optimizer_step(args, probes[min(micro_batch_sizes)], repeats) if time_optimizer else None
    return {mbs: [probe.medians() for probe in depths] for mbs, depths in probes.items()}, step


def _time_optimizer_step(args, probes: list[_Probe], repeats: int) -> dict[str, float]:
    """What an iteration costs a rank beyond its micro-batches and its gradient reduction, as
    the runtime runs it, on each depth's model: the training loop's all-reduces of the
    token count and the loss, then megatron-core's optimizer step (get_megatron_optimizer, as
    pretrain_gpt.py builds it: copy the gradients to the main ones, the gradient norm - its
    all-reduce over every rank, as the distributed optimizer's spans the job - clip, Adam
    tensor by tensor, copy back). Every rank of the profile steps at once, right after a
    micro-batch's forward and backward, a barrier (the gradient reduction meets the ranks
    there) and a moment of compute (network.py's BUSY_BEFORE_SEND_S). The step is the
    non-distributed optimizer's over the whole model: the distributed optimizer does the
    same work on the rank's 1/DP share and all-gathers the result, which the predictor
    prices as communication.

    Returns a line through the medians against the rank's parameters: seconds per parameter
    and fixed seconds (the step's own work beyond its parameters and the collectives)."""
    from megatron.hetero.profiling.network import BUSY_BEFORE_SEND_S, keep_busy
    from megatron.hetero.training import build_optimizer

    world = dist.group.WORLD
    stepped = argparse.Namespace(**{**vars(args), "use_distributed_optimizer": False})
    optimizers = []
    for probe in probes:
        optimizer, _ = build_optimizer(stepped, probe.plan, [probe.model], probe.config.params_dtype)
        # The distributed optimizer's gradient statistics span every rank (megatron-core:
        # its grad_stats_parallel_group); the non-distributed one's only the model's ranks.
        optimizer.grad_stats_parallel_group = world
        optimizers.append(optimizer)
    scalars = torch.zeros(2, device=compute_device())
    samples: list[list[float]] = [[] for _ in probes]
    for repeat in range(repeats + 1):  # one warm-up round
        order = range(len(probes)) if repeat % 2 == 0 else reversed(range(len(probes)))
        for i in order:
            probe, optimizer = probes[i], optimizers[i]
            probe.step(timed=False, keep_gradients=True)
            dist.barrier(group=world)
            # As the step meets a rank in training: right after its own work, not idle after
            # a barrier (under a CPU quota its first message then waits for the next period).
            keep_busy(BUSY_BEFORE_SEND_S)
            _sync()
            start = time.perf_counter()
            for _ in range(2):  # the token count (finalize_model_grads) and the loss (the loop)
                dist.all_reduce(scalars, group=world)
            optimizer.step()
            _sync()
            if repeat:
                samples[i].append(time.perf_counter() - start)
            probe.model.zero_grad_buffer()
            optimizer.zero_grad()
    params = [sum(p.numel() for p in probe.model.parameters()) for probe in probes]
    per_param, fixed = numpy.polyfit(params, [statistics.median(t) for t in samples], 1)
    return {"per_param_s": max(1e-15, per_param), "fixed_s": max(0.0, fixed)}


def profile_entries(args, micro_batch_sizes: list[int], repeats: int, everyone: dist.ProcessGroup,
                    dataset, time_optimizer: bool = False) -> tuple[list[dict], dict | None]:
    """This rank's profile entries at its tensor-parallel degree, one per micro-batch size:
    a line through the depths; and with time_optimizer the optimizer step's line
    (_time_optimizer_step)."""
    from megatron.core import parallel_state

    entries = []
    timed, step = _time_depths(args, micro_batch_sizes, repeats, everyone, dataset, time_optimizer)
    for mbs, depths in timed.items():
        (layer_f, fixed_f), (layer_b, fixed_b), (layer_s, _) = (
            numpy.polyfit(PROBE_DEPTHS, [d[key] for d in depths], 1) for key in ("forward", "backward", "saved"))
        floor = 1e-7  # noise can make a slope tiny; the schema wants > 0
        entries.append({
            "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
            "micro_batch_size": mbs,
            "layer_forward_s": max(floor, layer_f),
            "layer_backward_s": max(floor, layer_b),
            "layer_activation_bytes": max(0.0, layer_s),
            "logits_forward_s": max(0.0, fixed_f),
            "logits_backward_s": max(0.0, fixed_b),
            # Not per layer: the median over the depths.
            **{f"{key}_s": statistics.median(d[key] for d in depths)
               for key in ("batch", "embedding_forward", "embedding_backward")},
            # The deepest model's: the closest to a training micro-batch of a whole stage.
            "micro_batch_cv": depths[-1]["cv"],
        })
    return entries, step


def _profile_degree(args, tp: int, micro_batch_sizes: list[int], repeats: int,
                    everyone: dist.ProcessGroup, dataset, time_optimizer: bool) -> tuple[list[dict], dict | None]:
    """This rank's entries of one tensor-parallel degree (its process groups live for this
    call), and the optimizer step's line where asked."""
    from megatron.core import parallel_state
    from megatron.hetero.training import set_random_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        set_random_seed(args.seed)  # also seeds the tensor-parallel RNG tracker dropout uses
        return profile_entries(args, micro_batch_sizes, repeats, everyone, dataset, time_optimizer)
    finally:
        parallel_state.destroy_model_parallel()


def _gather_case(results: dict, device_type: str, tp: int, entry: dict) -> dict:
    """Adds every tensor-parallel group's entry of one case to results (by device type) and
    returns the median entry of this rank's device type."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (device_type, entry if dist.get_rank() % tp == 0 else None))
    case = (tp, entry["micro_batch_size"])
    for name, theirs in gathered:
        if theirs is not None:
            results.setdefault(name, {}).setdefault(case, []).append(theirs)
    return median_entry(results[device_type][case])


def main(argv: list[str] | None = None) -> int:
    argv, gpt_flags = split_at_double_dash(argv)
    parser = argparse.ArgumentParser(prog="python -m megatron.hetero.profiling.compute",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output-dir", required=True, help="profile directory (hetero-plan --profiles)")
    parser.add_argument("--device-type", default=None,
                        help="name in the cluster spec (default: HETERO_DEVICE, else what torch sees)")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tensor-parallel", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=16, help="timed rounds of every depth (median)")
    parser.add_argument("--one-size-at-a-time", action="store_true",
                        help="profile micro-batch sizes one after the other instead of in turns: one size's "
                             "four models in memory at a time, but a drift of the machine's speed between "
                             "sizes goes into their ratio")
    options = parser.parse_args(argv)

    from megatron.hetero import data, startup
    from megatron.hetero.model import model_spec

    # pretrain_gpt.py's start-up (megatron/hetero/startup.py) up to the model, for a world of
    # profiling processes instead of a plan's: the same flags, allocator, patches and model.
    startup.prepare_process(env.launch_rank())
    try:
        # The largest degree: every degree's divisibility checks, and its vocabulary padding.
        args = startup.model_args(PLACEHOLDER_FLAGS + gpt_flags, tensor_parallel=max(options.tensor_parallel))
    except HeteroError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    startup.start_megatron_core()
    torch.set_num_threads(env.omp_num_threads() or torch.get_num_threads())
    _init_world()
    _publish_identity()
    rank, world = dist.get_rank(), dist.get_world_size()
    device_type = _device_type(options.device_type)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    # Gloo on any device: its barrier is polled between rounds without a device sync.
    everyone = dist.new_group(backend="gloo")
    dataset = data.build_datasets(args, data.build_tokenizer(args), 64 * max(options.micro_batch_sizes))[0]
    # Sizes in turns within a degree (one set of process groups at a time), degrees one after
    # the other; --one-size-at-a-time builds one size's four models at a time (less memory).
    size_groups = ([[mbs] for mbs in options.micro_batch_sizes] if options.one_size_at_a_time
                   else [options.micro_batch_sizes])
    results: dict[str, dict[tuple[int, int], list[dict]]] = {}  # device type -> case -> ranks' entries
    number, cases = 0, len(options.tensor_parallel) * len(options.micro_batch_sizes)
    step = None  # the optimizer step's line, timed once (with the first degree's models)
    for tp in options.tensor_parallel:
        if world % tp:
            raise SystemExit(f"error: --tensor-parallel {tp} does not divide the {world} ranks")
        for sizes in size_groups:
            entries, timed_step = _profile_degree(args, tp, sizes, options.repeats, everyone, dataset,
                                                  time_optimizer=step is None)
            step = step or timed_step
            for entry in entries:
                merged = _gather_case(results, device_type, tp, entry)
                number += 1
                if rank == 0:
                    print(f"[profile {number}/{cases}] tp {tp} mbs {entry['micro_batch_size']} on {device_type}: "
                          f"layer forward {merged['layer_forward_s'] * 1e3:.2f} ms, backward "
                          f"{merged['layer_backward_s'] * 1e3:.2f} ms, activations "
                          f"{merged['layer_activation_bytes'] / 2**20:.1f} MiB", flush=True)
    steps: list = [None] * world
    dist.all_gather_object(steps, (device_type, step))
    if rank == 0:
        print("[profile] optimizer step per iteration: " + ", ".join(
            f"{name} {statistics.median(t['fixed_s'] for d, t in steps if d == name) * 1e3:.1f} ms + "
            f"{statistics.median(t['per_param_s'] for d, t in steps if d == name) * 1e9:.2f} ns per parameter"
            for name in sorted(results)), flush=True)
    if rank == 0:
        shape = model_shape(model_spec(args))
        for name, by_case in sorted(results.items()):
            profile = {"kind": "compute", "device_type": name, "precision": precision, "model": shape,
                       "entries": [median_entry(entries) for entries in by_case.values()],
                       "optimizer_step_s_per_param": statistics.median(t["per_param_s"] for d, t in steps if d == name),
                       "optimizer_step_fixed_s": statistics.median(t["fixed_s"] for d, t in steps if d == name),
                       "measured_on": f"{world} concurrent rank(s), {time.strftime('%Y-%m-%d %H:%M')}"}
            ComputeProfile.model_validate(profile)
            path = Path(options.output_dir) / f"compute-{name}.json"
            write_json_atomic(path, profile)
            print(f"wrote {path}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
