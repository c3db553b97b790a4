"""Identifier-aware decoding (DecodeOptions.names): a fill's identifiers are names that exist.

Of the default model's misses on 1,000 held-out line holes, 131 wrote an identifier that occurs
nowhere in the file where the true text had one that does (docs/research/19-s10-identifier-aware-decoding.md). The names
in scope are the identifiers of the job's own text (prefix, suffix and FillJob.lookup: the rest of
the document and the other open files) plus the language's keywords and builtins. At the leftmost
masked slot, whose left side is all committed text, a token that would make the identifier under
way a name that is in none of them loses `names` nats: one that continues it (`resp` + `onse`)
only while the result is the start of a known name, one that ends it (`(`, ` =`) only where it is
a whole known name. A name already off every known one (a new variable) is left alone, as are
numbers, strings and comments. At the healed slot (token healing re-types the partial word at the
cursor) the name starts inside the slot's own token, so that token's whole identifier is checked.

A job's names are gathered when it is admitted (`known_names`), at every keystroke, from texts that
barely change between keystrokes: the other open files and the document away from the cursor are
the same text each time. So each text is scanned in runs of CHUNK_LINES (64) whole lines, each
run's names cached by its text (no identifier spans a line break), and a keystroke pays the regex
only for the run it changed; jobs with the same names share one sorted `NameSet`, so typing inside
a name the file already has builds nothing new.

Only ASCII identifiers are tracked; a token with other letters is never penalized.
"""

from __future__ import annotations

import bisect
import builtins
import keyword
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.tokenizer import TextTokenizer

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TAIL = re.compile(r"[A-Za-z0-9_]*\Z")
_RUN = re.compile(r"[^A-Za-z0-9_]*([A-Za-z0-9_]*)")  # a candidate token's first identifier run
_LEAD = re.compile(r"[A-Za-z0-9_]*")
_OPEN, _CLOSE = {"(": ")", "[": "]", "{": "}"}, {")": "(", "]": "[", "}": "{"}
_BRACKETISH = re.compile(r"[()\[\]{}'\"#]")


def _always(m: re.Match[str] | None) -> re.Match[str]:
    """The match of a pattern above that matches every string (_TAIL, _RUN, _LEAD: runs of `*`)."""
    assert m is not None, "the pattern matches the empty string"
    return m


BASE_NAMES = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | frozenset(dir(builtins))
MAX_TEXT = 256 * 1024  # characters of a job's text searched for names (its end kept)
MAX_RANGE = 4096  # known names starting with the partial one beyond this: too open to constrain


class Vocab:
    """Per tokenizer, built once: each token's text, its leading identifier run and whether the
    token is that run alone (so the identifier may go on in the next token)."""

    def __init__(self, texts: list[str], special: set[int]):
        self.size = len(texts)
        self.texts = texts
        self.lead = [_always(_LEAD.match(t)).group(0) for t in texts]
        self.whole: dict[str, int] = {}  # identifier-only text -> id
        self.ending: dict[str, list[int]] = {}  # leading run -> ids with more (non-identifier) text after it
        id_start, non_id = [], []
        for i, (t, lead) in enumerate(zip(texts, self.lead)):
            if i in special or not t or "\ufffd" in t or not t.isascii():
                continue
            if lead:
                id_start.append(i)
                if lead == t:
                    self.whole[t] = i
                else:
                    self.ending.setdefault(lead, []).append(i)
            else:
                non_id.append(i)
        self.id_start = torch.tensor(id_start, dtype=torch.long)
        self.non_id = torch.tensor(non_id, dtype=torch.long)
        # the bracket rule: tokens whose first bracket, quote or comment character closes a bracket
        closers: dict[str, list[int]] = {c: [] for c in _CLOSE}
        for i, t in enumerate(texts):
            if i in special:
                continue
            m = _BRACKETISH.search(t)
            if m and m.group(0) in _CLOSE:
                closers[m.group(0)].append(i)
        self.closers = {c: torch.tensor(ids, dtype=torch.long) for c, ids in closers.items()}


CHUNK_LINES = 64  # names_in caches each text's names per run of this many lines
MAX_CHUNKS = 4096  # chunks kept (about 4096 x 64 lines of distinct text)
MAX_SETS = 16  # NameSets kept by known_names


class _Chunks:
    """The names of text chunks, least recently used dropped: between keystrokes the other open
    files (FillJob.lookup) and all but the cursor's chunk of the document are the same text, so a
    job pays the regex only for the chunks that changed (a line identifier never spans a chunk:
    chunks are whole lines). Thread-safe: several engine workers may admit jobs at once."""

    def __init__(self, cap: int = MAX_CHUNKS):
        self.cap = cap
        self._d: OrderedDict[str, frozenset[str]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def names(self, chunk: str) -> frozenset[str]:
        with self._lock:
            got = self._d.get(chunk)
            if got is not None:
                self._d.move_to_end(chunk)
                self.hits += 1
                return got
        got = frozenset(_NAME.findall(chunk))
        with self._lock:
            self.misses += 1
            self._d[chunk] = got
            while len(self._d) > self.cap:
                self._d.popitem(last=False)
        return got


_CHUNKS = _Chunks()


def names_in(*texts: str) -> set[str]:
    """The identifiers of some texts (the end of each kept when long) plus keywords and builtins."""
    out = set(BASE_NAMES)
    for t in texts:
        t = t[-MAX_TEXT:]
        if len(t) < 1024:  # the cursor's lines: cheaper to scan than to look up
            out.update(_NAME.findall(t))
            continue
        lines = t.split("\n")
        for i in range(0, len(lines), CHUNK_LINES):
            out |= _CHUNKS.names("\n".join(lines[i : i + CHUNK_LINES]))
    return out


_SETS: OrderedDict[frozenset[str], NameSet] = OrderedDict()
_SETS_LOCK = threading.Lock()


def known_names(*texts: str) -> NameSet:
    """NameSet(names_in(*texts)), the sorted set shared with the last jobs that had the same names
    (typing inside a name the file already has changes none of them)."""
    key = frozenset(names_in(*texts))
    with _SETS_LOCK:
        got = _SETS.get(key)
        if got is not None:
            _SETS.move_to_end(key)
            return got
    got = NameSet(key)
    with _SETS_LOCK:
        _SETS[key] = got
        while len(_SETS) > MAX_SETS:
            _SETS.popitem(last=False)
    return got


NAMES_FILE = "names.txt"  # in a model folder: identifiers common in its training corpus, one per line
MAX_NAMES_BYTES = 1 << 20


def load_names(folder: str | Path) -> frozenset[str]:
    """The model's corpus names (NAMES_FILE in its folder; `dlm-lsp names` writes it), empty if
    absent; only identifier lines are kept, and a file over MAX_NAMES_BYTES is refused."""
    p = Path(folder) / NAMES_FILE
    if not p.is_file():
        return frozenset()
    if p.stat().st_size > MAX_NAMES_BYTES:
        raise ValueError(f"{p} is over {MAX_NAMES_BYTES} bytes")
    return frozenset(w for w in p.read_text(encoding="utf-8", errors="replace").split() if _NAME.fullmatch(w))


def _scan(line: str, visit: Callable[[int, str], None] | None = None) -> bool:
    """Walks `line` outside its strings (quotes by parity) up to a comment, calling `visit(i, ch)`
    on each code character; True when the line's end is in code (not in a string or comment)."""
    quote = None
    i = 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return False
        elif visit is not None:
            visit(i, ch)
        i += 1
    return quote is None


def in_code(left: str) -> bool:
    """False when the end of `left` is inside a string or a comment of its line (quotes by parity)."""
    return _scan(left[left.rfind("\n") + 1 :])


def line_brackets(line: str, fill_from: int) -> list[tuple[str, bool]]:
    """The brackets left open on `line` (a line's text up to the slot), outside strings and comments
    (as in_code), each with whether it opened at or after `fill_from` (in the fill)."""
    stack: list[tuple[str, bool]] = []

    def visit(i: int, ch: str) -> None:
        if ch in _OPEN:
            stack.append((ch, i >= fill_from))
        elif ch in _CLOSE and stack and stack[-1][0] == _CLOSE[ch]:
            stack.pop()

    _scan(line, visit)
    return stack


class NameSet:
    """Names, sorted once for prefix queries."""

    def __init__(self, names: Iterable[str]):
        self.set = frozenset(names)
        self.sorted = sorted(self.set)

    def starting(self, p: str) -> list[str]:
        lo = bisect.bisect_left(self.sorted, p)
        return self.sorted[lo : bisect.bisect_left(self.sorted, p + "\x7f", lo)]

    def has_start(self, p: str) -> bool:
        lo = bisect.bisect_left(self.sorted, p)
        return lo < len(self.sorted) and self.sorted[lo].startswith(p)


class NameBias:
    """The penalty rows of one job over the union of `sets` (NameSet: the job's names, the model's
    corpus names): `row(left)` for the leftmost masked slot, `heal_row(left, ids)` for the healed
    slot's candidate ids, cached per partial identifier. `base`: the canvas's prefix text just
    before slot 0; `decode`: ids -> text (the job's tokenizer)."""

    def __init__(
        self,
        vocab: Vocab,
        sets: list[NameSet],
        weight: float,
        base: str = "",
        decode: Callable[[list[int]], str] | None = None,
        brackets: float = 0.0,
        ends: tuple[int, ...] = (),
    ):
        self.vocab, self.weight = vocab, float(weight)
        self.sets = [s for s in sets if s.sorted]
        self.base, self.decode = base, decode
        self.brackets, self.ends = float(brackets), tuple(ends)
        self._rows: dict[str, torch.Tensor | None] = {}
        self._brows: dict[tuple[str, int], torch.Tensor | None] = {}
        self._hrows: dict[tuple[str, tuple[int, ...]], torch.Tensor | None] = {}
        self._left: dict[tuple[int, ...], str] = {}

    def left_of(self, slot_ids: list[int]) -> str:
        """The committed text left of the slot after `slot_ids` (all committed): base + their text."""
        key = tuple(slot_ids)
        if key not in self._left:
            text = ""
            if slot_ids:
                if self.decode is None:  # a NameBias made without its tokenizer reads no committed slot
                    raise TypeError("NameBias.left_of needs `decode` to read committed slots")
                text = self.decode(list(slot_ids))
            self._left[key] = self.base + text
        return self._left[key]

    def slot_row(self, slot_ids: list[int], heal: list[int] | None) -> torch.Tensor | None:
        """The penalty of the leftmost masked slot, the slots before it committed as `slot_ids`;
        `heal`: its candidates when it is the healed slot."""
        left = self.left_of(slot_ids)
        if heal is not None:
            return self.heal_row(left, heal) if self.weight else None
        rows = [
            r
            for r in (self.row(left) if self.weight else None, self.bracket_row(left) if self.brackets else None)
            if r is not None
        ]
        return None if not rows else rows[0] if len(rows) == 1 else rows[0] + rows[1]

    def bracket_row(self, left: str) -> torch.Tensor | None:
        """(V,) the bracket rule's penalty for the slot after committed text `left` (DecodeOptions.
        brackets), or None: with a bracket open on the cursor's line, a token that closes another
        kind loses `brackets` nats, and while a bracket the fill opened is open, so do the ends
        (`ends`: padding, end of text, the line-break stop)."""
        start = left.rfind("\n") + 1
        key = (left[start:], max(0, len(self.base) - start))
        if key in self._brows:
            return self._brows[key]
        out = None
        if in_code(left):
            stack = line_brackets(*key)
            if stack:
                out = torch.zeros(self.vocab.size)
                want = _OPEN[stack[-1][0]]
                for c, ids in self.vocab.closers.items():
                    if c != want and ids.numel():
                        out[ids] = -self.brackets
                if any(in_fill for _, in_fill in stack) and self.ends:
                    out[torch.tensor(self.ends, dtype=torch.long)] = -self.brackets
        self._brows[key] = out
        return out

    def known(self, name: str) -> bool:
        return any(name in s.set for s in self.sets)

    def known_start(self, p: str) -> bool:
        return any(s.has_start(p) for s in self.sets)

    def ok(self, run: str, ended: bool) -> bool:
        """True when an identifier `run` is fine: a known name if it `ended`, else the start of one."""
        if not run or run[0].isdigit():
            return True
        return self.known(run) if ended else self.known_start(run)

    def row(self, left: str) -> torch.Tensor | None:
        """(V,) penalty for the slot after committed text `left`, or None when nothing is penalized
        (no identifier under way, a new name, a number, a string or comment)."""
        p = _always(_TAIL.search(left)).group(0)
        if not p or p[0].isdigit() or not in_code(left):
            return None
        if p in self._rows:
            return self._rows[p]
        out = None
        starting = set().union(*(s.starting(p) for s in self.sets)) if self.sets else set()
        if starting and len(starting) <= MAX_RANGE:
            v = self.vocab
            allowed = []
            for name in starting:
                rem = name[len(p) :]
                for j in range(1, len(rem) + 1):
                    i = v.whole.get(rem[:j])
                    if i is not None:
                        allowed.append(i)
                allowed.extend(v.ending.get(rem, ()) if rem else ())
            out = torch.zeros(v.size)
            out[v.id_start] = -self.weight
            if allowed:
                out[torch.tensor(allowed, dtype=torch.long)] = 0.0
            if not self.known(p):  # it may not end here
                out[v.non_id] = -self.weight
        self._rows[p] = out
        return out

    def heal_row(self, left: str, ids: list[int]) -> torch.Tensor | None:
        """(V,) penalty over the healed slot's candidates `ids` (their text starts with the healed
        tail): each candidate's identifier run, from the partial one in `left`, must be known."""
        if not in_code(left):
            return None
        p = _always(_TAIL.search(left)).group(0)
        if p and (p[0].isdigit() or not self.known_start(p)):
            return None  # a number, or a new name: nothing to hold its candidates to
        key = (p, tuple(ids))
        if key in self._hrows:  # the same partial identifier and candidates: every step of a fill
            return self._hrows[key]
        out = torch.zeros(self.vocab.size)
        hit = False
        for i in ids:
            s = self.vocab.texts[i]
            if p:
                lead = self.vocab.lead[i]
                run, ended = p + lead, lead != s
            else:
                m = _always(_RUN.match(s))
                run, ended = m.group(1), m.end() < len(s)
                if not run:
                    continue
            if not self.ok(run, ended):
                out[i] = -self.weight
                hit = True
        self._hrows[key] = out if hit else None
        return self._hrows[key]


_VOCABS: dict[int, Vocab] = {}


def vocab_for(tok: TextTokenizer) -> Vocab:
    """The Vocab of an engine.tokenizer.TextTokenizer (built once per tokenizer object)."""
    v = _VOCABS.get(id(tok))
    if v is None:
        texts = [tok.token_text(i) for i in range(tok.vocab_size)]
        added = {i for i, t in tok.tok.get_added_tokens_decoder().items() if t.special}
        v = _VOCABS[id(tok)] = Vocab(texts, added)
    return v
