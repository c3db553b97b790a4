"""Documents: opening, editing and closing them with their reference copy kept in step, syncing
with the server's copy (dlm/documentText), and asking for fills whose ranges are checked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dlm_lsp.measure.fuzz.checks import _brief, _first_diff, _ranges, check_answer
from dlm_lsp.measure.fuzz.client import DOC_TEXT, _inline_params
from dlm_lsp.measure.fuzz.reference import ANY_VERSION, RefText, _is_int, edit_outcomes, norm, resolve
from dlm_lsp.measure.fuzz.state import URIS, FuzzerState, Pending, RefDoc, _lang

if TYPE_CHECKING:
    from dlm_lsp.measure.replay import LspError


class DocumentsMixin(FuzzerState):
    """Fuzzer's documents: what is open, how edits and fills are sent and checked."""

    def free_uri(self) -> str | None:
        free = [u for u in URIS if u not in self.docs]
        return self.rng.choice(free) if free else None

    def snippet(self, most: int = 400) -> str:
        a = self.rng.randrange(len(self.corpus))
        a = self.corpus.rfind("\n", 0, a) + 1
        return self.corpus[a : a + self.rng.randint(0, most)]

    def open(self, uri: str, text: str, lang: str | None = None, version: int = 1) -> RefDoc:
        text = norm(text)
        doc = RefDoc(uri, lang if lang is not None else _lang(uri), text, version, version)
        doc.history.append((0, text))
        self.docs[uri] = doc
        self.notify(
            "textDocument/didOpen",
            {"textDocument": {"uri": uri, "languageId": doc.lang, "version": version, "text": text}},
            doc,
        )
        return doc

    def any_doc(self) -> RefDoc:
        """An open document (opening one when none is)."""
        if self.docs and self.rng.random() < 0.8:
            return self.docs[self.rng.choice(sorted(self.docs))]
        uri = self.free_uri() or self.rng.choice(sorted(self.docs))
        if uri in self.docs:
            return self.docs[uri]
        return self.open(uri, self.snippet())

    async def change(self, doc: RefDoc, changes: list[Any], version: Any = None, loose_version: bool = False) -> None:
        """Sends a didChange; a single outcome becomes the reference, several are resolved at once."""
        if version is None:
            version = doc.top + 1
        if _is_int(version):
            doc.top = max(doc.top, version)
        outcomes = edit_outcomes(doc.text, doc.version, changes, version, loose_version, doc.ref)
        self.notify(
            "textDocument/didChange",
            {"textDocument": {"uri": doc.uri, "version": version}, "contentChanges": changes},
            doc,
        )
        doc.edits += 1
        if len(outcomes) == 1:
            doc.set(*outcomes[0])
            if doc.edits % 4 == 0 and self.rng.random() < 0.5:
                await self.sync(doc)
        else:
            await self.sync(doc, outcomes)

    async def sync(self, doc: RefDoc, outcomes: list[tuple[str, Any]] | None = None) -> None:
        """Compares the server's copy with the reference (adopting one of `outcomes` when the edit's
        outcome was open); without dlm/documentText an open outcome reopens the document."""
        outcomes = outcomes or [(doc.text, doc.version)]
        if not self.doc_text:
            if len(outcomes) > 1:
                self.reopen(doc, outcomes[0][0])
            return
        p = self.request(DOC_TEXT, {"textDocument": {"uri": doc.uri}}, doc=doc)
        await self.settle(p)
        if not p.fut.done() or p.fut.exception() is not None:
            if p.fut.done() and not isinstance(p.fut.exception(), ConnectionError):
                self.fail("divergences", f"documentText failed: {p.fut.exception()}", doc.trace)
            return
        got = p.fut.result()
        if isinstance(got, dict) and isinstance(got.get("text"), str):
            got["text"] = norm(got["text"])
        if not isinstance(got, dict) or not any(
            got.get("text") == t and v in (got.get("version"), ANY_VERSION) for t, v in outcomes
        ):
            want = " or ".join(f"version {v} text {_brief(t)!r}" for t, v in outcomes[:4])
            have = (
                f"version {got.get('version')} text {_brief(got.get('text'))!r}" if isinstance(got, dict) else repr(got)
            )
            self.fail(
                "divergences",
                f"{doc.uri}: server has {have}; client has {want}{_first_diff(got, outcomes[0][0])}",
                doc=doc,
            )
            if isinstance(got, dict) and isinstance(got.get("text"), str) and _is_int(got.get("version")):
                doc.set(got["text"], got["version"])  # go on from the server's state
            else:
                self.reopen(doc, outcomes[0][0])
            return
        doc.set(got["text"], got["version"])

    def reopen(self, doc: RefDoc, text: str) -> None:
        """Closes and reopens `doc` with `text`: a known state again, in the same RefDoc."""
        self.notify("textDocument/didClose", {"textDocument": {"uri": doc.uri}}, doc)
        doc.top += 1
        doc.edits += 1
        doc.set(norm(text), doc.top)
        self.notify(
            "textDocument/didOpen",
            {"textDocument": {"uri": doc.uri, "languageId": doc.lang, "version": doc.top, "text": doc.text}},
            doc,
        )
        self.docs[doc.uri] = doc

    def close(self, doc: RefDoc, check: bool = True) -> None:
        self.notify("textDocument/didClose", {"textDocument": {"uri": doc.uri}}, doc)
        self.docs.pop(doc.uri, None)
        if check and self.doc_text:
            self.request(
                DOC_TEXT,
                {"textDocument": {"uri": doc.uri}},
                doc=doc,
                check=lambda r, e: ("protocol", f"documentText of a closed document: {_brief(r)}")
                if r is not None
                else None,
            )

    async def close_checked(self, doc: RefDoc) -> None:
        await self.sync(doc)
        if doc.uri in self.docs:
            self.close(doc)

    def complete(
        self,
        doc: RefDoc,
        line: Any,
        char: Any,
        method: str = "textDocument/inlineCompletion",
        params: dict[str, Any] | None = None,
    ) -> Pending:
        """Requests a fill at (line, char); its ranges are checked against the text as it is now."""
        ref, sent_at = doc.ref, doc.edits
        pos = {"line": line, "character": char}

        def check(result: Any, err: LspError | None) -> tuple[str, str] | None:
            if err is not None:
                return None
            self.ranges_checked += len(_ranges(method, result)[0])
            problem = check_answer(method, result, ref, resolve(ref, pos)[0])
            if problem is None:
                return None
            # the server may have read the document a few messages later (its handlers start after
            # the messages already buffered): a range valid in one of those states is not flagged
            for text in doc.since(sent_at):
                later = RefText(text)
                if check_answer(method, result, later, resolve(later, pos)[0]) is None:
                    return None
            return "bad_ranges", f"{method} at {line}:{char} of {doc.uri}: {problem}"

        return self.request(method, params or _inline_params(doc.uri, line, char), check=check, doc=doc)

    def at_cursor(self, doc: RefDoc, offset: int, method: str = "textDocument/inlineCompletion") -> Pending:
        line, char = doc.ref.position(offset)
        return self.complete(doc, line, char, method)

    def insert_change(self, doc: RefDoc, offset: int, text: str) -> dict[str, Any]:
        line, char = doc.ref.position(self._boundary(doc, offset))
        return {
            "range": {"start": {"line": line, "character": char}, "end": {"line": line, "character": char}},
            "text": text,
        }

    def range_change(self, doc: RefDoc, a: int, b: int, text: str) -> dict[str, Any]:
        (la, ca), (lb, cb) = doc.ref.position(self._boundary(doc, a)), doc.ref.position(self._boundary(doc, b))
        return {"range": {"start": {"line": la, "character": ca}, "end": {"line": lb, "character": cb}}, "text": text}

    async def type_text(self, doc: RefDoc, offset: int, text: str, ask: float = 0.7) -> int:
        """Types `text` at `offset` one piece at a time, asking for a fill after most keystrokes."""
        i = 0
        while i < len(text):
            k = self.rng.choice((1, 1, 1, 2, 3))
            piece = text[i : i + k]
            offset = self._boundary(doc, offset)
            await self.change(doc, [self.insert_change(doc, offset, piece)])
            offset += len(piece)
            i += k
            if self.rng.random() < ask:
                self.at_cursor(
                    doc,
                    offset,
                    "textDocument/completion" if self.rng.random() < 0.15 else "textDocument/inlineCompletion",
                )
        return offset

    def _boundary(self, doc: RefDoc, b: int) -> int:
        """`b` moved off the middle of a \\r\\n (no position names that place)."""
        return b + 1 if 0 < b < len(doc.text) and doc.text[b - 1] == "\r" and doc.text[b] == "\n" else b
