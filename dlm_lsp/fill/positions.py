"""LSP positions <-> offsets into a Python str, converted once at the protocol boundary.

LSP counts a column in code units of the negotiated encoding: UTF-16 unless the client offered
something else in `general.positionEncodings` (Neovim offers UTF-8 first, and pygls takes it).
Python strings index code points, so a column is converted here and nowhere else; everything
behind this module works on str offsets.

The rules are the spec's (and those of vscode-languageserver-textdocument, the model most clients
keep):
- Lines end at "\\n", "\\r\\n" or a lone "\\r", and nowhere else: form feed, vertical tab,
  \\x1c-\\x1e, \\x85, \\u2028 and \\u2029 (which `str.splitlines` breaks at) are ordinary characters.
- A column past a line's content clamps to the end of the content (before its line break); a line
  past the last one clamps to the end of the document; negative values clamp to 0.
- A lone surrogate (a str can hold one: JSON "\\ud800") is one UTF-16 unit and three UTF-8 bytes
  (as `surrogatepass` encodes it); an astral character is two UTF-16 units, and a column between
  them means the position before the character (as VS Code's editor validates positions; a UTF-8
  column inside a character likewise).
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate
from typing import overload

UTF8, UTF16, UTF32 = "utf-8", "utf-16", "utf-32"

_BREAK = re.compile(r"\r\n?|\n")


def units_len(text: str, encoding: str = UTF16) -> int:
    """Length of `text` in code units of `encoding`."""
    if encoding == UTF32 or text.isascii():  # isascii is O(1) on CPython strs
        return len(text)
    if encoding == UTF16:
        return len(text.encode("utf-16-le", "surrogatepass")) // 2
    return len(text.encode("utf-8", "surrogatepass"))


def utf8_len(text: str) -> int:
    """Length of `text` in UTF-8 bytes, a lone surrogate counting 3 (the bytes tree-sitter gets)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def column_to_index(line: str, column: int, encoding: str = UTF16) -> int:
    """Returns the str index in `line` (a line's content, without its break) of an LSP column;
    clamps past the end. A column inside a character (the middle of a surrogate pair, of a UTF-8
    sequence) means the index before that character."""
    if column <= 0:
        return 0
    if encoding == UTF32 or line.isascii():
        return min(column, len(line))
    if encoding == UTF16:
        raw = line.encode("utf-16-le", "surrogatepass")
        if 2 * column >= len(raw):
            return len(line)
        head = raw[: 2 * column].decode("utf-16-le", "surrogatepass")
        i = len(head)
        if line.startswith(head):
            return i
        if ord(line[i - 1]) > 0xFFFF and line.startswith(head[:-1]):
            return i - 1  # a cut inside a pair decoded its high half alone
        # the decoder joined a lone high and a lone low surrogate of the str into one character
        seen = 0
        for i, ch in enumerate(line):
            if seen >= column:
                return i
            seen += 2 if ord(ch) > 0xFFFF else 1
            if seen > column:
                return i
        return len(line)
    raw = line.encode("utf-8", "surrogatepass")
    if column >= len(raw):
        return len(line)
    try:
        return len(raw[:column].decode("utf-8", "surrogatepass"))
    except UnicodeDecodeError as e:  # a cut inside a sequence: before that character
        return len(raw[: e.start].decode("utf-8", "surrogatepass"))


def index_to_column(line: str, index: int, encoding: str = UTF16) -> int:
    """Returns the LSP column of str index `index` in `line`."""
    return units_len(line[: max(0, index)], encoding)


def line_starts(text: str) -> list[int]:
    """Offsets where each line begins (the first is 0): after each "\\n", "\\r\\n" and lone "\\r"."""
    if "\r" not in text:  # the common case, at C speed: 20 ms for 130k lines instead of 70
        parts = text.split("\n")
        parts.pop()
        return list(accumulate([len(p) + 1 for p in parts], initial=0))
    return [0, *(m.end() for m in _BREAK.finditer(text))]


def _starts_in(text: str, lo: int, hi: int) -> list[int]:
    """The line starts s of `text` with lo <= s <= hi. Whether s starts a line depends on
    text[s - 1] and text[s] only, so the scan covers text[lo - 1 : hi + 1]."""
    lo = max(lo, 1)
    return [m.end() for m in _BREAK.finditer(text, lo - 1, min(len(text), hi + 1)) if lo <= m.end() <= hi]


class LineIndex:
    """Line starts of one text, for repeated position <-> offset conversions in one encoding."""

    def __init__(self, text: str, encoding: str = UTF16, starts: list[int] | None = None):
        self.text = text
        self.encoding = encoding
        self.starts = line_starts(text) if starts is None else starts

    def with_encoding(self, encoding: str) -> LineIndex:
        """The same index converting columns in another encoding (line starts shared, not rescanned)."""
        return self if encoding == self.encoding else LineIndex(self.text, encoding, self.starts)

    def line_count(self) -> int:
        return len(self.starts)

    def content_end(self, line: int) -> int:
        """The offset where `line`'s content ends (its line break, or the end of the text)."""
        if line + 1 >= len(self.starts):
            return len(self.text)
        nxt = self.starts[line + 1]
        return nxt - 2 if self.text.startswith("\r\n", nxt - 2) else nxt - 1

    def line_text(self, line: int) -> str:
        """The content of `line`, without its line break."""
        return self.text[self.starts[line] : self.content_end(line)]

    def offset(self, line: int, character: int) -> int:
        """Returns the str offset of an LSP (line, character), clamped as the spec says."""
        if line < 0:
            return 0
        if line >= len(self.starts):
            return len(self.text)
        return self.starts[line] + column_to_index(self.line_text(line), character, self.encoding)

    def position(self, offset: int) -> tuple[int, int]:
        """Returns the LSP (line, character) of a str offset (one inside a "\\r\\n" counts as its start)."""
        offset = max(0, min(offset, len(self.text)))
        line = bisect_right(self.starts, offset) - 1
        end = self.content_end(line)
        return line, units_len(self.text[self.starts[line] : min(offset, end)], self.encoding)

    def row_col(self, offset: int) -> tuple[int, int]:
        """Returns (line, str index within the line) of a str offset."""
        offset = max(0, min(offset, len(self.text)))
        line = bisect_right(self.starts, offset) - 1
        return line, offset - self.starts[line]

    def lines(self) -> Lines:
        """The text's lines (without their breaks) as a sequence, cut on demand: no full split."""
        return Lines(self)

    def edited(self, a: int, b: int, new_text: str, text: str) -> LineIndex:
        """The index of `text` == self.text[:a] + new_text + self.text[b:], updated rather than
        rescanned: starts before the edit are kept, those after it shifted, and only the edit and
        one character either side (a "\\r" before it may now pair with a "\\n") scanned."""
        end = a + len(new_text)
        keep = self.starts[: bisect_left(self.starts, max(a, 1))]  # 0, and starts < a: unchanged
        mid = _starts_in(text, a, end)  # a start s depends on text[s-1] and text[s]
        delta = len(new_text) - (b - a)
        tail = self.starts[bisect_right(self.starts, b) :]  # starts > b: both characters unchanged
        out = LineIndex.__new__(LineIndex)
        out.text, out.encoding = text, self.encoding
        out.starts = keep + mid + ([s + delta for s in tail] if delta else tail)
        return out


class Lines(Sequence[str]):
    """Read-only sequence of a LineIndex's lines (without their breaks): len(), [i] and [i:j]."""

    def __init__(self, index: LineIndex):
        self._index = index

    def __len__(self) -> int:
        return len(self._index.starts)

    @overload
    def __getitem__(self, key: int) -> str: ...
    @overload
    def __getitem__(self, key: slice) -> list[str]: ...
    def __getitem__(self, key: int | slice) -> str | list[str]:
        n = len(self._index.starts)
        if isinstance(key, slice):
            return [self._index.line_text(i) for i in range(*key.indices(n))]
        if key < 0:
            key += n
        if not 0 <= key < n:
            raise IndexError(key)
        return self._index.line_text(key)

    def __iter__(self) -> Iterator[str]:
        return (self._index.line_text(i) for i in range(len(self._index.starts)))
