"""Evaluation holes cut from Python files with tree-sitter: prefix + middle + suffix at character offsets.

Three kinds, shaped like what the server is asked to fill:
  line   - the cursor is 1-15 characters into a code line; the middle is the rest of that line
  block  - the cursor is at the indentation of a function body's first line (after the `def ...:`
           header's newline); the middle is the whole body (2-8 lines); the suffix follows the body
  middle - the middle is one syntax node inside a single line, with code after it on that line
Only files that parse without errors are used, so "the fill adds no syntax error" is well defined.
Sampling is deterministic for a seed: each kind has its own RNG, a file is drawn uniformly (so one
big file of tables cannot dominate) and then a candidate in it, without repeats.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tree_sitter import Parser, Tree

KINDS = ("line", "block", "middle")
LINE_CUT_MAX = 15  # characters into the code of a line at most
BLOCK_LINES = (2, 8)  # body lines, inclusive
MIDDLE_CHARS = (2, 40)  # bytes of a middle-hole node
MAX_LINE_CHARS = 160  # longer lines are data tables or generated code, not what people type
# single-line nodes that are not code a user types as a unit
_MIDDLE_SKIP = {
    "comment",
    "string_content",
    "string_start",
    "string_end",
    "escape_sequence",
    "block",
    "module",
    "expression_statement",
    "line_continuation",
    "interpolation",
    "format_specifier",
}


@lru_cache(maxsize=1)
def _parser() -> Parser:
    import tree_sitter_python as tsp
    from tree_sitter import Language, Parser

    return Parser(Language(tsp.language()))


def parse(text: str) -> Tree:
    """Returns the tree-sitter tree of Python source text."""
    return _parser().parse(text.encode("utf-8"))


def count_syntax_errors(text: str) -> int:
    """Returns the number of ERROR and MISSING nodes in the parse of `text`."""
    tree = parse(text)
    if not tree.root_node.has_error:
        return 0
    n, stack = 0, [tree.root_node]
    while stack:
        cur = stack.pop()
        if cur.is_error or cur.is_missing:
            n += 1
        if cur.has_error:  # only subtrees that contain an error can hold more
            stack.extend(cur.children)
    return n


@dataclass
class Hole:
    """One hole: text[:a] is the prefix, text[a:b] the middle, text[b:] the suffix (character offsets)."""

    kind: str
    key: str  # the file's corpus key
    text: str  # the whole original file
    a: int
    b: int

    @property
    def prefix(self) -> str:
        return self.text[: self.a]

    @property
    def middle(self) -> str:
        return self.text[self.a : self.b]

    @property
    def suffix(self) -> str:
        return self.text[self.b :]

    @property
    def document(self) -> str:
        """The file as an editor holds it when the cursor sits in the hole: the middle removed."""
        return self.text[: self.a] + self.text[self.b :]

    @property
    def line(self) -> int:
        """0-based line of the cursor."""
        return self.text.count("\n", 0, self.a)

    @property
    def col(self) -> int:
        """0-based column of the cursor, in characters."""
        return self.a - (self.text.rfind("\n", 0, self.a) + 1)

    def filled(self, fill: str) -> str:
        return self.text[: self.a] + fill + self.text[self.b :]

    def describe(self) -> dict:
        return {"kind": self.kind, "key": self.key, "line": self.line + 1, "col": self.col + 1, "middle": self.middle}


class _File:
    """One parsed file and its candidate holes per kind, in byte offsets (computed lazily)."""

    def __init__(self, key: str, text: str):
        self.key, self.text = key, text
        self.raw = text.encode("utf-8")
        self.tree = parse(text)
        self.ok = not self.tree.root_node.has_error
        self.line_starts = [0]
        for i, ch in enumerate(self.raw):
            if ch == 10:
                self.line_starts.append(i + 1)
        self._cands: dict[str, list] = {}

    def line_bytes(self, row: int) -> bytes:
        """The row's bytes without its newline."""
        s = self.line_starts[row]
        e = self.line_starts[row + 1] - 1 if row + 1 < len(self.line_starts) else len(self.raw)
        return self.raw[s:e].rstrip(b"\r")

    def char_offset(self, byte_off: int) -> int:
        return len(self.raw[:byte_off].decode("utf-8"))

    def candidates(self, kind: str) -> list:
        if kind not in self._cands:
            self._cands[kind] = getattr(self, f"_{kind}_candidates")() if self.ok else []
        return self._cands[kind]

    def _starts_in_string_or_comment(self, row: int, col: int) -> bool:
        node = self.tree.root_node.descendant_for_point_range((row, col), (row, col))
        while node is not None:
            if node.type == "comment":
                return True
            if node.type == "string" and node.start_point.row < row:
                return True  # a line inside a multi-line string (docstring)
            node = node.parent
        return False

    def _line_candidates(self) -> list[int]:
        rows = []
        for row in range(len(self.line_starts)):
            line = self.line_bytes(row)
            code = line.strip()
            if len(code) < 2 or code.startswith(b"#") or len(line) > MAX_LINE_CHARS:
                continue
            if self._starts_in_string_or_comment(row, len(line) - len(line.lstrip())):
                continue
            rows.append(row)
        return rows

    def _block_candidates(self) -> list[tuple[int, int]]:
        out = []
        stack = [self.tree.root_node]
        while stack:
            node = stack.pop()
            stack.extend(reversed(node.children))
            if node.type != "function_definition":
                continue
            body = node.child_by_field_name("body")
            colon = body.prev_sibling if body is not None else None
            while colon is not None and colon.type == "comment":  # `def f():  # note`
                colon = colon.prev_sibling
            if body is None or colon is None or colon.type != ":":
                continue
            # the body starts at its first statement, on the line right after the header
            stmts = [c for c in body.named_children if c.type != "comment"]
            if not stmts:
                continue
            first_stmt = stmts[0]
            r0, r1 = first_stmt.start_point.row, body.end_point.row
            if r0 != colon.end_point.row + 1 or not BLOCK_LINES[0] <= r1 - r0 + 1 <= BLOCK_LINES[1]:
                continue  # one-line `def f(): ...`, comment lines before the body, or too short / long
            first = self.line_bytes(r0)
            if first_stmt.start_point.column != len(first) - len(first.lstrip()):
                continue
            last = self.line_bytes(r1)
            rest = last[body.end_point.column :].strip()
            if rest and not rest.startswith(b"#"):
                continue
            out.append((first_stmt.start_byte, self.line_starts[r1] + len(last)))
        return out

    def _middle_candidates(self) -> list[tuple[int, int]]:
        spans = set()
        stack = [self.tree.root_node]
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if not node.is_named or node.type in _MIDDLE_SKIP or node.start_point.row != node.end_point.row:
                continue
            if not MIDDLE_CHARS[0] <= node.end_byte - node.start_byte <= MIDDLE_CHARS[1]:
                continue
            row = node.start_point.row
            line = self.line_bytes(row)
            after = line[node.end_point.column :].strip()
            if not after or after.startswith(b"#") or len(line) > MAX_LINE_CHARS:
                continue
            if self._starts_in_string_or_comment(row, node.start_point.column):
                continue
            spans.add((node.start_byte, node.end_byte))
        return sorted(spans)

    def take(self, kind: str, rng: random.Random) -> Hole | None:
        """Removes one random candidate of `kind` and returns it as a Hole (None when none is left)."""
        cands = self.candidates(kind)
        if not cands:
            return None
        c = cands.pop(rng.randrange(len(cands)))
        if kind == "line":
            row = c
            line = self.line_bytes(row).decode("utf-8")
            indent = len(line) - len(line.lstrip())
            code_len = len(line.rstrip()) - indent
            k = rng.randint(1, min(LINE_CUT_MAX, code_len - 1))
            start = self.char_offset(self.line_starts[row])
            return Hole(kind, self.key, self.text, start + indent + k, start + len(line))
        a, b = c
        return Hole(kind, self.key, self.text, self.char_offset(a), self.char_offset(b))


def cut_holes(
    files: list[tuple[str, str]], per_kind: int, seed: int = 0, kinds: tuple[str, ...] = KINDS
) -> dict[str, list[Hole]]:
    """Returns up to `per_kind` holes of each kind from (key, text) pairs, deterministic for a seed."""
    parsed = [_File(k, t) for k, t in sorted(files, key=lambda kt: kt[0])]
    parsed = [f for f in parsed if f.ok]
    out: dict[str, list[Hole]] = {}
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown hole kind {kind!r}; known: {', '.join(KINDS)}")
        rng = random.Random(f"dlm-lsp-holes:{seed}:{kind}")
        pool = list(parsed)
        holes: list[Hole] = []
        while pool and len(holes) < per_kind:
            i = rng.randrange(len(pool))
            h = pool[i].take(kind, rng)
            if h is None or not h.middle.strip():
                if h is None:
                    pool.pop(i)
                continue
            holes.append(h)
        out[kind] = holes
    return out
