"""A wheel built from the tree is the product as a user installs it (pip, pipx, uv tool): it carries the
packages, the embedded default model and the demo's example, none of tests/ or scripts/, and
`dlm-lsp demo` runs from it in a fresh environment, outside the checkout, with the checkout's fills."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # no build isolation: the build backend (setuptools, a dev dependency) is already here; nothing is fetched
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    (whl,) = out.glob("dlm_lsp-*.whl")
    return whl


def test_the_wheel_carries_the_packages_and_the_default_model(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("dlm_lsp-")}
    assert tops == {"dlm_lsp", "engine", "kernels"}, tops
    data = {n.split(".data/data/", 1)[1] for n in names if ".data/data/" in n}
    for f in ("config.json", "model.safetensors", "tokenizer.json", "serving.json", "ngram.safetensors"):
        assert f"share/dlm-lsp/models/default/{f}" in data
    assert "share/dlm-lsp/examples/tide_log.py" in data
    assert "engine/train/data/corpus_manifest.txt" in names
    assert "dlm_lsp/fill/edit_gate.json" in names  # the next-edit gate travels with its rule
    for pkg in (
        "engine/model",
        "engine/decode",
        "engine/serve",
        "engine/clients",
        "engine/train",
        "engine/bias",
        "engine/weights",
        "dlm_lsp/fill",
        "dlm_lsp/http",
        "dlm_lsp/measure",
        "dlm_lsp/measure/fuzz",
    ):
        assert f"{pkg}/__init__.py" in names, pkg


def _fills(out: str) -> list[str]:
    return re.findall(r"^\s+(?:fill|raw)\s*:.*$", out, re.M)


def test_demo_runs_from_the_wheel_in_a_fresh_environment(wheel, tmp_path):
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # the dependencies (torch and the rest) come from this environment, so nothing is downloaded: a .pth
    # line adds its site-packages as a plain folder, which leaves its editable install of the checkout out
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    where = subprocess.run(
        [str(py), "-c", "import engine.paths as p, dlm_lsp; print(p.DATA_ROOT); print(dlm_lsp.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert Path(where[0]) == env_dir / "share" / "dlm-lsp"  # the wheel's own copy of the model, not the checkout's
    assert Path(where[1]).is_relative_to(env_dir)
    run = subprocess.run(
        [str(env_dir / "bin" / "dlm-lsp"), "demo", "--budget-ms", "60000"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    here = subprocess.run(
        [sys.executable, "-m", "dlm_lsp", "demo", "--budget-ms", "60000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert _fills(run.stdout) and _fills(run.stdout) == _fills(here.stdout)
