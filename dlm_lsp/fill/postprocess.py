"""Engine text -> the fill an editor may show, or nothing.

A small model's fill can contain anything, so every rule here makes it safer, never longer:
  1. drop padding / special tokens; one line for line, middle and one-line args holes
  2. block holes end at the first line indented less than the block (and top-level blocks at their
     first blank line); lines inside a multi-line string are text, not code, and never end a block;
     a line that repeats the one before it, or that re-types the first line of code below at its
     indentation, is cut
  3. a fill that repeats the code after the cursor, or the line above, is dropped (edit distance
     within 5% of the fill's own text, as Tabby does)
  4. brackets, against what the code after the cursor closes: of the N brackets open at the cursor
     the code after it closes k (the outermost ones), so the fill may close the N - k innermost;
     a further closer that re-types a bracket the editor auto-closed after the cursor extends the
     replace range over it, any other is cut, as is a mismatched closer. A bracket (or string) the
     fill opens must be closed by the fill or by the code after the cursor (a line hole whose line
     continues below: `self.assertEqual(`), which must still close what it closed before. A tail
     that repeats the rest of the line is trimmed unless the fill's own brackets need it
  5. a fill that adds tree-sitter error nodes the file did not have, with the file's real text
     after the cursor, is cut to its longest clean prefix (by whole lines, then by characters) or
     dropped
Everything is a pure function of its arguments; the syntax check is passed in as a callable.

The syntax check (rule 5, `SyntaxCheck`) runs at every fill, so it must not cost more in a long
file: it parses, with and without the fill, only the outermost statement around the cursor of at
most 12 kB (`check_region`: any nested statement in Python, top-level items elsewhere, on whole
lines). A fill holding a multi-line string or comment delimiter must leave those paired in that
region, or the rest of the file would lex differently from what the region shows. A cursor inside
a larger statement re-parses the whole file instead, incrementally from the document's tree.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from tree_sitter import Node, Parser, Tree

from dlm_lsp.fill.context import (
    CLOSERS,
    MATCH,
    FillRequest,
    LexState,
    count_closed,
    indent_width,
    lex_events,
    lex_state,
)
from dlm_lsp.fill.documents import parse_source

if TYPE_CHECKING:
    from dlm_lsp.fill.gate import Calibrator

_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]+\|>")
_END_MARKERS = ("<|endoftext|>", "<|eos|>", "</s>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
SIMILARITY = 0.05  # edit distance within 5% of the length counts as a repeat


@dataclass
class Finished:
    """A fill ready for the editor: insert `text` over [offset, offset + replace_len)."""

    text: str
    replace_len: int = 0
    dropped: str | None = None  # why nothing is shown (None when text is non-empty)
    postprocess_ms: float = 0.0
    # what the gate compared with min_confidence: the calibrated P(accepted) of the finished text
    # (calibrate.Calibrator) when finish() had a calibrator, else the engine's confidence
    score: float | None = None


# ----------------------------------------------------------------------------- small rules


def strip_specials(text: str) -> str:
    """Cuts at the first end-of-text marker and removes other special tokens (padding, masks)."""
    for m in _END_MARKERS:
        i = text.find(m)
        if i != -1:
            text = text[:i]
    text = _SPECIAL.sub("", text).replace("\r\n", "\n")
    # control characters (a lone \r, escape codes, NUL) and undecodable bytes never belong in a fill
    return _CONTROL.sub("", text).replace("\ufffd", "")


def first_line(text: str) -> str:
    """Text up to the first line break."""
    return text.split("\n", 1)[0].rstrip("\r")


def within_distance(a: str, b: str, k: int) -> bool:
    """True when the Levenshtein distance of a and b is at most k (banded, O(len * k))."""
    if abs(len(a) - len(b)) > k:
        return False
    if k == 0:
        return a == b
    big = k + 1
    prev = {j: j for j in range(0, min(len(b), k) + 1)}
    for i in range(1, len(a) + 1):
        cur = {}
        lo, hi = max(0, i - k), min(len(b), i + k)
        for j in range(lo, hi + 1):
            if j == 0:
                cur[j] = i
                continue
            cost = 0 if a[i - 1] == b[j - 1] else 1
            cur[j] = min(prev.get(j - 1, big) + cost, prev.get(j, big) + 1, cur.get(j - 1, big) + 1)
        if min(cur.values()) > k:
            return False
        prev = cur
    return prev.get(len(b), big) <= k


def similar(a: str, b: str, share: float = SIMILARITY) -> bool:
    """True when a and b differ by at most `share` of the longer one's length."""
    if not a or not b:
        return False
    return within_distance(a, b, int(share * max(len(a), len(b))))


def _norm_lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.split("\n") if ln.strip()]


def _trivial(line: str) -> bool:
    """A line too small to judge repetition by (a lone bracket, `pass`-sized)."""
    return len(re.sub(r"[\s()\[\]{};,:]", "", line)) < 3


def repeats_suffix(fill: str, suffix: str) -> bool:
    """True when the fill re-types the code that follows the cursor (same number of lines)."""
    f = _norm_lines(fill)
    if not f:
        return False
    s = _norm_lines(suffix)[: len(f)]
    return len(s) == len(f) and similar("\n".join(f), "\n".join(s))


def repeats_line_above(fill_line: str, line_above: str, own: int | None = None) -> bool:
    """True when a line (the cursor line as it would be with the fill) repeats the line above.
    `own`: how many characters of the line the fill wrote (the rest the user typed); the 5% is
    then a share of those, so typed text that matches the line above does not widen the margin."""
    a, b = fill_line.strip(), line_above.strip()
    if _trivial(a) or not b:
        return False
    if own is None:
        return similar(a, b)
    own = min(own, len(a))
    return within_distance(a, b, int(SIMILARITY * max(own, len(b) - (len(a) - own))))


_DEGENERATE = re.compile(r"(.{1,6}?)\1{7,}")


def cut_degenerate(fill: str) -> str:
    """Cuts the fill before a short pattern repeated 8+ times in a row ("ARARARAR...", ",,,,,,,,"),
    the signature of a small model that lost its way. A run of one digit is a number people write
    (100000000000)."""
    pos = 0
    while True:
        m = _DEGENERATE.search(fill, pos)
        if m is None:
            return fill
        unit = m.group(1)
        if unit.isspace() or (len(unit) == 1 and unit.isdigit()):
            pos = m.end()
            continue
        return fill[: m.start()].rstrip()


def cut_repetition(fill: str, suffix: str) -> str:
    """Cuts a multi-line fill where a line repeats the one before it, or where it starts re-typing
    the first line of code after the cursor (at that line's indentation or less: a line nested
    deeper belongs to a block of the fill, not to the code below)."""
    lines = fill.split("\n")
    below_line = next((ln for ln in suffix.split("\n")[1:] if ln.strip()), "")
    if not below_line:
        below_line = next((ln for ln in suffix.split("\n") if ln.strip()), "")
    below, below_indent = below_line.strip(), indent_width(below_line)
    for i in range(1, len(lines)):
        s = lines[i].strip()
        if not s or _trivial(s):
            continue
        if s == lines[i - 1].strip() or (below and indent_width(lines[i]) <= below_indent and similar(s, below)):
            return "\n".join(lines[:i]).rstrip()
    return fill


def cut_block(fill: str, req: FillRequest) -> str:
    """Cuts a block fill at the first line indented less than the block (or the first blank line for
    top-level blocks)."""
    limit = req.stop.block_indent or 0
    lines = fill.split("\n")
    seen_code = bool(lines[0].strip())
    st = req.lex.copy()
    for i in range(1, len(lines)):
        ln = lines[i]
        st = lex_state(lines[i - 1] + "\n", req.language_id, st)
        if st.quote is not None or st.block_comment:
            continue  # the line is inside a multi-line string or comment: text, not code
        if not ln.strip():
            if req.stop.stop_at_blank_line and seen_code:
                return "\n".join(lines[:i]).rstrip()
            continue
        if indent_width(ln) < limit:
            return "\n".join(lines[:i]).rstrip()
        seen_code = True
    return fill.rstrip()


def leading_closers(after: str, stack: list[str]) -> list[int]:
    """End offsets in `after` of the closers right after the cursor that close `stack`'s brackets
    innermost first (brackets the editor auto-closed)."""
    ends: list[int] = []
    for i, ch in enumerate(after):
        if ch not in CLOSERS or len(ends) >= len(stack) or MATCH[ch] != stack[-1 - len(ends)]:
            break
        ends.append(i + 1)
    return ends


def balance_brackets(fill: str, req: FillRequest) -> tuple[str, int]:
    """Returns (fill, replace_len): brackets balanced against what the code after the cursor closes."""
    fill, replace_len, _ = _balance(fill, req)
    return fill, replace_len


def _fill_events(fill: str, req: FillRequest, st: LexState) -> Iterator[tuple[int, str, str]]:
    """lex_events of the fill as it reads after the text before the cursor on its line (`""` + `"`
    opens a triple-quoted string), with indices into the fill; updates `st`, which must start as
    the state at the cursor."""
    if req.line_lex is None or not req.line_before:
        yield from lex_events(fill, req.language_id, st)
        return
    # re-lex the line from its start in `st` itself (it reaches the cursor's state again)
    start = req.line_lex
    st.stack, st.quote = list(start.stack), start.quote
    st.block_comment, st.line_comment = start.block_comment, start.line_comment
    n = len(req.line_before)
    for i, c, ev in lex_events(req.line_before + fill, req.language_id, st):
        if i >= n:
            yield i - n, c, ev


def _balance(fill: str, req: FillRequest) -> tuple[str, int, int]:
    """balance_brackets, plus the end offset in the fill of the last closer that re-types an
    auto-closed bracket (0 if none). Of the brackets open at the cursor the code after it closes
    `suffix_closes` - the outermost ones, since brackets nest - so the fill may close the others;
    a closer beyond those re-types an auto-closed bracket (replace range) or is cut."""
    st = req.lex.copy()
    auto = leading_closers(req.line_after, req.lex.stack)
    floor = len(st.stack)
    free = max(0, floor - req.suffix_closes)
    closed = retyped = 0
    replace_len = protected = 0
    for i, _c, ev in _fill_events(fill, req, st):
        if ev == "mismatch":
            return fill[:i].rstrip(), replace_len, protected
        if ev == "close" and len(st.stack) < floor:  # the fill closed a bracket opened before it
            floor = len(st.stack)
            closed += 1
            if closed <= free:
                continue
            if retyped < len(auto):
                replace_len, protected = auto[retyped], i + 1  # re-typed an auto-closed bracket
                retyped += 1
            else:
                return fill[:i].rstrip(), replace_len, protected  # the code below closes it already
    return fill, replace_len, protected


def own_brackets_closed(fill: str, req: FillRequest, replace_len: int = 0) -> bool:
    """True when every bracket and string the fill opens is closed, within the fill or by the code
    after the cursor (past `replace_len`): a last line that continues below, as in a line hole
    `self.assertEqual(` whose arguments are on the next lines. That code must still close the
    brackets opened before the cursor that it closed without the fill."""
    st = req.lex.copy()
    floor = len(st.stack)
    for _i, _c, ev in _fill_events(fill, req, st):
        if ev == "mismatch":
            return False
        floor = min(floor, len(st.stack))
    opened = len(st.stack) - floor
    open_quote = st.quote if st.quote != req.lex.quote else None  # a string the fill opened and left open
    open_string = open_quote is not None
    if not opened and not open_string:
        return True
    if st.line_comment or st.block_comment or _own_open(fill[: fill.rfind("\n") + 1], req):
        return False  # only the fill's last line may continue below (and not from inside a comment)
    after = (req.after_cursor or req.suffix)[replace_len:]
    if open_quote is not None:
        end = _string_end(after, open_quote)
        if end is None:
            return False
        after = after[end:]
    if not opened:
        return True
    retyped = sum(1 for e in leading_closers(req.line_after, req.lex.stack) if e <= replace_len)
    still = min(max(0, req.suffix_closes - retyped), floor)  # closes the code after must still do
    if open_string:
        return count_closed(after, req.language_id, st.stack) >= opened + still
    # the same count from the closers of `after` that close nothing inside it (lexed once per text)
    closed = 0
    for c in _unmatched_closers(req.after_cursor or req.suffix, req.language_id)[retyped:]:
        if closed >= len(st.stack) or MATCH[c] != st.stack[-1 - closed]:
            break
        closed += 1
    return closed >= opened + still


@lru_cache(maxsize=16)
def _unmatched_closers(text: str, language_id: str) -> tuple[str, ...]:
    """The closers of `text` that close no bracket opened inside it, in order: whatever stack is
    open before `text`, these are what close it (count_closed without re-lexing per stack)."""
    return tuple(c for _i, c, ev in lex_events(text, language_id, LexState()) if ev == "mismatch")


def _string_end(text: str, quote: str) -> int | None:
    """Offset just past the delimiter that closes a string `quote` open at the start of `text`
    (None when it is not closed: a one-line string ends with its line)."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\" and quote != "`":
            i += 2
            continue
        if text.startswith(quote, i):
            return i + len(quote)
        if c == "\n" and len(quote) == 1 and quote != "`":
            return None
        i += 1
    return None


def trim_tail_overlap(fill: str, rest_of_line: str, keep: int = 0, req: FillRequest | None = None) -> str:
    """Drops the fill's tail (after its first `keep` characters) when it re-types the rest of the
    line after the replaced range - unless (with `req`) the tail closes a bracket or string the
    fill itself opened (`C()` before a `)`): then the tail is the fill's own."""
    rest = rest_of_line.rstrip()
    tail = fill[keep:].rstrip()
    if rest.strip() and tail.endswith(rest):
        trimmed = fill[:keep] + tail[: -len(rest)]
        if req is not None and _own_open(trimmed, req) > _own_open(fill, req):
            return fill
        return trimmed
    return fill


def _own_open(fill: str, req: FillRequest) -> int:
    """Brackets (and a string) the fill opens and leaves open (0 for "")."""
    if not fill:
        return 0
    st = req.lex.copy()
    floor = len(st.stack)
    for _i, _c, ev in _fill_events(fill, req, st):
        if ev == "mismatch":
            break
        floor = min(floor, len(st.stack))
    return len(st.stack) - floor + (st.quote is not None and st.quote != req.lex.quote)


def cut_to_clean(fill: str, is_clean: Callable[[str], bool], max_tries: int = 40) -> str:
    """Returns the fill if it is clean, else its longest clean prefix: whole lines first, then
    characters at token boundaries; "" when no prefix is clean."""
    if is_clean(fill):
        return fill
    tries = 1
    lines = fill.split("\n")
    for k in range(len(lines) - 1, 0, -1):
        cand = "\n".join(lines[:k]).rstrip()
        if not cand.strip():
            continue
        tries += 1
        if is_clean(cand):
            return cand
        if tries >= max_tries // 2:
            break
    first = lines[0]
    cuts = [i for i in range(len(first) - 1, 0, -1) if _boundary(first, i)]
    for i in cuts:
        if tries >= max_tries:
            break
        cand = first[:i].rstrip()
        if not cand.strip():
            continue
        tries += 1
        if is_clean(cand):
            return cand
    return ""


def _boundary(s: str, i: int) -> bool:
    """True between two characters of different kinds (word / space / punctuation)."""

    def kind(c: str) -> int:
        return 0 if c.isalnum() or c == "_" else 1 if c.isspace() else 2

    return kind(s[i - 1]) != kind(s[i]) or kind(s[i]) == 2


# ----------------------------------------------------------------------------- the pipeline


def finish(
    req: FillRequest,
    raw: str,
    is_clean: Callable[[str, int], bool] | None = None,
    filters: bool = True,
    confidence: float = 1.0,
    min_confidence: float = 0.0,
    calibrator: Calibrator | None = None,
) -> Finished:
    """Returns the fill to show for `req` from the engine's `raw` text (empty text = show nothing).
    A fill the engine was less sure of than `min_confidence` (Fill.confidence) is not shown; with a
    `calibrator` (calibrate.Calibrator, the model's own) the gate compares the calibrated probability
    that the finished text is accepted instead, after the other filters."""
    t0 = time.perf_counter()

    def done(text: str, replace_len: int = 0, dropped: str | None = None, score: float | None = None) -> Finished:
        if not text.strip():
            text, replace_len, dropped = "", 0, dropped or "empty"
        return Finished(
            text,
            replace_len,
            dropped,
            (time.perf_counter() - t0) * 1000,
            confidence if score is None and calibrator is None else score,
        )

    text = strip_specials(raw).replace("\r\n", "\n")
    if req.stop.single_line:
        text = first_line(text)
    if req.hole_kind == "block" and not req.line_before.strip() and text.startswith("\n"):
        # the cursor already sits on an empty line: a fill starting with a line break would leave
        # that line behind as whitespace; start on it, without re-typing its indentation
        text = text.lstrip("\n")
        if req.line_before and text.startswith(req.line_before):
            text = text[len(req.line_before) :]
    text = text.rstrip()
    if not filters:
        return done(text)
    if min_confidence == math.inf and text.strip():  # the model's gate hides this kind (gate.kind_gate)
        return done("", dropped=f"{req.hole_kind} fills are off for this model (a minConfidence setting shows them)")
    if calibrator is None and text.strip() and confidence < min_confidence:
        return done("", dropped=f"low confidence ({confidence:.2f} < {min_confidence:.2f})")
    text = cut_degenerate(text)
    if not text.strip():
        return done("", dropped="empty")
    if req.hole_kind == "block" or (req.hole_kind == "args" and not req.stop.single_line):
        text = cut_block(text, req) if req.hole_kind == "block" else text
        text = cut_repetition(text, req.suffix)
    if repeats_suffix(text, req.suffix):
        return done("", dropped="repeats the code after the cursor")
    first = first_line(text)
    typed = req.hole_kind in ("line", "middle", "args")
    # the cursor line as it would read: the code after the cursor follows a one-line fill
    candidate_line = (req.line_before + first + (req.line_after if "\n" not in text else "")) if typed else first
    own = len(first.strip()) if typed and candidate_line.strip() != first.strip() else None
    if req.line_above and repeats_line_above(candidate_line, req.line_above, own):
        return done("", dropped="repeats the line above")
    text, replace_len, protected = _balance(text, req)
    text = trim_tail_overlap(text, req.line_after[replace_len:], protected, req)
    if not text.strip():
        return done("", dropped="only re-types what follows")

    def clean_enough(t: str) -> bool:
        rl = balance_brackets(t, req)[1]
        if not own_brackets_closed(t, req, rl):
            return False
        return is_clean is None or is_clean(t, rl)

    if not clean_enough(text):
        clean = cut_to_clean(text, clean_enough)
        if not clean.strip():
            return done("", dropped="adds syntax errors")
        if clean != text:
            text, replace_len = balance_brackets(clean, req)
    text = text.rstrip()
    if calibrator is not None:
        score = calibrator.score(req, text, confidence, replace_len)
        if score < min_confidence:
            return done("", dropped=f"low acceptance score ({score:.2f} < {min_confidence:.2f})", score=score)
        return done(text, replace_len, score=score)
    return done(text, replace_len)


# ----------------------------------------------------------------------------- syntax check


def error_nodes(node: Node) -> list[Node]:
    """ERROR and MISSING nodes under `node` (only subtrees flagged has_error are visited)."""
    found = []
    stack = [node]
    while stack:
        cur = stack.pop()
        if cur.is_error or cur.is_missing:
            found.append(cur)
        if cur.has_error:
            stack.extend(cur.children)
    return found


def count_errors(node: Node) -> int:
    """Number of ERROR and MISSING nodes under `node`."""
    return len(error_nodes(node))


REGION_MAX_BYTES = 12_000  # the largest statement the check parses on its own
PAIRING_MARKERS = ('"""', "'''", "`", "/*", "*/")  # fills with these must leave them paired


def check_region(
    root: Node, src: bytes, cursor: int, probe: int | None = None, limit: int = REGION_MAX_BYTES
) -> tuple[int, int] | None:
    """Byte span [start, end) of whole lines around `cursor` that parses on its own: the outermost
    statement holding `probe` (default: the cursor) of at most `limit` bytes, widened to whole
    lines and to the cursor's line. Statements are the root's children, and in Python also the
    statements of any block (tree-sitter-python takes an indented first line as the base level).
    None when that statement is larger than `limit` (the caller parses the whole file)."""
    probe = cursor if probe is None else probe
    python = root.type == "module"
    node = root.descendant_for_byte_range(probe, probe)
    best = None
    while node is not None and node.parent is not None:
        parent = node.parent
        if parent.parent is None or (python and parent.type == "block"):
            if node.end_byte - node.start_byte > limit:
                break
            best = node
        node = parent
    lo = min(best.start_byte, cursor) if best is not None else cursor
    hi = max(best.end_byte, cursor) if best is not None else cursor
    start = src.rfind(b"\n", 0, lo) + 1
    end = src.find(b"\n", hi)
    end = len(src) if end == -1 else end + 1
    if best is None and root.end_byte > limit:
        return None
    if best is None:
        return 0, len(src)
    return start, end


@dataclass
class _Source:
    """The bytes a syntax check parses, the cursor in them, and the errors they have without a fill."""

    src: bytes
    cursor: int
    tree: Tree | None  # the document's tree when src is the whole file (incremental re-parse)
    base_errors: int = 0
    base_starts_at_cursor: bool = False
    row: int = 0
    col_bytes: int = 0

    def __post_init__(self) -> None:
        before = self.src[: self.cursor]
        self.row = before.count(b"\n")
        self.col_bytes = len(before) - (before.rfind(b"\n") + 1)

    def with_base(self, root: Node) -> _Source:
        base = error_nodes(root)
        self.base_errors = len(base)
        self.base_starts_at_cursor = any(n.start_byte == self.cursor for n in base)
        return self


def _pairs_close(src: bytes) -> bool:
    """True when every multi-line string / comment delimiter in `src` is paired: an even number of
    \"\"\" and \'\'\' and backticks, as many /* as */. A region that passes lexes the rest of the file as before."""
    return (
        src.count(b'"""') % 2 == 0
        and src.count(b"'''") % 2 == 0
        and src.count(b"`") % 2 == 0
        and src.count(b"/*") == src.count(b"*/")
    )


class SyntaxCheck:
    """is_clean(fill, replace_len): inserting the fill at `offset` must not add error nodes, and no
    error may begin inside the fill itself (tree-sitter's recovery can trade an error at the cursor
    for a new one in the fill while the count stays the same).

    The check parses only the statement around the cursor (`check_region`: the outermost one of at
    most REGION_MAX_BYTES, on whole lines), before and after the fill, so its cost does not grow
    with the file; a fill holding a multi-line string or comment delimiter must also leave them
    paired in the region (so the rest of the file lexes as before). The whole file is re-parsed
    instead (incrementally, from the document's tree) when the cursor sits in a larger statement."""

    def __init__(self, text: str, tree: Tree, parser: Parser | None, offset: int, region_limit: int = REGION_MAX_BYTES):
        assert parser is not None, "a document with a tree has a parser (Document.parser)"
        self.parser, self.tree, self.calls = parser, tree, 0
        # the bytes the document's tree was parsed from (lone CR as LF, lone surrogates as U+FFFD)
        src_before = parse_source(text[:offset])
        cursor = len(src_before)
        self.src = src_before + parse_source(text[offset:])
        self.cursor = cursor
        self.text_from_cursor = text[offset:]
        probe = cursor
        line_end = text.find("\n", offset)
        if not text[text.rfind("\n", 0, offset) + 1 : len(text) if line_end == -1 else line_end].strip():
            # a blank line after a body lies outside its node: probe at the last code before it
            probe = max(0, len(parse_source(text[:offset].rstrip())) - 1)
        self.region = check_region(tree.root_node, self.src, cursor, probe, region_limit) if region_limit > 0 else None
        self._whole: _Source | None = None
        self._local: _Source | None = None
        if self.region is not None:
            a, b = self.region
            self._local = _Source(self.src[a:b], cursor - a, None)
            self._local.with_base(parser.parse(self._local.src).root_node)

    def whole(self) -> _Source:
        if self._whole is None:
            self._whole = _Source(self.src, self.cursor, self.tree).with_base(self.tree.root_node)
        return self._whole

    def __call__(self, fill: str, replace_len: int = 0) -> bool:
        self.calls += 1
        replaced = len(parse_source(self.text_from_cursor[:replace_len]))
        fb = fill.encode("utf-8")
        v = self.whole() if self._local is None else self._local
        start = v.cursor
        src = v.src[:start] + fb + v.src[start + replaced :]
        if v is self._local and any(m in fill for m in PAIRING_MARKERS) and not _pairs_close(src):
            return False  # the fill leaves a string or comment open past the statement
        if v.tree is not None:
            tree = v.tree.copy()
            nl = fill.rfind("\n")
            end_pt = (
                (v.row, v.col_bytes + len(fb))
                if nl == -1
                else (v.row + fill.count("\n"), len(fill[nl + 1 :].encode("utf-8")))
            )
            tree.edit(
                start, start + replaced, start + len(fb), (v.row, v.col_bytes), (v.row, v.col_bytes + replaced), end_pt
            )
            new = error_nodes(self.parser.parse(src, tree).root_node)
        else:
            new = error_nodes(self.parser.parse(src).root_node)
        if len(new) > v.base_errors:
            return False
        lo = start + 1 if v.base_starts_at_cursor else start
        return not any(lo <= n.start_byte < start + len(fb) for n in new)
