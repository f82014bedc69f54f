#!/usr/bin/env bash
# bench/gpu_bench.py's sections on one CUDA GPU machine that has torch (with nvcc) but neither
# megatron-core nor pydantic, and no network: run from the repository root, results to $OUT.
#
# Prepare on the machine the checkout lives on (both paths are git-ignored through
# .git/info/exclude and travel as carried paths):
#   echo /.gpu/ >> .git/info/exclude
#   mkdir -p .gpu/site .gpu/wheels
#   cp -r .venv/lib/python3.11/site-packages/megatron .gpu/site/ && find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
#   .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .gpu/wheels pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 \
#       typing_extensions==4.16.0
# (megatron-core is pure Python and needs only torch, numpy and packaging, which the GPU image has;
# `megatron` is a namespace package there and here, so .gpu/site's megatron/core and the
# checkout's megatron/hetero join on PYTHONPATH.)
#
#   bash bench/gpu_check.sh [SECTION ...]   # BUDGET=seconds (default 450) bounds the sections' total
#
# Writes to $OUT (runs/gpu_check without it): log (everything printed), gpu_bench.json (every
# section's figures), env.txt, build.log, logs.txt (the tails of the MoE runs' own logs).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/gpu_check}
BUDGET=${BUDGET:-450}
WORK=/tmp/gpu_bench
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
rm -rf "$WORK"
log() { echo "[gpu_check ${SECONDS}s] $*" | tee -a "$OUT/log"; }

"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/wheels/*.whl >"$OUT/build.log" 2>&1 || { log "installing .gpu/wheels failed"; tail -20 "$OUT/build.log" | tee -a "$OUT/log"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD/.gpu/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PYTHON" -c "import sys, torch, torch.utils.cpp_extension as e; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'CUDA_HOME', e.CUDA_HOME); print('grouped_mm', hasattr(torch, '_grouped_mm'), 'scaled_grouped_mm', hasattr(torch, '_scaled_grouped_mm'))"
    "$PYTHON" -c "import megatron.core, pydantic, megatron.hetero; print('megatron-core', megatron.core.__version__, megatron.core.__file__, 'pydantic', pydantic.VERSION)"
} 2>&1 | tee "$OUT/env.txt" | tee -a "$OUT/log" || { log "the environment check failed (env.txt)"; exit 1; }

# megatron-core's compiled dataset helper (the sample index of --mock-data too) is built for the
# checkout's Python; build it for this one from the source megatron-core ships beside it.
HELPERS=.gpu/site/megatron/core/datasets
if ! "$PYTHON" -c "import megatron.core.datasets.helpers_cpp" 2>/dev/null; then
    log "building megatron-core's dataset helpers for this Python"
    g++ -O3 -shared -std=c++17 -fPIC $("$PYTHON" -m pybind11 --includes) "$HELPERS/helpers.cpp" \
        -o "$HELPERS/helpers_cpp$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" \
        >>"$OUT/build.log" 2>&1 || { log "building the dataset helpers failed"; tail -20 "$OUT/build.log" | tee -a "$OUT/log"; exit 1; }
fi
log "building hetero_comm._comm_ext (CUDA)"
# Without the toolkit setup.py builds the CPU-only extension, and the bridge sections would fail late.
"$PYTHON" -c "import sys, torch.utils.cpp_extension as e; sys.exit(0 if e.CUDA_HOME else 'no CUDA toolkit found (CUDA_HOME): set it to the folder holding bin/nvcc')" 2>&1 | tee -a "$OUT/log" || exit 1
MAX_JOBS=16 "$PYTHON" setup.py build_ext --inplace >>"$OUT/build.log" 2>&1 \
    || { log "build failed"; tail -40 "$OUT/build.log" | tee -a "$OUT/log"; exit 1; }
"$PYTHON" -c "import hetero_comm._comm_ext as e; print('extension', e.__file__)" 2>&1 | tee -a "$OUT/log" || exit 1

# One invocation per section (each adds to gpu_bench.json), the new checks first, each bounded by
# its own cap and by what is left of BUDGET, so a slow or stuck section costs only itself.
SECTIONS=" ${*:-gemm8 moe train-moe comm parity gemm train} "  # bash bench/gpu_check.sh [SECTION ...]
section() {
    local cap=$1; shift
    [[ "$SECTIONS" == *" $1 "* ]] || return 0
    local left=$((BUDGET - SECONDS))
    local limit=$((cap < left ? cap : left))
    if ((limit < 20)); then log "skipped $* (budget spent)"; return; fi
    log "section $* (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$PYTHON" bench/gpu_bench.py --out "$WORK" --only "$@" 2>&1 | tee -a "$OUT/log"
    log "section $1 exit ${PIPESTATUS[0]}"
    cp "$WORK/gpu_bench.json" "$OUT/" 2>/dev/null
}
section 90 gemm8
section 150 moe
section 120 train-moe
section 60 comm
section 120 parity
section 30 gemm
section 200 train --train-cases 2:none 4:full

for f in "$WORK"/parity_moe_*.log "$WORK"/train_qwen3_moe.log; do
    [ -f "$f" ] && { echo "===== $f (last 60 lines)"; tail -60 "$f"; }
done >"$OUT/logs.txt" 2>&1
log "done"
