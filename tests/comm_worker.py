"""One rank of the hetero backend's multi-process checks (started by tests/test_comm.py).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p HETERO_VENDOR=v \\
        python tests/comm_worker.py SCENARIO OUT_DIR

Every check runs an operation on a ``hetero`` group and on a plain gloo group over the
same ranks with the same inputs, and compares. Inputs are generated from (case, rank), so
every rank can also rebuild the others' inputs (for tolerance bounds and p2p checks).
The rank writes OUT_DIR/rank<r>.json: number of checks, failures, per-group modes.

Comparisons are exact (torch.equal) except for SUM over random floats: the hierarchy adds
each vendor's partial sums first, a different association than gloo's, so the results
may differ by rounding. Those are checked against the bound world * eps * sum_r |x_r|
(each of at most world-1 additions rounds by eps/2 of a partial sum no larger than
sum_r |x_r|, in either order). Integer-valued inputs make every SUM/AVG exact, products
of +-1/2, +-1, +-2 are exact, MAX/MIN are exact, so all of those are compared exactly.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

import hetero_comm

warnings.filterwarnings("ignore")  # torch's deprecation notices for the old collective names

Op = dist.ReduceOp
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (1031,)]  # 1031: odd, several chunks at 1 KiB
BLOCKS = [(0,), (1,), (7,), (3, 5), (257,)]  # per-rank blocks of allgather/reduce-scatter


class Checker:
    def __init__(self) -> None:
        self.cases = 0
        self.failures: list[str] = []
        self.seed = 0
        self.group = ""

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed * 7919

    def start_group(self, name: str) -> None:
        self.group = name
        self.seed = 0  # the same seeds on every member, whatever else each rank ran before

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.cases += 1
        if not ok and len(self.failures) < 50:
            self.failures.append(f"[{self.group}] {name}: {detail}"[:800])

    def same(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        self.check(name, ok, f"got {got.flatten()[:8].tolist()} want {want.flatten()[:8].tolist()}")

    def raises(self, name: str, fragment: str, call) -> None:
        try:
            call()
        except Exception as err:  # noqa: BLE001 - any error type is fine, the message matters
            self.check(name, fragment in str(err), f"message {str(err)[:300]!r} lacks {fragment!r}")
            return
        self.check(name, False, "no error")


def make(seed: int, shape, dtype, kind: str = "int") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "int":
        return torch.randint(-8, 9, shape, generator=g).to(dtype)
    if kind == "prod":
        values = torch.tensor([-2.0, -1.0, 1.0, 2.0] if not dtype.is_floating_point else
                              [-2.0, -1.0, -0.5, 0.5, 1.0, 2.0])
        return values[torch.randint(0, len(values), shape, generator=g)].to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def kind_for(op) -> str:
    return "prod" if op == Op.PRODUCT else "int"


def reference_reduce(x: torch.Tensor, op, ref, dst: int | None = None) -> torch.Tensor:
    """gloo's result; AVG as gloo's SUM then a division by the group size."""
    y = x.clone()
    reduce_op = Op.SUM if op == Op.AVG else op
    if dst is None:
        dist.all_reduce(y, op=reduce_op, group=ref)
    else:
        dist.reduce(y, dst=dst, op=reduce_op, group=ref)
    if op == Op.AVG:
        y.div_(ref.size())
    return y


def ops_for(dtype) -> list:
    ops = [Op.SUM, Op.MAX, Op.MIN, Op.PRODUCT]
    return ops + [Op.AVG] if dtype.is_floating_point else ops


def check_allreduce(c: Checker, het, ref, dtypes, shapes) -> None:
    me, n = het.rank(), het.size()
    for dtype in dtypes:
        for shape in shapes:
            for op in ops_for(dtype):
                x = make(c.next_seed() + me, shape, dtype, kind_for(op))
                got = x.clone()
                dist.all_reduce(got, op=op, group=het)
                c.same(f"all_reduce {op} {dtype} {shape}", got, reference_reduce(x, op, ref))
                if op == Op.AVG:  # gloo's own AVG is that SUM and division too
                    gloo_avg = x.clone()
                    dist.all_reduce(gloo_avg, op=Op.AVG, group=ref)
                    c.same(f"all_reduce AVG as gloo's {dtype} {shape}", got, gloo_avg)
            if dtype.is_floating_point:  # random floats: rounding of another association
                seed = c.next_seed()
                xs = [make(seed + r, shape, dtype, "normal") for r in range(n)]
                got, want = xs[me].clone(), xs[me].clone()
                dist.all_reduce(got, group=het)
                dist.all_reduce(want, group=ref)
                eps = torch.finfo(dtype).eps
                bound = n * eps * sum(x.double().abs() for x in xs) + 1e-30
                diff = (got.double() - want.double()).abs()
                c.check(f"all_reduce SUM random {dtype} {shape}", bool((diff <= bound).all()),
                        f"max diff {diff.max() if diff.numel() else 0}")


def check_broadcast_reduce(c: Checker, het, ref, dtypes, shapes) -> None:
    me, n = het.rank(), het.size()
    for dtype in dtypes:
        for shape in shapes:
            for root in range(n):
                x = make(c.next_seed() + me, shape, dtype)
                got, want = x.clone(), x.clone()
                dist.broadcast(got, group_src=root, group=het)
                dist.broadcast(want, group_src=root, group=ref)
                c.same(f"broadcast root {root} {dtype} {shape}", got, want)
            for root in range(n):
                op = ops_for(dtype)[root % len(ops_for(dtype))]
                x = make(c.next_seed() + me, shape, dtype, kind_for(op))
                got = x.clone()
                dist.reduce(got, group_dst=root, op=op, group=het)
                want = reference_reduce(x, op, ref, dst=dist.get_global_rank(ref, root))
                if me == root:  # other ranks' buffers are scratch space (also in gloo)
                    c.same(f"reduce {op} root {root} {dtype} {shape}", got, want)


def check_allgather_reduce_scatter(c: Checker, het, ref, dtypes, blocks) -> None:
    me, n = het.rank(), het.size()
    for dtype in dtypes:
        for block in blocks:
            x = make(c.next_seed() + me, block, dtype)
            stacked = (n * block[0], *block[1:])  # gloo's layout: blocks along dim 0
            got, want = torch.empty(stacked, dtype=dtype), torch.empty(stacked, dtype=dtype)
            dist.all_gather_into_tensor(got, x, group=het)
            dist.all_gather_into_tensor(want, x, group=ref)
            c.same(f"all_gather_into_tensor {dtype} {block}", got, want)
            got_list = [torch.full(block, 99).to(dtype) for _ in range(n)]
            dist.all_gather(got_list, x, group=het)
            c.same(f"all_gather {dtype} {block}", torch.cat(got_list), want)
            for op in ops_for(dtype):
                x = make(c.next_seed() + me, (n, *block), dtype, kind_for(op))
                got = torch.empty(block, dtype=dtype)
                dist.reduce_scatter_tensor(got, x.reshape(stacked), op=op, group=het)
                want = reference_reduce(x, op, ref)[me]
                c.same(f"reduce_scatter_tensor {op} {dtype} {block}", got, want)
                if op in (Op.SUM, Op.AVG):
                    got = torch.empty(block, dtype=dtype)
                    dist.reduce_scatter(got, list(x.unbind(0)), op=op, group=het)
                    c.same(f"reduce_scatter {op} {dtype} {block}", got, want)


def check_coalesced(c: Checker, het, ref, mode: str) -> None:
    """The bucketed calls of Megatron's DDP and distributed optimizer."""
    me, n = het.rank(), het.size()
    devices = [None] if mode == "native" else [None, torch.device("cpu")]
    for device in devices:
        for dtype in (torch.float32, torch.bfloat16):
            xs = [make(c.next_seed() + me, shape, dtype) for shape in [(5,), (1031,), (0,), (2, 3)]]
            got = [x.clone() for x in xs]
            with dist._coalescing_manager(het, device=device, async_ops=True) as cm:
                for t in got:
                    dist.all_reduce(t, group=het)
            cm.wait()
            for i, x in enumerate(xs):
                c.same(f"coalesced all_reduce {device} {dtype} {i}", got[i], reference_reduce(x, Op.SUM, ref))
            blocks = [(3,), (513,)]
            ins = [make(c.next_seed() + me, b, dtype) for b in blocks]
            outs = [torch.empty(n * b[0], dtype=dtype) for b in blocks]
            with dist._coalescing_manager(het, device=device, async_ops=True) as cm:
                for o, i in zip(outs, ins):
                    dist.all_gather_into_tensor(o, i, group=het)
            cm.wait()
            for k, (o, i) in enumerate(zip(outs, ins)):
                want = torch.empty_like(o)
                dist.all_gather_into_tensor(want, i, group=ref)
                c.same(f"coalesced all_gather_into_tensor {device} {dtype} {k}", o, want)
            ins = [make(c.next_seed() + me, (n, *b), dtype) for b in blocks]
            outs = [torch.empty(b, dtype=dtype) for b in blocks]
            with dist._coalescing_manager(het, device=device, async_ops=True) as cm:
                for o, i in zip(outs, ins):
                    dist.reduce_scatter_tensor(o, i.flatten(), group=het)
            cm.wait()
            for k, (o, i) in enumerate(zip(outs, ins)):
                c.same(f"coalesced reduce_scatter_tensor {device} {dtype} {k}", o,
                       reference_reduce(i, Op.SUM, ref)[me])


def check_alltoall_gather_scatter(c: Checker, het, ref, dtypes, mode: str) -> None:
    me, n = het.rank(), het.size()
    for dtype in dtypes:
        in_splits = [(me + 2 * j) % 4 for j in range(n)]
        out_splits = [(j + 2 * me) % 4 for j in range(n)]
        x = make(c.next_seed() + me, (sum(in_splits), 3), dtype)
        got = torch.empty((sum(out_splits), 3), dtype=dtype)
        want = torch.empty_like(got)
        dist.all_to_all_single(got, x, out_splits, in_splits, group=het)
        dist.all_to_all_single(want, x, out_splits, in_splits, group=ref)
        c.same(f"all_to_all_single uneven {dtype}", got, want)
        ins = [make(c.next_seed() + me, (2, 3), dtype) for j in range(n)]
        got = [torch.empty((2, 3), dtype=dtype) for _ in range(n)]
        want = [torch.empty((2, 3), dtype=dtype) for _ in range(n)]
        dist.all_to_all(got, ins, group=het)
        dist.all_to_all(want, ins, group=ref)
        c.same(f"all_to_all {dtype}", torch.cat(got), torch.cat(want))
        # Blocks of different sizes (NCCL allows them, gloo's list version does not):
        # rank src sends make(seeds[dst] + src, (dst + 1,)) to rank dst.
        if mode == "hierarchical":  # the others are gloo's own alltoall
            seeds = [c.next_seed() for _ in range(n)]
            ins = [make(seeds[dst] + me, (dst + 1,), dtype) for dst in range(n)]
            got = [torch.empty(me + 1, dtype=dtype) for _ in range(n)]
            dist.all_to_all(got, ins, group=het)
            want = [make(seeds[me] + src, (me + 1,), dtype) for src in range(n)]
            c.same(f"all_to_all uneven {dtype}", torch.cat(got), torch.cat(want))
        for root in {0, n - 1}:
            x = make(c.next_seed() + me, (4,), dtype)
            got = [torch.empty(4, dtype=dtype) for _ in range(n)] if me == root else None
            want = [torch.empty(4, dtype=dtype) for _ in range(n)] if me == root else None
            dist.gather(x, got, group_dst=root, group=het)
            dist.gather(x, want, group_dst=root, group=ref)
            if me == root:
                c.same(f"gather root {root} {dtype}", torch.stack(got), torch.stack(want))
            pieces = [make(c.next_seed() + j, (5,), dtype) for j in range(n)]
            got, want = torch.empty(5, dtype=dtype), torch.empty(5, dtype=dtype)
            dist.scatter(got, pieces if me == root else None, group_src=root, group=het)
            dist.scatter(want, pieces if me == root else None, group_src=root, group=ref)
            c.same(f"scatter root {root} {dtype}", got, want)


def check_p2p(c: Checker, het) -> None:
    """Rings both ways through batch_isend_irecv, and plain send/recv from every rank."""
    me, n = het.rank(), het.size()
    for dtype in DTYPES:
        for shape in [(1,), (1031,)]:
            seed = c.next_seed()
            nxt, prv = (me + 1) % n, (me - 1) % n
            a, b = make(seed + me, shape, dtype), make(seed + 100 + me, shape, dtype)
            from_prev, from_next = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
            ops = [dist.P2POp(dist.isend, a, group_peer=nxt, group=het),
                   dist.P2POp(dist.irecv, from_prev, group_peer=prv, group=het),
                   dist.P2POp(dist.irecv, from_next, group_peer=nxt, group=het),
                   dist.P2POp(dist.isend, b, group_peer=prv, group=het)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            c.same(f"ring from previous {dtype} {shape}", from_prev, make(seed + prv, shape, dtype))
            c.same(f"ring from next {dtype} {shape}", from_next, make(seed + 100 + nxt, shape, dtype))
    seed = c.next_seed()
    for src in range(n):
        if me == src:
            works = [dist.isend(make(seed + src * n + dst, (9,), torch.float32), group_dst=dst,
                                group=het, tag=dst) for dst in range(n) if dst != src]
            for work in works:
                work.wait()
        else:
            got = torch.empty(9)
            dist.recv(got, group_src=src, group=het, tag=me)
            c.same(f"send {src}->{me}", got, make(seed + src * n + me, (9,), torch.float32))
    dist.barrier(group=het)


def check_async_and_layouts(c: Checker, het, ref, mode: str) -> None:
    me = het.rank()
    x = make(c.next_seed() + me, (1031,), torch.float32)
    got = x.clone()
    work = dist.all_reduce(got, group=het, async_op=True)
    result = work.get_future().wait()
    work.wait()
    want = reference_reduce(x, Op.SUM, ref)
    c.same("future value", result[0], want)
    c.same("async all_reduce", got, want)
    if mode != "hierarchical":
        return  # gloo itself (native, pass-through) does not reduce non-contiguous views
    base = make(c.next_seed() + me, (6, 8), torch.float32)
    want = reference_reduce(base[:, ::2].contiguous(), Op.SUM, ref)
    # A leaf that requires grad, as megatron-core's p2p receive buffers are: the backend
    # writes its memory the way the native libraries do, invisible to autograd.
    base.requires_grad_(True)
    strided = base[:, ::2]
    dist.all_reduce(strided, group=het)
    c.same("all_reduce non-contiguous", strided.detach(), want)
    seed = c.next_seed()
    y = make(seed + me, (4, 6), torch.float32).t()
    dist.broadcast(y, group_src=het.size() - 1, group=het)
    c.same("broadcast non-contiguous", y, make(seed + het.size() - 1, (4, 6), torch.float32).t())


def check_errors(c: Checker, het) -> None:
    """Unsupported operations fail on the calling thread, before anything is sent."""
    t = torch.zeros(3)
    c.raises("recv from any source", "hetero backend: recv from any source", lambda: dist.recv(t, group=het))
    c.raises("AVG on int64", "ReduceOp.AVG is not supported on Long",
             lambda: dist.all_reduce(torch.ones(3, dtype=torch.int64), op=Op.AVG, group=het))
    c.raises("PREMUL_SUM", "PREMUL_SUM is not supported",
             lambda: dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0), group=het))
    c.raises("all_gather_coalesced", "hetero backend: allgather_coalesced",
             lambda: dist.all_gather_coalesced([[torch.zeros(3) for _ in range(het.size())]], [t], group=het))


# How much of the dtype x shape grid each group runs: all of it on the world of the first
# scenario, every dtype but fewer shapes on the second (6 processes, small chunks: slower),
# a sample on subgroups.
COVERAGE = {
    "full": (DTYPES, SHAPES, BLOCKS),
    "dtypes": (DTYPES, [(0,), (7,), (1031,)], [(0,), (3, 5), (257,)]),
    "sample": ([torch.float32, torch.bfloat16], [(7,), (1031,)], [(1,), (257,)]),
}


def check_group(c: Checker, name: str, het, ref, coverage: str) -> dict:
    c.start_group(name)
    mode = hetero_comm.describe(het)["mode"]
    dtypes, shapes, blocks = COVERAGE[coverage]
    seconds = {}
    for check, args in [
        (check_allreduce, (dtypes, shapes)),
        (check_broadcast_reduce, (dtypes, shapes)),
        (check_allgather_reduce_scatter, (dtypes, blocks)),
        (check_coalesced, (mode,)),
        (check_alltoall_gather_scatter, (dtypes, mode)),
        (check_async_and_layouts, (mode,)),
    ]:
        start = time.monotonic()
        check(c, het, ref, *args)
        seconds[check.__name__] = round(time.monotonic() - start, 2)
    check_p2p(c, het)
    if mode == "hierarchical":
        check_errors(c, het)
    return {"name": name, "mode": mode, "vendors": hetero_comm.describe(het)["vendors"],
            "seconds": seconds}


def check_large(c: Checker, het, ref) -> None:
    """Several chunks at the default chunk size (4 MiB)."""
    me = het.rank()
    x = make(c.next_seed() + me, (1_500_001,), torch.float32)
    got = x.clone()
    dist.all_reduce(got, group=het)
    c.same("all_reduce 6 MB", got, reference_reduce(x, Op.SUM, ref))
    got = torch.empty(het.size() * 600_001)
    y = make(c.next_seed() + me, (600_001,), torch.float32)
    dist.all_gather_into_tensor(got, y, group=het)
    want = torch.empty_like(got)
    dist.all_gather_into_tensor(want, y, group=ref)
    c.same("all_gather_into_tensor 2.4 MB x world", got, want)


# Subgroups of each scenario (global ranks), created on every rank in this order.
SUBGROUPS = {
    "two_vendors": [[0, 1, 2], [1, 3], [3, 0]],
    "three_vendors": [[1, 2, 3, 5], [0, 3], [0, 2, 5]],
}


def main(scenario: str, out_dir: str) -> None:
    start = time.monotonic()
    rank = int(os.environ["RANK"])
    dist.init_process_group(backend="hetero")
    world_ref = dist.new_group(backend="gloo")
    c = Checker()
    coverage = "full" if scenario == "two_vendors" else "dtypes"
    groups = [check_group(c, "world", dist.group.WORLD, world_ref, coverage)]
    if scenario == "two_vendors":
        check_large(c, dist.group.WORLD, world_ref)
    for ranks in SUBGROUPS[scenario]:
        het, ref = dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            groups.append(check_group(c, f"subgroup {ranks}", het, ref, "sample"))
    dist.barrier()
    result = {"rank": rank, "cases": c.cases, "failures": c.failures, "groups": groups,
              "seconds": round(time.monotonic() - start, 2)}
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # do not wait for peers in atexit handlers
