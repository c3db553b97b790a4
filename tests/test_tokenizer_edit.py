"""TextTokenizer.encode_edit: re-tokenizing only near an edit gives the ids of tokenizing the whole
text, on real source files and the edits typing makes (and others), for the shipped tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from engine import tokenizer as tk
from engine.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.load(ROOT / "models" / "default")


def _texts() -> list[str]:
    files = sorted((ROOT / "engine").rglob("*.py"))[:12] + sorted((ROOT / "dlm_lsp").rglob("*.py"))[:6]
    return [f.read_text(encoding="utf-8") for f in files]


def _edits(text: str, rng: random.Random):
    """(old text, new text) pairs: typing at a cursor, deleting, pasting, replacing, tabs, blank lines,
    non-ASCII, a lone surrogate, edits at the very start and end."""
    pieces = [
        "x",
        " ",
        "\n",
        "\n    ",
        "\t",
        ":",
        "(",
        "é",
        "日本",
        "    return self.x\n",
        "\n\n",
        "'",
        "\ud800",
        "  \n",
    ]
    for _ in range(40):
        at = rng.randrange(len(text) + 1)
        old = text[:at]
        kind = rng.randrange(4)
        if kind == 0:  # typed one character at the end (the cursor), as the prefix grows
            yield old, old + rng.choice(pieces)
        elif kind == 1:  # a deletion near the end
            yield old, old[: max(0, len(old) - rng.randrange(1, 6))]
        elif kind == 2:  # an edit anywhere in the text
            j = rng.randrange(len(text) + 1)
            yield text, text[:j] + rng.choice(pieces) + text[j + rng.randrange(0, 3) :]
        else:  # a line replaced
            yield old, old.rsplit("\n", 1)[0] + "\n" + rng.choice(pieces)
    yield "", text[:50]
    yield text[:50], ""
    yield "def f():\n    return 1\n", "def f():\n    return 12\n"


def test_an_edit_gives_the_ids_of_the_whole_text(tok):
    assert tok.edit_ok
    rng = random.Random(0)
    fast = 0
    calls = []
    real_encode = tok.encode
    for text in _texts():
        for old, new in _edits(text, rng):
            calls.clear()
            tok.encode = lambda t: (calls.append(len(t)), real_encode(t))[1]  # noqa: E731
            try:
                got = tok.encode_edit(old, real_encode(old), new)
            finally:
                del tok.encode
            assert got == real_encode(new), (old[-80:], new[-80:])
            fast += bool(calls) and calls[0] < len(new) - 1  # only a tail was tokenized
    assert fast > 200  # the shortcut is taken, not only the whole-text fallback


def test_typing_a_line_tokenizes_only_that_line(tok):
    text = "class A:\n    def f(self):\n        return self.value + 1\n" * 40
    old = text + "        x = sel"
    seen = []
    real = tok.encode
    tok.encode = lambda t: (seen.append(t), real(t))[1]  # noqa: E731
    try:
        got = tok.encode_edit(old, real(old), old + "f")
    finally:
        del tok.encode
    assert got == real(old + "f")
    assert seen == [" x = self"]  # from the line's last indent character on


def test_boundary_and_common_prefix():
    assert tk.common_prefix("abcdef", "abcxyz") == 3 and tk.common_prefix("abc", "abc") == 3
    assert tk.common_prefix("", "a") == 0 and tk.common_prefix("ab", "abc") == 2
    text = "a = 1\n    b = 2\n"
    assert tk._boundary(text, len(text)) == 9  # the indent's last space, before "b"
    assert tk._boundary(text, 10) is None  # "b" itself must be in the common part: then only line 1 is left
    assert tk._boundary("x\n\ny", 4) == 2 and tk._boundary("x\ny", 3) is None


def test_another_kind_of_tokenizer_tokenizes_the_whole_text():
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # the boundary argument fails here
    other = TextTokenizer(raw)
    assert not other.edit_ok
    seen = []
    other.encode = lambda t: (seen.append(t), [len(t)])[1]  # noqa: E731
    assert other.encode_edit("a\n    b", [0], "a\n    bc") == [8] and seen == ["a\n    bc"]


def test_the_engine_tokenizes_a_session_as_it_would_afresh():
    # EngineService._encode: a document typed into (with its session key) gets the ids of tokenizing
    # its whole texts at every keystroke, its suffix edited too; other sessions and keyless jobs as ever
    from engine.api import FillJob
    from engine.serve.service import EngineService

    svc = EngineService(str(ROOT / "models" / "default"), device="cpu", threads=1)
    svc.load()
    text = (ROOT / "engine" / "decode" / "reuse.py").read_text(encoding="utf-8")
    cut = text.index("\n", len(text) // 2) + 1
    before, typed, after = text[:cut], "        for x in items:\n            y = x", text[cut:]
    for k in range(len(typed) + 1):
        for key in ("doc-a", "doc-b", None):
            suffix = after if k % 7 else ")" + after  # now and then the text after the cursor changes too
            job = FillJob(prefix=before + typed[:k], suffix=suffix, session=key)
            assert svc._encode(job) == tuple(svc.tok.encode_batch([job.prefix, job.suffix])), (k, key)
    assert set(svc._texts) == {"doc-a", "doc-b"}


def test_far_text_by_lines_gives_the_ids_of_the_whole_text(tok):
    """encode_lines (a fill's far text, its pieces' ids kept across keystrokes) equals encode on real
    files, texts with trailing spaces, CRLF, blank runs and odd characters, and on a text whose
    pieces were cached from other texts."""
    rng = random.Random(5)
    texts = _texts()
    odd = [
        "x = 1  \n\n\n   y\t\n" * 200,
        "a\r\nb \r\n\tc\n" * 400,
        "é ü 中文 \U0001f4a5\n  x\n" * 150,
        "def f():\n    return 1\n" * 150 + "tail",
    ]
    for text in texts + odd:
        assert tok.encode_lines(text) == tok.encode(text)
    a, b = texts[0], texts[1]
    for _ in range(5):  # snippets reordered and cut: pieces come from the cache, ids stay exact
        rows = (a + b).split("\n")
        mixed = "\n".join(rng.sample(rows, min(300, len(rows))))
        assert tok.encode_lines(mixed) == tok.encode(mixed)
    assert tok.encode_lines("") == [] and tok.encode_lines("short text") == tok.encode("short text")


def test_far_text_by_lines_keeps_a_bounded_cache(tok, monkeypatch):
    monkeypatch.setattr(tk, "LINE_CACHE", 50)
    text = "\n".join(f"name_{i} = {i}" for i in range(400))
    assert tok.encode_lines(text) == tok.encode(text)
    assert len(tok._lines) <= 50
