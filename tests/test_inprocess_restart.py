"""In-process restart (--inprocess-restart): a lost node costs the survivors no restart and
no work since the last snapshot.

The pieces without processes: which piece of which snapshot fills which part of a new
layout's tensors, the generations a store keeps, the supervisor's rank mapping. Then on the
emulated cpu_demo cluster (a fast node and a slow node in network namespaces): the slow
node is killed between snapshots; the fast node's processes carry on under a re-plan,
with the state from their snapshots (no checkpoint file read), and train what a run resumed
from the same iteration's checkpoint under the new plan trains. On a three-node cluster,
two nodes lost together take a shard and its only copy: the job says so and carries on
from the last disk checkpoint, in the same processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import GPT_MODEL, REPO, TRAINING, run_pretrain
from hetero.env import unused_port
from hetero.events import CheckpointLoaded, StateRestored, losses, of_kind, read_events
from hetero.launch.inprocess import Rejoin, finished, place, places, ready, report_finished, report_ready
from hetero.launch.recovery import new_ranks
from hetero.plan import Plan
from megatron.hetero.snapshots import (Box, LostState, Snapshot, SnapshotStore, flat_range_boxes, own_shard_pieces,
                                      plan_transfers)
from spawned_ranks import run_on_ranks
from test_elastic import CLUSTER, _plan, assert_nothing_left, kill_node, supervise
from tools.emulator import EmulatedCluster

EMULATOR = pytest.mark.skipif(bool(EmulatedCluster.missing_prerequisites()),
                              reason="emulator unavailable: " + "; ".join(EmulatedCluster.missing_prerequisites()))


# ----- the pieces, without processes ------------------------------------------------------

def test_a_need_is_cut_from_the_pieces_that_cover_it_own_first():
    # two ranks held halves of a 4x2 tensor; a new rank 0 needs rows 1..3, rank 1 needs all
    holdings = [[Box("w", (0, 0), (2, 2))], [Box("w", (2, 0), (2, 2))]]
    needs = [[Box("w", (1, 0), (3, 2))], [Box("w", (0, 0), (4, 2))]]
    transfers = plan_transfers(holdings, needs)
    filled = {}
    for t in transfers:
        filled.setdefault((t.target, t.need), []).append((t.source, t.part))
    assert sorted(filled[(0, needs[0][0])]) == [(0, Box("w", (1, 0), (1, 2))), (1, Box("w", (2, 0), (2, 2)))]
    assert sorted(filled[(1, needs[1][0])]) == [(0, Box("w", (0, 0), (2, 2))), (1, Box("w", (2, 0), (2, 2)))]
    for (target, need), parts in filled.items():  # every need exactly covered, nothing twice
        assert sum(part.numel for _, part in parts) == need.numel


def test_a_part_no_survivor_holds_is_named():
    with pytest.raises(LostState, match=r"w: rows \(2, 0\)\+\(2, 2\) are held by no surviving rank"):
        plan_transfers([[Box("w", (0, 0), (2, 2))]], [[Box("w", (0, 0), (4, 2))]])


def test_a_model_tensor_left_out_of_the_snapshots_is_cut_from_the_optimizers_main_parameter():
    # the optimizer's main parameter of w, flat over two data-parallel ranks; w itself left out
    holdings = [[Box("optimizer.state.param.w", (0, 0), (1, 2))],
                [Box("optimizer.state.param.w", (1, 0), (1, 2))]]
    need = Box("w", (0, 0), (2, 2))
    transfers = plan_transfers(holdings, [[need], []], without_twins=True)
    assert sorted((t.source, t.part.offset) for t in transfers) == [(0, (0, 0)), (1, (1, 0))]
    assert all(t.need == need for t in transfers)
    with pytest.raises(LostState, match=r"^w: rows"):  # w kept in the snapshots: its own pieces are needed
        plan_transfers(holdings, [[need]])


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_model_tensors_are_left_out_only_where_the_optimizer_holds_them_exactly(one_process_group):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.hetero.snapshots.pieces import take, twins, twins_agree

    weight = torch.arange(6, dtype=torch.float32).view(2, 3)
    bias = torch.ones(3)  # no optimizer copy (a frozen parameter): always kept
    main = weight.clone()  # the optimizer's main parameter of weight, whole on this one rank
    state = {"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0),
             "b": ShardedTensor.from_rank_offsets("b", bias, replica_id=0),
             "p": ShardedTensor.from_rank_offsets("optimizer.state.param.w", main, replica_id=0)}
    full, _ = take(state, {}, 1)
    assert twins(state) == {"w"} and twins_agree(state, full)
    lean, recipe = take(state, {}, 1, without_twins=True)
    assert {box.key for box in lean.pieces} == {"b", "optimizer.state.param.w"} and lean.without_twins
    assert recipe.take(2, {}, taken_by=0).without_twins
    main[0, 0] += 1  # the model's weights no longer the main parameter's (a quantized model, say)
    assert not twins_agree(state, take(state, {}, 1)[0])
    state["w"] = ShardedTensor.from_rank_offsets("w", weight.to(torch.bfloat16), replica_id=0)
    main.copy_(weight)  # bf16 weights: the main parameter cast to them
    assert twins_agree(state, take(state, {}, 1)[0])


def test_a_flat_range_is_cut_into_boxes_that_cover_it_exactly_in_order():
    shape = (2, 3, 4)
    for start in range(25):
        for stop in range(start, 25):
            marked = torch.zeros(shape, dtype=torch.int64)
            seen = []
            for offset, size in flat_range_boxes(shape, start, stop):
                region = marked[tuple(slice(o, o + n) for o, n in zip(offset, size))]
                region += 1
                seen += torch.arange(24).reshape(shape)[tuple(slice(o, o + n) for o, n in zip(offset, size))].flatten().tolist()
            assert seen == list(range(start, stop)), (start, stop)  # contiguous runs, in element order
            assert marked.flatten().tolist() == [1 if start <= i < stop else 0 for i in range(24)]


def test_own_optimizer_shards_of_stacked_layers_re_shard_to_another_tensor_parallel_degree():
    """Each rank's own slice of the distributed optimizer's flat state (TP 2, DP 3, a layer
    stack's prepended axis) restores a TP 3 layout split along the other axis exactly."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    layers, rows, cols = 2, 6, 5
    whole = torch.arange(layers * rows * cols, dtype=torch.float32).reshape(layers, rows, cols)
    holdings, pieces_of = [], []
    for layer in range(layers):
        for tp in range(2):  # the old run: rows split over TP 2, each TP part's state flat over DP 3
            local = whole[layer, tp * 3:(tp + 1) * 3].contiguous()
            flat = torch.cat([torch.full((2,), -1.0), local.flatten()])  # the flat state, a param at 2
            view = flat[2:].view(3, cols)
            sharded = ShardedTensor.from_rank_offsets("optimizer.state.param.w", view, (0, layer, layers),
                                                      (1, tp, 2), replica_id=(0, 0, 0), prepend_axis_num=1)
            for dp, (lo, hi) in enumerate([(2, 7), (7, 12), (12, 17)]):  # DP ranks' flat ranges
                shard = flat[lo:hi].clone()  # the rank's live optimizer shard of the parameter
                taken = own_shard_pieces(sharded, [(lo, hi, lambda shard=shard: {"param": shard}, "param")])
                assert sum(b.numel for b in taken) == hi - lo
                for box, (piece, (fetch, key, start, numel)) in taken.items():  # each piece's live source
                    assert torch.equal(fetch()[key][start:start + numel].view(box.shape), piece)
                holdings.append(list(taken))
                pieces_of.append({box: piece for box, (piece, _) in taken.items()})
    needs, targets = [], []
    for layer in range(layers):
        for tp, (c0, n) in enumerate([(0, 2), (2, 2), (4, 1)]):  # the new run: columns over TP 3
            need = Box("optimizer.state.param.w", (layer, 0, c0), (1, rows, n))
            needs.append([need])
            targets.append(torch.full(need.shape, float("nan")))
    for t in plan_transfers(holdings, needs):
        piece = pieces_of[t.source][t.piece]
        targets[t.target][t.part.slices_within(t.need)] = piece[t.part.slices_within(t.piece)]
    for [need], target in zip(needs, targets):
        expected = whole[tuple(slice(o, o + n) for o, n in zip(need.offset, need.shape))]
        assert torch.equal(target, expected), need


def test_a_recipe_takes_the_live_tensors_again_packed_one_buffer_per_dtype():
    from megatron.hetero.snapshots.pieces import Recipe
    from megatron.hetero.snapshots.taking import _refreshed, _same_snapshot

    weight = torch.arange(6, dtype=torch.float32).view(2, 3)  # a live model tensor
    shard = torch.arange(4, dtype=torch.float64)  # a live optimizer shard (another dtype)
    fetch = lambda: {"exp_avg": shard}  # noqa: E731
    boxes = [Box("w", (0, 0), (2, 3)), Box("optimizer.state.exp_avg.v", (1, 0), (1, 2))]
    recipe = Recipe(boxes, [weight, (fetch, "exp_avg", 2, 2)], ["torch.float32", "torch.float64"])
    template = {"optimizer": {"param_groups": [{"lr": 1.0, "step": 1}]}, "model": {}}
    first = recipe.take(1, _refreshed(template, {"optimizer": {"param_groups": [{"lr": 0.5, "step": 2}]},
                                                 "extra": {}}), taken_by=0)
    assert sorted(first.packed) == ["torch.float32", "torch.float64"]
    assert torch.equal(first.pieces[boxes[0]], weight) and first.pieces[boxes[1]].tolist() == [[2.0, 3.0]]
    assert first.common == {"optimizer": {"param_groups": [{"lr": 0.5, "step": 2}]}, "model": {}}
    weight.add_(1)  # training goes on: the next take sees it, the first keeps its copy
    shard.mul_(2)
    second = recipe.take(2, first.common, taken_by=0)
    assert torch.equal(second.pieces[boxes[0]], weight) and second.pieces[boxes[1]].tolist() == [[4.0, 6.0]]
    assert first.pieces[boxes[1]].tolist() == [[2.0, 3.0]]
    assert not _same_snapshot(first, second) and _same_snapshot(second, recipe.take(2, first.common, taken_by=0))
    # The live tensors' memory replaced (as `param.data = ...` or a reloaded optimizer does):
    # the views made at the first take are made again; a take into a dropped generation's
    # buffers fills those and leaves the held snapshots alone.
    weight.set_(torch.full((2, 3), 7.0))
    shard = torch.full((4,), 5.0, dtype=torch.float64)
    third = recipe.take(3, first.common, taken_by=0, into=first.packed)
    assert torch.equal(third.pieces[boxes[0]], weight) and third.pieces[boxes[1]].tolist() == [[5.0, 5.0]]
    assert all(third.packed[d].data_ptr() == first.packed[d].data_ptr() for d in first.packed)
    assert second.pieces[boxes[1]].tolist() == [[4.0, 6.0]]
    wrong = {"torch.float32": torch.empty(5)}  # another length: not taken into
    assert recipe.take(4, first.common, taken_by=0, into=wrong).packed["torch.float32"].data_ptr() != wrong[
        "torch.float32"].data_ptr()


def test_the_store_keeps_three_generations_and_a_copy_only_once_complete():
    store = SnapshotStore()
    for iteration in (1, 2, 3, 4):
        store.add(Snapshot(iteration, 0, "a", {Box("w", (0,), (2,)): torch.zeros(2)}))
    assert sorted(store.own) == [2, 3, 4] and store.newest == 4
    store.copies[3] = {1: Snapshot(3, 1, "b", {Box("w", (2,), (2,)): torch.ones(2)})}
    assert [s.iteration for s in store.held(3)] == [3, 3]
    store.add(Snapshot(3, 0, "a", {}))  # iteration 3 taken again (after a restore from 2)
    assert 3 not in store.copies, "copies of an earlier take of the iteration must not mix in"


def test_a_dropped_generations_buffers_are_handed_out_once_for_the_next_snapshot():
    store = SnapshotStore()
    buffers = {}
    for iteration in (1, 2, 3, 4):
        buffers[iteration] = {"torch.float32": torch.zeros(2)}
        store.add(Snapshot(iteration, 0, "a", {}, packed=buffers[iteration]))
        assert store.recycled() is (buffers[iteration - 3] if iteration > 3 else None)
    assert store.recycled() is None, "given out once"
    assert all(store.own[i].packed is buffers[i] for i in (2, 3, 4)), "the held ones untouched"


def test_a_snapshot_taken_beside_training_is_waited_for_and_its_error_reaches_the_training_loop():
    import threading

    from megatron.hetero.restart import InProcessRestart, _Background

    restart = InProcessRestart.__new__(InProcessRestart)
    restart._taking, restart.snapshot_seconds = None, [0.001]
    restart.finish_snapshot()  # nothing being taken: returns at once
    release, done = threading.Event(), []
    restart._taking = _Background(lambda: (release.wait(), done.append(True)))
    threading.Timer(0.2, release.set).start()
    restart.finish_snapshot()  # the step must not change what is still being copied
    assert done == [True] and restart._taking is None
    assert restart.snapshot_seconds[0] >= 0.15  # the wait counts to the snapshot's time

    def lost_peer():
        raise RuntimeError("a snapshot copy failed: Connection reset by peer")

    restart._taking = _Background(lost_peer)
    with pytest.raises(RuntimeError, match="Connection reset"):
        restart.finish_snapshot()
    restart._taking = _Background(lost_peer)
    restart.finish_snapshot(raise_error=False)  # after a loss: the recovery takes over
    assert restart._taking is None


def test_survivors_keep_their_devices_under_the_re_plan(tmp_path):
    old = Plan.load(_plan(tmp_path))
    assert places(old) == {"node-fast:0": 0, "node-fast:1": 1, "node-slow:0": 2, "node-slow:1": 3}
    from hetero.launch.elastic import replan

    new = replan(old, {"node-slow"})
    assert new_ranks(old, new, {"node-slow"}) == {"node-fast:0": 0, "node-fast:1": 1}
    # node-slow back: its new processes take the full plan's ranks there, one per device
    assert new_ranks(new, old, set(), joining={"node-slow"}) == places(old)


def test_a_returned_node_is_reported_and_taken_back_once(tmp_path):
    from hetero.launch.inprocess import launch_environment, report_returned, returned, taken_back

    report_returned(tmp_path, "node-slow")
    assert returned(tmp_path) == {"node-slow"}
    taken_back(tmp_path, {"node-slow"})
    assert returned(tmp_path) == set()
    rejoin = Rejoin(2, "p.json", "10.0.0.1", 30001, {"node-fast:0": 0, "node-slow:0": 1, "node-slow:1": 2})
    assert launch_environment(rejoin, "node-slow:1") == {
        "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "30001", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert launch_environment(rejoin, "node-other:0") is None


def test_the_control_directory_protocol(tmp_path):
    report_ready(tmp_path, 1, place("node-a", 0), {"snapshot_iteration": 7})
    assert [r["snapshot_iteration"] for r in ready(tmp_path, 1)] == [7]
    assert Rejoin.load(tmp_path, 1) is None
    Rejoin(1, "p.json", "10.0.0.1", 30001, {"node-a:0": 0}).save(tmp_path)
    assert Rejoin.load(tmp_path, 1).ranks == {"node-a:0": 0}
    report_finished(tmp_path, 1, place("node-a", 0))
    assert finished(tmp_path, 1) == {"node-a:0"}


def test_a_peer_the_library_error_names_is_lost_after_one_missed_heartbeat(tmp_path):
    """After a communication error, a peer on another machine counts as lost after 3 s of
    silence; the peer whose address the error names (its connection is already gone) after
    1.5 s, one missed heartbeat."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from megatron.hetero import watchdog

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    dog = watchdog.Watchdog(store, 0, Plan.load(_plan(tmp_path)), recover=True, peer_timeout_s=30)
    error = ("[gloo/transport/tcp/pair.cc:537] Read error [10.77.3.12]:52877: Connection reset by peer. "
             "This is typically caused by a remote peer crashing")
    named = set(watchdog._PEER_ADDRESS.findall(error))
    assert named == {"10.77.3.12"}
    for rank, address in ((1, "10.77.3.11"), (2, "10.77.3.12"), (3, "10.77.3.13")):
        dog.store.set(f"where/{rank}", f"node-{rank} {1000 + rank} machine-{rank} {address}")
        dog.store.set(f"done/{rank}", "0")
    silent_for = {1: 0.5, 2: 2.0, 3: 2.0}  # rank 2: named, silent past one beat; rank 3: not named
    for rank, seconds in silent_for.items():
        dog.store.set(f"alive/{rank}", repr(time.time() - seconds))
    dog.named_peers = named  # as handle() records them from the error
    lost = dog._find_lost([1, 2, 3], silence_s=watchdog.SILENT_AFTER_ERROR_S)
    assert [(r.launch_rank, r.host) for r in lost] == [(2, "node-2")], lost
    dog.named_peers = set()
    assert dog._find_lost([1, 3], silence_s=watchdog.SILENT_AFTER_ERROR_S) == []  # 3 s for the others


# ----- on the emulated cluster ------------------------------------------------------------

@pytest.mark.slow
@EMULATOR
def test_a_lost_node_costs_the_survivors_no_restart_and_no_file_read(tmp_path):
    plan = _plan(tmp_path)
    base = GPT_MODEL + TRAINING + ["--lr-decay-style", "constant", "--train-iters", "10",
                                   "--use-distributed-optimizer"]
    train = base + ["--inprocess-restart", "--non-persistent-save-interval", "1"]  # a snapshot every iteration
    # killed between iteration 4's snapshot and the next
    lines, _ = supervise(tmp_path, CLUSTER, plan, train, ["node-slow"], when=f"iteration {4:8d}/",
                         settle_s=0.3)
    output = "".join(lines)
    recorded = read_events(tmp_path / "runs" / "attempt-0-events")
    assert not of_kind(recorded, CheckpointLoaded), "no checkpoint file may be read"
    (restored,) = of_kind(recorded, StateRestored)
    assert restored.source == "memory" and restored.epoch == 1, restored
    assert restored.iteration >= 3, f"more than the iterations since the last snapshot lost: {restored}"
    assert "elastic: the job finished (attempt 0)" in output, output[-3000:]
    # The survivors are the processes that started the job: the pids that waited for the
    # re-plan are the pids that finished.
    control = tmp_path / "runs" / "attempt-0-control"
    waited = {r["place"]: r["pid"] for r in ready(control, 1)}
    ended = {json.loads(p.read_text())["place"]: json.loads(p.read_text())["pid"]
             for p in (control / "epoch-1" / "finished").glob("*.json")}
    assert waited == ended and set(waited) == {"node-fast:0", "node-fast:1"}, (waited, ended)
    after = {i: loss for i, loss in losses(recorded).items() if i > restored.iteration}
    assert sorted(after) == list(range(restored.iteration + 1, 11))

    # The same iteration's state from an uninterrupted run's checkpoint, resumed under the
    # re-plan by hand, trains the same losses.
    save = tmp_path / "reference"
    layout = Plan.load(plan)
    from tools.emulator.cluster import RankLayout
    from hetero.spec.cluster import Cluster

    with EmulatedCluster(Cluster.load(CLUSTER), RankLayout.of_plan(layout)) as emulated:
        reference = emulated.run(["pretrain_gpt.py", "--hetero-plan", str(plan), *base, "--train-iters",
                                  str(restored.iteration), "--save", str(save), "--save-interval",
                                  str(restored.iteration)], timeout=600, echo=False)
    assert reference.returncode == 0, reference.output[-3000:]
    replanned = tmp_path / "runs" / "plan-inprocess-1.json"
    by_hand = run_pretrain(base + ["--load", str(save), "--hetero-plan", str(replanned)], nproc=2,
                           env={"HETERO_DEVICE": "cpu-fast", "HETERO_VENDOR": "cpu"}, timeout=300)
    assert by_hand.returncode == 0, by_hand.output[-3000:]
    expected = by_hand.iteration_losses()
    assert sorted(expected) == sorted(after)
    for iteration, loss in after.items():
        assert abs(loss - expected[iteration]) <= 1e-6 * abs(expected[iteration]), (iteration, loss, expected)


THREE_NODES = {
    "name": "cpu-three",
    "devices": {"cpu-fast": {"vendor": "cpu", "memory_gib": 4, "peak_tflops": 0.05, "memory_bandwidth_gbs": 5}},
    "groups": [{"name": "local", "nodes": [
        {"host": f"node-{name}", "device": "cpu-fast", "count": 1, "intra_link": "loopback",
         "nic": {"kind": "ethernet", "gbps": 8}} for name in ("a", "b", "c")]}],
}


@pytest.mark.slow
@EMULATOR
def test_two_lost_nodes_that_held_a_shard_and_its_copy_fall_back_to_the_disk_checkpoint(tmp_path):
    cluster = tmp_path / "three.yaml"
    cluster.write_text(yaml.safe_dump(THREE_NODES))
    model = tmp_path / "tiny.yaml"
    model.write_text(yaml.safe_dump({"num_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
                                     "seq_length": 32, "vocab_size": 1024, "ffn_hidden_size": 256,
                                     "untie_embeddings_and_output_weights": False}))
    plan = tmp_path / "plan.json"
    subprocess.run([sys.executable, "-m", "hetero.cli", "--cluster", str(cluster), "--model", str(model),
                    "--global-batch-size", "12", "--seq-length", "32", "--micro-batch-size", "2",
                    "--precision", "fp32", "--no-fused-kernels", "--no-dropout", "--skip-baseline",
                    "--skip-upper-bound", "--quiet", "-o", str(plan)], cwd=REPO, check=True, capture_output=True)
    # Three pipeline stages, one per node: each node's layers are its own (the planner picks
    # three replicas here, each holding everything), the record kept for the re-plan.
    written = json.loads(plan.read_text())
    written.update(pipeline_parallel=3, data_parallel=1, stages=[
        {"num_layers": 1, "device_types": ["cpu-fast"]} for _ in range(3)],
        replicas=[{"num_micro_batches": 6, "device_types": ["cpu-fast"] * 3}], prediction=None)
    plan.write_text(json.dumps(written))
    hosts = [host for host, _ in Plan.load(plan).hosts()]
    assert hosts == ["node-a", "node-b", "node-c"]
    # node-b's stage is snapshot on node-b and copied to node-c: lose both
    lose = ["node-b", "node-c"]
    save = tmp_path / "ckpt"
    train = ["--num-layers", "3", *GPT_MODEL[2:], *TRAINING, "--global-batch-size", "12",
             "--lr-decay-style", "constant", "--train-iters", "8", "--use-distributed-optimizer",
             "--inprocess-restart", "--save", str(save), "--save-interval", "2"]
    lines, _ = supervise(tmp_path, cluster, plan, train, lose, when=f"iteration {3:8d}/", settle_s=0.3)
    output = "".join(lines)
    recorded = read_events(tmp_path / "runs" / "attempt-0-events")
    (restored,) = of_kind(recorded, StateRestored)
    assert restored.source == "disk" and restored.iteration == 2, restored
    assert "held by no surviving rank" in restored.detail
    assert "falling back to the last disk checkpoint" in output
    assert "elastic: the job finished (attempt 0)" in output, output[-3000:]


@pytest.mark.slow
@EMULATOR
def test_a_returned_node_joins_without_a_restart_of_the_others(tmp_path):
    """node-slow is lost, the job goes on in-process on node-fast; node-slow comes back and
    joins at an iteration boundary: node-fast's processes are never restarted, the returned
    node's new processes get their state from the others' snapshots (no file read), and the
    whole run trains what one process trains."""
    from tools.emulator.cluster import return_node

    plan = _plan(tmp_path)
    # Long enough for the returned node's processes to start while the job trains, and for
    # the joined plan to measure its snapshot interval (12 iterations): on an idle machine the
    # join came at iteration 90.
    iterations = 200
    train = GPT_MODEL + TRAINING + ["--lr-decay-style", "constant", "--train-iters", str(iterations),
                                    "--use-distributed-optimizer", "--inprocess-restart"]
    control = tmp_path / "runs" / "attempt-0-control"
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "tools.emulator", "--cluster", str(CLUSTER), "--plan", str(plan), "--elastic",
         "--run-dir", str(tmp_path / "runs"), "--", "pretrain_gpt.py", *train],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []

    def read_until(text: str) -> None:
        for line in supervisor.stdout:
            lines.append(line)
            if text in line:
                return
        raise AssertionError(f"the job ended before {text!r}:\n" + "".join(lines)[-4000:])

    try:
        read_until(f"iteration {3:8d}/")
        assert kill_node("node-slow") > 0
        read_until("restored from memory")
        return_node(control, "node-slow")
        read_until("came back; re-planned in-process")
        lines += supervisor.stdout.readlines()
        assert supervisor.wait(timeout=600) == 0, "".join(lines)[-5000:]
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
    assert_nothing_left(str(tmp_path))
    output = "".join(lines)
    recorded = read_events(tmp_path / "runs" / "attempt-0-events")
    assert not of_kind(recorded, CheckpointLoaded), "no checkpoint file may be read"
    restored = of_kind(recorded, StateRestored)
    assert len(restored) == 2, output[-6000:]
    lost, joined = restored
    assert (lost.epoch, lost.source, joined.epoch, joined.source) == (1, "memory", 2, "memory"), (lost, joined)
    assert joined.iteration > lost.iteration, (lost, joined)
    # node-fast's processes are the ones that started the job, through both re-plans; node-slow's
    # are new ones, started for the join, and they finish the run too.
    waited = {r["place"]: r["pid"] for r in ready(control, 1)}
    finished_by = {json.loads(p.read_text())["place"]: json.loads(p.read_text())["pid"]
                   for p in (control / "epoch-2" / "finished").glob("*.json")}
    joiners = {r["place"]: r["pid"] for r in ready(control, 2) if r.get("joining")}
    assert set(waited) == {"node-fast:0", "node-fast:1"}, waited
    assert set(joiners) == {"node-slow:0", "node-slow:1"}, joiners
    assert finished_by == {**waited, **joiners}, (finished_by, waited, joiners)
    assert Plan.load(tmp_path / "runs" / "plan-inprocess-2.json").world_size == Plan.load(plan).world_size
    assert "join at the next iteration boundary" in output
    # The default interval between snapshots: measured afresh under every plan, by every rank
    # alike (under the re-plan after the loss and after the join; the first plan may lose its
    # node before it has measured)
    assert output.count("> in-process restart: a snapshot takes") >= 2, output[-5000:]
    # Every iteration trained once in the end, and the run as a whole is one process's run.
    got = losses(recorded)
    assert sorted(got) == list(range(1, iterations + 1)), sorted(got)
    reference = run_pretrain(train[:-1], nproc=1, timeout=600)
    assert reference.returncode == 0, reference.output[-3000:]
    want = reference.iteration_losses()
    worst = max(abs(got[i] - want[i]) / abs(want[i]) for i in range(1, iterations + 1))
    print(f"largest relative loss difference to one process: {worst:.2e}")
    for i in range(1, iterations + 1):  # re-planned reductions sum in another order
        assert abs(got[i] - want[i]) <= 1e-4 * abs(want[i]), (i, got[i], want[i])


def test_shutting_the_connections_leaves_no_descriptor_behind():
    """Teardown shuts every TCP connection of the process by a duplicate of each descriptor:
    the duplicates of what is not a socket (pipes, event descriptors) must be closed too, or
    every re-plan doubles them (a process that re-planned a few times ran out of select()'s
    1024)."""
    import socket

    from megatron.hetero.restart import shut_connections

    read_end, write_end = os.pipe()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        before = len(os.listdir("/proc/self/fd"))
        shut_connections()
        shut_connections()
        assert len(os.listdir("/proc/self/fd")) == before
        assert accepted.recv(1) == b""  # the connection was shut: the peer sees its end
    finally:
        for thing in (client, accepted, server):
            thing.close()
        os.close(read_end)
        os.close(write_end)


def test_a_replan_member_that_never_comes_stops_the_meeting_within_its_bound(monkeypatch):
    """Two nodes lost moments apart: the second said it waits, the re-plan counted it, then it
    died. The re-plan's rendezvous gives up after its own bound (the heartbeat timeout), not
    after the process groups' --distributed-timeout-minutes, and the store is forgotten for
    the next re-plan."""
    import time

    from hetero.env import Launch
    from megatron.hetero import distributed
    from megatron.hetero.training.run import _meet_the_replan

    port = unused_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    distributed.forget_rendezvous()
    started = time.monotonic()  # rank 0 hosts the store: the store's own wait for its clients ends
    missing = _meet_the_replan(Launch(rank=0, world_size=2), timeout_s=1.0)
    assert missing and "1/2 clients joined" in missing, missing
    assert time.monotonic() - started < 30
    assert distributed._store is None  # the next re-plan meets at its own store

    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("RANK", "1")  # another rank reaches the store; the rank it waits for never does
    started = time.monotonic()
    assert _meet_the_replan(Launch(rank=1, world_size=2), timeout_s=1.0) == "1 of 2 processes came within 1 s"
    assert time.monotonic() - started < 30 and distributed._store is None
    del host


def test_a_replan_whose_groups_cannot_be_set_up_gives_up_at_its_bound(monkeypatch):
    """The member met, then died before the process groups' rendezvous: the set-up's store
    wait would last --distributed-timeout-minutes; at the heartbeat timeout the process shuts
    its connections, the wait fails, and the re-plan is given up for the next one."""
    import argparse
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from hetero.env import Launch
    from megatron.hetero import distributed, startup
    from megatron.hetero.training.run import _set_up_replan

    port = unused_port()
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    host = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    host.add("hetero/arrived", 1)  # the other member came to the meeting, then died
    distributed.forget_rendezvous()
    # the process groups' rendezvous, waiting for the dead member's address
    monkeypatch.setattr(startup, "init_distributed",
                        lambda *args: distributed._rendezvous(timedelta(minutes=10)).get("never-published"))
    started = time.monotonic()
    ctx, failed = _set_up_replan(argparse.Namespace(inprocess_heartbeat_timeout=1.0), None, None,
                                 Launch(rank=1, world_size=2))
    assert ctx is None and failed.startswith("its process groups were not set up within 1 s"), failed
    assert time.monotonic() - started < 30
    assert distributed._store is None
    del host


_PUBLISHES_THEN_DIES = """
import os, sys
from datetime import timedelta
import torch.distributed as dist

# gloo pairs two ranks by their addresses: the lower one listens, the higher one connects. The
# member publishes its address with the port made the highest, so that the other rank is the
# one that listens, and then is lost before it connects.
class PublishesThenDies(dist.Store):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
    def set(self, key, value):
        value = bytes(value)
        at = next((i for i in range(len(value) - 8) if value[i:i + 2] == bytes.fromhex("0200")
                   and value[i + 4:i + 8] == bytes.fromhex("7f000001")), None)
        if at is None:
            print("no AF_INET loopback address in gloo's published value: update this test", flush=True)
            os._exit(3)
        self.inner.set(key, value[:at + 2] + bytes.fromhex("ffff") + value[at + 4:])
        os._exit(0)
    def get(self, key):
        return self.inner.get(key)
    def add(self, key, amount):
        return self.inner.add(key, amount)
    def wait(self, keys, *timeout):
        return self.inner.wait(keys, *timeout)
    def check(self, keys):
        return self.inner.check(keys)
    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=PublishesThenDies(store), rank=1, world_size=2)
"""

_SETS_UP_A_REPLAN = """
import argparse, importlib, sys
from datetime import timedelta
import torch.distributed as dist
from hetero.env import Launch
from megatron.hetero import startup
run = importlib.import_module("megatron.hetero.training.run")  # the module (the package exports run())

port = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
run._meet_the_replan = lambda launch, timeout_s: None  # both members met; then one is lost
run.STUCK_SET_UP_GRACE_S = 2.0
# The groups' set-up, with the job's timeout (10 minutes): the real gloo wait for a lost member.
startup.init_distributed = lambda *args: dist.init_process_group(
    "gloo", store=store, rank=0, world_size=2, timeout=timedelta(minutes=10))
print("set-up starts", flush=True)
# The bound leaves the lost member time to start and publish its address (a few seconds).
print(run._set_up_replan(argparse.Namespace(inprocess_heartbeat_timeout=20.0), None, None, Launch(rank=0, world_size=2)), flush=True)
print("set-up returned", flush=True)
"""


def test_a_replan_member_lost_while_gloo_connects_ends_the_process_instead_of_a_hang():
    """The member met, gave gloo its address, and died before connecting: the rank that
    listens for it waits past gloo's own timeout, and no connection exists to shut. At the heartbeat timeout plus
    STUCK_SET_UP_GRACE_S the process ends with its reason (exit 75), so that the job resumes
    from its checkpoint instead of waiting for --distributed-timeout-minutes or longer."""
    import time

    port = unused_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    setting_up = subprocess.Popen([sys.executable, "-c", _SETS_UP_A_REPLAN, str(port)], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        before = ""
        while not before.endswith("set-up starts\n"):  # megatron-core imported, the store up
            line = setting_up.stdout.readline()
            assert line, before
            before += line
        started = time.monotonic()
        lost = subprocess.run([sys.executable, "-c", _PUBLISHES_THEN_DIES, str(port)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert lost.returncode == 0, lost.stdout + lost.stderr
        output, _ = setting_up.communicate(timeout=120)
    finally:
        setting_up.kill()
        setting_up.wait()
    assert setting_up.returncode == 75, output
    assert "set-up returned" not in output, output
    assert "the re-plan's process groups are still not set up after 22 s" in output, output
    assert "the job resumes from its last checkpoint" in output, output
    assert time.monotonic() - started < 100  # not gloo's 10 minutes


def _chosen(rank: int, added: tuple[float, float], jitter: tuple[float, float]) -> int:
    """The interval rank ``rank`` of two chooses when each rank sees a snapshot add ``added``
    to the time between two iteration boundaries of 200 ms, each gap moved by +-``jitter``."""
    import argparse

    from megatron.hetero.restart import InProcessRestart

    restart = InProcessRestart.__new__(InProcessRestart)
    restart.args = argparse.Namespace(non_persistent_save_interval=None, use_distributed_optimizer=True)
    restart.store = SnapshotStore()
    restart.snapshot_seconds = []
    restart.begin_plan()
    restart.snapshot_seconds = [0.15, 0.15] + [0.004] * 7
    signs = [1, -1, 0, 1, -1, 1, -1]
    after = [(0.2 + added[rank] + jitter[rank] * sign, True) for sign in signs]
    plain = [(0.2 + jitter[rank] * -sign, False) for sign in signs]
    restart._gaps = [(0.35, True), (0.35, True)] + [gap for pair in zip(plain, after) for gap in pair]
    return restart.chosen_interval()


def _interval_rank(rank: int, world: int) -> None:
    """Both ranks time the same job (200 ms iterations, a budget of 6 ms per snapshot)."""
    # A snapshot adds 14 ms on one rank's clock and 6 ms on the other's, with next to no
    # noise: the ranks' mean, 10 ms, is shown, and two iterations' budget covers it.
    assert _chosen(rank, (0.014, 0.006), (0.0005, 0.0005)) == 2
    # Three times the budget, in gaps that vary by a tenth of that: every 3 iterations.
    assert _chosen(rank, (0.018, 0.018), (0.002, 0.002)) == 3
    # The same 10 ms mean in gaps that vary by +-20 ms: no evidence of a cost beyond the
    # noise, the default every iteration.
    assert _chosen(rank, (0.014, 0.006), (0.02, 0.02)) == 1
    # Within the budget: every iteration.
    assert _chosen(rank, (0.005, 0.003), (0.0, 0.0)) == 1


def test_the_default_interval_is_one_unless_the_ranks_mean_cost_is_shown_beyond_its_noise():
    outcomes = run_on_ranks(_interval_rank, 2, timeout=60)
    assert outcomes == {0: "ok", 1: "ok"}, outcomes
