"""Run a test function on a few fresh gloo ranks (spawned, not forked: a fork of the test
process, whose OpenMP threads already ran, can hang in them) and collect their verdicts."""

from __future__ import annotations

import multiprocessing
import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_on_ranks(target, world: int, *args, timeout: float = 120) -> dict[int, str]:
    """target(rank, world, port, *args, results) on `world` spawned processes; each puts
    (rank, "ok" or what went wrong) on results. Returns {rank: outcome}."""
    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), free_port()
    ranks = [context.Process(target=target, args=(rank, world, port, *args, results)) for rank in range(world)]
    for process in ranks:
        process.start()
    outcomes = dict(results.get(timeout=timeout) for _ in ranks)
    for process in ranks:
        process.join(timeout=30)
    return outcomes
