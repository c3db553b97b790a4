"""The fuzzer's reference edit model: the client's copy of a document under LSP edit semantics.

`RefText` cuts lines at \\n, \\r\\n or \\r only (never at \\v \\f \\x1c \\x1d \\x1e \\x85 \\u2028
\\u2029) and counts columns in UTF-16 code units; a column past the line's end clamps to it; a line past
the last clamps to the document's end. Where the spec leaves an edit's outcome open (a negative or
over-2^31 position, a column inside a surrogate pair, a reversed range, a wrong version) `apply_change`
and `edit_outcomes` return the set of acceptable outcomes.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import random
import re
from typing import Any

UINT_MAX = 2**31 - 1  # LSP uinteger
LINE_END = re.compile(r"(\r\n|\r|\n)")
ANY_VERSION = "<any version>"  # an outcome whose version is not checked (the client sent a wrong one)


def utf16_len(s: str) -> int:
    """Length of `s` in UTF-16 code units (a lone surrogate is one unit)."""
    return len(s) if s.isascii() else len(s) + sum(1 for ch in s if ord(ch) > 0xFFFF)


class RefText:
    """A text with LSP line structure: lines end at \\n, \\r\\n or \\r; columns in UTF-16 units."""

    def __init__(self, text: str):
        self.text = text
        # [line, line end, line, ..., line] at C speed: a 10 MB text is cut in a few ms, not seconds
        if "\r" not in text:
            lens = list(map(len, text.split("\n")))
            self.starts = list(itertools.accumulate((n + 1 for n in lens[:-1]), initial=0))
            self.ends = list(map(operator.add, self.starts, lens))  # per line: its first char, its line end
            return
        parts = LINE_END.split(text)
        at = list(itertools.accumulate(map(len, parts), initial=0))
        self.starts, self.ends = at[0:-1:2], at[1::2]

    def __len__(self) -> int:
        return len(self.starts)

    def line(self, i: int) -> str:
        return self.text[self.starts[i] : self.ends[i]]

    def offsets(self, line: int, character: int) -> list[int]:
        """The str offsets of a position with line, character >= 0: one, or two (before and after the
        pair) when the column falls inside a surrogate pair. Past the end clamps."""
        if line >= len(self.starts):
            return [len(self.text)]
        s, seg = self.starts[line], self.line(line)
        if seg.isascii():
            return [s + min(character, len(seg))]
        units = 0
        for i, ch in enumerate(seg):
            if units >= character:
                return [s + i]
            w = 2 if ord(ch) > 0xFFFF else 1
            if units + w > character:
                return [s + i, s + i + 1]
            units += w
        return [s + len(seg)]

    def position(self, offset: int) -> tuple[int, int]:
        """The (line, UTF-16 column) of a str offset that is not inside a line end."""
        line = bisect.bisect_right(self.starts, offset) - 1
        return line, utf16_len(self.text[self.starts[line] : offset])

    def is_valid(self, line: Any, character: Any) -> bool:
        """True for a position that names a place in the text exactly (no clamping, no split pair)."""
        if not (_is_int(line) and _is_int(character)) or line < 0 or character < 0 or line >= len(self.starts):
            return False
        seg, units = self.line(line), 0
        for ch in seg:
            if units == character:
                return True
            units += 2 if ord(ch) > 0xFFFF else 1
            if units > character:
                return False
        return units == character

    def random_offset(self, rng: random.Random) -> int:
        """A random offset at a code point boundary, never between \\r and \\n."""
        i = rng.randrange(len(self.starts))
        return self.starts[i] + rng.randint(0, self.ends[i] - self.starts[i])


def norm(s: str) -> str:
    """`s` as JSON carries it: adjacent lone surrogates that form a pair become one character."""
    if s.isascii():
        return s
    try:
        s.encode("utf-8")  # fails only on surrogates
        return s
    except UnicodeEncodeError:
        pass
    return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def resolve(ref: RefText, pos: Any) -> tuple[list[int], bool]:
    """The offsets a wire position may mean, and whether the server may as well reject it.
    A negative coordinate clamps to 0 (or is rejected); one over 2^31-1 clamps or is rejected."""
    if not isinstance(pos, dict) or not (_is_int(pos.get("line")) and _is_int(pos.get("character"))):
        return [], True
    line, char = pos["line"], pos["character"]
    odd = line < 0 or char < 0 or line > UINT_MAX or char > UINT_MAX
    if line < 0:
        return [0], True
    return ref.offsets(line, max(0, char)), odd


def apply_change(text: str, change: Any, ref: RefText | None = None) -> list[str | None]:
    """Outcomes of one content change on `text` under LSP semantics; None = the change is rejected."""
    if not isinstance(change, dict) or not isinstance(change.get("text"), str):
        return [None]
    new = change["text"]
    if "range" not in change:
        return [new]
    rng = change["range"]
    if not isinstance(rng, dict):
        return [None]
    ref = ref if ref is not None and ref.text is text else RefText(text)
    starts, rej_a = resolve(ref, rng.get("start"))
    ends, rej_b = resolve(ref, rng.get("end"))
    out: list[str | None] = [None] if (rej_a or rej_b or len(starts) > 1 or len(ends) > 1) else []
    for a in starts:
        for b in ends:
            if b < a:  # a reversed range: swapped, or rejected
                out += [None, text[:b] + new + text[a:]]
            else:
                out.append(text[:a] + new + text[b:])
    return list(dict.fromkeys(out)) or [None]


def edit_outcomes(
    text: str,
    version: Any,
    changes: list[Any],
    sent_version: Any,
    loose_version: bool = False,
    ref: RefText | None = None,
) -> list[tuple[str, Any]]:
    """(text, version) outcomes of a didChange; a rejected notification leaves both unchanged.
    A change whose outcome is open makes the whole notification's outcome open."""
    texts: list[str | None] = [text]
    for ch in changes:
        nxt: list[str | None] = []
        for t in texts:
            nxt += [None] if t is None else apply_change(t, ch, ref)
        texts = list(dict.fromkeys(nxt))
    out = [(text, version)] if None in texts or loose_version else []
    for t in texts:
        if t is not None:
            t = norm(t)
            out.append((t, ANY_VERSION if loose_version else sent_version))
    return list(dict.fromkeys(out))
