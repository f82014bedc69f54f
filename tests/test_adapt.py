"""--hetero-adapt: replicas re-split while training, losses unchanged, a corrected plan."""

from __future__ import annotations

import re

import pytest

from conftest import GPT_MODEL, REPO, TRAINING, assert_same_training, cpu_devices, run_pretrain
from hetero.plan import Plan
from hetero.predict.schedule import equal_stages_time
from megatron.hetero.adapt import rebalanced_layers, rebalanced_micro_batches


# ---- the arithmetic ----------------------------------------------------------------------

def test_replicas_get_micro_batches_in_proportion_to_their_speed():
    # replica 2 is twice as fast as 0 and 1: equal times need 6 of its 12 micro-batches there
    assert rebalanced_micro_batches([2.0, 2.0, 1.0], [4, 4, 4], stages=1) == [3, 3, 6]
    assert rebalanced_micro_batches([1.0, 1.0], [5, 5], stages=1) == [5, 5]


def test_a_pipeline_split_accounts_for_the_fill_and_drain_steps():
    # per stage step: replica 0 takes 0.1 s, replica 1 0.2 s; 4 stages add 3 steps each
    seconds = [equal_stages_time(0.1, 8, 4), equal_stages_time(0.2, 8, 4)]
    counts = rebalanced_micro_batches(seconds, [8, 8], stages=4)
    assert counts == [12, 4]  # (12 + 3) * 0.1 = 1.5 s, (4 + 3) * 0.2 = 1.4 s: the nearest to equal
    times = [equal_stages_time(a, m, 4) for a, m in zip([0.1, 0.2], counts)]
    assert max(times) < max(seconds)


def test_every_replica_keeps_a_micro_batch_and_interleaving_keeps_multiples():
    assert rebalanced_micro_batches([100.0, 1.0, 1.0], [4, 4, 4], stages=1) == [1, 5, 6] or \
        rebalanced_micro_batches([100.0, 1.0, 1.0], [4, 4, 4], stages=1) == [1, 6, 5]
    counts = rebalanced_micro_batches([3.0, 1.0], [8, 8], stages=2, unit=2)
    assert sum(counts) == 16 and all(c % 2 == 0 and c >= 2 for c in counts)


def test_layers_move_to_the_faster_stage():
    # stage 0 takes 3 s for 4 layers, stage 1 1 s for 4: equal times want 2 and 6
    assert rebalanced_layers([3.0, 1.0], [4, 4]) == [2, 6]
    assert rebalanced_layers([1.0, 1.0, 1.0], [3, 3, 2]) == [3, 3, 2]
    assert min(rebalanced_layers([100.0, 1.0], [2, 2])) == 1


# ---- a real job on ranks of unequal speed --------------------------------------------------

SLOWED = REPO / "tests" / "slowed_rank.py"
# Ranks 0 and 1 take 0.1 s longer for every micro-batch's forward step than rank 2, whatever
# the machine's load.
SLOW = {"SLOW_RANKS": "0 1", "SLOW_FORWARD_S": "0.1"}
MODEL = [a if a != "64" else "256" for a in GPT_MODEL]  # hidden 256: compute, not overhead
RESPLIT = re.compile(r"hetero-adapt after iteration \d+: replica times \[[^]]*\] s -> "
                     r"micro-batches per replica \[([^]]*)\] -> \[([^]]*)\]")


@pytest.mark.slow
def test_adapted_replicas_train_the_same_model_faster(tmp_path):
    plan = {
        "version": 1, "tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 3,
        "micro_batch_size": 2, "stages": [{"num_layers": 4}],
        "replicas": [{"num_micro_batches": 4}] * 3, "rank_order": [0, 1, 2],
        "devices": cpu_devices(3),
    }
    args = MODEL + TRAINING + ["--global-batch-size", "24", "--train-iters", "8"]
    output = tmp_path / "adapted.json"
    # Its 3 ranks are forks of the one process that runs SLOWED (SLOW_NPROC).
    adapted = run_pretrain(args + ["--hetero-adapt", "--hetero-adapt-output", str(output)],
                           plan=plan, tmp_path=tmp_path, env={**SLOW, "SLOW_NPROC": "3"}, script=SLOWED)
    assert adapted.returncode == 0, adapted.output[-3000:]
    resplits = [[list(map(int, split.split(", "))) for split in m.groups()]
                for m in RESPLIT.finditer(adapted.stdout)]
    assert resplits and resplits[0][0] == [4, 4, 4], adapted.stdout[-3000:]
    slow_0, slow_1, fast = resplits[-1][1]
    assert fast > max(slow_0, slow_1) and slow_0 + slow_1 + fast == 12, resplits
    # The same samples each iteration: the losses of the run that kept 4/4/4. A sleep changes
    # no number, so that run needs neither the slowed ranks nor a launch of its own.
    fixed = run_pretrain(args, nproc=3, plan=plan, tmp_path=tmp_path)
    assert_same_training(fixed, adapted)
    corrected = Plan.load(output)
    assert [r.num_micro_batches for r in corrected.replicas] == [slow_0, slow_1, fast]
    assert "hetero-adapt: corrected plan written to" in adapted.stdout
