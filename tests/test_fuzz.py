"""`dlm-lsp fuzz`: its reference edit model, its answer checks, that it raises no false alarm on a
correct server and catches each defect of a broken one, and a bounded run against the real server."""

import argparse
import json
import random
import sys

import pytest

from dlm_lsp.measure.fuzz import add_fuzz_args, run_fuzz
from dlm_lsp.measure.fuzz.checks import CHECKS, check_answer
from dlm_lsp.measure.fuzz.fuzzer import Fuzzer
from dlm_lsp.measure.fuzz.reference import ANY_VERSION, RefText, apply_change, edit_outcomes, norm, resolve
from tests.lsp_helpers import REPO, scripted

REFERENCE = [sys.executable, str(REPO / "tests" / "lsp_reference_server.py")]
SEEDS = [REPO / "tests" / "data"]  # typed besides examples/: the runs below as they were seeded before fuzz left tests/
SCRIPTED = scripted(steps=1, step_ms=1, text="value)")


def pos(line, char):
    return {"line": line, "character": char}


def change(a, b, text):
    return {"range": {"start": pos(*a), "end": pos(*b)}, "text": text}


# ----------------------------------------------------------------------------- the reference edit model


def test_lines_end_at_lf_crlf_and_cr_only():
    ref = RefText("a\r\nb\rc\nd")
    assert [ref.line(i) for i in range(len(ref))] == ["a", "b", "c", "d"]
    other = "x\vx\fx\x1cx\x1dx\x1ex\x85x\u2028x\u2029x"
    assert len(RefText(other)) == 1  # what str.splitlines() cuts is one LSP line
    assert len(RefText("")) == 1 and len(RefText("a\n")) == 2 and len(RefText("\r\r\n\n")) == 4


def test_line_cuts_match_a_plain_scan():
    rng = random.Random(5)
    for _ in range(300):
        text = "".join(
            rng.choice(["a", "b", "\n", "\r", "\r\n", "\u2028", "\U0001f600"]) for _ in range(rng.randint(0, 12))
        )
        starts, ends, i = [0], [], 0
        while i < len(text):  # the spec's rule, one character at a time
            if text[i] in "\r\n":
                ends.append(i)
                i += 2 if text[i : i + 2] == "\r\n" else 1
                starts.append(i)
            else:
                i += 1
        ends.append(len(text))
        ref = RefText(text)
        assert (ref.starts, ref.ends) == (starts, ends), repr(text)


def test_positions_clamp_and_count_utf16():
    ref = RefText("ab\r\n\U0001f600c\n")
    assert ref.offsets(0, 99) == [2]  # past the line's end: before its "\r\n"
    assert ref.offsets(5, 0) == [len(ref.text)]  # past the last line: the document's end
    assert ref.offsets(1, 2) == [5] and ref.offsets(1, 3) == [6]  # the emoji is 2 units
    assert ref.offsets(1, 1) == [4, 5]  # inside the pair: before or after it
    assert ref.position(5) == (1, 2) and ref.position(len(ref.text)) == (2, 0)
    assert ref.is_valid(1, 3) and not ref.is_valid(1, 1) and not ref.is_valid(1, 4) and not ref.is_valid(3, 0)
    assert not ref.is_valid(0, -1) and not ref.is_valid("0", 0)
    assert resolve(ref, pos(-1, 0)) == ([0], True)  # negative: clamped, or rejected
    assert resolve(ref, pos(0, 2**40)) == ([2], True)  # over uinteger: clamped, or rejected
    assert resolve(ref, pos(0, "1")) == ([], True)


def test_apply_change_semantics():
    assert apply_change("a\rb", change((1, 0), (1, 0), "X")) == ["a\rXb"]  # "\r" ends line 0
    assert apply_change("a\u2028b", change((0, 2), (0, 2), "X")) == ["a\u2028Xb"]  # U+2028 does not
    assert apply_change("ab\r\ncd", change((0, 9), (1, 0), "")) == ["abcd"]  # joins the lines
    assert apply_change("ab", change((7, 3), (9, 9), "!")) == ["ab!"]
    assert apply_change("abc", change((0, 2), (0, 1), "")) == [None, "ac"]  # reversed: swapped or rejected
    assert apply_change("abc", change((0, -1), (0, 1), "")) == [None, "bc"]
    # inside a pair each end snaps before or after it (the two ends apart: the pair is replaced)
    assert apply_change("\U0001f600", change((0, 1), (0, 1), "|")) == [None, "|\U0001f600", "|", "\U0001f600|"]
    assert apply_change("abc", {"text": "new"}) == ["new"]
    assert apply_change("abc", {"range": change((0, 0), (0, 0), "")["range"], "text": None}) == [None]


def test_edit_outcomes_chain_changes_and_versions():
    # each change applies to the text the previous one left
    got = edit_outcomes("ab", 1, [change((0, 1), (0, 1), "\n"), change((1, 0), (1, 0), "X")], 2)
    assert got == [("a\nXb", 2)]
    assert edit_outcomes("ab", 1, [change((0, 5), (0, 1), "")], 2) == [("ab", 1), ("a", 2)]
    assert edit_outcomes("ab", 3, [change((0, 0), (0, 0), "v")], "7", loose_version=True) == [
        ("ab", 3),
        ("vab", ANY_VERSION),
    ]


def test_norm_joins_surrogate_halves_as_json_does():
    assert norm("a\ud83d" + "\ude00b") == "a\U0001f600b" == json.loads(json.dumps("a\ud83d" + "\ude00b"))
    assert norm("\ud800x") == "\ud800x"


# ----------------------------------------------------------------------------- answer checks


def inline_answer(a, b):
    return {"items": [{"insertText": "x", "range": {"start": pos(*a), "end": pos(*b)}}]}


def test_check_answer_flags_bad_ranges():
    ref = RefText("s = '\U0001f600'\nprint(max())\n")
    m = "textDocument/inlineCompletion"
    assert check_answer(m, inline_answer((1, 10), (1, 11)), ref, [ref.offsets(1, 10)[0]]) is None
    assert check_answer(m, {"items": []}, ref, [0]) is None and check_answer(m, None, ref, [0]) is None
    assert "does not contain the cursor" in check_answer(
        m, inline_answer((1, 11), (1, 11)), ref, [ref.offsets(1, 10)[0]]
    )
    assert "outside the document" in check_answer(m, inline_answer((1, 13), (1, 13)), ref, [])
    assert "outside the document" in check_answer(m, inline_answer((3, 0), (3, 0)), ref, [])
    assert "surrogate pair" in check_answer(m, inline_answer((0, 6), (0, 6)), ref, [])
    assert "reversed" in check_answer(m, inline_answer((1, 4), (1, 2)), ref, [])
    assert "insertText" in check_answer(
        m, {"items": [{"range": inline_answer((0, 0), (0, 0))["items"][0]["range"]}]}, ref, []
    )
    completion = {
        "isIncomplete": True,
        "items": [{"label": "x", "textEdit": {"newText": "x", "range": {"start": pos(1, 0), "end": pos(1, 99)}}}],
    }
    assert "outside" in check_answer("textDocument/completion", completion, ref, [ref.offsets(1, 0)[0]])


# ----------------------------------------------------------------------------- the fuzzer against known servers


def counts(rep):
    return {c: rep[c] for c in CHECKS}


def summary(rep) -> str:
    """The counts, each failure in a line, and the first one's messages (its repro)."""
    lines = [json.dumps(counts(rep))]
    lines += [f"{f['check']} [{f['class']} step {f['step']}]: {f['detail'][:400]}" for f in rep["failures"]]
    if rep["failures"]:
        lines += ["repro of the first:"] + [json.dumps(m)[:400] for m in rep["failures"][0]["messages"][-12:]]
    return "\n".join(lines).encode("ascii", "backslashreplace").decode()


async def test_no_false_alarms_on_a_correct_server():
    rep = await Fuzzer(400, seed=3, server_cmd=REFERENCE, max_doc_bytes=20_000, timeout=5, corpus_dirs=SEEDS).run()
    assert rep["ok"], summary(rep)
    assert rep["document_text"] and rep["answered"] > 1000
    assert all(v["steps"] > 0 for v in rep["classes"].values())


@pytest.mark.parametrize(
    "defect,classes,n,check",
    [
        ("lf_only", ["line_breaks"], 6, "divergences"),
        ("splitlines", ["line_breaks"], 6, "divergences"),
        ("range_shift", ["valid_session"], 4, "bad_ranges"),
        ("crash_nul", ["binary_content"], 6, "exits"),
        ("hang_unknown", ["unknown_methods"], 1, "unanswered"),
        ("drop_edit", ["valid_session"], 10, "divergences"),
        ("no_clamp", ["positions_out_of_range"], 20, "divergences"),
        ("wedge_huge", ["bad_framing"], 40, "unanswered"),
        ("exit_code", ["valid_session"], 1, "protocol"),
        ("early_answer", ["valid_session"], 1, "protocol"),
        ("stale_next_edit", ["next_edits"], 4, "protocol"),
        ("next_edit_out_of_range", ["next_edits"], 4, "bad_ranges"),
    ],
)
async def test_catches_each_defect(defect, classes, n, check):
    rep = await Fuzzer(
        n,
        seed=1,
        server_cmd=REFERENCE + ["--defect", defect],
        classes=classes,
        max_doc_bytes=20_000,
        timeout=1.5,
        corpus_dirs=SEEDS,
    ).run()
    assert not rep["ok"] and rep[check] > 0, counts(rep)
    f = next(f for f in rep["failures"] if f["check"] == check)
    assert f["messages"] and f["detail"]  # a repro: the messages that led there


async def test_failures_shrink_to_a_minimal_repro():
    rep = await Fuzzer(
        6,
        seed=1,
        server_cmd=REFERENCE + ["--defect", "lf_only"],
        classes=["line_breaks"],
        max_doc_bytes=20_000,
        timeout=2,
        shrink=True,
        corpus_dirs=SEEDS,
    ).run()
    shrunk = [f for f in rep["failures"] if isinstance(f.get("minimal"), list)]
    assert shrunk, summary(rep)
    for f in shrunk:
        assert f["minimal"][0]["method"] == "textDocument/didOpen"
        assert 2 <= len(f["minimal"]) <= min(5, len(f["messages"]))


def test_cli_writes_the_report_and_fails_on_a_defect(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_fuzz_args(p)
    out = tmp_path / "fuzz.json"
    cmd = " ".join(REFERENCE + ["--defect", "range_shift"])
    common = ["--n", "5", "--classes", "valid_session", "--corpus", str(SEEDS[0])]
    assert run_fuzz(p.parse_args([*common, "--server-cmd", cmd, "--json", str(out)])) == 1
    rep = json.loads(out.read_text())
    assert rep["bad_ranges"] > 0 and rep["failures"][0]["messages"]
    assert "FAIL bad_ranges" in capsys.readouterr().out
    assert run_fuzz(p.parse_args([*common, "--server-cmd", " ".join(REFERENCE)])) == 0
    assert run_fuzz(p.parse_args(["--classes", "valid_session,nope"])) == 2  # refused before any server starts
    assert "unknown classes ['nope']" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the real server


async def test_fuzz_the_real_server():
    """300 seeded steps against `dlm-lsp serve`'s code with the scripted engine, small documents."""
    rep = await Fuzzer(300, seed=0, model=SCRIPTED, max_doc_bytes=50_000, timeout=5, corpus_dirs=SEEDS).run()
    assert rep["document_text"], "the server does not answer dlm/documentText"
    assert rep["ok"], summary(rep)
    assert rep["ranges_checked"] > 100  # fills came back, so the range checks ran
