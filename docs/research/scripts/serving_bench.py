# Research probe, kept as it ran at commit 5ce2b37; not maintained: it may not run against today's layout.
"""The serving figures of docs/serving.md, into one JSON file:

1. HTTP overhead: the same fill (same prompt + suffix, deterministic, no deadline hit) N times,
   alternately (a) in this process: FimPipeline.prepare -> EngineService -> FimPipeline.complete
   (what the API does, without HTTP; the engine alone too) and (b) through `dlm-lsp http` on
   127.0.0.1 with one keep-alive client. Reported: p50 / p95 of each, the p50 difference, the
   median paired difference, and the client's time less the server's own total.
2. `dlm-lsp loadtest` with --clients C for --seconds S against `dlm-lsp ray-serve` with 1 and with 2
   replicas (one core each).

Usage: .venv/bin/python docs/research/scripts/serving_bench.py --json docs/measurements/serving.json
       [--model M] [--n 60] [--clients 8] [--seconds 20] [--only overhead|ray]
Run with nothing else of yours on the CPU; say in the notes what else shared it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from dlm_lsp.measure import loadtest  # noqa: E402
from dlm_lsp.http.fim import FimPipeline, Limits, parse_body  # noqa: E402

PROMPT = ("import os\n\n\ndef list_files(path):\n    \"\"\"The names of the regular files in path.\"\"\"\n"
          "    out = []\n    for name in os.listdir(path):\n        if os.path.isfile(os.path.join(path, name)):\n"
          "            out.")
SUFFIX = "\n    return out\n\n\nprint(list_files('.'))\n"
BODY = {"prompt": PROMPT, "suffix": SUFFIX, "deadline_ms": 60000}


def pct(xs, q):
    return round(loadtest.percentile(xs, q), 2)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Proc:
    def __init__(self, cmd, ready_timeout=400):
        self.log = tempfile.TemporaryFile()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=REPO,
                                  start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = self.p.stdout.readline()
        if not line:
            self.log.seek(0)
            raise SystemExit(f"{cmd} did not start: {self.log.read()[-2000:].decode(errors='replace')}")
        self.url = json.loads(line)["listening"]

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(10)


def wait_health(url, timeout=400):
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} never became ready")


def overhead(model, n: int) -> dict:
    """The same fill in this process and through `dlm-lsp http`, alternately (pairs see the same
    machine load: it is shared with training jobs), after 3 warm-up pairs."""
    import httpx

    from engine.serve.service import EngineService

    cmd = [sys.executable, "-m", "dlm_lsp", "http", "--port", str(free_port()), "--device", "cpu", "--threads", "1"]
    if model:
        cmd += ["--model", model]
    srv = Proc(cmd)
    eng = EngineService(model=model, device="cpu", threads=1).start()
    try:
        wait_health(srv.url)
        assert eng.wait_ready(300), eng.message
        pipe = FimPipeline(64)
        raw = json.dumps(BODY).encode()
        local, engine_only, remote, server_total, pairs, steps = [], [], [], [], [], set()
        with httpx.Client(timeout=120, trust_env=False) as c:
            for i in range(n + 3):
                t0 = time.perf_counter()
                prep = pipe.prepare(parse_body(raw, "openai", Limits()))
                t1 = time.perf_counter()
                fill = eng.submit(prep.job).result(120)
                t2 = time.perf_counter()
                pipe.complete(prep, fill, eng.serving.get("min_confidence") or 0.0)
                t3 = time.perf_counter()
                r = c.post(srv.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
                t4 = time.perf_counter()
                assert r.status_code == 200, r.text
                if i < 3:
                    continue
                local.append((t3 - t0) * 1000)
                engine_only.append((t2 - t1) * 1000)
                remote.append((t4 - t3) * 1000)
                server_total.append(r.json()["dlm"]["total_ms"])
                pairs.append((t4 - t3) * 1000 - (t3 - t0) * 1000)
                steps.update({fill.steps, r.json()["dlm"]["steps"]})
    finally:
        eng.close()
        srv.stop()
    client_minus_server = [a - b for a, b in zip(remote, server_total)]
    return {"n": n, "steps": sorted(steps),
            "in_process_pipeline_ms": {"p50": pct(local, 50), "p95": pct(local, 95)},
            "in_process_engine_ms": {"p50": pct(engine_only, 50), "p95": pct(engine_only, 95)},
            "http_client_ms": {"p50": pct(remote, 50), "p95": pct(remote, 95)},
            "http_server_total_ms": {"p50": pct(server_total, 50), "p95": pct(server_total, 95)},
            "p50_difference_ms": round(pct(remote, 50) - pct(local, 50), 2),
            "median_paired_difference_ms": pct(pairs, 50),
            "median_client_minus_server_total_ms": pct(client_minus_server, 50)}


def ray_load(model, replicas: int, clients: int, seconds: float) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "dlm_lsp", "ray-serve", "--replicas", str(replicas), "--port", str(port),
           "--device", "cpu"]
    if model:
        cmd += ["--model", model]
    t0 = time.monotonic()
    srv = Proc(cmd)
    started = time.monotonic() - t0
    try:
        report = asyncio.run(loadtest.run(srv.url, clients, seconds, deadline_ms=1000))
    finally:
        srv.stop()
    report["cluster_start_s"] = round(started, 1)
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--only", choices=["overhead", "ray"], default=None,
                    help="measure one part and merge it into --json (the other part is kept)")
    args = ap.parse_args()
    prior = json.loads(Path(args.json).read_text()) if args.only and Path(args.json).exists() else {}
    out = {**prior, "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
                       "load_before": os.getloadavg()},
           "model": args.model or "default", "request": {"prompt_chars": len(PROMPT), "suffix_chars": len(SUFFIX)}}
    if args.only in (None, "overhead"):
        print("HTTP overhead ...", file=sys.stderr)
        load = os.getloadavg()
        out["overhead"] = overhead(args.model, args.n)
        out["overhead"]["load_avg_before_after"] = [load, os.getloadavg()]
        print(json.dumps(out["overhead"]), file=sys.stderr)
    if args.only in (None, "ray"):
        out["loadtest"] = {}
        for replicas in (1, 2):
            print(f"ray-serve with {replicas} replica(s) ...", file=sys.stderr)
            load = os.getloadavg()
            out["loadtest"][str(replicas)] = ray_load(args.model, replicas, args.clients, args.seconds)
            out["loadtest"][str(replicas)]["load_avg_before_after"] = [load, os.getloadavg()]
            r = out["loadtest"][str(replicas)]
            print(f"  {r['throughput_rps']} fills/s, p50 {r['latency_ms']['p50']} ms, p95 {r['latency_ms']['p95']} ms, "
                  f"{r['statuses']}", file=sys.stderr)
        one, two = out["loadtest"]["1"], out["loadtest"]["2"]
        out["loadtest"]["throughput_ratio_2_vs_1"] = round(two["throughput_rps"] / one["throughput_rps"], 3) \
            if one["throughput_rps"] else None
    out["machine"]["load_after"] = os.getloadavg()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
