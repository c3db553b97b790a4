"""The cursor's context: document + offset -> FillRequest (prefix, suffix, hole kind, mask slots,
stop rules).

Hole kinds
  line    code before the cursor, nothing after it: finish the line
  block   the cursor is on an empty line (or at the end of a line that opens a block): fill
          statements until the block ends
  middle  code after the cursor on the same line: the fill must join it
  args    inside an unclosed ( or [ (or a Python {): fill up to the closing bracket

The prefix and suffix are windows around the cursor cut at statement boundaries under a character
budget (tokens ~ chars / 3.5), and the prefix always starts with the file's imports and the
headers of the definitions that enclose the cursor, even when their text lies outside the window.
Python, JavaScript/TypeScript, Go and Rust use their tree-sitter grammars; other languages use
indentation only. Where a syntax error above the cursor leaves no statement of the tree starting
in the window, as mid-edit it often does (the lines above become one ERROR node), the cut falls
back to textual statement starts, the imports to their lines and the headers to indentation, so
the lines above the cursor are never lost.

Far text (`FillRequest.far`): the document beyond both windows (FAR_BEFORE, 16k characters, before
the prefix; FAR_AFTER, 8k, after the suffix) and, before it, the cross-file context the server
passes in (DlmServer.cross_file): up to 12k characters of snippets of the workspace's other files
most like the lines around the cursor (dlm_lsp/fill/retrieval.py), else the starts of the other
open documents of the language, most recently edited first (`neighbour_text`: 24k characters shared
out). `to_fill_job` sends it as FillJob.lookup for rest-of-line holes only (FAR_KINDS: on block
and middle holes it made fills longer and fewer of them accepted): text the engine's copy boost
searches and whose identifiers the name bias knows, never tokens it forwards.

`to_fill_job` also turns on DecodeOptions.stop_newline for single-line holes, so their fills end at
the line break instead of decoding lines the post-processor would cut: line and middle holes, and
argument holes whose bracket opened on the cursor's line or whose argument is being typed on it. An
argument list continued from a line that is blank so far gets a block of up to 64 slots instead.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tree_sitter import Node

from dlm_lsp.fill.documents import MAX_LINE_CHARS, Document, grammar_name
from dlm_lsp.fill.positions import utf8_len

if TYPE_CHECKING:
    from engine.api import DecodeOptions, FillJob

HOLE_KINDS = ("line", "block", "middle", "args")
# rest of line: 16 slots hold 88% of held-out stdlib rest-of-line holes (p50 7 tokens); a middle
# of a line: 12 hold 99% (p50 3). With pad_left decoding a weak model writes to the canvas's end,
# so spare slots cost steps.
MASK_SLOTS = {"line": 16, "middle": 12, "args": 16, "block": 64}
CHARS_PER_TOKEN = 3.5
LONG_LINE_WINDOW = 300  # characters either side of the cursor looked at on a line over MAX_LINE_CHARS
PREFIX_SHARE = 0.7  # of the character budget; the rest goes to the suffix
IMPORTS_SHARE = 0.25  # of the prefix budget, at most, for imports kept from outside the window
FAR_BEFORE = 16000  # characters of the document before the prefix window searched by the copy boost (FillRequest.far)
FAR_AFTER = 8000  # and after the suffix window
FAR_KINDS = ("line",)  # hole kinds whose jobs carry the far text (FillJob.lookup)
NEIGHBOUR_CHARS = 24000  # characters of other open documents searched by the copy boost (neighbour_text)

OPENERS, CLOSERS = "([{", ")]}"
MATCH = {")": "(", "]": "[", "}": "{"}
CLOSER_OF = {"(": ")", "[": "]", "{": "}"}

# Node types that hold a sequence of statements: a child starting a row is a statement boundary.
_CONTAINERS = {
    "module",
    "block",
    "program",
    "source_file",
    "statement_block",
    "class_body",
    "statement_list",
    "declaration_list",
    "interface_body",
    "enum_body",
    "field_declaration_list",
    "switch_body",
    "expression_statement_list",
    "decorated_definition",
}
_IMPORTS = {
    "python": {"import_statement", "import_from_statement", "future_import_statement"},
    "javascript": {"import_statement"},
    "typescript": {"import_statement", "import_alias"},
    "tsx": {"import_statement", "import_alias"},
    "go": {"package_clause", "import_declaration"},
    "rust": {"use_declaration", "extern_crate_declaration"},
}
_DEFINITION_WORDS = (
    "function",
    "class",
    "method",
    "impl",
    "trait",
    "interface",
    "struct",
    "enum",
    "mod_item",
    "arrow_function",
    "type_declaration",
    "func_literal",
    "closure",
)
_IMPORT_LINE = re.compile(r"^(import\b|from\s+\S+\s+import\b|use\s|package\s|#include\b|require\b|using\s)")
_CONTINUES = ",([{\\+-*/=&|."  # a line ending with one of these goes on onto the next line
_BLOCK_OPENER = re.compile(r"(:|\{|=>|\bdo|\bthen)\s*(#.*|//.*)?$")


@dataclass
class StopRules:
    """Where a fill must end, decided from the hole before the engine runs."""

    single_line: bool  # cut at the first newline
    block_indent: int | None = None  # block: the first non-blank line indented less ends the fill
    stop_at_blank_line: bool = False  # top-level blocks end at their first blank line


@dataclass
class LexState:
    """Lexical state at a point of code: open brackets and whether we are in a string/comment."""

    stack: list[str] = field(default_factory=list)  # unclosed openers, innermost last
    quote: str | None = None  # delimiter of the string we are in
    block_comment: bool = False
    line_comment: bool = False

    @property
    def in_code(self) -> bool:
        return self.quote is None and not self.block_comment and not self.line_comment

    def copy(self) -> LexState:
        return LexState(list(self.stack), self.quote, self.block_comment, self.line_comment)


@dataclass
class FillRequest:
    """Everything the engine and the post-processor need for one hole."""

    prefix: str
    suffix: str
    hole_kind: str
    indent: str  # whitespace at the start of the cursor line
    mask_slots: int
    stop: StopRules
    language_id: str
    offset: int  # cursor, as a str offset into the document
    line_before: str  # cursor line, before the cursor
    line_after: str  # cursor line, after the cursor (no line break)
    line_above: str  # nearest non-blank line above the cursor line
    lex: LexState  # lexical state at the cursor (open brackets, string)
    suffix_closes: int = 0  # how many of lex.stack the text after the cursor closes
    after_cursor: str = ""  # the document after the cursor (up to 4000 characters), beyond the suffix window
    line_lex: LexState | None = None  # lexical state at the start of the cursor line
    indent_unit: str = "    "
    context_ms: float = 0.0
    # the document beyond the prefix and suffix windows (nearest FAR_BEFORE / FAR_AFTER characters):
    # never forwarded through the model, only searched by the engine's copy boost (FillJob.lookup)
    far: str = ""


# ----------------------------------------------------------------------------- lexical scanning


def _comment_markers(language_id: str) -> tuple[tuple[str, ...], bool]:
    """(line comment markers, has /* */ block comments) for a language."""
    g = grammar_name(language_id)
    if g == "python":
        return ("#",), False
    if g is not None:
        return ("//",), True
    return ("#", "//"), True


def lex_events(text: str, language_id: str, state: LexState) -> Iterator[tuple[int, str, str]]:
    """Yields (index, char, event) for each bracket of `text` in code, updating `state` in place.
    event: "open", "close" (matched an opener) or "mismatch" (a closer that does not match, or
    with nothing open)."""
    line_markers, block = _comment_markers(language_id)
    python = grammar_name(language_id) == "python"
    rust = grammar_name(language_id) == "rust"
    quotes = "'\"" + ("" if python or rust else "`")
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if state.line_comment:
            if c == "\n":
                state.line_comment = False
            i += 1
            continue
        if state.block_comment:
            if text.startswith("*/", i):
                state.block_comment = False
                i += 2
            else:
                i += 1
            continue
        if state.quote is not None:
            q = state.quote
            if c == "\\" and q != "`":
                i += 2
                continue
            if text.startswith(q, i):
                state.quote = None
                i += len(q)
                continue
            if c == "\n" and len(q) == 1 and q != "`":
                state.quote = None  # an unterminated one-line string ends with its line
            i += 1
            continue
        if any(text.startswith(m, i) for m in line_markers):
            state.line_comment = True
            i += 1
            continue
        if block and text.startswith("/*", i):
            state.block_comment = True
            i += 2
            continue
        if c in quotes or (rust and c == '"'):
            if python and text.startswith(c * 3, i):
                state.quote = c * 3
                i += 3
                continue
            state.quote = c
            i += 1
            continue
        if rust and c == "'":
            # 'x' and '\n' are chars; 'a (no closing quote right after) is a lifetime
            if text.startswith("\\", i + 1) or (i + 2 < n and text[i + 2] == "'"):
                state.quote = "'"
            i += 1
            continue
        if c in OPENERS:
            state.stack.append(c)
            yield i, c, "open"
        elif c in CLOSERS:
            if state.stack and state.stack[-1] == MATCH[c]:
                state.stack.pop()
                yield i, c, "close"
            else:
                yield i, c, "mismatch"
        i += 1


def lex_state(text: str, language_id: str, state: LexState | None = None) -> LexState:
    """The lexical state at the end of `text` (mismatched closers are ignored)."""
    st = state.copy() if state is not None else LexState()
    for _ in lex_events(text, language_id, st):
        pass
    st.line_comment = False if text.endswith("\n") else st.line_comment
    return st


def count_closed(text: str, language_id: str, stack: list[str], limit: int = 4000) -> int:
    """How many brackets of `stack` (innermost last) `text` closes, innermost first."""
    st = LexState(list(stack))
    closed = 0
    depth_floor = len(stack)
    for _, _c, ev in lex_events(text[:limit], language_id, st):
        if ev == "close" and len(st.stack) < depth_floor:
            depth_floor = len(st.stack)
            closed += 1
        elif ev == "mismatch":
            break
        if depth_floor == 0:
            break
    return closed


# ----------------------------------------------------------------------------- indentation


def indent_width(line: str) -> int:
    """Width of a line's leading whitespace (a tab counts 4)."""
    ws = leading_ws(line)
    return len(ws) + 3 * ws.count("\t")


def leading_ws(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def detect_indent_unit(lines: list[str]) -> str:
    """The file's indentation step: a tab, or the smallest positive difference in spaces (4 if none)."""
    tabs = sum(1 for ln in lines if ln.startswith("\t"))
    spaces = [len(leading_ws(ln)) for ln in lines if ln.startswith(" ") and ln.strip()]
    if tabs > len(spaces):
        return "\t"
    diffs = sorted({s for s in spaces if s > 0})
    unit = min((b - a for a, b in zip([0, *diffs], diffs) if b > a), default=4)
    return " " * max(2, min(unit, 8))


def opens_block(line: str, language_id: str) -> bool:
    """True when a line ends by opening an indented block (":" in Python, "{" elsewhere)."""
    s = line.rstrip()
    if not s:
        return False
    if grammar_name(language_id) == "python":
        return bool(re.search(r":\s*(#.*)?$", s)) and not s.lstrip().startswith("#")
    return bool(_BLOCK_OPENER.search(s))


# ----------------------------------------------------------------------------- tree helpers


def _tree_root(doc: Document) -> Node | None:
    return doc.tree.root_node if doc.tree is not None else None


def _statement_rows(root: Node, lo_row: int, hi_row: int, probe: int | None = None) -> set[int]:
    """Rows in [lo_row, hi_row] where a statement begins. With `probe` (a byte offset), only the
    statements of containers enclosing the probe count, so a window never starts inside a sibling
    function's body."""
    rows: set[int] = set()
    if probe is not None:
        containers = []
        node = root.descendant_for_byte_range(probe, probe)
        while node is not None:
            if node.type in _CONTAINERS or node.parent is None:
                containers.append(node)
            node = node.parent
    else:
        containers = [root]
    stack = list(containers)
    while stack:
        node = stack.pop()
        if node.end_point.row < lo_row or node.start_point.row > hi_row:
            continue
        if node.type in _CONTAINERS or node.parent is None:
            for child in node.named_children:
                r = child.start_point.row
                if lo_row <= r <= hi_row and child.type != "comment":
                    rows.add(r)
        if probe is None:
            stack.extend(node.named_children)
    return rows


def _fallback_statement_rows(lines: Sequence[str], lo_row: int, hi_row: int) -> set[int]:
    """Statement starts without a grammar: a non-blank line whose previous non-blank line does not
    continue onto it (no trailing comma, operator, open bracket or backslash)."""
    rows: set[int] = set()
    prev = ""
    for r in range(max(0, lo_row - 1), hi_row + 1):
        s = lines[r].rstrip()
        if s and r >= lo_row and not (prev and prev[-1] in _CONTINUES):
            rows.add(r)
        if s:
            prev = s
    return rows


def _enclosing_definitions(root: Node, byte: int) -> list[Node]:
    """Definitions (nodes with a body) whose body contains `byte`, outermost first."""
    node = root.descendant_for_byte_range(byte, byte)
    found = []
    while node is not None:
        body = node.child_by_field_name("body")
        if body is not None and any(w in node.type for w in _DEFINITION_WORDS) and body.start_byte <= byte:
            found.append(node)
        node = node.parent
    return found[::-1]


def _header_rows(node: Node) -> tuple[int, int]:
    """Rows (first, last) of a definition's header: up to the line its body starts on when the body
    starts with a bracket, else the line before the body."""
    body = node.child_by_field_name("body")
    assert body is not None  # a definition of _enclosing_definitions: it has a body
    first = node.start_point.row
    last = body.start_point.row
    if body.type not in ("block",) or body.start_point.row == first or _starts_with_bracket(body):
        return first, max(first, last)
    return first, max(first, last - 1)


def _starts_with_bracket(node: Node) -> bool:
    child = node.child(0) if node.child_count else None
    return child is not None and child.type == "{"


def _fallback_headers(lines: Sequence[str], row: int, indent: int, max_rows: int = 2000) -> list[tuple[int, int]]:
    """Enclosing headers by indentation: each nearer line above with less indentation (looking at
    most `max_rows` lines up: a big file must not cost a scan to its top per keystroke)."""
    headers = []
    cur = indent
    for r in range(row - 1, max(-1, row - 1 - max_rows), -1):
        if cur == 0:
            break  # nothing is indented less than column 0
        s = lines[r]
        if not s.strip():
            continue
        w = indent_width(s)
        if w < cur:
            headers.append((r, r))
            cur = w
            if w == 0:
                break
    return headers[::-1]


# ----------------------------------------------------------------------------- the request


_BRACE_LITERALS = {
    "object",
    "object_pattern",
    "dictionary",
    "set",
    "dictionary_comprehension",
    "set_comprehension",
    "literal_value",
    "struct_expression",
    "field_initializer_list",
    "object_type",
    "named_imports",
    "import_spec_list",
}


def _brace_is_literal(root: Node | None, byte: int) -> bool:
    """True when the innermost `{` around `byte` opens a literal (object, dict, struct), not a block."""
    if root is None:
        return False
    node = root.descendant_for_byte_range(byte, byte)
    while node is not None:
        first = node.child(0) if node.child_count else None
        if first is not None and first.type == "{" and node.start_byte < byte:
            return node.type in _BRACE_LITERALS
        node = node.parent
    return False


def _classify(before: str, after: str, lex: LexState, language_id: str, brace_literal: bool = False) -> str:
    """Returns the hole kind for a cursor between `before` and `after` on one line."""
    python = grammar_name(language_id) == "python"
    if not lex.in_code:
        return "middle" if after.strip() else "line"
    if lex.stack and (lex.stack[-1] in "([" or (lex.stack[-1] == "{" and (python or brace_literal))):
        return "args"
    if after.strip():
        return "middle"
    if not before.strip() or opens_block(before, language_id):
        return "block"
    return "line"


def neighbour_text(texts: Iterable[str], limit: int = NEIGHBOUR_CHARS) -> str:
    """Cross-file context for the copy boost's far side: the other open documents' texts (most
    relevant first), each cut to an equal share of `limit` characters (its start: imports and the
    first definitions), the most relevant last (FillJob.lookup keeps its end when it must cut)."""
    texts = [t for t in texts if t]
    if not texts:
        return ""
    share = limit // len(texts)
    return "\n".join(t[:share] for t in reversed(texts)) + "\n"


def build_request(
    doc: Document, offset: int, max_fill_tokens: int = 64, context_tokens: int = 512, neighbours: str = ""
) -> FillRequest:
    """Returns the FillRequest for the cursor at str `offset` of `doc`. `neighbours`: cross-file text
    for the copy boost (neighbour_text), put before the document's own far text."""
    t0 = time.perf_counter()
    text = doc.text
    offset = max(0, min(offset, len(text)))
    idx = doc.index()
    lines = idx.lines()  # cut on demand: splitting a big file costs more than the rest of this
    row, col = idx.row_col(offset)
    line = lines[row]
    before, after = line[:col], line[col:]
    long_line = len(line) > MAX_LINE_CHARS
    if long_line:  # minified code: only the cursor's neighbourhood, or the lexing below costs seconds
        before, after = before[-LONG_LINE_WINDOW:], after[:LONG_LINE_WINDOW]
    unit = detect_indent_unit(lines[max(0, row - 200) : row + 50])
    lang = doc.language_id

    above = next((lines[r] for r in range(row - 1, max(-1, row - 2001), -1) if lines[r].strip()), "")

    # character budgets (the engine cuts tokens to context_tokens too; this keeps the cut syntactic)
    kind_guess_slots = max(MASK_SLOTS.values())
    total_chars = max(400, int((context_tokens - min(kind_guess_slots, max_fill_tokens)) * CHARS_PER_TOKEN))
    prefix_budget = int(total_chars * PREFIX_SHARE)
    suffix_budget = total_chars - prefix_budget

    root = _tree_root(doc)
    cursor_byte = utf8_len(text[:offset]) if root is not None else 0
    blank = not line.strip()
    probe = cursor_byte
    if root is not None and blank:
        # a blank line after a body's last statement lies outside the definition's node: probe at
        # the last code before the cursor (and, in Python, keep definitions indented less)
        probe = max(0, utf8_len(text[:offset].rstrip()) - 1)

    # ---- what must be kept whatever the window: imports and the enclosing definitions' headers
    import_rows: list[tuple[int, int]] = []
    if root is not None:
        kinds = _IMPORTS.get(grammar_name(lang) or "", set())
        import_rows = [
            (c.start_point.row, c.end_point.row)
            for c in root.named_children
            if c.type in kinds and c.end_point.row < row
        ]
    if not import_rows:  # no grammar, or a syntax error that swallowed the imports into an ERROR node
        import_rows = [(r, r) for r in range(0, min(row, 400)) if _IMPORT_LINE.match(lines[r])]
    cur_indent = indent_width(line) if line.strip() else indent_width(before)
    header_rows = []
    if root is not None:
        defs = _enclosing_definitions(root, probe)
        if blank and grammar_name(lang) == "python":
            defs = [d for d in defs if d.start_point.column < cur_indent]
        header_rows = [_header_rows(d) for d in defs]
    if root is None or (not header_rows and root.has_error):  # by indentation where the tree has none
        header_rows = _fallback_headers(lines, row, cur_indent)
    last_import_row = max((b for _, b in import_rows), default=-1)
    header_rows = [(a, b) for a, b in header_rows if a > last_import_row and a < row]
    import_cap = int(prefix_budget * IMPORTS_SHARE)
    head_estimate = min(
        import_cap, sum(idx.starts[min(b + 1, len(idx.starts) - 1)] - idx.starts[a] for a, b in import_rows)
    )
    head_estimate += sum(idx.starts[min(b + 1, len(idx.starts) - 1)] - idx.starts[a] for a, b in header_rows)
    window_budget = max(prefix_budget // 3, prefix_budget - head_estimate)

    # ---- prefix window: the earliest statement start that fits
    lo_row = row
    while lo_row > 0 and offset - idx.starts[lo_row - 1] <= window_budget:
        lo_row -= 1
    if root is not None:
        rows = _statement_rows(root, lo_row, row, probe=probe) or _statement_rows(root, lo_row, row)
    else:
        rows = _fallback_statement_rows(lines, lo_row, row)
    start_row = min(rows, default=lo_row)
    if start_row == row and lo_row < row:
        # no statement of the tree starts before the cursor's row within the budget (a syntax error
        # upstream makes one ERROR node of the lines above): cut at textual statement starts instead
        # of losing every line above the cursor
        start_row = min(_fallback_statement_rows(lines, lo_row, row - 1), default=lo_row)
    if offset - idx.starts[start_row] > window_budget:
        start_row = row
    window = text[idx.starts[start_row] : offset]
    if len(window) > window_budget:  # one huge line: keep its end
        window = window[-window_budget:]

    head_parts: list[str] = []
    import_text = "\n".join("\n".join(lines[a : b + 1]) for a, b in import_rows if b < start_row)
    if len(import_text) > import_cap:
        import_text = import_text[-import_cap:].split("\n", 1)[-1]
    if import_text:
        head_parts.append(import_text + "\n")
    for a, b in header_rows:
        if a < start_row:
            head_parts.append("\n".join(lines[a : min(b, start_row - 1) + 1]) + "\n")
    head = "".join(head_parts)
    if head and window and start_row > 0 and lines[start_row - 1].strip() == "":
        head += "\n"  # keep the blank line the window started after
    prefix = head + window

    # ---- suffix window: rest of the line, then whole statements while they fit
    line_end = idx.starts[row + 1] if row + 1 < len(idx.starts) else len(text)
    hi_row = row
    while hi_row + 1 < len(lines) and idx.starts[hi_row + 1] - offset <= suffix_budget:
        hi_row += 1
    if hi_row + 1 >= len(lines) and len(text) - offset > suffix_budget:
        hi_row -= 1  # the last line starts within the budget but runs past it (a minified file)
    if hi_row + 1 >= len(lines):
        end = len(text)
    elif hi_row > row:
        srows = (
            _statement_rows(root, row + 1, hi_row + 1, probe=probe)
            if root is not None
            else _fallback_statement_rows(lines, row + 1, hi_row + 1)
        )
        cut_row = max(srows, default=hi_row + 1)
        end = idx.starts[cut_row]
    else:
        end = min(line_end, offset + suffix_budget)
    suffix = text[offset : max(end, min(line_end, offset + suffix_budget))]

    # ---- the hole
    # the headers in the prefix open the enclosing braces, so the prefix gives the real nesting
    line_lex = lex_state(prefix[: len(prefix) - len(before)], lang) if prefix.endswith(before) else None
    lex = lex_state(before, lang, line_lex) if line_lex is not None else lex_state(prefix, lang)
    brace_literal = bool(lex.stack) and lex.stack[-1] == "{" and _brace_is_literal(root, cursor_byte)
    kind = _classify(before, after, lex, lang, brace_literal)
    # arguments: one line when their bracket opened on this line, or when an argument is being typed
    # on it (a multi-line argument list continued from a line that is blank so far gets a block);
    # multi-line fills after typed text ran to all 64 slots, mostly repeating themselves (session 8)
    single = kind in ("line", "middle") or (kind == "args" and (_opener_on_line(before, lang) or bool(before.strip())))
    block_indent = None
    if kind == "block":
        # a header can span lines (`def f(a,\n      b):`): its block is indented from its first line
        if before.strip():  # end of a line that opens a block: the body goes on the next lines
            block_indent = (
                indent_width(line) if long_line else header_indent(lines, row, lang, end=col)
            ) + indent_width(unit)
        elif not before and opens_block(above, lang):
            block_indent = header_indent(lines, _row_above(lines, row), lang) + indent_width(unit)
        elif opens_block(above, lang):
            block_indent = max(indent_width(before), header_indent(lines, _row_above(lines, row), lang) + 1)
        else:
            block_indent = indent_width(before)
    slots = min(MASK_SLOTS[kind], max_fill_tokens)
    if kind == "args" and not single:
        slots = min(MASK_SLOTS["block"], max_fill_tokens)
    stop = StopRules(
        single_line=single, block_indent=block_indent, stop_at_blank_line=kind == "block" and block_indent == 0
    )
    after_cursor = text[offset : offset + 4000]
    win_start, suf_end = offset - len(window), offset + len(suffix)
    far = neighbours + text[max(0, win_start - FAR_BEFORE) : win_start]
    if suf_end < len(text):
        far += "\n" + text[suf_end : suf_end + FAR_AFTER]
    closes = count_closed(after_cursor, lang, lex.stack) if lex.stack else 0
    return FillRequest(
        prefix=prefix,
        suffix=suffix,
        hole_kind=kind,
        indent=leading_ws(line),
        mask_slots=slots,
        stop=stop,
        language_id=lang,
        offset=offset,
        line_before=before,
        line_after=after,
        line_above=above,
        lex=lex,
        suffix_closes=closes,
        after_cursor=after_cursor,
        line_lex=line_lex,
        indent_unit=unit,
        context_ms=(time.perf_counter() - t0) * 1000,
        far=far,
    )


def _row_above(lines: Sequence[str], row: int) -> int:
    """The nearest non-blank row above `row` (row itself when there is none)."""
    return next((r for r in range(row - 1, max(-1, row - 2001), -1) if lines[r].strip()), row)


def header_indent(lines: Sequence[str], row: int, language_id: str, end: int | None = None, max_rows: int = 40) -> int:
    """Indentation of the statement whose last line is `row` (cut at column `end`): a header that
    spans several lines (`def f(a,\n      b):`) starts on the nearest line above from which its
    brackets balance (but for the `{` that opens the block)."""
    last = lines[row] if end is None else lines[row][:end]
    for r in range(row, max(-1, row - max_rows), -1):
        chunk = "\n".join([*lines[r:row], last])
        if len(chunk) > MAX_LINE_CHARS:  # lexing is a Python loop: minified code ends the search
            break
        st = LexState()
        if not any(ev == "mismatch" for _i, _c, ev in lex_events(chunk, language_id, st)) and all(
            b == "{" for b in st.stack
        ):  # only the block's own brace may stay open
            return indent_width(lines[r])
    return indent_width(last)


def _opener_on_line(before: str, language_id: str) -> bool:
    """True when the innermost open bracket at the cursor was opened on the cursor line."""
    # any bracket still open from this line alone means the innermost opener is on this line
    return bool(lex_state(before, language_id).stack)


def to_fill_job(
    req: FillRequest, deadline: float | None, context_tokens: int = 512, options: DecodeOptions | None = None
) -> FillJob:
    """The engine job for a request (imported lazily: context itself never needs the engine)."""
    import dataclasses

    from engine.api import DecodeOptions, FillJob

    options = options or DecodeOptions()
    if options.stop_newline is None:  # a single-line hole's fill ends at its line break
        options = dataclasses.replace(options, stop_newline=req.stop.single_line)
    # the far side of the copy boost for rest-of-line holes only: on block and middle holes it made
    # fills longer and fewer of them accepted (docs/research/15-s07-far-side-cross-file-line-stop.md)
    lookup = req.far if req.hole_kind in FAR_KINDS else ""
    return FillJob(
        prefix=req.prefix,
        suffix=req.suffix,
        max_tokens=req.mask_slots,
        deadline=deadline,
        options=options,
        context_tokens=context_tokens,
        lookup=lookup,
        kind=req.hole_kind,
    )
