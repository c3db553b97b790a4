"""The calibrated gate (dlm_lsp/fill/gate.py): features, the logistic fit, the serving.json form, the
gate in postprocess.finish, the server and the eval, and `dlm-lsp calibrate` on eval samples."""

from __future__ import annotations

import json
import math
import random

import pytest

from dlm_lsp.fill.context import build_request
from dlm_lsp.fill.documents import Document
from dlm_lsp.fill.gate import FEATURES, Calibrator, features
from dlm_lsp.fill.postprocess import SyntaxCheck, finish
from dlm_lsp.measure.calibrate import fit

SRC = """import os


def load(path):
    with open(path) as fh:
        return fh.read().splitlines()


def main(argv):
    names = load(argv[1])
    with open(|
"""


def setup(src: str = SRC):
    offset = src.index("|")
    doc = Document("file:///t.py", "python", 1, src.replace("|", "", 1))
    req = build_request(doc, offset)
    return doc, req, SyntaxCheck(doc.text, doc.tree, doc.parser, offset)


def feat(req, text, conf=0.5, replace_len=0):
    return dict(zip(FEATURES, features(req, text, conf, replace_len)))


def test_features_describe_the_cursor_and_the_fill():
    _, req, _ = setup()
    x = feat(req, "path) as fh:", conf=0.5)
    assert len(features(req, "x", 0.5)) == len(FEATURES)
    assert x["logit_confidence"] == pytest.approx(0.0)
    assert x["log_chars"] == pytest.approx(math.log1p(len("path)asfh:")))
    assert x["log_typed"] == pytest.approx(math.log1p(len("withopen(")))
    assert x["after_open"] == 1.0 and x["after_dot"] == 0.0 and x["after_word"] == 0.0 and x["line_start"] == 0.0
    assert x["ends_colon"] == 1.0 and x["multi_line"] == 0.0 and x["replaces"] == 0.0
    # the fill and the whole cursor line occur in load(): copied from the context
    assert x["in_context"] == 1.0 and x["line_in_context"] == 1.0
    y = feat(req, "argv[2]) as out:")
    assert y["in_context"] == 0.0 and y["line_in_context"] == 0.0
    # the cursor line's own typed start does not count as context
    doc, req2, _ = setup("def f():\n    zzq_unique = |\n")
    assert feat(req2, "zzq_unique")["in_context"] == 0.0 and feat(req2, "1")["after_space"] == 1.0
    # confidence is clipped, never infinite
    assert math.isfinite(feat(req, "a", conf=1.0)["logit_confidence"])
    assert math.isfinite(feat(req, "a", conf=0.0)["logit_confidence"])


def test_features_see_the_far_text():
    """A fill copied from beyond the window (FillRequest.far: other open documents) counts as copied."""
    doc = Document("file:///t.py", "python", 1, "def g():\n    x = \n")
    req = build_request(doc, doc.text.index("= ") + 2, neighbours="frobnicate_widget(3)\n")
    assert feat(req, "frobnicate_widget(3)")["in_context"] == 1.0
    assert feat(req, "something_else(3)")["in_context"] == 0.0


def test_fit_recovers_a_known_logistic_model():
    rng = random.Random(0)
    rows, labels = [], []
    for _ in range(4000):
        a, b, c = rng.gauss(0, 1), rng.random() < 0.3, 5.0  # c is constant: no information
        z = -1.0 + 2.0 * a + 1.5 * b
        rows.append([a, float(b), c])
        labels.append(int(rng.random() < 1 / (1 + math.exp(-z))))
    (wa, wb, wc), bias = fit(rows, labels, l2=0.01)
    assert wa == pytest.approx(2.0, abs=0.25) and wb == pytest.approx(1.5, abs=0.3)
    assert wc == pytest.approx(0.0, abs=1e-6)
    assert bias == pytest.approx(-1.0, abs=0.25)
    # a strong penalty shrinks the weights towards 0
    (sa, _, _), _ = fit(rows, labels, l2=1e5)
    assert abs(sa) < 0.1 * abs(wa)
    with pytest.raises(ValueError):
        fit([[1.0]], [0, 1])


def test_calibrator_json_round_trip_and_malformed_input():
    cal = Calibrator(("in_context", "log_chars"), (2.0, -0.5), -1.0, {"fills": 10})
    back = Calibrator.from_json(json.loads(json.dumps(cal.to_json())))
    assert back == cal
    good = cal.to_json()
    for bad in (
        None,
        [],
        "x",
        {},
        {**good, "features": ["no_such_feature", "log_chars"]},
        {**good, "weights": [1.0]},
        {**good, "weights": [float("nan"), 1.0]},
        {**good, "weights": [True, 1.0]},
        {**good, "bias": "0"},
        {**good, "features": ["log_chars", "log_chars"]},
        {**good, "features": [], "weights": []},
    ):
        assert Calibrator.from_json(bad) is None, bad


def test_score_is_the_logistic_of_the_features():
    _, req, _ = setup()
    cal = Calibrator(("in_context",), (3.0,), -1.0)
    assert cal.score(req, "path) as fh:", 0.1) == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert cal.score(req, "argv[2]) as out:", 0.1) == pytest.approx(1 / (1 + math.exp(1.0)))


def test_finish_gates_on_the_calibrated_score():
    _, req, check = setup()
    cal = Calibrator(("in_context",), (3.0,), -1.0)  # copied: 0.88; not copied: 0.27
    # the raw gate hides a low-confidence fill ...
    raw = finish(req, "path) as fh:", check, confidence=0.1, min_confidence=0.5)
    assert raw.text == "" and "low confidence" in raw.dropped and raw.score == pytest.approx(0.1)
    # ... the calibrated gate shows it, being copied from the context, and hides one that is not
    shown = finish(req, "path) as fh:", check, confidence=0.1, min_confidence=0.5, calibrator=cal)
    assert shown.text == "path) as fh:" and shown.score == pytest.approx(0.8808, abs=1e-3)
    hidden = finish(req, "argv[2]) as out:", check, confidence=0.99, min_confidence=0.5, calibrator=cal)
    assert hidden.text == "" and "low acceptance score" in hidden.dropped
    assert hidden.score == pytest.approx(0.2689, abs=1e-3)
    # the score is of the finished text: post-processing ran first (the fill's second line is cut)
    two = finish(req, "path) as fh:\nmore", check, confidence=0.1, min_confidence=0.5, calibrator=cal)
    assert two.text == "path) as fh:"


def test_serving_json_carries_the_calibrator(tmp_path):
    from engine.weights.checkpoint import serving_defaults

    cal = Calibrator(("in_context",), (3.0,), -1.0).to_json()
    (tmp_path / "serving.json").write_text(json.dumps({"min_confidence": 0.4, "calibrator": cal}))
    got = serving_defaults(tmp_path)
    assert got["min_confidence"] == 0.4 and Calibrator.from_json(got["calibrator"]) is not None
    (tmp_path / "serving.json").write_text(json.dumps({"calibrator": "not a dict"}))
    assert "calibrator" not in serving_defaults(tmp_path)


def test_server_gates_with_the_engines_calibrator():
    from dlm_lsp.server import DlmServer

    server = DlmServer.__new__(DlmServer)
    server.engine_info = {}
    assert server.fill_calibrator() is None
    raw = Calibrator(("in_context",), (3.0,), -1.0).to_json()
    server.engine_info = {"calibrator": raw}
    cal = server.fill_calibrator()
    assert isinstance(cal, Calibrator) and cal.weights == (3.0,)
    assert server.fill_calibrator() is cal  # parsed once per engine report
    server.engine_info = {"calibrator": {"features": ["bogus"], "weights": [1], "bias": 0}}
    assert server.fill_calibrator() is None  # malformed: the raw confidence is gated


def test_eval_samples_fit_a_calibrator_that_the_eval_then_applies(tmp_path):
    """eval --samples -> dlm-lsp calibrate --write serving.json -> eval gates on the calibrated score."""
    from dlm_lsp.cli import main
    from tests.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "m")
    samples = tmp_path / "s.jsonl"
    args = [
        "eval",
        "--model",
        str(model),
        "--kinds",
        "line",
        "--per-kind",
        "60",
        "--limit-files",
        "8",
        "--threads",
        "1",
        "--min-confidence",
        "0",
    ]
    assert main([*args, "--samples", str(samples), "--json", str(tmp_path / "a.json")]) == 0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    with_fill = [r for r in rows if r["features"] is not None]
    assert with_fill and all(len(r["features"]) == len(FEATURES) for r in with_fill)
    assert all(r["accepted"] in (True, False) for r in rows if len("".join(r["ungated"].split())) >= 2)
    assert json.loads((tmp_path / "a.json").read_text())["meta"]["gate_on"] == "confidence"
    # a tiny random model is rarely accepted: fit on labels made from a feature so both classes exist
    chars = sorted(r["features"][FEATURES.index("log_chars")] for r in with_fill)
    for r in with_fill:
        r["accepted"] = r["features"][FEATURES.index("log_chars")] > chars[len(chars) // 2]
    assert len(with_fill) >= 20 and 0 < sum(r["accepted"] for r in with_fill) < len(with_fill)
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    serving = model / "serving.json"
    serving.write_text(json.dumps({"min_confidence": 0.5}))
    assert main(["calibrate", str(samples), "--l2", "0.1", "--write", str(serving)]) == 0
    stored = json.loads(serving.read_text())
    assert stored["min_confidence"] == 0.5 and stored["calibrator"]["fit"]["fills"] == len(with_fill)
    assert "log_chars" not in stored["calibrator"]["features"]  # DROP: not fitted by default
    assert main(["calibrate", str(samples), "--l2", "0.1", "--drop", "", "--write", str(serving)]) == 0
    stored = json.loads(serving.read_text())
    cal = Calibrator.from_json(stored["calibrator"])
    assert cal.names == FEATURES and cal.weights[FEATURES.index("log_chars")] > 0
    assert main(["calibrate", str(samples), "--drop", "no_such"]) == 2
    samples2 = tmp_path / "s2.jsonl"
    out = tmp_path / "b.json"
    assert main([*args[:-2], "--samples", str(samples2), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["gate_on"] == "calibrated" and res["meta"]["min_confidence"] == 0.5
    for r in map(json.loads, samples2.read_text().splitlines()):
        if r["features"] is not None:  # the gate compared the calibrated score of the ungated fill
            assert (r["shown"] == r["ungated"]) == (r["score"] >= 0.5 or not r["ungated"].strip()), r
    # --judge: the raw and the calibrated gate ranked on the same holes
    rep = tmp_path / "judge.json"
    assert (
        main(["calibrate", str(samples), "--l2", "0.1", "--drop", "", "--judge", str(samples), "--json", str(rep)]) == 0
    )
    j = json.loads(rep.read_text())["judge"]
    assert j["holes"] == len(rows) and j["fills"] == len(with_fill)
    assert set(j["curves"]) == {"confidence", "calibrated"} and j["at_shown"]
    # the labels follow log_chars, which the calibrator learned: it ranks at least as well as the raw one
    assert all(r["calibrated"] >= r["confidence"] for r in j["at_shown"])
    assert j["curves"]["calibrated"][0] == {
        "gate": 0.0,
        "shown": round(len(with_fill) / len(rows), 4),
        "accepted": round(sum(r["accepted"] for r in with_fill) / len(with_fill), 4),
    }
    # --folds: out-of-sample on the fit's own samples, fold by file
    assert main(["calibrate", str(samples), "--l2", "0.1", "--drop", "", "--folds", "2", "--json", str(rep)]) == 0
    cv = json.loads(rep.read_text())["cross_validation"]
    assert cv["folds"] == 2 and cv["holes"] == len(rows) and cv["fills"] == len(with_fill) and cv["at_shown"]
    row = cv["at_shown"][0]
    assert 0 <= row["calibrated"] <= 1 and row["calibrated_chars_per_shown"] >= 0
    # --exclude drops the holes of another samples file (here: all of them)
    assert main(["calibrate", str(samples), "--exclude", str(samples2), str(samples)]) == 1
    # --raw-gate: the same model gated on the engine's raw confidence
    assert main([*args[:-2], "--raw-gate", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["gate_on"] == "confidence"


def test_a_gate_per_hole_kind_and_a_kind_hidden_by_default(tmp_path):
    """serving.json's min_confidence may be one gate per hole kind; 1.0 hides a kind (no score passes,
    not even an all-certain 1.0); the user's minConfidence still overrides every kind."""
    from dlm_lsp.fill.gate import kind_gate
    from dlm_lsp.options import parse_options
    from dlm_lsp.server import make_server
    from engine.weights.checkpoint import serving_defaults

    per_kind = {"line": 0.2, "middle": 0.35, "block": 1.0}
    assert [kind_gate(per_kind, k) for k in ("line", "middle", "block", "args")] == [0.2, 0.35, math.inf, 0.0]
    assert kind_gate(0.4, "block") == 0.4 and kind_gate(None, "line") == 0.0 and kind_gate(True, "line") == 0.0
    (tmp_path / "serving.json").write_text(json.dumps({"min_confidence": {**per_kind, "lines": 0.5, "args": 2}}))
    assert serving_defaults(tmp_path) == {"min_confidence": per_kind}  # unknown kinds and out-of-range left out
    ls = make_server()
    ls.engine_info = {"gate": per_kind}
    assert (ls.fill_gate("line"), ls.fill_gate("block")) == (0.2, math.inf)
    ls.options, _ = parse_options({"minConfidence": 0.0}, ls.options)
    assert ls.fill_gate("block") == 0.0  # the user's setting turns the hidden kind back on
    req = build_request(Document("file:///a.py", "python", 1, "def f(x):\n    "), 14)
    hidden = finish(req, "return x", None, confidence=1.0, min_confidence=kind_gate(per_kind, "block"))
    assert hidden.text == "" and "fills are off for this model" in (hidden.dropped or "")
