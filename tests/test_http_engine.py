"""The language server's remote engine (engine/clients/http_engine.py) and the `engine` option: against a
real `dlm-lsp http` process on a tiny checkpoint, against the in-process API with the scripted
engine (exact timing for cancel and deadline), and the `mercury` flavour against a local stand-in
that speaks Inception's documented /v1/fim/completions shape (no network). The language server
runs as a real process over stdio with the endpoint as its engine."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from dlm_lsp.measure.replay import LspClient
from dlm_lsp.options import parse_options
from engine.api import EngineError, FillJob
from engine.clients.http_engine import HttpEngine, base_url
from tests.http_helpers import REPO, ThreadServer, http_process
from tests.lsp_helpers import REAL_SERVER, inline, insert, lsp_server, open_doc
from tests.test_http import PROMPT, Running

TIMEOUT = 120
URI = "file:///tmp/http_engine_doc.py"
DOC = "def add(a, b):\n    return \n\n\nprint(add(1, 2))\n"  # the cursor at (1, 11), after "return "
KEY_ENV = "DLM_TEST_MERCURY_KEY"
KEY = "test-key-123"


class MercuryStandIn:
    """A local server speaking Mercury's documented FIM shape: POST /v1/fim/completions {model
    (required), prompt, suffix, max_tokens, ...} -> {id, object: text_completion, created, model,
    choices: [{index, text, finish_reason}], usage: {prompt_tokens, reasoning_tokens,
    completion_tokens, total_tokens, cached_input_tokens}}, a bearer key, errors as {"error":
    {message, type, param, code}}. Fields outside its documented request are refused (400), so a
    client that leaks this project's extension fields to it fails. `delays` holds the seconds each
    next request waits before answering; a request whose client leaves meanwhile is `aborted`."""

    KNOWN = {
        "prompt",
        "suffix",
        "model",
        "max_tokens",
        "top_p",
        "top_k",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "stop",
        "stream",
        "stream_options",
        "temperature",
    }

    def __init__(self, text: str = "a + b"):
        self.text, self.delays = text, []
        self.fail_next: list[int] = []  # statuses a proxy in front would answer (plain text) for the next requests
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.aborted = 0
        self.app = Starlette(
            routes=[Route("/v1/models", self.models), Route("/v1/fim/completions", self.fim, methods=["POST"])]
        )
        self.server = ThreadServer(self.app, ready_path="/v1/models", ready_status=401)

    def _auth(self, request: Request):
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return JSONResponse(
                {
                    "error": {
                        "message": "Incorrect API key provided",
                        "type": "authentication_error",
                        "param": None,
                        "code": "invalid_api_key",
                    }
                },
                status_code=401,
            )
        return None

    async def models(self, request: Request):
        return self._auth(request) or JSONResponse({"data": [{"id": "mercury-2"}, {"id": "mercury-edit-2"}]})

    async def fim(self, request: Request):
        refused = self._auth(request)
        if refused:
            return refused
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        extra = sorted(set(body) - self.KNOWN)
        if extra or not isinstance(body.get("prompt"), str) or not isinstance(body.get("model"), str):
            return JSONResponse(
                {
                    "error": {
                        "message": f"bad request: unknown {extra}" if extra else "bad request",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                },
                status_code=400,
            )
        if self.fail_next:
            return PlainTextResponse("Internal Server Error", status_code=self.fail_next.pop(0))
        delay = self.delays.pop(0) if self.delays else 0.0
        end = time.monotonic() + delay
        while time.monotonic() < end:
            if await request.is_disconnected():
                self.aborted += 1
                return JSONResponse({}, status_code=499)
            await asyncio.sleep(0.01)
        return JSONResponse(
            {
                "id": "cmpl-standin",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop", "text": self.text}],
                "usage": {
                    "prompt_tokens": 12,
                    "completion_tokens": 3,
                    "total_tokens": 15,
                    "reasoning_tokens": 0,
                    "cached_input_tokens": 0,
                },
            }
        )

    def __enter__(self):
        self.server.__enter__()
        self.url = self.server.url + "/v1"
        return self

    def __exit__(self, *exc):
        self.server.__exit__(*exc)


def job(prefix: str = PROMPT, suffix: str = "\n", deadline_s: float | None = 30.0, slots: int = 16) -> FillJob:
    return FillJob(
        prefix=prefix,
        suffix=suffix,
        max_tokens=slots,
        deadline=None if deadline_s is None else time.monotonic() + deadline_s,
    )


def wait(pred, timeout: float = 10.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# ----------------------------------------------------------------------------- settings


def test_the_engine_option_takes_an_endpoint_but_never_a_key():
    opts, w = parse_options({"engine": "http://127.0.0.1:8765/v1"})
    assert opts.engine == {"url": "http://127.0.0.1:8765/v1", "api": "openai-fim", "apiKeyEnv": None, "model": None}
    assert not w
    opts, w = parse_options({"engine": {"url": "https://api.example.test/v1", "api": "mercury", "apiKeyEnv": "MY_KEY"}})
    assert opts.engine["api"] == "mercury" and opts.engine["apiKeyEnv"] == "MY_KEY" and not w
    for bad in (
        {"url": "http://x/v1", "apiKey": "sk-1"},
        {"url": "ftp://x"},
        {"url": "http://u:p@x/v1"},
        {"url": "http://x", "api": "grpc"},
        {"url": "http://x", "apiKeyEnv": "$(rm)"},
        42,
        "gpu-farm",
    ):
        opts, w = parse_options({"engine": bad})
        assert opts.engine is None and w and "engine" in w[0], bad
    opts, w = parse_options({"engine": {"url": "http://x/v1", "apiKey": "sk-1"}})
    assert "apiKeyEnv" in w[0] and "sk-1" not in w[0]
    # a workspace's settings can no more point the server at an endpoint than choose its model
    base, _ = parse_options({"engine": "shared"})
    opts, w = parse_options({"engine": "http://evil.test/v1"}, base, from_settings=True)
    assert opts.engine == "shared" and "workspace settings" in w[0]


def test_a_serve_on_an_http_engine_imports_no_torch():
    code = (
        "import sys; from dlm_lsp.server import default_engine_factory; "
        "e = default_engine_factory(None, 'cpu', None, engine={'url': 'http://127.0.0.1:9/v1', 'api': 'openai-fim', "
        "'apiKeyEnv': None, 'model': None}); print(type(e).__name__, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO), timeout=120)
    assert out.stdout.split() == ["HttpEngine", "False"], out.stderr


def test_base_url():
    assert base_url("http://127.0.0.1:8765") == "http://127.0.0.1:8765/v1"
    assert base_url("https://api.example.test/v1/") == "https://api.example.test/v1"
    for bad in ("ftp://x/v1", "http:///v1", "http://u:p@x/v1"):
        with pytest.raises(ValueError):
            base_url(bad)


# ----------------------------------------------------------------------------- against dlm-lsp http


async def test_a_dlm_lsp_http_process_is_the_language_servers_engine(tmp_path):
    from tests.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "tiny", printable=True)
    with http_process(model) as url:
        # the API itself, both shapes, with the real engine and pipeline
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": PROMPT, "suffix": "\n\nprint(1)\n", "postprocess": False, "deadline_ms": 5000},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        b = r.json()
        assert b["model"] == "tiny" and b["choices"][0]["text"] and b["usage"]["prompt_tokens"] > 0
        assert b["dlm"]["steps"] >= 1 and len(b["dlm"]["tokens_per_step"]) == b["dlm"]["steps"]
        assert sum(b["dlm"]["tokens_per_step"]) >= b["usage"]["completion_tokens"]
        assert b["dlm"]["forwarded_tokens"] > b["dlm"]["steps"] and b["dlm"]["reused_tokens"] == 0  # rows run
        r = httpx.post(
            url + "/v1/fim/completions", json={"prompt": PROMPT, "suffix": "\n", "model": "tiny"}, timeout=60
        )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        eng = HttpEngine(url).start()
        try:
            assert await asyncio.to_thread(eng.wait_ready, 30)
            assert eng.dlm and eng.model_id == "tiny"
            fill = await asyncio.wrap_future(eng.submit(job(slots=8)))
            assert fill.text and fill.steps >= 1 and len(fill.tokens_per_step) == fill.steps
            assert not fill.cancelled and 0.0 < fill.confidence <= 1.0
            assert fill.forwarded_tokens > fill.steps and fill.reused_tokens == 0  # read back from the `dlm` field
        finally:
            eng.close()
        opts = {"engine": {"url": url + "/v1"}, "postprocess": False, "budgetMs": 10000}
        async with lsp_server(REAL_SERVER, opts, ready_timeout=TIMEOUT) as c:
            open_doc(c, URI, DOC)
            items = await inline(c, URI, 1, 11, timeout=TIMEOUT)
            assert items and items[0]["insertText"], items
            stats = await c.request("dlm/stats", {}, timeout=30)
            assert stats["engineJobs"] >= 1 and stats["engineSteps"] >= 1 and stats["state"] == "ready"


def test_cancel_aborts_the_request_and_the_server_cancels_its_job():
    with Running("scripted:steps=2000,step_ms=5") as s:
        eng = HttpEngine(s.url).start()
        try:
            assert eng.wait_ready(10) and eng.dlm
            j = job()
            fut = eng.submit(j)
            wait(lambda: s.engine.jobs, what="the job to reach the server's engine")
            t0 = time.monotonic()
            j.cancel()
            fill = fut.result(5)
            assert fill.cancelled and time.monotonic() - t0 < 5.0  # the job would run 10 s
            server_job = s.engine.jobs[0]
            wait(lambda: server_job.cancelled, 5, "the server's engine job to be cancelled")
            assert s.server.counters["disconnected"] == 1
            # what the server received: the exact canvas, the deadline, no server-side post-processing
            sent = s.engine.jobs[0]
            assert sent.max_tokens == 16 and sent.prefix.endswith(PROMPT)
            assert 25.0 < sent.deadline - sent.submitted_at < 30.5
        finally:
            eng.close()


def test_a_deadline_passes_on_the_endpoint_too():
    with Running("scripted:hang=1") as s:
        eng = HttpEngine(s.url).start()
        try:
            assert eng.wait_ready(10)
            t0 = time.monotonic()
            with pytest.raises(EngineError, match="504"):
                eng.submit(job(deadline_s=0.3)).result(10)
            assert time.monotonic() - t0 < 10.0  # the endpoint never answers: the 504 came from its deadline
        finally:
            eng.close()


def test_an_endpoint_that_is_down_is_loading_then_ready_when_it_comes_up():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    eng = HttpEngine(f"http://127.0.0.1:{port}").start()
    try:
        time.sleep(0.5)
        assert eng.state == "loading" and "does not answer" in (eng.message or "")
        with Running(port=port):  # it comes up on that port
            assert eng.wait_ready(15)
            assert eng.submit(job()).result(10).text == "a + b"
        # and goes away: the next request fails at once, the state goes back to loading
        with pytest.raises(EngineError):
            eng.submit(job()).result(10)
        wait(lambda: eng.state == "loading", 5, "loading again")
    finally:
        eng.close()


# ----------------------------------------------------------------------------- the mercury flavour


def test_mercury_flavour_speaks_the_documented_shape(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    with MercuryStandIn() as m:
        eng = HttpEngine(m.url, api="mercury", api_key_env=KEY_ENV).start()
        try:
            assert eng.wait_ready(10) and not eng.dlm
            fill = eng.submit(job(prefix="x = ", suffix="\n", slots=12)).result(10)
            assert (fill.text, fill.tokens, fill.cancelled) == ("a + b", 3, False)
            body = m.requests[-1]
            assert body == {
                "prompt": "x = ",
                "suffix": "\n",
                "max_tokens": 12,
                "stream": False,
                "model": "mercury-edit-2",
            }
            assert m.headers[-1]["authorization"] == f"Bearer {KEY}"
            # a backend that went away behind a proxy: retried once; twice is an error
            m.fail_next.append(502)
            assert eng.submit(job()).result(10).text == "a + b" and len(m.requests) == 3
            m.fail_next.extend([500, 500])
            with pytest.raises(EngineError, match="HTTP 500"):
                eng.submit(job()).result(10)
            assert len(m.requests) == 5
            del m.requests[1:]
            # cancel aborts the request on the stand-in as well
            m.delays.append(5.0)
            j = job()
            fut = eng.submit(j)
            wait(lambda: len(m.requests) == 2, what="the second request")
            j.cancel()
            assert fut.result(5).cancelled
            wait(lambda: m.aborted == 1, 5, "the stand-in to see the request aborted")
        finally:
            eng.close()
    monkeypatch.setenv(KEY_ENV, "wrong")
    with MercuryStandIn() as m:
        eng = HttpEngine(m.url, api="mercury", api_key_env=KEY_ENV).start()
        try:
            wait(lambda: eng.state == "error", 10, "the refused key to be an error")
            assert "refused the API key" in eng.message and KEY_ENV in eng.message
            with pytest.raises(EngineError):
                eng.submit(job()).result(5)
        finally:
            eng.close()
    monkeypatch.delenv(KEY_ENV)
    eng = HttpEngine("http://127.0.0.1:9/v1", api="mercury", api_key_env=KEY_ENV).start()
    try:
        assert eng.state == "error" and KEY_ENV in eng.message  # no key: said at once, nothing sent
    finally:
        eng.close()


async def test_the_language_server_on_a_mercury_endpoint_post_processes_latest_wins_and_deadlines():
    with MercuryStandIn() as m:
        opts = {"engine": {"url": m.url, "api": "mercury", "apiKeyEnv": KEY_ENV}, "budgetMs": 1500}
        # the key reaches the server through its environment only
        c = LspClient(REAL_SERVER, env={**os.environ, KEY_ENV: KEY}, cwd=str(REPO))
        await c.start()
        try:
            await c.initialize(opts)
            await c.wait_ready(TIMEOUT)
            open_doc(c, URI, DOC)
            items = await inline(c, URI, 1, 11, timeout=30)
            assert [i["insertText"] for i in items] == ["a + b"]  # through the server's post-processing
            assert m.requests[-1]["prompt"].endswith(PROMPT) and m.requests[-1]["model"] == "mercury-edit-2"
            # latest wins: an edit and a newer request abort the older request's HTTP request
            m.delays.extend([5.0, 0.0])
            insert(c, URI, 2, 2, 0, "y = 1\n")
            first = asyncio.ensure_future(inline(c, URI, 1, 11, timeout=30))
            await asyncio.to_thread(wait, lambda: len(m.requests) == 2, 10, "the first request")
            t0 = time.monotonic()
            insert(c, URI, 3, 3, 0, "w = 0\n")
            second = await inline(c, URI, 1, 11, timeout=30)
            assert await first == [] and time.monotonic() - t0 < 4.0  # not the 5 s reply
            assert [i["insertText"] for i in second] == ["a + b"]
            await asyncio.to_thread(wait, lambda: m.aborted == 1, 5, "the superseded request to be aborted")
            # the budget is the deadline: a slow endpoint is answered empty and its request aborted
            m.delays.append(10.0)
            insert(c, URI, 4, 3, 0, "z = 2\n")
            t0 = time.monotonic()
            assert await inline(c, URI, 1, 11, timeout=30) == []
            assert time.monotonic() - t0 < 8.0  # the budget's 1.5 s, not the endpoint's 10 s
            await asyncio.to_thread(wait, lambda: m.aborted == 2, 5, "the late request to be aborted")
            stats = await c.request("dlm/stats", {}, timeout=30)
            assert stats["late"] == 1 and stats["cancelled"] >= 1
        finally:
            await c.stop()
