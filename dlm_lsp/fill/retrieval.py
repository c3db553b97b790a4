"""Cross-file snippets: the chunks of other files that look most like the code at the cursor.

The copy boost's far side and the identifier-aware decoding read a fill's far text
(`FillRequest.far`): the rest of the document and, before it, cross-file context. Instead of the
start of every other open document, `SnippetIndex` cuts each source (an open document, a workspace
file) into overlapping windows of CHUNK_LINES lines and gives the ones whose identifiers overlap
most with the lines around the cursor (QUERY_LINES above, QUERY_AFTER below; Jaccard similarity of identifier sets, as Copilot's and
Continue's neighbouring-tab snippets do), up to a character budget.

Identifiers seen in more than COMMON_SHARE of the chunks (and keywords) carry no signal and are left
out of every set. The index is inverted (identifier -> chunks), so a search costs the posting lists
of the query's identifiers, not a scan of the workspace: numpy over those lists, then the best
non-overlapping windows up to the budget, about 1-3 ms on an index of 23k windows (the measurement:
docs/research/29-s20-workspace-snippets.md).

Memory: each source's text is kept once and, per window, only its span and identifier count; the
identifier sets live only in the postings (4-byte entries). The index is about 2.4x the indexed
text (24 MB for 10 MB of code, where windows holding their own text and sets took 157 MB), so a
workspace's files fit beside the model.
"""

from __future__ import annotations

import keyword
import re
from array import array
from dataclasses import dataclass

import numpy as np

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CHUNK_LINES = 24  # lines per window
STRIDE = 12  # windows start every STRIDE lines (they overlap by half)
QUERY_LINES = 24  # lines above the cursor (and its own line) that make the query
QUERY_AFTER = (
    8  # ... and lines below it (docs/research/29-s20-workspace-snippets.md: 702 exact of 4,000 against 683 without)
)
COMMON_SHARE = 0.3  # identifiers in more of the chunks than this are stop words
MIN_COMMON_CHUNKS = 20  # ... once there are at least this many chunks
MAX_CHUNK_CHARS = 4000  # a window of longer lines is cut (minified or data files)
# characters of snippets a fill gets: 12k and 24k wrote the same exact fills on 4,000 held-out line
# holes, 12k kept as many characters or more, 48k fewer (docs/research/29-s20-workspace-snippets.md)
SNIPPET_CHARS = 12000
_KEYWORDS = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | {"self", "cls", "None", "True", "False"}


def identifiers(text: str) -> frozenset[str]:
    """The identifiers of `text` less keywords and one-letter names."""
    return frozenset(w for w in IDENT.findall(text) if len(w) > 1 and w not in _KEYWORDS)


def window_spans(text: str, lines: int = CHUNK_LINES, stride: int = STRIDE) -> list[tuple[int, int, int]]:
    """(first line, start, end) of each window of `lines` lines starting every `stride` lines: the
    window's text is text[start:end] (no line break at its end, at most MAX_CHUNK_CHARS); windows
    of whitespace only are dropped."""
    starts = [0]
    i = text.find("\n")
    while i >= 0:
        starts.append(i + 1)
        i = text.find("\n", i + 1)
    n = len(starts)  # rows, as text.split("\n") has them
    out = []
    for first in range(0, max(1, n - lines + stride), stride):
        a = starts[first]
        b = starts[first + lines] - 1 if first + lines < n else len(text)
        b = min(b, a + MAX_CHUNK_CHARS)
        if text[a:b].strip():
            out.append((first, a, b))
    return out


def windows(text: str, lines: int = CHUNK_LINES, stride: int = STRIDE) -> list[tuple[int, str]]:
    """(first line, text) of each window (window_spans)."""
    return [(line, text[a:b]) for line, a, b in window_spans(text, lines, stride)]


@dataclass(frozen=True)
class Chunk:
    source: str
    line: int  # first line of the window in its source
    text: str


class SnippetIndex:
    """Windows of several sources, searchable by the identifiers of a query text.

    A search is a few numpy operations over the posting lists of the query's identifiers (their
    arrays cached until an add changes them), so it costs milliseconds on a workspace of thousands of
    files; the greedy pick of the top windows is the only Python loop. Memory: each source's text
    once, and per window its place and identifier count; the identifier sets live only in the
    postings (4 bytes an entry): ~3x the indexed text in all."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._texts: dict[str, str] = {}
        self._by_source: dict[str, range] = {}
        self._source: list[str | None] = []  # per window: its source (None: removed)
        self._line = array("i")
        self._span = array("q")  # start, end of each window in its source's text
        self._nident = array("i")  # identifiers per window
        self._postings: dict[str, array] = {}  # identifier -> windows (removed ones included until compact)
        self._arrays: dict[str, np.ndarray] = {}  # identifier -> its postings as an array (dropped when they grow)
        self._live = 0
        self._version = 0  # changes with every add and remove
        self._sizes_key: tuple = ()
        self._sizes = np.zeros(0, dtype=np.int64)  # identifiers per window less the common ones
        self._alive = np.zeros(0, dtype=bool)

    def __len__(self) -> int:
        return self._live

    def sources(self) -> list[str]:
        return list(self._by_source)

    def chunk(self, i: int) -> Chunk | None:
        """Window i (None once its source was removed)."""
        source = self._source[i]
        if source is None:
            return None
        return self._window(i, source)

    def _window(self, i: int, source: str) -> Chunk:
        """Window i of `source` (its live source)."""
        a, b = self._span[2 * i], self._span[2 * i + 1]
        return Chunk(source, self._line[i], self._texts[source][a:b])

    def add(self, source: str, text: str) -> None:
        """Indexes `text` as `source`, replacing what `source` held."""
        self.remove(source)
        first = len(self._source)
        for line, a, b in window_spans(text):
            idents = identifiers(text[a:b])
            if not idents:
                continue
            i = len(self._source)
            self._source.append(source)
            self._line.append(line)
            self._span.extend((a, b))
            self._nident.append(len(idents))
            for w in idents:
                p = self._postings.get(w)
                if p is None:
                    p = self._postings[w] = array("i")
                p.append(i)
                self._arrays.pop(w, None)
        self._texts[source] = text
        self._by_source[source] = range(first, len(self._source))
        self._live += len(self._source) - first
        self._version += 1

    def remove(self, source: str) -> None:
        ids = self._by_source.pop(source, None)
        if ids is None:
            return
        del self._texts[source]
        for i in ids:
            self._source[i] = None  # searches mask dead windows; compact() drops them
        self._live -= len(ids)
        self._version += 1
        if len(self._source) > 1024 and self._live < len(self._source) // 2:
            self.compact()

    def compact(self) -> None:
        """Re-indexes the live sources, without the windows of removed ones (the same order)."""
        texts = sorted(self._texts.items(), key=lambda kv: self._by_source[kv[0]].start)
        self._reset()
        for source, text in texts:
            self.add(source, text)

    def _array(self, w: str) -> np.ndarray:
        a = self._arrays.get(w)
        if a is None:
            a = self._arrays[w] = np.array(self._postings[w], dtype=np.int64)
        return a

    def _counts(self, common: int) -> None:
        """Brings _sizes (identifiers per window under the common limit) and _alive up to date."""
        if self._sizes_key == (common, self._version):
            return
        n = len(self._source)
        frequent = [self._array(w) for w, p in self._postings.items() if len(p) > common]
        minus = np.bincount(np.concatenate(frequent), minlength=n) if frequent else np.zeros(n, dtype=np.int64)
        self._sizes = np.frombuffer(self._nident, dtype=np.int32).astype(np.int64) - minus
        self._alive = np.fromiter((s is not None for s in self._source), dtype=bool, count=n)
        self._sizes_key = (common, self._version)

    def search(
        self, query: str, limit_chars: int, exclude: str | None = None, max_postings: int | None = None
    ) -> list[Chunk]:
        """The windows most like `query` (Jaccard similarity of identifier sets, common identifiers
        left out), at most `limit_chars` characters of them, no two overlapping in one source, the
        most similar first (ties: the earlier indexed). Windows of `exclude` (the document being
        filled) are skipped."""
        common = max(MIN_COMMON_CHUNKS, int(COMMON_SHARE * self._live)) if max_postings is None else max_postings
        q = [w for w in identifiers(query) if len(self._postings.get(w, ())) <= common]  # unseen ones count too
        present = [self._array(w) for w in q if w in self._postings]
        if not present or limit_chars <= 0:
            return []
        self._counts(common)
        n = len(self._source)
        shared = np.bincount(np.concatenate(present), minlength=n)
        ok = (shared > 0) & self._alive
        if exclude is not None and exclude in self._by_source:
            r = self._by_source[exclude]
            ok[r.start : r.stop] = False
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
            source, line = self._source[i], self._line[i]
            assert source is not None  # candidates are live windows (_alive)
            if any(abs(line - l) < CHUNK_LINES for l in taken.get(source, ())):
                continue
            size = self._span[2 * i + 1] - self._span[2 * i]
            if used + size + 1 > limit_chars:
                if used + 200 > limit_chars:
                    break
                continue
            out.append(self._window(i, source))
            taken.setdefault(source, []).append(line)
            used += size + 1
        return out


def query_text(text: str, offset: int, lines: int = QUERY_LINES, after: int = QUERY_AFTER) -> str:
    """The query for a cursor at str `offset`: the `lines` lines above it and its line up to it, then
    the text after it up to the (after + 1)-th line break past its first character (the rest of its
    line and `after` lines below; one more when the cursor ends its line)."""
    start = offset
    for _ in range(lines + 1):
        j = text.rfind("\n", 0, start)
        if j < 0:
            start = 0
            break
        start = j
        if start == 0:
            break
    end = offset
    for _ in range(after + 1):
        j = text.find("\n", end + 1)
        if j < 0:
            end = len(text)
            break
        end = j
    return text[start:end]


def cross_file_text(index: SnippetIndex, text: str, offset: int, limit_chars: int, exclude: str | None = None) -> str:
    """The cross-file far text of a fill at str `offset` of `text`: the chunks of `index` most like
    the lines around the cursor (`query_text`), the document's own source (`exclude`) left out."""
    return snippet_text(index.search(query_text(text, offset), limit_chars, exclude=exclude))


def snippet_text(chunks: list[Chunk]) -> str:
    """Far text of `chunks` (most similar first): the most similar last, where the far text's cut
    (it keeps its end) reaches it last."""
    return "".join(c.text + "\n" for c in reversed(chunks))
