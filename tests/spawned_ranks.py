"""Run a test function on a few fresh gloo ranks (spawned, not forked: a fork of the test
process, whose OpenMP threads already ran, can hang in them), with megatron-hetero's
patches applied, and collect their verdicts."""

from __future__ import annotations

import multiprocessing

from hetero.env import unused_port


def _rank_main(target, rank: int, world: int, port: int, args: tuple, results) -> None:
    """One rank's life: the process group, the patches, target(rank, world, *args), and
    (rank, "ok" or what went wrong) on results for the parent to report."""
    import os

    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from megatron.hetero.patches import apply_patches

        apply_patches()
        target(rank, world, *args)
        results.put((rank, "ok"))
    except BaseException as err:
        results.put((rank, repr(err)))
    finally:
        torch.distributed.destroy_process_group()


def run_on_ranks(target, world: int, *args, timeout: float = 120) -> dict[int, str]:
    """target(rank, world, *args) on `world` spawned gloo ranks. Returns {rank: "ok" or
    what went wrong}."""
    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), unused_port()
    ranks = [context.Process(target=_rank_main, args=(target, rank, world, port, args, results))
             for rank in range(world)]
    for process in ranks:
        process.start()
    outcomes = dict(results.get(timeout=timeout) for _ in ranks)
    for process in ranks:
        process.join(timeout=30)
    return outcomes
