"""`dlm-lsp bench --cold-start`: how long a new `dlm-lsp serve` takes to its first fill, as an editor
starts it, with and without DLM_LSP_PRESTART (dlm_lsp/engines.py), side by side.

Each case spawns `python -m dlm_lsp serve` and talks LSP to it as VS Code does: initialize at once,
initialized, didOpen, and an inline completion asked at the end of the empty loop body as soon as the
server says the engine is ready (the extension asks again then). Times from the spawn: the
initialize answer, the engine ready, the first fill answered. Cases, in rounds so each pair runs side
by side on the same machine state:
  inproc      - the engine in the server process (DLM_ENGINE=inproc)
  shared      - the user's shared engine, none running: the serve starts it (a private
                XDG_RUNTIME_DIR per case; the daemon is stopped after it)
  running     - the shared engine already running with the model loaded (started by the case before)
each with the hint off and on. Prints a table of medians and the on/off ratios; --json writes every
time and the settings. What the editor itself takes around this (activating the extension,
spawning the process, drawing the ghost text) is measured by the code-server suite (timings.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dlm_lsp.measure.replay import LspClient

SOURCE = "import os\n\n\ndef total(items):\n    s = 0\n    for x in items:\n        \n    return s\n"
URI_NAME = "cold_start.py"
LINE, COL = 6, 8
CASES = ("inproc", "shared", "running")
TIMEOUT_S = 180.0


async def _one(model: str | None, device: str, engine: str, hint: bool, runtime: Path, cwd: Path) -> dict[str, float]:
    """Times (s from the spawn) of one server's initialize answer, engine ready and first fill."""
    options: dict[str, Any] = {"model": model, "device": device}
    env = dict(os.environ, DLM_ENGINE="inproc" if engine == "inproc" else "shared", XDG_RUNTIME_DIR=str(runtime))
    env.pop("DLM_LSP_PRESTART", None)
    if hint:
        env["DLM_LSP_PRESTART"] = json.dumps(options)
    uri = (cwd / URI_NAME).as_uri()
    t0 = time.monotonic()
    c = LspClient([sys.executable, "-m", "dlm_lsp", "serve"], env=env, cwd=str(cwd))
    await c.start()
    try:
        await c.initialize(options, root=cwd.as_uri())
        t_init = time.monotonic() - t0
        await c.wait_ready(TIMEOUT_S)
        t_ready = time.monotonic() - t0
        c.notify(
            "textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": SOURCE}}
        )
        params = {
            "textDocument": {"uri": uri},
            "position": {"line": LINE, "character": COL},
            "context": {"triggerKind": 2},
        }
        await c.request("textDocument/inlineCompletion", params, timeout=TIMEOUT_S)
        t_fill = time.monotonic() - t0
    finally:
        await c.stop()
    return {"initialize_s": t_init, "ready_s": t_ready, "first_fill_s": t_fill}


def _stop_daemons(runtime: Path) -> None:
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
    subprocess.run([sys.executable, "-m", "dlm_lsp", "engine", "--stop"], env=env, capture_output=True, timeout=60)


async def _rounds(model: str | None, device: str, reps: int) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {f"{case} {h}": [] for case in CASES for h in ("off", "on")}
    cwd = Path(tempfile.mkdtemp(prefix="dlm-cold-"))
    (cwd / URI_NAME).write_text(SOURCE)
    try:
        for r in range(reps):
            for hint in (False, True) if r % 2 == 0 else (True, False):  # alternate which goes first
                h = "on" if hint else "off"
                runs[f"inproc {h}"].append(await _one(model, device, "inproc", hint, cwd, cwd))
                runtime = Path(tempfile.mkdtemp(prefix="dlmrt-", dir="/tmp"))  # short: socket paths
                try:
                    runs[f"shared {h}"].append(await _one(model, device, "shared", hint, runtime, cwd))
                    runs[f"running {h}"].append(await _one(model, device, "shared", hint, runtime, cwd))
                finally:
                    _stop_daemons(runtime)
                    shutil.rmtree(runtime, ignore_errors=True)
                print(f"  round {r + 1}/{reps}, hint {h}: done", flush=True)
    finally:
        shutil.rmtree(cwd, ignore_errors=True)
    return runs


def run_cold_start(args: argparse.Namespace, model: str | None) -> int:
    reps = 1 if args.quick else args.reps
    print(f"cold start of dlm-lsp serve: model {model or 'default'} on {args.device}, {reps} round(s)")
    runs = asyncio.run(_rounds(model, args.device, reps))
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    print(f"{'case':<10} {'hint':<5} {'initialize':>11} {'ready':>8} {'first fill':>11}")
    for case in CASES:
        for h in ("off", "on"):
            m = med[f"{case} {h}"]
            print(f"{case:<10} {h:<5} {m['initialize_s']:>10.2f}s {m['ready_s']:>7.2f}s {m['first_fill_s']:>10.2f}s")
    ratios = {case: med[f"{case} on"]["first_fill_s"] / med[f"{case} off"]["first_fill_s"] for case in CASES}
    print("first fill, hint on / off: " + ", ".join(f"{c} {r:.2f}x" for c, r in ratios.items()))
    if args.json_out:
        out = {
            "mode": "cold-start",
            "model": model or "default",
            "device": args.device,
            "rounds": reps,
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
            "runs": runs,
            "median": med,
            "first_fill_on_over_off": ratios,
        }
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0
