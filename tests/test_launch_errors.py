"""Bad input stops the job on every rank with one message that names every problem and its fix.

Each multi-process case is a real launch; the timeout proves no rank waits in a collective.
Every rank checks; the message is printed once per node (by its first rank) and the job
exits 2.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import GPT_MODEL, REPO, TRAINING, make_plan, run_pretrain
from hetero.errors import HeteroError
from hetero.plan import Plan
from megatron.hetero.startup import configure

ARGS = GPT_MODEL + TRAINING
QUICK = 120  # seconds; a hang would run into the distributed timeout (minutes)


def _said_once(result, *fragments: str) -> None:
    """Exit 2, the error printed by launch rank 0 only, every fragment in it, no traceback."""
    assert result.returncode == 2, result.output[-3000:]
    speakers = [line.split("]")[0] + "]" for line in result.stderr.splitlines() if "] error:" in line]
    assert speakers == ["[launch rank 0]"], result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.output


# Five mistakes of a launch script written for another set-up: a refused flag, an unknown
# flag (a typo), two flags against the plan, a model the plan was not made for, and (in the
# launch) a process that is not the plan's device.
_FIVE_MISTAKES = ["--fp8-format", "hybrid", "--tensor-parallel-size", "2",
                  "--pipeline-model-parallel-size", "4", "--micro-batch-size", "4"]
_EXPECTED = ("--fp8-format: FP8", "unknown flag --tensor-parallel-size (did you mean --tensor-model-parallel-size?)",
             "--pipeline-model-parallel-size 4 contradicts the plan (2)", "--micro-batch-size 4 contradicts the plan (2)",
             "hidden-size: plan 128, flags 64")


def _plan_for_another_model(devices=None) -> dict:
    plan = make_plan(tp=1, pp=2, dp=1, stages=[2, 2], replicas=[8], rank_order=[0, 1], devices=devices)
    plan["model"] = {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 32,
                     "vocab_size": 1024}
    return plan


def test_every_problem_of_the_flags_and_plan_in_one_error(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan_for_another_model()))
    with pytest.raises(HeteroError) as raised:
        configure(ARGS + _FIVE_MISTAKES + ["--hetero-plan", str(path)], 2)
    message = str(raised.value)
    assert message.startswith("4 problems with this launch")
    for fragment in _EXPECTED:
        assert fragment in message, message


def test_steps_after_a_failed_one_still_check_what_they_can(tmp_path):
    # No plan to apply and a refused flag: the flags' own checks still run.
    with pytest.raises(HeteroError) as raised:
        configure(ARGS + ["--hetero-plan", str(tmp_path / "missing.json"), "--fp8-format", "hybrid",
                          "--bf16", "--fp16"], 1)
    message = str(raised.value)
    for fragment in ("plan file", "--fp8-format", "--bf16 and --fp16 are mutually exclusive"):
        assert fragment in message, message


def test_a_refused_flag_comes_first_even_where_the_flags_make_no_plan():
    # The flags' layout gives no plan (an expert layout the runtime refuses), and a
    # performance flag is refused: both are said, the refused flag first - it stops the
    # launch whatever the layout.
    expert_layout = ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "4"]
    with pytest.raises(HeteroError) as raised:
        configure(ARGS + expert_layout + ["--num-experts", "4", "--disable-bias-linear", "--overlap-grad-reduce",
                                          "--overlap-param-gather"], 2)
    problems = re.findall(r"^  \d\. (.*)$", str(raised.value), flags=re.MULTILINE)
    assert len(problems) == 2, str(raised.value)
    assert problems[0].startswith("--overlap-param-gather gathers the distributed optimizer's shards")
    assert problems[1].startswith("the expert layout of --expert-model-parallel-size")
    # A model without experts: the expert layout shapes no parameter (megatron-core builds
    # its groups, nothing uses them), so it stops nothing.
    assert configure(ARGS + expert_layout, 2).plan.expert_tensor_parallel is None


@pytest.mark.slow
def test_five_mistakes_in_one_launch(tmp_path):
    devices = [{"host": "node0", "device_type": "cpu", "vendor": "cpu"},
               {"host": "node0", "device_type": "A100-40GB", "vendor": "nvidia"}]
    result = run_pretrain(ARGS + _FIVE_MISTAKES, nproc=2, plan=_plan_for_another_model(devices),
                          tmp_path=tmp_path, timeout=QUICK)
    _said_once(result, "5 problems with this launch", *_EXPECTED,
               "launch rank 1 (logical rank 1, host node0): the plan expects A100-40GB (nvidia), found cpu")


@pytest.mark.slow
def test_malformed_plan(tmp_path):
    plan = make_plan(tp=1, pp=2, dp=1, stages=[4, 0], replicas=[8], rank_order=[0, 1])
    result = run_pretrain(ARGS, nproc=2, plan=plan, tmp_path=tmp_path, timeout=QUICK)
    _said_once(result, "not a valid hetero plan", "stages[1].num_layers", "regenerate the plan")


@pytest.mark.slow
def test_plan_for_another_world_size(tmp_path):
    plan = make_plan(tp=1, pp=2, dp=2, stages=[2, 2], replicas=[4, 4], rank_order=[0, 1, 2, 3])
    result = run_pretrain(ARGS, nproc=2, plan=plan, tmp_path=tmp_path, timeout=QUICK)
    _said_once(result, "is for 4 processes", "launched with 2")


@pytest.mark.slow
def test_device_mismatch_is_found_by_every_rank(tmp_path):
    devices = [
        {"host": "node0", "device_type": "cpu", "vendor": "cpu"},
        {"host": "node0", "device_type": "A100-40GB", "vendor": "nvidia"},
    ]
    plan = make_plan(tp=1, pp=2, dp=1, stages=[2, 2], replicas=[8], rank_order=[1, 0], devices=devices)
    result = run_pretrain(ARGS, nproc=2, plan=plan, tmp_path=tmp_path, timeout=QUICK)
    _said_once(
        result,
        "launch rank 1 (logical rank 0, host node0): the plan expects A100-40GB (nvidia), found cpu",
        "HETERO_DEVICE=A100-40GB",
    )
    assert "launch rank 0 (logical" not in result.stderr  # the matching rank is not blamed


@pytest.mark.slow
def test_emulated_devices_pass_the_check_and_train(tmp_path):
    devices = [
        {"host": "node0", "device_type": "H100-80GB", "vendor": "nvidia"},
        {"host": "node0", "device_type": "MI250X", "vendor": "amd"},
    ]
    plan = make_plan(tp=1, pp=2, dp=1, stages=[3, 1], replicas=[8], rank_order=[1, 0], devices=devices)
    result = run_pretrain(
        GPT_MODEL + TRAINING + ["--train-iters", "2", "--eval-iters", "0"],
        nproc=2, plan=plan, tmp_path=tmp_path,
        env={"HETERO_DEVICE": "H100-80GB,MI250X", "HETERO_VENDOR": "nvidia,amd"},
    )
    assert result.returncode == 0, result.output[-3000:]
    assert len(result.losses()) == 2
    assert "-> launch rank    1 on node0 (MI250X, amd)" in result.stdout


def test_unknown_flag():
    result = run_pretrain(ARGS + ["--tensor-parallel-size", "2"], timeout=QUICK)
    _said_once(result, "unknown flag --tensor-parallel-size", "did you mean --tensor-model-parallel-size?")


def test_flag_contradicting_the_plan(tmp_path):
    plan = make_plan(tp=1, pp=1, dp=1, stages=[4], replicas=[8], rank_order=[0])
    # TRAINING says 16; the last occurrence of a flag wins, as in Megatron-LM.
    result = run_pretrain(ARGS + ["--global-batch-size", "32"], plan=plan, tmp_path=tmp_path,
                          timeout=QUICK)
    _said_once(result, "--global-batch-size 32 contradicts the plan (16)")


def test_missing_plan_file():
    result = run_pretrain(ARGS + ["--hetero-plan", "/nonexistent/plan.json"], timeout=QUICK)
    _said_once(result, "plan file /nonexistent/plan.json does not exist")


@pytest.mark.slow
def test_torchrun_ends_without_a_traceback_of_its_own(tmp_path):
    """Bad input under torchrun: plain torchrun's failure summary points at our message (it
    still prints its own traceback); megatron.hetero.launcher, the same launch, prints none
    and exits with the workers' code."""
    bad = ARGS[:] + ["--hiden-size", "64"]
    bad.remove("--lr"), bad.remove("1e-3")  # fails validation: no megatron-core import, a quick launch
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    runs = {}
    for name, module in (("torchrun", "torch.distributed.run"), ("ours", "megatron.hetero.launcher")):
        runs[name] = subprocess.run(
            [sys.executable, "-m", module, "--standalone", "--nproc-per-node=1", str(REPO / "pretrain_gpt.py"), *bad],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=QUICK)
    plain, ours = runs["torchrun"], runs["ours"]
    assert plain.returncode == 1 and "ChildFailedError" in plain.stderr, plain.stderr[-3000:]
    assert "traceback : bad input (exit code 2), not a crash" in plain.stderr
    assert ours.returncode == 2, ours.stderr[-3000:]
    assert "Traceback" not in ours.stderr and "ChildFailedError" not in ours.stderr
    assert ours.stderr.count("] error: 2 problems with this launch") == 1
    assert "unknown flag --hiden-size (did you mean --hidden-size?)" in ours.stderr
    assert "missing required flag(s): --lr" in ours.stderr
    # torchrun lists the ranks it saw fail before it stopped the rest
    assert re.search(r"^pretrain_gpt\.py: launch ranks? [0-9, -]+ exited with code 2 \(bad input", ours.stderr,
                     re.MULTILINE), ours.stderr[-3000:]


def test_help_is_short_and_imports_no_torch():
    """--help and --help-all rendered in one process, which must not have imported torch."""
    probe = (
        "import contextlib, io, json, runpy, sys\n"
        "out = {}\n"
        "for flag in ('--help', '--help-all'):\n"
        "    sys.argv = ['pretrain_gpt.py', flag]\n"
        "    text = io.StringIO()\n"
        "    with contextlib.redirect_stdout(text):\n"
        "        try:\n"
        "            runpy.run_path('pretrain_gpt.py', run_name='__main__')\n"
        "        except SystemExit as stop:\n"
        "            out[flag + ' exit'] = stop.code\n"
        "    out[flag] = text.getvalue()\n"
        "out['imported'] = sorted(m for m in ('torch', 'megatron.core') if m in sys.modules)\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=QUICK)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["imported"] == []
    assert out["--help exit"] == 0 and out["--help-all exit"] == 0
    short, full = out["--help"].splitlines(), out["--help-all"].splitlines()
    assert 20 < len(short) <= 130, len(short)  # the honoured flags, a few screens; was 1,449 lines
    assert all(len(line) <= 100 for line in short)
    assert "--help-all" in out["--help"] and "docs/flags.md" in out["--help"]
    for honoured in ("--hidden-size", "--hetero-plan", "--use-distributed-optimizer", "--load"):
        assert honoured in out["--help"]
    assert len(full) > 10 * len(short) and "--fp8-format" in out["--help-all"]



@pytest.mark.slow
def test_a_rank_with_a_problem_of_its_own_says_it_too(tmp_path):
    """Launch rank 1 stands in for a V100 (no bf16): its error differs from rank 0's, so
    both are printed; rank 0's names rank 1's device, found through the store."""
    devices = [{"host": "node0", "device_type": "A100-40GB", "vendor": "nvidia"}] * 2
    plan = make_plan(tp=1, pp=2, dp=1, stages=[2, 2], replicas=[8], rank_order=[0, 1], devices=devices)
    result = run_pretrain(ARGS + ["--bf16"], nproc=2, plan=plan, tmp_path=tmp_path, timeout=QUICK,
                          env={"HETERO_DEVICE": "A100-40GB,V100-32GB"})
    assert result.returncode == 2, result.output[-3000:]
    own = [line for line in result.stderr.splitlines() if line.startswith("[launch rank 1] error:")]
    assert own and "2 problems with this launch" in own[0], result.stderr[-3000:]
    assert "--bf16" in result.stderr.split("[launch rank 1] error:")[1]
    assert "[launch rank 0] error: 1 of 2 processes do not match the plan's devices" in result.stderr


def test_processes_without_gpus_are_shown_the_per_local_rank_emulation():
    """A plan of two device types launched by one torchrun on CPUs: the fix names the one
    HETERO_DEVICE value that gives each local rank its device."""
    from megatron.hetero.distributed import FoundDevice, check_device_reports
    from hetero.env import Launch

    devices = [{"host": "n0", "device_type": "cpu-fast", "vendor": "cpu"}] * 2 + \
              [{"host": "n1", "device_type": "cpu-slow", "vendor": "cpu"}] * 2
    plan = Plan.from_dict(make_plan(tp=1, pp=2, dp=2, stages=[2, 2], replicas=[4, 4], rank_order=[0, 1, 2, 3],
                                    devices=devices))
    found = [FoundDevice("cpu", "cpu", "no GPU visible")] * 4
    with pytest.raises(HeteroError) as err:
        check_device_reports(plan, Launch(rank=0, world_size=4, local_rank=0, local_world_size=4), found)
    assert "HETERO_DEVICE=cpu-fast,cpu-fast,cpu-slow,cpu-slow" in str(err.value)
