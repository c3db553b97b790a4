"""engine/bias/edits.py: an edit's token substitutions, where they occur in a window, what they
propose there, the chain into the padding room, and the bias rows the sampler adds."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.bias.edits import EditBias, EditMemory, substitutions, word_edits

PAD, MASK = 0, 2


def test_a_replaced_run_is_one_substitution_and_inserts_take_a_neighbour_each_side():
    # 5 6 7 -> 5 9 7: a replace; 5 6 7 -> 5 6 8 7: an insert, widened to (6, 7) -> (6, 8, 7)
    assert substitutions([([5, 6, 7], [5, 9, 7])]) == [((6,), (9,))]
    assert substitutions([([5, 6, 7], [5, 6, 8, 7])]) == [((6, 7), (6, 8, 7))]
    assert substitutions([([5, 6, 7], [5, 7])]) == [((5, 6, 7), (5, 7))]  # a delete, widened
    assert substitutions([([], [4])]) == []  # nothing stood: nothing to substitute


def test_substitutions_skip_special_ids_and_keep_the_most_recent_once():
    assert substitutions([([5, MASK], [6, MASK])], special=[MASK]) == [((5,), (6,))]
    assert substitutions([([5, 1], [6, 1])], special=[1, 6]) == []  # the new run holds a special id
    subs = substitutions([([5], [6]), ([7], [8]), ([5], [6])])
    assert subs == [((7,), (8,)), ((5,), (6,))]


def test_word_edits_give_a_rename_with_and_without_its_leading_space():
    assert word_edits("def add(a, b):", "def add(x, b):") == [("a", "x"), (" a", " x")]
    assert word_edits("def f(self, x):", "def f(self, x: int):") == []  # no word replaced by a word
    assert word_edits("same", "same") == []


def test_occurrences_propose_the_new_ids_and_padding_where_the_new_run_is_shorter():
    mem = EditMemory([((6, 7), (9,)), ((4,), (3,))], 5.0, vocab_size=20, pad_id=PAD)
    window = [4, 6, 7, 1, 6, 1]
    assert mem.stale(window) == [True, True, True, False, False, False]  # a lone 6 is no occurrence of 6 7
    assert mem.proposals(window) == [[3], [9], [PAD], [], [], []]


def test_the_chain_continues_a_longer_new_run_from_the_committed_left_run():
    mem = EditMemory([((6,), (6, 8, 9))], 1.0, vocab_size=20, pad_id=PAD)
    assert mem.chain([1, 6]) == [8] and mem.chain([6, 8]) == [9] and mem.chain([1, 2]) == []


def test_the_bias_rows_put_the_weight_on_proposals_and_live_chains_only():
    mem = EditMemory([((6,), (6, 8))], 3.0, vocab_size=12, pad_id=PAD)
    # canvas: [prefix 1][slot0 = 6 committed][slot1 masked][slot2 masked], slot 3 not live
    ids = torch.tensor([1, 6, MASK, MASK, MASK])
    bias = EditBias(mem, stood=[[6], [], [], []], live=[True, True, True, False], mask_id=MASK)
    rows = bias(SimpleNamespace(ids=ids, start=1), torch.tensor([1, 2, 3]))
    assert rows.shape == (3, 12)
    assert rows[0, 8] == 3.0 and rows[0].sum() == 3.0  # after the committed 6: the chain's 8
    assert rows[1].sum() == 0  # its left neighbour is masked: no run
    assert rows[2].sum() == 0  # not live
    # padding committed between is skipped: 6 PAD | slot -> the run is (6,)
    ids = torch.tensor([1, 6, PAD, MASK])
    rows = bias(SimpleNamespace(ids=ids, start=1), torch.tensor([2]))
    assert rows[0, 8] == 3.0
