"""Where the shipped files are: the embedded default model, its autoregressive twin and the example file.

In a checkout they lie at the repository's root (`models/`, `examples/`). An installed wheel carries
the same files as data files (pyproject.toml, `[tool.setuptools.data-files]`), which pip puts under
the environment's `share/dlm-lsp/` (a venv, a pipx or `uv tool` environment, or the user's base with
`--user`). The checkout wins where both exist, so an editable install reads the repository's files.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout (site-packages when installed from a wheel)
SHARE = Path("share") / "dlm-lsp"  # where the wheel's data files go, under an install scheme's data root


def _installed_roots() -> list[Path]:
    """The data roots pip may have put the wheel's data files under, most specific first."""
    roots = [Path(sysconfig.get_path("data"))]
    for scheme in ("posix_user", "nt_user", "osx_framework_user"):
        try:
            roots.append(Path(sysconfig.get_path("data", scheme)))
        except KeyError:
            continue
    return [r / SHARE for r in roots]


def data_root() -> Path:
    """The folder that holds `models/` and `examples/`: the checkout's root, else the installed copy
    (the first that has the default model; the environment's own when none does, so errors name it)."""
    candidates = [REPO_ROOT, *_installed_roots()]
    return next((r for r in candidates if (r / "models" / "default" / "config.json").is_file()), candidates[1])


DATA_ROOT = data_root()
DEFAULT_MODEL_DIR = DATA_ROOT / "models" / "default"
DEFAULT_AR_DIR = DATA_ROOT / "models" / "default-ar"
EXAMPLES_DIR = DATA_ROOT / "examples"
