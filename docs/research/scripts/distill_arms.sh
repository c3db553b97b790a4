#!/usr/bin/env bash
# Research probe, kept as it ran at commit 483d2d0; not maintained: it may not run against today's layout.
# Candidate (e) at equal compute (docs/MODEL.md, "Session 15"): two branches of the long run from one
# checkpoint, side by side, one thread each, on the long run's own plan (24 CPU-hours, still at its
# peak LR), for the same HOURS of CPU time: the control trains as the long run does; the student also
# draws KD_SHARE of its masked-diffusion windows from the teacher's targets (`dlm-lsp distill-targets`)
# with their soft targets weighted KD_WEIGHT. Held-out loss and the eval's holes judge them.
#
#     FROM=runs/start/e-from HOURS=0.75 bash docs/research/scripts/distill_arms.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
FROM=${FROM:?a checkpoint folder of the long run (with optimizer.safetensors)}
HOURS=${HOURS:-0.75}
TARGETS=${TARGETS:-runs/teacher}
KD_SHARE=${KD_SHARE:-0.5}
KD_WEIGHT=${KD_WEIGHT:-0.5}
NICE=${NICE:-0}
DLM=.venv/bin/dlm-lsp
UNTIL=$(.venv/bin/python -c "import json; print(json.load(open('$FROM/training_state.json'))['hours'] + $HOURS)")
for arm in control student; do
  extra=()
  [ "$arm" = student ] && extra=(--distill "$TARGETS" --kd-share "$KD_SHARE" --kd-weight "$KD_WEIGHT")
  out=runs/e-$arm
  mkdir -p "$out"
  OMP_NUM_THREADS=1 setsid nohup nice -n "$NICE" $DLM train --corpus runs/corpus --out "$out" --resume "$FROM" \
    --until-hours "$UNTIL" --minutes 600 --total-hours 24 --clock cpu --threads 1 --val-examples 192 --no-progress \
    --holes 4 --anneal-steps 1000 "${extra[@]}" >> "$out/stdout.log" 2>&1 &
  echo "e-$arm: pid $! (from $FROM to $UNTIL CPU-h), log $out/stdout.log"
done
