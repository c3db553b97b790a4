"""docs/ARCHITECTURE.md's code map matches the folders: every package has its section, every module
is named in it, and every file it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
CODE_MAP = DOC.split("## Code map", 1)[1].split("\n## ", 1)[0]
PRODUCT = ("engine", "dlm_lsp", "kernels")


def _modules() -> list[Path]:
    return sorted(p.relative_to(ROOT) for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py")


def test_every_package_has_its_section():
    sections = set(re.findall(r"^### `([\w/]+)/`", CODE_MAP, re.M))
    packages = {str(p.parent.relative_to(ROOT)) for pkg in PRODUCT for p in (ROOT / pkg).rglob("__init__.py")}
    nested = {p for p in packages if p.count("/") > 1}  # e.g. dlm_lsp/measure/fuzz: described in its parent's section
    missing = sorted(packages - nested - sections - set(PRODUCT))
    assert not missing, f"no code-map section for {missing}"
    for p in nested:
        assert f"`{Path(p).name}/`" in CODE_MAP, p


def test_every_module_is_named_in_the_code_map():
    """In its folder's section, or (the commands' modules) in the entry points' table it refers to."""
    missing = [str(m) for m in _modules() if f"`{m.name}`" not in DOC and f"/{m.name}`" not in DOC]
    assert not missing, f"modules the code map does not name: {missing}"


def test_every_file_the_doc_names_exists():
    named = set(
        re.findall(r"`((?:engine|dlm_lsp|kernels|tests|scripts|docs|models|editors|examples)/[\w./-]+\.\w+)`", DOC)
    )
    assert named, "the doc names no file"
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, missing
