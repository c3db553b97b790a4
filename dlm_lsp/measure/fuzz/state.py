"""The fuzzer's records: the client's copy of each open document (`RefDoc`) and the requests that
await an answer (`Pending`), the documents it opens (`URIS`), and the type checker's view of the
composed `Fuzzer` that its mixins share (`FuzzerState`)."""

from __future__ import annotations

import asyncio
import collections
import random
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from dlm_lsp.measure.fuzz.reference import RefText

if TYPE_CHECKING:
    from dlm_lsp.measure.fuzz.checks import Check
    from dlm_lsp.measure.fuzz.client import FuzzClient


@dataclass
class RefDoc:
    """The client's copy of one open document, and the messages sent for it since it was opened."""

    uri: str
    lang: str
    text: str
    version: int
    top: int  # highest version sent, so the next one is higher whatever the server kept
    trace: list[Any] = field(default_factory=list)  # brief messages: the didOpen and the last ones
    left_out: int = 0  # messages dropped from the middle of `trace`
    full: list[Any] | None = field(default_factory=list)  # every message whole (None: too big to keep)
    edits: int = 0
    history: list[tuple[int, str]] = field(default_factory=list)  # (edit number, text) of recent states
    _ref: RefText | None = None

    def set(self, text: str, version: Any) -> None:
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
    msg_id: Any
    fut: asyncio.Future[Any]
    sent: float
    cls: str
    check: Check | None  # (result, error) -> (check name, problem) | None
    trace: list[Any]
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


class FuzzerState:
    """The composed `Fuzzer` as its mixins see it, for the type checker: the state `Fuzzer.__init__`
    sets, and the methods one mixin calls on another. Every mixin inherits it; at run time it holds
    nothing (annotations only; the methods are declared under TYPE_CHECKING, defined by the mixins)."""

    # the run's settings (fuzzer.py)
    n: int
    seed: int
    model: str | None
    timeout: float
    max_doc_bytes: int
    options: dict[str, Any]
    cmd: list[str]
    log_path: str | None
    keep: int
    shrink: bool
    rng: random.Random
    classes: dict[str, int]
    corpus: str
    # the server process and its stderr (lifetime.py)
    client: FuzzClient | None
    log: IO[bytes] | None
    launches: int
    expect_exit: bool
    doc_text: bool | None  # does the server answer dlm/documentText
    # documents, requests and what was seen (editing.py, messages.py)
    docs: dict[str, RefDoc]
    outstanding: list[Pending]
    trace: collections.deque[Any]
    counts: dict[str, dict[str, int]]
    failed: dict[str, int]
    failures: list[dict[str, Any]]
    cls: str
    step: int
    ids: int
    answered: int
    error_codes: collections.Counter[Any]
    decks: dict[str, list[Any]]
    stalls: list[tuple[float, float]]
    last_tick: float
    ranges_checked: int
    stray: int

    if TYPE_CHECKING:
        # messages.py
        def fail(
            self,
            check: str,
            detail: str,
            trace: list[Any] | None = ...,
            doc: RefDoc | None = ...,
            n_full: int | None = ...,
        ) -> None: ...
        def deal(self, deck: str, cards: list[Any]) -> Any: ...
        def next_id(self) -> int: ...
        def notify(self, method: str, params: Any, doc: RefDoc | None = ...) -> None: ...
        def request(
            self, method: str, params: Any, check: Check | None = ..., doc: RefDoc | None = ..., msg_id: Any = ...
        ) -> Pending: ...
        def raw(self, data: bytes, note: str) -> None: ...
        def ping(self, check: Check | None = ...) -> Pending: ...
        async def settle(self, *only: Pending) -> None: ...
        def alive(self) -> bool: ...
        @property
        def wire(self) -> FuzzClient: ...

        # lifetime.py
        async def launch(self) -> None: ...
        async def relaunch(self) -> None: ...
        def check_output(self) -> None: ...
        async def stop(self, shutdown: bool = ...) -> None: ...

        # editing.py
        def free_uri(self) -> str | None: ...
        def snippet(self, most: int = ...) -> str: ...
        def open(self, uri: str, text: str, lang: str | None = ..., version: int = ...) -> RefDoc: ...
        def any_doc(self) -> RefDoc: ...
        async def change(
            self, doc: RefDoc, changes: list[Any], version: Any = ..., loose_version: bool = ...
        ) -> None: ...
        async def sync(self, doc: RefDoc, outcomes: list[tuple[str, Any]] | None = ...) -> None: ...
        def close(self, doc: RefDoc, check: bool = ...) -> None: ...
        async def close_checked(self, doc: RefDoc) -> None: ...
        def complete(
            self, doc: RefDoc, line: Any, char: Any, method: str = ..., params: dict[str, Any] | None = ...
        ) -> Pending: ...
        def at_cursor(self, doc: RefDoc, offset: int, method: str = ...) -> Pending: ...
        def insert_change(self, doc: RefDoc, offset: int, text: str) -> dict[str, Any]: ...
        def range_change(self, doc: RefDoc, a: int, b: int, text: str) -> dict[str, Any]: ...
        async def type_text(self, doc: RefDoc, offset: int, text: str, ask: float = ...) -> int: ...
        def _boundary(self, doc: RefDoc, b: int) -> int: ...
