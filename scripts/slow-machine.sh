#!/usr/bin/env bash
# Runs a command as a slower machine would: it and every process it starts are pinned to one CPU, and a
# busy loop shares that CPU, so each gets about half of one core (2-4x slower than two idle cores). A
# test that assumes a speed (a sleep that orders events, a budget that a fresh server must beat) fails
# here first. `make test-slow` runs the whole suite this way.
#   bash scripts/slow-machine.sh CMD [ARGS...]     SLOW_CPU=N picks the CPU (default 0)
set -euo pipefail
command -v taskset >/dev/null || { echo "slow-machine: taskset (util-linux) is needed" >&2; exit 2; }
cpu=${SLOW_CPU:-0}
taskset -c "$cpu" sh -c 'while :; do :; done' &
busy=$!
trap 'kill "$busy" 2>/dev/null || true' EXIT
echo "slow-machine: $* pinned to CPU $cpu beside a busy loop (pid $busy)" >&2
taskset -c "$cpu" "$@"
