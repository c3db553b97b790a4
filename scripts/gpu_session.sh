#!/usr/bin/env bash
# One lease of the device machine (an H100 or H200 for at most 15 minutes, all tries together), as one command:
#   0. `dlm-lsp bench --gpu` first, alone on the GPU (its timings need it whole): random Dream-7B, LLaDA-8B
#      and SDAR-8B shapes in bf16, at most BENCH_S (300) s -> $OUT/gpu_bench.json, travelling in logs.tar
#      with its log (dlm_lsp/measure/gpu_bench.py; BENCH_S=0 skips it, for a lease that only trains);
#   1. the GPU checks in the background (scripts/gpu_check.py --skip-bench: every family's bf16 logits
#      on the GPU against fp32 on the CPU, and the slot-statistics kernel compiled for the GPU against
#      its torch reference);
#   2. a smoke run of the CUDA training path (3 steps on 200 files): a failure ends the lease at once;
#   3. two training runs side by side on the one GPU for the same wall-clock minutes (an equal-time size
#      comparison), both on the packed built corpus with the default's tokenizer, recipe as
#      scripts/gpu_train.sh (bf16 autocast, batch 128 x 512, warm-up / constant / cool-down), 4 holes
#      per infill window as the long run: A = the default's shape (dim 192, 5 layers, 3.97 M) and
#      B = dim 224, 6 layers (5.75 M; 1.4x the default's CPU fill cost, idle,
#      docs/research/scripts/size_latency.py; dim 256 x 6 costs 1.7x, which would put the default's p95
#      of ~180 ms past the 300 ms budget).
# Each run's best (EMA) checkpoint comes back as shards + rest.tar under $OUT/a and $OUT/b.
#
# Here, first (runs/ is ignored, so it is carried):
#   .venv/bin/python -m engine.train.pack --built runs/corpus --out runs/gpu_pack/corpus.tar.xz --limit-mb 48
#   cp models/default/tokenizer.json runs/gpu_pack/
# There (device run, carry ["runs/gpu_pack"]):   OUT=$OUT bash scripts/gpu_session.sh
# A rehearsal on the CPU (the plumbing, not the numbers): PACK=<a small pack> OUT=/tmp/x EXTRA="--device cpu
#   --max-steps 2 --max-files 100 --batch 4 --threads 1" WORKERS=0 bash scripts/gpu_session.sh
# Env: MINUTES (5.5, each run's training loop; 3 after the bench)  LIMIT_S (500, each run's hard stop; 300
#   after the bench: bench 5 + smoke 2 + training 5 minutes fit the lease)  WORKERS (6 per run)  BENCH_S (300)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:?set OUT to the folder that comes back}
PACK=${PACK:-runs/gpu_pack}
BENCH_S=${BENCH_S:-300}
if [ "$BENCH_S" != 0 ]; then MINUTES=${MINUTES:-3}; LIMIT_S=${LIMIT_S:-300}; fi
MINUTES=${MINUTES:-5.5}
LIMIT_S=${LIMIT_S:-500}
WORKERS=${WORKERS:-6}
export PYTHONUNBUFFERED=1 PY
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import sys, torch, triton, tokenizers, safetensors; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

# 0. the bench, alone (it stops starting sections 60 s before its timeout; its JSON is written after each)
touch "$OUT/bench.log"
if [ "$BENCH_S" != 0 ]; then
    BENCH_ARGS=(bench --gpu --budget-s $((BENCH_S - 60)) --json "$OUT/gpu_bench.json")
    "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || BENCH_ARGS+=(--dry-run --threads 1)
    timeout "$BENCH_S" "$PY" -m dlm_lsp "${BENCH_ARGS[@]}" > "$OUT/bench.log" 2>&1
    echo "bench exit $?"
    grep -v "^USDT" "$OUT/bench.log" | tail -60
fi

# 1. the checks, beside everything else (small shapes: they barely touch the GPU)
(timeout 400 "$PY" scripts/gpu_check.py --skip-bench --json "$OUT/gpu_check.json" > "$OUT/check.log" 2>&1; echo "check exit $?" >> "$OUT/check.log") &
CHECK=$!

# 2. the CUDA training path, 3 steps on 200 files
COMMON=(--tokenizer "$PACK/tokenizer.json" --holes 4 --val-examples 192 ${EXTRA:-})
if ! OUT= MINUTES=1 LIMIT_S=120 WORKERS=2 CORPUS="$PACK/corpus.tar.xz" bash scripts/gpu_train.sh runs/gpu-smoke \
        "${COMMON[@]}" --max-steps 3 --max-files 200 --dim 64 --n-layers 2 --n-heads 2 --ffn-dim 128 > "$OUT/smoke.log" 2>&1; then
    echo "SMOKE FAILED"; tail -40 "$OUT/smoke.log"; wait $CHECK; cat "$OUT/check.log"; exit 3
fi
echo "smoke ok: $(grep -c '\[save\]' "$OUT/smoke.log") save(s)"

# 3. A and B side by side
MINUTES=$MINUTES LIMIT_S=$LIMIT_S WORKERS=$WORKERS CORPUS="$PACK/corpus.tar.xz" OUT="$OUT/a" \
    bash scripts/gpu_train.sh runs/gpu-a "${COMMON[@]}" --dim 192 --n-layers 5 --n-heads 4 --ffn-dim 576 > "$OUT/a.log" 2>&1 &
A=$!
MINUTES=$MINUTES LIMIT_S=$LIMIT_S WORKERS=$WORKERS CORPUS="$PACK/corpus.tar.xz" OUT="$OUT/b" \
    bash scripts/gpu_train.sh runs/gpu-b "${COMMON[@]}" --dim 224 --n-layers 6 --n-heads 4 --ffn-dim 672 > "$OUT/b.log" 2>&1 &
B=$!
wait $CHECK
cat "$OUT/check.log"
sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader || true
wait $A; echo "A exit $?"
wait $B; echo "B exit $?"
for r in a b; do
    echo "== $r"; grep -E "corpus:|model:|\[save\]|Error|error" "$OUT/$r.log" | tail -12
    tail -3 "runs/gpu-$r/train_log.jsonl" 2>/dev/null
done
# logs travel in one file (at most 8 files come back)
# (the bench's JSON too: a/ and b/ and gpu_check.json take the other seven)
[ -f "$OUT/gpu_bench.json" ] || echo '{}' > "$OUT/gpu_bench.json"
tar -cf "$OUT/logs.tar" -C "$OUT" smoke.log a.log b.log check.log bench.log gpu_bench.json -C "$PWD/runs" gpu-a/train_log.jsonl gpu-b/train_log.jsonl 2>/dev/null
rm -f "$OUT"/smoke.log "$OUT"/a.log "$OUT"/b.log "$OUT"/check.log "$OUT"/bench.log "$OUT"/gpu_bench.json
find "$OUT" -type f | xargs ls -la
