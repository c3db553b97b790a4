"""Packs the training corpus into one compressed file for the GPU recipe (scripts/gpu_train.sh).

The device machine runs another Python (another stdlib), so it trains on a copy of this machine's
files. Members are stored under "<label>/<path>" ("stdlib/json/decoder.py"); unpacked and passed as
`--source <dir>/stdlib`, they get the same corpus keys ("stdlib:json/decoder.py") and so the same
train / held-out split. The held-out files travel too: the trainer's split rule keeps them out of
training and uses them for the validation loss only. MANIFEST.json lists both sides.

    python -m engine.train.pack [--out runs/corpus/train.tar.xz] [--source DIR ...] [--max-files N]

With --built runs/corpus (a folder of `dlm-lsp corpus`), the archive is itself a built corpus: its
corpus.json keeps the three sides (train, heldout, heldout_packages) as they were split here, and
every file lies under files/<label>/<path>; this interpreter's stdlib files are stored as label
"stdlib-here" (the other side's stdlib is another version). Unpacked, it is trained with `--corpus`.

    python -m engine.train.pack --built runs/corpus --out runs/gpu_pack/corpus.tar.xz --limit-mb 48
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

from engine.train import corpus

LIMIT_MB = 40  # what travels to the device machine must stay small


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    """A tar member with fixed metadata, so the same files always give the same archive."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0o644, 0, 0, "", ""
    return info, io.BytesIO(data)


def _text_bytes(path: Path) -> bytes | None:
    """The file's bytes if it is UTF-8 text, else None."""
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return data


def _keep(tmp: Path, out: Path, limit_mb: float) -> float:
    """Moves the written archive into place, refusing one over the limit; returns its MiB."""
    size_mb = tmp.stat().st_size / 2**20
    if size_mb > limit_mb:
        tmp.unlink()
        raise SystemExit(f"packed corpus is {size_mb:.1f} MiB, over the {limit_mb:g} MiB limit; use --max-files")
    tmp.replace(out)
    return round(size_mb, 2)


def pack(
    out: Path,
    sources: list[Path],
    max_files: int | None = None,
    include_stdlib: bool = True,
    limit_mb: float = LIMIT_MB,
) -> dict:
    """Writes the archive and returns its manifest."""
    files = corpus.collect(sources, include_stdlib=include_stdlib)
    train, held = corpus.split(files)
    if max_files:  # the same cut as `dlm-lsp train --max-files`
        train, held = train[:max_files], held[: max(2, max_files // 10)]
    manifest: dict[str, Any] = {  # written as MANIFEST.json
        "heldout_rule": f"sha256(key)[:8] % 100 < {corpus.HELDOUT_PERCENT}",
        "python": sys.version.split()[0],
        "train": [],
        "heldout": [],
        "bytes": 0,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        for side, group in (("train", train), ("heldout", held)):
            for f in group:
                data = _text_bytes(f.path)
                if data is None:
                    continue  # the trainer skips these too
                label, rel = f.key.split(":", 1)
                tar.addfile(*_member(f"{label}/{rel}", data))
                manifest[side].append({"key": f.key, "sha256": hashlib.sha256(data).hexdigest()[:16]})
                manifest["bytes"] += len(data)
        tar.addfile(*_member("MANIFEST.json", (json.dumps(manifest, indent=1) + "\n").encode()))
    manifest["archive_mib"] = _keep(tmp, out, limit_mb)
    return manifest


HERE = "stdlib-here"  # the label this interpreter's stdlib files take in a packed built corpus


def pack_built(out: Path, folder: Path, max_files: int | None = None, limit_mb: float = LIMIT_MB) -> dict:
    """Writes a built corpus (`dlm-lsp corpus`) as an archive that is a built corpus too."""
    sides = corpus.built_files(folder)
    if max_files:
        sides = {k: v[: max_files if k == "train" else max(2, max_files // 10)] for k, v in sides.items()}
    summary = {
        k: v
        for k, v in json.loads((folder / "corpus.json").read_text()).items()
        if k not in ("train", "heldout", "heldout_packages")
    }
    summary["packed_from"] = str(folder)
    manifest: dict[str, float] = {"bytes": 0}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        for side, group in sides.items():
            keys = []
            for f in group:
                data = _text_bytes(f.path)
                if data is None:
                    continue  # the trainer skips these too
                label, rel = f.key.split(":", 1)
                label = HERE if label == "stdlib" else label
                tar.addfile(*_member(f"files/{label}/{rel}", data))
                keys.append(f"{label}:{rel}")
                manifest["bytes"] += len(data)
            summary[side] = keys
            manifest[side] = len(keys)
        tar.addfile(*_member("corpus.json", (json.dumps(summary, indent=1) + "\n").encode()))
    manifest["archive_mib"] = _keep(tmp, out, limit_mb)
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.train.pack", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/corpus/train.tar.xz", help="archive to write (.tar.xz)")
    p.add_argument("--source", action="append", default=[], help="extra folder of .py files (repeatable)")
    p.add_argument("--no-stdlib", dest="stdlib", action="store_false", help="leave the stdlib out")
    p.add_argument("--max-files", type=int, default=None, help="only the first N training files (smoke runs)")
    p.add_argument("--limit-mb", type=float, default=LIMIT_MB)
    p.add_argument("--built", default=None, help="pack this built corpus (`dlm-lsp corpus --out`) as a built corpus")
    a = p.parse_args(argv)
    if a.built:
        m = pack_built(Path(a.out), Path(a.built), a.max_files, a.limit_mb)
        print(
            f"{a.out}: {m['train']} train + {m['heldout']} held-out + {m['heldout_packages']} held-out-package "
            f"files, {m['bytes'] / 1e6:.1f} MB of source -> {m['archive_mib']:.1f} MiB"
        )
        return 0
    m = pack(Path(a.out), [Path(s) for s in a.source], a.max_files, a.stdlib, a.limit_mb)
    print(
        f"{a.out}: {len(m['train'])} train + {len(m['heldout'])} held-out files, "
        f"{m['bytes'] / 1e6:.1f} MB of source -> {m['archive_mib']:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
