"""Every `dlm-lsp` error a user causes is one line on stderr and exit code 2, never a traceback:
a model not found, a file missing, unreadable or not text, a position outside the file, a bad option."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlm_lsp.cli import is_ours, one_line


def _run(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dlm_lsp.cli", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def source(tmp_path):
    f = tmp_path / "a.py"
    f.write_text("x = 1\nprint(x)\n")
    (tmp_path / "latin1.py").write_bytes(b"s = '\xe9\xff'\n")
    (tmp_path / "folder.py").mkdir()
    return f


CASES = {  # argv (with {src} for the file) -> words the one line must hold
    "line past the end": (["complete", "{src}:9:1"], "line 9 is outside"),
    "column past the line": (["complete", "{src}:1:40"], "column 40 is outside"),
    "line zero": (["complete", "{src}:0:1"], "line 0 is outside"),
    "no such file": (["complete", "missing.py:1:1"], "missing.py"),
    "a folder, not a file": (["complete", "folder.py:1:1"], "folder.py"),
    "not UTF-8": (["complete", "latin1.py:1:1"], "utf-8"),
    "model not found": (["complete", "{src}:1:1", "--model", "/no/such/folder"], "/no/such/folder"),
    "bad location": (["complete", "{src}:a:b"], "PATH:LINE:COL"),
    "bad option value": (["complete", "{src}:1:1", "--budget-ms", "soon"], "--budget-ms"),
    "unknown subcommand": (["serve-all"], "invalid choice"),
    "demo with a missing model": (["demo", "--model", "/no/such/folder"], "/no/such/folder"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_error_is_one_line_and_exit_code_2(tmp_path, source, case):
    argv, words = CASES[case]
    r = _run(tmp_path, *(a.replace("{src}", str(source)) for a in argv))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert words.lower() in lines[0].lower()


def test_a_bug_keeps_its_traceback():
    """Only errors that say what the user gave wrong become one line; anything else is a bug."""
    assert is_ours(FileNotFoundError(2, "No such file or directory", "x.py"))
    assert not is_ours(ZeroDivisionError("division by zero"))
    assert not is_ours(KeyError("x"))
    assert one_line(FileNotFoundError(2, "No such file or directory", "x.py")) == "No such file or directory: x.py"
    assert one_line(ValueError("two\nlines")) == "two lines"


def test_a_foreign_kernels_package_is_refused_with_a_message(tmp_path):
    """Hugging Face's `kernels` distribution installs the same top-level name as ours: found first
    on sys.path, importing dlm_lsp says so (and the command says it in one line), not an
    ImportError deep inside."""
    fake = tmp_path / "elsewhere" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('the foreign package was executed')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "elsewhere")}
    r = subprocess.run(
        [sys.executable, "-c", "import dlm_lsp"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0
    assert "ShadowedPackageError" in r.stderr and str(fake) in r.stderr and "pipx install" in r.stderr
    assert "the foreign package was executed" not in r.stderr  # found, never imported
    cli = Path(sys.executable).parent / "dlm-lsp"
    r = subprocess.run([str(cli), "models"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "uv tool install" in r.stderr
    ok = subprocess.run([sys.executable, "-c", "import dlm_lsp"], cwd=tmp_path, capture_output=True, timeout=120)
    assert ok.returncode == 0
