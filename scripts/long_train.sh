#!/usr/bin/env bash
# The long training of the bake-off's winner, recipe (b) (docs/research/20-s11-names-on-long-training-started.md): one
# warmup-stable-decay plan of HOURS CPU-hours (--clock cpu), one thread, in the background, resumed
# across sessions with its optimizer state so that the plan continues without re-warm-up.
# It branches from (b)'s stable phase: v2b at 2.57 CPU-hours (step 4,895, committed in 673e73e, before
# its 3.5-hour plan began to decay), so the LR stays at its peak until 80% of HOURS.
#
#     bash scripts/long_train.sh                  # start, or resume runs/v2b-long/last (or the committed copy)
#     MINUTES=150 bash scripts/long_train.sh      # a segment of at most 150 wall-clock minutes
#     .venv/bin/python scripts/bakeoff_snapshot.py v2b-long   # runs/v2b-long/last -> models/bakeoff/v2b-long
# The run's committed state left the tree: `git checkout 27c1395 -- models/bakeoff/v2b-long` brings it
# back to resume it (without it a fresh clone starts the run over from v2b's checkpoint below).
set -euo pipefail
cd "$(dirname "$0")/.."
HOURS=${HOURS:-24}
MINUTES=${MINUTES:-600}
NICE=${NICE:-10}
DLM=.venv/bin/dlm-lsp
NAME=v2b-long
[ -f runs/corpus/corpus.json ] || $DLM corpus --out runs/corpus
START=runs/start/v2b-2.57
if [ ! -f $START/optimizer.safetensors ]; then
  mkdir -p runs/start/tmp && git archive 673e73e models/bakeoff/v2b | tar -x -C runs/start/tmp
  rm -rf $START && mv runs/start/tmp/models/bakeoff/v2b $START && rm -rf runs/start/tmp
fi
out=runs/$NAME
mkdir -p "$out"
if [ -f "$out/last/optimizer.safetensors" ]; then resume=$out/last
elif [ -f "models/bakeoff/$NAME/optimizer.safetensors" ]; then resume=models/bakeoff/$NAME  # a fresh clone
else resume=$START
fi
OMP_NUM_THREADS=1 setsid nohup nice -n "$NICE" $DLM train --corpus runs/corpus --out "$out" --resume "$resume" \
  --minutes "$MINUTES" --total-hours "$HOURS" --clock cpu --threads 1 --val-examples 192 --no-progress \
  --holes 4 --anneal-steps 1000 >> "$out/stdout.log" 2>&1 &
echo "$NAME: pid $! (from $resume), log $out/stdout.log"
