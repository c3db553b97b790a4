"""LSP positions <-> offsets into a Python str, converted once at the protocol boundary.

LSP counts a column in code units of the negotiated encoding: UTF-16 unless the client offered
something else in `general.positionEncodings` (Neovim offers UTF-8 first, and pygls takes it).
Python strings index code points, so a column is converted here and nowhere else; everything
behind this module works on str offsets. Lines end at "\\n" ("\\r\\n" keeps its "\\r" at the end of
the line; a column past the line's content clamps to the line's end, as the spec asks).
"""
from __future__ import annotations

from bisect import bisect_right

UTF8, UTF16, UTF32 = "utf-8", "utf-16", "utf-32"


def _units(ch: str, encoding: str) -> int:
    """Code units of one code point in `encoding`."""
    cp = ord(ch)
    if encoding == UTF16:
        return 2 if cp > 0xFFFF else 1
    if encoding == UTF8:
        return 1 if cp < 0x80 else 2 if cp < 0x800 else 3 if cp < 0x10000 else 4
    return 1


def units_len(text: str, encoding: str = UTF16) -> int:
    """Length of `text` in code units of `encoding`."""
    if encoding == UTF32 or text.isascii():
        return len(text)
    if encoding == UTF16:
        return len(text) + sum(1 for ch in text if ord(ch) > 0xFFFF)
    return len(text.encode("utf-8"))


def column_to_index(line: str, column: int, encoding: str = UTF16) -> int:
    """Returns the str index in `line` of an LSP column; clamps past the end (before a final "\\r")."""
    end = len(line) - 1 if line.endswith("\r") else len(line)
    if column <= 0:
        return 0
    if encoding == UTF32 or line.isascii():
        return min(column, end)
    seen = 0
    for i, ch in enumerate(line[:end]):
        if seen >= column:
            return i
        seen += _units(ch, encoding)
        if seen > column:  # a column inside a surrogate pair / multi-byte char: snap past it
            return i + 1
    return end


def index_to_column(line: str, index: int, encoding: str = UTF16) -> int:
    """Returns the LSP column of str index `index` in `line`."""
    return units_len(line[: max(0, index)], encoding)


def line_starts(text: str) -> list[int]:
    """Offsets where each line begins (the first is 0)."""
    starts = [0]
    i = text.find("\n")
    while i != -1:
        starts.append(i + 1)
        i = text.find("\n", i + 1)
    return starts


class LineIndex:
    """Line starts of one text, for repeated position <-> offset conversions."""

    def __init__(self, text: str, encoding: str = UTF16):
        self.text = text
        self.encoding = encoding
        self.starts = line_starts(text)

    def line_text(self, line: int) -> str:
        """The text of `line` without its "\\n"."""
        start = self.starts[line]
        end = self.starts[line + 1] - 1 if line + 1 < len(self.starts) else len(self.text)
        return self.text[start:end]

    def offset(self, line: int, character: int) -> int:
        """Returns the str offset of an LSP (line, character); past the last line clamps to the end."""
        if line < 0:
            return 0
        if line >= len(self.starts):
            return len(self.text)
        return self.starts[line] + column_to_index(self.line_text(line), character, self.encoding)

    def position(self, offset: int) -> tuple[int, int]:
        """Returns the LSP (line, character) of a str offset."""
        offset = max(0, min(offset, len(self.text)))
        line = bisect_right(self.starts, offset) - 1
        return line, index_to_column(self.line_text(line), offset - self.starts[line], self.encoding)

    def row_col(self, offset: int) -> tuple[int, int]:
        """Returns (line, str index within the line) of a str offset."""
        offset = max(0, min(offset, len(self.text)))
        line = bisect_right(self.starts, offset) - 1
        return line, offset - self.starts[line]

    def lines(self) -> "Lines":
        """The text's lines (without their "\\n") as a sequence, cut on demand: no full split."""
        return Lines(self)

    def edited(self, a: int, b: int, new_text: str, text: str) -> "LineIndex":
        """The index of `text` == self.text[:a] + new_text + self.text[b:], updated rather than
        rescanned: line starts before the edit are kept, those after it are shifted."""
        ra = bisect_right(self.starts, a) - 1  # the line holding a
        rb = bisect_right(self.starts, b) - 1  # starts in (a, b] are gone
        delta = len(new_text) - (b - a)
        mid = []
        i = new_text.find("\n")
        while i != -1:
            mid.append(a + i + 1)
            i = new_text.find("\n", i + 1)
        out = LineIndex.__new__(LineIndex)
        out.text, out.encoding = text, self.encoding
        tail = self.starts[rb + 1 :]
        out.starts = self.starts[: ra + 1] + mid + ([s + delta for s in tail] if delta else tail)
        return out


class Lines:
    """Read-only sequence of a LineIndex's lines: len(), [i] and [i:j] like text.split("\\n")."""

    def __init__(self, index: LineIndex):
        self.index = index

    def __len__(self) -> int:
        return len(self.index.starts)

    def __getitem__(self, key):
        n = len(self.index.starts)
        if isinstance(key, slice):
            return [self.index.line_text(i) for i in range(*key.indices(n))]
        if key < 0:
            key += n
        if not 0 <= key < n:
            raise IndexError(key)
        return self.index.line_text(key)

    def __iter__(self):
        return (self.index.line_text(i) for i in range(len(self.index.starts)))
