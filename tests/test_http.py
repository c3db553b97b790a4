"""`dlm-lsp http` (dlm_lsp/http/app.py, dlm_lsp/http/fim.py): the real app under uvicorn on a
loopback port, driven over real sockets with httpx and raw sockets. The scripted engine
(dlm_lsp/measure/fuzz/scripted_engine.py) gives exact timing: cancel on disconnect, deadlines, a stuck engine.
`dlm-lsp http` as a process on a tiny checkpoint (the real engine) is tested in
tests/test_http_engine.py, where the language server uses it as its engine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dlm_lsp.http.app import FimServer, is_loopback
from dlm_lsp.http.fim import ApiError, FimPipeline, Limits, parse_body
from dlm_lsp.measure.fuzz.scripted_engine import ScriptedEngine
from engine.api import Fill
from tests.http_helpers import ThreadServer

REPO = Path(__file__).resolve().parent.parent
PROMPT = "def add(a, b):\n    return "
SUFFIX = "\n\n\nprint(add(1, 2))\n"


class RecordingEngine(ScriptedEngine):
    """The scripted engine, keeping every job it was given."""

    def __init__(self, model, on_state=None):
        super().__init__(model, "cpu", on_state)
        self.jobs = []

    def submit(self, job):
        self.jobs.append(job)
        return super().submit(job)


class Running(ThreadServer):
    """A FimServer with the recording scripted engine under uvicorn on a thread."""

    def __init__(self, script: str = "scripted:text=a%20%2B%20b", port: int = 0, **kw):
        self.engines: list[RecordingEngine] = []

        def factory(on_state):
            e = RecordingEngine(script, on_state)
            self.engines.append(e)
            return e

        self.server = FimServer(factory, "dlm-test", **kw)
        super().__init__(self.server.app, port=port)

    @property
    def engine(self) -> RecordingEngine:
        return self.engines[0]


def post(url: str, body, path: str = "/v1/completions", headers: dict | None = None, timeout: float = 20):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        url + path, content=data, headers={"content-type": "application/json", **(headers or {})}, timeout=timeout
    )


# ----------------------------------------------------------------------------- pure parts


def test_parse_body_reads_both_shapes_and_refuses_bad_fields():
    lim = Limits()
    p = parse_body(
        json.dumps(
            {
                "prompt": ["x = "],
                "suffix": None,
                "stop": "\n",
                "max_tokens": 8,
                "temperature": 0.5,
                "stream": True,
                "stream_options": {"include_usage": True},
                "deadline_ms": 250,
                "language": "go",
                "postprocess": False,
            }
        ).encode(),
        "openai",
        lim,
    )
    assert (p.prompt, p.suffix, p.stop, p.max_tokens, p.temperature, p.stream, p.include_usage) == (
        "x = ",
        "",
        ["\n"],
        8,
        0.5,
        True,
        True,
    )
    assert (p.deadline_ms, p.language, p.postprocess) == (250, "go", False)
    m = parse_body(json.dumps({"prompt": "a", "suffix": "b", "model": "m", "stop": ["\n\n"]}).encode(), "mercury", lim)
    assert (m.prompt, m.suffix, m.model, m.stop) == ("a", "b", "m", ["\n\n"])
    bad = [
        ({"prompt": 3}, "prompt"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens"),
        ({"prompt": "a", "temperature": 3}, "temperature"),
        ({"prompt": "a", "stop": [""]}, "stop"),
        ({"prompt": "a", "stop": ["x"] * 17}, "stop"),
        ({"prompt": "a", "n": 2}, "n"),
        ({"prompt": "a", "deadline_ms": 5}, "deadline_ms"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "suffix": 1}, "suffix"),
        ({"prompt": "a", "seed": 2**64, "temperature": 0.5}, "seed"),  # torch's generator would overflow
        ({"prompt": "a", "seed": -(2**63) - 1}, "seed"),
        ({"prompt": "a", "seed": 1.5}, "seed"),
    ]
    for body, param in bad:
        with pytest.raises(ApiError) as e:
            parse_body(json.dumps(body).encode(), "openai", lim)
        assert (e.value.status, e.value.param) == (400, param), body
    with pytest.raises(ApiError) as e:  # Mercury's stop is a list only, its prompt a string only
        parse_body(json.dumps({"prompt": ["a"]}).encode(), "mercury", lim)
    assert e.value.param == "prompt"
    with pytest.raises(ApiError) as e:
        parse_body(b"{nope", "openai", lim)
    assert e.value.status == 400
    with pytest.raises(ApiError) as e:
        parse_body(b" " * 100, "openai", Limits(max_body_bytes=10))
    assert e.value.status == 413


def test_pipeline_infers_the_hole_and_post_processes_like_the_server():
    pipe = FimPipeline(max_fill_tokens=64)
    p = parse_body(json.dumps({"prompt": PROMPT, "suffix": SUFFIX}).encode(), "openai", Limits())
    prep = pipe.prepare(p)
    assert prep.request.hole_kind == "line" and prep.job.max_tokens == 16 and prep.check is not None
    assert prep.job.prefix.endswith(PROMPT) and prep.job.suffix.startswith("\n")
    ok = pipe.complete(prep, Fill(text="a + b\nmore", tokens=4, steps=2, slots=16))
    assert (ok.text, ok.finish_reason) == ("a + b", "stop")  # a line hole ends at its line
    broken = pipe.complete(prep, Fill(text="a + (b", tokens=4, steps=2, slots=16))
    assert broken.text != "a + (b"  # never shown with its bracket left open
    # max_tokens bounds the slots; a block hole gets a block's
    small = pipe.prepare(parse_body(json.dumps({"prompt": PROMPT, "max_tokens": 5}).encode(), "openai", Limits()))
    assert small.job.max_tokens == 5
    exact = pipe.prepare(parse_body(json.dumps({"prompt": PROMPT, "slots": 7}).encode(), "openai", Limits()))
    assert exact.job.max_tokens == 7  # a client that sized the hole itself
    bounded = pipe.prepare(
        parse_body(json.dumps({"prompt": PROMPT, "slots": 40, "max_tokens": 9}).encode(), "openai", Limits())
    )
    assert bounded.job.max_tokens == 9
    block = pipe.prepare(parse_body(json.dumps({"prompt": "def f(x):\n", "suffix": ""}).encode(), "openai", Limits()))
    assert block.request.hole_kind == "block" and block.job.max_tokens == 64
    middle = pipe.prepare(parse_body(json.dumps({"prompt": "x = f(", "suffix": ")\n"}).encode(), "openai", Limits()))
    assert middle.request.hole_kind in ("middle", "args")
    # stop sequences cut the engine's text; postprocess false keeps the rest as it came
    raw = pipe.prepare(
        parse_body(json.dumps({"prompt": PROMPT, "postprocess": False, "stop": ["b"]}).encode(), "openai", Limits())
    )
    got = pipe.complete(raw, Fill(text=" a + b\n  c", tokens=16, steps=2, slots=16))
    assert (got.text, got.finish_reason) == (" a + ", "stop")
    full = pipe.complete(raw, Fill(text="xyz", tokens=16, steps=2, slots=16))
    assert (full.text, full.finish_reason) == ("xyz", "length")


def test_a_huge_prompt_is_cut_before_parsing():
    pipe = FimPipeline(max_fill_tokens=64)
    filler = "x = 1\n" * 150_000  # 900 kB before the function
    body = {"prompt": filler + PROMPT, "suffix": SUFFIX + "y = 2\n" * 20_000}
    t0 = time.perf_counter()
    prep = pipe.prepare(parse_body(json.dumps(body).encode(), "openai", Limits(max_body_bytes=2 << 20)))
    took = time.perf_counter() - t0
    assert prep.request.hole_kind == "line" and prep.job.prefix.endswith(PROMPT)
    assert prep.job.suffix.startswith("\n") and len(prep.job.prefix) < 40_000
    assert prep.check is not None  # parsed: the whole text (over 1M characters) would get no tree
    assert took < 1.0, took  # the whole 1 MB would take a tree-sitter parse of all of it


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.3.4.5")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")
    assert not is_loopback("example.org")


# ----------------------------------------------------------------------------- over real sockets


def test_completions_in_both_shapes_with_timing_and_usage():
    with Running() as s:
        r = post(s.url, {"prompt": PROMPT, "suffix": SUFFIX, "max_tokens": 16, "model": "dlm-test"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "dlm-test" and body["id"].startswith("cmpl-")
        assert body["choices"][0]["text"] == "a + b" and body["choices"][0]["finish_reason"] in ("stop", "length")
        d = body["dlm"]
        assert d["steps"] == 4 and d["hole_kind"] == "line" and d["slots"] == 16 and d["compute_ms"] > 0
        assert d["total_ms"] >= d["compute_ms"] and set(body["usage"]) == {
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
        }
        m = post(s.url, {"prompt": PROMPT, "suffix": SUFFIX, "model": "dlm-test"}, path="/v1/fim/completions")
        assert m.status_code == 200 and m.json()["choices"][0]["text"] == "a + b"
        assert {"reasoning_tokens", "cached_input_tokens"} <= set(m.json()["usage"])
        job = s.engine.jobs[-1]
        assert job.prefix.endswith(PROMPT) and job.deadline is not None
        models = httpx.get(s.url + "/v1/models").json()
        assert models["data"][0]["id"] == "dlm-test" and models["data"][0]["dlm"]["state"] == "ready"
        assert httpx.get(s.url + "/health").json()["status"] == "ready"


def test_stream_is_server_sent_events_ending_in_done():
    with Running() as s:
        with httpx.stream(
            "POST",
            s.url + "/v1/completions",
            timeout=20,
            json={"prompt": PROMPT, "suffix": SUFFIX, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] or "" for c in chunks if c["choices"]) == "a + b"
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] in ("stop", "length")
        assert any("dlm" in c for c in chunks) and chunks[-1]["choices"] == [] and "usage" in chunks[-1]


def test_errors_are_answered_with_their_status():
    with Running(limits=Limits(max_body_bytes=2000)) as s:
        assert post(s.url, {"prompt": 1}).status_code == 400
        assert post(s.url, b"not json").status_code == 400
        r = post(s.url, {"prompt": "x", "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        big = post(s.url, {"prompt": "x" * 5000})
        assert big.status_code == 413 and "2000" in big.json()["error"]["message"]

        def chunked():
            for _ in range(10):
                yield b"x" * 500

        r = httpx.post(s.url + "/v1/completions", content=chunked(), timeout=20)  # no Content-Length
        assert r.status_code == 413
        assert httpx.get(s.url + "/v1/completions").status_code == 405
        assert s.engine.jobs == []  # none of these reached the engine


def test_bearer_token_is_required_when_set():
    with Running(token="s3cret") as s:
        r = post(s.url, {"prompt": PROMPT})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert post(s.url, {"prompt": PROMPT}, headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert post(s.url, {"prompt": PROMPT}, headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # liveness needs no token


def read_answer(c: socket.socket, within: float = 20) -> bytes:
    """Everything the server sends until it closes the connection (at most `within` seconds)."""
    c.settimeout(within)
    out = b""
    while chunk := c.recv(65536):
        out += chunk
    return out


def test_the_token_is_checked_before_the_body_and_a_refusal_closes():
    """No body is waited for, no slot taken: a head without the token is answered at once."""
    with Running(token="s3cret", body_timeout_s=30) as s:
        c = socket.create_connection(("127.0.0.1", s.port))
        t0 = time.monotonic()
        c.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
            b"Content-Length: 100000\r\n\r\n{"
        )
        answer = read_answer(c)  # returns at EOF: the connection is closed
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()
        assert time.monotonic() - t0 < 10  # the body would have taken 30 s
        assert s.server.counters["requests"] == 0 and s.engine.jobs == []  # the handler never ran
        for path in ("/v1/unknown", "/metrics", "/"):  # every route but /health
            assert httpx.get(s.url + path).status_code == 401


def test_a_slow_body_is_answered_408_and_holds_no_slot():
    """Bodies still arriving take no in-flight slot: with every slot's worth of slow bodies open, a
    well-behaved request is answered; each slow body is answered 408 at its deadline, then closed."""
    with Running(max_inflight=2, body_timeout_s=2) as s:
        slow = []
        for _ in range(4):
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
            slow.append(c)
        time.sleep(0.3)
        r = post(s.url, {"prompt": PROMPT, "suffix": SUFFIX})
        assert r.status_code == 200, r.text
        for c in slow:
            answer = read_answer(c)
            assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer
            c.close()
        assert s.server.counters["body_timeouts"] == 4 and s.server.counters["refused"] == 0
        assert s.server.inflight == 0 and len(s.engine.jobs) == 1


def test_a_client_that_disconnects_cancels_its_engine_job():
    with Running("scripted:steps=2000,step_ms=5") as s:
        body = json.dumps({"prompt": PROMPT, "deadline_ms": 30000}).encode()
        c = socket.create_connection(("127.0.0.1", s.port))
        c.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        end = time.monotonic() + 10
        while not s.engine.jobs and time.monotonic() < end:
            time.sleep(0.01)
        assert s.engine.jobs, "the job never reached the engine"
        time.sleep(0.1)
        c.close()
        job = s.engine.jobs[0]
        end = time.monotonic() + 5
        while not job.cancelled and time.monotonic() < end:
            time.sleep(0.01)
        assert job.cancelled, "the engine job kept running after its client left"
        assert s.server.counters["disconnected"] == 1
        assert post(s.url, {"prompt": PROMPT, "deadline_ms": 100}).status_code == 200  # the server goes on


def test_a_client_that_leaves_while_sending_its_body_is_no_server_error():
    with Running() as s:
        c = socket.create_connection(("127.0.0.1", s.port))
        c.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"prompt": ')
        time.sleep(0.2)
        c.close()
        end = time.monotonic() + 5
        while s.server.counters["disconnected"] == 0 and time.monotonic() < end:
            time.sleep(0.01)
        assert s.server.counters["disconnected"] == 1 and s.server.counters["errors"] == 0
        assert s.engine.jobs == [] and s.server.inflight == 0


def test_the_deadline_is_honoured():
    with Running("scripted:steps=2000,step_ms=5") as s:
        t0 = time.monotonic()
        r = post(s.url, {"prompt": PROMPT, "deadline_ms": 200})
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["dlm"]["deadline_hit"] is True
        assert took < 8.0, took  # the job would take 10 s; a busy machine may take seconds to answer


def test_a_stuck_engine_answers_504_and_cancels_the_job():
    with Running("scripted:hang=1") as s:
        t0 = time.monotonic()
        r = post(s.url, {"prompt": PROMPT, "deadline_ms": 150})
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        assert time.monotonic() - t0 < 15.0  # the engine never ends: any answer came from the deadline
        assert s.engine.jobs[0].cancelled


def test_engine_errors_and_overload_are_answered():
    with Running("scripted:fail=1") as s:
        r = post(s.url, {"prompt": PROMPT})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    with Running("scripted:steps=100,step_ms=10", max_inflight=1) as s:
        results = {}

        def slow():
            results["slow"] = post(s.url, {"prompt": PROMPT, "deadline_ms": 5000}).status_code

        t = threading.Thread(target=slow)
        t.start()
        end = time.monotonic() + 10
        while not s.engine.jobs and time.monotonic() < end:
            time.sleep(0.01)
        busy = post(s.url, {"prompt": PROMPT})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        t.join(20)
        assert results["slow"] == 200


def test_requests_wait_for_the_model_then_answer_503_while_it_loads():
    s = Running("scripted:load_ms=3000").start()
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                h = httpx.get(s.url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.02)
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = post(s.url, {"prompt": PROMPT, "deadline_ms": 100})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
    finally:
        s.__exit__()


def test_refuses_a_non_loopback_address_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != "DLM_HTTP_TOKEN"}
    r = subprocess.run(
        [sys.executable, "-m", "dlm_lsp", "http", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert r.returncode == 2 and "without a token" in r.stderr
