"""The hetero communication backend (hetero_comm, csrc/) measured on an emulated cluster.

    sudo python bench/comm_bench.py                # ~3 min; needs root for the shaped link

Cluster: examples/clusters/emu_vendors.yaml - 2 NVIDIA-labelled ranks on one node, 2
AMD-labelled on another, the node link (the bridge between vendors) shaped to
--bridge-mbit, inside a node the loopback. Printed, measured side by side in one run:

- cross-vendor all-reduce over all 4 ranks: the hetero backend (inside each vendor, then
  the bridge between vendor leaders, chunked and pipelined) vs a flat gloo all-reduce;
  bus bandwidth, and the hierarchical path's algorithm bandwidth (bytes / time) as a
  share of the bridge link's measured bandwidth (target >= 90%);
- same-vendor pass-through: a 2-rank one-vendor group on the C++ pass-through backend
  (HETERO_COMM_WRAP_SINGLE_VENDOR=1) vs the native gloo group (target overhead <= 2%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SIZES_MIB = (1, 4, 16, 64)


def _timed(fn, rounds: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(rounds + 1):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def worker(rounds: int, out: str) -> None:
    """One rank: runs inside the emulated cluster."""
    import torch
    import torch.distributed as dist

    import hetero_comm  # noqa: F401  (registers the backend)
    from hetero.env import COMM_WRAP_SINGLE_VENDOR

    dist.init_process_group("hetero")
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = dist.new_group(backend="gloo")
    nv = [0, 1]
    native_pair = dist.new_group(nv, backend="gloo")
    os.environ[COMM_WRAP_SINGLE_VENDOR] = "1"
    wrapped_pair = dist.new_group(nv, backend="hetero")
    rows = []
    # The bridge itself: rank 0 streams to rank 2 (one flow, nothing else running).
    probe = torch.zeros(16 * 2**20 // 4)
    if rank in (0, 2):
        peer = 2 - rank
        seconds = _timed_pair(lambda: dist.send(probe, peer, group=flat) if rank == 0 else dist.recv(probe, peer, group=flat), rounds)
    else:
        seconds = 0.0
    dist.barrier()
    link = [None] * world
    dist.all_gather_object(link, seconds)
    bridge_bytes_per_s = probe.numel() * 4 / link[2]  # the receiver sees the whole transfer
    for mib in SIZES_MIB:
        tensor = torch.ones(int(mib * 2**20) // 4)
        hetero_s = _timed(lambda: dist.all_reduce(tensor), rounds)
        flat_s = _timed(lambda: dist.all_reduce(tensor, group=flat), rounds)
        native_s = wrapped_s = 0.0
        if rank in nv:  # interleaved, many rounds: the two differ by little, noise by more
            native, wrapped = [], []
            for _ in range(3 * rounds):
                native.append(_timed_pair(lambda: dist.all_reduce(tensor, group=native_pair), 1))
                wrapped.append(_timed_pair(lambda: dist.all_reduce(tensor, group=wrapped_pair), 1))
            native_s, wrapped_s = statistics.median(native), statistics.median(wrapped)
        dist.barrier()
        pair = [None] * world
        dist.all_gather_object(pair, (native_s, wrapped_s))
        rows.append({"mib": mib, "bytes": tensor.numel() * 4, "hetero_s": hetero_s, "flat_gloo_s": flat_s,
                     "native_pair_s": pair[0][0], "passthrough_pair_s": pair[0][1]})
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, "bridge_bytes_per_s": bridge_bytes_per_s, "rows": rows}))
    dist.destroy_process_group()


def _timed_pair(fn, rounds: int) -> float:
    """Like _timed, for ops only some ranks join (no barrier over everyone)."""
    times = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def report(result: dict, bridge_mbit: float) -> str:
    world, link = result["world"], result["bridge_bytes_per_s"]
    bus = 2 * (world - 1) / world
    lines = [f"bridge link: set {bridge_mbit:.0f} Mbit/s, measured {link / 1e6:.1f} MB/s (one gloo stream)", "",
             "| size | hetero s | flat gloo s | hetero busbw MB/s | flat busbw MB/s | hetero/flat | "
             "hetero algbw / bridge | pass-through s | native s | pass-through overhead |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        size = r["bytes"]
        overhead = r["passthrough_pair_s"] / r["native_pair_s"] - 1
        lines.append(
            f"| {r['mib']} MiB | {r['hetero_s']:.4f} | {r['flat_gloo_s']:.4f} | {bus * size / r['hetero_s'] / 1e6:.1f} | "
            f"{bus * size / r['flat_gloo_s'] / 1e6:.1f} | {r['flat_gloo_s'] / r['hetero_s']:.2f}x | "
            f"{size / r['hetero_s'] / link:.1%} | {r['passthrough_pair_s']:.4f} | {r['native_pair_s']:.4f} | {overhead:+.1%} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bridge-mbit", type=float, default=400.0)
    parser.add_argument("--out", default=str(REPO / "runs" / "bench-comm"))
    options = parser.parse_args()
    if options.worker:
        worker(options.rounds, options.out)
        return 0
    from hetero.spec.cluster import Cluster
    from tools.emulator import EmulatedCluster, RankLayout, stop_on_termination_signals

    stop_on_termination_signals()  # a killed bench still removes its emulated cluster
    missing = EmulatedCluster.missing_prerequisites()
    if missing:
        print("comm bench skipped: " + "; ".join(missing), file=sys.stderr)
        return 2
    cluster = Cluster.load(REPO / "examples" / "clusters" / "emu_vendors.yaml")
    gbps = max(n.nic.gbps for n in cluster.nodes)
    # Every rank may use half a core: 4 ranks fill the machine's 2 cores, no more.
    emulated = EmulatedCluster(cluster, RankLayout.of_cluster(cluster), compute_scale=0.5,
                               net_scale=options.bridge_mbit / (gbps * 1000))
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    print(emulated.describe(), flush=True)
    with emulated:
        job = emulated.run([str(Path(__file__).resolve()), "--worker", "--rounds", str(options.rounds),
                            "--out", str(out / "results.json")], echo=False, timeout=900)
    if job.returncode != 0:
        print(job.output[-4000:], file=sys.stderr)
        return job.returncode
    text = report(json.loads((out / "results.json").read_text()), options.bridge_mbit)
    (out / "report.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
