"""Identifier-aware decoding (DecodeOptions.names, engine/bias/names.py): a fill's identifiers are names
that exist in the job's text, the keywords and builtins, or the model's corpus names."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.api import DecodeOptions, FillJob
from engine.bias import names
from engine.decode import reference
from engine.decode.canvas import check_options
from engine.weights.checkpoint import serving_defaults
from tests.tiny import tiny_service

TEXTS = ["", "onse", "ond", "ite", "(", " =", "resp", "response", "respond", "onse(", "x", " foo", "\ufffd", "é"]


def _bias(known: set[str], weight: float = 3.0, corpus: set[str] = frozenset()) -> names.NameBias:
    vocab = names.Vocab(TEXTS, special={0})
    return names.NameBias(vocab, [names.NameSet(known), names.NameSet(corpus)], weight)


def _penalized(row) -> set[str]:
    return {TEXTS[i] for i in range(len(TEXTS)) if row is not None and row[i] < 0}


def test_continuing_a_partial_name_only_towards_known_names():
    b = _bias({"response", "request"})
    row = b.row("x = self.resp")
    # "resp" + "onse" is the known name; ending at "resp" or going to "respite" is not
    assert _penalized(row) == {"ond", "ite", "(", " =", "resp", "response", "respond", "x", " foo"}
    assert row[TEXTS.index("onse")] == 0 and row[TEXTS.index("onse(")] == 0  # the name ends after "onse": known
    assert row[TEXTS.index("ond")] == -3.0
    # a whole known name may end: punctuation is fine, going on is not
    assert _penalized(b.row("y = response")) == {"onse", "ond", "ite", "resp", "response", "respond", "onse(", "x"}
    assert b.row("y = response") is b.row("z = (response")  # cached per partial name


def test_new_names_numbers_strings_and_comments_are_left_alone():
    b = _bias({"response"})
    assert b.row("new_variab") is None  # no known name starts so: a name being defined
    assert b.row("x = 12") is None and b.row("x = 1e") is None  # numbers
    assert b.row('print("resp') is None and b.row("x = 1  # resp") is None  # a string, a comment
    assert b.row('print("a", resp') is not None and b.row("s = 'it''s' + resp") is not None
    assert b.row("x = ") is None  # no identifier under way at an ordinary slot
    assert b.row("x = self.resp") is not None


def test_the_healed_slot_checks_its_whole_identifier():
    b = _bias({"response"})
    ids = [TEXTS.index(t) for t in ("resp", "response", "respond")]
    row = b.heal_row("x = self.", ids)  # the partial word was removed from the prefix; slot 0 re-types it
    assert _penalized(row) == {"respond"}  # "resp" may still become "response"
    assert b.heal_row("x = self.", [TEXTS.index("response")]) is None  # nothing to penalize
    assert b.heal_row('s = "self.', ids) is None  # inside a string
    # the partial name spans the prefix and the slot: "re" + "sp..."
    row = names.NameBias(names.Vocab(["", "sponse", "spond"], set()), [names.NameSet({"response"})], 2.0).heal_row(
        "x = re", [1, 2]
    )
    assert row.tolist() == [0.0, 0.0, -2.0]


def test_corpus_names_count_as_known():
    b = _bias({"x"}, corpus={"respond"})
    assert _penalized(b.row("resp")) == {"onse", "ite", "(", " =", "resp", "response", "respond", "onse(", "x", " foo"}
    assert b.known("respond") and b.known_start("respo") and not b.known("resp")


def test_names_of_texts_and_the_names_file(tmp_path):
    got = names.names_in("def f(alpha, _beta2):\n    return alpha", "x.gamma")
    assert {"f", "alpha", "_beta2", "x", "gamma", "def", "len", "match"} <= got and "2" not in got
    assert names.load_names(tmp_path) == frozenset()
    (tmp_path / names.NAMES_FILE).write_text("alpha\nbeta gamma\n2bad\nnot-a-name\n")
    assert names.load_names(tmp_path) == {"alpha", "beta", "gamma"}
    (tmp_path / names.NAMES_FILE).write_text("x\n" * (names.MAX_NAMES_BYTES // 2 + 1))
    with pytest.raises(ValueError, match="over"):
        names.load_names(tmp_path)
    assert names.in_code("x = 'a' + b") and not names.in_code("x = 'a") and not names.in_code("x  # c")
    assert names.in_code('x = "a\\"b" + c') and names.in_code("a = '#'\nb = c")


def test_serving_json_may_set_names(tmp_path):
    (tmp_path / "serving.json").write_text(json.dumps({"decode": {"names": 4.0, "copy_bigram": 2.0}}))
    assert serving_defaults(tmp_path)["decode"] == {"names": 4.0, "copy_bigram": 2.0}
    (tmp_path / "serving.json").write_text(json.dumps({"decode": {"names": -1}}))
    assert "decode" not in serving_defaults(tmp_path)
    with pytest.raises(ValueError, match="names"):
        check_options(DecodeOptions(names=-1.0))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return tiny_service(tmp_path_factory.mktemp("names") / "m", seed=3)


def _oracle(service, job: FillJob):
    tok = service.tok
    p_ids, s_ids = tok.encode_batch([job.prefix, job.suffix])
    heal = tok.heal(p_ids) if job.options.heal else None
    if heal:
        p_ids = p_ids[: -heal.k]
    bias = names.NameBias(
        names.vocab_for(tok),
        [names.NameSet(names.names_in(job.prefix, job.suffix, job.lookup)), service.corpus_names],
        job.options.names,
        tok.decode(p_ids[-48:]),
        tok.decode,
    )
    return reference.reference_fill(
        service.model,
        p_ids,
        s_ids,
        job.max_tokens + (1 if heal else 0),
        job.options,
        heal=heal and heal.first,
        heal_then=heal and heal.then,
        names=bias,
    )


def test_service_fill_with_names_equals_the_oracle_and_changes_fills(service):
    cases = [
        (
            "import os\ndef total(items):\n    s = 0\n    for item in items:\n        s += item\n    return s\n\ntot = tot",
            "",
        ),
        ("class Point:\n    def __init__(self, xcoord, ycoord):\n        self.xcoord = xc", "\n"),
        ("values = [first_value, second_value]\nprint(sec", ")\n"),
        ("tot = tot", ""),
        ("import os\nos.pa", ""),
    ]
    changed = 0
    for heal in (False, True):
        base = DecodeOptions(threshold=0.5, heal=heal, names=0.0)
        on = dataclasses.replace(base, names=20.0)
        for prefix, suffix in cases:
            job = FillJob(prefix=prefix, suffix=suffix, max_tokens=6, options=on)
            got = service.run_now(job)
            assert got.token_ids == _oracle(service, job), (heal, prefix[-12:])
            plain = service.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=6, options=base))
            changed += got.token_ids != plain.token_ids
    assert changed  # the penalty reached the canvas


def test_names_off_builds_no_bias(service):
    job = FillJob(prefix="abc = ab", max_tokens=4, options=DecodeOptions(names=0.0, heal=False))
    act = service._admit(job, __import__("concurrent.futures").futures.Future())
    assert act.canvas.names is None
    act = service._admit(
        dataclasses.replace(job, options=DecodeOptions(names=1.5, heal=False)),
        __import__("concurrent.futures").futures.Future(),
    )
    assert isinstance(act.canvas.names, names.NameBias) and act.canvas.names.weight == 1.5
    assert torch.is_tensor(act.canvas.names.vocab.id_start)


def test_names_in_caches_whole_line_chunks_with_the_same_result():
    """names_in scans each run of CHUNK_LINES lines once: the result is the plain regex's over the
    whole texts, a second job with the same lookup text misses only the chunks that changed, and
    known_names shares one sorted NameSet between jobs whose names are the same."""
    import random

    rng = random.Random(3)
    words = [f"name_{i}" for i in range(300)] + ["x", "_y2", "déjà"]
    lines = [" ".join(rng.choice(words) + rng.choice([".", "(", " = ", ""]) for _ in range(6)) for _ in range(700)]
    lookup, doc = "\n".join(lines[:500]), "\n".join(lines[500:])
    plain = set(names.BASE_NAMES).union(*(names._NAME.findall(t) for t in (doc, lookup)))
    assert names.names_in(doc, lookup) == plain
    before = names._CHUNKS.misses
    typed = doc[:3000] + " brand_new_name " + doc[3000:]
    got = names.names_in(typed, lookup)
    assert got == set(names.BASE_NAMES).union(*(names._NAME.findall(t) for t in (typed, lookup)))
    assert "brand_new_name" in got
    assert names._CHUNKS.misses - before == 1  # only the edited chunk was scanned again
    a = names.known_names(doc, lookup)
    assert names.known_names(doc + " x", lookup) is a  # no new name: the same sorted set
    assert names.known_names(doc + " fresh_one", lookup) is not a
    assert a.sorted == sorted(plain)
    small = names._Chunks(cap=2)
    for c in ("a b", "c d", "e f"):
        small.names(c)
    assert list(small._d) == ["c d", "e f"] and small.names("a b") == {"a", "b"} and small.misses == 4


BTEXTS = ["", ")", "]", "}", "x", "(", "),", "')", " #)", "<end>", "\n"]


def test_bracket_rule_rows():
    """DecodeOptions.brackets: with a bracket open on the cursor's line, a token that closes another
    kind is penalized, and the ends are while a bracket the fill opened is still open; strings,
    comments and brackets closed on the line are skipped."""
    vocab = names.Vocab(BTEXTS, special={0, 9})
    assert {c: ids.tolist() for c, ids in vocab.closers.items()} == {")": [1, 6], "]": [2], "}": [3]}
    b = names.NameBias(vocab, [], 0.0, base="    y = f(a, ", brackets=2.0, ends=(9, 10))
    pen = lambda row: {BTEXTS[i] for i in range(len(BTEXTS)) if row is not None and row[i] < 0}  # noqa: E731
    assert pen(b.slot_row([], None)) == {"]", "}"}  # the prefix opened "(": ends are fine, ")" too
    b.decode = lambda ids: "".join(BTEXTS[i] for i in ids)
    assert pen(b.slot_row([5], None)) == {"]", "}", "<end>", "\n"}  # the fill opened "(": it may not end
    assert pen(b.slot_row([5, 1], None)) == {"]", "}"}  # closed again
    assert b.slot_row([5, 1, 1], None) is None  # nothing open on the line
    assert b.slot_row([], [1, 2]) is None  # the healed slot: names only (off here)
    assert names.line_brackets("f('(', [x  # (", 0) == [("(", True), ("[", True)]
    assert names.line_brackets("g(a)[b", 3) == [("[", True)] and names.line_brackets("g(a)[b", 5) == [("[", False)]
    assert (
        names.NameBias(vocab, [], 0.0, base="s = '(", brackets=2.0, ends=(9,)).slot_row([], None) is None
    )  # in a string
    both = names.NameBias(
        names.Vocab(TEXTS, special={0}), [names.NameSet({"response"})], 3.0, base="f(resp", brackets=1.0
    )
    assert both.slot_row([], None) is not None and float(both.slot_row([], None).min()) == -3.0


def test_service_fill_with_brackets_equals_the_oracle(service):
    tok = service.tok
    cases = [
        ("result = compute(alpha, beta", ")\n"),
        ("items = [first, (second", ""),
        ("call(x)[", "\n"),
        ("d = {'a': (1", ""),
    ]
    changed = 0
    for heal in (False, True):
        for nm in (0.0, 4.0):
            base = DecodeOptions(threshold=0.5, heal=heal, names=nm, brackets=0.0, stop_newline=True, refresh_every=1)
            on = dataclasses.replace(base, brackets=20.0)
            for prefix, suffix in cases:
                job = FillJob(prefix=prefix, suffix=suffix, max_tokens=6, options=on)
                got = service.run_now(job)
                p_ids, s_ids = tok.encode_batch([prefix, suffix])
                h = tok.heal(p_ids) if heal else None
                if h:
                    p_ids = p_ids[: -h.k]
                known = names.known_names(prefix, suffix, "") if nm else names.NameSet(())
                stops = list(tok.newline_ids())
                bias = names.NameBias(
                    names.vocab_for(tok),
                    [known, service.corpus_names],
                    nm,
                    tok.decode(p_ids[-48:]),
                    tok.decode,
                    brackets=20.0,
                    ends=(service.cfg.pad_token_id, service.cfg.eos_token_id) + tuple(stops),
                )
                want = reference.reference_fill(
                    service.model,
                    p_ids,
                    s_ids,
                    6 + (1 if h else 0),
                    on,
                    heal=h and h.first,
                    heal_then=h and h.then,
                    stop_ids=stops,
                    names=bias,
                )
                assert got.token_ids == want, (heal, nm, prefix)
                plain = service.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=6, options=base))
                changed += got.token_ids != plain.token_ids
    assert changed  # the rule reached the canvas
    with pytest.raises(ValueError, match="brackets"):
        check_options(DecodeOptions(brackets=-1.0))
