"""The fuzzer's records: the client's copy of each open document (`RefDoc`) and the requests that
await an answer (`Pending`), and the documents it opens (`URIS`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dlm_lsp.measure.fuzz.reference import RefText


@dataclass
class RefDoc:
    """The client's copy of one open document, and the messages sent for it since it was opened."""

    uri: str
    lang: str
    text: str
    version: int
    top: int  # highest version sent, so the next one is higher whatever the server kept
    trace: list = field(default_factory=list)  # brief messages: the didOpen and the last ones
    left_out: int = 0  # messages dropped from the middle of `trace`
    full: list | None = field(default_factory=list)  # every message whole (None: too big to keep)
    edits: int = 0
    history: list = field(default_factory=list)  # (edit number, text) of recent states
    _ref: RefText | None = None

    def set(self, text: str, version) -> None:
        self.text, self.version = text, version
        self.history.append((self.edits, text))
        del self.history[:-16]

    def since(self, edit_no: int) -> list[str]:
        """The texts this document had from edit `edit_no` on (the states a late answer may see)."""
        return [t for n, t in self.history if n > edit_no]

    @property
    def ref(self) -> RefText:
        if self._ref is None or self._ref.text is not self.text:
            self._ref = RefText(self.text)
        return self._ref


@dataclass
class Pending:
    msg_id: object
    fut: asyncio.Future
    sent: float
    cls: str
    check: object  # (result, error) -> (check name, problem) | None
    trace: list
    method: str
    doc: RefDoc | None = None
    n_full: int | None = None  # len(doc.full) when it was sent
    limit: float | None = None  # seconds it may take (None: the fuzzer's --timeout)


URIS = [f"file:///fuzz/src/m{i}.py" for i in range(12)] + [
    "file:///fuzz/src/app.js",
    "file:///fuzz/src/lib.rs",
    "file:///fuzz/src/main.go",
    "file:///fuzz/notes.txt",
    "untitled:Untitled-1",
    "file:///fuzz/d%C3%A9j%C3%A0/v.py",
    "file:///fuzz/with%20space.py",
    "file:///c%3A/fuzz/win.py",
]
LANGS = {".py": "python", ".js": "javascript", ".rs": "rust", ".go": "go", ".txt": "plaintext"}


def _lang(uri: str) -> str:
    return next((v for k, v in LANGS.items() if uri.endswith(k)), "python")
