"""`dlm-lsp ray-serve` on a local Ray cluster of this machine: two engine replicas of a tiny
checkpoint behind Serve's HTTP proxy speak the same API as `dlm-lsp http`; requests spread over
both; a replica killed mid-load is replaced and every request is still answered (a fill, or an
error status from the proxy: never a hang or a dropped connection); the language server's remote
engine works against it. One cluster for the whole module (its start is most of the cost)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

pytest.importorskip("ray.serve")

from dlm_lsp.measure import loadtest  # noqa: E402
from engine.api import FillJob  # noqa: E402
from engine.clients.http_engine import HttpEngine  # noqa: E402
from tests.http_helpers import REPO  # noqa: E402
from tests.tiny import make_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(480)]
# each load-test request's deadline: what the tests assert is that requests are answered, spread and
# survive a replica's death, not how fast; a slow, busy machine answered 7 of 11 requests past a 2 s
# deadline while one replica carried the load (the make test-slow run of session 33)
DEADLINE_MS = 10_000
START_TIMEOUT = 300


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("ray") / "tiny", printable=True)
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dlm_lsp",
            "ray-serve",
            "--model",
            str(model),
            "--replicas",
            "2",
            "--port",
            str(port),
            "--device",
            "cpu",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=REPO,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        line = proc.stdout.readline()  # printed once the application is ready
        if not line:
            log.seek(0)
            raise AssertionError(f"dlm-lsp ray-serve did not start: {log.read()[-3000:].decode(errors='replace')}")
        info = json.loads(line)
        assert info["replicas"] == 2 and info["listening"] == f"http://127.0.0.1:{port}"
        yield info["listening"]
    finally:
        proc.send_signal(signal.SIGTERM)  # serve.shutdown + ray.shutdown: the cluster's processes end
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the processes it started, by group id
            proc.wait(10)
        log.close()


def test_the_same_api_and_requests_spread_over_both_replicas(cluster):
    h = httpx.get(cluster + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ready"
    assert httpx.get(cluster + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
    r = httpx.post(
        cluster + "/v1/fim/completions",
        json={"prompt": "def f(x):\n    return ", "suffix": "\n", "postprocess": False},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] and r.json()["dlm"]["steps"] >= 1
    report = asyncio.run(loadtest.run(cluster, clients=4, seconds=4, deadline_ms=DEADLINE_MS))
    assert report["ok"] >= 8 and report["statuses"] == {"200": report["ok"]}, report
    assert len(report["by_process"]) == 2, report  # both replicas answered
    assert report["latency_ms"]["p50"] is not None and report["throughput_rps"] > 0


def test_a_killed_replica_is_replaced_and_no_request_is_lost(cluster):
    before = asyncio.run(loadtest.run(cluster, clients=4, seconds=2, deadline_ms=DEADLINE_MS))["by_process"]
    assert len(before) == 2, before
    victim = int(sorted(before)[0])

    async def load_and_kill():
        task = asyncio.ensure_future(loadtest.run(cluster, clients=4, seconds=6, deadline_ms=DEADLINE_MS, warmup=0))
        await asyncio.sleep(1.5)
        os.kill(victim, signal.SIGKILL)  # a replica process, by the pid it answered with
        return await task

    during = asyncio.run(load_and_kill())
    print(f"\nkilled replica {victim} under load: {during['statuses']}, by process {during['by_process']}")
    # every request was answered by the proxy: fills, or an error status for the ones on the victim
    assert during["errors"] == {}, during
    assert during["ok"] >= 4 and set(during["statuses"]) <= {"200", "500", "502", "503", "504"}, during
    # Serve replaces the replica: two processes answer again, one of them new
    end = time.monotonic() + 180
    while time.monotonic() < end:
        now = asyncio.run(loadtest.run(cluster, clients=4, seconds=2, deadline_ms=DEADLINE_MS, warmup=0))["by_process"]
        if len(now) == 2 and str(victim) not in now:
            print(f"replaced after {time.monotonic() - end + 180:.0f} s: {now}")
            break
        time.sleep(2)
    else:
        raise AssertionError(f"no replacement replica: {now}")


def test_the_language_servers_remote_engine_works_against_it(cluster):
    eng = HttpEngine(cluster).start()
    try:
        assert eng.wait_ready(30) and eng.dlm and eng.model_id == "tiny"
        job = FillJob(prefix="def f(x):\n    return ", suffix="\n", max_tokens=8, deadline=time.monotonic() + 10)
        fill = eng.submit(job).result(30)
        assert fill.text and fill.steps >= 1
    finally:
        eng.close()
