#!/usr/bin/env bash
# The default-model v2 bake-off (docs/research/08-v2-overview.md): every candidate gets the same CPU-hours
# (--clock cpu counts this process's CPU time, so jobs that share the cores stay comparable), one
# thread each, side by side, on the corpus of `dlm-lsp corpus`. Each call starts the candidates that
# have no checkpoint yet and resumes the others from runs/<name>/last (or, on a fresh clone, from the
# committed models/bakeoff/<name>), optimizer state included, so
# the warmup-stable-decay schedule planned over HOURS continues across sessions without re-warm-up.
#
#     bash scripts/bakeoff.sh [candidate ...]     # default: the candidates still running (LIVE; none since session 11)
#     HOURS=3.5 MINUTES=600 bash scripts/bakeoff.sh v2a v2-ar
set -euo pipefail
cd "$(dirname "$0")/.."
HOURS=${HOURS:-3.5}       # CPU-hours per candidate, planned once
MINUTES=${MINUTES:-600}   # wall-clock cap of this segment
UNTIL=${UNTIL:-}          # stop (and save) at this many CPU-hours, to compare candidates at equal compute mid-run
NICE=${NICE:-10}          # 0 when the trainings should not yield to the session's other work
DLM=.venv/bin/dlm-lsp
[ -f runs/corpus/corpus.json ] || $DLM corpus --out runs/corpus

declare -A RECIPE=(
  # (a) masked diffusion, several server-shaped holes per infill window
  [v2a]="--holes 4"
  # the AR twin at equal compute: FIM documents, loss on every token; its checkpoints are also the
  # first phase of recipe (b), AR first and then adapted to diffusion
  [v2-ar]="--objective ar"
  # (c) causal-attention diffusion with reordering (engine/decode/reorder.py): observed tokens first at their
  # logical positions, masks last, strict causal attention; 4 server-shaped holes per infill window.
  # Its context K/V are exact across denoising steps and keystrokes (FillJob.session). It starts from
  # nothing with the tokenizer v2a trained on the corpus (the same file as v2-ar's), so all share one
  [v2c]="--objective reorder --holes 4 --tokenizer models/bakeoff/v2a/tokenizer.json"
  # (b) AR first, then adapted to diffusion: v2-ar's checkpoint at 0.99 CPU-hours (step 1,766, the one
  # committed in 2e32686) resumed with the diffusion objective of v2a, the AR head's logit shift kept
  # and attention annealed from causal to full over 1,000 steps; the same 3.5 CPU-hours in all
  [v2b]="--holes 4 --anneal-steps 1000"
  # (f) AR first, then (c)'s causal diffusion with reordering (WeDLM's path): v2b's start (v2-ar at
  # 0.99 CPU-hours), resumed with the reorder objective. Attention stays causal, so nothing is
  # annealed and the AR weights keep their attention; its context K/V are exact, as (c)'s
  [v2f]="--objective reorder --holes 4"
)
# where a candidate with no checkpoint of its own starts from (its first phase): v2-ar at 0.99
# CPU-hours, as committed in 2e32686 (models/bakeoff/v2-ar has moved on since), taken from git history
AR_START=runs/start/v2-ar-0.99
if [ ! -f $AR_START/optimizer.safetensors ]; then
  mkdir -p runs/start/tmp && git archive 2e32686 models/bakeoff/v2-ar | tar -x -C runs/start/tmp
  rm -rf $AR_START && mv runs/start/tmp/models/bakeoff/v2-ar $AR_START && rm -rf runs/start/tmp
fi
declare -A START=([v2b]=$AR_START [v2f]=$AR_START)
# v2b and v2f have reached their 3.5 hours; v2a and v2c were retired in session 9 and v2f in session
# 11, behind at equal compute (docs/research/17-s09-bakeoff-equal-compute-candidate-f.md, docs/research/20-s11-names-on-long-training-started.md); they stay here to be
# reproduced by name. The winner's long training is scripts/long_train.sh.
LIVE=()
names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${LIVE[@]}")
for name in "${names[@]}"; do
  args=${RECIPE[$name]:?unknown candidate $name}
  out=runs/$name
  mkdir -p "$out"
  resume=()
  until=()
  [ -z "$UNTIL" ] || until=(--until-hours "$UNTIL")
  if [ -f "$out/last/optimizer.safetensors" ]; then resume=(--resume "$out/last")
  elif [ -f "models/bakeoff/$name/optimizer.safetensors" ]; then resume=(--resume "models/bakeoff/$name")  # a fresh clone
  elif [ -n "${START[$name]:-}" ]; then resume=(--resume "${START[$name]}")
  fi
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 setsid nohup nice -n "$NICE" $DLM train --corpus runs/corpus --out "$out" "${resume[@]}" "${until[@]}" \
    --minutes "$MINUTES" --total-hours "$HOURS" --clock cpu --threads 1 --val-examples 192 --no-progress $args \
    >> "$out/stdout.log" 2>&1 &
  echo "$name: pid $! (${resume[*]:-fresh}), log $out/stdout.log"
done
