"""Next-edit suggestions, the model-free parts: the region to rewrite, a rewrite as minimal edits, the
gate's checks, and the substitutions the user's recent edits made.

A next edit rewrites a window of whole lines near the cursor (`window_lines`, the one place the
region is computed). Whatever proposes the rewrite (the model, or `propagate` without one) gives new
text for the whole window; `line_edits` turns old and new window into the few replacements an editor
shows; the gate refuses a rewrite that changes only whitespace (`is_whitespace_only`) or takes back
the user's last edit (`is_reversal`). `substitutions` reads the recent edits (history.Edit, each with
its line as context) as token substitutions, `Dict` -> `dict`, `foo` -> `bar`; `propagate` carries
the ones that name something (`carried`) to the window's other occurrences in the same role, the
suggestion made without a model (docs/research/44-s31-propagate-roles.md).
"""

from __future__ import annotations

import bisect
import difflib
import keyword
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dlm_lsp.fill.history import Edit

_BREAK = re.compile(r"\r\n?|\n")  # LSP's line breaks, and no others (positions)
_TOKEN = re.compile(r"\w+|[^\w\s]")  # a word, or one punctuation character
_IDENTIFIER = re.compile(r"[^\W\d]\w*")

REVERSAL_SIMILARITY = 0.8  # how close to the text the user replaced a rewrite must come to be an undo
MAX_RENAME_PAIRS = 2  # an edit making more token substitutions rewrote its line: no rename read from it
MIN_TEXT_REPEATS = 2  # a word changed inside strings or comments is carried once the user changed it this often
# words that stand in code for everything at once (Python's keywords and the C family's common ones):
# a substitution holding one is a rewrite of its place, not something to carry
KEYWORDS = frozenset(keyword.kwlist) | {
    *("true", "false", "null", "nil", "undefined", "void", "var", "let", "const", "function"),
    *("switch", "goto", "typeof", "instanceof", "throw", "catch"),
}


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
    return [(old, new) for old, new, *_ in _runs(old_line, new_line)]


def _runs(old_line: str, new_line: str) -> list[tuple[str, str, bool, int, int]]:
    """The changed runs of whole tokens, (old, new, anchored, start, end): `anchored` when the run was
    only inserted or only deleted and is paired with the token before it; [start, end) is the old
    text's place in old_line."""
    old_toks, new_toks = list(_TOKEN.finditer(old_line)), list(_TOKEN.finditer(new_line))
    matcher = difflib.SequenceMatcher(
        None, [m.group() for m in old_toks], [m.group() for m in new_toks], autojunk=False
    )
    out = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        anchored = tag != "replace"
        if anchored:  # an insertion or a deletion: anchor it on the token before
            if i1 == 0 or j1 == 0:
                continue
            i1, j1 = i1 - 1, j1 - 1
        start, end = old_toks[i1].start(), old_toks[i2 - 1].end()
        old, new = old_line[start:end], new_line[new_toks[j1].start() : new_toks[j2 - 1].end()]
        if old != new and not is_whitespace_only(old, new):
            out.append((old, new, anchored, start, end))
    return out


def propagate(
    edits: Sequence[Edit],
    window: str,
    cursor: int | None = None,
    noncode: Sequence[tuple[int, int]] = (),
    comments: Sequence[str] = (),
) -> str | None:
    """`propagation`'s new window, or None when it changes nothing."""
    found = propagation(edits, window, cursor, noncode, comments)
    return None if found is None else found.window


@dataclass
class Made:
    """One substitution a propagation made: the old text at `start` (window offset) became
    `carry.new`; `role` says how it was matched: "role" (the token before or after it is one it had
    where the user changed it), "definition" (a use of a name renamed where it is defined) or "text"
    (a word inside strings or comments)."""

    start: int
    old: str
    carry: Carry
    role: str


@dataclass
class Propagation:
    """A model-free suggestion: the new window, the substitutions made in its kept run of lines, and
    where that run lies (window lines [first, last), the cursor's window line)."""

    window: str
    made: list[Made]
    first: int
    last: int
    cursor_line: int


def propagation(
    edits: Sequence[Edit],
    window: str,
    cursor: int | None = None,
    noncode: Sequence[tuple[int, int]] = (),
    comments: Sequence[str] = (),
) -> Propagation | None:
    """`window` with the edits' substitutions (`carried`) applied to the next run of lines that hold
    them, or None when that changes nothing: the suggestion made without a model.

    A substitution applies where its old text stands as the user's edit found it: whole tokens (`foo`
    in `foo.x`, not in `foobar`), in code for a code substitution (a string literal it replaces
    whole, `"en_us"` -> `DEFAULT_LOCALE`, counts as code) and inside the window's `noncode` spans
    (strings and comments, window offsets: `noncode_spans`) for a text one, and in the same role: the
    token just before or just after it is one it had where the user changed it (`int` changed in
    `-> int:` carries to another `-> int:`, not to `return int(x)`), except that a name renamed where
    it is defined carries to every use (not to `x.name`, nor to a call's `name=`). All apply at once,
    the longest old text first; of the lines that changes, the suggestion keeps one run of
    consecutive lines, the first at or after the `cursor`'s line (window offset; None: the window's
    start), else the last one above it: one suggestion is the next edit, and the editor asks again
    once it is taken, as the user moves through the occurrences."""
    rules = carried(edits, comments)
    if not rules:
        return None
    out, made = _substitute(rules, window, noncode)
    if out == window:
        return None
    cursor_line = window.count("\n", 0, 0 if cursor is None else cursor)
    first, last = changed_run(window, out, cursor_line)
    kept = next_run(window, out, 0 if cursor is None else cursor)
    starts = [0]
    for line in window.split("\n"):
        starts.append(starts[-1] + len(line) + 1)
    lo, hi = starts[first], starts[last]
    return Propagation(kept, [x for x in made if lo <= x.start < hi], first, last, cursor_line)


def _substitute(rules: dict[str, Carry], text: str, noncode: Sequence[tuple[int, int]]) -> tuple[str, list[Made]]:
    """`text` with every substitution of `rules` made where it applies (propagation's rule), and what
    was made."""
    olds = sorted(rules, key=len, reverse=True)
    pattern = re.compile("|".join(f"({_tokens_pattern(old)})" for old in olds))
    made: list[Made] = []

    def swap(m: re.Match) -> str:
        c = rules[olds[(m.lastindex or 1) - 1]]
        if _is_text(noncode, m.start(), m.end()) != c.text:
            return m.group()
        before, after = _around(text, m.start(), m.end())
        if before in c.before or after in c.after:
            made.append(Made(m.start(), m.group(), c, "text" if c.text else "role"))
            return c.new
        if c.everywhere and before != "." and not (after == "=" and before in ("(", ",")):
            # a use of the renamed name (not an attribute of something else, not a keyword argument)
            made.append(Made(m.start(), m.group(), c, "definition"))
            return c.new
        return m.group()

    return pattern.sub(swap, text), made


@dataclass
class Carry:
    """What an old text becomes (`new`), where (`text`: inside strings and comments, else code), and
    the tokens that stood just before and just after it where the user changed it ("" at the line's
    start or end): its roles."""

    new: str
    text: bool
    before: set[str] = field(default_factory=set)
    after: set[str] = field(default_factory=set)
    everywhere: bool = False  # renamed where it is defined: every use in code follows, whatever its role
    count: int = 0  # the edits that made it
    alone: bool = False  # one of them made nothing else: one run of tokens changed, within one line


def carried(edits: Sequence[Edit], comments: Sequence[str] = ()) -> dict[str, Carry]:
    """The substitutions `propagate` carries, old text -> Carry, composed in order (a chain ends at its
    last text: `a` -> `b`, `b` -> `c` takes both to `c`; one the user took back cancels out):

    - code: each changed run of whole tokens (as `substitutions` reads them) of an edit made in code
      that does not rewrite its line (at most MAX_RENAME_PAIRS runs), within one line, whose old text
      names something (an identifier, a string literal) and where neither side holds a keyword: an
      identifier renamed (`foo` -> `bar`), a qualified name or a call replaced (`typing.List` ->
      `list`, `tz.tzutc()` -> `timezone.utc`), a literal named (`"en_us"` -> `DEFAULT_LOCALE`). An
      insertion anchored on the token before it (`frame` -> `frame, **kwargs`) is not one: it says
      what was added at one place, not what every `frame` becomes;
    - text: a word changed for another inside strings or comments (`A` -> `An` in docstrings), once
      the user made that change MIN_TEXT_REPEATS times among the edits."""
    rules: dict[str, Carry] = {}
    text_runs: list[tuple[str, str, str, str]] = []
    for e in edits:
        line, new_line = e.before + e.old_text + e.after, e.before + e.new_text + e.after
        runs = _runs(line, new_line)
        if _is_text(noncode_spans(line, comments), len(e.before), len(e.before) + len(e.old_text)):
            text_runs += [
                (old, new, *_around(line, i, j))
                for old, new, anchored, i, j in runs
                if not anchored and _IDENTIFIER.fullmatch(old) and _IDENTIFIER.fullmatch(new)
            ]
            continue
        if len(runs) > MAX_RENAME_PAIRS:
            continue
        alone = len(runs) == 1 and not _BREAK.search(e.old_text + e.new_text)
        for old, new, anchored, i, j in runs:
            if not anchored and _carries(old, new):
                before, after = _around(line, i, j)
                _compose(rules, old, new, False, before, after, alone)
                if _IDENTIFIER.fullmatch(old) and _IDENTIFIER.fullmatch(new):  # a name renamed where defined
                    rules.get(old, Carry(new, False)).everywhere |= _defines(line, before, after)
    pairs = [(old, new) for old, new, _, _ in text_runs]
    for old, new, before, after in text_runs:
        if pairs.count((old, new)) >= MIN_TEXT_REPEATS and not (old in rules and not rules[old].text):
            _compose(rules, old, new, True, before, after, True)
    return rules


def _carries(old: str, new: str) -> bool:
    """True for a code substitution worth carrying: within one line, its old text names something
    (an identifier, or a string literal), and neither side holds a keyword (`None` -> `bool` in one
    signature, `if x >` -> `y =` in a rewritten line say nothing about the other `None`s and `if`s)."""
    if any(c in old or c in new for c in "\r\n") or not (_balanced(old) and _balanced(new)):
        return False
    spans = noncode_spans(old)
    literal = len(spans) == 1 and spans[0] == (0, len(old)) and len(old) > 1 and old[-1] == old[0]
    parts, at = [], 0  # old without its string literals: the names in code
    for a, b in spans:
        parts.append(old[at:a])
        at = b
    code = "".join(parts) + old[at:]
    if not (_IDENTIFIER.search(code) or literal):
        return False
    return not any(w in KEYWORDS for w in _IDENTIFIER.findall(code) + _IDENTIFIER.findall(new))


def _balanced(text: str) -> bool:
    """True when every bracket of `text` closes the one it opened, and all are closed."""
    stack = []
    for ch in text:
        if ch in "([{":
            stack.append(")]}"["([{".index(ch)])
        elif ch in ")]}" and (not stack or stack.pop() != ch):
            return False
    return not stack


def _compose(
    rules: dict[str, Carry], old: str, new: str, text: bool, before: str, after: str, alone: bool = False
) -> None:
    undone = rules.get(new)
    if undone is not None and undone.new == old:
        del rules[new]
        return
    for c in rules.values():
        if c.new == old:
            c.new = new
    c = rules.setdefault(old, Carry(new, text))
    c.new = new
    c.count += 1
    c.alone |= alone
    c.before.add(before)
    c.after.add(after)
    for k in [k for k, v in rules.items() if k == v.new]:
        del rules[k]


DEFINERS = ("def", "async def", "class", "function", "fn", "func", "let", "var", "const")


def _defines(line: str, before: str, after: str) -> bool:
    """True when the changed text (between the tokens `before` and `after` on `line`) is a name being
    defined: the name or a parameter on a line that opens a definition (`def f(foo):`, `class Foo:`,
    `let foo =`), an annotated parameter (`(self, foo: int`), or the target of an assignment at the
    line's start (`foo = 1`, `foo: int = 1`)."""
    head = line.lstrip()
    if any(head.startswith(d + " ") for d in DEFINERS) and (before in ("(", ",", "*") or before in head.split()[:2]):
        return True
    return after == ":" and before in ("(", ",") or before == "" and after in ("=", ":")


def _around(line: str, start: int, end: int) -> tuple[str, str]:
    """The tokens just before `start` and just after `end` on their line ("" at its start or end)."""
    head = line[_line_start(line, start) : start]
    m = _BREAK.search(line, end)
    tail = line[end : m.start() if m else len(line)]
    before = _TOKEN.findall(head)
    after = _TOKEN.match(tail.lstrip())
    return (before[-1] if before else ""), (after.group() if after else "")


def _tokens_pattern(old: str) -> str:
    """A regex matching `old`'s tokens with any spacing between them (none where `old` had none), and
    not inside a longer word."""
    body = r"\s+".join(re.escape(part) for part in old.split())
    head = r"(?<!\w)" if re.match(r"\w", old) else ""
    tail = r"(?!\w)" if re.search(r"\w$", old) else ""
    return head + body + tail


def _is_text(spans: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    """True when [start, end) lies in a string or comment of `spans`: it starts inside one, and is
    not a string replaced whole (starting at the string's opening quote and reaching its end)."""
    i = bisect.bisect_right(spans, (start, float("inf"))) - 1
    if i < 0 or not spans[i][0] <= start < spans[i][1]:
        return False
    return not (spans[i][0] == start and end >= spans[i][1])


def next_run(old_window: str, new_window: str, cursor: int) -> str:
    """`new_window` with only one run of consecutive changed lines kept (the rest as in `old_window`):
    the first starting at or after the line of `cursor` (an offset into old_window), else the last
    above it. Windows of different line counts come back whole."""
    old_lines, new_lines = old_window.split("\n"), new_window.split("\n")
    if len(old_lines) != len(new_lines):
        return new_window
    a, b = changed_run(old_window, new_window, old_window.count("\n", 0, cursor))
    return "\n".join(new_lines[i] if a <= i < b else old_lines[i] for i in range(len(old_lines)))


def changed_run(old_window: str, new_window: str, line: int) -> tuple[int, int]:
    """The window lines [first, last) of the run of consecutive changed lines `next_run` keeps for a
    cursor on `line`: the first run starting at or after it, else the last above it; all the lines
    when the windows' line counts differ or nothing changed."""
    old_lines, new_lines = old_window.split("\n"), new_window.split("\n")
    if len(old_lines) != len(new_lines):
        return 0, len(old_lines)
    runs: list[tuple[int, int]] = []
    for i, (x, y) in enumerate(zip(old_lines, new_lines)):
        if x != y and (not runs or runs[-1][1] != i):
            runs.append((i, i + 1))
        elif x != y:
            runs[-1] = (runs[-1][0], i + 1)
    if not runs:
        return 0, len(old_lines)
    return next((r for r in runs if r[0] >= line), runs[-1])


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
