"""Context parallelism (--context-parallel-size) without transformer-engine, with and without plans.

megatron-core's local attention gains context parallelism by a patch (context_parallel.py):
keys and values gathered over the context group, masked by the true positions of each rank's
load-balanced chunks. Checked against plain causal attention on random tensors (in-process,
then by the patched megatron-core module on two gloo ranks, gradients included), the chunk
order against megatron-core's own batch split, the plan's context axis against megatron-core's
grid, and whole jobs (CP 2, TP 2 x CP 2, a plan with unequal replicas) against one process.
"""

import json
import math

import pytest
import torch

from conftest import LLAMA_MODEL, TRAINING, assert_same_training, make_plan, run_pretrain
from hetero.errors import HeteroError, PlanError
from hetero.plan import Plan
from megatron.hetero.context_parallel import chunk_positions, full_sequence_keys_values
from megatron.hetero.startup import configure
from spawned_ranks import run_on_ranks


CPU = {"host": "localhost", "device_type": "cpu", "vendor": "cpu"}


def reference_attention(query, key, value):
    """Causal attention over the whole sequence, plainly: [s, b, n, d] in, [s, b, n*d] out;
    key/value [s, b, g, d] with g query groups (grouped-query attention)."""
    heads, groups = query.size(2), key.size(2)
    key = key.repeat_interleave(heads // groups, dim=2)
    value = value.repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("qbnd,kbnd->bnqk", query, key) / math.sqrt(query.size(-1))
    length = query.size(0)
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bnqk,kbnd->qbnd", scores.softmax(-1), value)
    return out.reshape(length, query.size(1), -1)


def _local(tensor, cp_size, cp_rank):
    return tensor.index_select(0, chunk_positions(tensor.size(0), cp_size, cp_rank))


class _Group:
    """Size and rank only: all megatron-core's batch split reads of a group."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp_size", [2, 3])
def test_chunks_are_megatron_cores_batch_split(cp_size, monkeypatch):
    from megatron.hetero.core_compat import batch_on_this_cp_rank

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # it reads a group only then
    # megatron-core 0.17+ asks torch.distributed for the group's size and rank.
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: group.size())
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: group.rank())

    length = 4 * cp_size
    for rank in range(cp_size):
        batch = {"tokens": torch.arange(length).repeat(2, 1),
                 "attention_mask": torch.arange(length).view(1, 1, length, 1).expand(2, 1, length, length)}
        split = batch_on_this_cp_rank(batch, _Group(cp_size, rank))
        assert split["tokens"][0].tolist() == chunk_positions(length, cp_size, rank).tolist()
        assert split["attention_mask"][0, 0, :, 0].tolist() == chunk_positions(length, cp_size, rank).tolist()
    with pytest.raises(HeteroError, match="divisible by 4"):
        chunk_positions(6, 2, 0)


@pytest.mark.parametrize("cp_size, heads, groups", [(2, 4, 4), (2, 4, 2), (4, 2, 1)])
def test_gathered_keys_and_causal_mask_give_full_attention(cp_size, heads, groups):
    """Each rank's queries against the gathered, reordered keys under the positions' mask
    are the rows of full causal attention for those positions."""
    torch.manual_seed(0)
    length, batch, dim = 8 * cp_size, 2, 8
    query = torch.randn(length, batch, heads, dim)
    key, value = torch.randn(length, batch, groups, dim), torch.randn(length, batch, groups, dim)
    expected = reference_attention(query, key, value)

    for rank in range(cp_size):
        pending = [key, value]

        def gather(local):  # every rank's chunks in rank order, as the all-gather returns them
            whole = pending.pop(0)
            assert torch.equal(local, _local(whole, cp_size, rank))
            return torch.cat([_local(whole, cp_size, r) for r in range(cp_size)])

        full_key, full_value, mask = full_sequence_keys_values(
            _local(key, cp_size, rank), _local(value, cp_size, rank), None, cp_size, rank, gather)
        assert torch.equal(full_key, key) and torch.equal(full_value, value)
        local_query = _local(query, cp_size, rank)
        repeat = heads // groups
        scores = torch.einsum("qbnd,kbnd->bnqk", local_query, full_key.repeat_interleave(repeat, 2)) / math.sqrt(dim)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        out = torch.einsum("bnqk,kbnd->qbnd", probs, full_value.repeat_interleave(repeat, 2))
        torch.testing.assert_close(out.reshape(out.size(0), batch, -1), _local(expected, cp_size, rank))
    with pytest.raises(HeteroError, match=r"expected \[\.\.\., 4, 16\]"):
        full_sequence_keys_values(key[:4], value[:4], torch.zeros(1, 1, 4, 4, dtype=torch.bool), 4, 0,
                                  lambda local: torch.cat([local] * 4))


def _attention_rank(rank, world, heads, groups):
    """One context rank: megatron-core's DotProductAttention (patched) on its chunks."""
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    model_parallel_cuda_manual_seed(0)  # the attention's dropout region forks its RNG tracker
    dim, length, batch = 8, 8 * world, 2
    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                               num_query_groups=groups, context_parallel_size=world, attention_dropout=0.0,
                               use_cpu_initialization=True)
    attention = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    torch.manual_seed(0)  # every rank draws the same whole sequence
    tensors = [torch.randn(length, batch, n, dim) for n in (heads, groups, groups)]
    grad_out = torch.randn(length, batch, heads * dim)
    full = [t.clone().requires_grad_() for t in tensors]
    reference_attention(*full).backward(grad_out)
    local = [_local(t, world, rank).requires_grad_() for t in tensors]
    out = attention(*local, attention_mask=None)
    out.backward(_local(grad_out, world, rank))
    torch.testing.assert_close(out, _local(reference_attention(*tensors), world, rank))
    for name, mine, ref in zip("qkv", local, full):
        torch.testing.assert_close(mine.grad, _local(ref.grad, world, rank), msg=f"gradient of {name}")


@pytest.mark.slow
def test_patched_megatron_attention_on_two_context_ranks():
    heads, groups = 4, 2
    outcomes = run_on_ranks(_attention_rank, 2, heads, groups, timeout=60)
    assert outcomes == {0: "ok", 1: "ok"}, outcomes


# ----- the plan's context axis -------------------------------------------------------------


def _plan(**fields) -> Plan:
    cp = fields.pop("context_parallel", 1)
    return Plan.from_dict({**make_plan(**fields), "context_parallel": cp})


@pytest.mark.parametrize("tp, cp, pp, dp", [(1, 2, 1, 2), (2, 2, 2, 1), (2, 2, 1, 3), (1, 4, 2, 2)])
def test_plan_context_groups_are_megatron_cores(tp, cp, pp, dp):
    from megatron.core.parallel_state import RankGenerator

    world = tp * cp * pp * dp
    plan = _plan(tp=tp, pp=pp, dp=dp, stages=[1] * pp, replicas=[2] * dp, rank_order=list(range(world))[::-1],
                 devices=[CPU] * world, context_parallel=cp)
    assert plan.world_size == world
    grid = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    ours = {
        "tp": [plan.grid.tensor_group(d, s, c) for s in range(pp) for d in range(dp) for c in range(cp)],
        "cp": [plan.grid.context_group(t, d, s) for s in range(pp) for d in range(dp) for t in range(tp)],
        "dp": [plan.grid.data_group(t, s, c) for s in range(pp) for c in range(cp) for t in range(tp)],
        "pp": [plan.grid.pipeline_group(t, d, c) for d in range(dp) for c in range(cp) for t in range(tp)],
    }
    for token, groups in ours.items():
        assert sorted(groups) == sorted(grid.get_ranks(token)), token
    # megatron-core's expert grid spans each stage's TP x CP x DP ranks.
    expert = Plan.from_dict({**plan.to_dict(), "expert_parallel": 2})
    experts = RankGenerator(tp=tp, ep=2, dp=tp * cp * dp // (2 * tp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for token, groups in (("ep", expert.grid.expert_groups), ("dp", expert.grid.expert_data_groups)):
        assert sorted(g for s in range(pp) for g in groups(s)) == sorted(experts.get_ranks(token)), token
    for rank in range(world):
        c = plan.grid.coords(rank)
        assert plan.grid.rank_at(c.tp_rank, c.dp_rank, c.pp_rank, c.cp_rank) == rank


def test_plan_context_field_round_trips_and_refuses_what_it_cannot_run():
    plan = _plan(tp=1, pp=1, dp=2, stages=[4], replicas=[5, 3], rank_order=[3, 1, 0, 2],
                 devices=[CPU] * 4, context_parallel=2)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan and "CP=2" in plan.summary()
    assert "context_parallel" not in Plan.from_dict(make_plan(tp=1, pp=1, dp=2, stages=[4], replicas=[1, 1],
                                                              rank_order=[0, 1])).to_dict()
    with pytest.raises(PlanError, match="devices has 2 entries but context_parallel x"):
        _plan(tp=1, pp=1, dp=2, stages=[4], replicas=[1, 1], rank_order=[0, 1, 2, 3], context_parallel=2)
    with pytest.raises(PlanError, match="context_parallel 2 with a tensor_parallel per stage"):
        Plan.from_dict({**make_plan(tp=1, pp=2, dp=1, stages=[2, 2], replicas=[2], rank_order=list(range(6)),
                                    stage_tp=[2, 1], devices=[CPU] * 6),
                        "context_parallel": 2})
    # Expert parallelism over the context ranks of each replica: the replicas may differ;
    # across replicas they run equal counts (the expert all-to-all of every micro-batch).
    experts = {**make_plan(tp=1, pp=1, dp=2, stages=[4], replicas=[5, 3], rank_order=[0, 1, 2, 3],
                           devices=[CPU] * 4), "context_parallel": 2}
    assert Plan.from_dict({**experts, "expert_parallel": 2}).grid.expert_groups(0) == [[0, 1], [2, 3]]
    with pytest.raises(PlanError, match=r"spans replicas \[0, 1\], which run \[5, 3\]"):
        Plan.from_dict({**experts, "expert_parallel": 4})


JOB = LLAMA_MODEL + TRAINING + ["--eval-iters", "0", "--train-iters", "3"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall"]


def test_flags_build_the_context_axis_and_contradictions_stop_at_start_up(tmp_path):
    flags = configure(JOB + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"], 8).plan
    assert (flags.context_parallel, flags.tensor_parallel, flags.data_parallel) == (2, 2, 2)
    planned = make_plan(tp=1, pp=1, dp=1, stages=[4], replicas=[8], rank_order=[1, 0], devices=[CPU] * 2)
    planned["context_parallel"] = 2
    (tmp_path / "plan.json").write_text(json.dumps(planned))
    assert configure(JOB + ["--hetero-plan", str(tmp_path / "plan.json")], 2).args.context_parallel_size == 2
    with pytest.raises(HeteroError, match=r"--context-parallel-size 4 contradicts the plan \(2\)"):
        configure(JOB + ["--hetero-plan", str(tmp_path / "plan.json"), "--context-parallel-size", "4"], 2)
    with pytest.raises(HeteroError, match="not divisible by tensor x pipeline x context"):
        configure(JOB + ["--context-parallel-size", "2"], 3)


@pytest.mark.slow
def test_context_parallel_jobs_train_as_one_process(tmp_path):
    """fp32 Llama (RoPE, grouped-query attention): TP 2 x CP 2 with sequence parallelism from
    the flags; a plan with CP 2, unequal replicas and permuted ranks, whose distributed-optimizer
    checkpoint one process resumes."""
    reference = run_pretrain(JOB)
    both = run_pretrain(JOB + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                               "--sequence-parallel"], nproc=4)
    assert_same_training(reference, both, rtol=1e-5)
    assert "CP=2" in both.output
    unequal = make_plan(tp=1, pp=1, dp=2, stages=[4], replicas=[5, 3], rank_order=[2, 0, 3, 1], devices=[CPU] * 4)
    unequal["context_parallel"] = 2
    planned = run_pretrain(JOB + ["--use-distributed-optimizer", "--save", str(tmp_path / "ckpt"),
                                  "--save-interval", "2"], nproc=4, plan=unequal, tmp_path=tmp_path)
    assert_same_training(reference, planned, rtol=1e-5)
    # Its checkpoint of iteration 2 (one writer per model-parallel rank), resumed by one process.
    resumed = run_pretrain(JOB + ["--use-distributed-optimizer", "--load", str(tmp_path / "ckpt"), "--ckpt-step", "2"])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert list(resumed.iteration_losses()) == [3]
    for name in ("lm loss", "params norm"):
        assert resumed.iteration_losses(name)[3] == pytest.approx(reference.series(name)[-1], rel=1e-5), name


@pytest.mark.slow
def test_context_parallel_with_expert_parallelism_trains_as_one_process(tmp_path):
    """MoE, EP 2 over each replica's two context ranks, replicas of 5 and 3 micro-batches.
    megatron-core's load-balancing loss sees each rank's tokens (as under sequence
    parallelism, where it differs from one process by the same ~1e-4): that bound here."""
    reference = run_pretrain(JOB + MOE)
    plan = make_plan(tp=1, pp=1, dp=2, stages=[4], replicas=[5, 3], rank_order=[3, 1, 2, 0], devices=[CPU] * 4)
    plan.update(context_parallel=2, expert_parallel=2)
    result = run_pretrain(JOB + MOE, nproc=4, plan=plan, tmp_path=tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert "EP=2 ETP=1 CP=2" in result.output
    for name in ("lm loss", "load_balancing_loss", "params norm"):
        ref, got = reference.series(name), result.series(name)
        assert len(ref) == len(got) == 3, (name, ref, got)
        for a, b in zip(ref, got):
            assert abs(a - b) <= 2e-4 * abs(a), (name, ref, got)
