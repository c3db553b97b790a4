"""The JSON-RPC layer (dlm_lsp/protocol.py): the framer on byte streams, envelopes, and the real server
process over stdio fed bad bytes, bad envelopes and lifecycle misuse - every request answered with the
right code, nothing that ends the process except `exit`, and no "Error in server" pop-ups.

After each bad frame a valid `dlm/stats` request (the probe) must be answered: the server is alive
and back in sync with the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from dlm_lsp.measure.replay import LspClient, LspError
from dlm_lsp.protocol import MAX_HEADER_LINE, MAX_MESSAGE_BYTES, Framer, Skipped, check_envelope
from tests.lsp_helpers import FAKE_SERVER, REAL_SERVER, REPO, TEST_BUDGET_MS, inline, open_doc, scripted, until

URI = "file:///tmp/dlm-protocol/a.py"
SRC = "def f():\n    \n"


def frame(body: bytes | dict, header: bytes = b"") -> bytes:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    return header + b"Content-Length: %d\r\n\r\n" % len(body) + body


def request(msg_id, method="dlm/stats", params=None) -> dict:
    return {"jsonrpc": "2.0", "id": msg_id, "method": method, "params": {} if params is None else params}


# ----------------------------------------------------------------------------- the framer


def feed_in_chunks(data: bytes, size: int, framer: Framer | None = None) -> list:
    f = framer or Framer()
    out = []
    for i in range(0, len(data), size):
        out += f.feed(data[i : i + size])
    return out + f.eof()


BODIES = [b'{"a": 1}', b"{}", '{"t": "\u00e9\\r\\n\u2603"}'.encode(), b"x" * 3000]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 4096, 10**6])
def test_framer_bodies_across_chunk_boundaries(size):
    stream = b"".join(frame(b) for b in BODIES)
    assert feed_in_chunks(stream, size) == BODIES


def test_framer_header_variants():
    # other headers, any case, LF-only line endings, spaces around the value
    stream = (
        b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\nContent-Length: 2\r\n\r\n{}"
        b"content-length:3\n\n[1]"
        b"CONTENT-LENGTH:   4  \r\n\r\n1234"
        b"Content-Length: 0\r\n\r\n"
    )
    assert feed_in_chunks(stream, 5) == [b"{}", b"[1]", b"1234", b""]


@pytest.mark.parametrize(
    "header,why",
    [
        (b"Content-Length: 1000000000000\r\n\r\n", "limit"),
        (b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n", "not a byte count"),
        (b"Content-Length: -5\r\n\r\n", "not a byte count"),
        (b"Content-Length: 12abc\r\n\r\n", "not a byte count"),
        (b"Content-Length: \r\n\r\n", "not a byte count"),
        (b"Content-Length: 0x10\r\n\r\n", "not a byte count"),
        (b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n", "two Content-Length"),
        (b"Content-Type: text/plain\r\n\r\n", "without Content-Length"),
    ],
)
@pytest.mark.parametrize("size", [1, 13, 10**6])
def test_framer_skips_a_bad_header_and_resynchronizes(header, why, size):
    out = feed_in_chunks(header + frame(b'{"ok": 1}'), size)
    assert [type(x) for x in out] == [Skipped, bytes], out
    assert why in out[0].reason and out[0].nbytes == len(header)
    assert out[1] == b'{"ok": 1}'


def test_framer_limit_is_the_body_size():
    f = Framer(max_body=10)
    out = f.feed(frame(b"0123456789") + frame(b"0123456789x") + frame(b"ok"))
    assert out[0] == b"0123456789" and isinstance(out[1], Skipped) and "limit" in out[1].reason
    # the skipped body is garbage glued to the next header: skipped too, and the next frame is found
    assert isinstance(out[2], Skipped) and out[2].nbytes == 11 and out[3] == b"ok" and len(out) == 4
    assert Framer().max_body == MAX_MESSAGE_BYTES == 64 * 1024 * 1024


@pytest.mark.parametrize(
    "garbage",
    [
        b"hello\r\n",
        b"\x00\xff\xfe\r\n\r\n\n",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # a header block without Content-Length
        b'{"jsonrpc": "2.0"}',  # glued to the next header, no newline
        b"Content-Length: 5\r\nnot a header\r\n\r\n",  # a header block broken by garbage
        b"z" * (3 * MAX_HEADER_LINE),  # a line too long to be a header
        b"q" * (MAX_HEADER_LINE - 3) + b"\r\n",
    ],
)
@pytest.mark.parametrize("size", [1, 100, 10**6])
def test_framer_skips_garbage(garbage, size):
    out = feed_in_chunks(garbage + frame(b"[1]") + frame(b"[2]"), size)
    bodies = [x for x in out if isinstance(x, bytes)]
    assert bodies == [b"[1]", b"[2]"], out
    assert sum(x.nbytes for x in out if isinstance(x, Skipped)) == len(garbage)


def test_framer_header_glued_to_long_garbage_in_small_chunks():
    # the Content-Length line arrives while the garbage line is over the header limit
    garbage = b"g" * (MAX_HEADER_LINE - 5)
    for size in (1, 9, 1000):
        assert [x for x in feed_in_chunks(garbage + frame(b"{}"), size) if isinstance(x, bytes)] == [b"{}"]


def test_framer_memory_stays_bounded_on_endless_garbage():
    f = Framer()
    for _ in range(200):
        f.feed(b"x" * 10_000)  # 2 MB, no newline
        assert len(f._buf) <= MAX_HEADER_LINE + 10_000
    f.feed(b"\r\n" + frame(b"{}"))
    assert f.eof() == []


def test_framer_eof_reports_a_cut_message():
    f = Framer()
    assert f.feed(b"Content-Length: 10\r\n\r\n12345") == []
    [cut] = f.eof()
    assert "5 bytes short" in cut.reason and cut.nbytes == 5
    f = Framer()
    assert f.feed(b"Content-Len") == [] and f.eof()[0].reason == "the input ended inside a header"


# ----------------------------------------------------------------------------- envelopes


@pytest.mark.parametrize(
    "data,kind,msg_id,problem",
    [
        (request(1), "request", 1, None),
        (request("a"), "request", "a", None),
        ({"jsonrpc": "2.0", "method": "x"}, "notification", None, None),
        ({"jsonrpc": "2.0", "id": 3, "result": None}, "response", 3, None),
        ({"jsonrpc": "2.0", "id": None, "error": {"code": 1, "message": "m"}}, "response", None, None),
        ({"jsonrpc": "2.0", "id": [3], "result": 1}, "response", None, "id must be"),
        ([request(1)], "invalid", None, "batch"),
        ("hello", "invalid", None, "JSON object"),
        (None, "invalid", None, "JSON object"),
        ({"jsonrpc": "1.0", "id": 4, "method": "x"}, "invalid", 4, "jsonrpc"),
        ({"id": 4, "method": "x"}, "invalid", 4, "jsonrpc"),
        ({"jsonrpc": "2.0", "id": 1.5, "method": "x"}, "invalid", None, "id must be"),
        ({"jsonrpc": "2.0", "id": True, "method": "x"}, "invalid", None, "id must be"),
        ({"jsonrpc": "2.0", "id": None, "method": "x"}, "invalid", None, "id must be"),
        ({"jsonrpc": "2.0", "id": 5, "method": 5}, "invalid", 5, "method must be"),
        ({"jsonrpc": "2.0", "method": None}, "invalid", None, "method must be"),
        ({"jsonrpc": "2.0", "id": 6}, "invalid", None, "neither"),
    ],
)
def test_check_envelope(data, kind, msg_id, problem):
    got = check_envelope(data)
    assert got[:2] == (kind, msg_id)
    assert (got[2] is None) if problem is None else (problem in got[2])


# ----------------------------------------------------------------------------- the server process


class RawClient(LspClient):
    """LspClient that records every message from the server and can write raw bytes."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.received: list[dict] = []
        self._got = asyncio.Event()

    def _dispatch(self, msg: dict) -> None:
        self.received.append(msg)
        self._got.set()
        super()._dispatch(msg)

    def send_bytes(self, raw: bytes) -> None:
        self.proc.stdin.write(raw)

    async def answer(self, msg_id, timeout: float = 10) -> dict:
        """The response (result or error) to `msg_id`."""

        async def find():
            while True:
                for m in self.received:
                    if "method" not in m and m.get("id") == msg_id:
                        return m
                self._got.clear()
                await self._got.wait()

        return await asyncio.wait_for(find(), timeout)

    async def probe(self, raw: bytes = b"") -> list[dict]:
        """Sends `raw` then a dlm/stats request; returns the messages that came before its answer,
        which must be a result (the server is alive and in sync)."""
        start = len(self.received)
        self.send_bytes(raw)
        msg_id, fut = self.send_request("dlm/stats", {})
        await asyncio.wait_for(fut, 10)
        got = self.received[start:]
        return [m for m in got if m.get("id") != msg_id or "method" in m]


@contextlib.asynccontextmanager
async def server(cmd=FAKE_SERVER, init: bool = True, options: dict | None = None):
    c = RawClient(cmd, cwd=str(REPO))
    await c.start()
    try:
        if init:
            c.init_result = await c.initialize(options or {"model": scripted(), "budgetMs": TEST_BUDGET_MS})
            await c.wait_ready(30)
        yield c
    finally:
        await c.stop()


def responses(msgs: list[dict]) -> list[tuple]:
    """(id, error code or None) of the responses among `msgs`."""
    return [(m.get("id"), (m.get("error") or {}).get("code")) for m in msgs if "method" not in m]


def error_popups(c: RawClient) -> list:
    return [
        p
        for _, m, p in c.notifications
        if m in ("window/showMessage", "window/logMessage") and "Error in server" in str((p or {}).get("message"))
    ]


BAD_FRAMES = {
    "huge length": b"Content-Length: 1000000000000\r\n\r\n",
    "5000-digit length": b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n",
    "negative length": b"Content-Length: -5\r\n\r\n",
    "words for a length": b"Content-Length: twelve\r\n\r\n",
    "no Content-Length": b'Content-Type: application/vscode-jsonrpc\r\n\r\n{"jsonrpc": "2.0", "id": 90, "method": "dlm/stats"}',
    "garbage lines": b"hello\r\n\x00\xff\xfe garbage\r\n\r\n\n",
    "garbage glued to the header": b'{"jsonrpc": "2.0", "id": 91, "method": "dlm/stats"}',
    "a line longer than any header": b"y" * (3 * MAX_HEADER_LINE),
    "an HTTP request": b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
}


async def test_bad_frames_are_skipped_and_the_server_resynchronizes():
    async with server() as c:
        for name, raw in BAD_FRAMES.items():
            before = await c.probe(raw)
            assert responses(before) == [], name  # nothing to answer: no message was framed
            assert c.proc.returncode is None, name
        # the header, then the body in pieces: one message
        body = json.dumps(request(92)).encode()
        for piece in [b"Content-Le", b"ngth: %d\r" % len(body), b"\n\r\n"] + [
            body[i : i + 7] for i in range(0, len(body), 7)
        ]:
            c.send_bytes(piece)
            await c.proc.stdin.drain()
            await asyncio.sleep(0.01)
        assert "result" in await c.answer(92)
        # LF-only line endings and lower-case names are accepted
        c.send_bytes(b"content-length: %d\n\n" % len(body) + body.replace(b"92", b"93"))
        assert "result" in await c.answer(93)
        assert not error_popups(c)


async def test_non_utf8_and_short_bodies_answer_parse_error():
    async with server() as c:
        assert responses(await c.probe(frame(b'{"jsonrpc": "2.0", "id": 1, "method": "\xff\xfe"}'))) == [(None, -32700)]
        # a Content-Length longer than the body eats the next message: a parse error, then resync
        eaten = frame(request(94))
        before = await c.probe(b"Content-Length: 70\r\n\r\n{}" + eaten)
        assert responses(before) == [(None, -32700)]


async def test_a_message_over_the_size_limit_is_skipped():
    async with server() as c:
        # a request the server would answer, padded past the limit: skipped unread, so never answered
        body = json.dumps(request(95, params={"pad": "a" * MAX_MESSAGE_BYTES})).encode()
        c.send_bytes(frame(body))
        await c.proc.stdin.drain()
        assert responses(await c.probe()) == []


ENVELOPES = [  # (body, expected id, expected error code)
    (b'{"jsonrpc": "2.0", "id": 1, ', None, -32700),
    (b"", None, -32700),
    (b"[" * 100_000 + b"]" * 100_000, None, -32700),  # too deep for the JSON parser
    (b'{"jsonrpc": "2.0", "id": ' + b"7" * 5000 + b', "method": "dlm/stats"}', None, -32700),
    (b"[]", None, -32600),
    (json.dumps([request(31)]).encode(), None, -32600),
    (b'"hello"', None, -32600),
    (b"42", None, -32600),
    (b"null", None, -32600),
    (b"{}", None, -32600),
    (b'{"jsonrpc": "2.0"}', None, -32600),
    (json.dumps({**request(32), "jsonrpc": "1.0"}).encode(), 32, -32600),
    (json.dumps({"id": 33, "method": "dlm/stats"}).encode(), 33, -32600),
    (json.dumps(request(1.5)).encode(), None, -32600),
    (json.dumps(request(True)).encode(), None, -32600),
    (json.dumps(request([34])).encode(), None, -32600),
    (json.dumps(request({"a": 1})).encode(), None, -32600),
    (json.dumps(request(None)).encode(), None, -32600),
    (json.dumps(request(35, method=5)).encode(), 35, -32600),
    (json.dumps({"jsonrpc": "2.0", "method": ["x"], "params": "bar"}).encode(), None, -32600),
    (json.dumps(request(36, method="foo/bar")).encode(), 36, -32601),
    (
        json.dumps(
            request(
                "s37",
                method="textDocument/hover",
                params={"textDocument": {"uri": URI}, "position": {"line": 0, "character": 0}},
            )
        ).encode(),
        "s37",
        -32601,
    ),
    (
        json.dumps(request(38, method="textDocument/didClose", params={"textDocument": {"uri": URI}})).encode(),
        38,
        -32601,
    ),
    (json.dumps(request(39, method="textDocument/inlineCompletion", params={"textDocument": 5})).encode(), 39, -32602),
    (json.dumps(request(40, method="textDocument/inlineCompletion", params="x")).encode(), 40, -32602),
    (json.dumps({**request(41), "extra": {"jsonrpc": "2.0", "id": 42, "method": "x"}}).encode(), 41, None),
]


async def test_bad_envelopes_get_the_json_rpc_error():
    async with server() as c:
        for body, msg_id, code in ENVELOPES:
            before = await c.probe(frame(body))
            assert responses(before) == [(msg_id, code)], body[:80]  # code None: a result
        assert c.proc.returncode is None and not error_popups(c)


async def test_notifications_are_never_answered_nor_shown():
    async with server() as c:
        open_doc(c, URI, SRC)
        for method, params in [
            ("foo/bar", {}),
            ("$/unknown", {"x": 1}),
            ("$/cancelRequest", None),
            ("$/cancelRequest", {"id": [1]}),
            ("$/cancelRequest", {"id": 12345}),
            ("textDocument/didOpen", {"textDocument": 5}),
            ("textDocument/didOpen", "text"),
            ("textDocument/didChange", {"textDocument": {"uri": 3}}),
            (
                "textDocument/didChange",
                {"textDocument": {"uri": "file:///not/open.py", "version": 2}, "contentChanges": [{"text": "x"}]},
            ),
            ("textDocument/didClose", {"textDocument": {"uri": "file:///not/open.py"}}),
            ("workspace/didChangeConfiguration", 7),
            ("initialized", {}),
            ("textDocument/completion", {}),
        ]:
            before = await c.probe(frame({"jsonrpc": "2.0", "method": method, "params": params}))
            assert responses(before) == [], method
        # the open document survived all of it
        assert (await inline(c, URI, 1, 4))[0]["insertText"] == "x = 1"
        assert not error_popups(c)
        assert not [m for _, m, _ in c.notifications if m == "window/showMessage"]


async def test_a_cancel_for_an_id_no_request_can_have_is_ignored_quietly(tmp_path):
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        c = RawClient(FAKE_SERVER, cwd=str(REPO), stderr=log)
        await c.start()
        try:
            await c.initialize({"model": scripted(), "budgetMs": TEST_BUDGET_MS})
            await c.wait_ready(30)
            for bad in ({"nested": 1}, [1, 2], True, None, 1.5):
                before = await c.probe(frame({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": bad}}))
                assert responses(before) == [], bad
            # a cancel for a request already answered (editors send them as the user types on): no warning
            answered = await c.probe(frame(request(41)))
            assert [r[0] for r in responses(answered)] == [41]
            await c.probe(frame({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": 41}}))
        finally:
            await c.stop()
    text = log_path.read_text(errors="replace")
    assert "Traceback" not in text and "unhashable" not in text, text[-2000:]
    assert "Cancel notification for unknown message id" not in text, text[-2000:]


async def test_nested_request_like_objects_are_params_not_messages():
    nested = {"jsonrpc": "2.0", "id": 777, "method": "textDocument/completion", "params": 1}
    async with server() as c:
        before = await c.probe(frame(request(60, params={"x": nested, "y": [dict(nested, id=778)]})))
        assert responses(before) == [(60, None)]
        c.notify(
            "workspace/didChangeConfiguration",
            {"settings": {"dlm": {"debounceMs": 0}, "x": dict(nested, id=779, method="shutdown")}},
        )
        open_doc(c, URI, SRC)
        assert (await inline(c, URI, 1, 4))[0]["insertText"] == "x = 1"  # not shut down
        await c.probe()
        assert not {777, 778, 779} & {m.get("id") for m in c.received}
        assert not error_popups(c)


# ----------------------------------------------------------------------------- lifecycle


async def test_requests_before_initialize_get_server_not_initialized():
    async with server(init=False) as c:
        for method, params in [
            ("dlm/stats", {}),
            ("shutdown", None),
            ("textDocument/inlineCompletion", {"textDocument": {"uri": URI}, "position": {"line": 1, "character": 4}}),
        ]:
            with pytest.raises(LspError) as err:
                await c.request(method, params, timeout=10)
            assert err.value.code == -32002, method
        open_doc(c, "file:///tmp/dlm-protocol/early.py", SRC)  # dropped: not initialized
        # an initialize with bad params is refused and leaves the server uninitialized
        with pytest.raises(LspError) as err:
            await c.request("initialize", {"capabilities": 5}, timeout=10)
        assert err.value.code == -32602
        await c.initialize({"model": scripted(), "budgetMs": TEST_BUDGET_MS})
        await c.wait_ready(30)
        assert await inline(c, "file:///tmp/dlm-protocol/early.py", 1, 4) == []
        open_doc(c, URI, SRC)
        assert (await inline(c, URI, 1, 4))[0]["insertText"] == "x = 1"


async def test_second_initialize_is_refused_and_keeps_state():
    async with server() as c:
        open_doc(c, URI, SRC)
        with pytest.raises(LspError) as err:
            await c.request("initialize", {"processId": None, "rootUri": None, "capabilities": {}}, timeout=10)
        assert err.value.code == -32600 and "already initialized" in str(err.value)
        assert (await inline(c, URI, 1, 4))[0]["insertText"] == "x = 1"


async def test_after_shutdown_only_exit_is_honoured():
    async with server() as c:
        open_doc(c, URI, SRC)
        assert await c.request("shutdown", None, timeout=10) is None
        for method, params in [
            ("dlm/stats", {}),
            ("shutdown", None),
            ("initialize", {"processId": None, "rootUri": None, "capabilities": {}}),
            ("textDocument/inlineCompletion", {"textDocument": {"uri": URI}, "position": {"line": 1, "character": 4}}),
        ]:
            with pytest.raises(LspError) as err:
                await c.request(method, params, timeout=10)
            assert err.value.code == -32600, method
        start = len(c.received)
        c.notify(
            "textDocument/didChange", {"textDocument": {"uri": URI, "version": 2}, "contentChanges": [{"text": ""}]}
        )
        c.notify("exit")
        assert await asyncio.wait_for(c.proc.wait(), 10) == 0
        assert responses(c.received[start:]) == []


@pytest.mark.parametrize("cmd", [FAKE_SERVER, REAL_SERVER], ids=["fake", "dlm-lsp serve"])
@pytest.mark.parametrize("steps,code", [(("initialize", "shutdown"), 0), (("initialize",), 1), ((), 1)])
async def test_exit_code(cmd, steps, code):
    # no `initialized`: the real server never loads its model
    c = RawClient(cmd, cwd=str(REPO))
    await c.start()
    try:
        for method in steps:
            params = {"processId": None, "rootUri": None, "capabilities": {}} if method == "initialize" else None
            await c.request(method, params, timeout=30)
        c.notify("exit")
        assert await asyncio.wait_for(c.proc.wait(), 30) == code
    finally:
        await c.stop()


async def test_exit_with_a_fill_in_flight_and_end_of_input(tmp_path):
    hold = tmp_path / "hold"
    hold.mkdir()
    async with server(options={"model": scripted(hold=str(hold)), "budgetMs": 60_000}) as c:
        open_doc(c, URI, SRC)
        c.send_request(
            "textDocument/inlineCompletion",
            {"textDocument": {"uri": URI}, "position": {"line": 1, "character": 4}, "context": {"triggerKind": 2}},
        )
        await until(lambda: (hold / "started-1").exists(), what="the fill's job to run")  # held: never ends
        c.notify("exit")
        assert await asyncio.wait_for(c.proc.wait(), 10) == 1
    async with server() as c:
        c.proc.stdin.close()  # the editor went away without exit
        assert await asyncio.wait_for(c.proc.wait(), 10) == 1
