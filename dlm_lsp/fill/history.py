"""A document's recent edits: what the user changed, where and when, for next-edit suggestions.

`EditHistory` is the one owner of every open document's edits (found by the key the server gives, a
normalized URI). The server records each content change of a didChange before applying it, as str
offsets into the text it is about to change, and drops a document's history on didClose (and on a
full-text change, whose offsets mean nothing to the edits before it).

The edits form a patch series: each `Edit.start` is an offset into the document as it was just
before that edit, so replaying them in order onto the oldest one's document gives the current text,
and the last edit's new text stands at `last.start .. last.new_end` of the current document. Keeping
each edit in its own coordinates means nothing is shifted when a later edit lands above an earlier one.

Keystrokes coalesce (`_merged`): a change that overlaps or touches the last edit's new text, within
`gap` seconds of it, is folded into it, so typing "abc" is one edit '' -> 'abc', backspaces into it
shrink it, and replacing a selected word then typing is one replacement. A change anywhere else, or
after a pause, starts a new edit; a change that takes an edit back entirely (typing then deleting it)
leaves no edit.

The history is bounded per document: at most `max_edits` edits and `max_chars` characters of old and
new text together, the oldest dropped first (dropping the oldest keeps the series replayable from a
later document). An edit that alone is over `max_chars` (a 2 MB paste) is not stored, and neither
is anything before it: a series with a hole in the middle cannot be replayed, and after a change that
big the edits before it say little about what comes next. Only a bounded slice of the line around
each edit is kept as its context (`before`, `after`).
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

GAP_S = 2.0  # a pause longer than this between keystrokes starts a new edit
MAX_EDITS = 16
MAX_CHARS = 4000
CONTEXT_CHARS = 120  # of the line on each side of an edit, for whole-word substitutions


@dataclass(frozen=True)
class Edit:
    """One coalesced change: `old_text` at `start` (an offset into the document as it was just before
    this edit) replaced by `new_text`, at monotonic time `time` (of its last keystroke). `before` and
    `after` are the text of the line on either side of the change (up to CONTEXT_CHARS each; the same
    before and after the edit), so `before + old_text + after` is the line as it was and
    `before + new_text + after` as it became."""

    start: int
    old_text: str
    new_text: str
    time: float
    before: str = ""
    after: str = ""

    @property
    def old_end(self) -> int:
        """The end of the replaced text, in the document before the edit."""
        return self.start + len(self.old_text)

    @property
    def new_end(self) -> int:
        """The end of the new text, in the document just after the edit."""
        return self.start + len(self.new_text)

    @property
    def size(self) -> int:
        """The characters this edit holds against the history's budget (old and new text)."""
        return len(self.old_text) + len(self.new_text)


def line_context(text: str, start: int, end: int, limit: int = CONTEXT_CHARS) -> tuple[str, str]:
    """The text of the line before `start` and after `end` in `text`, up to `limit` characters each;
    a side that the limit cuts inside a word loses that partial word, so the context holds whole
    words only."""
    lo = max(0, start - limit)
    line_start = max(text.rfind("\n", lo, start), text.rfind("\r", lo, start)) + 1
    before = text[max(lo, line_start) : start]
    if line_start == 0 and lo > 0 and _WORD.match(text, lo - 1):
        before = _WORD_HEAD.sub("", before)
    hi = min(len(text), end + limit)
    ends = [i for i in (text.find("\n", end, hi), text.find("\r", end, hi)) if i >= 0]
    after = text[end : min(ends) if ends else hi]
    if not ends and hi < len(text) and _WORD.match(text, hi):
        after = _WORD_TAIL.sub("", after)
    return before, after


_WORD = re.compile(r"\w")
_WORD_HEAD = re.compile(r"^\w+")
_WORD_TAIL = re.compile(r"\w+$")


@dataclass
class _Series:
    """One document's edits, oldest first, and the characters they hold."""

    edits: deque[Edit] = field(default_factory=deque)
    chars: int = 0


class EditHistory:
    """The recent edits of every open document, by key, coalesced and bounded (see the module)."""

    def __init__(self, max_edits: int = MAX_EDITS, max_chars: int = MAX_CHARS, gap: float = GAP_S):
        self.max_edits, self.max_chars, self.gap = max_edits, max_chars, gap
        self._docs: dict[str, _Series] = {}

    def record(
        self, key: str, start: int, old_text: str, new_text: str, now: float, text: str | None = None
    ) -> Edit | None:
        """The document's last edit after recording one content change: `old_text` at str offset
        `start` replaced by `new_text` at monotonic time `now`. `text` is the document just before the
        change, for the edit's line context (none without it). A no-op change records nothing; a
        change over `max_chars` clears the history (None)."""
        if old_text == new_text:
            return self.last(key)
        if len(old_text) + len(new_text) > self.max_chars:
            self.drop(key)
            return None
        before, after = line_context(text, start, start + len(old_text)) if text is not None else ("", "")
        edit = Edit(start, old_text, new_text, now, before, after)
        series = self._docs.setdefault(key, _Series())
        prev = series.edits[-1] if series.edits else None
        if prev is not None and now - prev.time <= self.gap:
            merged = _merged(prev, edit)
            if merged is not None and merged.size <= self.max_chars:
                series.edits.pop()
                series.chars -= prev.size
                if merged.old_text == merged.new_text:  # typed, then taken back
                    return self.last(key)
                edit = merged
        series.edits.append(edit)
        series.chars += edit.size
        while len(series.edits) > self.max_edits or series.chars > self.max_chars:
            series.chars -= series.edits.popleft().size
        return edit

    def recent(self, key: str, n: int = 3) -> list[Edit]:
        """The document's last `n` edits, oldest first (fewer when it has fewer)."""
        series = self._docs.get(key)
        if series is None or n <= 0:
            return []
        return list(series.edits)[-n:]

    def last(self, key: str) -> Edit | None:
        """The document's most recent edit, or None."""
        series = self._docs.get(key)
        return series.edits[-1] if series is not None and series.edits else None

    def drop(self, key: str) -> None:
        """Forgets a document's edits (didClose, a full-text change)."""
        self._docs.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._docs


def _merged(prev: Edit, edit: Edit) -> Edit | None:
    """`prev` and the `edit` that followed it as one edit, or None when `edit` neither overlaps nor
    touches prev's new text (or its old text disagrees with prev's new text where they overlap: the
    server missed a change, so they are not one edit)."""
    p, p_end = prev.start, prev.new_end  # prev's new text, in the document `edit` changed
    c, c_end = edit.start, edit.old_end
    if c > p_end or c_end < p:
        return None
    start = min(p, c)
    # the merged region in the document between the two edits: what `edit` replaced outside prev's
    # new text, on either side of it, is text prev never touched, so it was there before prev too
    left = edit.old_text[: max(0, p - c)]
    right = edit.old_text[max(0, p_end - c) :] if c_end > p_end else ""
    between = left + prev.new_text + right
    at = c - start
    if between[at : at + len(edit.old_text)] != edit.old_text:
        return None
    old_text = left + prev.old_text + right
    new_text = between[:at] + edit.new_text + between[at + len(edit.old_text) :]
    before = edit.before if c < p else prev.before
    after = edit.after if c_end >= p_end else prev.after
    return Edit(start, old_text, new_text, edit.time, before, after)
