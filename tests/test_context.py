"""Cursor context: hole kinds per language, windows, imports and headers, positions, documents."""

import pytest

from dlm_lsp.fill.context import build_request, count_closed, lex_state
from dlm_lsp.fill.documents import ContentChange, Document, DocumentStore, make_parser
from dlm_lsp.fill.positions import UTF8, UTF16, UTF32, LineIndex, column_to_index, index_to_column, units_len
from dlm_lsp.options import InitializationOptions, parse_options


def request(lang: str, src: str, **kw):
    """Builds the request for `src` with the cursor at the `|` marker."""
    offset = src.index("|")
    doc = Document("file:///t", lang, 1, src.replace("|", "", 1))
    return build_request(doc, offset, **kw)


# ----------------------------------------------------------------------------- hole kinds

CASES = [
    # (language, source with | at the cursor, expected hole kind, single line?)
    ("python", "def f(x):\n    y = x +|\n", "line", True),
    ("python", "def f(x):\n    |\n", "block", False),
    ("python", "def f(x):|\n", "block", False),
    ("python", "def f(x):\n    if x|:\n        pass\n", "middle", True),
    ("python", "def f(x):\n    return foo(x, |)\n", "args", True),
    ("python", "d = {'a': 1, |}\n", "args", True),
    ("python", "foo(\n    a,\n    |\n)\n", "args", False),
    ("python", "foo(\n    a,\n    b=|\n)\n", "args", True),  # an argument typed on the line: one line
    ("python", "s = 'abc|'\n", "middle", True),
    ("javascript", "function f(a) {\n  const b = a *|\n}\n", "line", True),
    ("javascript", "function f(a) {\n  |\n}\n", "block", False),
    ("javascript", "function f(a) {\n  return g(a, |);\n}\n", "args", True),
    ("javascript", "const o = {a: 1, |};\n", "args", True),
    ("javascript", "if (a|) {\n}\n", "args", True),
    ("typescript", "function f(a: number): number {\n  |\n}\n", "block", False),
    ("typescript", "function f(a: number): number {\n  return a|;\n}\n", "middle", True),
    ("go", "package main\n\nfunc main() {\n\tx := 1\n\t|\n}\n", "block", False),
    ("go", "package main\n\nfunc main() {\n\tfmt.Println(|)\n}\n", "args", True),
    ("go", "package main\n\nfunc main() {\n\ty := x +|\n}\n", "line", True),
    ("rust", "fn main() {\n    let v = vec![1, |];\n}\n", "args", True),
    ("rust", "fn main() {\n    let y = x +|\n}\n", "line", True),
    ("rust", "fn f<'a>(x: &'a str) {\n    |\n}\n", "block", False),
    ("plaintext", "proc x {\n  set a 1\n  |\n}\n", "block", False),
    ("plaintext", "set a [expr 1 +|\n", "args", True),
]


@pytest.mark.parametrize("lang,src,kind,single", CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_hole_kind(lang, src, kind, single):
    req = request(lang, src)
    assert req.hole_kind == kind
    assert req.stop.single_line is single


def test_mask_slots_per_kind_and_bound():
    assert request("python", "x = |\n").mask_slots == 16
    assert request("python", "if x|:\n    pass\n").mask_slots == 12
    assert request("python", "f(|)\n").mask_slots == 16
    assert request("python", "def f():\n    |\n").mask_slots == 64
    assert request("python", "def f():\n    |\n", max_fill_tokens=20).mask_slots == 20


def test_block_indent_rules():
    # empty line in a body: the block is the body's indentation
    assert request("python", "def f(x):\n    a = 1\n    |\n").stop.block_indent == 4
    # end of a line that opens a block: one indent unit deeper
    assert request("python", "def f(x):|\n").stop.block_indent == 4
    assert request("python", "class A:\n  def f(self):|\n").stop.block_indent == 4  # 2-space file
    # top level: ends at the first blank line
    top = request("python", "import os\n|\n")
    assert top.stop.block_indent == 0 and top.stop.stop_at_blank_line
    # tabs count 4
    assert request("go", "package main\n\nfunc main() {\n\t|\n}\n").stop.block_indent == 4


def test_prefix_and_suffix_are_exact_around_the_cursor_for_small_files():
    src = "import os\n\ndef f(x):\n    y = x +| 1\n    return y\n"
    req = request("python", src)
    text = src.replace("|", "")
    assert req.prefix == text[: src.index("|")]
    assert req.suffix == text[src.index("|") :]
    assert req.line_before == "    y = x +" and req.line_after == " 1"


# ----------------------------------------------------------------------------- windows


def _big_python() -> str:
    helpers = "".join(f"def helper_{i}(x):\n    return x + {i}\n\n\n" for i in range(80))
    body = "".join(f"        total += helper_{i}(x)\n" for i in range(120))
    return (
        "import os\nfrom collections import OrderedDict\n\n\n"
        + helpers
        + "class Ledger:\n    rate = 3\n\n    def settle(\n        self,\n        x,\n    ):\n"
        + "        total = 0\n"
        + body
        + "        |\n        return total\n\n\ndef tail():\n    pass\n"
    )


def test_window_keeps_imports_and_enclosing_headers_under_budget():
    req = request("python", _big_python(), context_tokens=512)
    budget = (512 - 64) * 3.5
    assert len(req.prefix) + len(req.suffix) <= budget * 1.05
    assert req.prefix.startswith("import os\nfrom collections import OrderedDict\n")
    assert "class Ledger:\n" in req.prefix
    assert "    def settle(\n        self,\n        x,\n    ):\n" in req.prefix  # whole multi-line header
    assert "helper_0(x):" not in req.prefix  # far definitions are out
    assert req.prefix.endswith("        total += helper_119(x)\n        ")


def test_window_starts_on_a_statement_boundary():
    req = request("python", _big_python())
    window = req.prefix.split("    ):\n", 1)[1]
    assert window.startswith("        total += helper_")  # a whole statement of the body
    assert req.suffix.startswith("\n        return total\n")


def test_window_never_starts_inside_a_sibling_body():
    helpers = "".join(f"def helper_{i}(x):\n    y = x * {i}\n    return y + 1\n\n" for i in range(80))
    req = request("python", "import os\n\n" + helpers + "def last(x):\n    |\n")
    after_imports = req.prefix.split("import os\n", 1)[1].lstrip("\n")
    assert after_imports.startswith("def helper_"), after_imports[:60]


@pytest.mark.parametrize(
    "lang,src,head,imp",
    [
        (
            "go",
            'package main\n\nimport "fmt"\n\nfunc main() {\n'
            + "".join(f"\tx += {i}\n" for i in range(300))
            + "\t|\n}\n",
            "func main() {\n",
            'package main\nimport "fmt"\n',
        ),
        (
            "rust",
            "use std::io;\n\nimpl Acc {\n    fn add(&mut self) -> i32 {\n"
            + "".join(f"        x += {i};\n" for i in range(300))
            + "        |\n    }\n}\n",
            "impl Acc {\n    fn add(&mut self) -> i32 {\n",
            "use std::io;\n",
        ),
        (
            "javascript",
            "import x from 'y';\n\nclass A {\n  run(a) {\n"
            + "".join(f"    a += {i};\n" for i in range(300))
            + "    |\n  }\n}\n",
            "class A {\n  run(a) {\n",
            "import x from 'y';\n",
        ),
        (
            "typescript",
            "import {x} from 'y';\n\nfunction g(a: number): number {\n"
            + "".join(f"  a += {i};\n" for i in range(300))
            + "  |\n}\n",
            "function g(a: number): number {\n",
            "import {x} from 'y';\n",
        ),
    ],
)
def test_headers_and_imports_per_language(lang, src, head, imp):
    req = request(lang, src)
    assert req.prefix.startswith(imp)
    assert head in req.prefix
    assert len(req.prefix) < 1600
    # the prefix's own brackets say we are inside the function's braces
    assert req.lex.stack and req.lex.stack[-1] == "{"
    assert req.suffix_closes >= 1


def test_indentation_fallback_headers_for_other_languages():
    body = "".join(f"    line {i}\n" for i in range(300))
    req = request("plaintext", "import thing\nsection alpha\n" + body + "    |\n")
    assert req.prefix.startswith("import thing\n")
    assert "section alpha\n" in req.prefix
    assert len(req.prefix) < 1600


# ----------------------------------------------------------------------------- lexing


def test_lexer_ignores_brackets_in_strings_and_comments():
    st = lex_state("f('(', \"[\", x  # )\n", "python")
    assert st.stack == ["("]
    st = lex_state("g(`${a}(`, /* ) */ b", "javascript")
    assert st.stack == ["("]
    st = lex_state("fn f<'a>(x: &'a str, c: char) { let q = '(';", "rust")
    assert st.stack == ["{"]
    st = lex_state('x = """ ( \n ) ( """ + (', "python")
    assert st.stack == ["("]


def test_count_closed():
    assert count_closed(")\n", "python", ["("]) == 1
    assert count_closed("])", "python", ["(", "["]) == 2
    assert count_closed("]", "python", ["("]) == 0  # mismatch stops counting
    assert count_closed("\n  x\n}\n", "go", ["{"]) == 1


# ----------------------------------------------------------------------------- positions


def test_utf16_columns():
    line = "s = '😀é' + x"
    # 😀 is one code point, two UTF-16 units, four UTF-8 bytes
    i = line.index("+")
    assert index_to_column(line, i, UTF16) == i + 1
    assert index_to_column(line, i, UTF8) == i + 4
    assert index_to_column(line, i, UTF32) == i
    for enc in (UTF8, UTF16, UTF32):
        assert column_to_index(line, index_to_column(line, i, enc), enc) == i
    assert column_to_index(line, 6, UTF16) == 5  # inside the surrogate pair: before the emoji
    assert column_to_index(line, 999, UTF16) == len(line)
    assert units_len("😀", UTF16) == 2 and units_len("😀", UTF8) == 4


def test_line_index_round_trip_and_clamping():
    text = "a😀b\r\nsecond\n"
    idx = LineIndex(text, UTF16)
    assert idx.offset(0, 3) == 2  # after the emoji
    assert idx.position(2) == (0, 3)
    assert idx.offset(0, 99) == 3  # clamps before "\r"
    assert idx.offset(1, 2) == text.index("second") + 2
    assert idx.offset(9, 0) == len(text)


def test_edited_line_index_equals_a_rescan():
    import random
    import re

    rng = random.Random(3)
    text = "one\ntwo\r\n\nfour 😀\n"
    idx = LineIndex(text, UTF16)
    pieces = ["", "x", "\n", "a\nb", "\n\n", "😀\n", "\r\n"]
    for _ in range(300):
        a = rng.randint(0, len(text))
        b = rng.randint(a, min(len(text), a + 6))
        new = rng.choice(pieces)
        text = text[:a] + new + text[b:]
        idx = idx.edited(a, b, new, text)
        fresh = LineIndex(text, UTF16)
        assert idx.starts == fresh.starts and idx.text is text
        lines, split = idx.lines(), re.split(r"\r\n|\r|\n", text)  # LSP's line breaks, not str.splitlines
        assert list(lines) == split and len(lines) == len(split)
        assert lines[1:3] == split[1:3] and lines[-1] == split[-1]


# ----------------------------------------------------------------------------- documents


def _change(line, ch, eline, ech, text):
    return ContentChange(text, (line, ch), (eline, ech))


def test_incremental_edits_match_a_fresh_parse():
    store = DocumentStore()
    src = "def f(x):\n    return x\n"
    store.open("u", "python", 1, src)
    edits = [
        (1, 12, 1, 12, " + 1"),
        (1, 4, 1, 4, "y = 2\n    "),
        (0, 6, 0, 7, "value"),
        (2, 11, 2, 12, "value"),
        (0, 0, 0, 0, "# é 😀\n"),
    ]
    expected = src
    for v, (l, c, el, ec, t) in enumerate(edits, start=2):
        doc = store.change("u", v, [_change(l, c, el, ec, t)])
        idx = LineIndex(expected, UTF16)
        a, b = idx.offset(l, c), idx.offset(el, ec)
        expected = expected[:a] + t + expected[b:]
        assert doc.text == expected and doc.version == v
        fresh = make_parser("python").parse(expected.encode())
        assert str(doc.tree.root_node) == str(fresh.root_node)
    assert doc.text == "# é 😀\ndef f(value):\n    y = 2\n    return value + 1\n"


def test_full_change_replaces_text():
    store = DocumentStore()
    store.open("u", "go", 1, "package a\n")
    doc = store.change("u", 2, [ContentChange("package b\n")])
    assert doc.text == "package b\n" and "package_clause" in str(doc.tree.root_node)


# ----------------------------------------------------------------------------- options


def test_options_defaults_and_bad_values():
    opts, warns = parse_options({"budgetMs": 150, "maxFillTokens": 32, "debounceMs": 20})
    assert (opts.budget_ms, opts.max_fill_tokens, opts.debounce_ms) == (150, 32, 20)
    assert warns == []
    opts, warns = parse_options({"budgetMs": -1, "device": "tpu", "languages": "python", "nope": 1})
    assert opts.budget_ms == 300 and opts.device == "auto" and "*" in opts.languages
    text = " ".join(warns)
    for key in ("budgetMs", "device", "languages", "nope"):
        assert key in text
    assert "using 300" in text
    base = InitializationOptions(budget_ms=500)
    opts, _ = parse_options({"device": "cpu"}, base)
    assert opts.budget_ms == 500 and opts.device == "cpu"
    assert parse_options({"model": "default"})[0].model is None
    assert not InitializationOptions(languages=["python"]).serves("go")
    assert InitializationOptions().serves("lua")  # "*": other languages by indentation
    assert parse_options({"minConfidence": 0.25})[0].min_confidence == 0.25
    opts, warns = parse_options({"minConfidence": 2})
    assert opts.min_confidence == InitializationOptions().min_confidence and "minConfidence" in warns[0]
    # nextEditMinConfidence: unset (the edit gate's per kind), a number for every kind, or null again
    assert InitializationOptions().next_edit_min_confidence is None
    opts, _ = parse_options({"nextEditMinConfidence": 0})
    assert (
        opts.next_edit_min_confidence == 0
        and parse_options({"nextEditMinConfidence": None}, opts)[0].next_edit_min_confidence is None
    )
    opts, warns = parse_options({"nextEditMinConfidence": 1.5})
    assert opts.next_edit_min_confidence is None and "nextEditMinConfidence" in warns[0]


@pytest.mark.parametrize(
    "lang,src,indent",
    [
        ("python", "class A:\n    def f(self, a,\n          b):\n        |\n", 8),
        ("python", "class A:\n    def f(self, a,\n          b):|\n", 8),
        ("python", "if (a and\n        b):\n    x = 1\n\nif (c or\n        d):\n|\n", 4),
        ("javascript", "function f(a,\n           b) {\n  |\n}\n", 2),
    ],
)
def test_block_indent_after_a_multi_line_header(lang, src, indent):
    req = request(lang, src)
    assert req.hole_kind == "block" and req.stop.block_indent == indent


def test_window_keeps_the_lines_above_when_no_statement_of_the_tree_starts_in_it():
    # mid-edit: a span deleted and being typed back, so the cursor's line dedents out of the class
    # (" sum(...)" at column 0 after a header): the tree's module-level statement at the cursor is
    # an ERROR node starting on the cursor's row, and the class began beyond the window. The window
    # then starts at a textual statement start, not at the cursor's row (it lost every line above:
    # the prefix was the imports alone)
    methods = "".join(f"    def m{i}(self, x):\n        y = x * {i}\n        return y + 1\n\n" for i in range(80))
    src = (
        "import os\n\n\nclass Log:\n"
        + methods
        + "    def summaries(self) -> list:\n| sum(x) / len(x)))\n        return out\n"
    )
    req = request("python", src)
    assert req.prefix.endswith("        return y + 1\n\n    def summaries(self) -> list:\n"), req.prefix[-200:]
    assert req.prefix.startswith("import os\nclass Log:\n") and len(req.prefix) > 1000, req.prefix[:80]
