"""Unified diffs -> a document's recent edits (history.Edit): how the next-edit route reads the edit
history a client sends as diffs (Continue's Next Edit: npm `diff` createPatch output, oldest first).

Reading (`hunks`): a hunk starts at its "@@ -a[,b] +c[,d] @@" header and holds exactly b old and d
new lines: " " context, "-" removed, "+" added; a "\\ No newline at end of file" note is skipped and
an empty line counts as an empty context line (editors strip the lone space). Anything outside a
hunk ("---" / "+++" / "Index:" lines, blank lines between diffs) is read past; a hunk cut short by
a line of none of these kinds ends there. Bad diffs never fail a request: what cannot be read is
left out.

Edits (`recent_edits`): each run of changed lines of a hunk is one edit, trimmed to the characters
that change, with the line around it as its context (`before`, `after`), as the language server's
EditHistory records a change. Runs keep their order: diffs oldest first, hunks and runs top to
bottom, so the last run of the last diff is the last edit.

Where (best effort): an edit's `start` is found through its hunk's new text (context and added
lines) in the current document: at the line the header names when the text stands there, else its
occurrence nearest the cursor, else that line all the same (the text is no longer in the document:
later typing changed it). Only the last edit's place matters to the judgement (suggest.judge's
undo check); every edit's text feeds the engine's edit memory and the renames.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dlm_lsp.fill.history import Edit, line_context
from dlm_lsp.fill.nextedit import common_prefix

_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
MAX_MATCHES = 256  # occurrences of a hunk's text weighed for the one nearest the cursor


@dataclass
class Hunk:
    """One hunk: its first line in the diff's new file (1-based; 0 for an empty range) and its lines
    as (tag, text), tag one of " ", "-", "+"."""

    new_start: int
    lines: list[tuple[str, str]] = field(default_factory=list)

    def text(self, side: str) -> str:
        """The hunk's old ("-") or new ("+") text: its context lines and that side's, each with its break."""
        return "".join(t + "\n" for tag, t in self.lines if tag in (" ", side))


def hunks(diffs: str) -> list[Hunk]:
    """Every readable hunk of the diffs, in order (see the module)."""
    out: list[Hunk] = []
    hunk: Hunk | None = None
    old_left = new_left = 0  # the lines the header promised and the hunk has not had yet
    for line in diffs.split("\n"):
        if hunk is not None:
            if line.startswith("\\"):
                continue
            tag = line[:1] or " "  # an empty line: an empty context line
            if (tag == "-" and old_left) or (tag == "+" and new_left) or (tag == " " and old_left and new_left):
                hunk.lines.append((tag, line[1:]))
                old_left -= tag != "+"
                new_left -= tag != "-"
                if not old_left and not new_left:
                    out.append(hunk)
                    hunk = None
                continue
            if hunk.lines:  # cut short: keep what it had, and read the line afresh
                out.append(hunk)
            hunk = None
        m = _HEADER.match(line)
        if m is not None:
            old_left = int(m.group(2)) if m.group(2) is not None else 1
            new_left = int(m.group(4)) if m.group(4) is not None else 1
            hunk = Hunk(int(m.group(3))) if old_left or new_left else None
    if hunk is not None and hunk.lines:
        out.append(hunk)
    return out


@dataclass
class _Change:
    """One run of changed lines of a hunk: its texts and where they start in the hunk's texts."""

    hunk: Hunk
    old: str
    new: str
    old_at: int  # in hunk.text("-")
    new_at: int  # in hunk.text("+")


def _changes(hunk: Hunk) -> list[_Change]:
    out: list[_Change] = []
    old_at = new_at = 0
    run: _Change | None = None
    for tag, text in hunk.lines:
        if tag == " ":
            if run is not None:
                out.append(run)
                run = None
            old_at += len(text) + 1
            new_at += len(text) + 1
            continue
        if run is None:
            run = _Change(hunk, "", "", old_at, new_at)
        if tag == "-":
            run.old += text + "\n"
            old_at += len(text) + 1
        else:
            run.new += text + "\n"
            new_at += len(text) + 1
    if run is not None:
        out.append(run)
    return out


def recent_edits(diffs: str, text: str, cursor: int, n: int) -> list[Edit]:
    """The last `n` edits the diffs hold (oldest first), placed in `text` (see the module)."""
    changes = [c for h in hunks(diffs) for c in _changes(h)][-n:] if n > 0 else []
    places: dict[int, int] = {}
    out: list[Edit] = []
    for c in changes:
        key = id(c.hunk)
        if key not in places:
            places[key] = _place(c.hunk, text, cursor)
        p = common_prefix(c.old, c.new)
        s = _common_suffix(c.old[p:], c.new[p:])
        old, new = c.old[p : len(c.old) - s], c.new[p : len(c.new) - s]
        before, after = line_context(c.hunk.text("-"), c.old_at + p, c.old_at + p + len(old))
        start = min(places[key] + c.new_at + p, len(text))
        out.append(Edit(start, old, new, 0.0, before, after))
    return out


def _place(hunk: Hunk, text: str, cursor: int) -> int:
    """Where the hunk's new text starts in `text` (see the module)."""
    new = hunk.text("+")
    hint = _line_offset(text, max(hunk.new_start - 1, 0))
    # the diff's files end with a break (createPatch is given them so); the document may not
    padded = text if text.endswith("\n") else text + "\n"
    if not new or padded.startswith(new, hint):
        return hint
    best, best_distance = hint, None
    at = padded.find(new)
    for _ in range(MAX_MATCHES):
        if at < 0:
            break
        distance = 0 if at <= cursor <= at + len(new) else min(abs(cursor - at), abs(cursor - at - len(new)))
        if best_distance is None or distance < best_distance:
            best, best_distance = at, distance
        at = padded.find(new, at + 1)
    return best


def _line_offset(text: str, line: int) -> int:
    """The str offset of 0-based `line` in `text` (lines cut at "\\n"); the end for a line past it."""
    at = 0
    for _ in range(line):
        nl = text.find("\n", at)
        if nl < 0:
            return len(text)
        at = nl + 1
    return at


def _common_suffix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[-1 - i] == b[-1 - i]:
        i += 1
    return i
