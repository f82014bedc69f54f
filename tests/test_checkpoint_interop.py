"""Checkpoints shared with Megatron-LM, and checkpoints of interleaved runs.

Megatron-LM's side is this file run as a script (one process, gloo, megatron-core 0.16.1):
it reads a checkpoint the way Megatron-LM's load_checkpoint reads a torch_dist one (the
sharded state dict built from the checkpoint's content metadata, the model under "model",
its optimizer, scheduler and "rng_state" entries, the iteration and "args" from the common
state) and writes it back the way Megatron-LM's save_checkpoint does (generate_state_dict's
keys, layers stacked under one key per tensor, its content metadata, no manifest, no plan).
The training runs are pretrain_gpt.py jobs, as in test_checkpoint.py.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import GPT_MODEL, TRAINING, make_plan, run_pretrain  # noqa: E402

SIX = GPT_MODEL + TRAINING + ["--train-iters", "6"]
# Uneven stages at their own tensor-parallel degrees, two ranks' order permuted.
STAGE_TP_PLAN = make_plan(tp=1, pp=2, dp=1, stages=[3, 1], replicas=[8], rank_order=[2, 0, 1], stage_tp=[2, 1])
# Two stages of two virtual stages each (an interleaved run, with Megatron-LM's flag), and a
# plan that splits the layers another way without virtual stages, with unequal replicas.
INTERLEAVED = make_plan(tp=1, pp=2, dp=1, stages=[2, 2], replicas=[8], rank_order=[1, 0])
UNEVEN = make_plan(tp=1, pp=2, dp=2, stages=[1, 3], replicas=[5, 3], rank_order=[1, 3, 0, 2])

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def homogeneous(tmp_path_factory):
    """One process, six iterations, a checkpoint (this runtime's) at 3: the run every resume
    must continue."""
    root = tmp_path_factory.mktemp("homogeneous") / "ckpt"
    result = run_pretrain(SIX + ["--save", str(root), "--save-interval", "3"])
    assert result.returncode == 0, result.output[-3000:]
    return root, result


def _assert_continues(resumed, reference, iterations=(4, 5, 6)):
    assert resumed.returncode == 0, resumed.output[-3000:]
    got, want = resumed.iteration_losses(), reference.iteration_losses()
    assert sorted(got) == list(iterations), resumed.output[-3000:]
    for i in iterations:  # re-sharded: reductions in another order, so equal to rounding
        assert math.isclose(got[i], want[i], rel_tol=1e-5), (i, got[i], want[i])


@pytest.mark.core019
def test_megatron_lm_reads_ours_and_ours_resumes_megatron_lm_under_a_heterogeneous_plan(tmp_path, homogeneous):
    ours, reference = homogeneous
    theirs = tmp_path / "megatron_lm"
    side = run_pretrain(SIX + ["--load", str(ours), "--ckpt-step", "3", "--save", str(theirs)],
                        script=Path(__file__))
    assert side.returncode == 0, side.output[-3000:]
    report = json.loads(side.stdout.strip().splitlines()[-1])
    # Megatron-LM's reading of our checkpoint: the weights and counters of iteration 3.
    assert report["iteration"] == 3 and report["checkpoint_version"] == 3.0
    assert report["args"] == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                              "num_layers": 4, "hidden_size": 64}
    norm_at_3 = reference.iteration_losses("params norm")[3]
    assert math.isclose(report["params_norm"], norm_at_3, rel_tol=1e-6), (report, norm_at_3)
    assert report["optimizer_steps"] == 3 and report["scheduler_steps"] == 3 * 16
    assert report["consumed_train_samples"] == 3 * 16
    # What it wrote is Megatron-LM's layout: stacked layers, its common state, no plan.
    assert (theirs / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert not (theirs / "iter_0000003" / "hetero_plan.json").exists()
    resumed = run_pretrain(SIX + ["--load", str(theirs)], nproc=3, plan=STAGE_TP_PLAN, tmp_path=tmp_path)
    assert "(written by Megatron-LM)" in resumed.stdout
    _assert_continues(resumed, reference)


def test_interleaved_run_saves_and_resumes_under_another_split(tmp_path, homogeneous):
    _, reference = homogeneous
    root = tmp_path / "ckpt"
    interleaved = ["--num-virtual-stages-per-pipeline-rank", "2"]
    first = run_pretrain(SIX + interleaved + ["--save", str(root), "--exit-interval", "3"],
                         nproc=2, plan=INTERLEAVED, tmp_path=tmp_path)
    assert first.returncode == 0, first.output[-3000:]
    for i in (1, 2, 3):
        assert math.isclose(first.iteration_losses()[i], reference.iteration_losses()[i], rel_tol=1e-5)
    resumed = run_pretrain(SIX + ["--load", str(root)], nproc=4, plan=UNEVEN, tmp_path=tmp_path)
    assert "tensors re-sharded" in resumed.stdout
    _assert_continues(resumed, reference)


def test_legacy_torch_format_resumes_exactly_and_names_the_way_to_another_plan(tmp_path):
    root = tmp_path / "ckpt"
    legacy = SIX + ["--ckpt-format", "torch"]
    first = run_pretrain(legacy + ["--save", str(root), "--save-interval", "3"])
    assert first.returncode == 0, first.output[-3000:]
    rank_file = root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"  # Megatron-LM's name
    assert rank_file.exists() and not (root / "iter_0000003" / "metadata.json").exists()
    resumed = run_pretrain(legacy + ["--load", str(root), "--ckpt-step", "3"])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.iteration_losses() == {i: first.iteration_losses()[i] for i in (4, 5, 6)}  # bit for bit
    unasked = run_pretrain(SIX + ["--load", str(root), "--ckpt-step", "3"], timeout=180)  # torch_dist
    assert unasked.returncode == 2, unasked.output[-3000:]
    assert "add --ckpt-format torch (" in unasked.stderr and "or --auto-detect-ckpt-format (" in unasked.stderr
    plan = make_plan(tp=1, pp=2, dp=1, stages=[3, 1], replicas=[8], rank_order=[1, 0])
    replanned = run_pretrain(legacy + ["--load", str(root), "--ckpt-step", "3"], nproc=2, plan=plan,
                             tmp_path=tmp_path, timeout=180)
    # Found by every rank at once, after the process groups exist: the job stops with it.
    assert replanned.returncode != 0, replanned.output[-3000:]
    assert ("it was written with tensor-parallel size 1 and pipeline-parallel size 1, this run has 1 and 2"
            in replanned.stderr)
    assert "--auto-detect-ckpt-format --ckpt-format torch_dist --save NEWDIR --exit-interval 4" in replanned.stderr


def test_another_vocabulary_names_the_padding_flag(homogeneous, tmp_path):
    root, _ = homogeneous  # NullTokenizer's 1001 tokens padded to 1024 (a multiple of 128)
    result = run_pretrain(SIX + ["--load", str(root), "--make-vocab-size-divisible-by", "8"], timeout=180)
    assert result.returncode == 2, result.output[-3000:]
    assert "the checkpoint's vocabulary is padded to 1024, this run pads its tokenizer's 1001 to 1008: " \
           "resume with --make-vocab-size-divisible-by 128" in result.stderr
    # A plan made for the padded vocabulary names the same flag, not a new plan.
    plan = make_plan(tp=1, pp=1, dp=1, stages=[4], replicas=[8], rank_order=[0])
    plan["model"] = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                     "max_position_embeddings": 32, "vocab_size": 1024}
    result = run_pretrain(SIX + ["--make-vocab-size-divisible-by", "8"], plan=plan, tmp_path=tmp_path, timeout=180)
    assert result.returncode == 2, result.output[-3000:]
    assert ("the plan was made for a vocabulary of 1024, this run pads its tokenizer's 1001 to 1008; "
            "--make-vocab-size-divisible-by 128 pads it to the plan's") in result.stderr


# ----- Megatron-LM's side (this file as a one-process script) -----------------------------


def _megatron_lm_side(argv: list[str]) -> None:
    """Loads --load (iteration --ckpt-step) as Megatron-LM's load_checkpoint does, prints
    what it read as JSON, and saves it to --save as Megatron-LM's save_checkpoint does."""
    import torch
    from megatron.hetero import startup
    from megatron.hetero.distributed import read_launch

    launch = read_launch()
    startup.prepare_process(launch.rank)
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--load")
    options.add_argument("--save")
    options.add_argument("--ckpt-step", type=int)
    paths, flags = options.parse_known_args(argv)
    job = startup.configure(flags, launch.world_size, launch)
    args = job.args
    startup.start_megatron_core()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.utils import unwrap_model
    from megatron.hetero import training

    startup.init_distributed(args, job.plan, job.plan_source)
    training.set_random_seed(args.seed)
    startup.build_tokenizer(args, job.plan)
    config, chunks = startup.build_model(args, job.plan)
    optimizer, scheduler = training.build_optimizer(args, job.plan, chunks, config.params_dtype)
    model = unwrap_model(chunks[0])
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)

    # load_checkpoint (torch_dist): the content metadata decides the sharded state dict.
    directory = Path(paths.load) / f"iter_{paths.ckpt_step:07d}"
    common = dist_checkpointing.load_common_state_dict(str(directory))
    ckpt_args = common["args"]
    metadata = {**(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}),
                "dp_cp_group": group}
    state = {"model": model.sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
    state["opt_param_scheduler"] = scheduler.state_dict()
    same_tp_pp = (ckpt_args.tensor_model_parallel_size, ckpt_args.pipeline_model_parallel_size) == (1, 1)
    if same_tp_pp:  # Megatron-LM's get_rng_state (no expert parallelism): one (pp, tp) box
        state["rng_state"] = ShardedObject("rng_state", None, (1, 1), (0, 0), replica_id=0)
    loaded = dist_checkpointing.load(state, str(directory), get_default_load_sharded_strategy(str(directory)),
                                     strict="assume_ok_unexpected")
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    rng = loaded["rng_state"][0] if same_tp_pp else None
    if rng is not None:
        torch.set_rng_state(rng["torch_rng_state"])
        get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])
    steps = {int(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s}
    report = {
        "iteration": common["iteration"], "checkpoint_version": common["checkpoint_version"],
        "args": {name: getattr(ckpt_args, name) for name in ("tensor_model_parallel_size",
                                                              "pipeline_model_parallel_size", "num_layers",
                                                              "hidden_size")},
        "params_norm": math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in model.parameters())),
        "optimizer_steps": steps.pop() if len(steps) == 1 else sorted(steps),
        "scheduler_steps": scheduler.num_steps,
        "num_floating_point_operations_so_far": common["num_floating_point_operations_so_far"],
        "consumed_train_samples": ckpt_args.consumed_train_samples,  # where its data resumes
    }

    # save_checkpoint (torch_dist): generate_state_dict's keys, its content metadata.
    saving = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True, "dp_cp_group": group}
    state = {"args": ckpt_args, "checkpoint_version": 3.0, "iteration": common["iteration"],
             "model": model.sharded_state_dict(metadata=saving)}
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=saving)
    state["opt_param_scheduler"] = scheduler.state_dict()
    rng_states = [{"random_rng_state": None, "np_rng_state": None, "torch_rng_state": torch.get_rng_state(),
                   "rng_tracker_states": get_cuda_rng_tracker().get_states()}]
    import random

    import numpy as np

    rng_states[0].update(random_rng_state=random.getstate(), np_rng_state=np.random.get_state())
    state["rng_state"] = ShardedObject("rng_state", rng_states, (1, 1), (0, 0), replica_id=0)
    state["num_floating_point_operations_so_far"] = common["num_floating_point_operations_so_far"]
    target = Path(paths.save) / f"iter_{common['iteration']:07d}"
    target.mkdir(parents=True)
    content = {k: v for k, v in saving.items() if k != "dp_cp_group"}
    dist_checkpointing.save(state, str(target), get_default_save_sharded_strategy("torch_dist"),
                            content_metadata=content)
    (Path(paths.save) / "latest_checkpointed_iteration.txt").write_text(str(common["iteration"]))
    torch.distributed.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    _megatron_lm_side(sys.argv[1:])
