"""Post-processing: every rule on its own, then the whole pipeline with the syntax check."""

import pytest

from dlm_lsp.fill.context import build_request
from dlm_lsp.fill.documents import Document
from dlm_lsp.fill.postprocess import (
    SyntaxCheck,
    balance_brackets,
    count_errors,
    cut_block,
    cut_degenerate,
    cut_repetition,
    cut_to_clean,
    finish,
    leading_closers,
    own_brackets_closed,
    repeats_line_above,
    repeats_suffix,
    similar,
    strip_specials,
    trim_tail_overlap,
    within_distance,
)


def setup(lang: str, src: str):
    offset = src.index("|")
    doc = Document("file:///t", lang, 1, src.replace("|", "", 1))
    req = build_request(doc, offset)
    check = SyntaxCheck(doc.text, doc.tree, doc.parser, offset) if doc.tree is not None else None
    return doc, req, check


def run(lang: str, src: str, raw: str, filters: bool = True):
    """Returns (finished, the cursor line after accepting the fill)."""
    doc, req, check = setup(lang, src)
    fin = finish(req, raw, check, filters=filters)
    text = doc.text[: req.offset] + fin.text + doc.text[req.offset + fin.replace_len :]
    row = doc.text[: req.offset].count("\n")
    return fin, text.split("\n")[row], text


# ----------------------------------------------------------------------------- small rules


def test_strip_specials():
    assert strip_specials("x = 1<|pad|><|pad|>") == "x = 1"
    assert strip_specials("abc<|endoftext|>def") == "abc"
    assert strip_specials("a<|mask|>b") == "ab"
    assert strip_specials("a\r\nb\rc\x1b[0m\x00\td") == "a\nbc[0m\td"


def test_edit_distance():
    assert within_distance("kitten", "sitting", 3) and not within_distance("kitten", "sitting", 2)
    assert within_distance("", "abc", 3) and not within_distance("", "abcd", 3)
    assert similar("return total + 1", "return total + 1")
    assert not similar("return total + 1", "return total - 2")
    long_a = "x" * 100 + "abcde"
    assert similar(long_a, "x" * 100 + "abcdf")  # 1 edit in 105 chars is within 5%
    assert not similar(long_a, "x" * 100 + "zzzzzzz")


def test_repeats_suffix_and_line_above():
    assert repeats_suffix("return y", "\n    return y\n")
    assert repeats_suffix("a = 1\n    b = 2", "\n\n    a = 1\n    b = 2\n    c = 3")
    assert not repeats_suffix("return x", "\n    return y\n")
    assert repeats_line_above("    total += price", "    total += price")
    assert not repeats_line_above("    )", "    )")  # too small to judge


def test_cut_repetition():
    assert cut_repetition("a = 1\n    a = 1\n    b = 2", "") == "a = 1"
    # re-typing the first line of code below the cursor
    assert cut_repetition("x = f()\n    return x", "\n    return x\n") == "x = f()"


def test_cut_degenerate():
    assert cut_degenerate("ARARARARARARARARARARAR") == ""
    assert cut_degenerate("x = 1 ,,,,,,,,,,,,,,") == "x = 1"
    assert cut_degenerate("values = [0, 0, 1]") == "values = [0, 0, 1]"
    assert cut_degenerate("x = 1" + " " * 20 + "# c") == "x = 1" + " " * 20 + "# c"


def test_cut_block_at_dedent_and_blank_line():
    _, req, _ = setup("python", "def f(x):\n    |\n")
    assert cut_block("y = x\n    return y\nprint(1)", req) == "y = x\n    return y"
    assert cut_block("y = x\n\n    return y", req) == "y = x\n\n    return y"  # blank lines inside are fine
    _, top, _ = setup("python", "import os\n|\n")
    assert cut_block("x = 1\ny = 2\n\nz = 3", top) == "x = 1\ny = 2"


def test_leading_closers():
    assert leading_closers(")", ["("]) == [1]
    assert leading_closers("))", ["(", "("]) == [1, 2]
    assert leading_closers("])", ["(", "["]) == [1, 2]
    assert leading_closers(")]", ["(", "["]) == []  # wrong order: not auto-closed brackets
    assert leading_closers(" )", ["("]) == []


def test_balance_brackets_replace_range_over_auto_closed():
    _, req, _ = setup("python", "x = foo(|)\n")
    assert balance_brackets("a, b)", req) == ("a, b)", 1)
    assert balance_brackets("a, b", req) == ("a, b", 0)
    assert balance_brackets("a]", req) == ("a", 0)  # mismatched closer is cut
    _, req2, _ = setup("python", "x = foo(bar(|))\n")
    assert balance_brackets("a), b)", req2) == ("a), b)", 2)


def test_balance_brackets_cuts_what_the_code_below_closes():
    # the call is closed two lines below: a fill that closes it again is cut
    _, req, _ = setup("python", "x = foo(\n    a,\n    |\n)\n")
    assert req.suffix_closes == 1
    assert balance_brackets("b)", req) == ("b", 0)
    # nothing closes the bracket after the cursor: the fill may close it
    _, req, _ = setup("python", "x = foo(|\n")
    assert balance_brackets("a, b)", req) == ("a, b)", 0)


def test_trim_tail_overlap():
    assert trim_tail_overlap(" > 0:", ":") == " > 0"
    assert trim_tail_overlap("x else y", " else y") == "x"
    assert trim_tail_overlap(":", ":") == ""  # nothing left: finish drops it
    assert trim_tail_overlap("a))", ")", keep=2) == "a)"  # "a)" re-typed an auto-closed bracket
    assert trim_tail_overlap("a)", ")", keep=2) == "a)"
    assert trim_tail_overlap("a + b", "") == "a + b"


def test_own_brackets_closed():
    _, req, _ = setup("python", "y = |\n")
    assert own_brackets_closed("f(a)", req)
    assert not own_brackets_closed("f(a", req)
    assert not own_brackets_closed("'abc", req)
    _, inside, _ = setup("python", "y = f(|)\n")
    assert own_brackets_closed("a)", inside)  # closing the outer bracket is fine


def test_cut_to_clean_prefers_lines_then_characters():
    clean = {"a = 1", "a = 1\nb = 2", "c", "c ="}
    assert cut_to_clean("a = 1\nb = 2\nc = (", lambda t: t in clean) == "a = 1\nb = 2"
    assert cut_to_clean("c = (((", lambda t: t in clean) == "c ="
    assert cut_to_clean("zzz", lambda t: False) == ""


def test_syntax_check_counts_only_new_errors():
    doc, req, check = setup("python", "def f(x):\n    y = x +|\n    return y\n")
    assert count_errors(doc.tree.root_node) >= 1  # the file is broken at the cursor already
    assert check(" 1", 0)
    assert not check(" ) ) )", 0)
    # same number of errors as before, but the new one starts inside the fill
    assert count_errors(doc.tree.root_node) == 1
    assert not check(" 1\n    z = (", 0)
    assert check(" 1\n    z = 3", 0)


def _big_module(n_funcs: int = 300) -> str:
    body = "".join(
        f'def f{i}(a, b):\n    """Doc {i}."""\n    c = a + b * {i}\n    return c\n\n\n' for i in range(n_funcs)
    )
    return "import os\n\n\nclass Big:\n" + "".join("    " + ln + "\n" if ln else "\n" for ln in body.split("\n")) + body


def test_syntax_check_parses_a_bounded_region_of_a_big_file():
    text = _big_module()
    assert len(text.encode()) > 40_000
    # the cursor inside a method of a class far larger than the region limit
    offset = text.index("c = a + b * 150") + len("c = a + b")
    mid = " * 150"
    doc = Document("file:///t.py", "python", 1, text[:offset] + text[offset + len(mid) :])
    check = SyntaxCheck(doc.text, doc.tree, doc.parser, offset)
    whole = SyntaxCheck(doc.text, doc.tree, doc.parser, offset, region_limit=0)
    a, b = check.region
    assert 0 < b - a <= 12_000 and doc.text[a:offset].lstrip().startswith("def f150")
    assert whole.region is None
    for fill, ok in [
        (mid, True),
        (" * (150", False),
        (" *", False),
        (mid + "\n        d = 1", True),
        (mid + ")", False),
        (' + """x', False),
        (' + """x"""', True),
        (" + '''", False),
    ]:
        assert check(fill) is ok and whole(fill) is ok, fill


def test_syntax_check_region_on_a_blank_line_after_a_body():
    text = _big_module()
    offset = text.index("    return c\n\n\ndef f200") + len("    return c\n")
    doc = Document("file:///t.py", "python", 1, text[:offset] + "    \n" + text[offset:])
    offset += 4
    check = SyntaxCheck(doc.text, doc.tree, doc.parser, offset)
    assert check.region is not None and "def f199" in doc.text[check.region[0] : offset]
    assert check("d = c") and check("return c + 1")
    assert not check("return (c")


# ----------------------------------------------------------------------------- the pipeline


@pytest.mark.parametrize(
    "src,raw,text,repl,line",
    [
        ("x = foo(|)\n", "a, b)", "a, b)", 1, "x = foo(a, b)"),
        ("x = foo(|)\n", "a, b).strip()", "a, b).strip()", 1, "x = foo(a, b).strip()"),
        ("def f(|):\n    pass\n", "a, b):", "a, b)", 1, "def f(a, b):"),
        ("def f(x):\n    if x|:\n        pass\n", " > 0:", " > 0", 0, "    if x > 0:"),
        ("def f(x):\n    y = x +|\n", " 1\n    return y", " 1", 0, "    y = x + 1"),
        ("x = [1, |]\n", "2, 3]]", "2, 3]", 1, "x = [1, 2, 3]"),
        ("x = foo(bar(|))\n", "a), b)", "a), b)", 2, "x = foo(bar(a), b)"),
        ("print(max(|))\n", "items, 2)", "items, 2)", 1, "print(max(items, 2))"),
        ("print(max(|))\n", "items, 2))", "items, 2))", 2, "print(max(items, 2))"),
        ("def f(x):\n    |\n", "\n    return x", "return x", 0, "    return x"),
    ],
)
def test_finish_single_fills(src, raw, text, repl, line):
    fin, got_line, _ = run("python", src, raw)
    assert (fin.text, fin.replace_len) == (text, repl)
    assert got_line == line


@pytest.mark.parametrize(
    "src,raw,why",
    [
        ("def f(x):\n    |\n    return y\n", "return y", "repeats the code after the cursor"),
        ("def f(x):\n    y = 1\n    |\n", "y = 1", "repeats the line above"),
        ("def f(x):\n    y = x +|\n", " (1", "adds syntax errors"),
        ("def f(x):\n    y = x +|\n", "<|pad|><|pad|>", "empty"),
        ("def f(x):\n    |\n", "ARARARARARARARARARARARAR", "empty"),
    ],
)
def test_finish_drops(src, raw, why):
    fin, _, _ = run("python", src, raw)
    assert fin.text == "" and fin.replace_len == 0
    assert fin.dropped == why


def test_finish_block_stops_at_dedent_and_stays_clean():
    fin, _, text = run("python", "def f(x):\n    |\n\ndef g():\n    pass\n", "y = x * 2\n    return y\nprint(y)\n")
    assert fin.text == "y = x * 2\n    return y"
    assert "print" not in text


def test_finish_block_syntax_cut_to_longest_clean_prefix():
    fin, _, text = run("python", "def f(x):\n    |\n", "y = x * 2\n    z = [y,\n    return z")
    assert fin.text == "y = x * 2"
    assert fin.dropped is None


@pytest.mark.parametrize(
    "lang,src,raw,expect",
    [
        ("go", "package main\n\nfunc main() {\n\tx := 1\n\t|\n}\n", "fmt.Println(x)\n}", "fmt.Println(x)"),
        ("rust", "fn main() {\n    let v = vec![1, |];\n}\n", "2, 3];", "2, 3]"),  # replaces the "]"
        ("javascript", "function f(a) {\n  return g(a, |);\n}\n", "b);", "b)"),
        ("typescript", "function f(a: number): number {\n  |\n}\n", "return a * 2;\n}\n", "return a * 2;"),
    ],
)
def test_finish_other_languages(lang, src, raw, expect):
    fin, line, text = run(lang, src, raw)
    assert fin.text == expect
    assert line.count("(") == line.count(")") and line.count("[") == line.count("]")
    doc = Document("file:///t", lang, 1, text)
    before = Document("file:///t", lang, 1, src.replace("|", ""))
    assert count_errors(doc.tree.root_node) <= count_errors(before.tree.root_node)


def test_finish_without_filters_keeps_text():
    fin, _, _ = run("python", "def f(x):\n    y = x +|\n", " (1\n2", filters=False)
    assert fin.text == " (1"  # only padding dropped and cut to one line
    fin, _, _ = run("python", "def f(x):\n    |\n", "ARARARARARARARAR", filters=False)
    assert fin.text == "ARARARARARARARAR"


# ----------------------------------------------------------------------------- oracle failure classes
# Each case is a true middle from the held-out split (dlm-lsp eval --oracle-only) that the pipeline
# used to shorten or drop, reduced to a few lines; the protections they touch are checked alongside.


@pytest.mark.parametrize(
    "src,raw",
    [
        # a line hole whose rest of line opens a call continued on the next lines
        ("class T:\n    def test(self):\n        self|\n            1, 2)\n", ".assertEqual("),
        ("class T:\n    def test(self):\n        d|\n            'w'))\n", 'efects.append(errors.Defect("E "'),
        # ... or a string the next lines close
        ('PATTERN|\n    x\n"""\n', ' = """'),
        # a lone quote that, after the two before the cursor, opens a docstring
        ('""|\nModule doc.\n"""\nimport os\n', '"'),
    ],
)
def test_finish_keeps_brackets_and_strings_the_code_below_closes(src, raw):
    fin, _, text = run("python", src, raw)
    assert (fin.text, fin.replace_len, fin.dropped) == (raw, 0, None)
    assert count_errors(Document("file:///t", "python", 1, text).tree.root_node) == 0


def test_finish_still_rejects_brackets_the_code_below_does_not_close():
    # the ")" below closes foo: a fill that opens another bracket would take it
    fin, _, _ = run("python", "x = foo(a,|\n    b)\n", " bar(")
    assert "(" not in fin.text
    _, req, _ = setup("python", "x = foo(a,|\n    b)\n")
    assert not own_brackets_closed(" bar(", req)
    _, req, _ = setup("python", "def f(x):\n    y = x +|\n    return y\n")
    assert not own_brackets_closed(" (1", req) and not own_brackets_closed(' """a', req)


def test_balance_brackets_fill_closes_the_brackets_the_code_below_leaves_open():
    # two brackets open, the code below closes one (the outer): the fill may close the inner one
    _, req, _ = setup("python", "x = foo(bar(|\n)\n")
    assert (req.suffix_closes, balance_brackets("a)", req)) == (1, ("a)", 0))
    assert balance_brackets("a))", req) == ("a)", 0)
    fin, _, text = run("python", "PAIRS = (\n    ('a', 1),\n    ('b|\n)\n", "', 2),")
    assert fin.text == "', 2),"
    assert count_errors(Document("file:///t", "python", 1, text).tree.root_node) == 0


@pytest.mark.parametrize(
    "src,raw,line",
    [
        # the tail ")" closes the fill's own call, not the one the rest of the line closes
        ("f(a, |)\n", "C()", "f(a, C())"),
        ("new = g((new,) + tuple|)\n", "(after)", "new = g((new,) + tuple(after))"),
        ("g(a, |)\n", "os.path.basename(name)", "g(a, os.path.basename(name))"),
    ],
)
def test_finish_keeps_a_tail_that_closes_the_fills_own_brackets(src, raw, line):
    fin, got, _ = run("python", src, raw)
    assert (fin.text, fin.replace_len, got) == (raw, 0, line)


def test_degenerate_runs_that_are_code():
    assert cut_degenerate("100000000000") == "100000000000"  # a number
    assert cut_degenerate("x = 100000000000 + ((((((((((y") == "x = 100000000000 +"
    assert cut_degenerate("1212121212121212") == ""  # a longer pattern is degenerate even in digits
    fin, _, _ = run("python", 'testcommon("%d", 100000000000, |)\n', '"100000000000"')
    assert fin.text == '"100000000000"'


def test_finish_block_after_a_multi_line_header():
    fin, _, _ = run("python", "def f(a,\n      b):\n    |\n", "x = a\n    return x")
    assert fin.text == "x = a\n    return x"
    fin, _, _ = run(
        "python",
        "class A:\n    def f(self, a,\n          b=1):\n        |\n\n    def g(self):\n        pass\n",
        "self.a = a\n        self.b = b\n    def h(self):",
    )
    assert fin.text == "self.a = a\n        self.b = b"  # still cut at the dedent


def test_cut_block_ignores_lines_inside_a_string():
    _, req, _ = setup("python", "def f():\n    |\n")
    body = 'x = """\nabc\n\n"""\n    return x'
    assert cut_block(body + "\nprint(x)", req) == body
    fin, _, _ = run("python", "def f():\n    |\n", body)
    assert fin.text == body


def test_cut_repetition_a_deeper_line_is_not_the_code_below():
    below = "\n\n        recursive()\n"
    assert cut_repetition("if d < 10:\n            recursive()", below) == "if d < 10:\n            recursive()"
    assert cut_repetition("x = 1\n        recursive()", below) == "x = 1"  # at its indentation: re-typed


def test_repeats_line_above_is_judged_on_the_fills_own_text():
    src = 'def t():\n    testcommon("%22x", -big, "-1234567890abcdef12345")\n    testcommon("%|\n'
    fin, _, _ = run("python", src, '23x", -big, " -1234567890abcdef12345")')  # 2 edits in 38
    assert fin.text == '23x", -big, " -1234567890abcdef12345")'
    fin, _, _ = run("python", src, '22x", -big, "-1234567890abcdef12345")')
    assert fin.dropped == "repeats the line above"
    # a middle fill is judged with the rest of its line
    fin, _, _ = run("python", "items = [\n    mod.SampleClass,\n    mod.|.__init__,\n]\n", "SampleClass")
    assert fin.text == "SampleClass"
    fin, _, _ = run("python", "items = [\n    mod.SampleClass,\n    mod.|,\n]\n", "SampleClass")
    assert fin.dropped == "repeats the line above"


def test_only_the_fills_last_line_may_continue_below():
    # a block fill cut inside a docstring it opened: the next docstring's quotes do not close it
    src = "class A:\n    def f(self):\n        |\n\n    def g(self):\n        '''Doc.'''\n        return 1\n"
    _, req, _ = setup("python", src)
    assert not own_brackets_closed("'''Use passive mode.\n        With", req)
    _, req, _ = setup("python", "def f():\n    |\n    more text\n    '''\n")
    assert own_brackets_closed("x = foo(\n        a, b)\n    y = '''", req)  # opened on the last line
    assert not own_brackets_closed("y = '''\n    x = foo(", req)


def test_finish_hides_fills_below_the_confidence_gate():
    doc, req, check = setup("python", "def f(x):\n    y = x +|\n")
    assert finish(req, " 1", check, confidence=0.4, min_confidence=0.3).text == " 1"
    low = finish(req, " 1", check, confidence=0.2, min_confidence=0.3)
    assert low.text == "" and "low confidence" in low.dropped
    assert finish(req, " 1", check, confidence=0.2).text == " 1"  # no gate by default
