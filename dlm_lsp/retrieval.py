"""Cross-file snippets: the chunks of other files that look most like the code at the cursor.

The copy boost's far side and the identifier-aware decoding read a fill's far text
(`FillRequest.far`): the rest of the document and, before it, cross-file context. Instead of the
start of every other open document, `SnippetIndex` cuts each source (an open document, a workspace
file) into overlapping windows of CHUNK_LINES lines and gives the ones whose identifiers overlap
most with the lines above the cursor (Jaccard similarity of identifier sets, as Copilot's and
Continue's neighbouring-tab snippets do), up to a character budget.

Identifiers seen in more than COMMON_SHARE of the chunks (and keywords) carry no signal and are left
out of every set. The index is inverted (identifier -> chunks), so a search costs the posting lists
of the query's identifiers, not a scan of the workspace.
"""
from __future__ import annotations

import keyword
import re
from dataclasses import dataclass

import numpy as np

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CHUNK_LINES = 24  # lines per window
STRIDE = 12  # windows start every STRIDE lines (they overlap by half)
QUERY_LINES = 24  # lines above the cursor (and its own line) that make the query
COMMON_SHARE = 0.3  # identifiers in more of the chunks than this are stop words
MIN_COMMON_CHUNKS = 20  # ... once there are at least this many chunks
MAX_CHUNK_CHARS = 4000  # a window of longer lines is cut (minified or data files)
# characters of snippets a fill gets: 12k and 24k wrote the same exact fills on 4,000 held-out line
# holes, 12k kept as many characters or more, 48k fewer (docs/MODEL.md, "Session 20")
SNIPPET_CHARS = 12000
_KEYWORDS = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | {"self", "cls", "None", "True", "False"}


def identifiers(text: str) -> frozenset[str]:
    """The identifiers of `text` less keywords and one-letter names."""
    return frozenset(w for w in IDENT.findall(text) if len(w) > 1 and w not in _KEYWORDS)


def windows(text: str, lines: int = CHUNK_LINES, stride: int = STRIDE) -> list[tuple[int, str]]:
    """(first line, text) of each window of `lines` lines starting every `stride` lines; windows
    with no identifier are dropped."""
    rows = text.split("\n")
    out = []
    for start in range(0, max(1, len(rows) - lines + stride), stride):
        chunk = "\n".join(rows[start : start + lines])[:MAX_CHUNK_CHARS]
        if chunk.strip():
            out.append((start, chunk))
    return out


@dataclass(frozen=True)
class Chunk:
    source: str
    line: int  # first line of the window in its source
    text: str
    idents: frozenset[str]


class SnippetIndex:
    """Windows of several sources, searchable by the identifiers of a query text.

    A search is a few numpy operations over the posting lists of the query's identifiers (their
    arrays cached until an add changes them), so it costs milliseconds on a workspace of thousands of
    files; the greedy pick of the top chunks is the only Python loop."""

    def __init__(self):
        self._chunks: list[Chunk | None] = []
        self._by_source: dict[str, list[int]] = {}
        self._postings: dict[str, list[int]] = {}  # identifier -> chunks (removed ones included until compact)
        self._arrays: dict[str, np.ndarray] = {}  # identifier -> its postings as an array (dropped when they grow)
        self._nident: list[int] = []  # identifiers per chunk
        self._live = 0
        self._version = 0  # changes with every add and remove
        self._sizes_key: tuple = ()
        self._sizes = np.zeros(0, dtype=np.int64)  # identifiers per chunk less the common ones
        self._alive = np.zeros(0, dtype=bool)

    def __len__(self) -> int:
        return self._live

    def sources(self) -> list[str]:
        return list(self._by_source)

    def add(self, source: str, text: str) -> None:
        """Indexes `text` as `source`, replacing what `source` held."""
        self.remove(source)
        ids = []
        for line, chunk in windows(text):
            idents = identifiers(chunk)
            if not idents:
                continue
            i = len(self._chunks)
            self._chunks.append(Chunk(source, line, chunk, idents))
            self._nident.append(len(idents))
            for w in idents:
                self._postings.setdefault(w, []).append(i)
                self._arrays.pop(w, None)
            ids.append(i)
        self._by_source[source] = ids
        self._live += len(ids)
        self._version += 1

    def remove(self, source: str) -> None:
        ids = self._by_source.pop(source, None)
        if ids is None:
            return
        for i in ids:
            self._chunks[i] = None  # searches mask dead chunks; compact() drops them
        self._live -= len(ids)
        self._version += 1
        if len(self._chunks) > 1024 and self._live < len(self._chunks) // 2:
            self.compact()

    def compact(self) -> None:
        """Rebuilds the lists without the chunks of removed sources."""
        live = [c for c in self._chunks if c is not None]
        self._chunks, self._by_source, self._postings, self._arrays, self._nident = [], {}, {}, {}, []
        self._live = 0
        for c in live:
            i = len(self._chunks)
            self._chunks.append(c)
            self._nident.append(len(c.idents))
            self._by_source.setdefault(c.source, []).append(i)
            for w in c.idents:
                self._postings.setdefault(w, []).append(i)
            self._live += 1
        self._version += 1

    def _array(self, w: str) -> np.ndarray:
        a = self._arrays.get(w)
        if a is None:
            a = self._arrays[w] = np.asarray(self._postings[w], dtype=np.int64)
        return a

    def _counts(self, common: int) -> None:
        """Brings _sizes (identifiers per chunk under the common limit) and _alive up to date."""
        if self._sizes_key == (common, self._version):
            return
        n = len(self._chunks)
        frequent = [self._array(w) for w, p in self._postings.items() if len(p) > common]
        minus = np.bincount(np.concatenate(frequent), minlength=n) if frequent else np.zeros(n, dtype=np.int64)
        self._sizes = np.asarray(self._nident, dtype=np.int64) - minus
        self._alive = np.fromiter((c is not None for c in self._chunks), dtype=bool, count=n)
        self._sizes_key = (common, self._version)

    def search(self, query: str, limit_chars: int, exclude: str | None = None,
               max_postings: int | None = None) -> list[Chunk]:
        """The chunks most like `query` (Jaccard similarity of identifier sets, common identifiers
        left out), at most `limit_chars` characters of them, no two overlapping in one source, the
        most similar first (ties: the earlier indexed). Chunks of `exclude` (the document being
        filled) are skipped."""
        common = max(MIN_COMMON_CHUNKS, int(COMMON_SHARE * self._live)) if max_postings is None else max_postings
        q = [w for w in identifiers(query) if len(self._postings.get(w, ())) <= common]  # unseen ones count too
        present = [self._array(w) for w in q if w in self._postings]
        if not present or limit_chars <= 0:
            return []
        self._counts(common)
        n = len(self._chunks)
        shared = np.bincount(np.concatenate(present), minlength=n)
        ok = (shared > 0) & self._alive
        for i in self._by_source.get(exclude, ()) if exclude is not None else ():
            ok[i] = False
        cand = np.nonzero(ok)[0]
        if not len(cand):
            return []
        sh = shared[cand].astype(np.float64)
        score = sh / (len(q) + self._sizes[cand] - sh)
        order = cand[np.lexsort((cand, -score))]
        out: list[Chunk] = []
        taken: dict[str, list[int]] = {}
        used = 0
        for i in order.tolist():
            c = self._chunks[i]
            if any(abs(c.line - l) < CHUNK_LINES for l in taken.get(c.source, ())):
                continue
            if used + len(c.text) + 1 > limit_chars:
                if used + 200 > limit_chars:
                    break
                continue
            out.append(c)
            taken.setdefault(c.source, []).append(c.line)
            used += len(c.text) + 1
        return out


def query_text(text: str, offset: int, lines: int = QUERY_LINES) -> str:
    """The query for a cursor at str `offset`: the `lines` lines above it and its line up to it."""
    start = offset
    for _ in range(lines + 1):
        j = text.rfind("\n", 0, start)
        if j < 0:
            start = 0
            break
        start = j
        if start == 0:
            break
    return text[start:offset]


def cross_file_text(index: SnippetIndex, text: str, offset: int, limit_chars: int, exclude: str | None = None) -> str:
    """The cross-file far text of a fill at str `offset` of `text`: the chunks of `index` most like
    the lines above the cursor (the document's own source, `exclude`, left out)."""
    return snippet_text(index.search(query_text(text, offset), limit_chars, exclude=exclude))


def snippet_text(chunks: list[Chunk]) -> str:
    """Far text of `chunks` (most similar first): the most similar last, where the far text's cut
    (it keeps its end) reaches it last."""
    return "".join(c.text + "\n" for c in reversed(chunks))
