import json

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
