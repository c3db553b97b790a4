"""A Python file as the synthetic edits (engine/train/synth_edits.py) read it: its code tokens at
character offsets (stdlib `tokenize`; comments, NL and indents dropped, and everything inside an
f-string, which 3.12 tokenizes, counted as part of the string) beside its `ast` tree, whose positions
(UTF-8 byte columns) convert to the same offsets. A site found in either is an offset into the text."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from bisect import bisect_left
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from engine.train.edit_pairs import Edit

MAX_CHARS = 100_000  # a bigger file is not read: its tree walks cost more than its cases are worth

_DROP = {tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER, tokenize.ENCODING}
_FOPEN = {getattr(tokenize, n) for n in ("FSTRING_START", "TSTRING_START") if hasattr(tokenize, n)}
_FCLOSE = {getattr(tokenize, n) for n in ("FSTRING_END", "TSTRING_END") if hasattr(tokenize, n)}


class Tok(NamedTuple):
    type: int
    string: str
    start: int  # character offsets in the text
    end: int


@dataclass
class Source:
    """One file's text, its code tokens (NEWLINE kept: it ends a statement) and its tree."""

    text: str
    tree: ast.Module
    toks: list[Tok]
    starts: list[int]  # each line's first character
    tok_starts: list[int] = field(init=False)
    nodes: list[ast.AST] = field(init=False)  # every node of the tree, walked once for every kind

    def __post_init__(self) -> None:
        self.tok_starts = [t.start for t in self.toks]
        self.nodes = list(ast.walk(self.tree))

    def off(self, line: int, col: int) -> int:
        """The character offset of an `ast` position (its column counts UTF-8 bytes)."""
        s = self.starts[line - 1]
        if self.text[s : s + col].isascii():
            return s + col
        return s + len(self.text[s : s + 4 * col].encode()[:col].decode("utf-8", "replace"))

    def start(self, node: ast.AST) -> int:
        return self.off(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self.off(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def at(self, off: int) -> int | None:
        """The index of the token starting at `off`, if one does."""
        i = bisect_left(self.tok_starts, off)
        return i if i < len(self.toks) and self.toks[i].start == off else None

    def span(self, lo: int, hi: int) -> range:
        """Indices of the tokens starting in [lo, hi)."""
        return range(bisect_left(self.tok_starts, lo), bisect_left(self.tok_starts, hi))

    def close(self, i: int) -> int:
        """The index of the bracket closing the one at i."""
        depth = 0
        for j in range(i, len(self.toks)):
            s = self.toks[j].string
            depth += (s in "([{") - (s in ")]}") if self.toks[j].type == tokenize.OP else 0
            if depth == 0:
                return j
        raise ValueError("unbalanced brackets")

    @cached_property
    def statements(self) -> list[tuple[int, int]]:
        """(start, end) of every statement, a decorated one from its first decorator."""
        return [
            (self.start((getattr(s, "decorator_list", None) or [s])[0]), self.end(s))
            for s in self.nodes
            if isinstance(s, ast.stmt)
        ]

    def parses_with(self, sites: list[Edit]) -> bool:
        """Whether the smallest statement holding the sites (offsets in the text, top to bottom) still
        parses with them applied: the rest of the file is unchanged, and parsed already. A nested one is
        parsed under `if 1:` (the parser does not ask that `return` be in a function)."""
        lo, hi = sites[0][0], sites[-1][0] + len(sites[-1][1])
        a, b = 0, len(self.text)
        for sa, sb in self.statements:
            if sa <= lo and hi <= sb and sb - sa < b - a:
                a, b = sa, sb
        a = self.text.rfind("\n", 0, a) + 1  # from its line's start (a decorator's '@' is left of it)
        out, pos = ["if 1:\n" if self.text[a] in " \t" else ""], a
        for off, old, new in sites:
            out += [self.text[pos:off], new]
            pos = off + len(old)
        try:
            ast.parse("".join(out) + self.text[pos:b])
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return False
        return True


def read_source(text: str) -> Source | None:
    """The file read into a Source, or None when it is too big, does not parse or does not tokenize."""
    if len(text) > MAX_CHARS:
        return None
    try:
        tree = ast.parse(text)
        raw = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (SyntaxError, ValueError, tokenize.TokenError, RecursionError, MemoryError):
        return None
    starts = [0] + [m.end() for m in re.finditer("\n", text)]  # StringIO's readline splits at \n only
    toks, depth = [], 0
    for t in raw:
        depth += (t.type in _FOPEN) - (t.type in _FCLOSE)
        if depth or t.type in _DROP or t.type in _FCLOSE:
            continue
        tok = Tok(t.type, t.string, starts[t.start[0] - 1] + t.start[1], starts[t.end[0] - 1] + t.end[1])
        if t.type != tokenize.NEWLINE and text[tok.start : tok.end] != t.string:
            return None  # a line break tokenize and this count differently (a lone \r)
        toks.append(tok)
    return Source(text, tree, toks, starts)
