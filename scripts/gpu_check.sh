#!/usr/bin/env bash
# The GPU check on one GPU (an H100 or H200), JSON out:
#   1. `dlm-lsp bench --gpu` (issue 37, dlm_lsp/measure/gpu_bench.py), first and alone on the GPU: random
#      Dream-7B, LLaDA-8B and SDAR-8B shapes in bf16, cached steps against the copy-bandwidth floor in the
#      eager loop / fixed-shape / CUDA-graph modes, launches and syncs per step, forced schedules, reuse,
#      8 concurrent requests, cancel latency; at most BENCH_TIMEOUT (300) s -> gpu_bench.json;
#   2. scripts/gpu_check.py (issue 13): bf16-vs-fp32 parity for every family, the slot-statistics kernel
#      against its reference; its own random Dream-7B bench only where step 1 did not run on a GPU
#      (GPU_CHECK_BENCH=1 keeps it) -> gpu_check.json. Budget: under 8 minutes (parity ~1 min).
#   scripts/gpu_check.sh                 # on the GPU machine; writes to ${OUT:-runs/gpu_check}/
#   TINY=1 scripts/gpu_check.sh          # the same code on the CPU with tiny shapes (tests/test_gpu_check.py)
#   BENCH=0 scripts/gpu_check.sh         # the checks alone
# Without a visible CUDA GPU both run their tiny modes (and say so in the JSON: "mode": "tiny" / "dry-run").
# The exit status is the checks', or the bench's when only the bench failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT_DIR=${OUT:-runs/gpu_check}
mkdir -p "$OUT_DIR"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'no cuda', torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
GPU=0
if [ -z "${TINY:-}" ] && "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then GPU=1; fi
ARGS=(--json "$OUT_DIR/gpu_check.json")
if [ -n "${TINY:-}" ]; then ARGS+=(--tiny); fi
BENCH_RC=0
if [ "${BENCH:-1}" != 0 ]; then
    BENCH_ARGS=(bench --gpu --json "$OUT_DIR/gpu_bench.json")
    if [ "$GPU" = 0 ]; then BENCH_ARGS+=(--dry-run --threads 1); fi
    timeout "${BENCH_TIMEOUT:-300}" "$PY" -m dlm_lsp "${BENCH_ARGS[@]}"
    BENCH_RC=$?
    echo "bench exit $BENCH_RC"
    if [ "$GPU" = 1 ] && [ -z "${GPU_CHECK_BENCH:-}" ]; then ARGS+=(--skip-bench); fi
fi
timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" scripts/gpu_check.py "${ARGS[@]}"
CHECK_RC=$?
[ "$CHECK_RC" != 0 ] && exit "$CHECK_RC"
exit "$BENCH_RC"
