"""`dlm-lsp loadtest URL --clients N --seconds S`: N clients post fill requests back to back to a
FIM HTTP API on this machine for S seconds and the run is reported: requests, answers by status,
throughput (answered fills per second), latency p50 / p95 / p99, and how the answers spread over
the answering processes (the `dlm.pid` of each answer: replicas behind one proxy differ).

Bounded by construction: the URL must be loopback (this is a tool for one's own server, not a way
to flood someone else's), at most MAX_CLIENTS clients and MAX_SECONDS seconds, one request in
flight per client. The fills are holes cut from a few fixed snippets (deterministic, no files read).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
import urllib.parse
from collections import Counter

from dlm_lsp.http.app import DEFAULT_TOKEN_ENV, is_loopback

MAX_CLIENTS = 64
MAX_SECONDS = 600

SNIPPETS = [
    ("def add(a, b):\n    return ", "\n\n\nprint(add(1, 2))\n"),
    (
        "import os\n\n\ndef list_files(path):\n    out = []\n    for name in os.listdir(path):\n        ",
        "\n    return out\n",
    ),
    ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.", "\n"),
    ("for i in range(10):\n    ", "\n"),
    ("def area(r):\n    import math\n    return math.pi * ", "\n"),
    ("items = [1, 2, 3]\ntotal = sum(", ")\nprint(total)\n"),
]


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def run(
    url: str,
    clients: int,
    seconds: float,
    path: str = "/v1/completions",
    deadline_ms: int = 1000,
    token: str | None = None,
    warmup: int = 1,
) -> dict:
    """The load test's report (a dict; `dlm-lsp loadtest` prints it and writes it as JSON)."""
    import httpx

    endpoint = url.rstrip("/") + path
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    latencies: list[float] = []
    statuses: Counter = Counter()
    pids: Counter = Counter()
    errors: Counter = Counter()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=deadline_ms / 1000 + 30, trust_env=False) as client:

        async def one(i: int) -> tuple[int, float, dict | None]:
            prompt, suffix = SNIPPETS[i % len(SNIPPETS)]
            body = {"prompt": prompt, "suffix": suffix, "deadline_ms": deadline_ms}
            t0 = time.perf_counter()
            r = await client.post(endpoint, content=json.dumps(body), headers=headers)
            ms = (time.perf_counter() - t0) * 1000
            try:
                data = r.json()
            except ValueError:
                data = None
            return r.status_code, ms, data

        for i in range(warmup):  # each replica's first fill pays for lazy set-up: keep it out of the figures
            await asyncio.gather(*(one(i * clients + c) for c in range(clients)), return_exceptions=True)
        end = time.monotonic() + seconds
        started = time.monotonic()

        async def worker(c: int) -> None:
            i = c
            while time.monotonic() < end:
                try:
                    status, ms, data = await one(i)
                except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
                    errors[type(e).__name__] += 1
                    statuses["error"] += 1
                    i += clients
                    continue
                statuses[str(status)] += 1
                if status == 200:
                    latencies.append(ms)
                    pid = (data or {}).get("dlm", {}).get("pid")
                    if pid is not None:
                        pids[str(pid)] += 1
                i += clients

        await asyncio.gather(*(worker(c) for c in range(clients)))
        wall = time.monotonic() - started
    ok = len(latencies)
    return {
        "url": endpoint,
        "clients": clients,
        "seconds": round(wall, 2),
        "deadline_ms": deadline_ms,
        "requests": sum(statuses.values()),
        "ok": ok,
        "statuses": dict(statuses),
        "errors": dict(errors),
        "throughput_rps": round(ok / wall, 3) if wall > 0 else 0.0,
        "latency_ms": {
            "p50": _r(percentile(latencies, 50)),
            "p95": _r(percentile(latencies, 95)),
            "p99": _r(percentile(latencies, 99)),
            "mean": _r(statistics.fmean(latencies) if latencies else None),
        },
        "by_process": dict(pids),
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def check_url(url: str) -> str | None:
    """Why `url` may not be load-tested (None: it may)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http(s) URL"
    if not is_loopback(parts.hostname):
        return f"{parts.hostname} is not this machine: loadtest only loads servers on loopback"
    return None


def add_loadtest_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the API's base, e.g. http://127.0.0.1:8765 (loopback only)")
    p.add_argument(
        "--clients", type=int, default=8, help=f"concurrent clients, each one request at a time (<= {MAX_CLIENTS})"
    )
    p.add_argument("--seconds", type=float, default=20, help=f"how long (<= {MAX_SECONDS})")
    p.add_argument("--path", default="/v1/completions", help="/v1/completions or /v1/fim/completions")
    p.add_argument("--deadline-ms", type=int, default=1000, help="each request's deadline_ms")
    p.add_argument("--token-env", default=DEFAULT_TOKEN_ENV, help="environment variable with the bearer token, if any")
    p.add_argument("--json", default=None, help="also write the report here")


def run_loadtest(args: argparse.Namespace) -> int:
    why = check_url(args.url)
    if why:
        print(f"dlm-lsp loadtest: {why}", file=sys.stderr)
        return 2
    if not 1 <= args.clients <= MAX_CLIENTS or not 0 < args.seconds <= MAX_SECONDS:
        print(f"dlm-lsp loadtest: --clients 1..{MAX_CLIENTS}, --seconds up to {MAX_SECONDS}", file=sys.stderr)
        return 2
    token = os.environ.get(args.token_env or "", "").strip() or None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    report = asyncio.run(run(args.url, args.clients, args.seconds, args.path, args.deadline_ms, token))
    lat = report["latency_ms"]
    print(
        f"{report['url']}: {report['clients']} clients, {report['seconds']} s: {report['ok']}/{report['requests']} ok "
        f"{report['statuses']}, {report['throughput_rps']} fills/s, p50 {lat['p50']} ms, p95 {lat['p95']} ms, "
        f"p99 {lat['p99']} ms; by process {report['by_process']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1
