"""Megatron-Hetero on one real GPU: what the CPU suite cannot check.

    python bench/gpu_bench.py --out DIR [--only gemm gemm8 comm parity moe train-moe train]

1. gemm: matrix-multiply throughput by shape (bf16, cuBLAS through torch) as a fraction of
   the catalog's dense peak, beside what hetero/efficiency.py's curve for the device says.
2. comm: the ``hetero`` backend's CUDA path. Two processes on the one GPU, labelled as two
   vendors, so every collective crosses the bridge (staged through host memory, ordered
   on the tensors' CUDA streams); results are checked against the exact sum in float64.
3. parity: pretrain_gpt.py in fp32 on the GPU, one NCCL process against two processes on the
   same GPU labelled as two vendors on the ``hetero`` backend (every group crosses the
   bridge): a pipeline of uneven stages, and two replicas of unequal micro-batch counts.
   The per-iteration losses must agree (GPU kernels are not bitwise deterministic: 1e-5).
4. train: pretrain_gpt.py on the GPU (NCCL world of one) for several micro-batch sizes
   and recomputation modes; each run's measured iteration time and peak allocated memory
   beside the predictor's, from the curve alone and from a profile of real layers taken
   first (megatron/hetero/profiling/compute.py).

5. gemm8, moe, train-moe (bench/gpu_moe.py): fp8 beside bf16 GEMMs on dense and expert
   shapes (a loop of per-expert GEMMs against torch's grouped GEMMs); MoE loss and
   load-balancing-loss parity, EP 1 on NCCL against EP 2 as two vendors on the bridge; a
   Qwen3-30B-A3B-shaped MoE model's measured iteration time beside the predictor's.

Writes DIR/gpu_bench.json (adding to what an earlier invocation wrote there) and prints tables. Needs CUDA and a build of hetero_comm._comm_ext.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from hetero.env import (EVENTS_DIR, VENDOR, per_local_rank_value, launch as launch_of_this_process,  # noqa: E402
                        unused_port)
from hetero.events import Iteration, Memory, iteration_times_s, of_kind, read_events  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from gpu_moe import bench_gemm8, bench_moe  # noqa: E402


from gpu_moe import DEVICE_TYPE  # noqa: E402  (the GPU present, by its catalog name)
MODEL_FLAGS = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
               "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size", "50257",
               "--bf16", "--attention-dropout", "0", "--hidden-dropout", "0"]
DATA_FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--num-workers", "0"]
GLOBAL_BATCH = 16
TRAIN_ITERATIONS, WARMUP = 14, 4
# (micro-batch size, recompute): Megatron's flags for each mode.
TRAIN_CASES = [(1, "none"), (2, "none"), (4, "none"), (4, "full")]
RECOMPUTE_FLAGS = {"none": [], "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", "1"]}


def fresh_events_dir(path: Path) -> Path:
    """An empty directory for one run's events (hetero.events): a rerun's must not mix in."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


# ----- 1. GEMM efficiency ---------------------------------------------------------------

def gemm_shapes() -> list[tuple[int, int, int]]:
    squares = [(n, n, n) for n in (256, 512, 1024, 2048, 4096, 8192, 16384)]
    # A GPT layer of hidden 2048 at 2048 tokens x micro-batch 1..4 (QKV, projection, MLP).
    layer = [(t, n, k) for t in (2048, 8192) for n, k in ((6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192))]
    thin = [(8192, 8192, k) for k in (128, 256, 512)]
    return squares + layer + thin


def time_gemm(m: int, n: int, k: int, repeats: int = 20) -> float:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def bench_gemm() -> list[dict]:
    from hetero.spec.catalog import DEVICES
    from hetero.predict.efficiency import curve_for

    peak = DEVICES[DEVICE_TYPE].peak_tflops
    curve = curve_for(DEVICE_TYPE, "nvidia")
    rows = []
    print(f"| m x n x k | TFLOP/s | of {peak:.0f} peak | curve says |\n|---|---:|---:|---:|")
    for m, n, k in gemm_shapes():
        seconds = time_gemm(m, n, k)
        tflops = 2 * m * n * k / seconds / 1e12
        rows.append({"shape": [m, n, k], "tflops": tflops, "fraction": tflops / peak, "curve": curve.gemm(m, n, k)})
        print(f"| {m} x {n} x {k} | {tflops:.0f} | {tflops / peak:.2f} | {curve.gemm(m, n, k):.2f} |", flush=True)
    return rows


# ----- 2. the hetero backend on CUDA tensors ----------------------------------------------

def comm_worker() -> None:
    """One rank: every collective on CUDA tensors over the cross-vendor bridge."""
    import torch.distributed as dist

    import hetero_comm

    launch = launch_of_this_process()  # set by bench_comm
    rank, world = launch.rank, launch.world_size
    torch.cuda.set_device(0)
    dist.init_process_group(backend="hetero")
    failures, cases = [], 0

    def inputs(seed: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.randn(numel, generator=torch.Generator().manual_seed(seed + r)).to(dtype) for r in range(world)]

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal cases
        cases += 1
        if not ok:
            failures.append(f"{name}: {detail}")

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for numel in (1, 1031, 3_000_001):  # the last: several 4 MiB chunks
            xs = inputs(numel, numel, dtype)
            exact = sum(x.double() for x in xs)
            bound = world * torch.finfo(dtype).eps * sum(x.double().abs() for x in xs) + 1e-30
            got = xs[rank].cuda()
            dist.all_reduce(got)
            diff = (got.double().cpu() - exact).abs()
            check(f"all_reduce {dtype} {numel}", bool((diff <= bound).all()), f"max diff {diff.max():.3g}")
            gathered = torch.empty(world * numel, dtype=dtype, device="cuda")
            dist.all_gather_into_tensor(gathered, xs[rank].cuda())
            check(f"all_gather {dtype} {numel}", torch.equal(gathered.cpu(), torch.cat(xs)))
            fulls = inputs(7 * numel, world * numel, dtype)
            shard = torch.empty(numel, dtype=dtype, device="cuda")
            dist.reduce_scatter_tensor(shard, fulls[rank].cuda())
            parts = [f[rank * numel:(rank + 1) * numel].double() for f in fulls]
            diff = (shard.double().cpu() - sum(parts)).abs()
            ok = bool((diff <= world * torch.finfo(dtype).eps * sum(p.abs() for p in parts) + 1e-30).all())
            check(f"reduce_scatter {dtype} {numel}", ok)
            root = numel % world
            value = xs[rank].cuda()
            dist.broadcast(value, src=root)
            check(f"broadcast {dtype} {numel}", torch.equal(value.cpu(), xs[root]))
    peer = 1 - rank
    for numel in (7, 2_000_003):
        xs = inputs(10 * numel, numel, torch.bfloat16)
        received = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
        ops = [dist.P2POp(dist.isend, xs[rank].cuda(), peer), dist.P2POp(dist.irecv, received, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        check(f"send/recv {numel}", torch.equal(received.cpu(), xs[peer]))
    # MoE's token exchange: all-to-all with uneven splits (rank r sends r + i + 1 rows to rank i).
    for rows in (3, 40_001):
        sends = [[torch.randn(r + i + 1, rows % 7 + 1, generator=torch.Generator().manual_seed(100 * r + i))
                  for i in range(world)] for r in range(world)]
        received = torch.empty(sum(s[rank].shape[0] for s in sends), rows % 7 + 1, device="cuda")
        dist.all_to_all_single(received, torch.cat(sends[rank]).cuda(),
                               output_split_sizes=[s[rank].shape[0] for s in sends],
                               input_split_sizes=[x.shape[0] for x in sends[rank]])
        check(f"all_to_all_single {rows}", torch.equal(received.cpu(), torch.cat([s[rank] for s in sends])))
    mode = hetero_comm.describe(dist.group.WORLD)["mode"]
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "mode": mode, "cases": cases, "failures": failures}), flush=True)


def bench_comm() -> dict:
    port, procs = unused_port(), []
    for rank, vendor in enumerate(("nvidia", "amd")):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), VENDOR: vendor}
        procs.append(subprocess.Popen([sys.executable, __file__, "--comm-worker"], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    reports = []
    for proc, output in zip(procs, outputs):
        lines = [line for line in output.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(output[-4000:])
            reports.append({"failures": [f"exit {proc.returncode}"], "cases": 0})
        else:
            reports.append(json.loads(lines[-1]))
    print(f"hetero backend on CUDA: {[r.get('mode') for r in reports]}, "
          f"{sum(r['cases'] for r in reports)} checks, failures: {[f for r in reports for f in r['failures']]}")
    return {"ranks": reports}


# ----- 3. loss parity on CUDA across the bridge --------------------------------------------

PARITY_FLAGS = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
                "--max-position-embeddings", "512", "--vocab-size", "8000", "--attention-dropout", "0",
                "--hidden-dropout", "0", "--micro-batch-size", "2", "--global-batch-size", "16",
                "--train-iters", "6", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--seed", "7"]


def parity_plan(pipeline: int, data: int, stages: list[int], replicas: list[int], vendors: list[str]) -> dict:
    return {"version": 1, "tensor_parallel": 1, "pipeline_parallel": pipeline, "data_parallel": data,
            "micro_batch_size": 2, "stages": [{"num_layers": n} for n in stages],
            "replicas": [{"num_micro_batches": n} for n in replicas], "rank_order": list(range(len(vendors))),
            "devices": [{"host": "gpu0", "device_type": DEVICE_TYPE, "vendor": v, "nic": "ib"} for v in vendors]}


def parity_command(out: Path, name: str, plan: dict, backend: str, flags: list[str]) -> tuple[list[str], dict, Path]:
    """The torchrun command line, environment and events directory of one parity run."""
    path = out / f"parity_{name}.json"
    path.write_text(json.dumps(plan))
    vendors = [d["vendor"] for d in plan["devices"]]
    records = fresh_events_dir(out / f"parity_{name}.events")
    env = {**os.environ, VENDOR: per_local_rank_value(vendors, VENDOR), EVENTS_DIR: str(records)}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(len(vendors)),
            "pretrain_gpt.py", "--hetero-plan", str(path), "--distributed-backend", backend, *flags, *DATA_FLAGS]
    return argv, env, records


def figures_of(out: Path, name: str, plan: dict, backend: str, flags: list[str]) -> dict[str, list[float]]:
    """Runs one parity job; every loss of its iteration lines (lm loss, MoE's aux losses), by name."""
    argv, env, records = parity_command(out, name, plan, backend, flags)
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    (out / f"parity_{name}.log").write_text(output)
    figures: dict[str, list[float]] = {}
    for event in of_kind(read_events(records), Iteration):
        for loss, value in event.losses.items():
            figures.setdefault(loss, []).append(value)
    if result.returncode != 0 or not figures.get("lm loss"):
        print(output[-3000:])
        raise SystemExit(f"parity run {name} failed (exit {result.returncode})")
    return figures


def losses_of(out: Path, name: str, plan: dict, backend: str) -> list[float]:
    return figures_of(out, name, plan, backend, PARITY_FLAGS)["lm loss"]


def bench_parity(out: Path) -> dict:
    reference = losses_of(out, "one_gpu", parity_plan(1, 1, [4], [8], ["nvidia"]), "nccl")
    results = {"reference": reference}
    for name, plan in [("pipeline_3_1", parity_plan(2, 1, [3, 1], [8], ["nvidia", "amd"])),
                       ("replicas_5_3", parity_plan(1, 2, [4], [5, 3], ["nvidia", "amd"]))]:
        losses = losses_of(out, name, plan, "hetero")
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        results[name] = {"losses": losses, "max_relative_difference": worst, "ok": len(losses) == len(reference)
                         and worst <= 1e-5}
        print(f"parity {name} (hetero backend, 2 vendors on one GPU) vs one GPU (NCCL): "
              f"max relative loss difference {worst:.2e} over {len(losses)} iterations", flush=True)
    return results


# ----- 4. predicted vs measured training --------------------------------------------------

def cluster_of_one():
    from hetero.spec.cluster import Cluster

    node = {"host": "gpu0", "device": DEVICE_TYPE, "count": 1, "intra_link": "nvlink4", "nic": {"kind": "ib", "gbps": 400}}
    return Cluster.from_dict({"name": "one GPU", "groups": [{"name": "local", "nodes": [node]}]})


def model_spec():
    from megatron.hetero.startup import model_spec_of_flags

    return model_spec_of_flags(MODEL_FLAGS + DATA_FLAGS)


def bench_train(out: Path, cases: list[tuple[int, str]] = TRAIN_CASES) -> list[dict]:
    from hetero.predict.costs import CostModel
    from hetero.predict.training_setup import TrainingSetup
    from hetero.predict.memory import DEFAULT_OVERHEAD_GIB
    from hetero.plan import Plan
    from hetero.predict.predictor import predict
    from hetero.spec.profiles import Profiles

    profile_dir = out / "profiles"
    subprocess.run([sys.executable, "-m", "megatron.hetero.profiling.compute", "--device-type", DEVICE_TYPE,
                    "-o", str(profile_dir), "--micro-batch-sizes", *sorted({str(mb) for mb, _ in cases}), "--", *MODEL_FLAGS, *DATA_FLAGS],
                   cwd=REPO, check=True)
    cluster, spec, profiles = cluster_of_one(), model_spec(), Profiles.load_dir(profile_dir)
    rows = []
    print("| micro-batch | recompute | measured s | curve s (error) | profile s (error) | "
          "max allocated GiB | predicted GiB (no context) |\n|---|---|---:|---:|---:|---:|---:|")
    for micro_batch, recompute in cases:
        devices = [{"host": "gpu0", "device_type": DEVICE_TYPE, "vendor": "nvidia", "nic": "ib"}]
        plan = Plan.from_dict({**Plan.uniform(tensor_parallel=1, pipeline_parallel=1, data_parallel=1,
                                              micro_batch_size=micro_batch, num_layers=spec.num_layers,
                                              global_batch_size=GLOBAL_BATCH).to_dict(), "devices": devices})
        path = out / f"plan_mb{micro_batch}_{recompute}.json"
        plan.save(path)
        # Without transformer-engine megatron-core's local layers run: unfused attention.
        setup = TrainingSetup("bf16", distributed_optimizer=False, fused_kernels=False, dropout=False,
                              recompute=recompute)
        by_curve = predict(plan, cluster, CostModel(cluster, spec, setup))
        by_profile = predict(plan, cluster, CostModel(cluster, spec, setup, profiles))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "pretrain_gpt.py", "--hetero-plan", str(path),
                *MODEL_FLAGS, *DATA_FLAGS, *RECOMPUTE_FLAGS[recompute], "--micro-batch-size", str(micro_batch),
                "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(TRAIN_ITERATIONS), "--lr", "1e-4",
                "--log-interval", "1", "--log-memory-interval", str(TRAIN_ITERATIONS), "--eval-iters", "0"]
        records = fresh_events_dir(out / f"train_mb{micro_batch}_{recompute}.events")
        result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600,
                                env={**os.environ, EVENTS_DIR: str(records)})
        output = result.stdout + result.stderr
        (out / f"train_mb{micro_batch}_{recompute}.log").write_text(output)
        if result.returncode != 0:
            print(output[-4000:])
            rows.append({"micro_batch": micro_batch, "recompute": recompute, "failed": result.returncode})
            continue
        recorded = read_events(records)
        times = iteration_times_s(recorded)
        # The last memory record: the peak over every iteration (the first has no Adam state yet).
        allocated = [m.max_allocated_mb for m in of_kind(recorded, Memory) if m.max_allocated_mb is not None]
        measured = statistics.median(times[WARMUP:])
        row = {"micro_batch": micro_batch, "recompute": recompute, "measured_s": measured,
               "spread": (max(times[WARMUP:]) - min(times[WARMUP:])) / measured,
               "curve_s": by_curve.iteration_time_s, "profile_s": by_profile.iteration_time_s,
               "measured_gib": allocated[-1] / 1024 if allocated else None,
               # max allocated counts torch's tensors: the predicted CUDA context and library
               # workspaces (hetero/memory.py) are not in it.
               "predicted_gib": max(by_curve.peak_memory_gib.values()) - DEFAULT_OVERHEAD_GIB}
        rows.append(row)
        memory = f"{row['measured_gib']:.1f}" if allocated else "-"
        print(f"| {micro_batch} | {recompute} | {measured:.3f} | {row['curve_s']:.3f} ({row['curve_s'] / measured - 1:+.1%}) "
              f"| {row['profile_s']:.3f} ({row['profile_s'] / measured - 1:+.1%}) | {memory} | "
              f"{row['predicted_gib']:.1f} |", flush=True)
    return rows


def bench_train_moe(out: Path) -> dict:
    """The Qwen3-30B-A3B-shaped MoE case (bench/gpu_moe.py): measured against the predictor's
    MoE terms (expert GEMMs at their row counts, permutation traffic, per-expert kernel gaps)."""
    from gpu_moe import MOE_WARMUP, moe_train_argv, moe_train_prediction

    plan_path, row = moe_train_prediction(out, DATA_FLAGS, cluster_of_one())
    records = fresh_events_dir(out / "train_qwen3_moe.events")
    result = subprocess.run(moe_train_argv(sys.executable, plan_path, DATA_FLAGS), cwd=REPO, capture_output=True,
                            text=True, timeout=600, env={**os.environ, EVENTS_DIR: str(records)})
    output = result.stdout + result.stderr
    (out / "train_qwen3_moe.log").write_text(output)
    if result.returncode != 0:
        print(output[-4000:])
        return {**row, "failed": result.returncode}
    recorded = read_events(records)
    times = iteration_times_s(recorded)[MOE_WARMUP:]
    allocated = [m.max_allocated_mb for m in of_kind(recorded, Memory) if m.max_allocated_mb is not None]
    row.update(measured_s=statistics.median(times), spread=(max(times) - min(times)) / statistics.median(times),
               measured_gib=allocated[-1] / 1024 if allocated else None)
    print(f"Qwen3-30B-A3B-shaped MoE (4 layers, 16 experts top-8, seq 4096, mbs 1, global batch 4): measured "
          f"{row['measured_s']:.3f} s/iter (spread {row['spread']:.0%}), predicted from the curve "
          f"{row['curve_s']:.3f} ({row['curve_s'] / row['measured_s'] - 1:+.1%}); max allocated "
          f"{row['measured_gib'] or float('nan'):.1f} GiB, predicted {row['predicted_gib']:.1f}", flush=True)
    return row


def train_case(text: str) -> tuple[int, str]:
    """MB:RECOMPUTE of --train-cases, e.g. 4:full."""
    micro_batch, _, recompute = text.partition(":")
    if not micro_batch.isdigit() or int(micro_batch) < 1 or recompute not in RECOMPUTE_FLAGS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MICRO_BATCH:RECOMPUTE with a positive micro-batch "
                                         f"size and recompute one of {sorted(RECOMPUTE_FLAGS)}, e.g. 4:full")
    return int(micro_batch), recompute


SECTIONS = ["gemm", "gemm8", "comm", "parity", "moe", "train-moe", "train"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/gpu_bench")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS,
                        help="sections to run, in this order (default: all; train is the dense cases)")
    parser.add_argument("--train-cases", nargs="+", type=train_case, default=TRAIN_CASES, metavar="MB:RECOMPUTE",
                        help="the train section's runs, e.g. 2:none 4:full (default: "
                        + " ".join(f"{mb}:{mode}" for mb, mode in TRAIN_CASES) + ")")
    parser.add_argument("--comm-worker", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.comm_worker:
        comm_worker()
        return 0
    if not torch.cuda.is_available():
        print("error: no CUDA device visible; this bench runs on a GPU machine", file=sys.stderr)
        return 2
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    # Sections run one invocation at a time (bench/gpu_check.sh) add to the results already there.
    path = out / "gpu_bench.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.update(device=torch.cuda.get_device_name(0), torch=torch.__version__)
    print(f"{results['device']}, torch {results['torch']}")
    steps = {"gemm": bench_gemm, "gemm8": bench_gemm8, "comm": bench_comm, "parity": lambda: bench_parity(out),
             "moe": lambda: bench_moe(out, figures_of, parity_plan), "train-moe": lambda: bench_train_moe(out),
             "train": lambda: bench_train(out, options.train_cases)}
    for name in options.only:
        results[name] = steps[name]()
        # Whole or not at all: the next invocation reads it, and a timeout may stop this one.
        path.with_suffix(".tmp").write_text(json.dumps(results, indent=1))
        os.replace(path.with_suffix(".tmp"), path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
