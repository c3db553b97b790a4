# Research probe, kept as it ran at commit 5d2dac2; not maintained: it may not run against today's layout.
"""Resident memory of N editor windows on the shared engine vs one window with its own engine.

Starts N `dlm-lsp serve` processes with the shared engine (a private XDG_RUNTIME_DIR, so the
user's own daemon is neither used nor disturbed) and one with `--engine inproc`, asks each for one
fill, and prints the RSS of every process (VmRSS from /proc) and the ratio
(daemon + N thin serves) / (one in-process serve). JSON with --json.

    .venv/bin/python docs/research/scripts/engine_memory.py --windows 3 [--model PATH] [--json mem.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from dlm_lsp.measure.replay import LspClient  # noqa: E402

SRC = "import os\n\n\ndef total(items):\n    s = 0\n    for x in items:\n        \n    return s\n"
SERVE = [sys.executable, "-m", "dlm_lsp", "serve"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


async def window(env: dict, options: dict, i: int) -> LspClient:
    c = LspClient(SERVE, env=env, cwd=str(REPO))
    await c.start()
    await c.initialize(options)
    await c.wait_ready(300)
    uri = f"file:///tmp/engine_memory_{i}.py"
    c.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": SRC}})
    await c.request("textDocument/inlineCompletion", {"textDocument": {"uri": uri}, "position": {"line": 6, "character": 8},
                                                      "context": {"triggerKind": 2}}, timeout=120)
    return c


async def measure(n: int, model: str | None, device: str) -> dict:
    runtime = tempfile.mkdtemp(prefix="dlmmem-", dir="/tmp")
    base = dict(os.environ, XDG_RUNTIME_DIR=runtime, DLM_ENGINE_IDLE_S="30")
    options = {"device": device, **({"model": model} if model else {})}
    clients: list[LspClient] = []
    daemon_pid = None
    try:
        for i in range(n):  # one after the other: the first starts the daemon, the others find it
            clients.append(await window(dict(base, DLM_ENGINE="shared"), options, i))
        from engine.serve import daemon as engine_daemon

        os.environ["XDG_RUNTIME_DIR"] = runtime
        st = engine_daemon.ask_all("status")
        assert len(st) == 1, st
        daemon_pid = st[0]["pid"]
        thin = [rss_mb(c.proc.pid) for c in clients]
        daemon = rss_mb(daemon_pid)
        inproc_client = await window(dict(base, DLM_ENGINE="inproc"), options, n)
        clients.append(inproc_client)
        inproc = rss_mb(inproc_client.proc.pid)
        shared_total = daemon + sum(thin)
        return {"windows": n, "model": st[0]["resolved_model"], "device": st[0]["device"], "model_loads": st[0]["loads"],
                "daemon_mb": round(daemon, 1), "thin_serve_mb": [round(x, 1) for x in thin],
                "shared_total_mb": round(shared_total, 1), "inproc_serve_mb": round(inproc, 1),
                "ratio_shared_to_one_inproc": round(shared_total / inproc, 3),
                "ratio_n_inproc_to_shared": round(n * inproc / shared_total, 3)}
    finally:
        for c in clients:
            await c.stop()
        if daemon_pid is not None:
            try:
                os.kill(daemon_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        shutil.rmtree(runtime, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    r = asyncio.run(measure(args.windows, args.model, args.device))
    print(f"model {r['model']} on {r['device']}, {r['windows']} windows, model loads {r['model_loads']}")
    print(f"{'process':<28}{'RSS MB':>10}")
    print(f"{'engine daemon':<28}{r['daemon_mb']:>10.0f}")
    for i, x in enumerate(r["thin_serve_mb"]):
        print(f"{f'thin serve {i + 1}':<28}{x:>10.0f}")
    print(f"{'shared total':<28}{r['shared_total_mb']:>10.0f}")
    print(f"{'one serve, engine inproc':<28}{r['inproc_serve_mb']:>10.0f}")
    print(f"{r['windows']} windows shared / 1 window in-process: {r['ratio_shared_to_one_inproc']:.2f}x "
          f"(target <= 1.3x); {r['windows']} in-process windows would be {r['ratio_n_inproc_to_shared']:.2f}x the shared total")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
