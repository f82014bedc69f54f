import json
import os
import sys

from conftest import make_plan
from hetero.launch import main, node_commands
from hetero.plan import Plan


def _two_node_plan() -> Plan:
    devices = [{"host": "gpu-a", "device_type": "H100-80GB", "vendor": "nvidia"}] * 4 + [
        {"host": "gpu-b", "device_type": "MI250X", "vendor": "amd"}
    ] * 2
    return Plan.from_dict(make_plan(tp=1, pp=2, dp=3, stages=[6, 2], replicas=[4, 4, 2],
                                    rank_order=[0, 1, 4, 2, 3, 5], devices=devices))


def test_one_torchrun_per_host_with_its_own_process_count():
    commands = node_commands(_two_node_plan(), "plan.json", ["--train-iters", "10"], master_port=1234)
    assert [c.host for c in commands] == ["gpu-a", "gpu-b"]
    assert commands[0].launch_ranks == [0, 1, 2, 3] and commands[1].launch_ranks == [4, 5]
    assert "--nproc-per-node=2" in commands[1].argv and "--node-rank=1" in commands[1].argv
    assert "--master-addr=gpu-a" in commands[1].argv and "--master-port=1234" in commands[1].argv
    assert commands[1].argv[-4:] == ["--hetero-plan", "plan.json", "--train-iters", "10"]
    assert commands[1].env == {}


def test_emulation_sets_per_local_rank_devices():
    commands = node_commands(_two_node_plan(), "plan.json", [], emulate_devices=True)
    assert commands[1].env == {"HETERO_DEVICE": "MI250X,MI250X", "HETERO_VENDOR": "amd,amd"}
    assert commands[1].shell().startswith("HETERO_DEVICE=MI250X,MI250X HETERO_VENDOR=amd,amd torchrun")


def test_cli_prints_and_rejects_bad_node(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_two_node_plan().to_dict()))
    assert main([str(path), "--", "--lr", "1e-4"]) == 0
    out = capsys.readouterr().out
    assert "# node 1: gpu-b, launch ranks 4-5" in out and out.count("torchrun") == 2
    assert main([str(path), "--node-rank", "5"]) == 2
    assert "outside the plan's 2 nodes" in capsys.readouterr().err


def test_run_starts_the_node_under_torchrun_without_its_traceback(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_two_node_plan().to_dict()))
    started = []
    monkeypatch.setattr(os, "execve", lambda program, argv, environ: started.append((argv, environ)))
    main([str(path), "--node-rank", "1", "--run", "--emulate-devices", "--", "--lr", "1e-4"])
    argv, environ = started[0]
    assert argv[:3] == [sys.executable, "-m", "megatron.hetero.launcher"]
    assert "--node-rank=1" in argv and argv[-2:] == ["--lr", "1e-4"]
    assert environ["HETERO_DEVICE"] == "MI250X,MI250X"


def test_launcher_ends_with_what_the_exit_codes_mean():
    from megatron.hetero.launcher import summary

    assert summary({0: 2, 1: 2, 2: 2, 3: 1, 5: -9}, "pretrain_gpt.py") == [
        "pretrain_gpt.py: launch ranks 0-2 exited with code 2 (bad input: the problems and their fixes "
        "are printed above)",
        "pretrain_gpt.py: launch rank 3 exited with code 1 (a lost rank, launcher or store, or a crash; "
        "the ranks' messages are above)",
        "pretrain_gpt.py: launch rank 5 was killed by SIGKILL",
    ]
