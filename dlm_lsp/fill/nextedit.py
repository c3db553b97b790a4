"""Next-edit suggestions, the model-free parts: the region to rewrite, a rewrite as minimal edits, the
gate's checks, and the substitutions the user's recent edits made.

A next edit rewrites a window of whole lines near the cursor (`window_lines`, the one place the
region is computed). Whatever proposes the rewrite (the model, or `propagate` without one) gives new
text for the whole window; `line_edits` turns old and new window into the few replacements an editor
shows; the gate refuses a rewrite that changes only whitespace (`is_whitespace_only`) or takes back
the user's last edit (`is_reversal`). `substitutions` reads the recent edits (history.Edit, each with
its line as context) as token substitutions, `Dict` -> `dict`, `foo` -> `bar`; `propagate` applies
the identifier ones to the window's other occurrences, the baseline a model has to beat.
"""

from __future__ import annotations

import bisect
import difflib
import re
from collections.abc import Sequence

from dlm_lsp.fill.history import Edit

_BREAK = re.compile(r"\r\n?|\n")  # LSP's line breaks, and no others (positions)
_TOKEN = re.compile(r"\w+|[^\w\s]")  # a word, or one punctuation character
_IDENTIFIER = re.compile(r"[^\W\d]\w*")

REVERSAL_SIMILARITY = 0.8  # how close to the text the user replaced a rewrite must come to be an undo
MAX_RENAME_PAIRS = 2  # an edit making more token substitutions rewrote its line: no rename read from it


# ----------------------------------------------------------------------------- the window


def window_lines(text: str, offset: int, above: int = 2, below: int = 8, max_lines: int = 12) -> tuple[int, int]:
    """The (start, end) str offsets of the window to rewrite around `offset`: the cursor's line, up
    to `above` lines before it and `below` after it, at most `max_lines` in all (lines below go
    first). `start` is a line's start; `end` is the start of the line after the window (its last
    line's break included), or the end of the text. The offset clamps into the text; lines are cut
    at "\\n", "\\r\\n" and "\\r", as LSP cuts them. Near either end of the file the window is just
    shorter: the lines it lacks on one side are not taken from the other."""
    offset = max(0, min(offset, len(text)))
    if 0 < offset < len(text) and text[offset - 1] == "\r" and text[offset] == "\n":
        offset -= 1  # inside a "\r\n": on the line it ends
    above = max(0, min(above, max_lines - 1))
    below = max(0, min(below, max_lines - 1 - above))
    start = _line_start(text, offset)
    for _ in range(above):
        if start == 0:
            break
        start = _line_start(text, start - (2 if text.startswith("\r\n", start - 2) else 1))
    end = _line_start(text, offset)
    for _ in range(below + 1):  # past the cursor's line and `below` more
        m = _BREAK.search(text, end)
        if m is None:
            return start, len(text)
        end = m.end()
    return start, end


def _line_start(text: str, offset: int) -> int:
    """The start of the line holding `offset` (not inside a "\\r\\n")."""
    return max(text.rfind("\n", 0, offset), text.rfind("\r", 0, offset)) + 1


# ----------------------------------------------------------------------------- a rewrite as edits


def line_edits(old_window: str, new_window: str) -> list[tuple[int, int, str]]:
    """The replacements (start, end, new text) that turn `old_window` into `new_window`: offsets into
    old_window, sorted, neither overlapping nor touching, each trimmed to the characters that change. Lines are
    matched first (difflib); a changed block of as many new lines as old ones is taken line by line,
    any other block whole, and each loses its common prefix and suffix. Applying them from the last
    to the first gives new_window."""
    old_lines, new_lines = _split_lines(old_window), _split_lines(new_window)
    old_at = _offsets(old_lines)
    out: list[tuple[int, int, str]] = []
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if i2 - i1 == j2 - j1:  # line for line: one edit per changed line
            pairs = [(old_at[i], old_at[i + 1], new_lines[j]) for i, j in zip(range(i1, i2), range(j1, j2))]
        else:
            pairs = [(old_at[i1], old_at[i2], "".join(new_lines[j1:j2]))]
        for a, b, new in pairs:
            old = old_window[a:b]
            if old == new:
                continue
            head = common_prefix(old, new)
            tail = common_prefix(old[head:][::-1], new[head:][::-1])
            a, b, new = a + head, b - tail, new[head : len(new) - tail]
            if out and out[-1][1] == a:  # edits of two neighbouring lines that meet are one
                a, new = out[-1][0], out.pop()[2] + new
            out.append((a, b, new))
    return out


def _split_lines(text: str) -> list[str]:
    """`text` cut into lines, each with its break (the last may have none)."""
    lines, at = [], 0
    for m in _BREAK.finditer(text):
        lines.append(text[at : m.end()])
        at = m.end()
    if at < len(text):
        lines.append(text[at:])
    return lines


def _offsets(lines: Sequence[str]) -> list[int]:
    """Where each line starts, and the end of the last."""
    out = [0]
    for line in lines:
        out.append(out[-1] + len(line))
    return out


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common head of `a` and `b`."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def apply_edits(text: str, edits: Sequence[tuple[int, int, str]]) -> str:
    """`text` with sorted, non-overlapping (start, end, new text) replacements applied."""
    for start, end, new in reversed(edits):
        text = text[:start] + new + text[end:]
    return text


# ----------------------------------------------------------------------------- the gate's checks


def is_whitespace_only(old: str, new: str) -> bool:
    """True when `old` and `new` differ, but only in whitespace: the same words and punctuation in
    the same order. Whitespace that splits or joins words is not whitespace only (`a b` -> `ab`)."""
    return old != new and _TOKEN.findall(old) == _TOKEN.findall(new)


def is_reversal(history_edits: Sequence[Edit], old_window: str, new_window: str, window_start: int) -> bool:
    """True when rewriting `old_window` (at document offset `window_start`) as `new_window` would take
    back the user's last edit (the last of `history_edits`, which must be the last change to the
    document, so its new text stands at last.start .. last.new_end now).

    The region is the last edit's new text widened to every replacement of the rewrite that overlaps
    or touches it. The rewrite is an undo when that region comes out as the text the user replaced,
    exactly or mostly: its similarity (difflib's ratio) to the user's old text, in the region, is at
    least REVERSAL_SIMILARITY and above its similarity to what stands there now. A rewrite that
    leaves the last edit's text alone is not one, whatever it does elsewhere; nor is one that carries
    the edit further (typing `ba` then a suggestion of `bar`)."""
    if not history_edits:
        return False
    last = history_edits[-1]
    s, e = last.start - window_start, last.new_end - window_start  # in old_window's offsets
    near = [(a, b, t) for a, b, t in line_edits(old_window, new_window) if a <= e and b >= s]
    if not near:
        return False
    lo, hi = min(s, near[0][0]), max(e, near[-1][1])
    # lo < s and hi > e only where a replacement reaches past the edit, inside the window
    head, tail = old_window[lo:s] if lo < s else "", old_window[e:hi] if hi > e else ""
    now, then = head + last.new_text + tail, head + last.old_text + tail
    after = apply_edits(now, [(a - lo, b - lo, t) for a, b, t in near])
    to_then = difflib.SequenceMatcher(None, after, then, autojunk=False).ratio()
    to_now = difflib.SequenceMatcher(None, after, now, autojunk=False).ratio()
    return after == then or (to_then >= REVERSAL_SIMILARITY and to_then > to_now)


# ----------------------------------------------------------------------------- substitutions


def substitutions(edits: Sequence[Edit]) -> list[tuple[str, str]]:
    """The (old, new) token substitutions the edits made, oldest first, without repeats: each edit's
    line before and after (`before + old_text + after`, `before + new_text + after`) diffed as
    tokens (words, single punctuation characters), each changed run of whole tokens one pair
    (`Dict` -> `dict`, `foo` -> `fooBar` when `Bar` was typed after `foo`). A run only inserted or
    only deleted is paired with the token before it (`x` -> `x: int`); at the start of a line it has
    no anchor and is left out."""
    out: list[tuple[str, str]] = []
    for edit in edits:
        old_line = edit.before + edit.old_text + edit.after
        new_line = edit.before + edit.new_text + edit.after
        for pair in _token_changes(old_line, new_line):
            if pair not in out:
                out.append(pair)
    return out


def _token_changes(old_line: str, new_line: str) -> list[tuple[str, str]]:
    old_toks, new_toks = list(_TOKEN.finditer(old_line)), list(_TOKEN.finditer(new_line))
    matcher = difflib.SequenceMatcher(
        None, [m.group() for m in old_toks], [m.group() for m in new_toks], autojunk=False
    )
    out = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag != "replace":  # an insertion or a deletion: anchor it on the token before
            if i1 == 0 or j1 == 0:
                continue
            i1, j1 = i1 - 1, j1 - 1
        old = old_line[old_toks[i1].start() : old_toks[i2 - 1].end()]
        new = new_line[new_toks[j1].start() : new_toks[j2 - 1].end()]
        if old != new and not is_whitespace_only(old, new):
            out.append((old, new))
    return out


def renames(edits: Sequence[Edit]) -> dict[str, str]:
    """The identifier renames the edits made, old -> new, composed in order: a rename of a rename
    takes both names to the last (`a` -> `b`, `b` -> `c`: `a` -> `c` and `b` -> `c`), and a rename the user took back
    (`a` -> `b`, then `b` -> `a`) cancels out."""
    names: dict[str, str] = {}
    for old, new in substitutions(edits):
        if not (_IDENTIFIER.fullmatch(old) and _IDENTIFIER.fullmatch(new)):
            continue
        if names.get(new) == old:
            del names[new]
            continue
        for k, v in list(names.items()):
            if v == old:
                names[k] = new
        names[old] = new
    return {k: v for k, v in names.items() if k != v}


def propagate(
    edits: Sequence[Edit],
    window: str,
    cursor: int | None = None,
    noncode: Sequence[tuple[int, int]] = (),
    comments: Sequence[str] = (),
) -> str | None:
    """`window` with the edits' identifier renames applied to the next run of lines that hold them,
    or None when that changes nothing: the suggestion made without a model.

    The renames are those of `renames`, taken from the edits that read as a rename (`rename_edits`:
    made in code, not in a string or a comment, and not a rewrite of the line). They apply to every
    whole-word occurrence (`foo` in `foo.x`, not in `foobar`) outside the window's `noncode` spans
    (strings and comments, window offsets: `noncode_spans`), all at once; of the lines that changes,
    the suggestion keeps one run of consecutive lines, the first at or after the `cursor`'s line
    (window offset; None: the window's start), else the last one above it: one suggestion is the next
    edit, and the editor asks again once it is taken, as the user moves through the occurrences."""
    names = renames(rename_edits(edits, comments))
    if not names:
        return None
    words = "|".join(re.escape(k) for k in sorted(names, key=len, reverse=True))

    def swap(m: re.Match) -> str:
        return m.group() if in_spans(noncode, m.start()) else names[m.group()]

    out = re.sub(rf"(?<!\w)(?:{words})(?!\w)", swap, window)
    if out == window:
        return None
    return next_run(window, out, 0 if cursor is None else cursor)


def rename_edits(edits: Sequence[Edit], comments: Sequence[str] = ()) -> list[Edit]:
    """The edits that may carry a rename: their change starts in code (not inside a string literal
    or a comment of the line, as `noncode_spans` reads it with `comments`) and makes at most
    MAX_RENAME_PAIRS token substitutions (more is a rewrite of the line: `x: Dict = None` ->
    `y: list[int] = []` renames nothing)."""
    out = []
    for e in edits:
        line = e.before + e.old_text + e.after
        if in_spans(noncode_spans(line, comments), len(e.before)):
            continue
        if len(_token_changes(line, e.before + e.new_text + e.after)) > MAX_RENAME_PAIRS:
            continue
        out.append(e)
    return out


def next_run(old_window: str, new_window: str, cursor: int) -> str:
    """`new_window` with only one run of consecutive changed lines kept (the rest as in `old_window`):
    the first starting at or after the line of `cursor` (an offset into old_window), else the last
    above it. Windows of different line counts come back whole."""
    old_lines, new_lines = old_window.split("\n"), new_window.split("\n")
    if len(old_lines) != len(new_lines):
        return new_window
    changed = [a != b for a, b in zip(old_lines, new_lines)]
    runs: list[tuple[int, int]] = []
    for i, c in enumerate(changed):
        if c and (i == 0 or not changed[i - 1]):
            runs.append((i, i + 1))
        elif c:
            runs[-1] = (runs[-1][0], i + 1)
    if not runs:
        return new_window
    line = old_window.count("\n", 0, cursor)
    a, b = next((r for r in runs if r[0] >= line), runs[-1])
    return "\n".join(new_lines[i] if a <= i < b else old_lines[i] for i in range(len(old_lines)))


# ----------------------------------------------------------------------------- code, strings, comments

LINE_COMMENTS = {  # by LSP languageId; a language not here gets strings only
    **dict.fromkeys(("python", "ruby", "shellscript", "perl", "r", "yaml", "toml", "julia", "elixir"), ("#",)),
    **dict.fromkeys(
        (
            "c",
            "cpp",
            "csharp",
            "java",
            "javascript",
            "javascriptreact",
            "typescript",
            "typescriptreact",
            "go",
            "rust",
            "swift",
            "kotlin",
            "scala",
            "php",
            "dart",
        ),
        ("//", "/*"),
    ),
}


def comments_of(language: str | None) -> tuple[str, ...]:
    """The comment openers `noncode_spans` knows for an LSP languageId (none for an unknown one)."""
    return LINE_COMMENTS.get(language or "", ())


def noncode_spans(text: str, comments: Sequence[str] = ()) -> list[tuple[int, int]]:
    """The (start, end) spans of `text` inside string literals (', ", and their triple forms, a
    backslash escaping; a single-quoted one ends at its line) or comments (each opener in
    `comments`: "#" or "//" to the end of the line, "/*" to "*/"), in order, by one regex pass (a
    2 MB line costs milliseconds). Text that starts inside a string is read as code."""
    alts = [r'"""[\s\S]*?(?:"""|$)', r"'''[\s\S]*?(?:'''|$)", r'"(?:\\.|[^"\\\n])*"?', r"'(?:\\.|[^'\\\n])*'?"]
    for c in comments:
        alts.append(r"/\*[\s\S]*?(?:\*/|$)" if c == "/*" else re.escape(c) + r"[^\n]*")
    return [m.span() for m in re.finditer("|".join(alts), text)]


def in_spans(spans: Sequence[tuple[int, int]], pos: int) -> bool:
    """True when `pos` lies inside one of the sorted, non-overlapping `spans`."""
    i = bisect.bisect_right(spans, (pos, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= pos < spans[i][1]
