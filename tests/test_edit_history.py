"""A document's edit history (dlm_lsp/fill/history.py): keystrokes coalescing into edits, the edits
as a replayable patch series, the bounds, and each edit's line context.

`Buffer` plays the server: it records each change against the text just before it, as didChange
would, then applies it. Time is passed explicitly; nothing sleeps.
"""

import random

from dlm_lsp.fill.history import CONTEXT_CHARS, MAX_CHARS, MAX_EDITS, Edit, EditHistory, line_context

KEY = "file:///a.py"


class Buffer:
    """A document and its history, changed the way the server changes one."""

    def __init__(self, text: str = "", history: EditHistory | None = None, key: str = KEY):
        self.text, self.key = text, key
        self.history = history if history is not None else EditHistory()
        self.now = 100.0

    def change(self, start: int, end: int, new: str, dt: float = 0.1) -> Edit | None:
        self.now += dt
        edit = self.history.record(self.key, start, self.text[start:end], new, self.now, text=self.text)
        self.text = self.text[:start] + new + self.text[end:]
        return edit

    def type(self, at: int, chars: str, dt: float = 0.1) -> None:
        for i, ch in enumerate(chars):
            self.change(at + i, at + i, ch, dt)

    def backspace(self, at: int, times: int = 1) -> None:
        for i in range(times):
            self.change(at - i - 1, at - i, "")

    def edits(self) -> list[Edit]:
        return self.history.recent(self.key, 10**6)


def undo_all(text: str, edits: list[Edit]) -> str:
    """The document before the first of `edits`, from the text after the last: each edit undone in
    turn, its new text checked where its start says it stands."""
    for e in reversed(edits):
        assert text[e.start : e.new_end] == e.new_text, (e, text)
        text = text[: e.start] + e.old_text + text[e.new_end :]
    return text


# ----------------------------------------------------------------------------- coalescing


def test_typing_a_word_is_one_edit():
    buf = Buffer("x = \n")
    buf.type(4, "abc")
    assert [(e.start, e.old_text, e.new_text) for e in buf.edits()] == [(4, "", "abc")]
    assert buf.edits()[0].new_end == 7 and buf.edits()[0].old_end == 4


def test_backspace_into_typed_text_shrinks_the_edit():
    buf = Buffer("x = \n")
    buf.type(4, "abc")
    buf.backspace(7)
    assert [(e.start, e.old_text, e.new_text) for e in buf.edits()] == [(4, "", "ab")]


def test_backspace_past_the_typed_text_takes_old_text_in():
    buf = Buffer("x = yz\n")
    buf.type(6, "ab")  # x = yzab
    buf.backspace(8, 3)  # x = y
    assert [(e.start, e.old_text, e.new_text) for e in buf.edits()] == [(5, "z", "")]
    assert undo_all(buf.text, buf.edits()) == "x = yz\n"


def test_typing_then_deleting_it_all_leaves_no_edit():
    buf = Buffer("one\n\n\n\n\ntwo\n")
    buf.change(0, 3, "ONE")
    buf.type(11, "abc")
    buf.backspace(14, 3)
    assert buf.text == "ONE\n\n\n\n\ntwo\n"
    assert [(e.old_text, e.new_text) for e in buf.edits()] == [("one", "ONE")]


def test_replacing_a_selected_word_then_typing_is_one_replacement():
    buf = Buffer("def f(foo): return foo\n")
    buf.change(6, 9, "b")  # the selection replaced by the first keystroke
    buf.type(7, "ar")
    assert [(e.start, e.old_text, e.new_text) for e in buf.edits()] == [(6, "foo", "bar")]


def test_an_edit_before_the_typed_text_that_touches_it_merges():
    buf = Buffer("a = 1\n")
    buf.type(4, "22")  # a = 221
    buf.change(3, 4, "")  # a =221: deletes the space just before the typed text
    assert [(e.start, e.old_text, e.new_text) for e in buf.edits()] == [(3, " ", "22")]
    assert (buf.edits()[0].before, buf.edits()[0].after) == ("a =", "1")  # the context moved left too
    assert undo_all(buf.text, buf.edits()) == "a = 1\n"


def test_a_far_edit_starts_a_new_one():
    buf = Buffer("alpha\n" * 10)
    buf.type(0, "xy")
    buf.type(40, "z")
    assert [(e.start, e.old_text, e.new_text) for e in buf.edits()] == [(0, "", "xy"), (40, "", "z")]
    assert buf.history.last(KEY) == buf.edits()[-1]


def test_a_pause_starts_a_new_edit():
    buf = Buffer("x = \n")
    buf.type(4, "ab")
    buf.change(6, 6, "c", dt=buf.history.gap + 0.5)
    buf.change(7, 7, "d", dt=buf.history.gap - 0.5)
    assert [e.new_text for e in buf.edits()] == ["ab", "cd"]


def test_a_change_that_disagrees_with_the_last_edit_starts_a_new_one():
    # the server says the typed "ab" was "zz": a change it missed, so the two are not one edit
    history = EditHistory()
    history.record(KEY, 4, "", "ab", 1.0)
    history.record(KEY, 4, "zz", "", 1.1)
    assert [(e.old_text, e.new_text) for e in history.recent(KEY)] == [("", "ab"), ("zz", "")]


def test_a_no_op_change_records_nothing():
    history = EditHistory()
    assert history.record(KEY, 3, "same", "same", 1.0) is None
    assert history.record(KEY, 3, "", "", 1.0) is None
    assert KEY not in history and history.recent(KEY) == []


def test_recent_gives_the_last_n_oldest_first():
    buf = Buffer("line\n" * 20)
    for i in range(5):
        buf.change(10 * i, 10 * i, str(i), dt=5)
    assert [e.new_text for e in buf.history.recent(KEY)] == ["2", "3", "4"]
    assert [e.new_text for e in buf.history.recent(KEY, 1)] == ["4"]
    assert buf.history.recent(KEY, 0) == [] and buf.history.recent("file:///other") == []


def test_edits_replay_as_a_patch_series():
    # random typing, backspaces, selections replaced and far jumps: undoing the kept edits one by
    # one from the current text finds each edit's new text at its start, and gives the first text
    rng = random.Random(7)
    first = "".join(rng.choice("ab \n") for _ in range(300))
    buf = Buffer(first, EditHistory(max_edits=10**6, max_chars=10**6))
    cursor = 150
    for _ in range(2000):
        if rng.random() < 0.1:
            cursor = rng.randrange(len(buf.text) + 1)
        r = rng.random()
        if r < 0.6:
            buf.change(cursor, cursor, rng.choice("abc\n"), dt=rng.choice([0.1, 0.1, 3.0]))
            cursor += 1
        elif r < 0.85 and cursor > 0:
            buf.change(cursor - 1, cursor, "")
            cursor -= 1
        else:
            end = min(len(buf.text), cursor + rng.randrange(4))
            buf.change(cursor, end, rng.choice(["", "x", "yz"]))
    edits = buf.edits()
    assert 1 < len(edits) < 2000  # keystrokes did coalesce, and not all into one
    assert undo_all(buf.text, edits) == first


# ----------------------------------------------------------------------------- bounds


def test_at_most_max_edits_the_oldest_go_first():
    buf = Buffer("x\n" * 100)
    for i in range(MAX_EDITS + 5):
        buf.change(4 * i, 4 * i + 1, "y", dt=5)
    edits = buf.edits()
    assert len(edits) == MAX_EDITS
    assert edits[0].start == 4 * 5 and edits[-1].start == 4 * (MAX_EDITS + 4)


def test_at_most_max_chars_the_oldest_go_first():
    buf = Buffer("\n" * 50)
    for i in range(12):
        buf.change(i, i, "v" * 500, dt=5)
    edits = buf.edits()
    assert sum(e.size for e in edits) <= MAX_CHARS
    assert len(edits) == MAX_CHARS // 500 and edits[-1].start == 11


def test_ten_thousand_records_stay_bounded():
    rng = random.Random(3)
    buf = Buffer("abc\n" * 2000)
    for _ in range(10_000):
        at = rng.randrange(len(buf.text) + 1)
        if rng.random() < 0.5:
            buf.type(at, "word", dt=0.05)
        else:
            buf.change(at, min(len(buf.text), at + rng.randrange(200)), "q" * rng.randrange(200), dt=0.05)
    edits = buf.edits()
    assert len(edits) <= MAX_EDITS and sum(e.size for e in edits) <= MAX_CHARS
    assert undo_all(buf.text, edits)  # still a consistent series


def test_long_typing_at_one_place_splits_rather_than_grow_past_the_budget():
    # the edit grows to the budget; the keystroke past it starts a new edit, and the full one goes
    buf = Buffer("\n")
    buf.type(0, "z" * MAX_CHARS, dt=0.01)
    assert [(e.start, len(e.new_text)) for e in buf.edits()] == [(0, MAX_CHARS)]
    buf.type(MAX_CHARS, "zz", dt=0.01)
    assert [(e.start, e.old_text, e.new_text) for e in buf.edits()] == [(MAX_CHARS, "", "zz")]


def test_a_huge_paste_clears_the_history_and_is_not_stored():
    buf = Buffer("def f():\n    pass\n")
    buf.type(18, "x = 1")
    paste = "y" * 2_000_000
    assert buf.change(23, 23, paste) is None
    assert buf.edits() == [] and buf.history.last(KEY) is None
    # the next keystroke, right after the typed text's old place, starts afresh: no merge with it
    buf.change(23, 23, "!")
    assert [(e.start, e.old_text, e.new_text) for e in buf.edits()] == [(23, "", "!")]
    assert len(buf.edits()[0].after) <= CONTEXT_CHARS  # the paste is not kept as context either


def test_a_huge_deletion_clears_the_history_too():
    buf = Buffer("z" * 10_000)
    buf.type(0, "ab")
    buf.change(0, 10_002, "")
    assert buf.edits() == []


def test_drop_forgets_one_document():
    history = EditHistory()
    history.record(KEY, 0, "", "a", 1.0)
    history.record("file:///b.py", 0, "", "b", 1.0)
    history.drop(KEY)
    assert KEY not in history and history.recent(KEY) == [] and history.last(KEY) is None
    assert [e.new_text for e in history.recent("file:///b.py")] == ["b"]
    history.drop("file:///never-opened.py")  # no error


# ----------------------------------------------------------------------------- line context


def test_each_edit_keeps_its_line_as_context():
    buf = Buffer("import os\ndef f(foo, y): return foo\nprint(1)\n")
    buf.change(16, 19, "bar")
    (e,) = buf.edits()
    assert (e.before, e.after) == ("def f(", ", y): return foo")
    assert e.before + e.old_text + e.after == "def f(foo, y): return foo"
    assert e.before + e.new_text + e.after == "def f(bar, y): return foo"


def test_typed_suffix_keeps_the_whole_line_as_context():
    buf = Buffer("x = foo + 1\r\ny\r\n")
    buf.type(7, "Bar")
    (e,) = buf.edits()
    assert e.before + e.new_text + e.after == "x = fooBar + 1"


def test_context_on_a_long_line_is_cut_at_whole_words():
    text = "w" * 500 + " left " + "." * (CONTEXT_CHARS - 12) + "X" + " right " + "v" * 500
    at = text.index("X")
    before, after = line_context(text, at, at + 1)
    assert len(before) <= CONTEXT_CHARS and len(after) <= CONTEXT_CHARS
    assert before.startswith(" left ") and not before.startswith("w")
    assert after.startswith(" right ") and "v" not in after


def test_context_stops_at_any_line_break():
    for br in ("\n", "\r\n", "\r"):
        text = f"a{br}one two{br}b"
        at = text.index("two")
        assert line_context(text, at, at + 3) == ("one ", "")
        assert line_context(text, at - 4, at - 4) == ("", "one two")
