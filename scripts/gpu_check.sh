#!/usr/bin/env bash
# The GPU check of issue 13 on one GPU (an H200 in the plan): bf16-vs-fp32 parity for every family,
# then a random Dream-7B bench (first forward, cached step, 32/64-slot fills, a batch of 8), JSON out.
# Budget: under 8 minutes (parity ~1 min for writing the tiny checkpoints, bench ~2-4 min).
#   scripts/gpu_check.sh                 # on the GPU machine; writes ${OUT:-runs/gpu_check}/gpu_check.json
#   TINY=1 scripts/gpu_check.sh          # the same code on the CPU with tiny shapes (tests/test_gpu_check.py)
# Without a visible CUDA GPU it runs the tiny mode too (and says so in the JSON: "mode": "tiny").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT_DIR=${OUT:-runs/gpu_check}
mkdir -p "$OUT_DIR"
ARGS=(--json "$OUT_DIR/gpu_check.json")
if [ -n "${TINY:-}" ]; then ARGS+=(--tiny); fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'no cuda', torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
exec timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" scripts/gpu_check.py "${ARGS[@]}"
