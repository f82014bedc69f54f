"""Every rank's side of bench/reduction_bench.py: gradient reductions timed on their own.

    torchrun ... bench/reduction_probe.py --cases cases.json --rounds 7 --out times.json

cases.json: {"cases": [{"name": ..., "groups": [[rank, ...], ...], "elements": [n, ...]}]}.
A case's groups run at once, as in one iteration's reduction: every rank issues the all-reduce
of each group it belongs to (float32 buffers of the group's element count), in the case's
order - the one global order the runtime issues its groups in (megatron/hetero/
template_reduction.py) - then waits for all of them. Each round every rank first computes
for a moment, as a gradient reduction follows a backward (the link profiler's rule: a rank
under a CPU quota sends its first message in its next period), then starts the case at
once; a case's time in a round is its slowest rank's. The cases take turns, in one order one
round and the other the next, so a drift of the machine's speed moves them alike. Rank 0
writes every round's time per case.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hetero.io import write_json_atomic
from megatron.hetero.profiling.network import BUSY_BEFORE_SEND_S, keep_busy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/reduction_probe.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", required=True)
    options = parser.parse_args(argv)
    cases = json.loads(Path(options.cases).read_text())["cases"]

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    handles: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for case in cases:  # every rank creates every group, in one order
        for ranks in case["groups"]:
            key = tuple(sorted(ranks))
            if key not in handles:
                handles[key] = dist.new_group(list(key))
    buffers = [[torch.ones(n) if rank in ranks else None for ranks, n in zip(c["groups"], c["elements"])]
               for c in cases]
    times: dict[str, list[float]] = {c["name"]: [] for c in cases}
    for round_ in range(options.rounds + 1):  # one warm-up round
        order = range(len(cases)) if round_ % 2 == 0 else reversed(range(len(cases)))
        for index in order:
            case = cases[index]
            dist.barrier()
            keep_busy(BUSY_BEFORE_SEND_S)
            start = time.perf_counter()
            works = [dist.all_reduce(buffer, group=handles[tuple(sorted(ranks))], async_op=True)
                     for ranks, buffer in zip(case["groups"], buffers[index]) if buffer is not None]
            for work in works:
                work.wait()
            elapsed = time.perf_counter() - start
            slowest = [None] * dist.get_world_size()
            dist.all_gather_object(slowest, elapsed)
            if round_:
                times[case["name"]].append(max(slowest))
    if rank == 0:
        write_json_atomic(Path(options.out), {"rounds_s": times})
        print(f"wrote {options.out}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
