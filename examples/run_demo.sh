#!/usr/bin/env bash
# A planned heterogeneous training run on this machine (README command `make demo`).
#
# The plan lays a Llama-style model over 2 "H100" and 2 "A100" processes: two pipelines
# of 2 stages with an uneven layer split [4, 2], the H100 pipeline taking 5 micro-batches
# per iteration and the A100 pipeline 3, and a rank order that keeps each pipeline on one
# node. Without GPUs the four processes run on this CPU; HETERO_DEVICE tells each one
# which device of the plan it stands in for (the start-up check compares them).
set -euo pipefail
cd "$(dirname "$0")/.."

PLAN=${PLAN:-examples/plans/demo_2xh100_2xa100.json}
NPROC=$(python -c "from hetero.plan import Plan; print(Plan.load('$PLAN').world_size)")
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export HETERO_DEVICE=$(python -c "from hetero.plan import Plan; print(','.join(d.device_type for d in Plan.load('$PLAN').devices))")
  export HETERO_VENDOR=$(python -c "from hetero.plan import Plan; print(','.join(d.vendor for d in Plan.load('$PLAN').devices))")
fi

GPT_ARGS=(
  --num-layers 6 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 8
  --group-query-attention --num-query-groups 4
  --swiglu --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --disable-bias-linear
  --seq-length 128 --max-position-embeddings 128
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
TRAINING_ARGS=(
  --micro-batch-size 2 --global-batch-size 16 --train-iters "${TRAIN_ITERS:-30}"
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 3
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --seed 1234
)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 2047 --num-workers 0)
OUTPUT_ARGS=(--log-interval 5 --eval-interval 15 --eval-iters 2)

exec torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  --hetero-plan "$PLAN" "${GPT_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}"
