"""`dlm-lsp corpus`: the command's arguments and its run (the corpus, engine/train/corpus_build.py; with
--edits, next-edit cases from release pairs, engine/train/edit_pairs.py; with --synthetic-edits,
next-edit cases made from a built corpus's training files, engine/train/edit_data.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.train.corpus_build import MANIFEST, CorpusError, build


def add_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/corpus", help="folder to build into (wheels are cached in OUT/wheels)")
    p.add_argument("--manifest", default=str(MANIFEST), help="pinned packages, one `name==version [heldout]` a line")
    p.add_argument(
        "--extra-manifest",
        default=None,
        help="more pinned packages after --manifest's (engine/train/data/ngram_extra_manifest.txt: the n-gram table's corpus)",
    )
    p.add_argument("--no-stdlib", dest="stdlib", action="store_false", help="leave the stdlib out")
    p.add_argument(
        "--edits",
        metavar="OUT_DIR",
        default=None,
        help="build next-edit cases from each package's previous release into OUT_DIR instead (engine/train/edit_pairs.py)",
    )
    p.add_argument("--held-out-only", action="store_true", help="with --edits: the held-out packages only")
    p.add_argument("--max-cases", type=int, default=None, help="with --edits: at most N cases a side")
    p.add_argument(
        "--edit-pairs", type=int, default=1, help="with --edits: release pairs a package, walking back from its pin"
    )
    p.add_argument(
        "--synthetic-edits",
        metavar="OUT_DIR",
        default=None,
        help="build synthetic next-edit cases from the train files of a built corpus into OUT_DIR instead (engine/train/edit_data.py)",
    )
    p.add_argument(
        "--from",
        dest="from_corpus",
        metavar="CORPUS_DIR",
        default=None,
        help="with --synthetic-edits: the corpus `dlm-lsp corpus` built (default: --out)",
    )
    p.add_argument("--seed", type=int, default=0, help="with --synthetic-edits: one seed, one data set")


def run_corpus(args: argparse.Namespace) -> int:
    if args.synthetic_edits:
        from engine.train.edit_data import run_synthetic

        return run_synthetic(args)
    if args.edits:
        from engine.train.edit_pairs import run_edits  # it imports this module

        return run_edits(args)
    out = Path(args.out)
    try:
        s = build(
            out,
            Path(args.manifest),
            include_stdlib=args.stdlib,
            extra_manifest=Path(args.extra_manifest) if args.extra_manifest else None,
        )
    except CorpusError as e:
        print(f"dlm-lsp corpus: {e}", file=sys.stderr)
        return 2
    b = s["bytes"]
    print(
        f"{out}/corpus.json: {len(s['train'])} train files ({b['train'] / 1e6:.1f} MB), {len(s['heldout'])} held out "
        f"({b['heldout'] / 1e6:.1f} MB), {len(s['heldout_packages'])} in held-out packages ({b['heldout_packages'] / 1e6:.1f} MB); "
        f"{len(s['packages'])} packages; dropped {s['dropped']}"
    )
    return 0
