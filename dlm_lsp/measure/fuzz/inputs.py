"""The input classes: each step of a run draws one (`CLASSES`, by weight) and sends its messages,
valid sessions and every kind of hostile input."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any, cast

from dlm_lsp.measure.fuzz.checks import _brief, _expect_code, _no_items, check_next_edit
from dlm_lsp.measure.fuzz.client import DOC_TEXT, PING, _frame, _inline_params
from dlm_lsp.measure.fuzz.reference import UINT_MAX, RefText, apply_change, edit_outcomes, utf16_len
from dlm_lsp.measure.fuzz.state import URIS, FuzzerState, Pending

if TYPE_CHECKING:
    from dlm_lsp.measure.replay import LspError

NEXT_EDIT = "dlm/nextEdit"

# every Unicode line break; only the first three end a line in LSP
LINE_BREAKS = ["\n", "\r", "\r\n", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
ASTRAL = ["\U0001f600", "\U0001d518", "\U00010348", "\U0001f4a5"]  # 2 UTF-16 units each
LONE = ["\ud800", "\udbff", "\udc00", "\udfff"]
BINARY = ["\x00", "\x01", "\x07", "\x08", "\x1b[31m", "\x7f", "\ufeff", "\ufffe", "\uffff", "\x00\x00\x00", "\t\x0b"]

# input class -> weight
CLASSES = {
    "valid_session": 20,
    "line_breaks": 8,
    "positions_out_of_range": 8,
    "surrogate_split": 5,
    "lone_surrogates": 4,
    "binary_content": 4,
    "big_documents": 2,
    "unknown_language": 3,
    "never_opened": 4,
    "reversed_ranges": 4,
    "wrong_versions": 4,
    "wrong_types": 6,
    "unknown_methods": 4,
    "bad_framing": 8,
    "nested_params": 3,
    "lifecycle": 1,
    "storm": 3,
    "cancel_random": 5,
    "next_edits": 6,
}


class InputsMixin(FuzzerState):
    """Fuzzer's input classes, one method per name in CLASSES."""

    async def valid_session(self) -> None:
        doc = self.any_doc()
        for _ in range(self.rng.randint(1, 6)):
            r = self.rng.random()
            off = doc.ref.random_offset(self.rng)
            if r < 0.5:
                await self.type_text(doc, off, self.snippet(12))
            elif r < 0.7:
                b = min(len(doc.text), off + self.rng.randint(0, 40))
                b = doc.ref.random_offset(self.rng) if self.rng.random() < 0.2 else b
                a, b = min(off, b), max(off, b)
                b = self._boundary(doc, b)
                await self.change(doc, [self.range_change(doc, a, b, self.snippet(30))])
                self.at_cursor(doc, a)
            elif r < 0.8:  # several changes in one notification, each on the text the previous left
                changes, text = [], doc.text
                for _ in range(self.rng.randint(2, 4)):
                    ref = RefText(text)
                    o = ref.random_offset(self.rng)
                    line, char = ref.position(o)
                    ch = {
                        "range": {"start": {"line": line, "character": char}, "end": {"line": line, "character": char}},
                        "text": self.snippet(8),
                    }
                    changes.append(ch)
                    text = cast(str, apply_change(text, ch)[0])  # an insertion at a valid position: one text
                await self.change(doc, changes)
            elif r < 0.85:
                await self.change(doc, [{"text": self.snippet(300)}])
            else:
                self.at_cursor(doc, off, self.rng.choice(("textDocument/inlineCompletion", "textDocument/completion")))
        if self.rng.random() < 0.25:
            await self.close_checked(doc)

    async def line_breaks(self) -> None:
        doc = self.any_doc()
        for _ in range(self.rng.randint(1, 4)):
            brk = self.rng.choice(LINE_BREAKS)
            off = doc.ref.random_offset(self.rng)
            await self.change(doc, [self.insert_change(doc, off, "a" + brk + "b" + self.rng.choice(LINE_BREAKS) + "c")])
            # edit and ask on the lines after the break: a server splitting lines differently is off here
            ref = doc.ref
            line = min(len(ref) - 1, ref.position(off)[0] + self.rng.randint(1, 3))
            char = self.rng.randint(0, utf16_len(ref.line(line)) + 2)
            await self.change(
                doc,
                [
                    {
                        "range": {"start": {"line": line, "character": char}, "end": {"line": line, "character": char}},
                        "text": "Z",
                    }
                ],
            )
            self.complete(doc, line, min(char, utf16_len(doc.ref.line(line))))
        if self.rng.random() < 0.3:  # a document made of every break
            uri = self.free_uri()
            if uri:
                text = "".join(f"l{i}{b}" for i, b in enumerate(self.rng.sample(LINE_BREAKS, len(LINE_BREAKS))))
                d = self.open(uri, text)
                for line in range(0, len(d.ref) + 1, 2):
                    self.complete(d, line, 1)
                await self.change(
                    d,
                    [
                        {
                            "range": {
                                "start": {"line": len(d.ref) - 1, "character": 0},
                                "end": {"line": len(d.ref) - 1, "character": 1},
                            },
                            "text": "!",
                        }
                    ],
                )
        await self.sync(doc)

    async def positions_out_of_range(self) -> None:
        doc = self.any_doc()
        ref = doc.ref
        line = self.rng.randrange(len(ref))
        llen = utf16_len(ref.line(line))
        picks = [
            (line, llen + self.rng.randint(1, 50)),
            (len(ref) + self.rng.randint(0, 5), 0),
            (len(ref) + 3, 7),
            (UINT_MAX, UINT_MAX),
            (line, UINT_MAX),
            (-1, 0),
            (0, -1),
            (-5, -5),
            (2**40, 0),
            (line, 2**53),
            (10**30, 10**30),
        ]
        for _ in range(self.rng.randint(1, 4)):
            l, c = self.rng.choice(picks)
            self.complete(doc, l, c, self.rng.choice(("textDocument/inlineCompletion", "textDocument/completion")))
        l, c = self.rng.choice(picks)
        l2, c2 = self.rng.choice(picks + [(line, 0)])
        await self.change(
            doc,
            [
                {
                    "range": {"start": {"line": l, "character": c}, "end": {"line": l2, "character": c2}},
                    "text": self.rng.choice(("", "X", "\n", "end\r\n")),
                }
            ],
        )
        await self.sync(doc)

    async def surrogate_split(self) -> None:
        doc = self.any_doc()
        off = doc.ref.random_offset(self.rng)
        emoji = "".join(self.rng.choice(ASTRAL) for _ in range(self.rng.randint(1, 3)))
        await self.change(doc, [self.insert_change(doc, off, f"s = '{emoji}x{self.rng.choice(ASTRAL)}'")])
        line, char = doc.ref.position(off + 5)  # just before the first astral character
        mid = char + 1
        for _ in range(self.rng.randint(1, 3)):
            self.complete(doc, line, mid, self.rng.choice(("textDocument/inlineCompletion", "textDocument/completion")))
        r = self.rng.random()
        if r < 0.4:
            await self.change(
                doc,
                [
                    {
                        "range": {"start": {"line": line, "character": mid}, "end": {"line": line, "character": mid}},
                        "text": "|",
                    }
                ],
            )
        elif r < 0.8:
            await self.change(
                doc,
                [
                    {
                        "range": {
                            "start": {"line": line, "character": mid},
                            "end": {"line": line, "character": mid + 2},
                        },
                        "text": "",
                    }
                ],
            )
        await self.sync(doc)

    async def lone_surrogates(self) -> None:
        bad = "".join(self.rng.choice(LONE + ["a", "b"]) for _ in range(self.rng.randint(1, 5)))
        doc = self.any_doc()
        off = doc.ref.random_offset(self.rng)
        change = self.insert_change(doc, off, bad)
        fixed = dict(change, text="".join("\ufffd" if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in bad))
        outcomes = edit_outcomes(doc.text, doc.version, [change], doc.top + 1)
        outcomes += edit_outcomes(doc.text, doc.version, [fixed], doc.top + 1)
        doc.top += 1
        self.notify(
            "textDocument/didChange",
            {"textDocument": {"uri": doc.uri, "version": doc.top}, "contentChanges": [change]},
            doc,
        )
        self.complete(doc, *doc.ref.position(off))
        await self.sync(doc, list(dict.fromkeys(outcomes + [(doc.text, doc.version)])))
        if self.rng.random() < 0.3 and doc.uri in self.docs:
            await self.close_checked(doc)

    async def binary_content(self) -> None:
        doc = self.any_doc()
        junk = "".join(self.rng.choice(BINARY) for _ in range(self.rng.randint(1, 6)))
        await self.type_text(doc, doc.ref.random_offset(self.rng), junk, ask=0.5)
        if self.rng.random() < 0.3:
            uri = self.free_uri()
            if uri:
                d = self.open(uri, junk * 20 + "\x00\n\x00")
                self.complete(d, 1, 1)
                await self.sync(d)
        await self.sync(doc)

    async def big_documents(self) -> None:
        uri = self.free_uri() or self.rng.choice(sorted(self.docs))
        if uri in self.docs:
            self.close(self.docs[uri])
        size = self.max_doc_bytes
        if self.rng.random() < 0.5:
            text = (self.corpus * (size // max(1, len(self.corpus)) + 1))[:size]
        else:  # one line
            text = ("x = [" + "1, " * (size // 3))[:size]
        doc = self.open(uri, text)
        ref = doc.ref
        last = len(ref) - 1
        self.complete(doc, last, utf16_len(ref.line(last)))
        self.complete(doc, last // 2, 3)
        await self.change(doc, [self.insert_change(doc, len(doc.text) // 2, "y = 1\n")])
        await self.change(doc, [self.insert_change(doc, len(doc.text), "\nz = ")])
        self.complete(doc, len(doc.ref) - 1, 4)
        await self.close_checked(doc)

    async def unknown_language(self) -> None:
        uri = self.free_uri()
        if uri is None:
            return await self.valid_session()
        lang = self.rng.choice(["cobol", "", "Python", "x" * 300, "\U0001f4a5", "plaintext", "c++", "PYTHON"])
        doc = self.open(uri, self.snippet(200), lang)
        await self.type_text(doc, doc.ref.random_offset(self.rng), self.snippet(6))
        await self.close_checked(doc)

    async def never_opened(self) -> None:
        uri = f"file:///fuzz/never/n{self.rng.randrange(1000)}.py"
        r = self.rng.random()
        pos = {"line": 0, "character": 0}
        if r < 0.3:
            self.notify(
                "textDocument/didChange",
                {
                    "textDocument": {"uri": uri, "version": 2},
                    "contentChanges": [{"range": {"start": pos, "end": pos}, "text": "x"}],
                },
            )
        elif r < 0.5:
            self.notify("textDocument/didClose", {"textDocument": {"uri": uri}})
        self.request(
            self.rng.choice(("textDocument/inlineCompletion", "textDocument/completion")),
            _inline_params(uri, self.rng.randint(0, 3), self.rng.randint(0, 3)),
            check=_no_items(uri),
        )
        if self.doc_text:
            self.request(
                DOC_TEXT,
                {"textDocument": {"uri": uri}},
                check=lambda res, e: ("protocol", f"documentText of a never-opened document: {_brief(res)}")
                if res is not None or e is not None
                else None,
            )

    async def reversed_ranges(self) -> None:
        doc = self.any_doc()
        a, b = sorted((doc.ref.random_offset(self.rng), doc.ref.random_offset(self.rng)))
        b = self._boundary(doc, b)
        ch = self.range_change(doc, a, b, self.rng.choice(("", "R", "rev\n")))
        ch["range"] = {"start": ch["range"]["end"], "end": ch["range"]["start"]}
        await self.change(doc, [ch])

    async def wrong_versions(self) -> None:
        doc = self.any_doc()
        v = self.rng.choice([doc.version, doc.version - 1, 0, -1, -(2**31), 2**53, 3.5, "7", None])
        await self.change(
            doc, [self.insert_change(doc, doc.ref.random_offset(self.rng), "v")], version=v, loose_version=True
        )
        if doc.uri in self.docs:
            await self.close_checked(doc)  # a doc at a version of 2**53 takes no further edits

    async def wrong_types(self) -> None:
        doc = self.any_doc()
        u = doc.uri
        reqs = [
            ("textDocument/inlineCompletion", []),
            ("textDocument/inlineCompletion", None),
            ("textDocument/inlineCompletion", {"textDocument": 5, "position": {"line": 0, "character": 0}}),
            (
                "textDocument/inlineCompletion",
                {"textDocument": {"uri": u}, "position": {"line": "1", "character": 0}, "context": {"triggerKind": 2}},
            ),
            (
                "textDocument/inlineCompletion",
                {"textDocument": {"uri": u}, "position": {"line": 1.5, "character": 0}, "context": {"triggerKind": 2}},
            ),
            ("textDocument/inlineCompletion", {"textDocument": {"uri": None}, "position": {"line": 0, "character": 0}}),
            ("textDocument/inlineCompletion", {"textDocument": {"uri": u}, "context": {"triggerKind": 2}}),
            (
                "textDocument/inlineCompletion",
                {"textDocument": {"uri": u}, "position": {"line": 0, "character": 0}, "context": {"triggerKind": "x"}},
            ),
            ("textDocument/completion", {"textDocument": {"uri": u}, "position": [1, 2]}),
            ("textDocument/completion", "params"),
            (DOC_TEXT, {"textDocument": "x"}),
            (DOC_TEXT, [u]),
            ("dlm/stats", [1, 2]),
        ]
        for _ in range(self.rng.randint(1, 3)):
            self.request(*self.rng.choice(reqs))
        r = self.rng.random()
        if r < 0.3:
            bad = self.deal(
                "bad changes",
                [
                    {},
                    {"x": 1},
                    5,
                    "text",
                    [None],
                    [{"text": None}],
                    [{"text": 5}],
                    [{"text": True}],
                    [{"text": ["a"]}],
                    [{"range": {"start": 5}, "text": "q"}],
                    [{"range": None, "text": 3}],
                    [{"text": "ok"}, {"text": None}],
                ],
            )
            self.notify(
                "textDocument/didChange",
                {"textDocument": {"uri": u, "version": doc.top + 1}, "contentChanges": bad},
                doc,
            )
            doc.top += 1
            await self.sync(doc, [(doc.text, doc.version), (doc.text, doc.top)])
        elif r < 0.5:
            uri = f"file:///fuzz/bad/{self.rng.randrange(99)}.py"
            td = self.deal(
                "bad opens",
                [
                    {"languageId": None, "version": "1", "text": 5},
                    {"text": None},
                    {"text": 5},
                    {"version": None},
                    {"languageId": 7},
                    {"text": ["x"]},
                ],
            )
            self.notify(
                "textDocument/didOpen",
                {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": "x", **td}},
            )
            if self.doc_text:  # an ill-typed didOpen opens nothing

                def opened_nothing(res: Any, e: LspError | None, td: Any = td) -> tuple[str, str] | None:
                    return ("divergences", f"didOpen with {td} opened {_brief(res)}") if res is not None else None

                self.request(DOC_TEXT, {"textDocument": {"uri": uri}}, check=opened_nothing)
            self.notify("textDocument/didClose", {"textDocument": {"uri": uri}})
        elif r < 0.6:
            self.notify("textDocument/didClose", self.rng.choice([{}, {"textDocument": []}, None]))
        elif r < 0.7:
            await self.change(doc, [], version=doc.top + 1)  # empty but well-typed: only the version moves
        self.ping()

    async def unknown_methods(self) -> None:
        for _ in range(self.rng.randint(1, 3)):
            m = self.rng.choice(
                ["fuzz/nothing", "$/fuzz", "textDocument/fuzz", "", "\U0001f4a5", "workspace/executeCommand2"]
            )
            self.request(
                m, self.rng.choice([{}, None, [1], {"a": {"b": []}}]), check=_expect_code(-32601, f"method {m!r}")
            )
        if self.rng.random() < 0.5:
            self.notify(self.rng.choice(["fuzz/note", "$/fuzzNote", "$/setTrace2", "textDocument/didFuzz"]), {"x": 1})
        if self.rng.random() < 0.3:  # a method name that is not a string: Invalid Request, answered
            msg_id = self.next_id()
            self.raw(
                _frame(json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": 123, "params": {}}).encode()),
                "method is a number",
            )  # the ping after it must be answered
        self.ping()

    async def bad_framing(self) -> None:
        ok = json.dumps({"jsonrpc": "2.0", "id": 0, "method": PING, "params": {}}).encode()
        kinds = {  # kind -> (bytes, whether the ping right after must be answered)
            "invalid_json": (_frame(b'{"jsonrpc": "2.0", "id": 9, "method": '), True),
            "invalid_utf8": (_frame(b'{"jsonrpc": "2.0", "method": "\xff\xfe\xc0"}'), True),
            "non_object": (
                _frame(self.rng.choice([b"42", b'"hello"', b"null", b"true", b"[]", b"{}", b"[1, 2]"])),
                True,
            ),
            "batch": (
                _frame(
                    b"["
                    + json.dumps({"jsonrpc": "2.0", "id": f"batch-{self.step:d}", "method": PING}).encode()
                    + b', {"jsonrpc": "2.0", "method": "fuzz/note"}]'
                ),
                True,
            ),
            "no_jsonrpc": (_frame(b'{"id": "nj-%d", "method": "fuzz/ping"}' % self.step), True),
            "long_content_length": (b"Content-Length: %d\r\n\r\n" % (len(ok) + 7) + ok + b"#######", True),
            "unknown_header": (b"X-Fuzz: 1\r\n" + _frame(b'{"jsonrpc": "2.0", "method": "fuzz/note"}'), True),
            "content_type": (
                b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\n"
                + _frame(b'{"jsonrpc": "2.0", "method": "fuzz/note"}'),
                True,
            ),
            "bad_content_length": (b"Content-Length: abc\r\n\r\n", False),
            "negative_content_length": (b"Content-Length: -12\r\n\r\n", False),
            "huge_content_length": (b"Content-Length: 99999999999999\r\n\r\n", False),
            "no_content_length": (b"Content-Type: text/plain\r\n\r\n", False),
            "garbage_line": (
                self.rng.choice([b"hello world\r\n\r\n", b"\r\n", b"GET / HTTP/1.1\r\n\r\n", b"\x00\x01\x02\r\n\r\n"]),
                False,
            ),
            "deep_json": (_frame(b"[" * 100_000 + b"]" * 100_000), True),
        }
        kind = self.deal("framing", sorted(kinds))
        data, strict = kinds[kind]
        self.raw(data, kind)
        if self.rng.random() < 0.3:  # and a request written in pieces, with pauses
            msg_id = self.next_id()
            body = _frame(json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": PING}).encode())
            fut = self.wire.expect(msg_id)
            for i in range(0, len(body), 7):
                self.raw(body[i : i + 7], "split write")
                await self.wire.drain()
                await asyncio.sleep(0.002)
            self.outstanding.append(Pending(msg_id, fut, time.monotonic(), self.cls, None, list(self.trace), PING))
        a = self.ping()
        b = self.ping()
        if not strict:  # the garbage may swallow the next message; the one after must be answered
            await self.settle(b)
            if a in self.outstanding:
                self.outstanding.remove(a)
                self.wire.pending.pop(a.msg_id, None)

    async def nested_params(self) -> None:
        doc = self.any_doc()
        off = doc.ref.random_offset(self.rng)
        line, char = doc.ref.position(off)
        params = _inline_params(doc.uri, line, char)
        params["textDocument"]["method"] = "exit"
        params["params"] = {"jsonrpc": "2.0", "id": 1, "method": "shutdown", "params": {"method": "exit"}}
        params["context"]["jsonrpc"] = "2.0"
        r = self.rng.random()
        if r < 0.4:
            self.complete(doc, line, char, params=params)
        elif r < 0.7:
            depth = self.rng.choice((50, 500, 5000))
            self.raw(
                _frame(
                    b'{"jsonrpc": "2.0", "method": "workspace/didChangeConfiguration", "params": {"settings": '
                    + b'{"method": "exit", "dlm": ' * depth
                    + b'{"budgetMs": "x"}'
                    + b"}" * depth
                    + b"}}"
                ),
                f"settings nested {depth} deep",
            )
        else:
            msg_id = self.next_id()
            depth = self.rng.choice((1000, 100_000))
            body = (
                b'{"jsonrpc": "2.0", "id": %d, "method": "textDocument/inlineCompletion", "params": ' % msg_id
                + b'{"a": ' * depth
                + b"1"
                + b"}" * depth
                + b"}"
            )
            self.raw(_frame(body), f"params nested {depth} deep")  # may be a parse error: answered with id null
        self.ping()

    async def lifecycle(self) -> None:
        r = self.rng.random()
        if r < 0.6 or self.launches > max(2, self.n // 200):
            self.request("initialize", {"processId": None, "rootUri": None, "capabilities": {}})
            self.notify("initialized", {})
            self.ping()
            return
        await self.settle()
        await self.stop(shutdown=r < 0.85)
        self.check_output()
        await self.launch()

    async def storm(self) -> None:
        for _ in range(self.rng.randint(30, 100)):
            r = self.rng.random()
            uri = self.rng.choice(URIS)
            doc = self.docs.get(uri)
            if doc is None:
                self.open(uri, self.snippet(300))
            elif r < 0.1:
                self.close(doc, check=False)  # its documentText might run after a later reopen
            elif r < 0.6:
                off = doc.ref.random_offset(self.rng)
                await self.change(doc, [self.insert_change(doc, off, self.snippet(3) or "q")])
                if self.rng.random() < 0.5:
                    self.at_cursor(doc, off)
            else:
                self.at_cursor(doc, doc.ref.random_offset(self.rng))
        await self.settle()
        for doc in list(self.docs.values()):
            await self.sync(doc)

    async def cancel_random(self) -> None:
        for _ in range(self.rng.randint(1, 4)):
            r = self.rng.random()
            if r < 0.4 and self.docs:
                doc = self.any_doc()
                p = self.at_cursor(doc, doc.ref.random_offset(self.rng))
                if self.rng.random() < 0.5:
                    await asyncio.sleep(self.rng.choice((0, 0.001, 0.02)))
                self.notify("$/cancelRequest", {"id": p.msg_id})
            else:
                self.notify(
                    "$/cancelRequest",
                    self.rng.choice(
                        [
                            {"id": self.rng.randint(-5, self.ids + 100)},
                            {"id": str(self.rng.randrange(99))},
                            {"id": None},
                            {"id": {"nested": 1}},
                            {},
                            None,
                            {"id": 2**63},
                        ]
                    ),
                )
        self.ping()

    async def next_edits(self) -> None:
        """An edit, then dlm/nextEdit at the current version (null or edits valid in that text), at an
        older and a future version (null), and with params of the wrong shape (InvalidParams)."""
        doc = self.any_doc()
        off = doc.ref.random_offset(self.rng)
        b = self._boundary(doc, min(len(doc.text), off + self.rng.randint(0, 12)))
        await self.change(doc, [self.range_change(doc, min(off, b), max(off, b), self.snippet(10))])
        await self.sync(doc)  # the server's version and text, whatever the edit's outcome was
        ref, version = doc.ref, doc.version
        line, char = ref.position(doc.ref.random_offset(self.rng))

        def valid(res: Any, e: LspError | None, ref: RefText = ref) -> tuple[str, str] | None:
            problem = None if e is not None else check_next_edit(res, ref)
            return None if problem is None else ("bad_ranges", problem)

        def null(res: Any, e: LspError | None) -> tuple[str, str] | None:
            return (
                None
                if e is not None or res is None
                else ("protocol", f"next edit for a version not current: {_brief(res)}")
            )

        def params(v: Any, ln: Any = line, ch: Any = char) -> dict[str, Any]:
            return {"textDocument": {"uri": doc.uri, "version": v}, "position": {"line": ln, "character": ch}}

        self.request(NEXT_EDIT, params(version), check=valid, doc=doc)
        if isinstance(version, int) and not isinstance(version, bool):
            self.request(NEXT_EDIT, params(version - 1), check=null, doc=doc)
            self.request(NEXT_EDIT, params(version + 10**6), check=null, doc=doc)
        self.request(NEXT_EDIT, params(version, 10**9, 0), check=null, doc=doc)  # past the end
        bad: Any = self.rng.choice([None, [], {"textDocument": 5}, params(version, -1, 0), params(version, "1", 0)])

        def invalid(res: Any, e: LspError | None) -> tuple[str, str] | None:
            return (
                None
                if e is not None and e.code == -32602
                else ("protocol", f"malformed nextEdit answered {_brief(res)}")
            )

        self.request(NEXT_EDIT, bad, check=invalid, doc=doc)
        if self.rng.random() < 0.5:
            await self.type_text(doc, doc.ref.random_offset(self.rng), self.snippet(6))  # a keystroke storm behind it
