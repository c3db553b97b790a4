"""engine/tokenizer.py: token healing's choice of the prefix tail to re-type."""
from __future__ import annotations

import pytest

from engine.tokenizer import EOS, PAD, TextTokenizer, train_bpe
from tests.tiny import CORPUS


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return train_bpe(CORPUS, 300)


def test_a_partial_word_is_healed_to_the_tokens_that_complete_it(tok):
    prefix = "import os\nimpo"
    ids = tok.encode(prefix)
    assert tok.token_id("import") is not None and ids[-1] != tok.token_id("import")  # the cut split the word
    k, cands, text = tok.heal(ids)
    assert k >= 1 and tok.decode(ids[-k:]) == text and prefix.endswith(text)
    assert "import".startswith(text) and tok.token_id("import") in cands
    assert all(tok.token_text(i).startswith(text) for i in cands)
    # the longest tail some token extends: one more token back, nothing does
    assert not any(tok.token_text(i).startswith(tok.decode(ids[-k - 1 :])) for i in range(tok.vocab_size))


def test_nothing_to_heal(tok):
    assert tok.heal([]) == (0, [], "")
    assert tok.heal([tok.token_id(EOS)]) == (0, [], "")  # special tokens are never re-typed
    cands = tok.heal(tok.encode("a +"))[1]
    assert all(i not in (tok.token_id(PAD), tok.token_id(EOS)) for i in cands)
    # a last token that no other token extends is left alone (k = 1 needs a second candidate)
    alone = [i for i in range(7, tok.vocab_size)
             if sum(tok.token_text(j).startswith(tok.token_text(i)) for j in range(tok.vocab_size)) == 1
             and "\ufffd" not in tok.token_text(i)]
    assert alone and tok.heal([alone[0]]) == (0, [], "")
