"""engine/tokenizer.py: token healing's choice of the prefix tail to re-type."""

from __future__ import annotations

import pytest

from engine.tokenizer import EOS, PAD, SPECIALS, TextTokenizer, train_bpe
from tests.tiny import CORPUS


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return train_bpe(CORPUS, 300)


def _texts(tok, ids):
    return [tok.token_text(i) for i in ids]


def test_a_partial_word_is_healed_to_the_tokens_that_complete_it(tok):
    prefix = "import os\nimpo"
    ids = tok.encode(prefix)
    assert tok.token_id("import") is not None and ids[-1] != tok.token_id("import")  # the cut split the word
    h = tok.heal(ids)
    assert h.k >= 1 and tok.decode(ids[-h.k :]) == h.text and prefix.endswith(h.text)
    assert "import".startswith(h.text) and tok.token_id("import") in h.first
    # the longest tail some token extends: one more token back, nothing does
    assert not any(t.startswith(tok.decode(ids[-h.k - 1 :])) for t in _texts(tok, range(tok.vocab_size)))
    # slot 0 either extends the tail, or is a shorter piece of it whose rest slot 1 extends
    for i in h.first:
        t = tok.token_text(i)
        if i in h.then:
            assert h.text.startswith(t) and len(t) < len(h.text)
            assert all(u.startswith(h.text[len(t) :]) for u in _texts(tok, h.then[i]))
        else:
            assert t.startswith(h.text)


def test_healing_reaches_how_the_whole_text_is_tokenized(tok):
    """At cursors inside words and indentation, the tokens of the text with the rest of the line
    typed (the tokenization the model was trained on) are reachable: the kept prefix is theirs, slot 0
    may take the next one, and when that is a shorter piece of the tail, slot 1 the one after."""
    reached = pieces = 0
    for text in CORPUS[:4]:
        whole = tok.encode(text)
        for cut in range(1, len(text)):
            h = tok.heal(tok.encode(text[:cut]))
            if h is None:
                continue
            kept = tok.encode(text[:cut])[: -h.k]
            if whole[: len(kept)] != kept or len(whole) <= len(kept) + 1:
                continue  # the cursor's prefix splits differently further back: healing cannot help
            first, second = whole[len(kept)], whole[len(kept) + 1]
            if tok.token_text(first).startswith(h.text):
                assert first in h.first and first not in h.then
            elif h.text.startswith(tok.token_text(first)) and tok.token_text(second).startswith(
                h.text[len(tok.token_text(first)) :]
            ):
                assert first in h.then and second in h.then[first]
                pieces += 1
            else:
                continue
            reached += 1
    assert reached >= 20 and pieces >= 1


def test_nothing_to_heal(tok):
    assert tok.heal([]) is None
    assert tok.heal([tok.token_id(EOS)]) is None  # special tokens are never re-typed
    h = tok.heal(tok.encode("a +"))
    specials = {tok.token_id(s) for s in SPECIALS}
    assert h is None or not specials & (set(h.first) | {i for v in h.then.values() for i in v})
    # a last token that no other token extends and that splits into no pieces is left alone
    alone = [
        i
        for i in range(len(SPECIALS), tok.vocab_size)
        if len(tok.token_text(i)) == 1
        and sum(t.startswith(tok.token_text(i)) for t in _texts(tok, range(tok.vocab_size))) == 1
    ]
    assert alone and tok.heal([alone[0]]) is None
    assert tok.token_id(PAD) in specials


def test_lone_surrogates_are_encoded_as_the_replacement_character():
    from pathlib import Path

    tok = TextTokenizer.load(Path(__file__).resolve().parent.parent / "models" / "default")
    assert tok.encode("x = '\ud800'") == tok.encode("x = '\ufffd'")
    assert tok.encode_batch(["\udfff", "ok"]) == [tok.encode("\ufffd"), tok.encode("ok")]
