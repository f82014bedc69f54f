"""Link profile between the hosts of a job, in the predictor's format.

    torchrun ... -m megatron.hetero.profiling.network -o profiles/          # on a real cluster
    python -m tools.emulator --cluster C.yaml -- -m megatron.hetero.profiling.network -o profiles/

For every pair of hosts (and every host with itself, when it runs two ranks or more) the
ranks of the two hosts pair up and ping-pong at once - the NIC shared as in training - to
time one device pair's bandwidth (large messages) and latency (small messages). Then an
all-reduce over every rank is timed at a few sizes. Rank 0 writes links.json.
A rank's host is --host (the node's name in the cluster spec: `hetero-plan profile --slurm`
passes each node's Slurm name, which a host name such as node0.example.org is not), else
HETERO_EMULATED_HOST (set by the emulator), else its hostname.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hetero import env
from hetero.io import write_json_atomic
from hetero.spec.profiles import LinkProfile


def _ping_pong(peer: int, first: bool, tensor: torch.Tensor, rounds: int) -> float:
    """Median one-way time of a small `tensor` between this rank and peer."""
    times = []
    for _ in range(rounds + 1):  # one warm-up round
        start = time.perf_counter()
        if first:
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        else:
            dist.recv(tensor, peer)
            dist.send(tensor, peer)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[1:])


def _stream(peer: int, sender: bool, tensor: torch.Tensor, count: int) -> float:
    """Bytes/s of `count` messages sent one way (every pair at once shares the NIC as
    training does), acknowledged by a one-element reply so the sender sees the end."""
    ack = torch.zeros(1)
    start = time.perf_counter()
    for _ in range(count):
        dist.send(tensor, peer) if sender else dist.recv(tensor, peer)
    dist.recv(ack, peer) if sender else dist.send(ack, peer)
    return count * tensor.numel() * tensor.element_size() / (time.perf_counter() - start)


def _pairs(ranks_a: list[int], ranks_b: list[int]) -> list[tuple[int, int]]:
    if ranks_a is ranks_b:  # inside one host: disjoint pairs (0,1), (2,3), ...
        return list(zip(ranks_a[0::2], ranks_a[1::2]))
    return list(zip(ranks_a, ranks_b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.hetero.profiling.network",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output-dir", required=True)
    parser.add_argument("--message-mib", type=float, default=8.0, help="bandwidth message size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--allreduce-mib", type=float, nargs="+", default=[1.0, 16.0])
    parser.add_argument("--host", default=None,
                        help="this node's name in the cluster spec (default: HETERO_EMULATED_HOST, else the "
                             "host name)")
    options = parser.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = options.host or env.host()
    hosts: list = [None] * world
    dist.all_gather_object(hosts, host)
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    names = list(by_host)
    combos = [(a, a) for a in names if len(by_host[a]) >= 2] + list(itertools.combinations(names, 2))
    big = torch.zeros(int(options.message_mib * 2**20) // 4)
    small = torch.zeros(1)
    links = []
    for number, (a, b) in enumerate(combos, 1):
        pairs = _pairs(by_host[a], by_host[a] if a == b else by_host[b])
        mine = next(((x, y) for x, y in pairs if rank in (x, y)), None)
        measured = None
        dist.barrier()
        if mine:
            peer = mine[1] if rank == mine[0] else mine[0]
            latency = _ping_pong(peer, rank == mine[0], small, options.rounds * 4)
            _stream(peer, rank == mine[0], big, 1)  # warm-up
        dist.barrier()  # every pair starts streaming together
        if mine:
            measured = (_stream(peer, rank == mine[0], big, options.rounds), latency)
        results: list = [None] * world
        dist.all_gather_object(results, measured)
        per_pair = [results[x] for x, _ in pairs]
        bandwidth = statistics.median(m[0] for m in per_pair)
        latency = statistics.median(m[1] for m in per_pair)
        links.append({"hosts": [a, b], "bandwidth_gbs": bandwidth / 1e9, "latency_us": latency * 1e6})
        if rank == 0:
            print(f"[links {number}/{len(combos)}] {a} <-> {b}: {len(pairs)} pair(s) at once, "
                  f"{bandwidth / 1e6:.1f} MB/s per pair, latency {latency * 1e6:.0f} us", flush=True)
    collectives = []
    for mib in options.allreduce_mib:
        tensor = torch.ones(int(mib * 2**20) // 4)
        times = []
        for _ in range(options.rounds + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
        collectives.append({"op": "allreduce", "hosts": hosts, "bytes": tensor.numel() * 4, "seconds": seconds})
        if rank == 0:
            print(f"[allreduce] {world} ranks, {mib:g} MiB: {seconds * 1e3:.1f} ms "
                  f"(bus bandwidth {2 * (world - 1) / world * tensor.numel() * 4 / seconds / 1e6:.1f} MB/s)",
                  flush=True)
    if rank == 0:
        profile = {"kind": "links", "links": links, "collectives": collectives,
                   "measured_on": f"{world} ranks on {len(names)} hosts, {time.strftime('%Y-%m-%d %H:%M')}"}
        LinkProfile.model_validate(profile)
        path = Path(options.output_dir) / "links.json"
        write_json_atomic(path, profile)
        print(f"wrote {path}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
