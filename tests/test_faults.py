"""Fault injection: what the engine and the server do when a step raises, never ends, kills the
engine's thread, runs out of memory, or the model file is broken. Each fault: a log line, the failing
request gets an error or an empty answer, the next request is served.

Engine faults are injected by patching `engine.decode.forward.forward` (the one call every step makes); the
server is driven in process (`DlmServer.fill_at`) with the real engine on a tiny checkpoint, or as a
real process over stdio (`dlm-lsp serve`, or the scripted engine in dlm_lsp/measure/fuzz/scripted_engine.py).
Limits are generous ("answered within 5 s"): they tell a hang from an answer, not fast from slow.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
import time

import pytest

from engine.api import EngineError, FillJob
from engine.decode import forward as fwd
from engine.serve.service import EngineService
from tests.lsp_helpers import FAKE_SERVER, REAL_SERVER, inline, lsp_server, open_doc, scripted
from tests.tiny import make_tiny_checkpoint

TIMEOUT = 60
PREFIX = "def add(a, b):\n    return"
URI = "file:///tmp/dlm-faults/a.py"
SRC = "import os\n\n\ndef total(items):\n    s = 0\n    for x in items:\n        \n    return s\n"
LINE, COL = 6, 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("faults") / "tiny", printable=True)


class Fault:
    """Replaces engine.decode.forward.forward: `when(canvases)` picks the steps that fault, `act()` is the fault."""

    def __init__(self, monkeypatch, act, when=lambda canvases: True, times: int | None = None):
        self.real, self.act, self.when, self.left = fwd.forward, act, when, times
        self.hits = 0
        self.release = threading.Event()  # lets a blocked step go at teardown
        monkeypatch.setattr(fwd, "forward", self)

    def __call__(self, model, canvases, ctx=None):
        if self.when(canvases) and (self.left is None or self.left > 0):
            self.hits += 1
            if self.left is not None:
                self.left -= 1
            self.act(self)
        return self.real(model, canvases, ctx)


def block_forever(fault: Fault) -> None:
    fault.release.wait(600)


@pytest.fixture
def service(folder):
    made = []

    def make(**kw):
        svc = EngineService(str(folder), device="cpu", **kw).start()
        assert svc.wait_ready(TIMEOUT)
        made.append(svc)
        return svc

    yield make
    for svc in made:
        svc.close()


def job(n: int = 6, **kw) -> FillJob:
    return FillJob(prefix=PREFIX, max_tokens=n, **kw)


# ----------------------------------------------------------------------------- the engine alone


@pytest.mark.parametrize(
    "error,match",
    [
        (RuntimeError("injected step failure"), "decoding failed: injected step failure"),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB"), "out of memory while decoding"),
        (MemoryError(), "out of memory while decoding"),
    ],
)
def test_a_step_that_raises_fails_its_job_and_the_next_is_served(service, monkeypatch, caplog, error, match):
    svc = service()

    def act(fault):
        raise error

    fault = Fault(monkeypatch, act, times=1)  # a job alone is not retried
    with caplog.at_level(logging.ERROR, logger="dlm.engine"):
        with pytest.raises(EngineError, match=match):
            svc.submit(job()).result(TIMEOUT)
    assert fault.hits == 1
    assert any("failed" in r.getMessage() for r in caplog.records)
    fill = svc.submit(job()).result(TIMEOUT)
    assert fill.steps >= 1 and fill.text
    assert svc.stats["out_of_memory"] == (0 if "injected" in str(error) else 1)


def test_a_step_that_never_ends_is_abandoned_and_a_new_worker_serves_the_next_job(service, monkeypatch, caplog):
    states = []
    svc = service(stall_s=0.5, on_state=lambda s, info: states.append((s, info.get("message"))))
    fault = Fault(monkeypatch, block_forever, times=1)
    try:
        with caplog.at_level(logging.ERROR, logger="dlm.engine"):
            with pytest.raises(EngineError, match="stuck for .* the engine was restarted"):
                svc.submit(job()).result(10)
        assert any("stuck" in r.getMessage() for r in caplog.records)
        fill = svc.submit(job()).result(TIMEOUT)  # the stuck thread still blocks: a new worker answers
        assert fill.steps >= 1 and fill.text
        assert svc.stats["stalls"] == 1 and svc.stats["restarts"] == 1 and svc.state == "ready"
        assert any(s == "ready" and m and "stuck" in m and "took over" in m for s, m in states)
    finally:
        fault.release.set()


def test_a_worker_stuck_again_and_again_turns_into_a_clear_error(service, monkeypatch):
    svc = service(stall_s=0.3, max_stalls=2)
    fault = Fault(monkeypatch, block_forever)
    try:
        for _ in range(2):
            with pytest.raises(EngineError, match="stuck"):
                svc.submit(job()).result(10)
        assert svc.state == "error" and "stopped" in svc.message and "Restart the server" in svc.message
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="stuck .* 2 times"):
            svc.submit(job()).result(10)  # fails fast, queued behind nothing
        assert time.monotonic() - t0 < 5
    finally:
        fault.release.set()


class ThreadKiller(BaseException):
    """Not an Exception: escapes every `except Exception` in the worker."""


def test_the_engine_thread_dying_fails_its_job_and_the_engine_restarts(service, monkeypatch, caplog):
    svc = service()
    queued = []

    def act(fault):
        queued.append(svc.submit(job(4)))  # waits in the queue while the worker dies: must not be lost
        raise ThreadKiller("injected")

    Fault(monkeypatch, act, times=1)
    with caplog.at_level(logging.CRITICAL, logger="dlm.engine"):
        with pytest.raises(EngineError, match="the engine thread died \\(ThreadKiller: injected\\)"):
            svc.submit(job()).result(TIMEOUT)
    assert any("died" in r.getMessage() for r in caplog.records)
    assert queued[0].result(TIMEOUT).steps >= 1  # served by the new worker
    assert svc.submit(job()).result(TIMEOUT).text
    assert svc.stats["worker_deaths"] == 1 and svc.stats["restarts"] == 1


def test_an_exception_escaping_the_worker_loop_restarts_the_engine(service, monkeypatch):
    svc = service()
    real = svc._expired
    calls = []

    def broken(j, fut):
        calls.append(j)
        if len(calls) == 1:
            raise RuntimeError("injected outside any step")
        return real(j, fut)

    monkeypatch.setattr(svc, "_expired", broken)
    # the job being taken from the queue when the worker died is answered with the error
    with pytest.raises(EngineError, match="the engine thread died \\(RuntimeError: injected outside any step\\)"):
        svc.submit(job()).result(TIMEOUT)
    assert svc.submit(job()).result(TIMEOUT).text
    assert svc.stats["worker_deaths"] == 1


# ----------------------------------------------------------------------------- through the server


async def _server(engine_factory, options: dict):
    from dlm_lsp.server import DlmServer

    server = DlmServer(engine_factory)
    server.loop = asyncio.get_running_loop()
    server.apply_options(options, initial=True)
    server.start_engine()
    await asyncio.wait_for(server._ready.wait(), TIMEOUT)
    server.documents.open(URI, "python", 1, SRC)
    return server


async def _ask(server, limit: float = 5.0):
    """One fill request as the handler runs it; fails the test if it is not answered within `limit`."""
    from lsprotocol import types

    return await asyncio.wait_for(server.fill_at(URI, types.Position(LINE, COL)), limit)


async def test_server_answers_a_request_whose_step_never_ends_and_serves_the_next(folder, monkeypatch):
    fault = Fault(monkeypatch, block_forever, times=1)
    server = await _server(
        lambda m, d, on_state: EngineService(m, d, on_state, stall_s=1.0),
        {"model": str(folder), "postprocess": False, "budgetMs": 300},
    )
    try:
        t0 = time.monotonic()
        assert await _ask(server) is None  # budget + grace: empty, while the step still blocks
        assert time.monotonic() - t0 < 5
        assert server.stats.late == 1 and server.stats.empty == 1
        got = None
        end = time.monotonic() + TIMEOUT
        while got is None and time.monotonic() < end:  # until the watchdog has replaced the worker (~1 s)
            got = await _ask(server)
            if got is None:
                await asyncio.sleep(0.2)
        assert got is not None and got[0]
        assert server.engine.stats["stalls"] == 1
    finally:
        fault.release.set()
        server.engine.close()


async def test_server_engine_thread_death_fails_one_request_and_the_next_is_served(folder, monkeypatch):
    def act(fault):
        raise ThreadKiller("injected")

    Fault(monkeypatch, act, times=1)
    server = await _server(EngineService, {"model": str(folder), "postprocess": False, "budgetMs": 5000})
    try:
        assert await _ask(server) is None
        assert server.stats.errors == 1
        got = await _ask(server)
        assert got is not None and got[0]
        assert server.engine.stats["worker_deaths"] == 1
    finally:
        server.engine.close()


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), MemoryError()])
async def test_server_out_of_memory_fails_one_request_and_the_next_is_served(folder, monkeypatch, caplog, error):
    def act(fault):
        raise error

    Fault(monkeypatch, act, times=1)
    server = await _server(EngineService, {"model": str(folder), "postprocess": False, "budgetMs": 5000})
    try:
        with caplog.at_level(logging.WARNING):
            assert await _ask(server) is None
        assert any("out of memory" in r.getMessage() for r in caplog.records if r.name == "dlm.server")
        got = await _ask(server)
        assert got is not None and got[0]
        assert server.stats.errors == 1 and server.engine.stats["out_of_memory"] == 1
    finally:
        server.engine.close()


async def test_a_slow_engine_step_is_answered_at_the_deadline_and_counted_late():
    # the hang of issue 16: a step far longer than the budget (the deadline is checked between steps)
    async with lsp_server(FAKE_SERVER, {"model": scripted(steps=3, step_ms=20000), "budgetMs": 200}) as c:
        open_doc(c, URI, SRC)
        t0 = time.monotonic()
        assert await inline(c, URI, LINE, COL, timeout=5) == []
        assert time.monotonic() - t0 < 5
        s = await c.request("dlm/stats", {}, timeout=5)
        assert s["late"] == 1 and s["empty"] == 1 and s["requests"] == 1


async def test_a_job_that_never_finishes_is_answered_and_the_server_stays_up():
    async with lsp_server(FAKE_SERVER, {"model": scripted(hang=1), "budgetMs": 200}) as c:
        open_doc(c, URI, SRC)
        assert await inline(c, URI, LINE, COL, timeout=5) == []
        assert await inline(c, URI, LINE, COL, timeout=5) == []  # queued behind the stuck job: answered too
        s = await c.request("dlm/stats", {}, timeout=5)
        assert s["late"] == 2 and s["requests"] == 2


# ----------------------------------------------------------------------------- a broken model file


def _break(kind: str, src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    w = dst / "model.safetensors"
    raw = w.read_bytes()
    if kind == "truncated":
        w.write_bytes(raw[: len(raw) // 2])
    elif kind == "huge-header":
        w.write_bytes(struct.pack("<Q", 10 * 2**30) + raw[8:])
    elif kind == "pickle-only":
        w.unlink()
        (dst / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    elif kind == "missing":
        w.unlink()
    return dst


@pytest.mark.parametrize(
    "kind,match",
    [
        ("truncated", "model.safetensors is truncated"),
        ("huge-header", "over the 100 MB limit"),
        ("pickle-only", "only pickle weights \\(pytorch_model.bin\\)"),
        ("missing", "no model.safetensors in"),
    ],
)
async def test_a_broken_model_file_is_an_error_state_and_the_server_stays_up(folder, tmp_path, kind, match):
    import re

    broken = _break(kind, folder, tmp_path / kind)
    async with lsp_server(
        REAL_SERVER, {"model": str(broken), "budgetMs": 300}, wait_ready=False, log_path=tmp_path / "server.log"
    ) as c:
        st = await c.wait_notification("dlm/status", lambda p: p["state"] in ("ready", "error"), timeout=TIMEOUT)
        assert st["state"] == "error" and re.search(match, st["message"]) and str(broken) in st["message"]
        msg = await c.wait_notification("window/showMessage", lambda p: p["type"] == 1, timeout=10)
        assert re.search(match, msg["message"])
        open_doc(c, URI, SRC)
        assert await inline(c, URI, LINE, COL, timeout=10) == []
        s = await c.request("dlm/stats", {}, timeout=10)
        assert s["state"] == "error" and s["requests"] == 1
    log = (tmp_path / "server.log").read_text()
    assert re.search(match, log)
