#!/usr/bin/env bash
# Research probe, kept as it ran at commit b1626c9; not maintained: it may not run against today's layout.
# A cooldown branch of a warmup-stable-decay run (docs/MODEL.md, "Long training"): resume a checkpoint
# taken at the peak LR (its optimizer state kept, so no re-warm-up) and decay the LR linearly to 10%
# over the next DECAY CPU-hours, into its own folder. The run it branches from goes on untouched, so a
# usable model is had at any point of the long plan without waiting for its own decay.
#
#     FROM=models/bakeoff/v2b-long NAME=v2b-cool DECAY=0.75 bash docs/research/scripts/cooldown.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
FROM=${FROM:-models/bakeoff/v2b-long}
NAME=${NAME:-v2b-cool}
DECAY=${DECAY:-0.75}
NICE=${NICE:-10}
EXTRA=${EXTRA:-}   # more `dlm-lsp train` flags, e.g. EXTRA="--infill-share 0.9"
DLM=.venv/bin/dlm-lsp
[ -f runs/corpus/corpus.json ] || $DLM corpus --out runs/corpus
# the plan ends DECAY hours after the checkpoint's point and decays over exactly that share of it
read -r TOTAL SHARE < <(.venv/bin/python -c "
import json, sys
h = json.load(open('$FROM/training_state.json'))['hours']
t = h + $DECAY
print(f'{t:.6f} {$DECAY / t:.6f}')")
out=runs/$NAME
mkdir -p "$out"
OMP_NUM_THREADS=1 setsid nohup nice -n "$NICE" $DLM train --corpus runs/corpus --out "$out" --resume "$FROM" \
  --minutes 600 --total-hours "$TOTAL" --decay-share "$SHARE" --clock cpu --threads 1 --val-examples 192 \
  --no-progress --holes 4 --anneal-steps 1000 $EXTRA >> "$out/stdout.log" 2>&1 &
echo "$NAME: pid $! (from $FROM, decay over $DECAY CPU-h to $TOTAL), log $out/stdout.log"
