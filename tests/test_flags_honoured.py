"""Megatron-LM flags honoured with Megatron-LM's meaning: each test fails if its flags are
ignored (in-process where the effect is a megatron-core config; one tiny run for the loop)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import GPT_MODEL, TRAINING, run_pretrain
from hetero.errors import HeteroError
from megatron.hetero.startup import configure

BASE = GPT_MODEL + TRAINING


def _args(*given: str):
    return configure(BASE + list(given), 1).args


def test_ddp_flags_reach_megatron_cores_ddp_config():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.hetero.arguments import config_from_flags
    from megatron.hetero.model import megatron_ddp_fields

    stage = torch.nn.Linear(10, 10)  # 110 parameters
    default = megatron_ddp_fields(_args(), [stage])
    # Megatron-LM checks unless told not to (on GPUs: megatron-core reports through torch.cuda).
    assert default["check_for_nan_in_grad"] is torch.cuda.is_available()
    assert "bucket_size" not in default
    args = _args("--no-check-for-nan-in-loss-and-grad", "--ddp-num-buckets", "4",
                 "--ddp-pad-buckets-for-high-nccl-busbw", "--ddp-reduce-scatter-with-fp32-accumulation")
    config = config_from_flags(DistributedDataParallelConfig, args, **megatron_ddp_fields(args, [stage]))
    assert (config.check_for_nan_in_grad, config.bucket_size, config.pad_buckets_for_high_nccl_busbw,
            config.reduce_scatter_with_fp32_accumulation) == (False, 110 // 4, True, True)


def test_ddp_num_buckets_is_checked_as_megatron_lm_does():
    for given in (["--ddp-num-buckets", "0"], ["--ddp-num-buckets", "2", "--ddp-bucket-size", "100"]):
        with pytest.raises(HeteroError, match="--ddp-num-buckets"):
            _args(*given)
    # Dynamic loss scaling reads NaN gradients as its signal: the check is off, as in Megatron-LM.
    assert _args("--fp16").check_for_nan_in_loss_and_grad is False
    assert _args("--fp16", "--loss-scale", "1024").check_for_nan_in_loss_and_grad is True


def test_nan_loss_stops_the_run_unless_the_check_is_off():
    from megatron.hetero.training import _finite_loss, checked_forward_step, forward_step, forward_step_for, loss_func

    checked = forward_step_for(_args())
    assert checked.func is checked_forward_step and checked.keywords == {"rerun_mode": "validate_results"}
    assert forward_step_for(_args("--rerun-mode", "disabled")).keywords == {"rerun_mode": "disabled"}
    assert forward_step_for(_args("--no-check-for-nan-in-loss-and-grad")) is forward_step

    mask = torch.ones(4)
    finite = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert _finite_loss(lambda out: loss_func(mask, out), "disabled", finite)[0].item() == 10.0
    for bad, kind in ((float("nan"), "NaN"), (float("inf"), "Inf")):
        poisoned = finite.clone()
        poisoned[2] = bad
        with pytest.raises(HeteroError, match=f"found {kind} in local forward loss") as stopped:
            _finite_loss(lambda out: loss_func(mask, out), "disabled", poisoned)
        assert "re-run" not in str(stopped.value)
        # Megatron-LM's default, validate_results, would re-run the iteration first: the
        # message says this run did not.
        with pytest.raises(HeteroError, match="was not re-run to tell a transient fault"):
            _finite_loss(lambda out: loss_func(mask, out), "validate_results", poisoned)


def test_config_field_flags_reach_transformer_config():
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.hetero.arguments import honoured_config_values

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    values = honoured_config_values(_args(
        "--no-initialization", "--microbatch-group-size-per-virtual-pipeline-stage", "4",
        "--overlap-p2p-communication-warmup-flush"), fields)
    assert values["perform_initialization"] is False
    assert values["microbatch_group_size_per_vp_stage"] == 4
    assert values["overlap_p2p_comm_warmup_flush"] is True
    assert honoured_config_values(_args(), fields)["perform_initialization"] is True


@pytest.mark.slow
def test_run_control_flags_in_the_training_loop():
    result = run_pretrain(GPT_MODEL + TRAINING + [
        "--num-layers", "2", "--global-batch-size", "8", "--train-iters", "3",
        "--iterations-to-skip", "1", "--train-sync-interval", "1",
        "--distributed-timeout-seconds-after-init", "30", "--check-weight-hash-across-dp-replicas-interval", "3",
        "--data-parallel-random-init", "--hidden-dropout", "0.1",
        "--overlap-grad-reduce", "--ddp-num-buckets", "2"], nproc=2)
    assert result.returncode == 0, result.output[-3000:]
    assert "skipping iteration 2 (--iterations-to-skip)" in result.stdout
    losses = result.iteration_losses()
    assert sorted(losses) == [1, 3]  # the skipped iteration trains nothing and logs nothing
    assert all(math.isfinite(v) for v in losses.values())
    assert "this rank's parameters in 2 buckets" in result.stdout
    # The data moved past the skipped batch: 3 iterations of 8 samples consumed.
    assert "consumed samples:           24" in result.stdout
    # Every replica holds the same weights, before training and at the interval (with
    # --data-parallel-random-init too: only the replicas' random streams differ).
    assert [line for line in result.stdout.splitlines() if "Weight hashes match" in line] == [
        ">>> Weight hashes match after 0 iterations...", ">>> Weight hashes match after 3 iterations..."]


def _indexed_dataset(prefix, low: int, high: int):
    """A megatron-core .bin/.idx pair of 200 documents of tokens in [low, high)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    rng = np.random.default_rng(low)
    for _ in range(200):
        builder.add_item(torch.from_numpy(rng.integers(low, high, int(rng.integers(20, 80))).astype(np.int32)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _data_args(*given: str):
    return configure(GPT_MODEL + [a for a in TRAINING if a != "--mock-data"] + list(given), 1).args


def test_a_dataset_per_split(tmp_path):
    from megatron.hetero import data

    low, high = _indexed_dataset(tmp_path / "low", 0, 500), _indexed_dataset(tmp_path / "high", 500, 1000)
    (tmp_path / "splits.json").write_text(f'{{"train": ["{low}"], "valid": "1 {high}", "test": []}}')
    for given in (["--train-data-path", low, "--valid-data-path", high],
                  ["--per-split-data-args-path", str(tmp_path / "splits.json")]):
        args = _data_args(*given)
        data.check_data_paths(args)
        train, valid, test = data.build_datasets(args, data.build_tokenizer(args), 64)
        assert test is None and args.split is None
        assert all(int(train[i]["tokens"].max()) < 500 for i in range(8))  # train reads "low" only
        assert all(int(valid[i]["tokens"].min()) >= 500 for i in range(8))  # validation "high" only
    (tmp_path / "data_args").write_text(f"0.3 {low}\n0.7 {high}\n")
    assert _data_args("--data-args-path", str(tmp_path / "data_args")).data_path == ["0.3", low, "0.7", high]
    with pytest.raises(HeteroError, match="--split"):
        _data_args("--train-data-path", low, "--split", "90,8,2")


@pytest.mark.slow
def test_checkpoint_progress_and_profiling_flags(tmp_path):
    from megatron.core import dist_checkpointing

    short = GPT_MODEL + TRAINING + ["--num-layers", "2", "--global-batch-size", "4", "--train-iters", "2"]
    empty = tmp_path / "empty"
    empty.mkdir()
    exited = run_pretrain(short + ["--load", str(empty), "--exit-on-missing-checkpoint"])
    assert exited.returncode == 0, exited.output[-3000:]
    assert "--exit-on-missing-checkpoint" in exited.stdout and not exited.iteration_losses()

    saved = run_pretrain(short + ["--save", str(tmp_path / "ckpt"), "--no-save-optim", "--no-save-rng",
                                  "--save-interval", "1", "--save-retain-interval", "2", "--train-iters", "3",
                                  "--ckpt-assume-constant-structure",
                                  "--log-progress", "--profile", "--use-pytorch-profiler",
                                  "--profile-step-start", "1", "--profile-step-end", "2",
                                  "--tensorboard-dir", str(tmp_path / "tb"),
                                  "--dump-param-to-param-group-map", str(tmp_path / "groups")])
    assert saved.returncode == 0, saved.output[-3000:]
    from torch.distributed.checkpoint import FileSystemReader

    grouped = FileSystemReader(str(tmp_path / "groups")).read_metadata().state_dict_metadata
    assert "module.decoder.layers.0.self_attention.linear_qkv.weight" in grouped  # megatron-core's map
    traces = list((tmp_path / "tb").glob("*.pt.trace.json"))  # torch.profiler's trace of iteration 2
    assert len(traces) == 1 and "ProfilerStep#1" in traces[0].read_text()
    progress = (tmp_path / "ckpt" / "progress.txt").read_text().splitlines()
    assert [line.split("\t")[3:5] for line in progress] == [["Starting job"]] + [
        ["Saved checkpoint", f"Iteration: {i}"] for i in (1, 2, 3)]
    assert "# GPUs: 1" in progress[2]
    operations = [float(line.split("Floating-point operations: ")[1].split("\t")[0]) for line in progress[1:]]
    assert 0 < operations[0] and math.isclose(operations[1], 2 * operations[0], rel_tol=1e-6)
    # --save-retain-interval 2: iteration 1's checkpoint went when iteration 2's was written.
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    directory = tmp_path / "ckpt" / "iter_0000003"
    common = dist_checkpointing.load_common_state_dict(str(directory))
    assert (common["hetero"]["optimizer_saved"], common["hetero"]["rng_form"]) == (False, None)
    stored = dist_checkpointing.load_tensors_metadata(str(directory))
    assert stored and not any(key.startswith("optimizer") for key in stored)  # weights only
    resumed = run_pretrain(short + ["--load", str(tmp_path / "ckpt"), "--train-iters", "4"])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert sorted(resumed.iteration_losses()) == [4]
    # --use-checkpoint-args: the model flags left out come from the checkpoint (2 layers, not
    # GPT_MODEL's 4), and the run resumes it.
    unshaped = [a for a in TRAINING] + ["--global-batch-size", "4", "--train-iters", "4", "--use-checkpoint-args",
                                        "--load", str(tmp_path / "ckpt")]
    job = configure(unshaped, 1)
    assert (job.args.num_layers, job.args.hidden_size, job.args.num_attention_heads, job.args.seq_length) == (2, 64, 4, 32)
    assert "Setting num_layers to 2 from checkpoint" in job.args.startup_notes
    converted = run_pretrain(short + ["--load", str(tmp_path / "ckpt"), "--ckpt-convert-format", "torch_dist",
                                      "--ckpt-convert-save", str(tmp_path / "converted")])
    assert converted.returncode == 0, converted.output[-3000:]
    assert "> converted checkpoint:" in converted.stdout and not converted.iteration_losses()
    assert (tmp_path / "converted" / "torch_dist" / "iter_0000003" / "metadata.json").is_file()
    finetuned = run_pretrain(short + ["--load", str(empty), "--pretrained-checkpoint", str(tmp_path / "ckpt")])
    assert finetuned.returncode == 0, finetuned.output[-3000:]
    assert "fine-tuning from --pretrained-checkpoint" in finetuned.stdout
    assert sorted(finetuned.iteration_losses()) == [1, 2]  # weights loaded, counting from 0 (--finetune)
    assert finetuned.iteration_losses()[1] < saved.iteration_losses()[1]  # not a fresh model


def test_override_opt_param_scheduler_keeps_the_flags_schedule():
    from megatron.hetero.training import build_scheduler

    def resumed_max_lr(*given: str) -> float:
        job = configure(BASE + ["--lr", "2e-3", *given], 1)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
        scheduler = build_scheduler(job.args, job.plan, optimizer)
        scheduler.load_state_dict({**scheduler.state_dict(), "max_lr": 5e-3})  # another run's schedule
        return scheduler.max_lr

    assert resumed_max_lr() == 5e-3  # the checkpoint's schedule resumes
    assert resumed_max_lr("--override-opt_param-scheduler") == 2e-3
    assert resumed_max_lr("--override-opt-param-scheduler") == 2e-3
    with pytest.raises(HeteroError, match="give one"):
        configure(BASE + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], 1)


def test_disable_jit_fuser_stops_megatron_cores_fusions_compiling(monkeypatch):
    import megatron.core.jit as jit
    from megatron.hetero import patches

    monkeypatch.setattr(patches, "_no_gpu", lambda: False)  # as on a GPU, where fusions compile
    monkeypatch.setitem(patches._JIT_FUSER, "disabled", False)
    monkeypatch.setattr(jit, "jit_fuser", jit.jit_fuser)
    assert patches.compiles_fusions()
    assert _args("--disable-jit-fuser").disable_jit_fuser
    patches.disable_jit_fuser()
    assert not patches.compiles_fusions() and jit.jit_fuser is jit.noop_decorator


def test_tp_pp_dp_mapping_orders_the_uniform_plans_ranks(tmp_path):
    import json

    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    default = configure(BASE + layout, 8).plan
    mapped = configure(BASE + layout + ["--use-tp-pp-dp-mapping"], 8).plan
    assert default.rank_order == list(range(8))
    for stage in range(2):
        for replica in range(2):
            for rank in range(2):  # Megatron-LM's tp-pp-dp rank of (tp, dp, pp)
                assert mapped.launch_rank(mapped.grid.rank_at(rank, replica, stage)) == rank + 2 * (stage + 2 * replica)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(default.to_dict()))
    with pytest.raises(HeteroError, match="--use-tp-pp-dp-mapping"):
        configure(BASE + ["--hetero-plan", str(path), "--use-tp-pp-dp-mapping"], 8)
    path.write_text(json.dumps(mapped.to_dict()))
    configure(BASE + ["--hetero-plan", str(path), "--use-tp-pp-dp-mapping"], 8)


def test_tp_pp_dp_mapping_with_context_parallelism_is_megatron_cores_grid():
    from megatron.core.parallel_state import RankGenerator

    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--context-parallel-size", "2", "--transformer-impl", "local"]
    plan = configure(BASE + layout + ["--use-tp-pp-dp-mapping"], 16).plan
    grid = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-pp-dp")  # Megatron-LM's order
    coords = [(t, d, s, c) for t in range(2) for d in range(2) for s in range(2) for c in range(2)]
    for axis, index in (("tp", 0), ("dp", 1), ("pp", 2), ("cp", 3)):
        ours = {tuple(plan.launch_rank(plan.grid.rank_at(*(coord[:index] + (i,) + coord[index + 1:])))
                      for i in range(2)) for coord in coords}
        assert sorted(ours) == sorted(map(tuple, grid.get_ranks(axis))), axis


def test_the_first_replica_whose_weights_differ_is_named():
    from megatron.hetero.training import first_differing_replica

    same = torch.arange(12, dtype=torch.uint8).view(3, 4)
    other = same.clone()
    other[2, 1] += 1
    assert first_differing_replica([same, same.clone(), same.clone()]) is None
    assert first_differing_replica([same, same.clone(), other]) == (2, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusals")
def test_cuda_only_profiling_is_refused_on_the_cpu_by_name():
    with pytest.raises(HeteroError, match="--record-memory-history .* needs a GPU"):
        _args("--record-memory-history")
    with pytest.raises(HeteroError, match="--log-device-memory-used .* needs a GPU"):
        _args("--log-device-memory-used")
    with pytest.raises(HeteroError, match="--tensorboard-dir"):
        _args("--profile", "--use-pytorch-profiler")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's substitution")
@pytest.mark.parametrize("tensorboard", [[], ["--tensorboard-dir", "tb"]], ids=["no-tensorboard", "tensorboard"])
def test_an_nsys_profile_runs_as_torch_profiler_on_the_cpu_under_the_one_note(tensorboard, tmp_path, monkeypatch):
    from megatron.hetero.cpu_device import substitution_note

    monkeypatch.chdir(tmp_path)
    args = _args("--profile", *tensorboard)
    assert args.use_pytorch_profiler
    assert args.profile_trace_dir == ("tb" if tensorboard else str(tmp_path / "profile"))
    note = substitution_note(args.cpu_substitutions)
    assert f"--profile (an nsys capture range) -> torch.profiler, as with --use-pytorch-profiler (its trace in " \
           f"{args.profile_trace_dir})" in note


def test_cyclic_dataloader_goes_round_the_data_in_a_new_order_each_pass():
    from conftest import make_plan
    from hetero.plan import Plan
    from megatron.hetero.data import ReplicaBatchSampler

    assert _args().dataloader_type == "single" and _args("--dataloader-type", "cyclic").dataloader_type == "cyclic"
    even = Plan.from_dict(make_plan(tp=1, pp=1, dp=2, stages=[4], replicas=[2, 2], rank_order=[0, 1], mbs=2))
    uneven = Plan.from_dict(make_plan(tp=1, pp=1, dp=2, stages=[4], replicas=[3, 1], rank_order=[0, 1], mbs=2))

    def stream(plan, cyclic_seed, samples=40):
        replicas = [iter(ReplicaBatchSampler(10, plan, d, cyclic_seed=cyclic_seed)) for d in range(2)]
        taken = []
        while len(taken) < samples:  # one global batch: replica 0's micro-batches, then replica 1's
            for d, replica in enumerate(replicas):
                for _ in range(plan.replicas[d].num_micro_batches):
                    taken += next(replica)
        return taken

    assert list(ReplicaBatchSampler(10, even, 0)) == [[0, 1], [2, 3]]  # single: one pass, in order
    cyclic = stream(even, 1234)
    passes = [cyclic[i:i + 10] for i in range(0, 40, 10)]
    assert all(sorted(p) == list(range(10)) for p in passes)  # every pass is the whole dataset
    assert len({tuple(p) for p in passes}) == 4 and passes[0] != list(range(10))  # each in its own order
    assert stream(uneven, 1234) == cyclic  # the same global batches under any split of replicas


@pytest.mark.slow
def test_full_validation_of_a_dataset_per_split(tmp_path):
    from megatron.hetero import data
    from megatron.hetero.data import ReplicaBatchSampler
    from hetero.plan import Plan
    from conftest import make_plan

    plan = Plan.from_dict(make_plan(tp=1, pp=1, dp=1, stages=[4], replicas=[2], rank_order=[0], mbs=2))
    again = iter(ReplicaBatchSampler(10, plan, 0, repeat_after=8))  # 2 global batches of 4, then over
    assert [next(again) for _ in range(6)] == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3]]

    low, high = _indexed_dataset(tmp_path / "low", 0, 500), _indexed_dataset(tmp_path / "high", 500, 1000)
    given = ["--train-data-path", low, "--valid-data-path", high, "--full-validation",
             "--num-layers", "2", "--train-iters", "2", "--eval-interval", "2"]
    args = _data_args(*given)
    _, valid, _ = data.build_datasets(args, data.build_tokenizer(args), 32)
    iterations = len(valid) // 16
    assert iterations > 1  # the whole split, not --eval-iters 1
    result = run_pretrain(GPT_MODEL + [a for a in TRAINING if a != "--mock-data"] + given)
    assert result.returncode == 0, result.output[-3000:]
    assert f"> full validation: {iterations * 16} samples of the validation split, {iterations} iterations" \
        in result.stdout
    assert "validation loss at iteration 2 on validation set" in result.stdout
    assert "on test set" not in result.stdout  # no --test-data-path: no test split


def test_decrease_batch_size_if_needed_rounds_the_global_batch_down():
    uneven = ["--global-batch-size", "14"]  # 2 replicas of micro-batch 2: 14 is no multiple of 4
    with pytest.raises(HeteroError, match="global batch size"):
        configure(BASE + uneven, 2)
    job = configure(BASE + uneven + ["--decrease-batch-size-if-needed"], 2)
    assert (job.args.global_batch_size, job.plan.global_batch_size) == (12, 12)
    assert any("decreasing batch size from 14 to 12" in note for note in job.args.startup_notes)


@pytest.mark.slow
def test_param_gather_overlapped_with_the_optimizer_step():
    from megatron.core.optimizer import OptimizerConfig
    from megatron.hetero.arguments import honoured_config_values

    overlap = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    with pytest.raises(HeteroError, match="needs --use-distributed-optimizer and --overlap-param-gather"):
        _args("--overlap-param-gather-with-optimizer-step")
    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert honoured_config_values(_args(*overlap, "--overlap-param-gather-with-optimizer-step"),
                                  fields)["overlap_param_gather_with_optimizer_step"] is True
    interleaved = GPT_MODEL + TRAINING + overlap + [
        "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
        "--global-batch-size", "8", "--train-iters", "3"]
    reference = run_pretrain(interleaved, nproc=2)
    overlapped = run_pretrain(interleaved + ["--overlap-param-gather-with-optimizer-step"], nproc=2)
    assert overlapped.returncode == 0, overlapped.output[-3000:]
    # The same training: only when the first chunk's weights are gathered changes.
    assert overlapped.iteration_losses() == pytest.approx(reference.iteration_losses(), rel=1e-5)
    assert len(overlapped.iteration_losses()) == 3


@pytest.mark.slow
def test_global_non_persistent_checkpoints(tmp_path):
    import shutil

    from megatron.hetero.checkpointing import TRACKER

    short = GPT_MODEL + TRAINING + ["--num-layers", "2", "--global-batch-size", "4", "--save", str(tmp_path / "ckpt"),
                                    "--non-persistent-ckpt-type", "global"]
    first = run_pretrain(short + ["--train-iters", "3", "--save-interval", "2", "--non-persistent-save-interval", "1"])
    assert first.returncode == 0, first.output[-3000:]
    # Persistent at 2 and at the end; non-persistent at 1 and 3 (not 2: the persistent one), the newest kept.
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "non_persistent").glob("iter_*")) == ["iter_0000003"]
    # As if the job had died before its final save: the non-persistent checkpoint is the newer.
    shutil.rmtree(tmp_path / "ckpt" / "iter_0000003")
    (tmp_path / "ckpt" / TRACKER).write_text("2")
    resumed = run_pretrain(short + ["--train-iters", "4", "--load", str(tmp_path / "ckpt")])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "loading the non-persistent checkpoint of iteration 3" in resumed.stdout
    assert sorted(resumed.iteration_losses()) == [4]
    # local (and in_memory) are snapshots in peers' memory, which only an in-process restart reads
    with pytest.raises(HeteroError, match="--non-persistent-ckpt-type local keeps snapshots in memory, which "
                                          "only an in-process restart reads: add --inprocess-restart"):
        _args("--non-persistent-ckpt-type", "local")


def test_data_parallel_random_init_gives_each_replica_its_own_stream():
    from megatron.hetero.training import rank_seed

    assert {rank_seed(1234, 0, dp) for dp in range(4)} == {1234}  # Megatron-LM's default: one stream
    assert [rank_seed(1234, 1, dp, True) for dp in range(3)] == [1334, 1344, 1354]
    assert _args("--data-parallel-random-init").data_parallel_random_init


def test_group_tuning_flags_reach_megatron_core_or_are_noted_on_the_cpu():
    """--use-sharp, --high-priority-stream-groups, --disable-gloo-process-groups, ... go to
    megatron-core's initialize_model_parallel as Megatron-LM passes them; on the CPU (every
    group a gloo group) they are reset and listed in the one substitution note."""
    import inspect

    from megatron.core import parallel_state
    from megatron.hetero.arguments import parse_args
    from megatron.hetero.cpu_device import substitute_gpu_choices
    from megatron.hetero.distributed import GROUP_OPTION_FLAGS, group_options

    accepted = set(inspect.signature(parallel_state.initialize_model_parallel).parameters)
    # megatron-core 0.17+ builds the all-gather groups outside it (for Megatron-FSDP only).
    assert set(GROUP_OPTION_FLAGS) - {"create_all_gather_group"} <= accepted

    given = ["--use-sharp", "--sharp-enabled-group", "dp", "--high-priority-stream-groups", "dp", "tp",
             "--create-all-gather-group", "--disable-gloo-process-groups"]
    args = parse_args(BASE + given)
    expected = {"use_sharp": True, "sharp_enabled_group": "dp", "nccl_communicator_config_path": None,
                "high_priority_stream_groups": ["dp", "tp"], "create_all_gather_group": True,
                "create_gloo_process_groups": False}
    assert group_options(args) == {name: value for name, value in expected.items() if name in accepted}
    if torch.cuda.is_available():
        return
    notes = substitute_gpu_choices(args, [])
    assert any("--use-sharp" in n and "--disable-gloo-process-groups" in n and "gloo" in n for n in notes), notes
    assert group_options(args) == group_options(parse_args(BASE)), "reset to Megatron-LM's defaults on the CPU"
