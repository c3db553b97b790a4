"""`dlm-lsp corpus --edits OUT`: next-edit cases from real edits, the line diffs between consecutive
releases of the corpus manifest's packages (both wheels fetched with pip, licences checked as the
corpus does, the held-out packages written apart).

    pinned release and the one before it (`pip index versions`; --edit-pairs walks further back)
        v
    each .py file present in both wheels (the corpus's file filters on both sides), its line diff
    (difflib) cut into hunks top to bottom; a hunk changing more than MAX_HUNK_LINES lines is dropped
        v
    a CASE per hunk i with a hunk right before it: the <= HISTORY hunks before i are replayed as the
    user's edits on the old file, the cursor sits at the end of the last one, and the truth is hunk i
    when it starts within REACH unchanged lines of the cursor (else no case); a NOISE case after a
    hunk with nothing following within reach: the truth is no change
        v
    OUT/<side>.jsonl (one case a line), the old files once under OUT/files/<side>/, OUT/edits.json

A case, applied with `apply_edits`: `document(case) = apply_edits(old file, case["edits"])`, the
cursor is a character offset into it, and the file after the truth is `apply_edits(document,
[case["truth"]])` (`truth` is null for noise). Every edit is `[offset, old, new]`, the offset taken
in the text as it is at that moment, trimmed to the characters that change (as a user types them).
Sides, as in `dlm-lsp corpus`: "heldout_packages" (every file of a held-out package), "heldout" (a
training package's file whose key falls in `corpus.is_heldout`) and "train".
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from engine.train import corpus
from engine.train.corpus_build import MANIFEST, CorpusError, Pin, _drop_reason, _norm, fetch, licence_of, read_manifest

MAX_HUNK_LINES = 15  # a hunk rewriting more lines than this is a refactor, not a next edit
HISTORY = 3  # hunks replayed as the user's recent edits
REACH = 12  # unchanged lines between the cursor and the truth's first line, at most
PER_FILE = 6  # cases (not noise) one file gives at most
PER_FILE_NOISE = 2
PER_PACKAGE = 120  # cases (not noise) one package gives at most, all its release pairs together
PER_PACKAGE_NOISE = 40
SIDES = ("heldout_packages", "heldout", "train")

Edit = tuple[int, str, str]  # (offset in the text at that moment, old text, new text)
_TOKEN = re.compile(r"\w+|[^\w\s]")
_IDENT = re.compile(r"[A-Za-z_]\w*")
T = TypeVar("T")


@dataclass(frozen=True)
class Hunk:
    """One changed region of a line diff: old lines [a, b) become `new` (whole lines, newlines kept)."""

    a: int
    b: int
    old: str
    new: str

    @property
    def lines(self) -> int:
        """Lines it rewrites: the larger of the removed and the added count."""
        added = self.new.count("\n") + (1 if self.new and not self.new.endswith("\n") else 0)
        return max(self.b - self.a, added)


def hunks(old: str, new: str) -> list[Hunk]:
    """Every changed region of the line diff of old -> new, top to bottom (big ones too)."""
    ol, nl = old.splitlines(keepends=True), new.splitlines(keepends=True)
    sm = difflib.SequenceMatcher(None, ol, nl, autojunk=False)
    # consecutive opcodes never both change: a gap between two matching blocks is one opcode
    return [
        Hunk(i1, i2, "".join(ol[i1:i2]), "".join(nl[j1:j2]))
        for tag, i1, i2, j1, j2 in sm.get_opcodes()
        if tag != "equal"
    ]


def apply_edits(text: str, edits: Iterable[Edit | list]) -> str:
    """The text after each edit in order; raises ValueError when an edit's old text is not where it says."""
    for off, old, new in edits:
        if text[off : off + len(old)] != old:
            raise ValueError(f"edit at {off} expects {old[:40]!r}, finds {text[off : off + len(old)][:40]!r}")
        text = text[:off] + new + text[off + len(old) :]
    return text


def trimmed(off: int, old: str, new: str) -> Edit:
    """The same edit without the characters old and new share at either end."""
    p = 0
    while p < min(len(old), len(new)) and old[p] == new[p]:
        p += 1
    s = 0
    while s < min(len(old), len(new)) - p and old[-1 - s] == new[-1 - s]:
        s += 1
    return off + p, old[p : len(old) - s], new[p : len(new) - s]


def substitutions(old: str, new: str) -> set[tuple[str, str]]:
    """Token substitutions of a word-level diff: identifier pairs of same-length replacements, else the
    replaced spans when both sides hold an identifier (`self.x` -> `self._x` gives ("x", "_x"))."""
    a, b = _TOKEN.findall(old), _TOKEN.findall(new)
    out = set()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "replace":
            continue
        if i2 - i1 == j2 - j1:
            out |= {
                (x, y) for x, y in zip(a[i1:i2], b[j1:j2]) if x != y and _IDENT.fullmatch(x) and _IDENT.fullmatch(y)
            }
        elif any(map(_IDENT.fullmatch, a[i1:i2])) and any(map(_IDENT.fullmatch, b[j1:j2])):
            out.add((" ".join(a[i1:i2]), " ".join(b[j1:j2])))
    return out


@dataclass
class FileCase:
    """One case of one file, before it is named: `after` is the index of the last replayed hunk."""

    after: int
    edits: list[Edit]
    cursor: int
    truth: Edit | None
    category: str  # "repeat", "other" or "noise"

    @property
    def tag(self) -> str:
        return f"noise{self.after}" if self.truth is None else f"hunk{self.after + 1}"


def file_cases(old: str, new: str) -> list[FileCase]:
    """Every case of one file pair, top to bottom (not capped)."""
    hs = hunks(old, new)
    starts = [0]
    for ln in old.splitlines(keepends=True):
        starts.append(starts[-1] + len(ln))
    out = []
    for j, h in enumerate(hs):
        if h.lines > MAX_HUNK_LINES:
            continue
        # the replay: h and up to HISTORY - 1 small hunks right before it (a big one ends the run)
        first = j
        while first > j - HISTORY + 1 and first > 0 and hs[first - 1].lines <= MAX_HUNK_LINES:
            first -= 1
        edits, shift = [], 0
        for r in hs[first : j + 1]:
            edits.append(trimmed(starts[r.a] + shift, r.old, r.new))
            shift += len(r.new) - len(r.old)
        cursor = edits[-1][0] + len(edits[-1][2])
        nxt = hs[j + 1] if j + 1 < len(hs) else None
        if nxt is None or nxt.a - h.b > REACH:
            out.append(FileCase(j, edits, cursor, None, "noise"))
        elif nxt.lines <= MAX_HUNK_LINES:
            # the truth is judged against the replayed hunks only: the user's last HISTORY edits
            replayed = set().union(*(substitutions(r.old, r.new) for r in hs[first : j + 1]))
            cat = "repeat" if substitutions(nxt.old, nxt.new) & replayed else "other"
            out.append(FileCase(j, edits, cursor, trimmed(starts[nxt.a] + shift, nxt.old, nxt.new), cat))
    return out


def _by_hash(items: list[tuple[str, bool, T]]) -> list[tuple[str, bool, T]]:
    """(key, noise?, item) triples in the order of a hash of their key: a stable pick, not the first ones."""
    return sorted(items, key=lambda it: hashlib.sha256(it[0].encode()).hexdigest())


def _cap(items: list[tuple[str, bool, T]], per: int, per_noise: int) -> list[T]:
    """At most `per` items that are not noise and `per_noise` that are, picked in hash order."""
    real = _by_hash([it for it in items if not it[1]])[:per]
    noise = _by_hash([it for it in items if it[1]])[:per_noise]
    return [it[2] for it in real + noise]


# ---------------------------------------------------------------------- releases


def read_wheel(path: Path) -> tuple[dict[str, bytes], bytes]:
    """(.py files by path inside the wheel, METADATA) of a wheel."""
    with zipfile.ZipFile(path) as z:
        names = sorted(z.namelist())
        metas = [n for n in names if n.endswith(".dist-info/METADATA")]
        if not metas:
            raise CorpusError(f"{path.name} has no METADATA")
        files = {n: z.read(n) for n in names if n.endswith(".py") and ".dist-info/" not in n}
        return files, z.read(metas[0])


def read_folder(root: Path) -> dict[str, bytes]:
    """.py files by path under `root` (a release unpacked in a folder)."""
    return {
        f.relative_to(root).as_posix(): f.read_bytes()
        for f in sorted(root.rglob("*.py"))
        if "__pycache__" not in f.parts
    }


def pair_files(old: dict[str, bytes], new: dict[str, bytes]) -> list[tuple[str, str, str]]:
    """(path, old text, new text) of each file in both releases that changed and passes the corpus's
    file filters on both sides, sorted by path."""
    out = []
    for rel in sorted(old.keys() & new.keys()):
        if old[rel] == new[rel] or _drop_reason(rel, old[rel]) or _drop_reason(rel, new[rel]):
            continue
        out.append((rel, old[rel].decode("utf-8"), new[rel].decode("utf-8")))
    return out


def release_cases(label: str, old_v: str, new_v: str, files: list[tuple[str, str, str]], heldout: bool) -> list[dict]:
    """The capped cases of one release pair, as JSON-ready dicts (the old text under "_old", not written)."""
    out = []
    for rel, old, new in files:
        side = "heldout_packages" if heldout else "heldout" if corpus.is_heldout(f"{label}:{rel}") else "train"
        fcs = file_cases(old, new)
        fid = f"{label}@{old_v}..{new_v}:{rel}"
        for c in _cap([(f"{fid}#{c.tag}", c.truth is None, c) for c in fcs], PER_FILE, PER_FILE_NOISE):
            out.append(
                {
                    "id": f"{fid}#{c.tag}",
                    "side": side,
                    "package": label,
                    "versions": [old_v, new_v],
                    "path": rel,
                    "file": f"files/{side}/{label}/{old_v}/{rel}",
                    "old_sha256": hashlib.sha256(old.encode("utf-8", "surrogatepass")).hexdigest(),
                    "edits": [list(e) for e in c.edits],
                    "cursor": c.cursor,
                    "truth": list(c.truth) if c.truth else None,
                    "category": c.category,
                    "_order": (rel, c.after, c.truth is None),
                    "_old": old,
                }
            )
    return out


def previous_versions(name: str, version: str, k: int) -> list[str]:
    """Up to k releases before `version`, newest first, from `pip index versions` (its list is newest
    first and holds final releases only)."""
    r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True)
    m = re.search(r"Available versions:\s*(.+)", r.stdout)
    if r.returncode != 0 or not m:
        raise CorpusError(f"pip could not list the releases of {name}: {r.stderr.strip()[-300:] or 'no versions'}")
    listed = [v.strip() for v in m.group(1).split(",")]
    if version not in listed:
        raise CorpusError(f"{name}=={version} is not among the releases pip lists")
    return listed[listed.index(version) + 1 :][:k]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_edits(
    out: Path,
    pins: list[Pin],
    pairs_per_package: int = 1,
    held_out_only: bool = False,
    max_cases: int | None = None,
    wheels: Path | None = None,
    versions: Callable[[str, str, int], list[str]] = previous_versions,
    log: Callable[[str], object] = print,
) -> dict:
    """Builds the edit cases into `out` and returns the summary written to out/edits.json. A package
    whose releases cannot be listed or fetched, or whose licence is not permissive, is skipped with
    its reason; the release chain of a package already in out/edits.json is reused (pinned)."""
    wheels = wheels or out / "wheels"
    prior: dict[tuple[str, str], list[str]] = {}
    if (out / "edits.json").exists():
        for p in json.loads((out / "edits.json").read_text()).get("pairs", []):
            prior.setdefault((p["package"], p["chain_from"]), []).append(p["old"])
    pairs: list[dict] = []
    skipped: list[dict] = []
    by_side: dict[str, list[dict]] = {s: [] for s in SIDES}
    for pin in sorted(pins, key=lambda p: _norm(p.name)):
        if held_out_only and not pin.heldout:
            continue
        label = _norm(pin.name)
        try:
            chain = prior.get((label, pin.version), [])
            if len(chain) < pairs_per_package:
                chain = versions(pin.name, pin.version, pairs_per_package)
            chain = chain[:pairs_per_package]
            if not chain:
                raise CorpusError(f"{pin.name} has no release before {pin.version}")
            releases = [pin.version, *chain]
            got = {}
            for v in releases:
                whl = fetch(Pin(pin.name, v), wheels)
                files, meta = read_wheel(whl)
                lic, ok = licence_of(meta)
                if not ok:
                    raise CorpusError(f"{pin.name}=={v}: licence {lic!r} is not on the permissive list")
                got[v] = (whl, files, lic)
        except CorpusError as e:
            skipped.append({"package": label, "version": pin.version, "reason": str(e)})
            log(f"  skipped {pin.name}: {e}")
            continue
        pkg_cases = []
        for new_v, old_v in zip(releases, releases[1:]):
            changed = pair_files(got[old_v][1], got[new_v][1])
            cs = release_cases(label, old_v, new_v, changed, pin.heldout)
            for c in cs:
                c["_order"] = (len(pairs), *c["_order"])  # pairs in order, the newest of a package first
            pkg_cases += cs
            pairs.append(
                {
                    "package": label,
                    "heldout": pin.heldout,
                    "chain_from": pin.version,
                    "old": old_v,
                    "new": new_v,
                    "licence": [got[old_v][2], got[new_v][2]],
                    "wheels": [got[old_v][0].name, got[new_v][0].name],
                    "sha256": [_sha(got[old_v][0]), _sha(got[new_v][0])],
                    "changed_files": len(changed),
                }
            )
        pkg_cases = _cap([(c["id"], c["truth"] is None, c) for c in pkg_cases], PER_PACKAGE, PER_PACKAGE_NOISE)
        for c in pkg_cases:
            by_side[c["side"]].append(c)
        log(f"  {pin.name} {' <- '.join(releases)}: {len(pkg_cases)} cases")
    if max_cases is not None:
        by_side = {s: _round_robin(cs, max_cases) for s, cs in by_side.items()}
    counts = _write(out, by_side)
    summary = {
        "rules": {
            "max_hunk_lines": MAX_HUNK_LINES,
            "history": HISTORY,
            "reach_lines": REACH,
            "per_file": [PER_FILE, PER_FILE_NOISE],
            "per_package": [PER_PACKAGE, PER_PACKAGE_NOISE],
            "max_cases_a_side": max_cases,
            "heldout": "every file of a heldout package; else corpus.is_heldout(key)",
        },
        "pairs": pairs,
        "skipped": skipped,
        "counts": counts,
    }
    (out / "edits.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _round_robin(cases: list[dict], n: int) -> list[dict]:
    """At most n cases, taken a package at a time in turn (each package's in hash order)."""
    per: dict[str, list[dict]] = {}
    for c in cases:
        per.setdefault(c["package"], []).append(c)
    queues = [[c for _, _, c in _by_hash([(c["id"], False, c) for c in per[p]])] for p in sorted(per)]
    out: list[dict] = []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def _write(out: Path, by_side: dict[str, list[dict]]) -> dict:
    """Writes each side's cases and their old files; returns counts per side, package and category."""
    out.mkdir(parents=True, exist_ok=True)
    counts: dict = {}
    for side, cases in by_side.items():
        cases = sorted(cases, key=lambda c: (c["package"], c["_order"]))
        with open(out / f"{side}.jsonl", "w", encoding="utf-8") as f:
            for c in cases:
                dest = out / c["file"]
                if not dest.exists():
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_text(c["_old"], encoding="utf-8", errors="surrogatepass")
                f.write(json.dumps({k: v for k, v in c.items() if not k.startswith("_")}) + "\n")
        per_pkg: dict[str, Counter] = {}
        for c in cases:
            per_pkg.setdefault(c["package"], Counter())[c["category"]] += 1
        counts[side] = {
            "total": dict(sorted(Counter(c["category"] for c in cases).items())),
            "packages": {p: dict(sorted(v.items())) for p, v in sorted(per_pkg.items())},
        }
    return counts


def load_case(out: Path, case: dict) -> tuple[str, str]:
    """(document the user holds, document after the truth) of a case written under `out`."""
    old = (Path(out) / case["file"]).read_text(encoding="utf-8")
    doc = apply_edits(old, case["edits"])
    return doc, apply_edits(doc, [case["truth"]]) if case["truth"] else doc


# ---------------------------------------------------------------------- CLI (through `dlm-lsp corpus`)


def run_edits(args: argparse.Namespace) -> int:
    out = Path(args.edits)
    try:
        pins = read_manifest(Path(args.manifest or MANIFEST))
        s = build_edits(
            out,
            pins,
            pairs_per_package=args.edit_pairs,
            held_out_only=args.held_out_only,
            max_cases=args.max_cases,
            versions=previous_versions,  # looked up here, so a test can put its own in
        )
    except CorpusError as e:
        print(f"dlm-lsp corpus --edits: {e}", file=sys.stderr)
        return 2
    for side, c in s["counts"].items():
        if c["total"]:
            print(f"{out}/{side}.jsonl: {c['total']}")
    if s["skipped"]:
        print(
            f"skipped {len(s['skipped'])} packages: "
            + "; ".join(f"{k['package']} ({k['reason'][:120]})" for k in s["skipped"])
        )
    return 0
