"""Open documents: the server's own copy of each editor buffer, its version, and a tree-sitter tree.

The text is the truth and equals the editor's, whatever the editor sends: positions follow the
spec's rules (`positions`: line breaks are exactly \\n, \\r\\n and \\r; out-of-range positions
clamp), the text is kept exactly as received (lone surrogates included), and nothing else in the
server (pygls's workspace included) keeps or edits a copy. Documents are found by a normalized URI
(`uri_key`), so two spellings of one URI are one document.

The tree is parsed lazily: each change edits the old tree (`tree.edit`), and the first use after
changes re-parses with it (`parser.parse(src, old)`), so a burst of changes costs one parse.
tree-sitter's incremental parse still visits every node of a long flat list (the statements of a
module, measured at 1-2.6 us each), so big documents get no tree and their context comes from
indentation alone (`context`): over MAX_PARSE_CHARS characters, with a line over MAX_LINE_CHARS,
with more than MAX_TOP_LEVEL_NODES top-level nodes, or after SLOW_PARSES re-parses in a row over
SLOW_PARSE_MS. The limits are checked when the document opens or gets a full-text change, and
size and line length after each edit; a document that lost its tree gets it back only with a
full-text change. Languages without a grammar here keep text only.
"""

from __future__ import annotations

import functools
import logging
import re
import string
import time
from dataclasses import dataclass

from tree_sitter import Language, Parser, Point, Tree

from dlm_lsp.fill.positions import UTF16, LineIndex, utf8_len

log = logging.getLogger("dlm.documents")

# CPU time of one incremental re-parse after a one-character edit (tree-sitter 0.26, 2-core box):
# 2 MB of short Python lines (130k statements) 370 ms, 3.9 MB of one-line JavaScript 320 ms, 2 MB
# of small functions 58 ms, 128 kB of short lines (10k statements) 19-35 ms, 1 MB of real code 9 ms.
MAX_PARSE_CHARS = 1_000_000
MAX_LINE_CHARS = 10_000  # minified code: no useful syntax context, and lines cost Python loops
MAX_TOP_LEVEL_NODES = 10_000  # 20-35 ms of CPU per re-parse of a flat module that big
SLOW_PARSE_MS = 30.0
SLOW_PARSES = 2

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
    ".py": "python",
    ".pyi": "python",
    ".js": "javascript",
    ".mjs": "javascript",
    ".cjs": "javascript",
    ".jsx": "javascriptreact",
    ".ts": "typescript",
    ".mts": "typescript",
    ".tsx": "typescriptreact",
    ".go": "go",
    ".rs": "rust",
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
            import tree_sitter_python

            return Language(tree_sitter_python.language())
        if name == "javascript":
            import tree_sitter_javascript

            return Language(tree_sitter_javascript.language())
        if name in ("typescript", "tsx"):
            import tree_sitter_typescript

            return Language(
                tree_sitter_typescript.language_typescript()
                if name == "typescript"
                else tree_sitter_typescript.language_tsx()
            )
        if name == "go":
            import tree_sitter_go

            return Language(tree_sitter_go.language())
        if name == "rust":
            import tree_sitter_rust

            return Language(tree_sitter_rust.language())
    except ImportError:
        log.warning("tree-sitter grammar for %s is not installed; using indentation only", name)
    return None


def make_parser(language_id: str) -> Parser | None:
    """A fresh Parser for a languageId, or None when no grammar is available."""
    name = grammar_name(language_id)
    lang = grammar(name) if name else None
    return Parser(lang) if lang is not None else None


# ----------------------------------------------------------------------------- URIs

_UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")
_ESCAPE_OR_RAW = re.compile(r"%[0-9A-Fa-f]{2}|[^\x21-\x7e]")  # an escape, or a char a URI must escape
_DRIVE = re.compile(r"file:///([A-Za-z])(?::|%3A)(?=/|$)")


def uri_key(uri: str) -> str:
    """The identity of a document URI, one for all spellings of it: escapes of unreserved
    characters decoded (`%41` -> `A`), other escapes upper-cased (`%3a` -> `%3A`), characters a URI
    must escape (space, non-ASCII) escaped as UTF-8, the scheme lower-cased, and a file URI's drive
    letter lower-cased with its colon unescaped (VS Code sends file:///c%3A/..., Neovim file:///C:/...)."""

    def one(m: re.Match) -> str:
        s = m.group()
        if len(s) == 3 and s[0] == "%":
            c = chr(int(s[1:], 16))
            return c if c in _UNRESERVED else s.upper()
        return "".join(f"%{b:02X}" for b in s.encode("utf-8", "surrogatepass"))

    key = _ESCAPE_OR_RAW.sub(one, uri)
    scheme, sep, rest = key.partition(":")
    if sep and scheme.isascii() and scheme.isalpha():
        key = scheme.lower() + ":" + rest
    m = _DRIVE.match(key)
    if m:
        key = f"file:///{m.group(1).lower()}:{key[m.end() :]}"
    return key


# ----------------------------------------------------------------------------- documents

_LONE_CR = re.compile(r"\r(?!\n)")
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_source(text: str) -> bytes:
    """The bytes tree-sitter parses for `text`: its UTF-8, with each lone "\r" read as "\n"
    (tree-sitter counts rows at "\n" only, LSP also at "\r") and each lone surrogate as U+FFFD (3
    bytes, as `surrogatepass` counts it) - so the tree's byte offsets and rows are the text's."""
    if "\r" in text:
        text = _LONE_CR.sub("\n", text)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text).encode("utf-8")


def join_pairs(text: str) -> str:
    """`text` with each lone high surrogate that is followed by a lone low one joined with it into
    the character they encode: the same UTF-16 units (what the client has, and what JSON carries)
    in the one spelling a str has for them."""
    if not _SURROGATE.search(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _is_high(ch: str) -> bool:
    return "\ud800" <= ch <= "\udbff"


def _is_low(ch: str) -> bool:
    return "\udc00" <= ch <= "\udfff"


@dataclass(frozen=True)
class ContentChange:
    """One content change of a didChange as plain data: the new `text`, and the LSP (line, character)
    positions `start` and `end` of the range it replaces, both None when it replaces the whole text
    (the protocol layer turns the wire's changes into these: protocol.content_changes)."""

    text: str
    start: tuple[int, int] | None = None
    end: tuple[int, int] | None = None


def valid_change(ch: object) -> bool:
    """True for a content change of the right types: text a str, start and end both None or both
    (line, character) pairs of integers."""
    if not isinstance(getattr(ch, "text", None), str):
        return False
    start, end = getattr(ch, "start", None), getattr(ch, "end", None)
    if start is None and end is None:
        return True
    return all(isinstance(p, tuple) and len(p) == 2 and all(type(v) is int for v in p) for p in (start, end))


def _point(idx: LineIndex, offset: int) -> Point:
    """The tree-sitter point (row, byte column) of a str offset."""
    row, col = idx.row_col(offset)
    start = idx.starts[row]
    return Point(row, utf8_len(idx.text[start : start + col]))


class Document:
    """One open document. `text` is the truth; `tree` mirrors it when a grammar exists and the
    document is small enough (`no_tree` says why not, otherwise None)."""

    def __init__(self, uri: str, language_id: str, version: int, text: str, parser: Parser | None = None):
        self.uri, self.language_id, self.version = uri, language_id, version
        self.parser = parser if parser is not None else make_parser(language_id)
        self.no_tree: str | None = None
        self.parse_ms = 0.0  # CPU time of the last parse
        self._slow = 0  # re-parses in a row over SLOW_PARSE_MS
        self.text = text

    # ---------------------------------------------------------------- state

    @property
    def text(self) -> str:
        return self._text

    @text.setter
    def text(self, text: str) -> None:
        """Replaces the whole text (a full-text change): fresh index, fresh parse when next needed."""
        text = join_pairs(text)
        self._text = text
        self._index = LineIndex(text, UTF16)
        self._views: dict[str, LineIndex] = {}
        self._tree: Tree | None = None
        self._slow = 0
        self.no_tree = None
        if self.parser is not None:
            self._check_size(0, len(self._index.starts) - 1)
        self._dirty = self.parser is not None and self.no_tree is None

    @property
    def tree(self) -> Tree | None:
        """The tree of the current text (parsed now if changes are pending), or None."""
        if self._dirty:
            self._parse()
        return self._tree

    def index(self, encoding: str = UTF16) -> LineIndex:
        """Line index of the current text, converting columns in `encoding` (kept across calls,
        updated per change)."""
        if encoding == UTF16:
            return self._index
        view = self._views.get(encoding)
        if view is None:
            view = self._views[encoding] = self._index.with_encoding(encoding)
        return view

    def reparse(self, incremental: bool = True) -> None:
        """Parses now rather than at the tree's next use; `incremental=False` starts from scratch."""
        if not incremental and self.no_tree is None and self.parser is not None:
            self._tree, self._dirty = None, True
        if self._dirty:
            self._parse()

    def _parse(self) -> None:
        self._dirty = False
        old = self._tree
        # CPU time of this thread, not wall time: the limit is about the work a keystroke costs, and
        # a loaded machine (wall time x3-4 measured) must not take trees from mid-size files
        t0 = time.thread_time()
        src = parse_source(self._text)
        parser = self.parser
        assert parser is not None  # _dirty is only ever set on a document with a parser
        tree = parser.parse(src, old) if old is not None else parser.parse(src)
        self.parse_ms = (time.thread_time() - t0) * 1000
        self._slow = self._slow + 1 if old is not None and self.parse_ms > SLOW_PARSE_MS else 0
        if self._slow >= SLOW_PARSES:
            self._drop_tree(
                f"{SLOW_PARSES} re-parses in a row took over {SLOW_PARSE_MS:.0f} ms (the last {self.parse_ms:.0f} ms)"
            )
        elif tree.root_node.child_count > MAX_TOP_LEVEL_NODES:
            self._drop_tree(f"over {MAX_TOP_LEVEL_NODES:,} top-level syntax nodes")
        else:
            self._tree = tree

    def _check_size(self, first: int, last: int) -> None:
        """Drops the tree when the text is too long or one of lines first..last is."""
        if len(self._text) > MAX_PARSE_CHARS:
            self._drop_tree(f"over {MAX_PARSE_CHARS:,} characters")
        elif longest_line(self._index, first, last) > MAX_LINE_CHARS:
            self._drop_tree(f"a line over {MAX_LINE_CHARS:,} characters")

    def _drop_tree(self, reason: str) -> None:
        self._tree, self._dirty = None, False
        if self.no_tree is None:
            self.no_tree = reason
            log.warning("%s: %s; no syntax tree, completions use indentation only", self.uri, reason)

    # ---------------------------------------------------------------- changes

    def apply_change(
        self, start: tuple[int, int] | None, end: tuple[int, int] | None, new_text: str, encoding: str = UTF16
    ) -> None:
        """Applies one content change: a range of LSP (line, character) positions, or None for the
        full text. Positions clamp and snap (`positions`); a reversed range is swapped, as the
        reference client library (vscode-languageserver-textdocument) does."""
        if start is None or end is None:
            self.text = new_text
            return
        idx = self.index(encoding)
        a, b = idx.offset(*start), idx.offset(*end)
        if b < a:
            log.debug("%s: reversed range %s-%s, swapped", self.uri, start, end)
            a, b = b, a
        self._splice(a, b, new_text)

    def _splice(self, a: int, b: int, new_text: str) -> None:
        """text[a:b] = new_text, with the line index and the tree (if any) edited to match."""
        old, idx = self._text, self._index
        if (a > 0 and _is_high(old[a - 1])) or (b < len(old) and _is_low(old[b])) or _SURROGATE.search(new_text):
            # lone halves that now meet become the character they encode (join_pairs)
            a2 = a - 1 if a > 0 and _is_high(old[a - 1]) else a
            b2 = b + 1 if b < len(old) and _is_low(old[b]) else b
            a, b, new_text = a2, b2, join_pairs(old[a2:a] + new_text + old[b:b2])
        text = old[:a] + new_text + old[b:]
        new_idx = idx.edited(a, b, new_text, text)
        end = a + len(new_text)
        if self._tree is not None:
            # a lone "\r" before the edit reads as "\n" to tree-sitter until the edit puts a "\n"
            # after it, so the edit covers it
            ea = a - 1 if a > 0 and old[a - 1] == "\r" else a
            start_byte = ea if old.isascii() else utf8_len(old[:ea])
            self._tree.edit(
                start_byte,
                start_byte + utf8_len(old[ea:b]),
                start_byte + utf8_len(text[ea:end]),
                _point(idx, ea),
                _point(idx, b),
                _point(new_idx, end),
            )
            self._dirty = True
        self._text, self._index, self._views = text, new_idx, {}
        if self.no_tree is None and self.parser is not None:
            self._check_size(new_idx.row_col(a)[0], new_idx.row_col(end)[0])


def longest_line(idx: LineIndex, first: int, last: int) -> int:
    """The length of the longest line among lines first..last (line breaks included)."""
    starts = idx.starts
    inner = max(map(int.__sub__, starts[first + 1 : last + 1], starts[first:last]), default=0)
    end = starts[last + 1] if last + 1 < len(starts) else len(idx.text)
    return max(inner, end - starts[last])


class DocumentStore:
    """Open documents by URI (normalized by `uri_key`; a document keeps the URI it was opened with)."""

    def __init__(self) -> None:
        self._docs: dict[str, Document] = {}
        self._told_no_tree = False
        self._touched: dict[str, int] = {}  # key -> when it was last opened or changed (a counter)
        self._clock = 0

    def _touch(self, key: str) -> None:
        self._clock += 1
        self._touched[key] = self._clock

    def neighbours(self, uri: str, language_id: str, n: int = 4) -> list[Document]:
        """The other open documents in `language_id`, the most recently opened or changed first:
        the cross-file context of a fill at `uri` (context.build_request's `neighbours`)."""
        me = uri_key(uri) if isinstance(uri, str) else None
        keys = sorted(
            (k for k, d in self._docs.items() if k != me and d.language_id == language_id),
            key=lambda k: -self._touched.get(k, 0),
        )
        return [self._docs[k] for k in keys[:n]]

    @staticmethod
    def key(uri: str) -> str:
        return uri_key(uri)

    def open(self, uri: str, language_id: str, version: int, text: str) -> Document | None:
        """Opens (or re-opens) a document; None, and nothing opened, when text or version has the
        wrong type."""
        if not isinstance(uri, str) or not isinstance(text, str) or type(version) is not int:
            log.warning(
                "didOpen with a wrong type ignored: uri %.80r, version %.20r, text of type %s",
                uri,
                version,
                type(text).__name__,
            )
            return None
        if not isinstance(language_id, str):
            language_id = "plaintext"
        key = uri_key(uri)
        if key in self._docs:
            log.info("didOpen for a document already open, replacing it: %s", uri)
        doc = Document(uri, language_id, version, text)
        self._docs[key] = doc
        self._touch(key)
        return doc

    def get(self, uri: str) -> Document | None:
        return self._docs.get(uri_key(uri)) if isinstance(uri, str) else None

    def close(self, uri: str) -> None:
        if isinstance(uri, str):
            self._docs.pop(uri_key(uri), None)
            self._touched.pop(uri_key(uri), None)

    def change(self, uri: str, version: int, changes: object, encoding: str = UTF16) -> Document | None:
        """Applies content changes (ContentChange) in order. A notification with a change of the wrong
        types is ignored whole, version included."""
        doc = self.get(uri) if isinstance(uri, str) else None
        if doc is None:
            log.warning("didChange for a document that is not open: %.200r", uri)
            return None
        if (
            type(version) is not int
            or not isinstance(changes, (list, tuple))
            or not all(valid_change(ch) for ch in changes)
        ):
            log.warning("didChange with a wrong type ignored (%s, version %.20r): %.200r", uri, version, changes)
            return doc
        for ch in changes:
            if ch.start is None:
                doc.apply_change(None, None, ch.text)
            else:
                doc.apply_change(ch.start, ch.end, ch.text, encoding)
        if version is not None and version <= doc.version:
            log.debug("%s: version %s after %s", uri, version, doc.version)
        doc.version = version
        self._touch(uri_key(uri))
        return doc

    def no_tree_notice(self) -> str | None:
        """A message for the user the first time (per store) an open document has no tree for its size."""
        if self._told_no_tree:
            return None
        doc = next((d for d in self._docs.values() if d.no_tree), None)
        if doc is None:
            return None
        self._told_no_tree = True
        name = doc.uri.rsplit("/", 1)[-1]
        return (
            f"dlm-lsp: {name} is too big for syntax-aware completions ({doc.no_tree}); its "
            "completions use indentation only, and so will other files that big."
        )

    def __len__(self) -> int:
        return len(self._docs)

    def __contains__(self, uri: str) -> bool:
        return uri_key(uri) in self._docs
