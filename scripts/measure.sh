#!/usr/bin/env bash
# Re-measures everything the closing notes quote, into docs/research/measurements/ (run with nothing
# else on the CPU; about 27 minutes on the 2-core CPU). The commands are the ones
# docs/research/measurements/README.md lists.
set -euo pipefail
cd "$(dirname "$0")/.."
M=docs/research/measurements
B=.venv/bin/dlm-lsp
mkdir -p $M
run() { echo "+ $*" >&2; "$@"; }
run $B ctxbench --json $M/ctx.json
run $B bench --threads 2 --json $M/bench.json
run $B bench --threads 1 --json $M/bench_1thread.json
run $B replay examples/tide_log.py --cps 10 --json $M/replay.json --png $M/replay_latency.png
run $B replay examples/tide_log.py --cps 10 --cancel --json $M/replay_cancel.json
run $B eval --threads 2 --ar-model models/default-ar --json $M/eval.json --md $M/eval.md
run $B eval --threads 2 --ar-model models/default-ar --decode '{"heal": false}' --json $M/eval_no_heal.json --md $M/eval_no_heal.md
run $B demo > $M/demo.txt
