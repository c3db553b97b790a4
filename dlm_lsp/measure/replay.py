"""`dlm-lsp replay PATH`: type a file into the real server, like an editor, and measure.

The server runs as a subprocess over stdio. An empty document is opened and the file's text is
typed (with --at N the document opens as the whole file less the --max-chars characters from offset N,
and those are typed back at N: editing inside an existing file, with its text before and after the
cursor in the context) at --cps characters per second, one incremental didChange per character, each followed by an
inlineCompletion request at the new cursor (no $/cancelRequest, like Neovim 0.12; --cancel sends
one for the previous request first, like VS Code). Reported (and written with --json):
  requests, answered (non-empty fills), empty, cancelled (server-side: superseded, client-cancelled
  or stale), typed_through (served from the fill shown, no engine call), typed_along (fills that
  finished after the user typed along them and were kept for typing-through), p50_ms/p95_ms/max_ms of
  answered requests, wasted_step_share (engine steps of jobs later cancelled / all engine steps,
  from the server's `dlm/stats` request), next_text_match (share of fills shown - answered before
  the next keystroke - that the file's next characters start with), and the engine's work per
  keystroke from the rows it reports per job (`engineJobRows` of dlm/stats; one job per keystroke
  that reached the engine, typed-through ones run none): forwarded_tokens_mean/p95 (rows run through
  the model over the whole fill, context included), recompute_tokens_mean/p95 (what a full recompute
  would have run: forwarded + reused context rows), forwarded_ratio (all forwarded / all recompute)
  and reuse_share (jobs that reused any context rows / engine_jobs_run, the jobs that ran a step);
  null when the engine reports no rows.
`LspClient` is a minimal JSON-RPC client over a subprocess's stdio, also used by the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from dlm_lsp.fill.documents import language_id_for_path
from dlm_lsp.fill.positions import units_len


class LspError(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('code')}: {error.get('message')}")
        self.code = error.get("code")
        self.error = error


class LspClient:
    """JSON-RPC over a child process's stdin/stdout. Server->client requests are answered with
    null (or `config` for workspace/configuration); notifications are kept in `notifications`."""

    def __init__(
        self,
        cmd: list[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stderr: IO[Any] | int | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.cmd, self.env, self.cwd, self.stderr = cmd, env, cwd, stderr
        self.config = config
        self.proc: asyncio.subprocess.Process | None = None
        self._ids = itertools.count(1)
        self.pending: dict[Any, asyncio.Future[Any]] = {}
        self.notifications: list[tuple[float, str, object]] = []
        self.server_requests: list[tuple[str, object]] = []
        self._note_event = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._corked: list[bytes] | None = None  # messages held by `corked` for one write

    @property
    def process(self) -> asyncio.subprocess.Process:
        """The server process (`start` has run)."""
        if self.proc is None:
            raise RuntimeError("the server is not started (LspClient.start)")
        return self.proc

    @property
    def _stdin(self) -> asyncio.StreamWriter:
        """The server's stdin (a pipe: `start` opens one)."""
        stdin = self.process.stdin
        if stdin is None:
            raise RuntimeError("the server has no stdin pipe")
        return stdin

    @property
    def _stdout(self) -> asyncio.StreamReader:
        """The server's stdout (a pipe: `start` opens one)."""
        stdout = self.process.stdout
        if stdout is None:
            raise RuntimeError("the server has no stdout pipe")
        return stdout

    async def start(self) -> LspClient:
        self.proc = await asyncio.create_subprocess_exec(
            *self.cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self.stderr if self.stderr is not None else asyncio.subprocess.DEVNULL,
            env=self.env,
            cwd=self.cwd,
            limit=2**24,
        )
        self._reader = asyncio.create_task(self._read_loop())
        return self

    def _write(self, msg: dict[str, Any]) -> None:
        body = json.dumps(msg).encode("utf-8")
        frame = b"Content-Length: %d\r\n\r\n" % len(body) + body
        if self._corked is not None:
            self._corked.append(frame)
        else:
            self._stdin.write(frame)

    @contextlib.contextmanager
    def corked(self) -> Iterator[None]:
        """Holds the messages sent inside the block and writes them in one write at its end: a burst
        the server reads at once, as from an editor faster than the server (a pipe write under
        PIPE_BUF bytes arrives whole)."""
        self._corked = []
        try:
            yield
        finally:
            frames, self._corked = self._corked, None
            self._stdin.write(b"".join(frames))

    def write_raw(self, body: bytes) -> None:
        """Sends a body as is (for malformed-message tests)."""
        self._stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def send_request(self, method: str, params: Any) -> tuple[int, asyncio.Future[Any]]:
        msg_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[msg_id] = fut
        self._write({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        return msg_id, fut

    async def request(self, method: str, params: Any = None, timeout: float = 60.0) -> Any:
        _, fut = self.send_request(method, params)
        return await asyncio.wait_for(fut, timeout)

    def notify(self, method: str, params: Any = None) -> None:
        self._write({"jsonrpc": "2.0", "method": method, "params": params})

    def cancel(self, msg_id: int) -> None:
        self.notify("$/cancelRequest", {"id": msg_id})

    async def _read_loop(self) -> None:
        out = self._stdout
        try:
            while True:
                length: int | None = None
                while True:
                    line = await out.readline()
                    if not line:
                        return
                    line = line.strip()
                    if not line:
                        break
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length is None:  # a header block without Content-Length (readexactly(None) raised this)
                    raise TypeError("a header block without Content-Length")
                body = await out.readexactly(length)
                self._dispatch(json.loads(body))
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return
        finally:
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("server exited"))

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "method" in msg and "id" in msg:  # a request from the server
            self.server_requests.append((msg["method"], msg.get("params")))
            result = None
            if msg["method"] == "workspace/configuration":
                items = (msg.get("params") or {}).get("items") or []
                result = [self.config.get(i.get("section"), None) if self.config else None for i in items]
            self._write({"jsonrpc": "2.0", "id": msg["id"], "result": result})
        elif "method" in msg:
            self.notifications.append((time.monotonic(), msg["method"], msg.get("params")))
            self._note_event.set()
        else:
            fut = self.pending.pop(msg.get("id"), None)
            if fut is not None and not fut.done():
                if "error" in msg and msg["error"] is not None:
                    fut.set_exception(LspError(msg["error"]))
                else:
                    fut.set_result(msg.get("result"))

    async def wait_notification(
        self, method: str, pred: Callable[[Any], bool] = lambda p: True, timeout: float = 60.0, since: int = 0
    ) -> Any:
        """Returns the params of the first `method` notification (from index `since`) matching pred."""
        end = time.monotonic() + timeout
        while True:
            for _, m, p in self.notifications[since:]:
                if m == method and pred(p):
                    return p
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {method} notification matching within {timeout}s")
            self._note_event.clear()
            try:
                await asyncio.wait_for(self._note_event.wait(), left)
            except TimeoutError:
                pass

    async def initialize(
        self, options: dict[str, Any] | None = None, capabilities: dict[str, Any] | None = None, root: str | None = None
    ) -> Any:
        caps = (
            capabilities
            if capabilities is not None
            else {
                "general": {"positionEncodings": ["utf-16"]},
                "textDocument": {"inlineCompletion": {}, "synchronization": {"dynamicRegistration": False}},
            }
        )
        result = await self.request(
            "initialize",
            {
                "processId": os.getpid(),
                "rootUri": Path(root).resolve().as_uri() if root else None,
                "capabilities": caps,
                "initializationOptions": options,
            },
        )
        self.notify("initialized", {})
        return result

    async def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        """Waits for dlm/status with state ready (or error, which raises)."""
        st = await self.wait_notification("dlm/status", lambda p: p.get("state") in ("ready", "error"), timeout)
        if st["state"] == "error":
            raise RuntimeError(f"engine failed: {st.get('message')}")
        return st

    async def stop(self, timeout: float = 10.0) -> int | None:
        try:
            if self.process.returncode is None:
                await self.request("shutdown", None, timeout=timeout)
                self.notify("exit")
                await asyncio.wait_for(self.process.wait(), timeout)
        except (TimeoutError, Exception):  # noqa: BLE001
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()
        if self._reader is not None:
            self._reader.cancel()
        return self.process.returncode


def server_command(model: str | None = None) -> list[str]:
    """The command that starts this checkout's server."""
    return [sys.executable, "-m", "dlm_lsp", "serve"]


# ----------------------------------------------------------------------------- replay


def stamp_done(rec: dict[str, Any]) -> Callable[[asyncio.Future[Any]], None]:
    """A done-callback that records in `rec["done"]` when the future finished (monotonic time)."""

    def stamp(fut: asyncio.Future[Any]) -> None:
        rec.update(done=time.monotonic())

    return stamp


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q * (len(s) - 1)))))
    return round(s[k], 1)


def forwarded_summary(job_rows: list[Any] | None) -> dict[str, Any]:
    """Tokens forwarded per engine job, with reuse and as a full recompute, from dlm/stats'
    `engineJobRows` ([forwarded, reused] per job that ran); None values when no job reported rows."""
    rows = [(int(f), int(u)) for f, u in job_rows or []]
    forwarded = [f for f, _ in rows]
    recompute = [f + u for f, u in rows]
    if not sum(recompute):  # no job ran, or an engine that does not count rows (an HTTP endpoint)
        return {
            "engine_jobs_run": len(rows),
            **{
                k: None
                for k in (
                    "forwarded_tokens_mean",
                    "forwarded_tokens_p95",
                    "recompute_tokens_mean",
                    "recompute_tokens_p95",
                    "forwarded_ratio",
                    "reuse_share",
                )
            },
        }
    return {
        "engine_jobs_run": len(rows),
        "forwarded_tokens_mean": round(statistics.fmean(forwarded), 1),
        "forwarded_tokens_p95": _percentile(forwarded, 0.95),
        "recompute_tokens_mean": round(statistics.fmean(recompute), 1),
        "recompute_tokens_p95": _percentile(recompute, 0.95),
        "forwarded_ratio": round(sum(forwarded) / sum(recompute), 4),
        "reuse_share": round(sum(u > 0 for _, u in rows) / len(rows), 4),
    }


async def replay(
    path: str,
    cps: float = 10.0,
    max_chars: int = 400,
    cancel: bool = False,
    model: str | None = None,
    budget_ms: int | None = None,
    device: str | None = None,
    server_cmd: list[str] | None = None,
    log_path: str | None = None,
    ready_timeout: float = 180.0,
    at: int | None = None,
    lockstep: bool = False,
) -> dict[str, Any]:
    """Types `path` into a fresh server and returns the measurements (see module docstring)."""
    full = Path(path).read_text(encoding="utf-8")
    start = 0 if at is None else at
    if not 0 <= start <= len(full):
        raise ValueError(f"--at {start} is outside {path} ({len(full)} characters)")
    text = full[start : start + max_chars]
    opened = "" if at is None else full[:start] + full[start + len(text) :]
    lang = language_id_for_path(path)
    opts: dict[str, Any] = {}
    if model:
        opts["model"] = model
    if budget_ms:
        opts["budgetMs"] = budget_ms
    if device:
        opts["device"] = device
    stderr = open(log_path, "wb") if log_path else None
    client = LspClient(server_cmd or server_command(), stderr=stderr)
    await client.start()
    try:
        await client.initialize(opts)
        status = await client.wait_ready(ready_timeout)
        uri = Path(path).resolve().as_uri() + ".replay"
        client.notify(
            "textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": lang, "version": 1, "text": opened}}
        )
        before = full[:start].split("\n")
        line, char = len(before) - 1, units_len(before[-1])  # cursor in UTF-16 units
        records: list[dict[str, Any]] = []
        pending_prev: tuple[int, asyncio.Future[Any]] | None = None
        loop = asyncio.get_running_loop()
        t_start = loop.time()
        typed_at: list[float] = []  # loop-time of each keystroke, as sent
        for i, ch in enumerate(text):
            if lockstep and pending_prev is not None:
                await asyncio.wait([pending_prev[1]], timeout=ready_timeout)
                t_start = max(t_start, loop.time() - i / cps)  # the pace resumes from the answer
            await asyncio.sleep(max(0.0, t_start + i / cps - loop.time()))
            typed_at.append(loop.time())
            if cancel and pending_prev is not None and not pending_prev[1].done():
                client.cancel(pending_prev[0])
            version = i + 2
            client.notify(
                "textDocument/didChange",
                {
                    "textDocument": {"uri": uri, "version": version},
                    "contentChanges": [
                        {
                            "range": {
                                "start": {"line": line, "character": char},
                                "end": {"line": line, "character": char},
                            },
                            "text": ch,
                        }
                    ],
                },
            )
            if ch == "\n":
                line, char = line + 1, 0
            else:
                char += units_len(ch)
            rec: dict[str, Any] = {"i": i + 1, "sent": time.monotonic(), "version": version}
            msg_id, fut = client.send_request(
                "textDocument/inlineCompletion",
                {
                    "textDocument": {"uri": uri},
                    "position": {"line": line, "character": char},
                    "context": {"triggerKind": 2},
                },
            )
            fut.add_done_callback(stamp_done(rec))
            rec["future"] = fut
            records.append(rec)
            pending_prev = (msg_id, fut)
        await asyncio.wait([r["future"] for r in records], timeout=30)
        stats = await client.request("dlm/stats", {}, timeout=10)
    finally:
        await client.stop()
        if stderr:
            stderr.close()

    answered_lat, all_lat, shown, matched, prefix_share, shown_fills = [], [], 0, 0, [], []
    errors = 0
    for r in records:
        fut = r["future"]
        if not fut.done() or fut.cancelled():
            continue
        all_lat.append((r["done"] - r["sent"]) * 1000)
        exc = fut.exception()
        if exc is not None:
            # RequestCancelled answers --cancel's own $/cancelRequest (the server counts it as cancelled)
            errors += 0 if isinstance(exc, LspError) and exc.code == -32800 else 1
            continue
        res = fut.result() or {}
        items = res.get("items", []) if isinstance(res, dict) else res
        if not items or not items[0].get("insertText"):
            continue
        fill = items[0]["insertText"]
        lat = (r["done"] - r["sent"]) * 1000
        answered_lat.append(lat)
        # shown = arrived before the next keystroke (the editor discards later ones)
        nxt = r["i"]
        arrival = r["done"] - r["sent"]
        gap = (typed_at[nxt] - typed_at[nxt - 1]) if nxt < len(typed_at) else float("inf")
        if arrival <= gap:
            shown += 1
            shown_fills.append({"i": r["i"], "fill": fill})
            truth = text[r["i"] : r["i"] + len(fill)]
            if len(truth) == len(fill) and truth == fill:
                matched += 1
            common = 0
            for a, b in zip(fill, truth):
                if a != b:
                    break
                common += 1
            prefix_share.append(common / len(fill))
    result = {
        "path": str(path),
        "at": at,
        "chars": len(text),
        "cps": cps,
        "cancel": cancel,
        "lockstep": lockstep,
        "model": status.get("model"),
        "device": status.get("device"),
        "budget_ms": budget_ms or 300,
        "requests": len(records),
        "answered": len(answered_lat),
        "empty": stats.get("empty"),
        "cancelled": (stats.get("cancelled") or 0) + (stats.get("stale") or 0),
        "stale": stats.get("stale"),
        "typed_through": stats.get("typedThrough"),
        "typed_along": stats.get("typedAlong"),
        "errors": errors + (stats.get("errors") or 0),
        "p50_ms": _percentile(answered_lat, 0.5),
        "p95_ms": _percentile(answered_lat, 0.95),
        "max_ms": round(max(answered_lat), 1) if answered_lat else None,
        "mean_ms": round(statistics.fmean(answered_lat), 1) if answered_lat else None,
        # every answer, empty and superseded ones included: how fast the server responds at all
        "response_p50_ms": _percentile(all_lat, 0.5),
        "response_p95_ms": _percentile(all_lat, 0.95),
        "engine_jobs": stats.get("engineJobs"),
        "engine_steps": stats.get("engineSteps"),
        "wasted_steps": stats.get("wastedSteps"),
        "wasted_step_share": round(stats.get("wastedStepShare") or 0.0, 4),
        "shown": shown,
        "next_text_match": round(matched / shown, 4) if shown else 0.0,
        "next_text_prefix_share": round(statistics.fmean(prefix_share), 4) if prefix_share else 0.0,
        **forwarded_summary(stats.get("engineJobRows")),
        "latencies_ms": [round(x, 1) for x in answered_lat],
        "response_latencies_ms": [round(x, 1) for x in all_lat],
        "shown_fills": shown_fills,  # (keystroke, text) of each fill shown: in --json only
    }
    return result


def write_histogram(
    latencies: list[float], out: str, title: str, budget_ms: float | None = None, responses: list[float] | None = None
) -> None:
    """Latency histogram PNG (matplotlib, Agg backend): answered fills, and every response behind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    values = list(latencies) + list(responses or [])
    bins: list[float] | None = None
    if values:
        import numpy as np

        bins = np.linspace(0, max(values) * 1.02 + 1, 41).tolist()
    if responses:
        ax.hist(responses, bins=bins, color="#c8c8c8", edgecolor="white", label=f"all responses ({len(responses)})")
    if latencies:
        ax.hist(
            latencies, bins=bins, color="#3b7dd8", edgecolor="white", label=f"fills shown/answered ({len(latencies)})"
        )
    if budget_ms:
        ax.axvline(budget_ms, color="#d83b3b", linestyle="--", label=f"budget {budget_ms:.0f} ms")
    if values or budget_ms:
        ax.legend()
    ax.set_xlabel("request-to-answer latency (ms)")
    ax.set_ylabel("requests")
    ax.set_title(title)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def add_replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="source file to type")
    p.add_argument("--cps", type=float, default=10.0, help="characters per second (default 10)")
    p.add_argument("--max-chars", type=int, default=400, help="type at most this many characters (default 400)")
    p.add_argument(
        "--at",
        type=int,
        default=None,
        metavar="N",
        help="open the whole file less the typed span and type it back at character offset N "
        "(default: type from an empty document)",
    )
    p.add_argument("--cancel", action="store_true", help="send $/cancelRequest for the previous request (like VS Code)")
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="type each character only once the previous request is answered (the server's counts, not the clock's)",
    )
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the report as JSON")
    p.add_argument("--png", default=None, metavar="OUT", help="write a latency histogram PNG")
    p.add_argument("--model", default=None, help="model folder or HF cache id (default: the embedded model)")
    p.add_argument("--device", default=None, help="auto, cpu or cuda")
    p.add_argument("--budget-ms", type=int, default=None, help="server budget per fill (default 300)")
    p.add_argument("--server-log", default=None, help="write the server's stderr here")


def run_replay(args: argparse.Namespace) -> int:
    try:
        res = asyncio.run(
            replay(
                args.path,
                cps=args.cps,
                max_chars=args.max_chars,
                cancel=args.cancel,
                model=args.model,
                budget_ms=args.budget_ms,
                device=args.device,
                log_path=args.server_log,
                at=args.at,
                lockstep=args.lockstep,
            )
        )
    except ValueError as e:
        print(f"replay: {e}", file=sys.stderr)
        return 2
    lat, rlat, fills = res.pop("latencies_ms"), res.pop("response_latencies_ms"), res.pop("shown_fills")
    for k, v in res.items():
        print(f"{k:24} {v}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(
            json.dumps({**res, "latencies_ms": lat, "response_latencies_ms": rlat, "shown_fills": fills}, indent=2)
            + "\n"
        )
    if args.png:
        write_histogram(
            lat,
            args.png,
            f"replay {Path(args.path).name} at {args.cps:g} cps, model {res['model']}",
            res["budget_ms"],
            rlat,
        )
    return 0
