"""Open documents: text, version and an incrementally re-parsed tree-sitter tree per document.

Each didChange edits the old tree (`tree.edit`) and re-parses with it (`parser.parse(src, old)`),
so a keystroke costs a re-parse of the changed region only. Languages without a grammar here keep
text only and are handled by indentation in `context`.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

from tree_sitter import Language, Parser, Point, Tree

from dlm_lsp.positions import UTF16, LineIndex

log = logging.getLogger("dlm.documents")

# languageId -> canonical grammar name
_GRAMMAR_OF = {
    "python": "python",
    "javascript": "javascript",
    "javascriptreact": "javascript",
    "typescript": "typescript",
    "typescriptreact": "tsx",
    "go": "go",
    "rust": "rust",
}
_EXTENSIONS = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript", ".cjs": "javascript",
    ".jsx": "javascriptreact", ".ts": "typescript", ".mts": "typescript", ".tsx": "typescriptreact",
    ".go": "go", ".rs": "rust",
}


def language_id_for_path(path: str) -> str:
    """The LSP languageId an editor would give a file, from its extension ("plaintext" if unknown)."""
    for ext, lang in _EXTENSIONS.items():
        if path.endswith(ext):
            return lang
    return "plaintext"


def grammar_name(language_id: str) -> str | None:
    """Canonical grammar name for a languageId (None: indentation only)."""
    return _GRAMMAR_OF.get(language_id)


@functools.cache
def grammar(name: str) -> Language | None:
    """The tree-sitter Language for a canonical grammar name, or None if its package is missing."""
    try:
        if name == "python":
            import tree_sitter_python as m

            return Language(m.language())
        if name == "javascript":
            import tree_sitter_javascript as m

            return Language(m.language())
        if name in ("typescript", "tsx"):
            import tree_sitter_typescript as m

            return Language(m.language_typescript() if name == "typescript" else m.language_tsx())
        if name == "go":
            import tree_sitter_go as m

            return Language(m.language())
        if name == "rust":
            import tree_sitter_rust as m

            return Language(m.language())
    except ImportError:
        log.warning("tree-sitter grammar for %s is not installed; using indentation only", name)
    return None


def make_parser(language_id: str) -> Parser | None:
    """A fresh Parser for a languageId, or None when no grammar is available."""
    name = grammar_name(language_id)
    lang = grammar(name) if name else None
    return Parser(lang) if lang is not None else None


@dataclass
class Document:
    """One open document. `text` is the truth; `tree` mirrors it when a grammar exists."""

    uri: str
    language_id: str
    version: int
    text: str
    parser: Parser | None = field(default=None, repr=False)
    tree: Tree | None = field(default=None, repr=False)
    _index: LineIndex | None = field(default=None, repr=False)
    _index_encoding: str = UTF16

    def __post_init__(self):
        if self.parser is None:
            self.parser = make_parser(self.language_id)
        self.reparse()

    def index(self, encoding: str = UTF16) -> LineIndex:
        """Line index of the current text (cached until the next change)."""
        if self._index is None or self._index.text is not self.text or self._index.encoding != encoding:
            self._index = LineIndex(self.text, encoding)
        return self._index

    def reparse(self, incremental: bool = False) -> None:
        if self.parser is None:
            return
        src = self.text.encode("utf-8")
        if incremental and self.tree is not None:
            self.tree = self.parser.parse(src, self.tree)
        else:
            self.tree = self.parser.parse(src)

    def apply_change(self, start: tuple[int, int] | None, end: tuple[int, int] | None, new_text: str,
                     encoding: str = UTF16) -> None:
        """Applies one content change: a range in LSP (line, character) or None for the full text."""
        if start is None or end is None:
            self.text = new_text
            self.tree = None
            self._index = None
            return
        idx = self.index(encoding)
        a, b = idx.offset(*start), idx.offset(*end)
        if b < a:
            a, b = b, a
        old = self.text
        if self.tree is not None:
            # tree-sitter wants byte offsets and (row, byte column) points
            row_a, col_a = idx.row_col(a)
            row_b, col_b = idx.row_col(b)
            line_a = idx.line_text(row_a)
            line_b = idx.line_text(row_b)
            start_byte = len(old[:a].encode("utf-8"))
            old_end_byte = start_byte + len(old[a:b].encode("utf-8"))
            new_end_byte = start_byte + len(new_text.encode("utf-8"))
            start_pt = Point(row_a, len(line_a[:col_a].encode("utf-8")))
            old_end_pt = Point(row_b, len(line_b[:col_b].encode("utf-8")))
            nl = new_text.rfind("\n")
            if nl == -1:
                new_end_pt = Point(row_a, start_pt.column + len(new_text.encode("utf-8")))
            else:
                new_end_pt = Point(row_a + new_text.count("\n"), len(new_text[nl + 1 :].encode("utf-8")))
            self.tree.edit(start_byte, old_end_byte, new_end_byte, start_pt, old_end_pt, new_end_pt)
        self.text = old[:a] + new_text + old[b:]
        self._index = idx.edited(a, b, new_text, self.text)  # no rescan of a big file per keystroke


class DocumentStore:
    """Documents by URI."""

    def __init__(self):
        self._docs: dict[str, Document] = {}

    def open(self, uri: str, language_id: str, version: int, text: str) -> Document:
        doc = Document(uri, language_id, version, text)
        self._docs[uri] = doc
        return doc

    def get(self, uri: str) -> Document | None:
        return self._docs.get(uri)

    def close(self, uri: str) -> None:
        self._docs.pop(uri, None)

    def change(self, uri: str, version: int, changes, encoding: str = UTF16) -> Document | None:
        """Applies LSP content changes (objects with optional `range` and `text`) and re-parses once."""
        doc = self._docs.get(uri)
        if doc is None:
            log.warning("didChange for a document that is not open: %s", uri)
            return None
        incremental = True
        for ch in changes:
            rng = getattr(ch, "range", None)
            if rng is None:
                doc.apply_change(None, None, ch.text)
                incremental = False
            else:
                doc.apply_change((rng.start.line, rng.start.character), (rng.end.line, rng.end.character),
                                 ch.text, encoding)
        doc.version = version
        doc.reparse(incremental=incremental and doc.tree is not None)
        return doc

    def __len__(self) -> int:
        return len(self._docs)
