"""Sample-based schedules and the batch-size ramp under heterogeneous plans."""

import pytest

from conftest import GPT_MODEL, TRAINING, assert_same_training, make_plan, run_pretrain
from hetero.errors import HeteroError, PlanError
from hetero.plan import Plan
from megatron.hetero.arguments import parse_args, validate_args
from megatron.hetero.batch_schedule import BatchSchedule
from megatron.hetero.data import ReplicaBatchSampler


def _plan(replicas, mbs=2):
    return Plan.from_dict(make_plan(tp=1, pp=1, dp=len(replicas), stages=[4], replicas=replicas,
                                    rank_order=list(range(len(replicas))), mbs=mbs))


@pytest.mark.parametrize("replicas, global_batch, expected", [
    ([5, 3], 16, [5, 3]),        # the plan's own batch: the plan's counts
    ([5, 3], 8, [3, 1]),         # 2.5 / 1.5: the tie goes to the lower replica
    ([5, 3], 4, [1, 1]),         # 1.25 / 0.75: largest remainder
    ([1, 6, 1], 12, [1, 4, 1]),  # 0.75 / 4.5 / 0.75: the two largest remainders
    ([2, 2, 2, 2], 8, [1, 1, 1, 1]),
])
def test_ramp_steps_split_in_the_plans_proportions(replicas, global_batch, expected):
    split = _plan(replicas).split_micro_batches(global_batch)
    assert split == expected and sum(split) * 2 == global_batch


def test_a_ramp_step_too_small_for_every_replica_is_an_error():
    with pytest.raises(PlanError, match="leaves replica 1 without a micro-batch"):
        _plan([7, 1]).split_micro_batches(4)
    with pytest.raises(PlanError, match="not a whole number of micro-batches"):
        _plan([5, 3]).split_micro_batches(9)


def test_ramp_follows_megatron_cores_calculator():
    from megatron.core import num_microbatches_calculator

    # megatron-core 0.17+ dropped the ramp (Megatron-LM 0.19 accepts --rampup-batch-size, warns
    # that it is deprecated and trains at the full batch size): the 0.16 calculator is the reference.
    RampupBatchsizeNumMicroBatchesCalculator = getattr(num_microbatches_calculator,
                                                       "RampupBatchsizeNumMicroBatchesCalculator", None)
    if RampupBatchsizeNumMicroBatchesCalculator is None:
        pytest.skip("megatron-core without RampupBatchsizeNumMicroBatchesCalculator (0.17+)")

    schedule = BatchSchedule(_plan([5, 3]), [4, 4, 50])
    reference = RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=16, micro_batch_size=2, data_parallel_size=1,
        decrease_batch_size_if_needed=False, rank=-1, start_global_batch_size=4,
        batch_size_increment=4, ramup_samples=50)
    for consumed in range(0, 120):
        reference.update(consumed, consistency_check=False)
        assert schedule.global_batch_size(consumed) == reference.get_current_global_batch_size()


def test_train_samples_give_megatrons_iteration_count():
    schedule = BatchSchedule(_plan([5, 3]), [8, 4, 24])
    # ramp: 8 (0), 8 (8), 12 (16), then 16 from sample 28 on: (100 - 28) // 16 = 4 more
    assert schedule.train_iters_for_samples(100) == 3 + 4
    assert [schedule.consumed_samples(i) for i in range(5)] == [0, 8, 16, 28, 44]
    assert BatchSchedule(_plan([5, 3])).train_iters_for_samples(100) == 6


@pytest.mark.parametrize("replicas", [[8], [5, 3], [1, 6, 1]])
def test_every_plan_reads_the_same_ramped_batches(replicas):
    plan = _plan(replicas)
    schedule = BatchSchedule(plan, [12, 2, 20])  # 12, 14, 16: every replica gets a micro-batch
    streams = [iter(ReplicaBatchSampler(10_000, plan, d, schedule=schedule)) for d in range(len(replicas))]
    consumed = 0
    for _ in range(8):
        size = schedule.global_batch_size(consumed)
        counts = schedule.micro_batches(size)
        seen = [i for d, stream in enumerate(streams) for _ in range(counts[d]) for i in next(stream)]
        assert seen == list(range(consumed, consumed + size))
        consumed += size


def test_resumed_sampler_continues_the_ramp():
    plan = _plan([5, 3])
    schedule = BatchSchedule(plan, [4, 4, 40])
    fresh = list(ReplicaBatchSampler(200, plan, 1, schedule=schedule))
    resumed = list(ReplicaBatchSampler(200, plan, 1, start_iteration=3, schedule=schedule))
    skipped = sum(schedule.micro_batches(schedule.global_batch_size(schedule.consumed_samples(i)))[1]
                  for i in range(3))
    assert resumed == fresh[skipped:]


@pytest.mark.parametrize("extra, fragment", [
    (["--train-samples", "64"], "exactly one of --train-iters and --train-samples"),
    (["--lr-warmup-samples", "16"], "--lr-warmup-samples with --train-iters"),
    (["--rampup-batch-size", "6", "4", "100"], "must be START plus a whole number of INCREMENTs"),
    (["--rampup-batch-size", "5", "1", "100"], "not multiples of the micro-batch size 2"),
])
def test_schedule_flag_errors(extra, fragment):
    args = parse_args(GPT_MODEL + TRAINING + extra)
    args.tensor_model_parallel_size = 1
    with pytest.raises(HeteroError, match=fragment):
        validate_args(args)


def _without(flags: list[str], *names: str) -> list[str]:
    out, skip = [], 0
    for flag in flags:
        if skip:
            skip -= 1
        elif flag in names:
            skip = 1
        else:
            out.append(flag)
    return out


def test_sample_based_and_iteration_based_schedules_give_the_same_learning_rates():
    # Warm-up, decay and training length in iterations of 16 samples, or in samples.
    common = _without(GPT_MODEL + TRAINING, "--train-iters", "--lr-decay-style") + [
        "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--eval-iters", "0"]
    by_iters = run_pretrain(common + ["--train-iters", "6", "--lr-warmup-iters", "2",
                                      "--lr-decay-iters", "5"])
    by_samples = run_pretrain(common + ["--train-samples", "96", "--lr-warmup-samples", "32",
                                        "--lr-decay-samples", "80"])
    assert by_iters.returncode == 0, by_iters.output[-3000:]
    assert by_samples.returncode == 0, by_samples.output[-3000:]
    lrs = by_iters.series("learning rate")
    assert len(lrs) == 6 and lrs[0] < lrs[1] and lrs[-1] == pytest.approx(1e-4)
    assert by_samples.series("learning rate") == lrs
    assert by_samples.losses() == by_iters.losses()


RAMP = ["--rampup-batch-size", "4", "4", "24", "--train-samples", "96", "--eval-iters", "0"]


def _batch_sizes(result) -> list[int]:
    return [int(b) for b in result.series("global batch size")]


@pytest.mark.slow
def test_rampup_under_a_heterogeneous_plan_trains_as_one_process(tmp_path):
    args = _without(GPT_MODEL + TRAINING, "--train-iters") + RAMP
    reference = run_pretrain(args)
    assert reference.returncode == 0, reference.output[-3000:]
    assert _batch_sizes(reference) == [4, 4, 8, 12, 16, 16, 16, 16]
    plan = make_plan(tp=1, pp=2, dp=2, stages=[3, 1], replicas=[5, 3], rank_order=[2, 0, 3, 1])
    result = run_pretrain(args, nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(reference, result)
    assert _batch_sizes(result) == _batch_sizes(reference)
    # The split of every ramp step is stated at start-up.
    assert "global batch     4 -> micro-batches per replica [1, 1]" in result.stdout
    assert "global batch     8 -> micro-batches per replica [3, 1]" in result.stdout
    assert "global batch    12 -> micro-batches per replica [4, 2]" in result.stdout
    assert "global batch    16 -> micro-batches per replica [5, 3]" in result.stdout
