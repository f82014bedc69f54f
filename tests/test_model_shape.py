"""Model-shape flags of Megatron-LM recipes, trained under a heterogeneous plan."""

import re

import pytest

from conftest import GPT_MODEL, TRAINING, assert_same_training, make_plan, run_pretrain

SHAPE = ["--squared-relu", "--position-embedding-type", "rope", "--no-position-embedding",
         "--rotary-interleaved", "--rotary-base", "500000", "--rotary-percent", "0.5",
         "--qk-layernorm", "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
         "--decoupled-lr", "3e-3", "--decoupled-min-lr", "1e-4", "--eval-iters", "0",
         "--train-iters", "4"]


@pytest.mark.slow
def test_shape_flags_train_the_same_under_a_heterogeneous_plan(tmp_path):
    reference = run_pretrain(GPT_MODEL + TRAINING + SHAPE)
    assert reference.returncode == 0, reference.output[-3000:]
    plan = make_plan(tp=2, pp=2, dp=1, stages=[1, 3], replicas=[8], rank_order=[3, 1, 2, 0])
    result = run_pretrain(GPT_MODEL + TRAINING + SHAPE, nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(reference, result)
    # --apply-layernorm-1p stores every norm scale as gamma - 1: the same function at the
    # start (equal first loss), different parameters (zeros instead of ones in the norm).
    plain = run_pretrain(GPT_MODEL + TRAINING + [f for f in SHAPE if f != "--apply-layernorm-1p"])
    assert plain.returncode == 0, plain.output[-3000:]
    assert plain.losses()[0] == pytest.approx(reference.losses()[0], rel=1e-5)
    assert plain.series("params norm")[0] > reference.series("params norm")[0]


def _parameters(result) -> int:
    found = re.findall(r"number of parameters on \(tensor, pipeline\) model parallel rank \(0, 0\): (\d+)",
                       result.output)
    assert found, result.output[-3000:]
    return int(found[0])


# GPT_MODEL's shape: hidden 64, 4 layers, 4 heads, vocabulary 1000 padded to 1024, 32 positions.
HIDDEN, LAYERS, HEADS, VOCAB, POSITIONS = 64, 4, 4, 1024, 32
NORM = 2 * HIDDEN                       # LayerNorm: scale and bias
ATTENTION = NORM + HIDDEN * 3 * HIDDEN + HIDDEN * HIDDEN   # norm, QKV, projection (no biases)
EMBEDDINGS = VOCAB * HIDDEN + POSITIONS * HIDDEN + NORM     # tied output layer; final norm


def test_transformer_config_fields_take_effect():
    """Flags whose whole effect is a TransformerConfig field change the model megatron-core
    builds, as in Megatron-LM: each term below is one flag's parameters."""
    flags = ["--disable-bias-linear", "--add-qkv-bias", "--attention-output-gate", "--quick-geglu",
             "--softmax-type", "learnable", "--train-iters", "1", "--eval-iters", "0"]
    result = run_pretrain(GPT_MODEL + TRAINING + flags)
    assert result.returncode == 0, result.output[-3000:]
    gate = HIDDEN * HIDDEN                      # --attention-output-gate: QKV also projects a gate
    qkv_bias = 3 * HIDDEN + HIDDEN              # --add-qkv-bias (gate included)
    geglu = 2 * HIDDEN * 4 * HIDDEN + 4 * HIDDEN * HIDDEN   # --quick-geglu: fc1 doubled for the GLU
    softmax_offsets = HEADS                     # --softmax-type learnable: one offset per head
    layer = ATTENTION + gate + qkv_bias + softmax_offsets + NORM + geglu
    assert _parameters(result) == EMBEDDINGS + LAYERS * layer
    # A sliding window (--window-size) changes what attention sees, hence the first loss.
    windowed = run_pretrain(GPT_MODEL + TRAINING + flags + ["--window-size", "4,0"])
    assert windowed.returncode == 0, windowed.output[-3000:]
    assert windowed.losses()[0] != pytest.approx(result.losses()[0], rel=1e-6)


def test_multi_token_prediction_layers_are_built_and_trained():
    """--mtp-num-layers adds megatron-core's MTP block (two norms, the 2h->h projection, one
    decoder layer, a final norm) and its loss to the gradients; Megatron-LM's iteration line
    shows each MTP layer's loss."""
    flags = ["--disable-bias-linear", "--position-embedding-type", "rope", "--train-iters", "2", "--eval-iters", "0"]
    plain = run_pretrain(GPT_MODEL + TRAINING + flags)
    mtp = run_pretrain(GPT_MODEL + TRAINING + flags + ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.5"])
    assert plain.returncode == 0 and mtp.returncode == 0, (plain.output + mtp.output)[-3000:]
    layer = ATTENTION + NORM + 2 * HIDDEN * 4 * HIDDEN
    assert _parameters(plain) == EMBEDDINGS - POSITIONS * HIDDEN + LAYERS * layer  # RoPE: no position table
    assert _parameters(mtp) == _parameters(plain) + 2 * NORM + 2 * HIDDEN * HIDDEN + layer + NORM
    # Same first forward (the lm loss), different gradients from the MTP loss.
    assert mtp.losses()[0] == pytest.approx(plain.losses()[0], rel=1e-6)
    assert mtp.losses()[1] != pytest.approx(plain.losses()[1], rel=1e-6)
    assert len(mtp.series("mtp_1 loss")) == 2 and "mtp_1 loss" not in plain.output
    # Megatron-LM's own rule: MTP only with rope or no position embeddings.
    learned = run_pretrain(GPT_MODEL + TRAINING + ["--mtp-num-layers", "1"])
    assert learned.returncode != 0 and "--position-embedding-type learned_absolute" in learned.output
    assert "Traceback" not in learned.output


MOE_EP2 = ["--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
           "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
           "--moe-token-dispatcher-type", "alltoall", "--use-distributed-optimizer"]


@pytest.mark.slow
@pytest.mark.parametrize("extra, expert_parallel, replicas", [
    ([], 1, [5, 3]),
    (["--untie-embeddings-and-output-weights"], 1, [5, 3]),
    (MOE_EP2, 2, [4, 4]),  # the expert-parallel group spans both replicas: equal counts
], ids=["tied", "untied", "moe-ep2"])
def test_multi_token_prediction_trains_the_same_across_pipeline_stages(extra, expert_parallel, replicas, tmp_path):
    """MTP layers on the last stage of a heterogeneous plan (uneven stages, unequal replicas
    where experts allow, ranks permuted) train the model one process trains: the lm, MTP and
    router losses and the norms (with tied embeddings the stage's logits read its copy of the
    word embeddings, which the first stage's gradient keeps in step; a MoE model's MTP layer
    is a MoE layer, its experts exchanged over the expert-parallel group). A checkpoint saved
    under the plan resumes in one process."""
    model = GPT_MODEL + ["--position-embedding-type", "rope", "--disable-bias-linear", "--mtp-num-layers", "1"] + extra
    reference = run_pretrain(model + TRAINING)
    assert reference.returncode == 0, reference.output[-3000:]
    plan = make_plan(tp=1, pp=2, dp=2, stages=[1, 3], replicas=replicas, rank_order=[3, 1, 2, 0])
    plan["expert_parallel"] = expert_parallel
    save = ["--save", str(tmp_path / "checkpoint"), "--save-interval", "3"]
    result = run_pretrain(model + TRAINING + save, nproc=4, plan=plan, tmp_path=tmp_path)
    assert_same_training(reference, result)
    names = ["mtp_1 loss"] + (["load_balancing_loss"] if expert_parallel > 1 else [])
    for name in names:
        for a, b in zip(reference.series(name), result.series(name), strict=True):
            assert abs(a - b) <= 1e-4 * abs(a), name
    resumed = run_pretrain(model + TRAINING + ["--load", str(tmp_path / "checkpoint"), "--ckpt-step", "3"])
    assert resumed.returncode == 0, resumed.output[-3000:]
    for name in ("lm loss", "mtp_1 loss"):
        expected = dict(enumerate(reference.series(name), start=1))
        assert resumed.iteration_losses(name) == pytest.approx({4: expected[4], 5: expected[5]}, rel=1e-4), name
