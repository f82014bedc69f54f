"""hetero.env: every variable's parsing, and that nothing else reads Megatron-Hetero's variables."""

from __future__ import annotations

import re

import pytest

from conftest import REPO
from hetero import env
from hetero.env import EnvError, Launch
from hetero.errors import HeteroError


def test_launch_is_read_from_torchrun_variables():
    assert env.launch({}) is None  # a bare `python`
    assert env.launch({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == \
        Launch(rank=3, world_size=4, local_rank=1, local_world_size=2)
    # LOCAL_RANK defaults to 0; LOCAL_WORLD_SIZE may be missing (a hand-made launch)
    assert env.launch({"RANK": "0", "WORLD_SIZE": "1"}) == Launch(0, 1, 0, None)
    assert env.launch_rank({}) == 0
    assert env.launch_rank({"RANK": "2", "WORLD_SIZE": "3"}) == 2


@pytest.mark.parametrize("environ, fragments", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x'", "this process's launch rank"]),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, ["RANK='-1'", "of at least 0"]),
    ({"RANK": "0"}, ["WORLD_SIZE is not", "launch with torchrun"]),
    ({"RANK": "0", "WORLD_SIZE": "0"}, ["WORLD_SIZE='0'", "of at least 1"]),
    ({"RANK": "4", "WORLD_SIZE": "4"}, ["RANK=4 is outside WORLD_SIZE=4", "ranks 0..3"]),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     ["LOCAL_RANK=2 is outside LOCAL_WORLD_SIZE=2"]),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "one"}, ["LOCAL_RANK='one'"]),
])
def test_bad_launch_variables_are_named_with_the_fix(environ, fragments):
    with pytest.raises(EnvError) as raised:
        env.launch(environ)
    for fragment in fragments:
        assert fragment in str(raised.value)


def test_per_local_rank_lists_are_indexed_by_local_rank():
    node = {"HETERO_DEVICE": "H100-80GB, MI250X", "HETERO_VENDOR": "NVIDIA,amd", "LOCAL_WORLD_SIZE": "2"}
    assert env.device({**node, "LOCAL_RANK": "0"}) == "H100-80GB"
    assert env.device({**node, "LOCAL_RANK": "1"}) == "MI250X"
    assert env.vendor({**node, "LOCAL_RANK": "0"}) == "nvidia"  # vendors are lower case
    assert env.vendor({**node, "LOCAL_RANK": "1"}) == "amd"
    # One entry is every local rank's; unset or blank is None.
    assert env.device({"HETERO_DEVICE": "cpu-fast", "LOCAL_RANK": "5"}) == "cpu-fast"
    assert env.device({}) is None and env.device({"HETERO_DEVICE": "  "}) is None
    assert env.emulator_cpu({"HETERO_EMULATOR_CPUS": "3,0", "LOCAL_RANK": "1"}) == 0
    assert env.emulator_cgroup({"HETERO_EMULATOR_CGROUPS": "/a,/b", "LOCAL_RANK": "1"}) == "/b"
    assert env.per_local_rank_value(["H100-80GB", "MI250X"], env.DEVICE) == "H100-80GB,MI250X"
    process = env.this_process({**node, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                "HETERO_EMULATED_HOST": "node-a"})
    assert (process.launch.rank, process.host, process.device, process.vendor) == (1, "node-a", "MI250X", "amd")


@pytest.mark.parametrize("environ, fragments", [
    ({"HETERO_DEVICE": "a,b", "LOCAL_RANK": "2"}, ["HETERO_DEVICE=a,b lists 2 entries", "LOCAL_RANK 2",
                                                   "one entry per local rank"]),
    ({"HETERO_DEVICE": "a,b,c", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
     ["lists 3 entries", "2 local ranks (LOCAL_WORLD_SIZE)"]),
    ({"HETERO_VENDOR": "nvidia,,amd"}, ["HETERO_VENDOR='nvidia,,amd' has an empty entry"]),
    ({"HETERO_EMULATOR_CPUS": "x"}, ["HETERO_EMULATOR_CPUS=x", "core numbers"]),
])
def test_bad_per_local_rank_lists(environ, fragments):
    with pytest.raises(EnvError) as raised:
        env.device(environ) if "HETERO_DEVICE" in environ else \
            env.vendor(environ) if "HETERO_VENDOR" in environ else env.emulator_cpu(environ)
    for fragment in fragments:
        assert fragment in str(raised.value)
    with pytest.raises(EnvError, match="non-empty names without commas"):
        env.per_local_rank_value(["a,b"], env.DEVICE)


def test_settings():
    assert env.keep_freed_memory({}) is False
    for on in ("1", "true", "YES", "on"):
        assert env.keep_freed_memory({"HETERO_CPU_KEEP_FREED_MEMORY": on}) is True
    for off in ("0", "false", "no", "off", ""):
        assert env.keep_freed_memory({"HETERO_CPU_KEEP_FREED_MEMORY": off}) is False
    with pytest.raises(EnvError, match=r"HETERO_CPU_KEEP_FREED_MEMORY='2' is neither on nor off; set "
                                       r"HETERO_CPU_KEEP_FREED_MEMORY=1 or HETERO_CPU_KEEP_FREED_MEMORY=0"):
        env.keep_freed_memory({"HETERO_CPU_KEEP_FREED_MEMORY": "2"})
    assert env.trace_iteration({}) == 3 and env.trace_iteration({"HETERO_TRACE_ITERATION": "7"}) == 7
    with pytest.raises(EnvError, match="HETERO_TRACE_ITERATION='0': give an iteration number of at least 1"):
        env.trace_iteration({"HETERO_TRACE_ITERATION": "0"})
    assert env.trace_dir({}) is None and env.trace_dir({"HETERO_TRACE_DIR": "/t"}) == "/t"
    assert env.events_dir({"HETERO_EVENTS_DIR": "/e"}) == "/e"
    assert env.comm_chunk_bytes({}) == 4 << 20
    assert env.comm_chunk_bytes({"HETERO_COMM_CHUNK_BYTES": "1024"}) == 1024
    with pytest.raises(EnvError, match="HETERO_COMM_CHUNK_BYTES='4k': give a number of bytes of at least 1"):
        env.comm_chunk_bytes({"HETERO_COMM_CHUNK_BYTES": "4k"})
    assert env.comm_wrap_single_vendor({"HETERO_COMM_WRAP_SINGLE_VENDOR": "1"}) is True
    assert env.allow_untested_megatron_core({}) is False
    assert env.omp_num_threads({"OMP_NUM_THREADS": "2"}) == 2 and env.omp_num_threads({}) is None
    assert env.host({"HETERO_EMULATED_HOST": "node-slow"}) == "node-slow"
    assert env.under_torchrun_agent({"TORCHELASTIC_RUN_ID": "x"}) and not env.under_torchrun_agent({})


def test_read_when_asked_not_at_import(monkeypatch):
    """A process forked from one that imported hetero.env (the tests' job server) has an
    environment of its own: nothing is cached."""
    monkeypatch.setenv("HETERO_DEVICE", "a")
    assert env.device() == "a"
    monkeypatch.setenv("HETERO_DEVICE", "b")
    assert env.device() == "b"


def test_precision_check_reads_this_local_ranks_device(monkeypatch):
    """The bf16 check looks at the device this process stands in for (its LOCAL_RANK's
    entry), as the device check does: not at every entry of the node's list."""
    from types import SimpleNamespace

    from hetero.plan import Plan
    from megatron.hetero.arguments import check_precision_supported

    plan = Plan.uniform(tensor_parallel=1, pipeline_parallel=1, data_parallel=2, micro_batch_size=2,
                        num_layers=4, global_batch_size=16)
    args = SimpleNamespace(params_dtype="bf16")
    monkeypatch.setenv("HETERO_DEVICE", "H100-80GB,V100-16GB")
    monkeypatch.setenv("LOCAL_RANK", "0")
    check_precision_supported(args, plan)  # H100: bf16 is fine
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(HeteroError, match="--bf16 is not supported by V100-16GB"):
        check_precision_supported(args, plan)


_READERS = re.compile(r"os\.environ(?:\.get)?\(?\[?\s*[\"'](HETERO_[A-Z_]+)|getenv\(\s*[\"'](HETERO_[A-Z_]+)")


def test_only_hetero_env_reads_the_variables():
    """Megatron-Hetero's variables are parsed in hetero/env.py alone, and every one it names
    is documented in VARIABLES."""
    readers = []
    for folder in ("hetero", "hetero_comm", "megatron/hetero", "tools", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name == "env.py" and path.parent.name == "hetero":
                continue
            for match in _READERS.finditer(path.read_text()):
                readers.append(f"{path.relative_to(REPO)}: {match.group(0)}")
    assert not readers, "read these through hetero.env:\n" + "\n".join(readers)
    source = (REPO / "hetero" / "env.py").read_text()
    named = set(re.findall(r"\"(HETERO_[A-Z_]+)\"", source))
    assert named == {name for name in env.VARIABLES if name.startswith("HETERO_")}


def test_a_store_port_is_free_and_outside_the_ephemeral_range():
    """A port from bind(0) is an ephemeral one, which gloo's outgoing connections in a job
    running beside this one can take before the store listens (EADDRINUSE)."""
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        ephemeral_start = int(ports.read().split()[0])
    held = []
    try:
        for _ in range(20):
            port = env.unused_port()
            assert port < ephemeral_start
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))  # free when handed out: this bind must succeed
            held.append(sock)
    finally:
        for sock in held:
            sock.close()
