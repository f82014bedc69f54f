#!/usr/bin/env bash
# The main job (README: `make demo`): profile, plan and train a heterogeneous cluster on an
# emulated copy of it on this machine, then hold the prediction against the measurement.
#
# 1. tools/emulator makes this machine examples/clusters/cpu_demo.yaml - a fast node and a
#    node half as fast, two devices each: one network namespace per node with its NIC's
#    rate, a CPU quota per process in proportion to its device's speed - and the profilers
#    time the model's layers on every emulated device and the links between the nodes.
# 2. hetero-plan lays a small Llama-style model over the cluster with those profiles (fp32,
#    no fused attention: what runs on a CPU). It prints the plan, its predicted speed, the
#    Megatron baseline, and draws the predicted iteration (runs/demo/plan.png).
# 3. pretrain_gpt.py trains under the plan on the emulated cluster, one torchrun per node,
#    and `hetero-plan explain --measured` compares its logged iteration time with the plan's.
# Without root (or with EMULATE=0) nothing can be emulated: the plan comes from the devices'
# stated speeds and the processes run unshaped under one torchrun; HETERO_DEVICE tells each
# which of the plan's devices it stands in for.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT_DIR:-runs/demo}
mkdir -p "$OUT"
PLAN=$OUT/plan.json
CLUSTER=examples/clusters/cpu_demo.yaml

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
OUTPUT_ARGS=(--log-interval 5 --log-throughput --eval-interval 15 --eval-iters 2)
ARGS=("${GPT_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}")

EMULATED=0
if [ "${EMULATE:-1}" = 1 ] && python -c "import sys; from tools.emulator import EmulatedCluster as E; m = E.missing_prerequisites(); print('emulator unavailable: ' + '; '.join(m) + ' -> planning from stated speeds, running unshaped', file=sys.stderr) if m else None; sys.exit(1 if m else 0)"; then
  EMULATED=1
fi

# Runs a command with its output in a log, showing only the profilers' progress lines (the
# whole log where it fails).
logged() {
  local log=$1
  shift
  if ! "$@" > "$log" 2>&1; then
    tail -n 40 "$log"
    echo "failed: $* (log: $log)" >&2
    exit 1
  fi
  grep -E '^\[(profile|links|allreduce)|^wrote' "$log" || true
}

PROFILE_ARGS=()
if [ "$EMULATED" = 1 ]; then
  echo "== profiling the emulated cluster: layers per device at TP 1 and 2, links =="
  logged "$OUT/profile_compute.log" python -m tools.emulator --cluster "$CLUSTER" -- -m megatron.hetero.profiling.compute \
    -o "$OUT/profiles" --micro-batch-sizes 2 --tensor-parallel 1 2 -- "${GPT_ARGS[@]}" "${DATA_ARGS[@]}"
  logged "$OUT/profile_network.log" python -m tools.emulator --cluster "$CLUSTER" -- -m megatron.hetero.profiling.network \
    -o "$OUT/profiles"
  PROFILE_ARGS=(--profiles "$OUT/profiles")
  echo
fi

hetero-plan --cluster "$CLUSTER" --model examples/models/llama_tiny.yaml \
  --global-batch-size 16 --seq-length 128 --micro-batch-size 2 --tensor-parallel 1,2 "${PROFILE_ARGS[@]}" \
  --precision fp32 --no-fused-kernels --no-dropout --quiet -o "$PLAN" --timeline "$OUT/plan.png"
echo

if [ "$EMULATED" = 1 ]; then
  python -m tools.emulator --cluster "$CLUSTER" --plan "$PLAN" -- pretrain_gpt.py --hetero-plan "$PLAN" "${ARGS[@]}" \
    | tee "$OUT/train.log"
else
  NPROC=$(python -c "from hetero.plan import Plan; print(Plan.load('$PLAN').world_size)")
  if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export HETERO_DEVICE=$(python -c "from hetero.plan import Plan; print(','.join(d.device_type for d in Plan.load('$PLAN').devices))")
    export HETERO_VENDOR=$(python -c "from hetero.plan import Plan; print(','.join(d.vendor for d in Plan.load('$PLAN').devices))")
  fi
  torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py --hetero-plan "$PLAN" "${ARGS[@]}" | tee "$OUT/train.log"
fi
echo
hetero-plan explain "$PLAN" --measured "$OUT/train.log" | tail -n 1
