"""Process start-up under a plan: who am I, am I what the plan says, then the groups.

Order matters. Everything that can be wrong with the launch is checked *before* the
first collective, and every rank reaches the same verdict, so a bad launch stops with the
same clear message everywhere instead of hanging in a collective:

1. the launch's world size against the plan (each rank checks alone);
2. each rank's device against the plan's ``devices`` entry, exchanged through the
   rendezvous key-value store (not a collective), so all ranks see every mismatch;
3. only then ``init_process_group`` with the logical rank the plan assigns to this
   process, and megatron-core's ``initialize_model_parallel``, whose default rank order
   (tp fastest, then dp, then pp) is the plan's logical order. With
   ``--distributed-backend hetero`` each process first tells the backend its vendor (the
   plan's, or HETERO_VENDOR), so groups within one vendor use the native library.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hetero import env
from hetero.env import Launch
from hetero.spec.devices import CPU, device_type_matches
from hetero.errors import HeteroError
from hetero.plan import Plan
from megatron.hetero import stage_tensor_parallel
from megatron.hetero.identity import RankIdentity, compute_device, set_this_rank


_MAX_REPORTED_MISMATCHES = 8


@dataclass(frozen=True)
class FoundDevice:
    device_type: str
    vendor: str | None  # None: not known (an emulated device with no vendor given)
    how: str  # where the identity came from, for error messages


def read_launch() -> Launch:
    """Reads torchrun's variables; a bare ``python pretrain_gpt.py`` is a 1-process job."""
    launch = env.launch()
    if launch is not None:
        return launch
    # torch's env:// rendezvous reads these, so the world of one is written where it looks.
    os.environ.update({env.RANK: "0", env.WORLD_SIZE: "1", env.LOCAL_RANK: "0", env.LOCAL_WORLD_SIZE: "1"})
    os.environ.setdefault(env.MASTER_ADDR, "127.0.0.1")
    if env.get(env.MASTER_PORT) is None:
        os.environ[env.MASTER_PORT] = str(env.unused_port())
    return env.launch()


def check_world_size(plan: Plan, launch: Launch, plan_source: str) -> None:
    if plan.world_size != launch.world_size:
        raise HeteroError(
            f"the plan {plan_source} is for {plan.world_size} processes "
            f"({plan.summary().split(' micro-batch=')[0]}) but this job was launched with {launch.world_size}; "
            f"launch {plan.world_size} processes (e.g. `python -m hetero.launch {plan_source}` "
            "prints the torchrun commands) or regenerate the plan for this cluster"
        )


def detect_device(local_rank: int) -> FoundDevice:
    """This process's device: HETERO_DEVICE if set (emulation), else what torch sees.

    HETERO_DEVICE and HETERO_VENDOR give one entry per local rank (hetero.env).
    """
    override, vendor = env.device(), env.vendor()
    if override:
        return FoundDevice(override, vendor, env.DEVICE)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(local_rank % torch.cuda.device_count())
        return FoundDevice(name, vendor or ("amd" if torch.version.hip else "nvidia"), "torch.cuda")
    return FoundDevice(CPU, vendor or CPU, "no GPU visible")


def _mismatch(plan: Plan, launch_rank: int, found: FoundDevice) -> str | None:
    expected = plan.devices[launch_rank]
    type_ok = (
        found.device_type == CPU == expected.device_type.lower()
        or (found.device_type != CPU and device_type_matches(expected.device_type, found.device_type))
    )
    vendor_ok = found.vendor is None or found.vendor.lower() == expected.vendor.lower()
    if type_ok and vendor_ok:
        return None
    hint = ""
    if found.how == "no GPU visible":
        hint = f" (to emulate it on this CPU, set {env.DEVICE}={expected.device_type})"
    return (
        f"launch rank {launch_rank} (logical rank {plan.logical_rank(launch_rank)}, host "
        f"{expected.host}): the plan expects {expected.device_type} ({expected.vendor}), "
        f"found {found.device_type} ({found.vendor or 'vendor not given'}, from {found.how}){hint}"
    )


def exchange_devices(store: dist.Store, launch: Launch, found: FoundDevice, timeout: timedelta) -> list[FoundDevice]:
    """Every rank publishes its device and reads everyone's, through the store (no collective)."""
    check = dist.PrefixStore("hetero/device-check", store)
    check.set(str(launch.rank), json.dumps(found.__dict__))
    keys = [str(r) for r in range(launch.world_size)]
    try:
        check.wait(keys, timeout)
    except Exception:
        missing = [k for k in keys if not check.check([k])]
        raise HeteroError(
            f"launch ranks {', '.join(missing)} did not report their device within "
            f"{timeout}; they failed to start (see their output above) or were never launched"
        ) from None
    reports = [FoundDevice(**json.loads(v)) for v in check.multi_get(keys)]
    # The store may live in launch rank 0; it must not exit before everyone has read.
    check.add("read", 1)
    if launch.rank == 0:
        deadline = time.monotonic() + timeout.total_seconds()
        while check.add("read", 0) < launch.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
    return reports


def check_device_reports(plan: Plan, launch: Launch, reports: list[FoundDevice]) -> None:
    """Every rank's device against the plan: one HeteroError listing every mismatch."""
    problems = [p for r, f in enumerate(reports) if (p := _mismatch(plan, r, f))]
    if problems:
        shown = problems[:_MAX_REPORTED_MISMATCHES]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more launch ranks")
        raise HeteroError(
            f"{len(problems)} of {launch.world_size} processes do not match the plan's devices:\n  - "
            + "\n  - ".join(shown)
            + _emulation_hint(plan, reports)
            + "\nLaunch the plan on the cluster it was made for, or regenerate it for this one."
        )


def _emulation_hint(plan: Plan, reports: list[FoundDevice]) -> str:
    """Where no process sees a GPU and the plan's devices differ, the per-local-rank form of
    HETERO_DEVICE for launchers that start several ranks of different types."""
    types = [device.device_type for device in plan.devices]
    if len(set(types)) < 2 or any(found.how != "no GPU visible" for found in reports):
        return ""
    return (f"\nTo emulate the plan's devices on CPUs, give one entry per local rank: one launcher "
            f"starting every rank takes {env.DEVICE}={env.per_local_rank_value(types, env.DEVICE)}; "
            "several take their own ranks' entries (`python -m hetero.launch PLAN --emulate-devices` "
            "prints each node's).")


_devices_checked = False  # the check runs once per process (start-up runs it with the flags')


def verify_devices(
    store: dist.Store, plan: Plan, launch: Launch, found: FoundDevice, timeout: timedelta
) -> None:
    """All ranks publish their device, read everyone's, and agree on the verdict."""
    global _devices_checked
    reports = exchange_devices(store, launch, found, timeout)
    _devices_checked = True
    check_device_reports(plan, launch, reports)


def check_launch_devices(plan: Plan | None, launch: Launch, timeout: timedelta) -> None:
    """Start-up's device check, beside the checks of the flags and the plan: every rank
    takes part in the exchange (so none waits for a rank whose flags were wrong); the
    verdict needs a plan of this world size with devices (``plan`` None: none)."""
    global _devices_checked
    found = detect_device(launch.local_rank)
    if launch.world_size == 1:  # nothing to exchange
        reports = [found]
    else:
        reports = exchange_devices(_rendezvous(timeout), launch, found, timeout)
    if plan is not None:
        _devices_checked = True
        check_device_reports(plan, launch, reports)


def comm_vendor(plan: Plan, launch: Launch, found: FoundDevice, planned: bool) -> str:
    """This rank's vendor for --distributed-backend hetero.

    HETERO_VENDOR, when set, wins (per local rank, as in detect_device); else the plan's
    entry for this process (``devices`` is indexed by launch rank, not by the logical rank
    the process group uses); a plan-less launch uses what was detected.
    """
    if env.vendor() and found.vendor:
        return found.vendor
    if planned:
        return plan.devices[launch.rank].vendor
    return found.vendor or CPU


def _use_hetero_backend(vendor: str) -> None:
    try:
        import hetero_comm
    except ImportError as err:
        raise HeteroError(f"--distributed-backend hetero: {err}") from None
    hetero_comm.set_vendor(vendor)


_store: dist.Store | None = None


def _rendezvous(timeout: timedelta) -> dist.Store:
    """The job's key-value store (torchrun's agent store, or one hosted by launch rank 0)."""
    global _store
    if _store is None:
        _store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    _store.set_timeout(timeout)
    return _store


def wait_for_every_rank(launch: Launch, timeout: timedelta, key: str = "hetero/arrived") -> None:
    """Returns once every launch rank has reached the job's store; TimeoutError (or the
    store's own error when its host is gone) after ``timeout``. The bound is this wait's own:
    the store keeps the job's timeout for what follows."""
    store = _rendezvous(timeout)
    arrived = store.add(key, 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while arrived < launch.world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{arrived} of {launch.world_size} processes came within "
                               f"{timeout.total_seconds():.0f} s")
        time.sleep(0.05)
        arrived = store.add(key, 0)


def forget_rendezvous() -> None:
    """Drops this process's store and device check (in-process restart joins a new world)."""
    global _store, _devices_checked
    _store, _devices_checked = None, False


def job_store() -> dist.Store:
    """The rendezvous store of this job (after initialize)."""
    assert _store is not None, "initialize() first"
    return _store


def wait_for_peers_to_fail(launch: Launch, timeout: timedelta = timedelta(seconds=60)) -> None:
    """Holds a rank that stops on bad input until every rank has stopped too.

    torchrun kills the remaining processes as soon as one exits; without this, a rank
    still starting up would die without printing its own report of the problem. All
    ranks reach the same verdict on bad input, so the wait is short; it is bounded in
    case one rank does not.
    """
    if launch.world_size == 1:
        return
    try:
        announce_stopped(_rendezvous(timeout))
        failed = dist.PrefixStore("hetero/stopped", _rendezvous(timeout))
        deadline = time.monotonic() + timeout.total_seconds()
        # Polled finely: the ranks then exit within milliseconds of each other, before torchrun
        # (which looks every 0.1 s) stops the ones still running with SIGTERM.
        while failed.add("count", 0) < launch.world_size and time.monotonic() < deadline:
            time.sleep(0.005)
    except Exception:  # no store reachable: nothing to wait for
        pass


def node_leader_error(launch: Launch, message: str, timeout: timedelta = timedelta(seconds=20)) -> str | None:
    """Publishes this rank's error and returns the one its node's local rank 0 published
    (None: this rank is that one, or it published nothing in ``timeout``): every rank
    checks the launch, and an error its node's first rank already printed is printed once."""
    leader = launch.rank - launch.local_rank  # torchrun numbers the ranks of a node consecutively
    if launch.world_size == 1:
        return None
    try:
        errors = dist.PrefixStore("hetero/errors", _rendezvous(timeout))
        errors.set(str(launch.rank), message)
        if leader == launch.rank:
            return None
        errors.wait([str(leader)], timeout)
        return errors.get(str(leader)).decode()
    except Exception:  # no store, or the node's first rank did not stop on an error
        return None


def announce_stopped(store: dist.Store) -> None:
    """Counts this rank among those that stopped on a reported error (see above)."""
    dist.PrefixStore("hetero/stopped", store).add("count", 1)


GROUP_OPTION_FLAGS = {
    # megatron-core's initialize_model_parallel argument: (the flag, its dest, Megatron-LM's default)
    "use_sharp": ("--use-sharp", "use_sharp", False),
    "sharp_enabled_group": ("--sharp-enabled-group", "sharp_enabled_group", None),
    "nccl_communicator_config_path": ("--nccl-communicator-config-path", "nccl_communicator_config_path", None),
    "high_priority_stream_groups": ("--high-priority-stream-groups", "high_priority_stream_groups", []),
    "create_all_gather_group": ("--create-all-gather-group", "create_all_gather_group", False),
    "create_gloo_process_groups": ("--disable-gloo-process-groups", "enable_gloo_process_groups", True),
}
"""Flags that tune the process groups megatron-core creates (NCCL options, SHARP, stream
priorities, the side gloo groups): passed to it as Megatron-LM passes them. On the CPU every
group is a gloo group already and none applies (cpu_device.substitute_gpu_choices)."""


def group_options(args) -> dict:
    """megatron-core's initialize_model_parallel arguments the flags give, those the installed
    release takes: from 0.17 on --create-all-gather-group is no argument of it (Megatron-LM
    builds those groups for Megatron-FSDP only, which the runtime refuses)."""
    import inspect

    from megatron.core import parallel_state

    accepted = inspect.signature(parallel_state.initialize_model_parallel).parameters
    return {name: getattr(args, dest) for name, (_, dest, _) in GROUP_OPTION_FLAGS.items() if name in accepted}


def initialize(
    plan: Plan,
    plan_source: str,
    backend: str | None,
    timeout: timedelta,
    check_devices: bool = True,
    sequence_parallel: bool = False,
    group_options: dict | None = None,
) -> RankIdentity:
    """Checks the launch against the plan, then creates every process group; returns (and
    publishes, identity.py) this process's identity.

    check_devices=False is for the uniform plan made up for a plan-less launch, which
    has no device expectations. sequence_parallel: how activations cross stages of
    different tensor-parallel degree (stage_tensor_parallel.py). group_options: megatron-core's
    NCCL tuning of the groups it creates (GROUP_OPTION_FLAGS), as the flags give it.
    """
    from megatron.core import parallel_state

    launch = read_launch()
    check_world_size(plan, launch, plan_source)
    found = detect_device(launch.local_rank)
    on_gpu = torch.cuda.is_available()
    backend = backend or ("nccl" if on_gpu else "gloo")
    if backend == "nccl" and not on_gpu:
        raise HeteroError(
            "--distributed-backend nccl needs a GPU and none is visible; use "
            "--distributed-backend gloo on the CPU"
        )
    store = _rendezvous(timeout)
    if check_devices and not _devices_checked:
        verify_devices(store, plan, launch, found, timeout)

    if on_gpu:
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    if backend == "hetero":
        _use_hetero_backend(comm_vendor(plan, launch, found, planned=check_devices))
    logical_rank = plan.logical_rank(launch.rank)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore("default_pg", store),
        rank=logical_rank,
        world_size=launch.world_size,
        timeout=timeout,
    )
    minutes = max(1, int(timeout.total_seconds() // 60))
    coords = plan.grid.coords(logical_rank)
    if not plan.megatron_grid:
        # The groups come from the plan's grid (patch parallel-state-groups-from-per-stage-grid):
        # each template's own, side by side; sizes of 1 only keep megatron-core's
        # divisibility checks of one grid quiet.
        stage_tensor_parallel.use_plan_grid(plan, sequence_parallel)
        parallel_state.initialize_model_parallel(expert_model_parallel_size=plan.expert_parallel,
                                                 distributed_timeout_minutes=minutes, **(group_options or {}))
        stage_tensor_parallel.finish_plan_grid(timeout)
    else:
        stage_tensor_parallel.use_plan_grid(None)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=plan.tensor_parallel,
            pipeline_model_parallel_size=plan.pipeline_parallel,
            # Model chunks per pipeline rank of the interleaved schedule (None: plain 1F1B);
            # get_forward_backward_func picks the schedule from it.
            virtual_pipeline_model_parallel_size=plan.virtual_pipeline_size,
            # The expert grid (its order inside each stage is the plan's expert_rank_at).
            expert_model_parallel_size=plan.expert_parallel,
            expert_tensor_parallel_size=plan.expert_tensor_parallel,
            context_parallel_size=plan.context_parallel,
            distributed_timeout_minutes=minutes,
            **(group_options or {}),
        )
        check_expert_groups(plan, logical_rank)
    assert (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_context_parallel_rank(),
    ) == (coords.tp_rank, coords.local_dp_rank, coords.pp_rank, coords.cp_rank), "megatron-core's rank order changed"
    from megatron.hetero import template_reduction  # imports megatron-core: after the launch checks

    template_reduction.use_plan(plan if plan.num_templates > 1 else None, timeout)
    identity = RankIdentity(launch=launch, logical_rank=logical_rank, coords=coords, device=compute_device(),
                            vendor=comm_vendor(plan, launch, found, planned=check_devices))
    set_this_rank(identity)
    return identity


def check_expert_groups(plan: Plan, logical_rank: int) -> None:
    """megatron-core's expert groups of this rank are the plan's (plan.expert_groups, whose
    replicas Plan checked for equal micro-batch counts): a change of megatron-core's expert
    order would otherwise deadlock the all-to-all of replicas with unequal counts."""
    from megatron.core import parallel_state

    pp_rank = plan.grid.coords(logical_rank).pp_rank
    for kind, planned, group in (
            ("expert model-parallel", plan.grid.expert_groups(pp_rank), parallel_state.get_expert_model_parallel_group()),
            ("expert data-parallel", plan.grid.expert_data_groups(pp_rank), parallel_state.get_expert_data_parallel_group()),
            ("expert tensor-parallel", plan.grid.expert_tensor_groups(pp_rank),
             parallel_state.get_expert_tensor_parallel_group())):
        ours = next(g for g in planned if logical_rank in g)
        built = dist.get_process_group_ranks(group)
        assert built == ours, f"megatron-core's {kind} group {built} is not the plan's {ours}"
