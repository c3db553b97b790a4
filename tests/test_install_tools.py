"""`pipx install .` and `uv tool install .` from the checkout give a working `dlm-lsp`: each tool installs
the project into an environment of its own under a temporary folder (the user's pipx and uv homes and
caches are never touched), then that environment's `dlm-lsp demo` and `dlm-lsp complete FILE:L:C` run
from an unrelated folder, with the embedded default model and the demo's example out of that
environment, the checkout's fills, and every HTTP request sent to a proxy that is not there.

Both tools pin the CPU torch the Makefile installs (`torch==2.13.0`, the wheel pip's configuration on
this machine finds on local disk): pip, under pipx, reads that configuration itself; uv reads no pip
configuration, so it gets pip's find-links through UV_FIND_LINKS."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from tests.test_wheel import _fills

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # as the Makefile pins it
INSTALL_TIMEOUT_S = 300

# a file outside the checkout; the cursor is after `hi = ` on line 8
SAMPLE = "def mean(levels):\n    total = sum(levels)\n    return total / len(levels)\n\n\ndef spread(levels):\n    lo = min(levels)\n    hi = \n"
CURSOR = "8:10"
# what the installed environment loads: the model's folder, the package, torch's build
WHERE = "import engine.paths as p, dlm_lsp, torch; print(p.DATA_ROOT, dlm_lsp.__file__, torch.__version__, sep='\\n')"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment with the checkout's venv taken out (a tool's install must stand on its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(extra)
    return env


def _offline_env() -> dict[str, str]:
    """As _clean_env, with every HTTP(S) request going to a closed port: a download would fail."""
    proxies = {f"{k}_proxy": "http://127.0.0.1:9" for k in ("http", "https", "all")}
    return _clean_env(
        **proxies, **{k.upper(): v for k, v in proxies.items()}, NO_PROXY="", no_proxy="", HF_HUB_OFFLINE="1"
    )


def _pip_find_links() -> list[str]:
    """The find-links pip's configuration names (files and PIP_FIND_LINKS), in order, once each."""
    out = _run([sys.executable, "-m", "pip", "config", "list"], check=True).stdout
    links: list[str] = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            links += [v for v in shlex.split(value) if v not in links]
    return links


@pytest.fixture
def tool_home() -> Iterator[Path]:
    # not tmp_path: an install holds about 2 GB (torch, triton), which pytest would keep for three runs
    with tempfile.TemporaryDirectory(prefix="dlm-tool-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("elsewhere") / "stats.py"
    path.write_text(SAMPLE)
    return path


@pytest.fixture(scope="module")
def checkout_fills(sample) -> tuple[list[str], str]:
    """The demo's fills and the sample's fill from the checkout, what every install must give."""
    demo = _run([sys.executable, "-m", "dlm_lsp", "demo", "--budget-ms", "60000"], cwd=ROOT, timeout=240, check=True)
    done = _run(
        [sys.executable, "-m", "dlm_lsp", "complete", f"{sample}:{CURSOR}", "--json", "--budget-ms", "60000"],
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    return _fills(demo.stdout), json.loads(done.stdout)["text"]


def _missing(tool: str) -> NoReturn:
    """A tool the dev extra pins is absent: a skip on a hand-made environment, a failure in CI (where
    `make test` installed the extra, so its absence is a broken install step, not a choice)."""
    if os.environ.get("CI"):
        pytest.fail(f"{tool} is missing although the dev extra pins it: the install step is broken")
    pytest.skip(f"{tool} is not installed here (the dev extra pins it: make setup)")


def install_with_pipx(home: Path) -> tuple[Path, Path]:
    """Runs `pipx install .` into `home`; gives back the command and its environment's folder."""
    if importlib.util.find_spec("pipx") is None:
        _missing("pipx")
    env = _clean_env(PIPX_HOME=str(home / "pipx"), PIPX_BIN_DIR=str(home / "bin"), PIPX_MAN_DIR=str(home / "man"))
    # --backend pip: pipx hands installs to uv when uv sits beside it, and uv reads no pip configuration
    # (it would take PyPI's CUDA torch, 4.8 GB); --preinstall pins torch before the project asks `torch>=2.13`
    cmd = [sys.executable, "-m", "pipx", "install", "--backend", "pip", "--preinstall", TORCH, "."]
    done = _run(cmd, cwd=ROOT, env=env, timeout=INSTALL_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return home / "bin" / "dlm-lsp", home / "pipx" / "venvs" / "dlm-lsp"


def install_with_uv(home: Path) -> tuple[Path, Path]:
    """Runs `uv tool install .` into `home`; gives back the command and its environment's folder."""
    try:
        from uv import find_uv_bin

        uv = find_uv_bin()
    except (ImportError, FileNotFoundError):
        _missing("uv")
    env = _clean_env(
        UV_TOOL_DIR=str(home / "tools"),
        UV_TOOL_BIN_DIR=str(home / "bin"),
        UV_CACHE_DIR=str(home / "cache"),
        UV_PYTHON_DOWNLOADS="never",  # this Python, never one uv would fetch
    )
    # pip's find-links hold the CPU torch wheel. Not pip's extra indexes: uv takes each package from the
    # first index that has it, and a local index with another starlette or torch would then refuse the pins.
    if links := _pip_find_links():
        env["UV_FIND_LINKS"] = ",".join(links)
    cmd = [uv, "tool", "install", ".", "--with", TORCH, "--python", sys.executable]
    done = _run(cmd, cwd=ROOT, env=env, timeout=INSTALL_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return home / "bin" / "dlm-lsp", home / "tools" / "dlm-lsp"


# its steps' own timeouts (install 300 s, then the demo and a completion) and not the suite's 300 s a test:
# on a slow, busy machine the pipx install alone neared 300 s (session 33's make test-slow)
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("install", [install_with_pipx, install_with_uv], ids=["pipx", "uv"])
def test_the_tool_install_runs_from_anywhere_with_the_embedded_model(
    install: Callable[[Path], tuple[Path, Path]], tool_home, sample, checkout_fills
):
    command, env_dir = install(tool_home)
    elsewhere = sample.parent
    where = _run([str(env_dir / "bin" / "python"), "-c", WHERE], cwd=elsewhere, env=_clean_env(), check=True)
    data_root, package, torch_version = where.stdout.splitlines()
    assert Path(data_root) == env_dir / "share" / "dlm-lsp"  # the installed model, not the checkout's
    assert Path(package).is_relative_to(env_dir)
    assert torch_version == importlib.metadata.version("torch")  # the Makefile's (CPU) build

    demo_fills, sample_fill = checkout_fills
    demo = _run([str(command), "demo", "--budget-ms", "60000"], cwd=elsewhere, env=_offline_env(), timeout=240)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert _fills(demo.stdout) and _fills(demo.stdout) == demo_fills
    done = _run(
        [str(command), "complete", f"{sample.name}:{CURSOR}", "--json", "--budget-ms", "60000"],
        cwd=elsewhere,
        env=_offline_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sample_fill and json.loads(done.stdout)["text"] == sample_fill
