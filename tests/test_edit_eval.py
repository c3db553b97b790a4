"""`dlm-lsp eval --kinds edit` (dlm_lsp/measure/edit_eval.py) on three hand-made cases in the edit
cases' JSONL format: a stand-in engine answers each approach with a known rewrite, so every count
(shown, exact, closer, farther, reversals, whitespace, noise silence, coverage) and the gate curve
are checked exactly; then the command end to end through `eval`'s own arguments, and once on a tiny
random checkpoint (the real EngineService path)."""

from __future__ import annotations

import json

import pytest

from dlm_lsp.cli import build_parser
from dlm_lsp.fill import edit_gate
from dlm_lsp.measure import edit_eval, evaluate
from engine.api import EDIT_APPROACHES, EngineError, Rewrite
from tests.tiny import make_tiny_checkpoint

# repeat: `x` renamed to `w` on line 1, the release renames its two other uses next
RENAME_OLD = "x = 1\ny = x + 1\nz = x + 2\n"
RENAME_DOC = "w = 1\ny = x + 1\nz = x + 2\n"
RENAME_TRUTH = "w = 1\ny = w + 1\nz = w + 2\n"
# other: an edit on line 1, the truth on line 13, outside the window (line 1 and 8 below)
FAR_OLD = "a = 0\n" + "".join(f"v{i} = {i}\n" for i in range(1, 15))
FAR_DOC = FAR_OLD.replace("a = 0", "a = 10")
FAR_AT = FAR_DOC.index("v12 = 12") + len("v12 = 12")
# noise: a changed constant, nothing follows
NOISE_OLD = "def g():\n    return 1\n"
NOISE_DOC = "def g():\n    return 2\n"

CASES = [
    {"id": "p@1..2:rename.py#hunk1", "file": "rename.py", "old": RENAME_OLD, "edits": [[0, "x", "w"]], "cursor": 1,
     "truth": [10, "x + 1\nz = x", "w + 1\nz = w"], "category": "repeat"},
    {"id": "p@1..2:far.py#hunk1", "file": "far.py", "old": FAR_OLD, "edits": [[4, "", "1"]], "cursor": 6,
     "truth": [FAR_AT, "", "0"], "category": "other"},
    {"id": "p@1..2:noise.py#noise0", "file": "noise.py", "old": NOISE_OLD, "edits": [[20, "1", "2"]], "cursor": 21,
     "truth": None, "category": "noise"},
]  # fmt: skip

# (approach, window) -> (rewrite, confidence); any other job gets its window back (unchanged)
ANSWERS = {
    ("window", RENAME_DOC): (RENAME_TRUTH, 0.95),  # exact
    ("surprise", RENAME_DOC): ("w = 1\ny = w + 1\nz = x + 2\n", 0.5),  # half way: closer
    ("memory", RENAME_DOC): (RENAME_OLD, 0.8),  # takes the user's rename back: blocked
    ("window+memory", RENAME_DOC): ("w = 1\ny = x + 1\n", 0.3),  # drops a line: farther
    ("surprise+memory", RENAME_DOC): ("w = 1\ny = x + 1\nz = x  + 2\n", 0.7),  # whitespace: blocked
    ("window", FAR_DOC[: FAR_DOC.index("v9 =")]): (FAR_DOC[: FAR_DOC.index("v9 =")].replace("v1 = 1", "v1 = 11"), 0.4),
    ("window", NOISE_DOC): ("def g():\n    return 3\n", 0.6),  # noise: anything shown is farther
    ("memory", NOISE_DOC): (EngineError("the window has 300 tokens; max_tokens is 256"), 0.0),  # refused
}


class ScriptedEngine:
    """Answers each EditJob from ANSWERS; keeps the jobs."""

    def __init__(self) -> None:
        self.jobs: list = []

    def run_now(self, job) -> Rewrite:
        self.jobs.append(job)
        text, conf = ANSWERS.get((job.approach, job.window), (job.window, 1.0))
        if isinstance(text, Exception):
            raise text
        return Rewrite(text, confidence=conf)


def write_cases(folder, cases=CASES) -> None:
    rows = []
    for c in cases:
        path = folder / "files" / "heldout_packages" / "p" / "1" / c["file"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(c["old"])
        rows.append(
            {
                "id": c["id"], "side": "heldout_packages", "package": "p", "versions": ["1", "2"], "path": c["file"],
                "file": f"files/heldout_packages/p/1/{c['file']}", "edits": c["edits"], "cursor": c["cursor"],
                "truth": c["truth"], "category": c["category"],
            }
        )  # fmt: skip
    (folder / "heldout_packages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "train.jsonl").write_text(json.dumps({**rows[0], "id": "never read"}) + "\n")


@pytest.fixture
def cases(tmp_path):
    write_cases(tmp_path)
    return tmp_path


ALL = [*EDIT_APPROACHES, *edit_eval.BASELINES]


@pytest.fixture
def samples(cases):
    loaded = edit_eval.read_cases(cases)
    assert [c.document for c in loaded] == [RENAME_DOC, FAR_DOC, NOISE_DOC]
    return edit_eval.evaluate_cases(loaded, ALL, ScriptedEngine())


def _one(samples, case_id, approach):
    (s,) = [s for s in samples if s.id.endswith(case_id) and s.approach == approach]
    return s


def test_each_rewrite_is_scored_as_what_it_does(samples):
    s = _one(samples, "rename.py#hunk1", "window")
    assert (s.shown, s.exact, s.closer, s.farther, s.covered, s.confidence) == (True, True, True, False, True, 0.95)
    s = _one(samples, "rename.py#hunk1", "surprise")
    assert (s.shown, s.exact, s.closer, s.farther) == (True, False, True, False)
    s = _one(samples, "rename.py#hunk1", "memory")
    assert (s.shown, s.reversal, s.silent) == (False, True, "reversal")
    s = _one(samples, "rename.py#hunk1", "window+memory")
    assert (s.shown, s.exact, s.closer, s.farther) == (True, False, False, True)
    s = _one(samples, "rename.py#hunk1", "surprise+memory")
    assert (s.shown, s.whitespace, s.silent, s.reversal) == (False, False, "whitespace", False)
    s = _one(samples, "rename.py#hunk1", "propagate")  # the rename carried to its other uses: the truth
    assert (s.shown, s.exact, s.closer, s.confidence) == (True, True, True, 1.0)
    s = _one(samples, "far.py#hunk1", "window")  # the truth lies below the window: never exact
    assert (s.shown, s.exact, s.farther, s.covered) == (True, False, True, False)
    s = _one(samples, "noise.py#noise0", "window")
    assert (s.shown, s.exact, s.farther, s.covered) == (True, False, True, True)
    for case in ("rename.py#hunk1", "far.py#hunk1", "noise.py#noise0"):
        s = _one(samples, case, "silent")
        assert (s.shown, s.silent, s.latency_ms) == (False, "baseline", None)
    assert all(s.latency_ms is not None for s in samples if s.approach != "silent")


def test_the_report_counts_per_category_and_approach(samples):
    rep = edit_eval.report(samples, ALL)
    res = rep["results"]
    assert set(res) == set(ALL) and all(set(r) == set(edit_eval.GROUPS) for r in res.values())
    w = res["window"]
    assert (w["repeat"]["exact"], w["repeat"]["closer"], w["other"]["farther"], w["other"]["covered"]) == (1, 1, 1, 0)
    assert (w["noise"]["shown"], w["noise"]["silent_share"], w["noise"]["farther"]) == (1, 0.0, 1)
    assert (w["edits"]["cases"], w["edits"]["shown"], w["edits"]["exact_of_shown"], w["edits"]["covered"]) == (
        2,
        2,
        0.5,
        1,
    )
    assert res["memory"]["repeat"]["reversals_blocked"] == 1
    assert all(r[g]["reversals_shown"] == 0 and r[g]["whitespace_shown"] == 0 for r in res.values() for g in r)
    assert res["surprise+memory"]["repeat"]["silent_reasons"] == {"whitespace": 1}
    assert res["propagate"]["repeat"]["exact"] == 1 and res["propagate"]["noise"]["silent_share"] == 1.0
    assert res["silent"]["edits"]["shown"] == 0 and res["silent"]["noise"]["silent_share"] == 1.0
    assert res["surprise"]["noise"]["silent_reasons"] == {"unchanged": 1}
    assert res["memory"]["noise"]["silent_reasons"] == {"refused": 1}  # the engine's error: nothing shown
    # the gate curve: at 0.5 the far case (0.4) is held back, the exact one (0.95) is still shown
    pts = {p["gate"]: p for p in rep["curves"]["window"]["edits"]}
    assert (pts[0.0]["shown"], pts[0.0]["exact_of_shown"], pts[0.0]["shown_share"]) == (2, 0.5, 1.0)
    assert (pts[0.5]["shown"], pts[0.5]["exact_of_shown"], pts[0.5]["shown_share"]) == (1, 1.0, 0.5)
    assert pts[0.9]["shown"] == 1 and rep["curves"]["window"]["noise"][7]["shown"] == 0  # 0.6 < 0.7


def test_replayed_edits_stay_apart_and_reach_the_engine_as_lines(cases):
    """Two touching edits would coalesce if typed together: the replay spaces them past the gap."""
    old = "x = 1\n"
    doc, history = edit_eval.replay(old, [(0, "x", "w"), (1, "", "v")])
    assert doc == "wv = 1\n"
    assert [(e.old_text, e.new_text) for e in history.recent(edit_eval.KEY)] == [("x", "w"), ("", "v")]
    engine = ScriptedEngine()
    edit_eval.evaluate_cases(edit_eval.read_cases(cases), ["window"], engine)
    assert engine.jobs[0].edits == [("x = 1", "w = 1")] and engine.jobs[0].prefix == ""


def test_the_command_writes_json_and_samples(cases, tmp_path, monkeypatch, capsys):
    out, rows = tmp_path / "edit.json", tmp_path / "samples.jsonl"
    monkeypatch.setattr(edit_eval, "load_edit_engine", lambda args: ScriptedEngine())
    argv = ["eval", "--kinds", "edit", "--edit-cases", str(cases), "--json", str(out), "--samples", str(rows)]
    assert evaluate.run_eval(build_parser("eval").parse_args(argv)) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"results", "curves", "meta"}
    assert report["meta"]["counts"] == {"noise": 1, "other": 1, "repeat": 1} and report["meta"]["approaches"] == ALL
    assert report["results"]["window"]["repeat"]["exact"] == 1
    assert [p["gate"] for p in report["curves"]["surprise"]["repeat"]] == list(edit_eval.GATES)
    lines = [json.loads(ln) for ln in rows.read_text().splitlines()]
    assert len(lines) == 3 * len(ALL)
    need = {"id", "approach", "category", "shown", "exact", "closer", "farther", "confidence", "latency_ms"}
    assert all(need <= set(r) for r in lines)
    printed = capsys.readouterr().out
    assert "| repeat | window | 1 | 1 | 1 | 100% | 1 |" in printed and "| noise | silent |" in printed
    again = edit_eval.report(edit_eval.read_samples(rows), ALL)  # the samples alone give the same report
    assert json.loads(json.dumps(again)) == {k: report[k] for k in ("results", "curves")}


def test_a_pick_of_cases_and_the_approaches_asked_for(cases, tmp_path, monkeypatch):
    monkeypatch.setattr(edit_eval, "load_edit_engine", lambda args: ScriptedEngine())
    out = tmp_path / "edit.json"
    argv = ["eval", "--kinds", "edit", "--edit-cases", str(cases), "--approaches", "memory", "--max-cases", "2"]
    assert evaluate.run_eval(build_parser("eval").parse_args([*argv, "--json", str(out)])) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["cases"] == 2 and list(report["results"]) == ["memory", "propagate", "silent"]
    for bad in (["--approaches", "guess"], ["--kinds", "edit,line"], ["--edit-cases", str(tmp_path / "none")]):
        args = build_parser("eval").parse_args([*argv, *bad])
        assert evaluate.run_eval(args) == 2


def test_the_baselines_need_no_engine(cases, tmp_path, monkeypatch):
    """propagate runs without an engine, gated as the server gates it (the shipped edit gate) or,
    with --edit-gate none, every suggestion shown with the kind and features a gate is fitted on."""
    argv = ["eval", "--kinds", "edit", "--edit-cases", str(cases), "--approaches", "propagate"]
    out, rows = tmp_path / "edit.json", tmp_path / "samples.jsonl"
    ungated = [*argv, "--edit-gate", "none", "--json", str(out), "--samples", str(rows)]
    assert evaluate.run_eval(build_parser("eval").parse_args(ungated)) == 0
    report = json.loads(out.read_text())
    assert report["results"]["propagate"]["edits"]["exact"] == 1 and report["meta"]["edit_gate"] is None
    shown = [r for r in map(json.loads, rows.read_text().splitlines()) if r["approach"] == "propagate" and r["shown"]]
    assert shown and all(r["kind"] in edit_gate.KINDS and len(r["features"]) == len(edit_gate.FEATURES) for r in shown)
    for least, exact in ((1.0, 0), (0.0, 1)):  # a shipped gate that hides every kind, one that shows all
        gate = edit_gate.EditGate(("repeated",), (0.0,), 0.0, dict.fromkeys(edit_gate.KINDS, least))
        monkeypatch.setattr(edit_gate, "_SHIPPED", [gate])
        assert evaluate.run_eval(build_parser("eval").parse_args([*argv, "--json", str(out)])) == 0
        report = json.loads(out.read_text())
        assert (
            report["results"]["propagate"]["edits"]["exact"] == exact and report["meta"]["edit_gate"] == gate.to_json()
        )
        if not exact:
            assert "unsure" in report["results"]["propagate"]["edits"]["silent_reasons"]


def test_on_a_tiny_checkpoint(cases, tmp_path):
    """The real EngineService path: a random model's rewrites, scored (whatever they are)."""
    model = make_tiny_checkpoint(tmp_path / "tiny", printable=True)
    out, rows = tmp_path / "edit.json", tmp_path / "samples.jsonl"
    argv = ["eval", "--kinds", "edit", "--edit-cases", str(cases), "--approaches", "window,surprise+memory"]
    argv += ["--model", str(model), "--threads", "1", "--json", str(out), "--samples", str(rows)]
    assert evaluate.run_eval(build_parser("eval").parse_args(argv)) == 0
    res = json.loads(out.read_text())["results"]
    assert res["window"]["edits"]["cases"] == 2 and res["window"]["noise"]["reversals_shown"] == 0
    assert len(rows.read_text().splitlines()) == 3 * 4


def test_the_train_side_is_for_the_baselines_only(cases, tmp_path):
    """--edit-side train reads train.jsonl (a second set of cases for rules without a model) and
    refuses a model's approach: a model may have trained on those cases."""
    argv = ["eval", "--kinds", "edit", "--edit-cases", str(cases), "--edit-side", "train", "--edit-gate", "none"]
    argv += ["--approaches", ""]
    out = tmp_path / "train.json"
    assert evaluate.run_eval(build_parser("eval").parse_args([*argv, "--json", str(out)])) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["cases"] == 1 and report["meta"]["sides"] == ["train"]  # the one "never read" row
    assert report["results"]["propagate"]["repeat"]["exact"] == 1
    refused = build_parser("eval").parse_args([*argv[:-1], "memory"])
    assert evaluate.run_eval(refused) == 2
