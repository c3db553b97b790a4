"""The engine started with the server process (dlm_lsp/engines.py, started by dlm_lsp/engines.py): with DLM_LSP_PRESTART the engine
the hint picks is made before the client's initialize and adopted when the options pick the same one;
other options close it and start theirs; a hint that fails to start changes nothing the user sees;
no hint or a bad one starts nothing early. The scripted engine tells which engine of the process
filled ("engine N of M, C closed"); a test waits for the server's log to say the hinted engine exists
before it sends initialize, so "made before initialize" is an order, not a timing."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from dlm_lsp import engines
from dlm_lsp.measure.replay import LspClient
from dlm_lsp.options import InitializationOptions
from engine.serve import daemon as engine_daemon
from tests.lsp_helpers import FAKE_SERVER, REAL_SERVER, TEST_BUDGET_MS, inline, open_doc, scripted
from tests.tiny import make_tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120
SRC = "import os\n\n\ndef total(items):\n    s = 0\n    for x in items:\n        \n    return s\n"
URI = "file:///tmp/prestart_doc.py"


async def _wait_log(path: Path, needle: str, timeout: float = TIMEOUT) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = path.read_text(errors="replace") if path.exists() else ""
        if needle in text:
            return text
        await asyncio.sleep(0.02)
    raise AssertionError(f"the server's log never said {needle!r}:\n{path.read_text(errors='replace')[-3000:]}")


async def _session(
    tmp_path: Path, hint: object, options: dict, wait_made: str | None = None, cmd=FAKE_SERVER, env=None
):
    """(client, log path): a started server with DLM_LSP_PRESTART=hint (unset when None), initialized
    with `options` (a budgetMs of TEST_BUDGET_MS unless they name one: the first fill of a fresh server
    on a busy machine may take longer than the 300 ms default) once the log says `wait_made` (when given)."""
    options = {"budgetMs": TEST_BUDGET_MS, **options}
    env = dict(env or os.environ)
    env.pop(engines.PRESTART_ENV, None)
    if hint is not None:
        env[engines.PRESTART_ENV] = hint if isinstance(hint, str) else json.dumps(hint)
    log_path = tmp_path / "server.log"
    log = open(log_path, "wb")
    c = LspClient(cmd, env=env, cwd=str(REPO), stderr=log)
    c.log_file = log  # type: ignore[attr-defined]
    await c.start()
    if wait_made:
        await _wait_log(log_path, wait_made)
    await c.initialize(options)
    return c, log_path


async def _stop(c: LspClient) -> None:
    await c.stop()
    c.log_file.close()  # type: ignore[attr-defined]


async def _fill(c: LspClient) -> str:
    await c.wait_ready(TIMEOUT)
    open_doc(c, URI, SRC)
    items = await inline(c, URI, 6, 8, timeout=TIMEOUT)
    assert items, "no fill"
    return items[0]["insertText"].strip()


async def _filled(tmp_path: Path, hint: object, options: dict, wait_made: str | None = None) -> tuple[str, str]:
    """(the first fill's text, the server's log) of a _session, stopped after."""
    c, log = await _session(tmp_path, hint, options, wait_made=wait_made)
    try:
        return await _fill(c), log.read_text()
    finally:
        await _stop(c)


async def test_the_hinted_engine_is_made_before_initialize_and_adopted(tmp_path):
    opts = {"model": scripted(made=1, load_ms=300), "postprocess": False}
    text, log = await _filled(tmp_path, opts, opts, wait_made="scripted engine 1 made")
    assert text.startswith("engine 1 of 1, 0 closed"), text
    assert "adopted the engine started with the process" in log


async def test_options_that_pick_another_engine_close_the_hinted_one(tmp_path):
    hint = {"model": scripted(made=1, text="hinted")}
    opts = {"model": scripted(made=1), "postprocess": False}
    text, log = await _filled(tmp_path, hint, opts, wait_made="scripted engine 1 made")
    assert text.startswith("engine 2 of 2, 1 closed"), text
    assert "adopted" not in log


@pytest.mark.parametrize(
    "hint",
    [None, "{not json", "[1, 2]", {"engine": {"url": "http://127.0.0.1:9/v1", "api": "openai-fim"}}],
    ids=["none", "not-json", "not-an-object", "http-endpoint"],
)
async def test_without_a_usable_hint_the_engine_starts_at_initialized(tmp_path, hint):
    text, log = await _filled(tmp_path, hint, {"model": scripted(made=1), "postprocess": False})
    assert text.startswith("engine 1 of 1, 0 closed"), text
    assert "starting the engine early" not in log


async def test_a_hinted_engine_that_fails_to_start_is_reported_as_without_a_hint(tmp_path):
    opts = {"model": scripted(broken=1)}
    c, log = await _session(tmp_path, opts, opts, wait_made="the engine did not start early")
    try:
        st = await c.wait_notification("dlm/status", lambda p: p.get("state") in ("ready", "error"), TIMEOUT)
        assert st["state"] == "error" and "scripted broken model" in st["message"], st
        open_doc(c, URI, SRC)
        assert await inline(c, URI, 6, 8, timeout=TIMEOUT) == []  # answered, empty
        assert (await c.request("dlm/stats", {}, timeout=TIMEOUT))["state"] == "error"
    finally:
        await _stop(c)


async def test_a_request_while_the_hinted_engine_loads_waits_for_it(tmp_path):
    """A fill asked before the adopted engine is ready waits for it within the budget, as with an
    engine started at initialized."""
    opts = {"model": scripted(made=1, load_ms=600), "postprocess": False, "budgetMs": 20000}
    c, _ = await _session(tmp_path, opts, opts)
    try:
        open_doc(c, URI, SRC)
        items = await inline(c, URI, 6, 8, timeout=TIMEOUT)
        assert items and items[0]["insertText"].strip().startswith("engine 1 of 1"), items
    finally:
        await _stop(c)


# -------------------------------------------------------------------------------- the pieces


def test_machine_key_is_what_picks_the_engine(monkeypatch):
    monkeypatch.delenv("DLM_ENGINE", raising=False)
    base = InitializationOptions()
    assert engines.machine_key(base) == (None, "auto", None, "shared")
    assert engines.machine_key(InitializationOptions(budget_ms=900, languages=["go"])) == engines.machine_key(base)
    assert engines.machine_key(InitializationOptions(model="m", device="cpu", threads=2, engine="inproc")) == (
        "m",
        "cpu",
        2,
        "inproc",
    )
    monkeypatch.setenv("DLM_ENGINE", "inproc")
    assert engines.machine_key(base)[3] == "inproc"
    assert engines.machine_key(InitializationOptions(engine={"url": "http://127.0.0.1:1"})) is None


def test_hinted_options_parse_as_initialize_does():
    env = {engines.PRESTART_ENV: json.dumps({"model": "m", "device": "cpu", "threads": 0, "budgetMs": 5})}
    opts = engines.hinted_options(env)
    assert opts is not None and (opts.model, opts.device, opts.threads) == ("m", "cpu", None)  # bad values: defaults
    assert engines.hinted_options({}) is None
    assert engines.hinted_options({engines.PRESTART_ENV: "nope"}) is None


class _Engine:
    def __init__(self, on_state, gate: threading.Event | None = None):
        self.on_state, self.gate, self.closed = on_state, gate, 0

    def start(self):
        if self.gate is not None:
            self.gate.wait(10)
        self.on_state("loading", {"model": "m"})
        return self

    def close(self):
        self.closed += 1


def test_an_early_engine_passes_its_last_state_and_then_each_new_one():
    made: list[_Engine] = []

    def make(on_state):
        made.append(_Engine(on_state))
        return made[-1]

    early = engines.EarlyEngine(("m", "cpu", None, "inproc"), make)
    assert early.made.wait(10)
    got: list[tuple[str, dict]] = []
    engine, last = early.attach(lambda s, i: got.append((s, i)))
    assert engine is made[0] and last == ("loading", {"model": "m"})
    made[0].on_state("ready", {"model": "m"})
    assert got == [("ready", {"model": "m"})]


def test_an_early_engine_closed_while_it_is_being_made_is_closed_once_made():
    gate = threading.Event()
    made: list[_Engine] = []

    def make(on_state):
        made.append(_Engine(on_state, gate))
        return made[-1]

    early = engines.EarlyEngine(("m", "cpu", None, "inproc"), make)
    early.close()  # never blocks on the making
    gate.set()
    assert early.made.wait(10)
    assert made[0].closed == 1
    assert early.attach(lambda s, i: None) == (None, None)


@pytest.mark.parametrize(
    "environ, imports",
    [
        ({}, False),
        ({"DLM_ENGINE": "inproc"}, True),
        ({"DLM_ENGINE": "shared", engines.PRESTART_ENV: '{"engine": "inproc"}'}, True),
        ({"DLM_ENGINE": "inproc", engines.PRESTART_ENV: '{"engine": "shared"}'}, False),
        ({engines.PRESTART_ENV: '{"engine": {"url": "http://127.0.0.1:9/v1"}}'}, False),
    ],
)
def test_an_inproc_engines_imports_start_first_and_once(monkeypatch, environ, imports):
    started: list[str] = []
    monkeypatch.setattr(engines, "_warming", [])
    monkeypatch.setattr(engines, "_import_engine", lambda: started.append("imports"))
    engines.warm_imports(environ)
    engines.warm_imports(environ)  # once per process
    for t in engines._warming:
        t.join(10)
    assert started == (["imports"] if imports else [])


def test_without_a_hint_no_engine_is_made_early(monkeypatch):
    monkeypatch.setattr(engines, "_warming", [])
    monkeypatch.setattr(engines, "_import_engine", lambda: None)

    def factory(*a, **kw):
        raise AssertionError("no engine without a hint")

    assert engines.prestart(factory, {"DLM_ENGINE": "inproc"}) is None
    assert engines.prestart(factory, {}) is None


# -------------------------------------------------------------------------------- real engines


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("prestart") / "tiny", printable=True))


async def test_a_real_inproc_engine_is_loaded_from_the_hint(tmp_path, tiny):
    opts = {"model": tiny, "device": "cpu", "engine": "inproc", "postprocess": False}
    c, log = await _session(tmp_path, opts, opts, cmd=REAL_SERVER)
    try:
        await c.wait_ready(TIMEOUT)
        open_doc(c, URI, SRC)
        assert await inline(c, URI, 6, 8, timeout=TIMEOUT)
        text = log.read_text()
        assert "starting the engine early" in text and "adopted the engine started with the process" in text, text
    finally:
        await _stop(c)


async def test_the_shared_engine_is_started_before_initialize(tmp_path, tiny, monkeypatch):
    """With the hint, the serve starts (or finds) the user's shared engine at once: the daemon answers
    its status before the client has sent initialize; the serve then fills through it."""
    runtime = Path(tempfile.mkdtemp(prefix="dlmrt-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("DLM_ENGINE_IDLE_S", "60")
    env = dict(os.environ, DLM_ENGINE="shared")
    opts = {"model": tiny, "device": "cpu", "postprocess": False, "budgetMs": TEST_BUDGET_MS}
    c = None
    try:
        first_log = open(tmp_path / "first.log", "wb")
        c = LspClient(
            REAL_SERVER, env=dict(env, **{engines.PRESTART_ENV: json.dumps(opts)}), cwd=str(REPO), stderr=first_log
        )
        await c.start()
        end = time.monotonic() + TIMEOUT
        while not engine_daemon.ask_all("status"):
            assert time.monotonic() < end, "no shared engine started before initialize"
            await asyncio.sleep(0.05)
        await c.initialize(opts)
        await c.wait_ready(TIMEOUT)
        open_doc(c, URI, SRC)
        assert await inline(c, URI, 6, 8, timeout=TIMEOUT)
        assert len(engine_daemon.ask_all("status")) == 1  # adopted: no second daemon or connection made
        await c.stop()
        # with the engine running, a new serve connects at initialized (milliseconds) instead of early
        log = open(tmp_path / "second.log", "wb")
        c = LspClient(REAL_SERVER, env=dict(env, **{engines.PRESTART_ENV: json.dumps(opts)}), cwd=str(REPO), stderr=log)
        await c.start()
        await c.initialize(opts)
        await c.wait_ready(TIMEOUT)
        open_doc(c, URI, SRC)
        assert await inline(c, URI, 6, 8, timeout=TIMEOUT)
        log.close()
        text = (tmp_path / "second.log").read_text()
        assert "runs: connecting at initialized" in text and "starting the engine early" not in text, text
    finally:
        if c is not None:
            await c.stop()
        for st in engine_daemon.ask_all("status"):
            try:
                os.kill(st["pid"], 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(runtime, ignore_errors=True)


async def test_nothing_reaches_stderr_before_the_initialize_answer(tmp_path, tiny, monkeypatch):
    """eglot 1.9 (Emacs 28) stops waiting for the initialize answer when the server's stderr gets a
    line first, and the engine started early logs as it starts (here it starts the shared engine,
    which answers its status before initialize is sent): those lines are held until initialized,
    then written (dlm_lsp.engines.hold_logs)."""
    runtime = Path(tempfile.mkdtemp(prefix="dlmrt-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("DLM_ENGINE_IDLE_S", "60")
    opts = {"model": tiny, "device": "cpu", "postprocess": False}
    env = dict(os.environ, DLM_ENGINE="shared", **{engines.PRESTART_ENV: json.dumps(opts)})
    log_path = tmp_path / "serve.log"
    log = open(log_path, "wb")
    c = LspClient(REAL_SERVER, env=env, cwd=str(REPO), stderr=log)
    try:
        await c.start()
        end = time.monotonic() + TIMEOUT
        while not engine_daemon.ask_all("status"):  # started (and logged so) by the serve
            assert time.monotonic() < end, "no shared engine started before initialize"
            await asyncio.sleep(0.05)
        caps = {"textDocument": {"inlineCompletion": {}}}
        params = {"processId": os.getpid(), "rootUri": None, "capabilities": caps, "initializationOptions": opts}
        assert (await c.request("initialize", params, timeout=TIMEOUT))["capabilities"]
        assert log_path.read_bytes() == b"", log_path.read_text()
        c.notify("initialized", {})
        await c.wait_ready(TIMEOUT)
        text = await _wait_log(log_path, "adopted the engine started with the process")
        assert "starting the engine early" in text and "started the shared engine" in text, text
        assert text.index("started the shared engine") < text.index("adopted"), text  # held, then in order
    finally:
        await c.stop()
        log.close()
        for st in engine_daemon.ask_all("status"):
            try:
                os.kill(st["pid"], 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(runtime, ignore_errors=True)
