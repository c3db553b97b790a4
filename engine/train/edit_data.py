"""`dlm-lsp corpus --synthetic-edits OUT --from CORPUS`: the synthetic half of the next-edit training
data (engine/train/synth_edits.py), made from the training files of a corpus `dlm-lsp corpus` built.

    CORPUS/corpus.json's "train" keys, read where corpus.built_files puts them (a stdlib key names this
    interpreter's file, a package key CORPUS/files/<package>/<path>). ONLY the train side: never a
    held-out file nor a file of a held-out package, so the code the next-edit eval measures on stays
    unseen; a listed key that corpus.is_heldout takes, or whose package corpus.json marks held out, is
    skipped all the same (and counted)
        v
    each file's cases (synth_edits.synthetic_cases, at most per_file that are not noise), its Random
    seeded by (seed, key): a file's cases do not depend on the other files, one seed gives one data set
        v
    per package at most PER_PACKAGE cases that are not noise and PER_PACKAGE_NOISE noise, in hash order
    of their ids (edit_pairs' pick)
        v
    OUT/synthetic.jsonl: edit_pairs' case format (id, side "train", package, path, file, old_sha256,
    edits, cursor, truth, category) plus "kind"; each old file once under OUT/files/synthetic/<package>/
    <path>, written as edit_pairs writes its own, so edit_pairs.load_case(OUT, case) reads every case;
    OUT/synthetic.json: the rules, the files read and skipped, the counts per kind and category and per
    package. No network: the files are the corpus's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from engine.train import corpus
from engine.train.corpus_build import _norm
from engine.train.edit_pairs import MAX_HUNK_LINES, REACH, _cap, _write
from engine.train.synth_edits import KINDS, NOISE_SHARE, PER_FILE, synthetic_cases
from engine.train.synth_source import MAX_CHARS

PER_PACKAGE = 1500  # cases (not noise) one package gives at most: no package's style fills the set
PER_PACKAGE_NOISE = 500
SIDE = "synthetic"  # OUT/synthetic.jsonl and OUT/files/synthetic/; every case's "side" is "train"


def file_cases(key: str, text: str, seed: int, per_file: int = PER_FILE) -> list[dict]:
    """One training file's cases as written (the old text under "_old", not written)."""
    label, rel = key.split(":", 1)
    sha = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    out = []
    for n, c in enumerate(synthetic_cases(text, random.Random(f"{seed}:{key}"), per_file)):
        tag = c.pop("tag")
        out.append(
            {
                "id": f"{key}#{tag}",
                "side": "train",
                "package": label,
                "path": rel,
                "file": f"files/{SIDE}/{label}/{rel}",
                "old_sha256": sha,
                **c,
                "_order": (rel, n),
                "_old": text,
            }
        )
    return out


def build_synthetic(
    out: Path,
    corpus_dir: Path,
    seed: int = 0,
    per_file: int = PER_FILE,
    per_package: int = PER_PACKAGE,
    per_package_noise: int = PER_PACKAGE_NOISE,
    log: Callable[[str], object] = print,
) -> dict:
    """Builds the synthetic cases of the corpus in `corpus_dir` into `out` and returns the summary written
    to out/synthetic.json; FileNotFoundError when corpus_dir holds no corpus.json."""
    out, corpus_dir = Path(out), Path(corpus_dir)
    train = corpus.built_files(corpus_dir)["train"]
    meta = json.loads((corpus_dir / "corpus.json").read_text())
    held_packages = {_norm(p["name"]) for p in meta.get("packages", []) if p.get("heldout")}
    per_pkg: dict[str, list[tuple[str, bool, dict]]] = {}
    files: Counter[str] = Counter()
    for i, f in enumerate(train):
        if i and i % 500 == 0:
            log(f"  {i}/{len(train)} files")
        label = f.key.split(":", 1)[0]
        if corpus.is_heldout(f.key) or label in held_packages:
            files["skipped_heldout"] += 1  # a corpus.json that lists one as train was not made by us
            continue
        text = f.read()
        if text is None:
            files["unreadable"] += 1
            continue
        cs = file_cases(f.key, text, seed, per_file)
        files["with_cases"] += bool(cs)
        per_pkg.setdefault(label, []).extend((c["id"], c["truth"] is None, c) for c in cs)
    cases = [c for p in sorted(per_pkg) for c in _cap(per_pkg[p], per_package, per_package_noise)]
    shutil.rmtree(out / "files" / SIDE, ignore_errors=True)  # an old file of an earlier build is not ours
    counts = _write(out, {SIDE: cases})[SIDE]
    kinds = {k: dict(sorted(Counter(c["category"] for c in cases if c["kind"] == k).items())) for k in KINDS}
    summary = {
        "corpus": str(corpus_dir),
        "seed": seed,
        "rules": {
            "kinds": list(KINDS),
            "max_hunk_lines": MAX_HUNK_LINES,
            "reach_lines": REACH,
            "user_edits": "the first 1 or 2 sites of an intent; noise: all of its sites (1 or 2)",
            "category": "edit_pairs' rule: repeat when the truth shares a token substitution with the edits",
            "per_file": per_file,
            "noise_share_a_file": NOISE_SHARE,
            "per_package": [per_package, per_package_noise],
            "max_file_chars": MAX_CHARS,
            "sides": "train only: corpus.json's train keys, minus corpus.is_heldout and held-out packages",
        },
        "files": {"train": len(train), **dict(sorted(files.items()))},
        "kinds": kinds,
        "counts": counts,
    }
    (out / f"{SIDE}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


# ---------------------------------------------------------------------- CLI (through `dlm-lsp corpus`)


def run_synthetic(args: argparse.Namespace) -> int:
    out = Path(args.synthetic_edits)
    try:
        s = build_synthetic(out, Path(args.from_corpus or args.out), seed=args.seed)
    except FileNotFoundError as e:
        print(f"dlm-lsp corpus --synthetic-edits: {e}", file=sys.stderr)
        return 2
    print(
        f"{out}/{SIDE}.jsonl: {s['counts']['total']} from {s['files'].get('with_cases', 0)} of "
        f"{s['files']['train']} train files; per kind: "
        + "; ".join(f"{k} {sum(v.values())} {v}" for k, v in s["kinds"].items())
    )
    return 0
