"""`dlm-lsp next-edit FILE:L:C --before OLD` end to end (dlm_lsp/headless_edit.py): a rename carried
to its other uses by the propagation baseline (the diff and the JSON, exactly), an engine approach
on the default model, the history the diff replays, and every bad input as one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlm_lsp.fill import edit_gate
from dlm_lsp.headless_edit import diff_edits, history_of

ROOT = Path(__file__).resolve().parent.parent
OLD = "def total(items):\n    count = 0\n    for item in items:\n        count += item\n    return count\n"
NEW = OLD.replace("    count = 0", "    n = 0")


def _run(cwd, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "dlm_lsp.cli", "next-edit", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def files(tmp_path):
    (tmp_path / "old.py").write_text(OLD)
    (tmp_path / "new.py").write_text(NEW)
    return tmp_path


def test_the_baseline_carries_a_rename_as_a_diff(files):
    r = _run(files, "new.py:2:6", "--before", "old.py", "--approach", "propagate")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        "--- new.py\n"
        "+++ new.py\n"
        "@@ -1,5 +1,5 @@\n"
        " def total(items):\n"
        "     n = 0\n"
        "     for item in items:\n"
        "-        count += item\n"
        "-    return count\n"
        "+        n += item\n"
        "+    return n\n"
    )
    assert r.stderr == ""


def test_the_baseline_as_json(files):
    """--min-confidence 0 shows what the rules make, at the edit gate's confidence; by default the
    shipped gate's least confidence for the suggestion's kind decides, as in the server."""
    r = _run(files, "new.py:2:6", "--before", "old.py", "--approach", "propagate", "--json", "--min-confidence", "0")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out.pop("latency_ms") >= 0
    confidence = out.pop("confidence")
    assert out == {
        "edits": [
            {"start": {"line": 3, "character": 8}, "end": {"line": 3, "character": 13}, "newText": "n"},
            {"start": {"line": 4, "character": 11}, "end": {"line": 4, "character": 16}, "newText": "n"},
        ],
        "silent": None,
    }
    gate = edit_gate.shipped()
    assert gate is not None and 0.0 < confidence < 1.0
    r = _run(files, "new.py:2:6", "--before", "old.py", "--approach", "propagate", "--json")
    default = json.loads(r.stdout)
    assert default["confidence"] == confidence
    # `count = 0` -> `n = 0` renames a name where it is assigned: the definition kind's gate
    assert (default["silent"] == "unsure") == (confidence < gate.gates["definition"])
    assert (default["silent"] is None) == bool(default["edits"])
    assert _run(files, "new.py:2:6", "--before", "old.py", "--min-confidence", "2").returncode == 2


def test_silence_says_why(files):
    r = _run(files, "old.py:2:1", "--before", "old.py", "--approach", "propagate")
    assert (r.returncode, r.stdout) == (0, "no suggestion (no recent edit)\n")
    (files / "num.py").write_text(OLD.replace("count = 0", "count = 1"))
    r = _run(files, "num.py:2:1", "--before", "old.py", "--approach", "propagate", "--json")
    assert json.loads(r.stdout)["silent"] == "unchanged" and json.loads(r.stdout)["edits"] == []


def test_an_engine_approach_on_the_default_model(files):
    # the default approach (propagate) needs no model: the engine's layout runs the embedded model
    r = _run(files, "new.py:2:6", "--before", "old.py", "--approach", "surprise+memory", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"edits", "confidence", "latency_ms", "silent"}
    assert (out["silent"] is None) == bool(out["edits"]) and 0.0 <= out["confidence"] <= 1.0


def test_the_history_is_the_diff_top_to_bottom():
    before = "a = 1\nb = 2\nc = 3\nd = 4\n"
    after = "a = 10\nb = 2\nd = 4\ne = 5\n"
    edits = diff_edits(before, after)
    assert edits == [(5, "", "0"), (13, "c = 3\n", ""), (19, "", "e = 5\n")]
    recent = history_of(before, after).recent("file", 5)
    assert [(e.start, e.old_text, e.new_text) for e in recent] == edits  # none coalesced
    assert recent[0].before == "a = 1" and recent[0].after == ""


BAD = {  # argv -> words the one line must hold
    "no such file": (["missing.py:1:1", "--before", "old.py"], "no such file: missing.py"),
    "no such old file": (["new.py:1:1", "--before", "gone.py"], "no such file: gone.py"),
    "a folder": (["folder.py:1:1", "--before", "old.py"], "not a regular file"),
    "a fifo": (["new.py:1:1", "--before", "pipe"], "not a regular file"),
    "a binary file": (["blob.py:1:1", "--before", "old.py"], "binary"),
    "not utf-8": (["latin1.py:1:1", "--before", "old.py"], "not utf-8"),
    "bad location": (["new.py:a:b", "--before", "old.py"], "PATH:LINE:COL"),
    "line past the end": (["new.py:9:1", "--before", "old.py"], "line 9 is outside"),
    "column past the line": (["new.py:1:40", "--before", "old.py"], "column 40 is outside"),
    "no --before": (["new.py:1:1"], "--before"),
    "unknown approach": (["new.py:1:1", "--before", "old.py", "--approach", "guess"], "invalid choice"),
    "model not found": (
        ["new.py:2:6", "--before", "old.py", "--approach", "surprise+memory", "--model", "/no/such/folder"],
        "/no/such/folder",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_exit_code_2(files, case):
    (files / "folder.py").mkdir()
    os.mkfifo(files / "pipe")
    (files / "blob.py").write_bytes(b"\x00\x01binary\x00")
    (files / "latin1.py").write_bytes(b"s = '\xe9\xff'\n")
    argv, words = BAD[case]
    r = _run(files, *argv)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert words.lower() in lines[0].lower()
