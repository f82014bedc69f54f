"""Link profile between the hosts of a job, in the predictor's format.

    torchrun ... -m megatron.hetero.profiling.network -o profiles/          # on a real cluster
    python -m tools.emulator --cluster C.yaml -- -m megatron.hetero.profiling.network -o profiles/

For every pair of hosts (and every host with itself, when it runs two ranks or more) the
ranks of the two hosts pair up and exchange messages at once - the NIC shared as in training - to
time one device pair's bandwidth (large messages) and latency (a small message each way
at once, right after computing, as pipeline stages exchange them). Then an all-reduce over
every rank is timed at a few sizes, in turns, each right after computing as a gradient
reduction starts. Rank 0 writes links.json.
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


# A pipeline stage computes, then sends its output and receives its next input; so does its
# neighbour. Timed so - both ranks computing, then one message each way at once - a message
# between cpu_demo.yaml's emulated devices took 4-8 ms, where a ping-pong between idle ranks
# took 0.1-0.5 ms: a rank under a CPU quota has used its share of the quota's period when it
# sends, and the exchange waits for the next. Where no quota throttles the host, the compute
# changes nothing.
BUSY_BEFORE_SEND_S = 0.02


def keep_busy(seconds: float) -> None:
    """Keep this rank's processor busy, as a stage's forward or backward does."""
    work = torch.ones(128, 128)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work @ work


def _latency(peer: int, tensor: torch.Tensor, rounds: int) -> float:
    """Median time of one small message between this rank and peer, as pipeline stages
    exchange them: each round both compute for BUSY_BEFORE_SEND_S, then send one to the other
    and receive the other's at once."""
    inbox = torch.empty_like(tensor)
    times = []
    for _ in range(rounds + 1):  # one warm-up round
        keep_busy(BUSY_BEFORE_SEND_S)
        start = time.perf_counter()
        for work in (dist.isend(tensor, peer), dist.irecv(inbox, peer)):
            work.wait()
        times.append(time.perf_counter() - start)
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


def _allreduce_times(sizes_mib: list[float], rounds: int) -> dict[float, float]:
    """Median seconds of an all-reduce over every rank at each size, timed as a gradient
    reduction meets it: every rank computes for BUSY_BEFORE_SEND_S, then all-reduce (the
    first message of a rank under a CPU quota waits for its next period, as in training).
    The sizes take turns, in one order one round and the other the next, so that a drift of
    the machine's speed moves them alike: timed size after size (and after idle ranks), one
    busy minute during the 1 MiB all-reduces of an emulated cluster made them take 59 ms
    where 10-12 ms was usual, and the fit through the sizes charged every reduction 50 ms."""
    tensors = {mib: torch.ones(int(mib * 2**20) // 4) for mib in sizes_mib}
    times: dict[float, list[float]] = {mib: [] for mib in sizes_mib}
    for repeat in range(rounds + 1):  # one warm-up round
        for mib in sizes_mib if repeat % 2 == 0 else reversed(sizes_mib):
            dist.barrier()
            keep_busy(BUSY_BEFORE_SEND_S)
            start = time.perf_counter()
            dist.all_reduce(tensors[mib])
            if repeat:
                times[mib].append(time.perf_counter() - start)
    return {mib: statistics.median(t) for mib, t in times.items()}


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
    parser.add_argument("--allreduce-mib", type=float, nargs="+", default=[1.0, 4.0, 16.0])
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
            latency = _latency(peer, small, options.rounds * 4)
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
    for mib, seconds in _allreduce_times(options.allreduce_mib, options.rounds * 3).items():
        size = int(mib * 2**20) // 4 * 4
        collectives.append({"op": "allreduce", "hosts": hosts, "bytes": size, "seconds": seconds})
        if rank == 0:
            print(f"[allreduce] {world} ranks, {mib:g} MiB: {seconds * 1e3:.1f} ms "
                  f"(bus bandwidth {2 * (world - 1) / world * size / seconds / 1e6:.1f} MB/s)", flush=True)
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
