"""`dlm-lsp soak`: type real code into the server for minutes, like an editor, and watch it hold up.

The server runs as a subprocess over stdio (`dlm-lsp serve`; a `scripted:...` model runs the real
server with the scripted engine, as `dlm-lsp fuzz` does). --docs documents are open at once; the
"user" types into one at a time at --cps keystrokes per second (all documents together), switching
documents every few dozen keystrokes, each document typing a source file (examples/, then held-out
stdlib files; --source to choose) and starting the next file when one is done. After every
keystroke it requests inline completion at the cursor, as VS Code does; before that, with
probability --cancel-rate, it sends $/cancelRequest for the previous request still unanswered.
Reported (and written with --json): requests sent, answered (any response, RequestCancelled
included), fills (non-empty answers), cancelled (RequestCancelled answers), errors (other error
responses, plus the server's own `errors` counter), lost (unanswered when the run ends, after a
grace of --grace-s), late (answered later than --late-ms), p50/p95/max latency of all answers, the
server's RSS (VmRSS from /proc/<pid>/status, its child processes included) sampled every second and its growth from the end of
warm-up (--warmup-s) to the end, in percent. The engine runs inside the server (DLM_ENGINE=inproc),
so that RSS is the model's too; with --engine shared the daemon's RSS is reported beside it.
Exit status 1 when lost > 0 or late > 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from dlm_lsp.measure.fuzz.checks import server_exceptions
from dlm_lsp.measure.fuzz.client import FuzzClient, server_command
from dlm_lsp.measure.fuzz.reference import utf16_len
from dlm_lsp.measure.replay import LspError, _percentile, stamp_done
from engine.paths import EXAMPLES_DIR, REPO_ROOT

CANCELLED = -32800


def rss_kb(pid: int) -> int | None:
    """VmRSS of a process in kB (None where /proc has none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def tree_rss_kb(pid: int) -> int | None:
    """VmRSS of a process and all its descendants in kB (an engine in a child process counts too)."""
    total, todo, seen = None, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        kb = rss_kb(p)
        if kb is None:
            continue
        total = (total or 0) + kb
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return total


def engine_daemons() -> list[int]:
    """Pids of this user's shared engine daemons (`dlm-lsp engine`), which no server parents."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if d.stat().st_uid != os.getuid():
                continue
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith((b"dlm_lsp", b"dlm-lsp")) for a in argv) and b"engine" in argv:
            out.append(int(d.name))
    return out


def default_sources(most: int = 8, max_bytes: int = 40_000) -> list[Path]:
    """The files to type: examples/, then the first held-out stdlib files (never trained on)."""
    files = sorted(EXAMPLES_DIR.glob("*.py"))
    try:
        from engine.train.corpus import collect, is_heldout

        held = [f.path for f in collect() if is_heldout(f.key) and 500 < f.path.stat().st_size < max_bytes]
        files += held[:most]
    except Exception:  # noqa: BLE001 - the examples alone will do
        pass
    return files


class Soak:
    def __init__(
        self,
        seconds: float,
        cps: float = 20.0,
        docs: int = 5,
        cancel_rate: float = 1.0,
        model: str | None = None,
        sources: list[Path] | None = None,
        warmup_s: float | None = None,
        late_ms: float = 2000.0,
        grace_s: float = 5.0,
        seed: int = 0,
        budget_ms: int | None = None,
        server_cmd: list[str] | None = None,
        log_path: str | None = None,
        options: dict[str, Any] | None = None,
        engine: str = "inproc",
        next_edit_rate: float = 0.1,
    ) -> None:
        self.seconds, self.cps, self.n_docs, self.cancel_rate = seconds, cps, docs, cancel_rate
        self.next_edit_rate = next_edit_rate  # the share of keystrokes also followed by a dlm/nextEdit
        self.model, self.late_ms, self.grace_s = model, late_ms, grace_s
        self.warmup_s = warmup_s if warmup_s is not None else min(60.0, seconds * 0.2)
        self.rng = random.Random(seed)
        self.options = dict(options or {})
        if model:
            self.options["model"] = model
        if budget_ms:
            self.options["budgetMs"] = budget_ms
        self.cmd = server_cmd or server_command(model)
        self.log_path = log_path
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in (sources or default_sources())]
        self.texts = [t for t in texts if t.strip()] or ["def f(x):\n    return x + 1\n"]
        self.records: list[dict[str, Any]] = []
        self.rss: list[tuple[float, int]] = []
        self.engine = engine  # "inproc": the model lives in the server process; "shared": in a daemon
        self.engine_rss: list[tuple[float, int]] = []
        self.exceptions: dict[str, int] = {}

    async def run(self) -> dict[str, Any]:
        log = open(self.log_path, "w+b") if self.log_path else tempfile.TemporaryFile()
        client = FuzzClient(self.cmd, cwd=str(REPO_ROOT), stderr=log, env={**os.environ, "DLM_ENGINE": self.engine})
        await client.start()
        try:
            await client.initialize(self.options)
            status = await client.wait_ready(300)
            sampler = asyncio.create_task(self._sample_rss(client.process.pid))
            t0 = time.monotonic()
            await self._type(client)
            typed_s = time.monotonic() - t0
            pending = [r["future"] for r in self.records if not r["future"].done()]
            if pending:
                await asyncio.wait(pending, timeout=self.grace_s)
            sampler.cancel()
            exited = client.process.returncode
            stats: dict[str, Any] = {}
            if exited is None:
                try:
                    stats = await client.request("dlm/stats", {}, timeout=10)
                except (TimeoutError, LspError):  # a server without dlm/stats
                    pass
        finally:
            await client.stop()
            self.exceptions = server_exceptions(log)
            log.close()
        return self.report(status, stats, typed_s, exited)

    async def _sample_rss(self, pid: int) -> None:
        t0 = time.monotonic()
        while True:
            kb, t = tree_rss_kb(pid), round(time.monotonic() - t0, 1)
            if kb is not None:
                self.rss.append((t, kb))
            if self.engine == "shared":
                daemon = [rss_kb(p) or 0 for p in engine_daemons()]
                if daemon:
                    self.engine_rss.append((t, sum(daemon)))
            await asyncio.sleep(1.0)

    async def _type(self, client: FuzzClient) -> None:
        """Keystrokes at --cps until --seconds are up."""
        docs: list[dict[str, Any]] = []
        for i in range(self.n_docs):
            uri = f"file:///soak/doc{i}.py"
            client.notify(
                "textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": ""}}
            )
            docs.append({"uri": uri, "version": 1, "file": i % len(self.texts), "i": 0, "line": 0, "char": 0})
        loop = asyncio.get_running_loop()
        start, k, active, prev = loop.time(), 0, 0, None
        left_here = self.rng.randint(20, 120)
        while loop.time() - start < self.seconds:
            await asyncio.sleep(max(0.0, start + k / self.cps - loop.time()))
            k += 1
            left_here -= 1
            if left_here <= 0:
                active, left_here = self.rng.randrange(self.n_docs), self.rng.randint(20, 120)
            d = docs[active]
            text = self.texts[d["file"]]
            if d["i"] >= len(text):  # file done: empty the document and type the next file
                d.update(file=(d["file"] + 1) % len(self.texts), i=0, line=0, char=0, version=d["version"] + 1)
                client.notify(
                    "textDocument/didChange",
                    {"textDocument": {"uri": d["uri"], "version": d["version"]}, "contentChanges": [{"text": ""}]},
                )
                continue
            ch = text[d["i"]]
            d["i"] += 1
            d["version"] += 1
            at = {"line": d["line"], "character": d["char"]}
            client.notify(
                "textDocument/didChange",
                {
                    "textDocument": {"uri": d["uri"], "version": d["version"]},
                    "contentChanges": [{"range": {"start": at, "end": at}, "text": ch}],
                },
            )
            if ch == "\n":
                d["line"], d["char"] = d["line"] + 1, 0
            else:
                d["char"] += utf16_len(ch)
            if prev is not None and not prev[1].done() and self.rng.random() < self.cancel_rate:
                client.cancel(prev[0])
            msg_id, fut = client.send_request(
                "textDocument/inlineCompletion",
                {
                    "textDocument": {"uri": d["uri"]},
                    "position": {"line": d["line"], "character": d["char"]},
                    "context": {"triggerKind": 2},
                },
            )
            rec: dict[str, Any] = {"sent": time.monotonic(), "future": fut}
            fut.add_done_callback(stamp_done(rec))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.records.append(rec)
            prev = (msg_id, fut)
            if self.rng.random() < self.next_edit_rate:  # a next edit asked too, as after an idle pause
                _, nfut = client.send_request(
                    "dlm/nextEdit",
                    {
                        "textDocument": {"uri": d["uri"], "version": d["version"]},
                        "position": {"line": d["line"], "character": d["char"]},
                    },
                )
                nrec: dict[str, Any] = {"sent": time.monotonic(), "future": nfut, "next_edit": True}
                nfut.add_done_callback(stamp_done(nrec))
                nfut.add_done_callback(lambda f: f.cancelled() or f.exception())
                self.records.append(nrec)
            if client.process.returncode is not None or client.gone:
                return

    def report(
        self, status: dict[str, Any], stats: dict[str, Any], typed_s: float, exited: int | None
    ) -> dict[str, Any]:
        lat, fills, cancelled, errors, lost, next_edits_shown = [], 0, 0, 0, 0, 0
        error_kinds: dict[str, int] = {}
        for r in self.records:
            fut = r["future"]
            if not fut.done():
                lost += 1
                continue
            exc = fut.exception()
            if isinstance(exc, ConnectionError):
                lost += 1
                continue
            lat.append((r["done"] - r["sent"]) * 1000)
            if isinstance(exc, LspError):
                if exc.code == CANCELLED:
                    cancelled += 1
                else:
                    errors += 1
                    error_kinds[str(exc)] = error_kinds.get(str(exc), 0) + 1
                continue
            res = fut.result()
            if r.get("next_edit"):
                next_edits_shown += bool(isinstance(res, dict) and res.get("edits"))
                continue
            items = res.get("items", []) if isinstance(res, dict) else (res or [])
            fills += bool(items and items[0].get("insertText"))
        late = sum(1 for x in lat if x > self.late_ms)
        warm = [kb for t, kb in self.rss if t >= self.warmup_s]
        growth = round((warm[-1] - warm[0]) / warm[0] * 100, 1) if len(warm) >= 2 else None
        ewarm = [kb for t, kb in self.engine_rss if t >= self.warmup_s]
        engine = (
            {
                "engine_rss_end_mb": round(ewarm[-1] / 1024, 1),
                "engine_rss_growth_pct": round((ewarm[-1] - ewarm[0]) / ewarm[0] * 100, 1),
            }
            if len(ewarm) >= 2
            else {}
        )
        server_errors = int(stats.get("errors") or 0)
        return {
            "ok": lost == 0 and late == 0 and exited is None,
            "seconds": round(typed_s, 1),
            "cps": self.cps,
            "docs": self.n_docs,
            "cancel_rate": self.cancel_rate,
            "model": status.get("model"),
            "device": status.get("device"),
            "requests": len(self.records),
            "next_edits": sum(1 for r in self.records if r.get("next_edit")),
            "next_edits_shown": next_edits_shown,
            "answered": len(lat),
            "fills": fills,
            "cancelled": cancelled,
            "errors": errors + server_errors,
            "error_kinds": error_kinds,
            "server_errors": server_errors,
            "lost": lost,
            "late": late,
            "late_ms": self.late_ms,
            "exited": exited,
            "p50_ms": _percentile(lat, 0.5),
            "p95_ms": _percentile(lat, 0.95),
            "max_ms": round(max(lat), 1) if lat else None,
            "rss_start_mb": round(self.rss[0][1] / 1024, 1) if self.rss else None,
            "rss_warm_mb": round(warm[0] / 1024, 1) if warm else None,
            "rss_end_mb": round(self.rss[-1][1] / 1024, 1) if self.rss else None,
            "rss_max_mb": round(max(kb for _, kb in self.rss) / 1024, 1) if self.rss else None,
            "rss_growth_pct": growth,
            "warmup_s": self.warmup_s,
            "engine": self.engine,
            **engine,
            "engine_jobs": stats.get("engineJobs"),
            "typed_through": stats.get("typedThrough"),
            "server_exceptions": self.exceptions,
            "rss_kb": self.rss,
            **({"engine_rss_kb": self.engine_rss} if self.engine_rss else {}),
        }


# ----------------------------------------------------------------------------- CLI


def add_soak_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--minutes", type=float, default=None, help="how long to type (default 30)")
    g.add_argument("--seconds", type=float, default=None, help="how long to type, in seconds (short runs)")
    p.add_argument("--cps", type=float, default=20.0, help="keystrokes per second, all documents together (default 20)")
    p.add_argument("--docs", type=int, default=5, help="documents open at once (default 5)")
    p.add_argument(
        "--cancel-rate",
        type=float,
        default=1.0,
        help="share of keystrokes that cancel the previous unanswered request (default 1: VS Code)",
    )
    p.add_argument(
        "--next-edit-rate",
        type=float,
        default=0.1,
        help="share of keystrokes also followed by a dlm/nextEdit request (default 0.1)",
    )
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the report as JSON")
    p.add_argument(
        "--model",
        default=None,
        help="model folder, or scripted:... for the scripted engine (default: the embedded model)",
    )
    p.add_argument("--source", dest="sources", action="append", default=None, help="a file to type (repeatable)")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="RSS growth is counted from here (default 20%% of the run, at most 60 s)",
    )
    p.add_argument(
        "--late-ms", type=float, default=2000.0, help="an answer later than this fails the run (default 2000)"
    )
    p.add_argument(
        "--grace-s", type=float, default=5.0, help="how long unanswered requests may still answer after typing ends"
    )
    p.add_argument("--budget-ms", type=int, default=None, help="server budget per fill (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--engine",
        choices=["inproc", "shared"],
        default="inproc",
        help="the engine in the server process (default: its RSS is the server's) or the shared daemon "
        "(its RSS reported apart)",
    )
    p.add_argument("--server-log", default=None, help="write the server's stderr here")
    p.add_argument("--server-cmd", default=None, help="run this server command instead of dlm-lsp serve")


def run_soak(args: argparse.Namespace) -> int:
    seconds = args.seconds if args.seconds is not None else (args.minutes if args.minutes is not None else 30) * 60
    soak = Soak(
        seconds,
        cps=args.cps,
        docs=args.docs,
        cancel_rate=args.cancel_rate,
        next_edit_rate=args.next_edit_rate,
        model=args.model,
        sources=[Path(s) for s in args.sources] if args.sources else None,
        warmup_s=args.warmup_s,
        late_ms=args.late_ms,
        grace_s=args.grace_s,
        seed=args.seed,
        budget_ms=args.budget_ms,
        log_path=args.server_log,
        server_cmd=shlex.split(args.server_cmd) if args.server_cmd else None,
        engine=args.engine,
    )
    rep = asyncio.run(soak.run())
    for k, v in rep.items():
        if k not in ("rss_kb", "engine_rss_kb"):
            print(f"{k:16} {v}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(rep, indent=1) + "\n")
    return 0 if rep["ok"] else 1
