"""The context a fill is given, per model and device (issue 37): the rule (engine.api.context_budget),
the engine reporting it with its state (in-process, through the daemon, through an HTTP endpoint),
the `contextTokens` option, `dlm-lsp http --context-tokens`, and the tree-sitter context filling
a larger budget. The language server's own use of it is in tests/test_server_e2e.py."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
import torch

from dlm_lsp.fill.context import build_request, to_fill_job
from dlm_lsp.fill.documents import Document
from dlm_lsp.http import app as http_app
from dlm_lsp.http.app import FimServer
from dlm_lsp.measure.fuzz.scripted_engine import ScriptedEngine
from dlm_lsp.options import CONTEXT_TOKENS_RANGE, InitializationOptions, parse_options
from engine.api import (
    CPU_CONTEXT_TOKENS,
    CUDA_CONTEXT_TOKENS,
    DEFAULT_CONTEXT_TOKENS,
    FillJob,
    context_budget,
    reported_context_tokens,
)
from engine.clients.http_engine import HttpEngine
from engine.clients.remote import RemoteEngine
from engine.serve import daemon as engine_daemon
from engine.serve.service import EngineService
from tests.http_helpers import ThreadServer
from tests.tiny import make_tiny_checkpoint

TIMEOUT = 60


# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    "device,max_seq_len,context_len,budget",
    [
        ("cpu", 1024, 512, 512),  # the embedded default model
        ("cpu", 32768, 4096, CPU_CONTEXT_TOKENS),  # a 7B family on the CPU keeps today's 512
        ("cpu", 1024, 256, 256),  # a window below the cap is the model's
        ("cpu", 300, None, 300),  # no context_len: max_seq_len is the window
        ("cuda", 32768, 4096, 4096),
        ("cuda:1", 131072, 32768, CUDA_CONTEXT_TOKENS),  # a long window is capped on the GPU too
        ("cuda", 2048, None, 2048),
        ("cuda", 1024, 4096, 1024),  # never past max_seq_len, whatever context_len says
        ("mps", 8192, 8192, CPU_CONTEXT_TOKENS),  # any device but CUDA is held to the CPU's cap
    ],
)
def test_the_budget_is_the_models_window_capped_for_the_device(device, max_seq_len, context_len, budget):
    assert context_budget(device, max_seq_len, context_len) == budget


def test_an_engine_that_reports_no_budget_gets_512():
    assert DEFAULT_CONTEXT_TOKENS == 512
    for info in (None, {}, {"context_tokens": None}, {"context_tokens": True}, {"context_tokens": 0}):
        assert reported_context_tokens(info) == 512, info
    assert reported_context_tokens({"context_tokens": "4096"}) == 512  # a value of the wrong type
    assert reported_context_tokens({"context_tokens": 4096}) == 4096


# ----------------------------------------------------------------------------- the option


def test_context_tokens_option_is_typed_defaulted_and_validated():
    assert InitializationOptions().context_tokens is None  # the engine's budget
    opts, warnings = parse_options({"contextTokens": 2048})
    assert opts.context_tokens == 2048 and warnings == []
    assert parse_options({"contextTokens": 2048.0})[0].context_tokens == 2048  # JSON clients send floats
    low, high = CONTEXT_TOKENS_RANGE
    assert parse_options({"contextTokens": low})[0].context_tokens == low
    assert parse_options({"contextTokens": high})[0].context_tokens == high
    for bad in (low - 1, high + 1, -5, "4096", True, 1.5, [4096]):
        opts, warnings = parse_options({"contextTokens": bad})
        assert opts.context_tokens is None, bad
        assert len(warnings) == 1 and "'contextTokens'" in warnings[0] and "using None" in warnings[0], warnings
    # a bad value keeps the one set before; null goes back to the engine's budget
    base, _ = parse_options({"contextTokens": 1024})
    assert parse_options({"contextTokens": 10}, base)[0].context_tokens == 1024
    assert parse_options({"contextTokens": None}, base)[0].context_tokens is None
    # not machine-scoped: a workspace may ask for less or more context (the engine cuts it to the window)
    opts, warnings = parse_options({"contextTokens": 4096}, base, from_settings=True)
    assert opts.context_tokens == 4096 and warnings == []


# ----------------------------------------------------------------------------- machine-scoped options


@pytest.mark.parametrize("key,start,other", [("device", "cpu", "cuda"), ("threads", 2, 16)])
def test_device_and_threads_come_from_initialization_options_only(key, start, other):
    init, warnings = parse_options({key: start})
    assert getattr(init, key.lower()) == start and warnings == []
    opts, warnings = parse_options({key: other, "budgetMs": 250}, init, from_settings=True)
    assert getattr(opts, key) == start and opts.budget_ms == 250  # refused; the rest applies
    assert len(warnings) == 1 and f"{key!r} cannot be changed through workspace settings" in warnings[0]
    same, warnings = parse_options({key: start}, init, from_settings=True)  # the value it has: no warning
    assert getattr(same, key) == start and warnings == []
    assert getattr(parse_options({key: other}, init)[0], key) == other  # the user's initializationOptions


# ----------------------------------------------------------------------------- the engine reports it


def test_the_engine_service_reports_its_models_budget_for_its_device(tmp_path):
    states: list[tuple[str, dict]] = []
    svc = EngineService(str(make_tiny_checkpoint(tmp_path / "tiny")), device="cpu", threads=1)
    svc.on_state = lambda state, info: states.append((state, info))
    assert svc.context_budget() is None  # nothing loaded: nothing to report
    svc.load()
    assert states[0] == ("loading", {**states[0][1], "context_tokens": None})
    assert states[-1][0] == "ready" and states[-1][1]["context_tokens"] == 512  # a 1024 window on the CPU
    assert svc.cfg is not None
    svc.cfg = dataclasses.replace(svc.cfg, context_len=256)
    assert svc.context_budget() == 256
    svc.cfg, svc.device = dataclasses.replace(svc.cfg, context_len=None, max_seq_len=8192), torch.device("cuda")
    assert svc.context_budget() == 4096


def _daemon(script: str) -> tuple[engine_daemon.EngineDaemon, threading.Thread]:
    d = engine_daemon.EngineDaemon(
        script, "cpu", idle_s=60, service_factory=lambda m, dev, on_state, threads: ScriptedEngine(m, dev, on_state)
    )
    assert d.bind()
    t = threading.Thread(target=d.serve_forever, daemon=True)
    t.start()
    return d, t


@pytest.fixture
def runtime(monkeypatch):
    """A private XDG_RUNTIME_DIR, short (a socket path has a 107-byte limit)."""
    d = Path(tempfile.mkdtemp(prefix="dlmrt-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("script,budget", [("scripted:context=2048", 2048), ("scripted:steps=1", None)])
def test_the_daemon_passes_the_budget_to_its_windows_and_an_old_one_falls_back(runtime, script, budget):
    """A daemon's engine that reports a budget: the window's RemoteEngine reports it; one that does
    not (a daemon from before this field): nothing, and the server falls back to 512."""
    d, t = _daemon(script)
    infos: list[dict] = []
    r = RemoteEngine(script, "cpu", on_state=lambda state, info: infos.append(info) if state == "ready" else None)
    try:
        r.start()
        assert r.wait_ready(TIMEOUT)
        assert infos and infos[-1].get("context_tokens") == budget and infos[-1]["engine"] == "shared"
        assert reported_context_tokens(infos[-1]) == (budget or 512)
    finally:
        r.close()
        d.stop()
        t.join(TIMEOUT)


# ----------------------------------------------------------------------------- the HTTP face


class Recording(ScriptedEngine):
    def __init__(self, model, on_state=None):
        super().__init__(model, "cpu", on_state)
        self.jobs: list[FillJob] = []

    def submit(self, job):
        self.jobs.append(job)
        return super().submit(job)


def _fim(script: str, **kw) -> tuple[FimServer, list[Recording]]:
    engines: list[Recording] = []

    def factory(on_state):
        engines.append(Recording(script, on_state))
        return engines[-1]

    return FimServer(factory, "dlm-test", **kw), engines


def _complete(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "def add(a, b):\n    return ", "suffix": ""}, timeout=20)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "script,flag,budget",
    [
        ("scripted:context=2048", None, 2048),  # default: the model's budget, as the engine reports it
        ("scripted:context=2048", 1000, 1000),  # --context-tokens
        ("scripted:steps=1", None, 512),  # an engine that reports none
    ],
)
def test_dlm_lsp_http_gives_fills_the_flag_or_the_models_budget_and_reports_it(script, flag, budget):
    server, engines = _fim(script, context_tokens=flag)
    with ThreadServer(server.app) as s:
        _complete(s.url)
        assert engines[0].jobs[-1].context_tokens == budget
        models = httpx.get(s.url + "/v1/models", timeout=10).json()
        assert models["data"][0]["dlm"]["context_tokens"] == budget
        # the language server on this endpoint takes the budget as the engine's (engine/clients/http_engine.py)
        infos: list[dict] = []
        eng = HttpEngine(s.url, on_state=lambda state, info: infos.append(info))
        try:
            assert eng.start().wait_ready(TIMEOUT) and eng.dlm
            assert infos[-1]["context_tokens"] == budget
        finally:
            eng.close()


def test_the_http_flag_is_parsed_and_checked():
    p = argparse.ArgumentParser()
    http_app.add_http_args(p)
    assert p.parse_args([]).context_tokens is None
    assert p.parse_args(["--context-tokens", "4096"]).context_tokens == 4096
    for bad in ("63", "40000"):
        assert http_app.run_http(p.parse_args(["--context-tokens", bad])) == 2  # refused before anything starts


def test_a_fim_endpoint_that_is_not_dlm_lsp_reports_no_budget():
    """A plain FIM API's model list (no `dlm` field): the server keeps 512."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "other", "object": "model"}]})

    app = Starlette(routes=[Route("/v1/models", models)])
    with ThreadServer(app, ready_path="/v1/models") as s:
        infos: list[dict] = []
        eng = HttpEngine(s.url, on_state=lambda state, info: infos.append(info))
        try:
            assert eng.start().wait_ready(TIMEOUT) and not eng.dlm
            assert infos[-1]["context_tokens"] is None and reported_context_tokens(infos[-1]) == 512
        finally:
            eng.close()


# ----------------------------------------------------------------------------- the tree-sitter context


def _long_module() -> tuple[Document, int]:
    """A module with imports, 60 helper functions, then a class whose long method holds the cursor."""
    helpers = "".join(f"def helper_{i}(x):\n    return x * {i} + {i}\n\n\n" for i in range(60))
    body = "".join(f"        total += self.rates[{i}] * amount\n" for i in range(120))
    after = "".join(f"        total -= self.fees[{i}]\n" for i in range(120))
    text = (
        "import math\nimport os\nfrom collections import OrderedDict\n\n\n"
        + helpers
        + "class Ledger:\n    def __init__(self):\n        self.rates = []\n\n"
        + "    def settle(self, amount):\n        total = 0\n"
        + body
        + "        \n"
        + after
        + "        return total\n"
    )
    offset = text.index("        \n", text.index("def settle")) + 8
    return Document("file:///tmp/ledger.py", "python", 1, text), offset


def test_a_larger_budget_collects_more_context_with_the_imports_headers_and_snippets_kept():
    doc, offset = _long_module()
    snippets = "def other_file_helper(y):\n    return y\n"
    small = build_request(doc, offset, 64, 512, neighbours=snippets)
    big = build_request(doc, offset, 64, 2048, neighbours=snippets)
    for req in (small, big):
        assert req.hole_kind == "block"
        # what is kept whatever the window: the imports and the enclosing definitions' headers
        assert req.prefix.startswith("import math\nimport os\nfrom collections import OrderedDict\n")
        assert "class Ledger:\n" in req.prefix and "    def settle(self, amount):\n" in req.prefix
        assert req.far.startswith(snippets)  # the workspace snippets, as today
    # the window around the cursor grows with the budget, on both sides
    rates = [req.prefix.count("total += self.rates[") for req in (small, big)]
    fees = [req.suffix.count("total -= self.fees[") for req in (small, big)]
    assert rates[1] > 3 * rates[0] > 0 and fees[1] > 3 * fees[0] > 0, (rates, fees)
    assert big.prefix.endswith(small.prefix[small.prefix.index("        total += self.rates[") :])
    assert big.suffix.startswith(small.suffix)
    # ...within the budget's characters (tokens ~ chars / 3.5)
    assert len(big.prefix) + len(big.suffix) <= (2048 - 64) * 3.5
    assert to_fill_job(big, None, 2048).context_tokens == 2048


def test_dlm_lsp_complete_gives_its_fill_the_engines_budget_as_the_server_does():
    from dlm_lsp.headless import fill_document
    from engine.api import Fill

    class Engine:
        def __init__(self, budget: int | None):
            self.budget, self.jobs = budget, []

        def context_budget(self) -> int | None:
            return self.budget

        def run_now(self, job: FillJob) -> Fill:
            self.jobs.append(job)
            return Fill(text="total += 1", tokens=3, steps=1, slots=job.max_tokens)

    doc, offset = _long_module()
    got = {}
    for budget in (2048, None):  # None: not loaded / a stand-in without a budget: 512
        engine = Engine(budget)
        fill_document(engine, doc, offset)
        got[budget] = engine.jobs[0]
    assert got[2048].context_tokens == 2048 and got[None].context_tokens == 512
    assert len(got[2048].prefix) > 3 * len(got[None].prefix)
