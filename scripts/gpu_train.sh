#!/usr/bin/env bash
# The GPU recipe: `dlm-lsp train` on CUDA (bf16 autocast, engine/train/loop.py) with a larger batch, at most
# ~8 minutes in all, on the corpus packed by engine/train/pack.py; then the checkpoints are split
# into safetensors shards of at most SHARD_MB MiB (engine/weights/shard.py), the size that comes back from
# the device machine.
#
#   python -m engine.train.pack                   # here: runs/corpus/train.tar.xz (~5 MiB)
#   python -m engine.train.pack --built runs/corpus --out runs/gpu_pack/corpus.tar.xz --limit-mb 48
#                                                 # or the built corpus of `dlm-lsp corpus` (~35 MiB), trained
#                                                 # with --corpus on its own three sides
#   scripts/gpu_train.sh [RUN_DIR] [dlm-lsp train flags, overriding the defaults below]
#
# On the device machine (carry runs/corpus; add runs/default/best and RESUME=... to continue the
# CPU-trained model instead of starting fresh):
#   OUT=$OUT scripts/gpu_train.sh runs/gpu
# Env: CORPUS (runs/corpus/train.tar.xz)  PY (python3)  MINUTES (6, training loop only)
#      LIMIT_S (480, hard stop for the whole train command)  WORKERS (12 batch-building processes)
#      SHARD_MB (16)  RESUME (checkpoint folder to continue from)  OUT (export folder, see the end)
set -euo pipefail
cd "$(dirname "$0")/.."
RUN="${1:-runs/gpu}"
[ $# -gt 0 ] && shift
CORPUS="${CORPUS:-runs/corpus/train.tar.xz}"
PY="${PY:-python3}"
MINUTES="${MINUTES:-6}"
LIMIT_S="${LIMIT_S:-480}"
WORKERS="${WORKERS:-12}"
SHARD_MB="${SHARD_MB:-16}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# TOKENIZERS_PARALLELISM is left alone: the corpus is encoded in parallel here, and the batch workers
# forked afterwards must not use the Rust thread pool (forced on, their first encode_batch deadlocks)

if [ ! -f "$CORPUS" ]; then
    echo "no packed corpus at $CORPUS; run: python -m engine.train.pack" >&2
    exit 2
fi
rm -rf "$RUN/corpus"
mkdir -p "$RUN/corpus"
"$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" "$CORPUS" "$RUN/corpus"  # no xz binary needed
SOURCES=()
if [ -f "$RUN/corpus/corpus.json" ]; then  # a packed built corpus (engine.train.pack --built): its own split
    SOURCES=(--corpus "$RUN/corpus")
else
    for d in "$RUN"/corpus/*/; do SOURCES+=(--source "${d%/}"); done
fi
RESUME_ARGS=()
[ -n "${RESUME:-}" ] && RESUME_ARGS=(--resume "$RESUME")

# `dlm-lsp train`'s own parser and run function; two fields it has no flag for are set here: the
# machine's own stdlib stays out (the packed copy holds the split), and batches are built by workers.
STATUS=0
(timeout -s INT "$LIMIT_S" "$PY" - "${SOURCES[@]}" "${RESUME_ARGS[@]}" --out "$RUN" --device cuda \
    --minutes "$MINUTES" --batch 128 --seq-len 512 --lr 1e-3 --warmup 200 \
    --vocab 8192 --dim 256 --n-layers 6 --n-heads 4 --ffn-dim 768 \
    --save-every-min 2 --no-progress "$@" <<PYEOF
import argparse, sys
from engine.train.command import add_train_args, run_train
p = argparse.ArgumentParser(prog="dlm-lsp train")
add_train_args(p)
args = p.parse_args(sys.argv[1:])
args.stdlib = False
args.workers = $WORKERS
try:
    sys.exit(run_train(args))
except KeyboardInterrupt:  # the hard stop: the last periodic checkpoint stands
    print("stopped at the time limit; keeping the last saved checkpoint", file=sys.stderr)
    sys.exit(124)
PYEOF
) || STATUS=$?

CKPTS=()
for d in "$RUN/best" "$RUN/last"; do [ -d "$d" ] && CKPTS+=("$d"); done
if [ ${#CKPTS[@]} -eq 0 ]; then
    echo "training wrote no checkpoint (exit $STATUS)" >&2
    [ "$STATUS" -eq 0 ] && STATUS=1
    exit "$STATUS"
fi
"$PY" -m engine.weights.shard "${CKPTS[@]}" --max-mb "$SHARD_MB"

# Export for the device tool (at most 8 files of 16 MiB come back): the weight shards as they are,
# everything else of best/ (config, index, tokenizer, state, log, curve; not the optimizer state, twice
# the weights' size) and the split in one tar:
#   mkdir ckpt && tar -xf best/rest.tar -C ckpt && cp best/model-*.safetensors ckpt/
if [ -n "${OUT:-}" ]; then
    RUN_ABS="$(cd "$RUN" && pwd)"
    mkdir -p "$OUT/best"
    cp "$RUN_ABS"/best/model-*.safetensors "$OUT/best/"
    tar -cf "$OUT/best/rest.tar" -C "$RUN_ABS/best" --exclude 'model-*.safetensors' --exclude optimizer.safetensors . \
        -C "$RUN_ABS" split.json
    ls -la "$OUT/best"
fi
echo "checkpoints: $RUN/best and $RUN/last (sharded at $SHARD_MB MiB); training exit status $STATUS"
exit "$STATUS"
