"""Helpers for the end-to-end tests: start a real server process, talk LSP to it."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import urllib.parse
from pathlib import Path

from dlm_lsp.measure.replay import LspClient

REPO = Path(__file__).resolve().parent.parent
FAKE_SERVER = [sys.executable, str(REPO / "dlm_lsp" / "measure" / "fuzz" / "fake_server.py")]
REAL_SERVER = [sys.executable, "-m", "dlm_lsp", "serve"]
# The budget `lsp_server` sends unless the options name one: a first fill of a fresh server on a slow,
# busy machine (tree-sitter's first parse, a cold page cache, a CPU shared with other tests) can take
# longer than the 300 ms default, which answers it empty; tests of the budget and the deadline set
# their own. The tests' own waits are bounded by their timeouts, not by this.
TEST_BUDGET_MS = 60_000


def scripted(**kw) -> str:
    """The `model` option that selects the scripted engine's behaviour (dlm_lsp/measure/fuzz/scripted_engine.py)."""
    return "scripted:" + ",".join(f"{k}={urllib.parse.quote(str(v), safe='')}" for k, v in kw.items())


@contextlib.asynccontextmanager
async def lsp_server(
    cmd,
    options: dict | None = None,
    capabilities: dict | None = None,
    log_path=None,
    wait_ready: bool = True,
    config: dict | None = None,
    ready_timeout: float = 120,
    root: str | None = None,
):
    """Yields an initialized LspClient talking to `cmd`; stops the server afterwards. Options without
    a budgetMs get TEST_BUDGET_MS."""
    if options is not None and "budgetMs" not in options:
        options = {**options, "budgetMs": TEST_BUDGET_MS}
    log = open(log_path, "wb") if log_path else None
    client = LspClient(cmd, cwd=str(REPO), stderr=log, config=config)
    await client.start()
    try:
        client.init_result = await client.initialize(options, capabilities, root=root)
        if wait_ready:
            await client.wait_ready(ready_timeout)
        yield client
    finally:
        await client.stop()
        if log:
            log.close()


def open_doc(client: LspClient, uri: str, text: str, lang: str = "python", version: int = 1) -> None:
    client.notify(
        "textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": lang, "version": version, "text": text}}
    )


def insert(client: LspClient, uri: str, version: int, line: int, char: int, text: str) -> None:
    client.notify(
        "textDocument/didChange",
        {
            "textDocument": {"uri": uri, "version": version},
            "contentChanges": [
                {
                    "range": {"start": {"line": line, "character": char}, "end": {"line": line, "character": char}},
                    "text": text,
                }
            ],
        },
    )


def inline_params(uri: str, line: int, char: int) -> dict:
    return {"textDocument": {"uri": uri}, "position": {"line": line, "character": char}, "context": {"triggerKind": 2}}


async def inline(client: LspClient, uri: str, line: int, char: int, timeout: float = 30):
    """Returns the items of a textDocument/inlineCompletion answer."""
    res = await client.request("textDocument/inlineCompletion", inline_params(uri, line, char), timeout=timeout)
    return res["items"] if isinstance(res, dict) else (res or [])


async def until(condition, timeout: float = 60, what: str = "a condition"):
    """Awaits the first truthy value of `condition()` (a function or a coroutine function), checked
    again every few ms; fails after `timeout` seconds, naming `what`. A wait for an event, whatever
    the machine's speed: the timeout only ends a wait that would never end."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"waited {timeout} s for {what}")
        await asyncio.sleep(0.005)


async def until_stats(client: LspClient, pred, timeout: float = 60, what: str = "dlm/stats"):
    """The server's first `dlm/stats` answer for which `pred(stats)` holds (see `until`)."""

    async def check():
        s = await client.request("dlm/stats", {}, timeout=timeout)
        return s if pred(s) else None

    return await until(check, timeout, what)
