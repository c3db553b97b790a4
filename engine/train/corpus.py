"""The training corpus: Python files (the interpreter's standard library plus any folders given), a
deterministic file-level train / held-out split, and the split's manifest."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 5  # share of files kept out of training for `dlm-lsp eval`


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class SourceFile:
    key: str  # stable name: "stdlib:json/decoder.py" or "<folder name>:<relative path>"
    path: Path

    def read(self) -> str | None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            return None
        return text if text.strip() else None


def collect(sources: list[Path] | None = None, include_stdlib: bool = True) -> list[SourceFile]:
    """Returns every .py file of the stdlib (minus site-packages) and of `sources`, sorted by key."""
    roots: list[tuple[str, Path]] = []
    if include_stdlib:
        roots.append(("stdlib", stdlib_dir()))
    for s in sources or []:
        roots.append((Path(s).resolve().name, Path(s).resolve()))
    files = []
    for label, root in roots:
        for f in root.rglob("*.py"):
            rel = f.relative_to(root)
            if "site-packages" in rel.parts or "__pycache__" in rel.parts:
                continue
            files.append(SourceFile(f"{label}:{rel.as_posix()}", f))
    return sorted(files, key=lambda s: s.key)


def is_heldout(key: str) -> bool:
    """Deterministic split by a hash of the file's key, stable across machines and Python versions."""
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return h % 100 < HELDOUT_PERCENT


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_heldout(f.key)]
    held = [f for f in files if is_heldout(f.key)]
    return train, held


def write_manifest(path: Path, train: list[SourceFile], held: list[SourceFile]) -> None:
    path.write_text(
        json.dumps(
            {
                "heldout_rule": f"sha256(key)[:8] % 100 < {HELDOUT_PERCENT}",
                "train": [f.key for f in train],
                "heldout": [f.key for f in held],
            },
            indent=1,
        )
        + "\n"
    )


def heldout_files(sources: list[Path] | None = None) -> list[SourceFile]:
    """The held-out files the eval harness uses (same rule as training)."""
    return split(collect(sources))[1]


def built_files(folder: Path | str) -> dict[str, list[SourceFile]]:
    """The sides of a corpus built by `dlm-lsp corpus` ("train", "heldout", "heldout_packages"):
    stdlib keys name this interpreter's files, package keys the files written under folder/files/."""
    folder = Path(folder)
    meta = folder / "corpus.json"
    if not meta.exists():
        raise FileNotFoundError(f"{meta} not found: build it with `dlm-lsp corpus --out {folder}`")
    summary = json.loads(meta.read_text())
    root = stdlib_dir()
    out = {}
    for side in ("train", "heldout", "heldout_packages"):
        files = []
        for key in summary.get(side, []):
            label, rel = key.split(":", 1)
            files.append(SourceFile(key, root / rel if label == "stdlib" else folder / "files" / label / rel))
        out[side] = files
    return out
