"""The next-edit gate (dlm_lsp/fill/edit_gate.py) and its fit (dlm_lsp/measure/calibrate_edit.py): what
a propagation's suggestion tells it, how the per-kind gate silences a suggestion, and that the fit picks
its gates from packages it did not see."""

import json
import math

import pytest

from dlm_lsp.fill import edit_gate, suggest
from dlm_lsp.fill.edit_gate import FEATURES, EditGate, features, kind_of
from dlm_lsp.fill.history import Edit
from dlm_lsp.fill.nextedit import propagation
from dlm_lsp.headless_edit import suggestion
from dlm_lsp.measure import calibrate_edit


def edit(old: str, new: str, before: str = "", after: str = "") -> Edit:
    return Edit(0, old, new, 1.0, before, after)


def feats(p) -> dict[str, float]:
    return dict(zip(FEATURES, features(p), strict=True))


def test_features_say_what_the_propagation_did():
    # the user changed typing.List to list twice in signatures; two more below the cursor
    recent = [edit("typing.List", "list", "def f(x: ", "[int]):"), edit("typing.List", "list", "def g(y: ", "[str]):")]
    window = "a = 1\ndef h(z: typing.List[int], w: typing.List[str]):\n    pass\n"
    p = propagation(recent, window, cursor=0)
    assert p is not None and p.window == "a = 1\ndef h(z: list[int], w: list[str]):\n    pass\n"
    assert (p.first, p.last, p.cursor_line) == (1, 2, 0)
    f = feats(p)
    assert f["repeated"] == 1.0 and f["log_sites"] == pytest.approx(math.log(3))
    assert f["log_distance"] == pytest.approx(math.log(2)) and f["above"] == 0.0
    assert f["qualified"] == 1.0 and f["shrinks"] == 0.0 and f["grows"] == 0.0
    assert f["definition"] == 0.0 and kind_of(p) == "code"
    assert f["log_chars"] == pytest.approx(math.log1p(len("typing.List")))


def test_a_rename_at_its_definition_is_its_own_kind():
    p = propagation([edit("_table", "table", "def f(self, ", "=None):")], "    if _table is None:\n")
    assert p is not None and [m.role for m in p.made] == ["definition"] and kind_of(p) == "definition"
    f = feats(p)
    assert f["definition"] == 1.0 and f["repeated"] == 0.0 and f["shrinks"] == 1.0 and f["qualified"] == 0.0
    # the run above the cursor's line
    above = propagation([edit("foo", "bar", "x = ", "(1)")], "y = foo(2)\nz = 3\n", cursor=len("y = foo(2)\nz"))
    assert (
        above is not None
        and feats(above)["above"] == 1.0
        and feats(above)["log_distance"] == pytest.approx(math.log(2))
    )


def test_words_in_strings_are_the_text_kind():
    recent = [edit("A", "An", '    """', " error."), edit("A", "An", '    """', " option.")]
    window = '    """A value."""\n'
    p = propagation(recent, window, noncode=[(4, len(window) - 1)])
    assert p is not None and kind_of(p) == "text" and feats(p)["text"] == 1.0


def gate_of(**weights: float) -> EditGate:
    names = tuple(weights)
    return EditGate(names, tuple(weights.values()), 0.0)


def test_the_gate_scores_and_silences_per_kind():
    recent = [edit("typing.List", "list", "def f(x: ", "[int]):")]
    doc = "def g(y: typing.List[str]):\n    pass\n"
    req = suggest.edit_request(doc, 0, recent, "propagate", language="python")
    assert req is not None
    g = gate_of(qualified=-2.0)  # sigmoid(-2) for a qualified old text
    b = suggest.baseline(req, g)
    assert b.kind == "code" and b.confidence == pytest.approx(1 / (1 + math.exp(2)))
    assert suggest.baseline(req).confidence == 1.0  # no gate: shown at 1
    g.gates = {"code": 0.5}
    assert b.least == 0.0 and suggest.baseline(req, g).least == 0.5
    found = suggestion(doc, 0, recent, "propagate", None, None, "python", scorer=g)
    assert found is not None and found.silent == "unsure"
    # the user's nextEditMinConfidence is the gate for every kind when set
    found = suggestion(doc, 0, recent, "propagate", None, 0.0, "python", scorer=g)
    assert found is not None and found.silent is None and found.edits
    g.gates = {"definition": 0.99}  # another kind's gate does not touch this one
    found = suggestion(doc, 0, recent, "propagate", None, None, "python", scorer=g)
    assert found is not None and found.silent is None


def test_gate_json_round_trips_and_refuses_what_it_cannot_read():
    g = EditGate(("repeated", "above"), (1.5, -0.5), -1.0, {"code": 0.4, "text": 1.0}, {"note": "x"})
    back = EditGate.from_json(json.loads(json.dumps(g.to_json())))
    assert back == g
    good = g.to_json()
    for bad in (
        None,
        [],
        {**good, "features": ["nope", "above"]},
        {**good, "weights": [1.0]},
        {**good, "bias": "x"},
        {**good, "weights": [float("nan"), 1.0]},
        {**good, "gates": {"loops": 0.5}},
        {**good, "gates": {"code": True}},
        {**good, "features": ["above", "above"]},
    ):
        assert EditGate.from_json(bad) is None, bad


def test_the_shipped_gate_is_read_from_its_file(tmp_path, monkeypatch):
    path = tmp_path / "edit_gate.json"
    monkeypatch.setattr(edit_gate, "PATH", path)
    monkeypatch.setattr(edit_gate, "_SHIPPED", [])
    assert edit_gate.shipped() is None  # no file: no gate, every suggestion at confidence 1
    monkeypatch.setattr(edit_gate, "_SHIPPED", [])
    path.write_text(json.dumps(EditGate(("above",), (-1.0,), 0.5, {"code": 0.3}).to_json()))
    got = edit_gate.shipped()
    assert got is not None and got.gates == {"code": 0.3}
    path.write_text("{not json")
    assert edit_gate.shipped() is got  # read once
    monkeypatch.setattr(edit_gate, "_SHIPPED", [])
    assert edit_gate.shipped() is None  # malformed: no gate


def test_the_repository_ships_a_gate_it_can_read():
    raw = json.loads(edit_gate.PATH.read_text(encoding="utf-8"))
    g = EditGate.from_json(raw)
    assert g is not None and set(g.gates) == set(edit_gate.KINDS)
    assert g.fit_info and g.fit_info["suggestions"] >= 20


# ----------------------------------------------------------------------------- the fit


def sample(pkg: str, i: int, x: float, exact: bool, farther: bool = False, kind: str = "code") -> dict:
    f = [0.0] * len(FEATURES)
    f[FEATURES.index("repeated")] = x
    return {
        "id": f"{pkg}@1..2:m.py#hunk{i}",
        "approach": "propagate",
        "category": "repeat" if exact else "other",
        "shown": True,
        "exact": exact,
        "closer": exact,
        "farther": farther,
        "kind": kind,
        "features": f,
    }


def test_least_gate_is_the_lowest_that_meets_the_targets():
    rows = [(0.9, {"exact": True, "farther": False})] * 4 + [(0.2, {"exact": False, "farther": True})] * 4
    assert calibrate_edit.least_gate(rows, exact=0.5, farther=0.15, min_shown=3) == 0.9
    assert calibrate_edit.least_gate(rows, exact=0.5, farther=0.5, min_shown=3) == 0.0
    assert calibrate_edit.least_gate(rows, exact=0.5, farther=0.15, min_shown=5) == 1.0  # too few above 0.9
    assert calibrate_edit.least_gate([], exact=0.5, farther=0.15, min_shown=1) == 1.0


def test_out_of_fold_scores_a_package_by_the_others():
    # repeated predicts exact in packages a..h; package z holds the opposite. Its own fit would score
    # z's repeated samples low; a fit on the other packages scores them high.
    rows = []
    for p in "abcdefgh":
        rows += [sample(p, i, 1.0, True) for i in range(3)] + [sample(p, 9 + i, 0.0, False) for i in range(3)]
    rows += [sample("z", i, 1.0, False) for i in range(2)]
    oof = calibrate_edit.out_of_fold(rows, k=4, l2=1.0)
    assert all(p > 0.5 for p, s in zip(oof, rows) if s["id"].startswith("z@"))
    assert all(p < 0.5 for p, s in zip(oof, rows) if not s["features"][0])


def test_calibrate_edits_writes_a_gate_the_server_reads(tmp_path, capsys):
    rows = []
    for p in "abcdefgh":
        rows += [sample(p, i, 1.0, True) for i in range(3)]
        rows += [sample(p, 9 + i, 0.0, False, farther=True) for i in range(3)]
        rows += [sample(p, 20, 1.0, True, kind="definition")]
    rows.append({**sample("a", 30, 1.0, True), "approach": "silent"})  # not propagate's: left out
    rows.append({**sample("a", 31, 1.0, True), "shown": False})  # not shown: left out
    samples = tmp_path / "s.jsonl"
    samples.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out, report = tmp_path / "gate.json", tmp_path / "report.json"
    args = [str(samples), "--write", str(out), "--judge", str(samples), "--json", str(report), "--note", "test"]
    from dlm_lsp.cli import main

    assert main(["calibrate-edits", *args]) == 0
    g = EditGate.from_json(json.loads(out.read_text()))
    assert g is not None and g.fit_info["suggestions"] == 56 and g.fit_info["note"] == "test"
    # code: the repeated half is exact and never farther, so its gate shows it and hides the rest
    assert 0.0 < g.gates["code"] < 1.0 and g.gates["text"] == 1.0  # no text suggestions: hidden
    rep = json.loads(report.read_text())
    assert rep["judge"]["ungated"]["all"]["shown"] == 56
    gated = rep["judge"]["gated"]["all"]
    assert gated["farther"] == 0 and gated["exact"] == gated["shown"] >= 24
    assert "edit gate written" in capsys.readouterr().out


def test_calibrate_edits_refuses_too_few_or_foreign_samples(tmp_path, capsys):
    from dlm_lsp.cli import main

    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps(sample("a", 1, 1.0, True)) + "\n")
    assert main(["calibrate-edits", str(few)]) == 1
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({**sample("a", 1, 1.0, True), "features": [1.0]}) + "\n")
    assert main(["calibrate-edits", str(wrong)]) == 2
    assert "features" in capsys.readouterr().err
