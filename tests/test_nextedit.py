"""Next-edit helpers without a model (dlm_lsp/fill/nextedit.py): the window to rewrite, a rewrite as
minimal edits, the gate's whitespace and undo checks, and the recent edits' substitutions with the
propagation baseline.
"""

import random

from dlm_lsp.fill import suggest
from dlm_lsp.fill.history import Edit, EditHistory
from dlm_lsp.fill.nextedit import (
    apply_edits,
    carried,
    comments_of,
    in_spans,
    is_reversal,
    is_whitespace_only,
    line_edits,
    next_run,
    noncode_spans,
    propagate,
    substitutions,
    window_lines,
)

LINES = "".join(f"line{i}\n" for i in range(20))  # "line0\n" ... "line19\n", 6 or 7 characters each


def lines_of(text: str, window: tuple[int, int]) -> list[str]:
    return text[window[0] : window[1]].splitlines()


def edit(old: str, new: str, before: str = "", after: str = "", start: int = 0) -> Edit:
    return Edit(start, old, new, 1.0, before, after)


# ----------------------------------------------------------------------------- the window


def test_window_is_whole_lines_around_the_cursor():
    at = LINES.index("line10") + 3
    start, end = window_lines(LINES, at)
    assert lines_of(LINES, (start, end)) == [f"line{i}" for i in range(8, 19)]
    assert start == LINES.index("line8") and end == LINES.index("line19")  # the last line's break is in


def test_window_at_the_start_and_end_of_the_file_is_shorter():
    assert lines_of(LINES, window_lines(LINES, 0)) == [f"line{i}" for i in range(9)]
    start, end = window_lines(LINES, len(LINES) - 1)  # on "line19"
    assert lines_of(LINES, (start, end)) == ["line17", "line18", "line19"] and end == len(LINES)
    # at the very end: the empty line after the last break, which has no break of its own
    start, end = window_lines(LINES, len(LINES), above=1)
    assert (start, end) == (LINES.index("line19"), len(LINES))


def test_window_of_an_empty_file_and_clamped_offsets():
    assert window_lines("", 0) == (0, 0)
    assert window_lines("", 5) == (0, 0)
    assert window_lines(LINES, 10**6) == window_lines(LINES, len(LINES))
    assert window_lines(LINES, -5) == window_lines(LINES, 0)
    assert window_lines("no break", 3) == (0, 8)


def test_window_is_capped_at_max_lines_below_going_first():
    at = LINES.index("line10")
    assert lines_of(LINES, window_lines(LINES, at, above=2, below=8, max_lines=4)) == [
        "line8",
        "line9",
        "line10",
        "line11",
    ]
    assert lines_of(LINES, window_lines(LINES, at, above=9, below=9, max_lines=3)) == ["line8", "line9", "line10"]
    assert lines_of(LINES, window_lines(LINES, at, above=0, below=0)) == ["line10"]


def test_window_cuts_lines_at_crlf_and_lone_cr():
    text = "a\r\nb\rc\nd\r\ne\r\n"
    at = text.index("c")
    assert window_lines(text, at, above=1, below=1) == (text.index("b"), text.index("e"))
    assert window_lines(text, at, above=2, below=0) == (0, text.index("d"))
    # an offset inside a "\r\n" is on the line that break ends, as LSP positions count it
    inside = text.index("\r\nb") + 1
    assert window_lines(text, inside, above=0, below=0) == (0, text.index("b"))
    # form feed and U+2028 are not line breaks
    assert window_lines("a\x0cb\u2028c\nd", 0, above=0, below=0) == (0, 6)


# ----------------------------------------------------------------------------- line_edits


def test_line_edits_are_trimmed_to_the_changed_characters():
    old = "def f(foo):\n    return foo + 1\n"
    new = "def f(bar):\n    return bar + 1\n"
    assert line_edits(old, new) == [(6, 9, "bar"), (23, 26, "bar")]
    assert line_edits(old, old) == []


def test_line_edits_of_inserted_and_deleted_lines():
    old = "a = 1\nb = 2\n"
    assert line_edits(old, "a = 1\nx = 0\nb = 2\n") == [(6, 6, "x = 0\n")]
    assert line_edits(old, "b = 2\n") == [(0, 6, "")]
    assert line_edits("", "new\n") == [(0, 0, "new\n")]
    assert line_edits("x", "") == [(0, 1, "")]


def test_line_edits_of_neighbouring_changed_lines_are_one_edit_when_they_meet():
    # line by line: "a\n" -> "a\r" ends at its line's end, "cd\n" -> "xd\n" starts at its line's start
    assert line_edits("a\ncd\n", "a\rxd\n") == [(1, 3, "\rx")]


def test_line_edits_round_trip_on_random_pairs():
    rng = random.Random(20240611)
    pieces = ["a", "b", "foo", " ", "  ", "\n", "\r\n", "\r", "(", ")", "é", "\t"]
    for _ in range(3000):
        old = "".join(rng.choice(pieces) for _ in range(rng.randrange(15)))
        if rng.random() < 0.5:  # a mutation of old: the usual case, few lines change
            cut = [rng.randrange(len(old) + 1) for _ in range(2)]
            new = old[: min(cut)] + "".join(rng.choice(pieces) for _ in range(rng.randrange(4))) + old[max(cut) :]
        else:
            new = "".join(rng.choice(pieces) for _ in range(rng.randrange(15)))
        edits = line_edits(old, new)
        assert apply_edits(old, edits) == new, (old, new, edits)
        for a, b, text in edits:
            assert 0 <= a <= b <= len(old)
            assert old[a:b] != text
            # trimmed: no common first or last character left
            assert not (old[a:b] and text and old[a] == text[0]), (old, new, edits)
            assert not (old[a:b] and text and old[b - 1] == text[-1]), (old, new, edits)
        assert all(b < c for (_, b, _), (c, _, _) in zip(edits, edits[1:])), (old, new, edits)
        assert (edits == []) == (old == new)


# ----------------------------------------------------------------------------- the gate's checks


def test_whitespace_only():
    assert is_whitespace_only("f(a,b)\n", "f(a, b)\n")
    assert is_whitespace_only("    x = 1\n", "\tx = 1\n")
    assert is_whitespace_only("x = 1\n", "x = 1\n\n")
    assert not is_whitespace_only("x = 1\n", "x = 1\n")  # no difference at all
    assert not is_whitespace_only("return x", "returnx")  # joins two words
    assert not is_whitespace_only("x = 1", "x = 2")


RENAMED = "def f(bar):\n    return foo + 1\n"  # the user just renamed the parameter foo -> bar
LAST = Edit(RENAMED.index("bar"), "foo", "bar", 1.0, "def f(", "):")


def test_taking_the_last_edit_back_is_a_reversal():
    undo = RENAMED.replace("bar", "foo")
    assert is_reversal([LAST], RENAMED, undo, 0)
    # mostly back: one letter off the old name
    assert is_reversal([LAST], RENAMED, RENAMED.replace("bar", "fooo"), 0)
    # the window starts further down the document: offsets are the document's
    doc = "import os\n\n" + RENAMED
    moved = Edit(doc.index("bar"), "foo", "bar", 1.0)
    w0 = doc.index("def")
    assert is_reversal([moved], doc[w0:], doc[w0:].replace("bar", "foo"), w0)


def test_only_the_last_edit_counts():
    older = Edit(0, "x", "y", 0.5)
    assert is_reversal([older, LAST], RENAMED, RENAMED.replace("bar", "foo"), 0)
    assert not is_reversal([LAST, older], RENAMED, RENAMED.replace("bar", "foo"), 0)
    assert not is_reversal([], RENAMED, RENAMED.replace("bar", "foo"), 0)


def test_a_suggestion_elsewhere_is_not_a_reversal():
    follow = RENAMED.replace("return foo", "return bar")  # propagating the rename to the use
    assert not is_reversal([LAST], RENAMED, follow, 0)
    # bar -> foo, but at another place than the edit (a different line that happens to hold bar)
    doc = "def f(bar):\n    return bar + 1\n"
    assert not is_reversal([LAST], doc, doc.replace("return bar", "return foo"), 0)


def test_carrying_the_edit_further_is_not_a_reversal():
    doc = "x = ba\n"
    typed = Edit(4, "", "ba", 1.0)
    assert not is_reversal([typed], doc, "x = bar\n", 0)
    assert not is_reversal([LAST], RENAMED, RENAMED.replace("bar", "baz"), 0)
    # close to the old text, but closer still to the new: the edit carried on, not taken back
    doc = "n = value_counts\n"
    plural = Edit(4, "value_count", "value_counts", 1.0)
    assert not is_reversal([plural], doc, "n = value_countss\n", 0)


def test_putting_back_a_deleted_line_is_a_reversal():
    doc = "a = 1\nc = 3\n"
    deleted = Edit(6, "b = 2\n", "", 1.0)
    assert is_reversal([deleted], doc, "a = 1\nb = 2\nc = 3\n", 0)
    assert not is_reversal([deleted], doc, "a = 1\nc = 3\nd = 4\n", 0)


def test_an_edit_outside_the_window_is_never_reversed():
    doc = "x = 1\n" * 30
    far = Edit(150, "y", "x", 1.0)  # line 25
    window = doc[:30]
    assert not is_reversal([far], window, window.replace("x", "y", 1), 0)


# ----------------------------------------------------------------------------- substitutions


def test_substitutions_of_a_rename():
    e = edit("foo", "bar", "def f(", ", y): return foo")
    assert substitutions([e]) == [("foo", "bar")]


def test_substitutions_are_whole_words_from_the_line_context():
    # "Bar" typed after "foo": the substitution is the whole word, not '' -> 'Bar'
    assert substitutions([edit("", "Bar", "x = foo", " + 1")]) == [("foo", "fooBar")]
    # one letter changed inside a word
    assert substitutions([edit("o", "a", "x = f", "o + 1")]) == [("foo", "fao")]


def test_substitutions_of_a_type_hint():
    e = edit("D", "d", "def f(x: ", "ict[str, int]) -> None:")
    assert substitutions([e]) == [("Dict", "dict")]
    added = edit("", ": int", "def f(x", ", y):")
    assert substitutions([added]) == [("x", "x: int")]
    assert substitutions([edit("", "    ", "", "x = 1")]) == []  # indentation only: no substitution


def test_substitutions_from_the_history_of_typed_keystrokes():
    history = EditHistory()
    text = "def f(foo):\n    return foo\n"
    at = text.index("foo") + 3
    for i, ch in enumerate("Bar"):
        history.record("k", at + i, "", ch, 1.0 + i / 10, text=text)
        text = text[: at + i] + ch + text[at + i :]
    assert substitutions(history.recent("k")) == [("foo", "fooBar")]


def test_substitutions_without_repeats_oldest_first():
    a = edit("foo", "bar", "x(", ")")
    b = edit("Dict", "dict", "y: ", "")
    assert substitutions([a, b, a]) == [("foo", "bar"), ("Dict", "dict")]


def test_carried_substitutions_compose_and_cancel():
    # the b's may be a's the user renamed by hand: both go to the last name
    rules = carried([edit("a", "b", "f(", ")"), edit("b", "c", "f(", ")")])
    assert {k: c.new for k, c in rules.items()} == {"a": "c", "b": "c"}
    assert carried([edit("foo", "bar", "f(", ")"), edit("bar", "foo", "f(", ")")]) == {}
    assert carried([edit("", ": int", "f(x", ")")]) == {}  # an insertion says what was added, not a rename


def test_carried_substitutions_name_something():
    def olds(*edits):
        return {k: c.new for k, c in carried(list(edits), ("#",)).items()}

    assert olds(edit("typing.L", "l", "x: ", "ist[int] = []")) == {"typing.List": "list"}
    assert olds(edit('"en_us"', "DEFAULT_LOCALE", "def f(locale: str = ", "):")) == {'"en_us"': "DEFAULT_LOCALE"}
    call = edit("fb.get_invocation_str()", "invocation_str", "fb.body = 'x' % ", "")
    assert olds(call) == {"fb.get_invocation_str()": "invocation_str"}
    assert olds(edit("None", "bool", "def f() -> ", ":")) == {}  # a keyword: every None is not this one
    assert olds(edit("default", "fallback", "    ", " = 1")) == {"default": "fallback"}  # a name in Python
    assert olds(edit("if x >", "y =", "    ", " 1")) == {}
    assert olds(edit("0", "1", "lower = ", "")) == {}  # a number names nothing
    assert olds(edit("(a, b)", "(a,\n b)", "f", "")) == {}  # across lines: a rewrite, not a substitution
    assert olds(edit("self.cancel_for(", "task_id =", "    ", "task_id)")) == {}  # brackets left open
    assert olds(edit('"linear", "log"', "AxisType", "Enum(", ")")) == {}  # strings, not one literal named


def test_a_word_changed_in_strings_carries_once_the_user_repeated_it():
    one = edit("A", "An", '    """', " IP address field.")
    two = edit("A", "An", '    """', " IPv4 address field.")
    window = '    """A IPv6 address field."""\n    A = 1\n'
    noncode = noncode_spans(window, ("#",))
    assert propagate([one], window, noncode=noncode, comments=("#",)) is None
    got = propagate([one, two], window, noncode=noncode, comments=("#",))
    assert got == '    """An IPv6 address field."""\n    A = 1\n'  # in the docstring, not in code


# ----------------------------------------------------------------------------- propagate


def test_propagate_renames_whole_words_only():
    e = edit("foo", "bar", "def f(", ", y):")
    window = "    foo = foo + 1\n    foobar(foo.x, _foo, foo_)\n    return foo\n"
    assert propagate([e], window) == ("    bar = bar + 1\n    foobar(bar.x, _foo, foo_)\n    return bar\n")


def test_propagate_carries_a_use_to_uses_in_the_same_role():
    # `int` changed in a return annotation: the next return annotation follows, a call does not
    e = edit("int", "Any", "    def f(self) -> ", ":")
    window = "        return int(x)\n    def g(self) -> int:\n        n: Optional[int] = 1\n"
    assert propagate([e], window) == "        return int(x)\n    def g(self) -> Any:\n        n: Optional[int] = 1\n"
    # the token before or the one after matching is enough: `Dict[` after `: ` and after `-> `
    d = edit("D", "d", "def f(x: ", "ict[str, int]):")
    hints = "def g(y: Dict[str, Dict]) -> Dict[str, int]:\n    return Dictionary(y)\n"
    assert propagate([d], hints) == "def g(y: dict[str, Dict]) -> dict[str, int]:\n    return Dictionary(y)\n"


def test_propagate_carries_a_definition_to_every_use():
    window = "    total = _table[0] + len(_table)\n    return f(_table)\n"
    assigned = edit("_", "", "    ", "table = load()")  # the assignment's target renamed
    assert propagate([assigned], window) == window.replace("_table", "table")
    parameter = edit("proxies", "proxy", "        self, ", ": Proxy = None,")  # an annotated parameter
    assert propagate([parameter], "    if proxies is None:\n") == "    if proxy is None:\n"
    method = edit("enter", "_enter", "    def ", "(path, key):")
    assert propagate([method], "    remap(root, enter=enter)\n") == "    remap(root, enter=_enter)\n"
    # not an attribute of something else, not a call's keyword argument
    key = edit("key", "_key", "    def setdefault(self, ", ", default=None):")
    assert propagate([key], "        x = self.key or f(key=key)\n") == "        x = self.key or f(key=_key)\n"
    # a name given a type at once is not a plain rename: carried in its role only
    typed = edit("msg", "raw_msg: bytes", "    def f(self, ", "):")
    assert propagate([typed], "        for x in msg.splitlines():\n") is None
    # a sequence, not a name: carried in its role only
    call = edit("typing.List", "list", "    x: ", "[int] = []")
    assert propagate([call], "    y = typing.List(z)\n    w: typing.List[str]\n") == (
        "    y = typing.List(z)\n    w: list[str]\n"
    )


def test_propagate_gives_none_when_nothing_changes():
    e = edit("foo", "bar", "def f(", "):")
    assert propagate([e], "    return foobar\n") is None
    assert propagate([], "foo\n") is None
    assert propagate([edit("", ": int", "f(x", ")")], "x = 1\n") is None


def test_propagate_keeps_the_next_run_of_lines():
    e = edit("foo", "bar", "def f(", "):")
    window = "a = foo\nx = 1\nb = foo\nc = foo\ny = 2\nd = foo\n"
    # the cursor on line 1 (x = 1): the run at or after it is lines 2-3; line 0 and line 5 wait
    assert propagate([e], window, cursor=window.index("x")) == "a = foo\nx = 1\nb = bar\nc = bar\ny = 2\nd = foo\n"
    assert propagate([e], window, cursor=window.index("y")) == "a = foo\nx = 1\nb = foo\nc = foo\ny = 2\nd = bar\n"
    # past every run: the last one above the cursor
    up = "a = foo\nb = foo\nx = 1\nc = foo\ny = 2\n"
    assert propagate([e], up, cursor=up.index("y")) == "a = foo\nb = foo\nx = 1\nc = bar\ny = 2\n"
    assert propagate([e], window) == "a = bar\nx = 1\nb = foo\nc = foo\ny = 2\nd = foo\n"  # no cursor: the start


def test_next_run_leaves_windows_of_other_line_counts_whole():
    assert next_run("a\nb\n", "a\nc\nd\n", 0) == "a\nc\nd\n"
    assert next_run("a\nb\nc", "A\nb\nC", 2) == "a\nb\nC"
    assert next_run("a\nb", "a\nb", 0) == "a\nb"


def test_strings_and_comments_are_not_code():
    text = "x = \"a#b\" # c\ny = '''doc\nmore''' + s # t\nz = \"open\nw = 1"
    spans = noncode_spans(text, comments_of("python"))
    assert [text[a:b] for a, b in spans] == ['"a#b"', "# c", "'''doc\nmore'''", "# t", '"open']
    assert not in_spans(spans, text.index("s #")) and in_spans(spans, text.index("more"))
    c = 'a = "x\\"y" // c\nb = 1 /* d\n e */ + 2 # not a comment in C'
    assert [c[a:b] for a, b in noncode_spans(c, comments_of("typescript"))] == ['"x\\"y"', "// c", "/* d\n e */"]
    assert [c[a:b] for a, b in noncode_spans(c, comments_of("no-such-language"))] == ['"x\\"y"']  # strings only


def test_propagate_renames_code_not_strings_or_comments():
    e = edit("foo", "bar", "def f(", "):")
    window = 'print(foo, "foo")  # foo\n'
    assert propagate([e], window, noncode=noncode_spans(window, ("#",))) == 'print(bar, "foo")  # foo\n'
    assert propagate([e], window) == 'print(bar, "bar")  # bar\n'  # no spans given: every occurrence


def test_an_edit_inside_a_string_or_a_rewritten_line_is_no_rename():
    in_string = edit("general", "ten", '    "months": {"', '": "{0}"},')
    in_comment = edit("foo", "bar", "x = 1  # see ", "")
    rewrite = edit("ProxiesTypes = Union[URL, str, Dict]", "CertTypes = Tuple[str, str]", "", "")
    rename = edit("timer", "start", "def f(", ": float):")
    assert set(carried([in_string, in_comment, rewrite, rename], ("#",))) == {"timer"}
    assert propagate([in_string, in_comment, rewrite], 'x = form["general"] + foo\n', comments=("#",)) is None
    # the comment opener matters: in C-like code "#" opens no comment
    assert set(carried([in_comment], comments_of("go"))) == {"foo"}


def test_the_request_reads_strings_opened_above_the_window():
    doc = 'def f(x):\n    """Uses foo.\n' + "\n" * 12 + '    foo()\n    """\n    return foo\n'
    recent = [edit("foo", "bar", "def g(", "):")]
    cursor = doc.index("    foo()")
    req = suggest.edit_request(doc, cursor, recent, "propagate", language="python")
    assert req is not None and req.start > doc.index('"""')  # the string opens above the window
    # foo() is docstring text, so the next run of code holding foo is the return line
    assert suggest.baseline(req).window == req.window.replace("return foo", "return bar")
