"""`dlm-lsp loadtest URL --clients N --seconds S`: N clients post fill requests back to back to a
FIM HTTP API on this machine for S seconds and the run is reported: requests, answers by status,
throughput (answered fills per second), latency p50 / p95 / p99, and how the answers spread over
the answering processes (the `dlm.pid` of each answer: replicas behind one proxy differ).

`--hostile` runs the same clients beside hostile ones (ATTACKS: slow bodies, slow heads, idle
connections, a connection flood), one phase each after one without: the well-behaved clients'
answers and p95 under each attack, and how the server ended the attackers' connections.

Bounded by construction: the URL must be loopback (this is a tool for one's own server, not a way
to flood someone else's; the attackers come from other 127.x addresses), at most MAX_CLIENTS
clients, MAX_ATTACKERS slow connections, MAX_IDLE idle ones and MAX_SECONDS seconds in all, one
request in flight per client. The fills are holes cut from a few fixed snippets (deterministic, no
files read).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import statistics
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

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


async def _drive(
    endpoint: str, headers: dict, clients: int, seconds: float, deadline_ms: int, warmup: int
) -> tuple[list[float], Counter, Counter, Counter, float]:
    """`clients` clients, each one request at a time, for `seconds` after `warmup` rounds on a fresh
    connection pool: (latencies of the 200s, statuses, answering pids, errors, wall seconds)."""
    import httpx

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
    return latencies, statuses, pids, errors, wall


def _summary(latencies: list[float], statuses: Counter, errors: Counter, wall: float) -> dict:
    ok = len(latencies)
    return {
        "seconds": round(wall, 2),
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
            "max": _r(max(latencies) if latencies else None),
        },
    }


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
    endpoint = url.rstrip("/") + path
    latencies, statuses, pids, errors, wall = await _drive(
        endpoint, _headers(token), clients, seconds, deadline_ms, warmup
    )
    return {
        "url": endpoint,
        "clients": clients,
        "deadline_ms": deadline_ms,
        **_summary(latencies, statuses, errors, wall),
        "by_process": dict(pids),
    }


def _headers(token: str | None) -> dict:
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    return headers


# ---------------------------------------------------------------------- hostile clients

# The attacks of --hostile (docs/reliability.md), each from loopback addresses of its own, so the
# server's per-address cap meets the attackers and not the well-behaved clients (127.0.0.1):
#   slow-body  `attackers` connections at once, each a complete head with Content-Length: 100, then
#              10 bytes, then nothing (a new one when the server closes it)
#   slow-head  `attackers` connections at once, each a request head one byte every 0.5 s, never ending
#   idle       `idle` connections at once over ten addresses (110 each for 1,100), sending nothing
#   flood      FLOOD_WORKERS connections at once from one address, past its cap, each opened again
#              FLOOD_PAUSE_S after the server answers or closes it
ATTACKS = ("slow-body", "slow-head", "idle", "flood")
MAX_ATTACKERS = 256
MAX_IDLE = 2000
FLOOD_WORKERS = 256
FLOOD_PAUSE_S = 0.25
TRICKLE_S = 0.5  # a slow head's pace, and how often an attacker looks whether the phase is over
REOPEN_S = 0.1  # an attacker's pause before its next connection
RAMP_S = 1.0  # the attack's head start before the well-behaved clients of its phase begin


async def _attacker(
    host: str,
    port: int,
    source: str,
    stop: asyncio.Event,
    seen: Counter,
    opening: bytes = b"",
    trickle: bytes = b"",
    pause_s: float = REOPEN_S,
) -> None:
    """One hostile connection at a time from `source` until `stop`: sends `opening`, then `trickle`
    every TRICKLE_S, and counts how each connection ended: the server's status ("408", "503"...),
    "closed" (no answer), "reset", or "open_at_end" (still held when the phase ended)."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            seen["connect_error"] += 1
            await _pause(stop, pause_s)
            continue
        seen["connections"] += 1
        got, ending = b"", None
        try:
            if opening:
                writer.write(opening)
                await writer.drain()
            while not stop.is_set():
                try:
                    chunk = await asyncio.wait_for(reader.read(4096), TRICKLE_S)
                except TimeoutError:
                    if trickle:
                        writer.write(trickle)
                        await writer.drain()
                    continue
                if not chunk:
                    break
                got += chunk
        except OSError:
            ending = "reset"
        finally:
            writer.close()
        if got.startswith(b"HTTP/"):
            ending = got.split(b" ", 2)[1].decode(errors="replace")
        seen[ending or ("open_at_end" if stop.is_set() else "closed")] += 1
        await _pause(stop, pause_s)


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def _attack(
    name: str, host: str, port: int, path: str, token: str | None, attackers: int, idle: int
) -> tuple[int, Callable[[asyncio.Event, Counter], list[Coroutine[Any, Any, None]]]]:
    """(connections held at once, stop + counter -> the attack's coroutines)."""
    auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
    if name == "slow-body":
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
        opening = head.encode() + auth + b"\r\n" + b'{"prompt":'
        return attackers, lambda stop, seen: [
            _attacker(host, port, "127.0.0.2", stop, seen, opening) for _ in range(attackers)
        ]
    if name == "slow-head":
        opening = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode()
        return attackers, lambda stop, seen: [
            _attacker(host, port, "127.0.0.3", stop, seen, opening, trickle=b"a") for _ in range(attackers)
        ]
    if name == "idle":
        return idle, lambda stop, seen: [
            _attacker(host, port, f"127.0.0.{10 + i % 10}", stop, seen) for i in range(idle)
        ]
    if name == "flood":
        return FLOOD_WORKERS, lambda stop, seen: [
            _attacker(host, port, "127.0.0.4", stop, seen, pause_s=FLOOD_PAUSE_S) for _ in range(FLOOD_WORKERS)
        ]
    raise ValueError(f"unknown attack {name!r}: one of {', '.join(ATTACKS)}")


def ipv4_loopback(url: str) -> tuple[str, int]:
    """(127.x address, port) of a loopback URL; raises ValueError for one that is not IPv4 loopback
    (the attackers come from other 127.x addresses, which IPv6 loopback does not have)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        raise ValueError("--hostile speaks plain http (its attackers write raw request bytes)")
    port = parts.port or 80
    try:
        infos = socket.getaddrinfo(parts.hostname, port, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        infos = []
    for *_, addr in infos:
        if is_loopback(str(addr[0])):
            return str(addr[0]), port
    raise ValueError(f"{parts.hostname} is not an IPv4 loopback address: --hostile attacks from other 127.x addresses")


def _fit_open_files(need: int) -> None:
    """Raises this process's soft open-file limit towards `need` (its attackers hold that many)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard)
            )


async def run_hostile(
    url: str,
    clients: int,
    seconds: float,
    path: str = "/v1/completions",
    deadline_ms: int = 1000,
    token: str | None = None,
    attacks: tuple[str, ...] = ATTACKS,
    attackers: int = 64,
    idle: int = 1100,
) -> dict:
    """One phase with no attack, then one per attack: the attack starts, RAMP_S later `clients`
    well-behaved clients (new connections) run for `seconds` beside it; each phase's report has
    their answers and latency and how the attackers' connections ended."""
    host, port = ipv4_loopback(url)
    endpoint = url.rstrip("/") + path
    headers = _headers(token)
    _fit_open_files(max(attackers, idle, FLOOD_WORKERS) + clients + 256)
    await _drive(endpoint, headers, clients, 0, deadline_ms, warmup=1)  # the first fills' lazy set-up
    phases = []
    for name in ("none", *attacks):
        seen: Counter = Counter()
        stop = asyncio.Event()
        held, make = (0, None) if name == "none" else _attack(name, host, port, path, token, attackers, idle)
        tasks = [asyncio.ensure_future(c) for c in (make(stop, seen) if make else [])]
        if tasks:
            await asyncio.sleep(RAMP_S)
        latencies, statuses, _, errors, wall = await _drive(endpoint, headers, clients, seconds, deadline_ms, warmup=0)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        phases.append(
            {"attack": name, "held_at_once": held, "well_behaved": _summary(latencies, statuses, errors, wall)}
            | ({"attackers": dict(seen)} if tasks else {})
        )
    return {
        "url": endpoint,
        "mode": "hostile",
        "clients": clients,
        "seconds": seconds,
        "deadline_ms": deadline_ms,
        "phases": phases,
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
    p.add_argument(
        "--hostile",
        action="store_true",
        help="a phase with no attack, then one per attack beside the clients; --seconds is each phase's",
    )
    p.add_argument(
        "--attacks", default=",".join(ATTACKS), help=f"with --hostile: which, comma-separated ({', '.join(ATTACKS)})"
    )
    p.add_argument(
        "--attackers", type=int, default=64, help=f"slow-body / slow-head connections at once (<= {MAX_ATTACKERS})"
    )
    p.add_argument("--idle", type=int, default=1100, help=f"idle connections at once (<= {MAX_IDLE})")


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
    if args.hostile:
        return _run_hostile(args, token)
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


def _run_hostile(args: argparse.Namespace, token: str | None) -> int:
    attacks = tuple(a.strip() for a in args.attacks.split(",") if a.strip())
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown or not 1 <= args.attackers <= MAX_ATTACKERS or not 1 <= args.idle <= MAX_IDLE:
        print(
            f"dlm-lsp loadtest: --attacks from {', '.join(ATTACKS)}; --attackers 1..{MAX_ATTACKERS}, --idle 1..{MAX_IDLE}",
            file=sys.stderr,
        )
        return 2
    if (len(attacks) + 1) * (args.seconds + RAMP_S) > MAX_SECONDS:
        print(
            f"dlm-lsp loadtest: --hostile runs {len(attacks) + 1} phases: at most {MAX_SECONDS} s in all",
            file=sys.stderr,
        )
        return 2
    try:
        report = asyncio.run(
            run_hostile(
                args.url,
                args.clients,
                args.seconds,
                args.path,
                args.deadline_ms,
                token,
                attacks,
                args.attackers,
                args.idle,
            )
        )
    except ValueError as e:
        print(f"dlm-lsp loadtest: {e}", file=sys.stderr)
        return 2
    print(f"{report['url']}: {report['clients']} well-behaved clients, {report['seconds']} s a phase")
    for ph in report["phases"]:
        wb, lat = ph["well_behaved"], ph["well_behaved"]["latency_ms"]
        held = f" ({ph['held_at_once']} connections at once)" if ph["held_at_once"] else ""
        print(
            f"  {ph['attack']:<9}{held}: well-behaved {wb['ok']}/{wb['requests']} ok {wb['statuses']}, "
            f"p50 {lat['p50']} ms, p95 {lat['p95']} ms, max {lat['max']} ms"
            + (f"; attackers' connections {ph['attackers']}" if "attackers" in ph else "")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(ph["well_behaved"]["ok"] for ph in report["phases"]) else 1
