"""dlm-lsp: the language server (this package) over the diffusion engine (`engine`) and its kernels
(`kernels`), three top-level packages of one distribution.

`engine` and `kernels` are generic names: Hugging Face's `kernels` distribution installs the same
top-level name. Importing dlm_lsp first checks, without importing them, that the `engine` and
`kernels` Python would load are the ones installed beside this package, and otherwise stops with
a message naming the other one and the fix (an environment of its own: `pipx install` /
`uv tool install`), instead of failing later deep inside an import.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OURS = ("engine", "kernels")  # the distribution's other top-level packages


class ShadowedPackageError(ImportError):
    """Another distribution's `engine` or `kernels` comes first on sys.path."""


def check_siblings(root: Path | None = None) -> None:
    """Raises ShadowedPackageError when `engine` or `kernels` would load from anywhere but `root`
    (the folder holding dlm_lsp)."""
    root = (root or Path(__file__).resolve().parent.parent).resolve()
    for name in OURS:
        spec = importlib.util.find_spec(name)
        origin = None if spec is None else spec.origin or next(iter(spec.submodule_search_locations or []), None)
        if origin is None:
            raise ShadowedPackageError(f"dlm-lsp's `{name}` package is missing beside {root}; reinstall dlm-lsp")
        where = Path(origin).resolve()
        if where.parent.parent != root and where.parent != root:
            raise ShadowedPackageError(
                f"another package named `{name}` ({where}) comes before dlm-lsp's in this Python environment; "
                "install dlm-lsp in an environment of its own: `pipx install dlm-lsp` or `uv tool install dlm-lsp`"
            )


try:
    check_siblings()
except ShadowedPackageError as e:
    if Path(sys.argv[0]).name == "dlm-lsp":  # the command: one line, exit code 2, as its other errors
        print(f"dlm-lsp: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    raise
