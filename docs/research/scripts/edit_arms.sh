#!/usr/bin/env bash
# Research probe, kept as it ran at the commit that adds it; not maintained.
# Issue 46's bake-off: three branches of the default model at equal CPU time, one thread each, side
# by side, on one cooldown plan (warmup, then the LR decayed linearly to 10% over HOURS CPU-hours):
#   A  today's objective (the control: more of the same compute)
#   B  + next-edit canvases (the real train-side release pairs and the synthetic edits) at EDIT_SHARE
#   C  B + correction: CORRECT_SHARE of the examples with visible tokens made wrong, every visible
#      token a target
# Each arm resumes its own OUT_ROOT/edit-<arm>/last (optimizer state kept) when there is one, else
# starts from models/default; UNTIL stops a segment at that many CPU-hours of the plan (the clock is
# the checkpoint's, which starts at the default's 24.003), so a plan runs over several sessions.
#
#     OUT_ROOT=.cache/i46 EDIT_DATA=.cache/edit-cases-full,.cache/i46/synth \
#         CORPUS=.cache/i46/corpus HOURS=2 NICE=19 bash docs/research/scripts/edit_arms.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT_ROOT=${OUT_ROOT:-runs}
CORPUS=${CORPUS:-runs/corpus}
EDIT_DATA=${EDIT_DATA:?folders of edit cases: dlm-lsp corpus --edits and --synthetic-edits}
HOURS=${HOURS:-2}
LR=${LR:-3e-4}
EDIT_SHARE=${EDIT_SHARE:-0.25}
CORRECT_SHARE=${CORRECT_SHARE:-0.15}
NICE=${NICE:-0}
ARMS=${ARMS:-A B C}
DLM=.venv/bin/dlm-lsp
START=$(.venv/bin/python -c "import json; print(json.load(open('models/default/training_state.json'))['hours'])")
read -r TOTAL SHARE < <(.venv/bin/python -c "t = $START + $HOURS; print(f'{t:.6f} {$HOURS / t:.6f}')")
UNTIL=${UNTIL:-$TOTAL}
for arm in $ARMS; do
  extra=()
  case $arm in
    A) ;;
    B) extra=(--edit-data "$EDIT_DATA" --edit-share "$EDIT_SHARE") ;;
    C) extra=(--edit-data "$EDIT_DATA" --edit-share "$EDIT_SHARE" --correct-share "$CORRECT_SHARE") ;;
    *) echo "no arm $arm" >&2; exit 2 ;;
  esac
  out=$OUT_ROOT/edit-$arm
  from=models/default
  [ -f "$out/last/training_state.json" ] && from=$out/last
  mkdir -p "$out"
  OMP_NUM_THREADS=1 setsid nohup nice -n "$NICE" $DLM train --corpus "$CORPUS" --out "$out" --resume "$from" \
    --lr "$LR" --minutes 6000 --total-hours "$TOTAL" --decay-share "$SHARE" --until-hours "$UNTIL" --clock cpu \
    --threads 1 --val-examples 192 --no-progress --holes 4 --anneal-steps 1000 --save-every-min 10 \
    "${extra[@]}" >> "$out/stdout.log" 2>&1 &
  echo "edit-$arm: pid $! (from $from, plan to $TOTAL CPU-h, this segment to $UNTIL), log $out/stdout.log"
done
