"""`dlm-lsp corpus`: the training corpus, rebuilt reproducibly from the stdlib plus a pinned manifest of
permissively licensed packages fetched with pip (wheels, `--no-deps`), never from a hub.

    manifest (engine/train/data/corpus_manifest.txt)      one `name==version` a line; `heldout` after it
        |  pip download --no-deps (cached in OUT/wheels)   keeps the whole package out of training
        v
    licence from the wheel's METADATA (License-Expression, else License / classifiers): permissive only
        v
    filters, in order: files over 200 kB; generated files ("generated" / "do not edit" in the first
    300 bytes); vendored trees (_vendor, vendored, vendor, third_party, externals); exact duplicates;
    near duplicates of a kept file (>= 80% of its long lines already seen); files sharing >= 30% of
    their long lines with any held-out file; one package capped at 5% of the training bytes
        v
    OUT/files/<package>/<path inside the wheel>   and   OUT/corpus.json (every key, its side, counts)

The held-out side is the stdlib's and the packages' files whose key hash falls in the 5% rule
(`engine.train.corpus.is_heldout`, as before), plus every file of the held-out packages: `dlm-lsp eval
--corpus OUT --heldout packages` measures code from projects the model never saw. Long lines are
stripped lines of >= 30 characters; lines found in more than 20 files (licence headers, boilerplate)
do not count as shared.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.train import corpus

MANIFEST = Path(__file__).resolve().parent / "data" / "corpus_manifest.txt"
MAX_FILE_BYTES = 200_000
PACKAGE_CAP = 0.05  # share of the training bytes one package may hold
NEAR_HELDOUT = 0.30  # a training file sharing this share of its long lines with a held-out file goes
NEAR_DUP = 0.80  # a file whose long lines were this much seen already in kept files goes
LONG_LINE = 30
BOILERPLATE_FILES = 20
VENDORED = {"_vendor", "vendored", "vendor", "third_party", "externals", "_vendored"}
GENERATED = re.compile(rb"generated|do not edit", re.IGNORECASE)

# SPDX ids (lower case) and licence classifiers that allow training and redistribution of derived
# weights without copyleft terms
PERMISSIVE_SPDX = {
    "mit",
    "mit-0",
    "bsd-2-clause",
    "bsd-3-clause",
    "bsd-3-clause-clear",
    "0bsd",
    "apache-2.0",
    "isc",
    "psf-2.0",
    "python-2.0",
    "unlicense",
    "zpl-2.1",
    "hpnd",
    "cc0-1.0",
    "bsd",
    "apache 2.0",
    "apache",
    "zlib",
    "mit-cmu",
}
PERMISSIVE_CLASSIFIERS = {
    "MIT License",
    "BSD License",
    "Apache Software License",
    "Python Software Foundation License",
    "ISC License (ISCL)",
    "The Unlicense (Unlicense)",
    "Zope Public License",
    "MIT No Attribution License (MIT-0)",
    "Historical Permission Notice and Disclaimer (HPND)",
    "CC0 1.0 Universal (CC0 1.0) Public Domain Dedication",
}
COPYLEFT = re.compile(r"\b(A?GPL|LGPL|MPL|EPL|EUPL|CDDL|OSL|CC[- ]BY[- ]NC|copyleft|Mozilla|General Public)", re.I)


class CorpusError(Exception):
    """A manifest line, a download or a licence that stops the build; the message says which."""


@dataclass
class Pin:
    name: str
    version: str
    heldout: bool = False


@dataclass
class PackageInfo:
    name: str
    version: str
    license: str
    wheel: str
    sha256: str
    heldout: bool
    files: int = 0
    bytes: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


def read_manifest(path: Path = MANIFEST) -> list[Pin]:
    """The pinned packages: `name==version [heldout]` per line, `#` comments."""
    pins, seen = [], set()
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", parts[0])
        if not m or parts[1:] not in ([], ["heldout"]):
            raise CorpusError(f"{path}:{n}: expected `name==version` or `name==version heldout`, got {raw!r}")
        key = _norm(m.group(1))
        if key in seen:
            raise CorpusError(f"{path}:{n}: {m.group(1)} is listed twice")
        seen.add(key)
        pins.append(Pin(m.group(1), m.group(2), heldout=bool(parts[1:])))
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def licence_of(metadata: bytes) -> tuple[str, bool]:
    """(licence text as found, permissive?) from a wheel's METADATA."""
    m = email.parser.BytesParser().parsebytes(metadata, headersonly=True)
    expr = str(m.get("License-Expression") or "").strip()
    classifiers = [
        str(c).split("::")[-1].strip() for c in (m.get_all("Classifier") or []) if str(c).startswith("License ::")
    ]
    if expr:
        return expr, _spdx_permissive(expr)
    text = str(m.get("License") or "").strip()
    first = text.splitlines()[0][:80] if text else ""
    found = "; ".join(filter(None, [first, *classifiers])) or "none"
    if COPYLEFT.search(text[:2000]) or any(COPYLEFT.search(c) for c in classifiers):
        return found, False
    if any(c in PERMISSIVE_CLASSIFIERS for c in classifiers):
        return found, True
    short = first.lower().removesuffix(" license").strip()
    return found, bool(short) and (short in PERMISSIVE_SPDX or _spdx_permissive(first))


def _spdx_permissive(expr: str) -> bool:
    """AND needs every side permissive, OR any side (parentheses are flattened: enough for wheels)."""
    e = expr.replace("(", " ").replace(")", " ")
    return any(
        all(t.strip().lower() in PERMISSIVE_SPDX for t in re.split(r"\s+AND\s+", alt))
        for alt in re.split(r"\s+OR\s+", e)
    )


def fetch(pin: Pin, cache: Path) -> Path:
    """The pinned wheel in `cache`, downloaded with pip when missing (no dependencies)."""
    cache.mkdir(parents=True, exist_ok=True)
    have = _wheel_in(cache, pin)
    if have:
        return have
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "-q",
        "-d",
        str(cache),
        f"{pin.name}=={pin.version}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    have = _wheel_in(cache, pin)
    if r.returncode != 0 or not have:
        tail = "\n".join(l for l in r.stderr.splitlines() if "is ignored" not in l)[-400:]
        raise CorpusError(f"pip could not download {pin.name}=={pin.version}: {tail or 'no wheel'}")
    return have


def _wheel_in(cache: Path, pin: Pin) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", pin.name).lower()
    for w in sorted(cache.glob("*.whl")):
        parts = w.name.split("-")
        if len(parts) >= 2 and parts[0].lower() == stem and parts[1] == pin.version:
            return w
    return None


def _long_lines(text: str) -> set[int]:
    out = set()
    for ln in text.splitlines():
        s = ln.strip()
        if len(s) >= LONG_LINE:
            out.add(
                int.from_bytes(hashlib.blake2b(s.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
            )
    return out


def _drop_reason(rel: str, data: bytes) -> str | None:
    parts = rel.split("/")
    if VENDORED & set(parts[:-1]):
        return "vendored"
    if len(data) > MAX_FILE_BYTES:
        return "over_200kB"
    if GENERATED.search(data[:300]):
        return "generated"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not_utf8"
    if not text.strip():
        return "empty"
    return None


def build(
    out: Path,
    manifest: Path = MANIFEST,
    include_stdlib: bool = True,
    wheels: Path | None = None,
    pins: list[Pin] | None = None,
    stdlib_root: Path | None = None,
    log: Callable[[str], object] = print,
    extra_manifest: Path | None = None,
) -> dict:
    """Builds the corpus into `out` and returns its summary (also written to out/corpus.json).
    `extra_manifest`: more pinned packages after the manifest's (engine/train/data/ngram_extra_manifest.txt:
    the n-gram table's corpus, whose held-out side holds every held-out file of the manifest's alone)."""
    pins = pins if pins is not None else read_manifest(manifest)
    if extra_manifest is not None:
        extra = read_manifest(extra_manifest)
        twice = {_norm(p.name) for p in pins} & {_norm(p.name) for p in extra}
        if twice:
            raise CorpusError(f"{extra_manifest}: {', '.join(sorted(twice))} already in {manifest}")
        pins = pins + extra
    wheels = wheels or out / "wheels"
    files_dir = out / "files"
    # (key, side hint, text, package); the stdlib's files come first so a package's copy of a stdlib
    # module is the duplicate that goes
    items: list[tuple[str, bool, str, str]] = []
    dropped: Counter = Counter()
    packages: list[PackageInfo] = []
    if include_stdlib:
        for f in corpus.collect(include_stdlib=True) if stdlib_root is None else _collect_dir("stdlib", stdlib_root):
            try:
                data = f.path.read_bytes()
            except OSError:
                continue
            why = _drop_reason(f.key.split(":", 1)[1], data)
            if why:
                dropped[why] += 1
                continue
            items.append((f.key, corpus.is_heldout(f.key), data.decode("utf-8"), "stdlib"))
    for pin in pins:
        whl = fetch(pin, wheels)
        with zipfile.ZipFile(whl) as z:
            metas = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
            if not metas:
                raise CorpusError(f"{whl.name} has no METADATA")
            lic, ok = licence_of(z.read(metas[0]))
            if not ok:
                raise CorpusError(
                    f"{pin.name}=={pin.version}: licence {lic!r} is not on the permissive list; "
                    "remove it from the manifest"
                )
            info = PackageInfo(
                pin.name, pin.version, lic, whl.name, hashlib.sha256(whl.read_bytes()).hexdigest(), pin.heldout
            )
            label = _norm(pin.name)
            for zi in sorted(z.infolist(), key=lambda i: i.filename):
                rel = zi.filename
                if not rel.endswith(".py") or ".dist-info/" in rel:
                    continue
                data = z.read(zi)
                why = _drop_reason(rel, data)
                if why:
                    info.dropped[why] = info.dropped.get(why, 0) + 1
                    dropped[why] += 1
                    continue
                key = f"{label}:{rel}"
                items.append((key, pin.heldout or corpus.is_heldout(key), data.decode("utf-8"), label))
        packages.append(info)
        log(f"  {pin.name}=={pin.version} ({lic})")

    # exact duplicates: the first by order (stdlib, then manifest order) stays
    seen_sha: set[str] = set()
    uniq = []
    for it in items:
        sha = hashlib.sha256(it[2].encode("utf-8", "surrogatepass")).hexdigest()
        if sha in seen_sha:
            dropped["exact_duplicate"] += 1
            continue
        seen_sha.add(sha)
        uniq.append(it)
    lines = [_long_lines(it[2]) for it in uniq]
    freq: Counter = Counter()
    for ls in lines:
        freq.update(ls)
    common = {h for h, c in freq.items() if c > BOILERPLATE_FILES}
    lines = [ls - common for ls in lines]

    held_idx = [i for i, it in enumerate(uniq) if it[1]]
    by_line: dict[int, list[int]] = defaultdict(list)
    for i in held_idx:
        for h in lines[i]:
            by_line[h].append(i)
    kept_lines: set[int] = set()
    train_idx = []
    for i, it in enumerate(uniq):
        if it[1]:
            continue
        ls = lines[i]
        if ls:
            shared = Counter(j for h in ls for j in by_line.get(h, ()))
            if shared and max(shared.values()) >= NEAR_HELDOUT * len(ls):
                dropped["near_heldout"] += 1
                continue
            if len(ls) >= 5 and len(ls & kept_lines) >= NEAR_DUP * len(ls):
                dropped["near_duplicate"] += 1
                continue
            kept_lines |= ls
        train_idx.append(i)

    # package cap: files beyond a package's share go, in key-hash order (stable, not alphabetical)
    total = sum(len(uniq[i][2]) for i in train_idx)
    per_pkg: dict[str, list[int]] = defaultdict(list)
    for i in train_idx:
        per_pkg[uniq[i][3]].append(i)
    cap = PACKAGE_CAP * total
    keep = set(train_idx)
    for pkg, idx in per_pkg.items():
        size = sum(len(uniq[i][2]) for i in idx)
        if pkg == "stdlib" or size <= cap:
            continue
        for i in sorted(idx, key=lambda i: hashlib.sha256(uniq[i][0].encode()).hexdigest()):
            if size <= cap:
                break
            keep.discard(i)
            size -= len(uniq[i][2])
            dropped["package_cap"] += 1

    # write the kept files; the stdlib is read in place (its keys name the interpreter's own files)
    if files_dir.exists():
        import shutil

        shutil.rmtree(files_dir)
    train_keys: list[str] = []
    held_keys: list[str] = []
    held_pkg_keys: list[str] = []
    heldout_pkgs = {_norm(p.name) for p in pins if p.heldout}
    count: Counter[tuple[str, str]] = Counter()
    nbytes: Counter[tuple[str, str]] = Counter()
    for i, (key, held, text, pkg) in enumerate(uniq):
        if not held and i not in keep:
            continue
        if pkg != "stdlib":
            dest = files_dir / pkg / key.split(":", 1)[1]
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text, encoding="utf-8", errors="surrogatepass")
        side = "heldout_packages" if pkg in heldout_pkgs else ("heldout" if held else "train")
        (held_pkg_keys if side == "heldout_packages" else held_keys if held else train_keys).append(key)
        count[(pkg, side)] += 1
        nbytes[(pkg, side)] += len(text.encode("utf-8", "surrogatepass"))
    for p in packages:
        label = _norm(p.name)
        side = "heldout_packages" if p.heldout else "train"
        p.files, p.bytes = count[(label, side)], nbytes[(label, side)]
    summary = {
        "manifest": str(manifest),
        "manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.exists() else None,
        **(
            {
                "extra_manifest": str(extra_manifest),
                "extra_manifest_sha256": hashlib.sha256(extra_manifest.read_bytes()).hexdigest(),
            }
            if extra_manifest is not None
            else {}
        ),
        "python": sys.version.split()[0],
        "stdlib": include_stdlib,
        "rules": {
            "heldout": f"sha256(key)[:8] % 100 < {corpus.HELDOUT_PERCENT}, plus every file of a heldout package",
            "max_file_bytes": MAX_FILE_BYTES,
            "package_cap": PACKAGE_CAP,
            "near_heldout": NEAR_HELDOUT,
            "near_duplicate": NEAR_DUP,
            "long_line_chars": LONG_LINE,
            "boilerplate_files": BOILERPLATE_FILES,
            "vendored": sorted(VENDORED),
        },
        "bytes": {
            "train": sum(v for (_, s), v in nbytes.items() if s == "train"),
            "heldout": sum(v for (_, s), v in nbytes.items() if s == "heldout"),
            "heldout_packages": sum(v for (_, s), v in nbytes.items() if s == "heldout_packages"),
        },
        "dropped": dict(sorted(dropped.items())),
        "packages": [p.__dict__ for p in packages],
        "train": train_keys,
        "heldout": held_keys,
        "heldout_packages": held_pkg_keys,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _collect_dir(label: str, root: Path) -> list[corpus.SourceFile]:
    files = [
        corpus.SourceFile(f"{label}:{f.relative_to(root).as_posix()}", f)
        for f in root.rglob("*.py")
        if "__pycache__" not in f.parts and "site-packages" not in f.relative_to(root).parts
    ]
    return sorted(files, key=lambda s: s.key)
