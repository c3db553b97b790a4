"""The server as a real process over stdio.

Most tests run dlm_lsp/measure/fuzz/fake_server.py - the real server with a scripted engine whose step time,
step count and text are exact, so scheduling (latest-wins, cancel, stale versions, typing-through)
can be asserted. The last tests run `python -m dlm_lsp serve` with the default model.
"""

import asyncio
import contextlib
import json
import os
import subprocess
import sys

import pytest

from dlm_lsp.measure.replay import LspError
from tests.lsp_helpers import (
    FAKE_SERVER,
    REAL_SERVER,
    REPO,
    TEST_BUDGET_MS,
    inline,
    inline_params,
    insert,
    lsp_server,
    open_doc,
    scripted,
    until,
    until_stats,
)

URI = "file:///tmp/dlm-e2e/a.py"
SRC = "import os\n\n\ndef total(items):\n    s = 0\n    for x in items:\n        \n    return s\n"
LINE, COL = 6, 8  # the empty line in the loop body: a block hole
TEST_MODEL = os.environ.get("DLM_LSP_TEST_MODEL")  # None: the default model in models/default


async def stats(client):
    return await client.request("dlm/stats", {}, timeout=10)


# ----------------------------------------------------------------------------- protocol basics


async def test_capabilities_and_status():
    async with lsp_server(FAKE_SERVER, {"model": scripted()}) as c:
        caps = c.init_result["capabilities"]
        assert caps["inlineCompletionProvider"] is not None
        assert "completionProvider" in caps
        assert caps["textDocumentSync"]["change"] == 2  # incremental
        st = await c.wait_notification("dlm/status", lambda p: p["state"] == "ready")
        assert set(st) == {"state", "model", "device", "lastLatencyMs", "message"}
        open_doc(c, URI, SRC)
        items = await inline(c, URI, LINE, COL)
        assert items[0]["insertText"] == "x = 1"
        # a status after the fill carries its latency
        st = await c.wait_notification("dlm/status", lambda p: p["lastLatencyMs"] is not None)
        assert st["lastLatencyMs"] > 0


@pytest.mark.parametrize("encoding,col", [("utf-16", 11), ("utf-8", 14)])
async def test_fill_range_and_negotiated_positions(encoding, col):
    # the scripted engine echoes the prefix's tail: the server must have cut the text at the cursor,
    # counting columns in the encoding it negotiated (Neovim offers UTF-8 first)
    caps = {"general": {"positionEncodings": [encoding]}, "textDocument": {"inlineCompletion": {}}}
    async with lsp_server(FAKE_SERVER, {"model": scripted(echo=6), "postprocess": False}, capabilities=caps) as c:
        assert c.init_result["capabilities"]["positionEncoding"] == encoding
        open_doc(c, URI, "s = '😀é' + x\n")
        assert col == len("s = '😀é' +".encode(encoding + ("-le" if encoding == "utf-16" else ""))) // (
            2 if encoding == "utf-16" else 1
        )
        items = await inline(c, URI, 0, col)
        assert items[0]["insertText"] == "'😀é' +"
        assert items[0]["range"] == {"start": {"line": 0, "character": col}, "end": {"line": 0, "character": col}}


async def test_replace_range_over_auto_closed_bracket():
    async with lsp_server(FAKE_SERVER, {"model": scripted(text="items, 2)")}) as c:
        open_doc(c, URI, "print(max())\n")
        items = await inline(c, URI, 0, 10)  # between the inner "(" and ")"
        assert items[0]["insertText"] == "items, 2)"
        assert items[0]["range"] == {"start": {"line": 0, "character": 10}, "end": {"line": 0, "character": 11}}


async def test_completion_fallback_item():
    async with lsp_server(FAKE_SERVER, {"model": scripted(text="total = 0\n    return total")}) as c:
        open_doc(c, URI, "def f():\n    \n")
        res = await c.request("textDocument/completion", inline_params(URI, 1, 4))
        assert res["isIncomplete"] is True
        item = res["items"][0]
        assert item["textEdit"]["newText"] == "total = 0\n    return total"
        assert item["textEdit"]["range"]["start"] == {"line": 1, "character": 4}


# ----------------------------------------------------------------------------- scheduling


async def test_latest_wins_without_client_cancel(tmp_path):
    # the first job is held (it would never end by itself): the first request must be answered when
    # the second one supersedes it, and its job stopped, before any job is let end
    hold, opts = _held(tmp_path, steps=4, step_ms=1, text="s += 1")
    async with lsp_server(FAKE_SERVER, opts) as c:
        open_doc(c, URI, SRC)
        _, first = c.send_request("textDocument/inlineCompletion", inline_params(URI, 4, 9))
        await until(lambda: (hold / "started-1").exists(), what="the first job's start")
        _, second = c.send_request("textDocument/inlineCompletion", inline_params(URI, LINE, COL))
        r1 = await asyncio.wait_for(first, 60)
        assert r1["items"] == []  # answered when superseded: its job was still held
        s = await until_stats(c, lambda s: s["engineJobs"] == 1, what="the first job to stop")
        assert 1 <= s["wastedSteps"] == s["engineSteps"] <= 4  # stopped by the cancel, never released
        assert not second.done()  # the second job is held too
        (hold / "release").touch()
        r2 = await asyncio.wait_for(second, 60)
        assert r2["items"][0]["insertText"] == "s += 1"
        s = await stats(c)
        assert s["cancelled"] == 1 and s["answered"] == 1 and s["requests"] == 2
        assert s["engineJobs"] == 2
        assert s["engineSteps"] == s["wastedSteps"] + 4


async def test_cancel_request_stops_the_job(tmp_path):
    hold, opts = _held(tmp_path, steps=4, step_ms=1)
    async with lsp_server(FAKE_SERVER, opts) as c:
        open_doc(c, URI, SRC)
        msg_id, fut = c.send_request("textDocument/inlineCompletion", inline_params(URI, LINE, COL))
        await until(lambda: (hold / "started-1").exists(), what="the job's start")
        c.cancel(msg_id)
        with pytest.raises(LspError) as err:
            await asyncio.wait_for(fut, 60)
        assert err.value.code == -32800  # RequestCancelled
        # the held job ends only when the cancel reaches it (after the server's grace for typing along)
        s = await until_stats(c, lambda s: s["engineJobs"] == 1, what="the job to stop")
        assert s["cancelled"] == 1
        assert 1 <= s["wastedSteps"] == s["engineSteps"] <= 4
        # the server is fine afterwards
        (hold / "release").touch()
        assert (await inline(c, URI, LINE, COL))[0]["insertText"] == "x = 1"


async def test_same_cursor_twice_shares_one_job():
    async with lsp_server(FAKE_SERVER, {"model": scripted(steps=10, step_ms=20, text="s += 1"), "budgetMs": 5000}) as c:
        open_doc(c, URI, SRC)
        futs = [c.send_request("textDocument/inlineCompletion", inline_params(URI, LINE, COL))[1] for _ in range(2)]
        r1, r2 = await asyncio.wait_for(asyncio.gather(*futs), 5)
        assert r1["items"][0]["insertText"] == r2["items"][0]["insertText"] == "s += 1"
        assert (await stats(c))["engineJobs"] == 1


async def _type_along(c, hold, cancel: bool, burst: bool = False):
    """Asks at the cursor, then types "s +" while that request's job runs, asking after each
    keystroke (and with `cancel`, cancelling the previous request first, like VS Code); lets the job
    end once the server has begun all four requests. The scripted engine holds the job (its `hold`
    folder), so the keystrokes land while it runs however slow the machine. Each keystroke waits for
    the server to begin the previous request (its dlm/stats), one request at a time; with `burst` the
    three keystrokes and their requests go in one write instead, read by the server at once (a busy
    server behind a fast typist). Returns the first and the last request's futures."""
    open_doc(c, URI, SRC)
    prev_id, first = c.send_request("textDocument/inlineCompletion", inline_params(URI, LINE, COL))
    await until(lambda: (hold / "started-1").exists(), what="the first job's start")
    with c.corked() if burst else contextlib.nullcontext():
        for v, ch in enumerate("s +", start=2):
            insert(c, URI, v, LINE, COL + v - 2, ch)
            if cancel:
                c.cancel(prev_id)
            prev_id, last = c.send_request("textDocument/inlineCompletion", inline_params(URI, LINE, COL + v - 1))
            if not burst:
                await until_stats(c, lambda s, n=v: s["requests"] == n, what=f"the server to begin request {v}")
    await until_stats(c, lambda s: s["requests"] == 4, what="the server to begin the four requests")
    (hold / "release-1").touch()
    return first, last


def _held(tmp_path, **kw):
    hold = tmp_path / "hold"
    hold.mkdir()
    return hold, {"model": scripted(hold=str(hold), **kw), "budgetMs": 60_000}


async def test_typing_along_a_running_job_reuses_its_fill(tmp_path):
    # the user types "s +" while the job runs: no new job, the rest of the fill is served
    hold, opts = _held(tmp_path, steps=10, step_ms=5, text="s += x")
    async with lsp_server(FAKE_SERVER, opts) as c:
        first, last = await _type_along(c, hold, cancel=False)
        assert (await asyncio.wait_for(first, 60))["items"] == []  # its version is gone
        res = await asyncio.wait_for(last, 60)
        assert res["items"][0]["insertText"] == "= x"
        s = await stats(c)
        assert s["engineJobs"] == 1 and s["typedAlong"] == 1 and s["wastedSteps"] == 0


async def test_typing_along_survives_the_client_cancel_of_each_keystroke(tmp_path):
    # like VS Code: every keystroke sends didChange, cancels the previous request, asks again
    hold, opts = _held(tmp_path, steps=10, step_ms=5, text="s += x")
    async with lsp_server(FAKE_SERVER, opts) as c:
        first, last = await _type_along(c, hold, cancel=True)
        with pytest.raises(LspError) as err:
            await asyncio.wait_for(first, 60)
        assert err.value.code == -32800
        res = await asyncio.wait_for(last, 60)
        assert res["items"][0]["insertText"] == "= x"  # the first job's fill, typed through
        s = await stats(c)
        assert s["engineJobs"] == 1 and s["typedAlong"] == 1 and s["wastedSteps"] == 0
        assert s["cancelled"] == 3 and s["typedThrough"] == 1


async def test_a_burst_of_keystrokes_read_at_once_still_types_along_the_job(tmp_path):
    # the requests of the first two keystrokes are read before the later keystrokes' changes reach
    # the server: they are stale on arrival (answered empty, counted stale) and must not supersede the
    # job the user is typing along; the last request is served from its fill
    hold, opts = _held(tmp_path, steps=10, step_ms=5, text="s += x")
    async with lsp_server(FAKE_SERVER, opts) as c:
        first, last = await _type_along(c, hold, cancel=False, burst=True)
        assert (await asyncio.wait_for(first, 60))["items"] == []
        res = await asyncio.wait_for(last, 60)
        assert res["items"][0]["insertText"] == "= x"
        s = await stats(c)
        assert s["engineJobs"] == 1 and s["typedAlong"] == 1 and s["wastedSteps"] == 0
        assert s["stale"] == 3 and s["typedThrough"] == 1  # the first (its version is gone) and the two read early


async def test_stale_version_is_never_returned(tmp_path):
    hold, opts = _held(tmp_path, text="STALE")
    async with lsp_server(FAKE_SERVER, opts) as c:
        open_doc(c, URI, SRC)
        _, fut = c.send_request("textDocument/inlineCompletion", inline_params(URI, LINE, COL))
        await until(lambda: (hold / "started-1").exists(), what="the job's start")
        insert(c, URI, 2, LINE, COL, "pass")
        await stats(c)  # answered after the change above was applied
        (hold / "release-1").touch()
        res = await asyncio.wait_for(fut, 60)
        assert res["items"] == []
        s = await stats(c)
        assert s["answered"] == 0 and s["cancelled"] + s["stale"] == 1


async def test_typing_through_needs_no_engine():
    async with lsp_server(FAKE_SERVER, {"model": scripted(text="sum(items)")}) as c:
        open_doc(c, URI, "def f(items):\n    return \n")
        items = await inline(c, URI, 1, 11)
        assert items[0]["insertText"] == "sum(items)"
        insert(c, URI, 2, 1, 11, "s")
        items = await inline(c, URI, 1, 12)
        assert items[0]["insertText"] == "um(items)"
        assert items[0]["range"]["start"] == {"line": 1, "character": 12}
        insert(c, URI, 3, 1, 12, "um(")
        items = await inline(c, URI, 1, 15)
        assert items[0]["insertText"] == "items)"
        s = await stats(c)
        assert s["typedThrough"] == 2 and s["engineJobs"] == 1
        # typing something else goes back to the engine
        insert(c, URI, 4, 1, 15, "z")
        await inline(c, URI, 1, 16)
        s = await stats(c)
        assert s["typedThrough"] == 2 and s["engineJobs"] == 2


async def test_two_spellings_of_one_uri_share_the_typing_through_memory():
    spelled = "file:///tmp/dlm-e2e/%61.py"  # %61 is "a": the same document as URI
    async with lsp_server(FAKE_SERVER, {"model": scripted(text="sum(items)")}) as c:
        open_doc(c, URI, "def f(items):\n    return \n")
        assert (await inline(c, URI, 1, 11))[0]["insertText"] == "sum(items)"
        insert(c, spelled, 2, 1, 11, "s")
        assert (await inline(c, spelled, 1, 12))[0]["insertText"] == "um(items)"
        s = await stats(c)
        assert s["typedThrough"] == 1 and s["engineJobs"] == 1


async def test_a_document_with_a_lone_surrogate_still_gets_checked_fills():
    async with lsp_server(FAKE_SERVER, {"model": scripted(text="s += x")}) as c:
        open_doc(c, URI, SRC.replace("import os", "import os  # \ud800 \r"))
        items = await inline(c, URI, LINE, COL)
        assert [i["insertText"] for i in items] == ["s += x"]  # the syntax check ran on the region
        s = await stats(c)
        assert s["errors"] == 0


async def test_debounce_drops_requests_superseded_while_waiting():
    async with lsp_server(FAKE_SERVER, {"model": scripted(), "debounceMs": 300}) as c:
        open_doc(c, URI, SRC)
        futs = [c.send_request("textDocument/inlineCompletion", inline_params(URI, LINE, COL))[1] for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*futs), 5)
        assert [len(r["items"]) for r in results] == [0, 0, 1]
        assert (await stats(c))["engineJobs"] == 1  # only the last one reached the engine


# ----------------------------------------------------------------------------- robustness


async def test_malformed_params_get_an_error_and_the_server_lives():
    async with lsp_server(FAKE_SERVER, {"model": scripted()}) as c:
        open_doc(c, URI, SRC)
        with pytest.raises(LspError) as err:
            await c.request("textDocument/inlineCompletion", {"textDocument": 5}, timeout=5)
        assert err.value.code == -32602
        with pytest.raises(LspError):
            await c.request("textDocument/inlineCompletion", {"position": {"line": "x"}}, timeout=5)
        c.write_raw(b'{"jsonrpc": "2.0", "id": 999, "method": "textDocument/inlineCompletion", "params": [}')
        c.notify("textDocument/didChange", {"textDocument": {"uri": 3}})  # a broken notification
        # unknown document and far-away positions are answered, not errors
        assert await inline(c, "file:///nowhere.py", 0, 0) == []
        assert len(await inline(c, URI, 999, 999)) == 1
        assert (await inline(c, URI, LINE, COL))[0]["insertText"] == "x = 1"


async def test_engine_errors_answer_empty():
    async with lsp_server(FAKE_SERVER, {"model": scripted(fail=1)}) as c:
        open_doc(c, URI, SRC)
        assert await inline(c, URI, LINE, COL) == []
        s = await stats(c)
        assert s["errors"] == 1


async def test_the_models_own_gate_applies_unless_the_user_sets_min_confidence():
    low = scripted(text="total += x", confidence=0.3, gate=0.5)
    async with lsp_server(FAKE_SERVER, {"model": low}) as c:
        open_doc(c, URI, SRC)
        assert await inline(c, URI, LINE, COL) == []  # 0.3 < the model's 0.5
    async with lsp_server(FAKE_SERVER, {"model": low, "minConfidence": 0.2}) as c:
        open_doc(c, URI, SRC)
        assert [i["insertText"] for i in await inline(c, URI, LINE, COL)] == ["total += x"]
    async with lsp_server(FAKE_SERVER, {"model": scripted(text="total += x", confidence=0.8, gate=0.5)}) as c:
        open_doc(c, URI, SRC)
        assert [i["insertText"] for i in await inline(c, URI, LINE, COL)] == ["total += x"]


def test_serving_defaults_are_read_and_checked(tmp_path):
    from engine.weights.checkpoint import serving_defaults

    assert serving_defaults(tmp_path) == {}
    (tmp_path / "serving.json").write_text('{"min_confidence": 0.4, "chosen_by": "curve"}')
    assert serving_defaults(tmp_path) == {"min_confidence": 0.4}
    for bad in ('{"min_confidence": 1.5}', '{"min_confidence": true}', "[0.4]", "not json"):
        (tmp_path / "serving.json").write_text(bad)
        assert serving_defaults(tmp_path) == {}
    # the shipped model's own settings are all read: its gate (0.0 since session 14: the stop when unsure
    # does the gating, docs/MODEL.md), the stop, and the calibrator the gate reads
    shipped = serving_defaults(REPO / "models" / "default")
    assert "min_confidence" in shipped and shipped["decode"]["stop_below"] > 0 and "calibrator" in shipped
    # decoding the model was tuned with: known keys in range only
    (tmp_path / "serving.json").write_text(
        '{"decode": {"copy_bigram": 2.0, "copy_order": 3, "copy_unigram": -1, "window": 0, "threshold": 0.1}}'
    )
    assert serving_defaults(tmp_path) == {"decode": {"copy_bigram": 2.0, "copy_order": 3}}
    (tmp_path / "serving.json").write_text('{"decode": {"copy_order": 3.5, "copy_bigram": true}}')
    assert serving_defaults(tmp_path) == {}


def test_model_decode_defaults_fill_only_what_the_job_left_unset(tmp_path):
    from engine.api import DecodeOptions, FillJob, with_model_defaults
    from engine.serve.service import EngineService
    from tests.tiny import make_tiny_checkpoint

    tuned = {"copy_bigram": 2.0, "copy_order": 3}
    o = with_model_defaults(DecodeOptions(), tuned)
    assert (o.copy_bigram, o.copy_order, o.copy_unigram) == (2.0, 3, 0.0)
    o = with_model_defaults(DecodeOptions(copy_bigram=0.0), tuned)  # an explicit 0 turns it off
    assert (o.copy_bigram, o.copy_order) == (0.0, 3)
    assert with_model_defaults(DecodeOptions(), {}).copy_bigram == 0.0
    # the engine decodes a job with the model's setting: the same fill as asking for it explicitly
    folder = make_tiny_checkpoint(tmp_path / "m")
    prefix = "def area(width, height):\n    return width * height\n\nprint(area(wid"
    svc = EngineService(str(folder), device="cpu", threads=1)
    svc.load()
    plain = svc.run_now(FillJob(prefix=prefix, max_tokens=8))
    explicit = svc.run_now(FillJob(prefix=prefix, max_tokens=8, options=DecodeOptions(copy_bigram=6.0, copy_order=3)))
    (folder / "serving.json").write_text('{"decode": {"copy_bigram": 6.0, "copy_order": 3}}')
    tuned = EngineService(str(folder), device="cpu", threads=1)
    tuned.load()  # reads serving.json
    tuned_fill = tuned.run_now(FillJob(prefix=prefix, max_tokens=8))
    off = tuned.run_now(FillJob(prefix=prefix, max_tokens=8, options=DecodeOptions(copy_bigram=0.0)))
    assert tuned.serving["decode"] == {"copy_bigram": 6.0, "copy_order": 3}
    assert tuned_fill.text == explicit.text and off.text == plain.text
    assert explicit.text != plain.text  # the boost changes this fill (else the test proves nothing)


async def test_bad_options_warn_and_fall_back():
    async with lsp_server(
        FAKE_SERVER, {"model": scripted(), "budgetMs": -3, "languages": "python", "maxFillTokens": 0}
    ) as c:
        msgs = []
        for key in ("budgetMs", "languages", "maxFillTokens"):
            msgs.append(await c.wait_notification("window/showMessage", lambda p, k=key: k in p["message"], timeout=5))
        assert all(m["type"] == 2 for m in msgs)  # Warning
        assert "using 300" in msgs[0]["message"]
        # the fallen-back defaults (languages, maxFillTokens) still fill; the budget is raised through
        # settings so that a slow machine's first fill is not cut by the 300 ms default (issue 44)
        c.notify("workspace/didChangeConfiguration", {"settings": {"dlm": {"budgetMs": TEST_BUDGET_MS}}})
        open_doc(c, URI, SRC)
        assert len(await inline(c, URI, LINE, COL)) == 1


async def test_configuration_change_applies_without_restarting_the_engine():
    """Settings a workspace may change apply to the next fill; none restarts the engine (what does,
    model, device, engine, threads, comes from initializationOptions only: the test below)."""
    opts = {"model": scripted(tell="max_tokens"), "device": "cpu", "postprocess": False}
    async with lsp_server(FAKE_SERVER, opts) as c:
        open_doc(c, URI, SRC)
        assert (await inline(c, URI, LINE, COL))[0]["insertText"] == "64"  # a block hole's slots
        n = len(c.notifications)
        c.notify("workspace/didChangeConfiguration", {"settings": {"dlm": {"maxFillTokens": 20, "device": "cpu"}}})
        assert (await inline(c, URI, LINE, COL))[0]["insertText"] == "20"
        assert not any(m == "dlm/status" and p["state"] == "loading" for _, m, p in c.notifications[n:])
        assert not any(m == "window/showMessage" for _, m, _p in c.notifications[n:])  # `device` unchanged: no warning
        # `model` from workspace settings is refused (tests/test_security.py)


async def test_a_workspace_cannot_change_the_device():
    async with lsp_server(FAKE_SERVER, {"model": scripted(tell="max_tokens"), "device": "cpu"}) as c:
        open_doc(c, URI, SRC)
        n = len(c.notifications)
        c.notify("workspace/didChangeConfiguration", {"settings": {"dlm": {"device": "cuda", "maxFillTokens": 20}}})
        warn = await c.wait_notification(
            "window/showMessage", lambda p: "'device'" in p["message"], since=n, timeout=10
        )
        assert warn["type"] == 2 and "cannot be changed through workspace settings" in warn["message"]
        assert "keeping 'cpu'" in warn["message"]
        assert (await inline(c, URI, LINE, COL))[0]["insertText"] == "20"  # the rest of the settings applied
        assert not any(m == "dlm/status" and p["state"] == "loading" for _, m, p in c.notifications[n:])


@pytest.mark.parametrize(
    "script,options,budget",
    [
        ({}, {}, 512),  # an engine that reports no budget (an older daemon, another FIM API)
        ({"context": 2048}, {}, 2048),  # the model's budget for its device, as the engine reports it
        ({"context": 2048}, {"contextTokens": 1000}, 1000),  # the option overrides it
    ],
)
async def test_fills_get_the_context_the_engine_reports_or_the_option(script, options, budget):
    opts = {"model": scripted(tell="context_tokens", **script), "postprocess": False, **options}
    async with lsp_server(FAKE_SERVER, opts) as c:
        open_doc(c, URI, SRC)
        assert (await inline(c, URI, LINE, COL))[0]["insertText"] == str(budget)
        assert (await stats(c))["contextTokens"] == budget
        # a workspace may change it (it picks no hardware; the engine cuts it to the model's window)
        c.notify("workspace/didChangeConfiguration", {"settings": {"dlm": {"contextTokens": 4096}}})
        assert (await inline(c, URI, LINE, COL))[0]["insertText"] == "4096"
        c.notify("workspace/didChangeConfiguration", {"settings": {"dlm": {"contextTokens": None}}})
        assert (await inline(c, URI, LINE, COL))[0]["insertText"] == str(script.get("context", 512))


async def test_progress_while_loading():
    caps = {"window": {"workDoneProgress": True}, "textDocument": {"inlineCompletion": {}}}
    async with lsp_server(FAKE_SERVER, {"model": scripted(load_ms=800)}, capabilities=caps) as c:
        await c.wait_notification("$/progress", lambda p: p["value"]["kind"] == "end", timeout=10)
        assert ("window/workDoneProgress/create", {"token": "dlm-lsp/loading/1"}) in c.server_requests
        kinds = [p["value"]["kind"] for _, m, p in c.notifications if m == "$/progress"]
        assert kinds == ["begin", "end"]


async def test_request_while_loading_is_answered_within_budget():
    # the engine loads for 10 minutes: a request waits for it at most its budget, then answers empty
    async with lsp_server(FAKE_SERVER, {"model": scripted(load_ms=600_000), "budgetMs": 200}, wait_ready=False) as c:
        open_doc(c, URI, SRC)
        assert await inline(c, URI, LINE, COL, timeout=60) == []
        s = await stats(c)
        assert s["state"] == "loading" and s["requests"] == 1 and s["empty"] == 1


# ----------------------------------------------------------------------------- the real model


def _block_hole():
    text = (REPO / "examples" / "tide_log.py").read_text()
    cut = text.index("        return self.high - self.low")
    doc = text[:cut] + "        \n" + text[text.index("\n", cut) + 1 :]
    return doc, doc[:cut].count("\n")


async def test_real_server_engine_gives_a_nonempty_fill_with_a_correct_range(tmp_path):
    """`python -m dlm_lsp serve` with the real engine on a tiny random checkpoint that only predicts
    printable text (never padding): a non-empty fill at the cursor over stdio."""
    from tests.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny", printable=True)
    doc, line = _block_hole()
    async with lsp_server(
        REAL_SERVER,
        {"postprocess": False, "budgetMs": 5000, "model": str(ckpt)},
        log_path=tmp_path / "server.log",
        ready_timeout=120,
    ) as c:
        uri = (REPO / "examples" / "tide_log.py").as_uri()
        open_doc(c, uri, doc)
        items = await inline(c, uri, line, 8, timeout=60)
        assert len(items) == 1 and items[0]["insertText"].strip()
        assert items[0]["range"] == {"start": {"line": line, "character": 8}, "end": {"line": line, "character": 8}}
        s = await stats(c)
        assert s["engineJobs"] == 1 and s["engineSteps"] >= 1 and s["errors"] == 0


async def test_real_server_with_the_default_model(tmp_path):
    """`python -m dlm_lsp serve` with the default model: protocol and range, not the text (the
    model may legitimately end a fill at once with padding)."""
    doc, line = _block_hole()
    opts = {"postprocess": False, "budgetMs": 2000}
    if TEST_MODEL:
        opts["model"] = TEST_MODEL
    async with lsp_server(REAL_SERVER, opts, log_path=tmp_path / "server.log", ready_timeout=180) as c:
        uri = (REPO / "examples" / "tide_log.py").as_uri()
        open_doc(c, uri, doc)
        items = await inline(c, uri, line, 8, timeout=60)
        assert len(items) <= 1
        for it in items:
            assert it["range"] == {"start": {"line": line, "character": 8}, "end": {"line": line, "character": 8}}
            assert "<|" not in it["insertText"]
        # with the filters on the answer is still well-formed: empty, or a fill starting at the cursor
        c.notify("workspace/didChangeConfiguration", {"settings": {"dlm": {"postprocess": True}}})
        items = await inline(c, uri, line, 8, timeout=60)
        for it in items:
            assert it["range"]["start"] == {"line": line, "character": 8}
            assert it["range"]["end"]["line"] == line
            assert "<|" not in it["insertText"]
        s = await stats(c)
        assert s["engineJobs"] == 2 and s["engineSteps"] >= 2 and s["errors"] == 0


def test_complete_command_json(tmp_path):
    """`dlm-lsp complete PATH:LINE:COL --json` runs the same path as the server."""
    src = tmp_path / "half.py"
    src.write_text("def area(w, h):\n    size = w *\n    return size\n")
    cmd = [sys.executable, "-m", "dlm_lsp", "complete", f"{src}:2:15", "--json", "--budget-ms", "2000"]
    if TEST_MODEL:
        cmd += ["--model", TEST_MODEL]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"text", "range", "hole_kind", "latency_ms", "steps", "tokens"} <= set(res)
    assert res["range"]["start"] == {"line": 1, "character": 14}
    assert res["range"]["end"] == {"line": 1, "character": 14}
    assert res["hole_kind"] == "line" and res["steps"] >= 1
    assert 0.0 < res["confidence"] <= 1.0


async def test_result_for_an_older_version_is_dropped_in_process():
    """The version check after the engine await, on its own: a change the scheduler never saw
    (no didChange handler ran) must still keep the old result from being returned."""
    from lsprotocol import types

    from dlm_lsp.measure.fuzz.scripted_engine import ScriptedEngine
    from dlm_lsp.server import DlmServer

    server = DlmServer(ScriptedEngine)
    server.loop = asyncio.get_running_loop()
    server.apply_options({"model": scripted(steps=5, step_ms=20, text="y = 2")}, initial=True)
    server.start_engine()
    await asyncio.wait_for(server._ready.wait(), 5)
    doc = server.documents.open(URI, "python", 1, SRC)
    task = asyncio.create_task(server.fill_at(URI, types.Position(LINE, COL)))
    await asyncio.sleep(0.03)
    doc.text, doc.version = doc.text.replace("s = 0", "s = 1"), 2
    assert await task is None
    assert server.stats.stale == 1 and server.stats.wasted_steps == 5
    text, rng = await server.fill_at(URI, types.Position(LINE, COL))  # control: same version -> the fill
    assert text == "y = 2" and rng.start.line == LINE
    # a change that only typed along the running job: still not returned, but kept for typing-through
    task = asyncio.create_task(server.fill_at(URI, types.Position(LINE - 1, 4)))
    await asyncio.sleep(0.03)
    cur = server.documents.get(URI).index().offset(LINE - 1, 4)
    doc.text, doc.version = doc.text[:cur] + "y" + doc.text[cur:], 3
    assert await task is None
    assert server.stats.typed_along == 1 and server.stats.wasted_steps == 5
    jobs = server.stats.engine_jobs
    text, _ = await server.fill_at(URI, types.Position(LINE - 1, 5))
    assert text == " = 2" and server.stats.engine_jobs == jobs
    server.engine.close()


def test_one_shot_commands_fill_with_the_resident_workers_thread_count(tmp_path):
    """`complete` / `demo` fill on their main thread: it must get cpu_threads() (cores less one) or
    DLM_THREADS, not torch's one thread per core, which spins when another core is busy."""
    from tests.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "m")
    code = (
        "import torch; from dlm_lsp.headless import load_engine; from engine.serve.service import cpu_threads; "
        f"e = load_engine({str(model)!r}, 'cpu'); print(torch.get_num_threads(), e.threads, cpu_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DLM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    torch_threads, engine_threads, expected = map(int, out.stdout.split()[-3:])
    assert torch_threads == engine_threads == expected
    env["DLM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:-1] == ["1", "1"]
