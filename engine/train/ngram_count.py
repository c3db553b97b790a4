"""`dlm-lsp ngram`: counts the corpus n-gram memory (engine/bias/ngram.py) from the train side of a
`dlm-lsp corpus` folder with a model's tokenizer, and writes it into the model's folder."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine.bias.ngram import NGRAM_FILE, NgramError, NgramTable, count_order, tokenizer_digest

log = logging.getLogger(__name__)


def corpus_tokens(corpus: str, model: str, max_files: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """The train side of a `dlm-lsp corpus` folder as one id array (-1 after each file), each
    position's package number, and the number of packages (the stdlib counts as one)."""
    from engine.tokenizer import TextTokenizer
    from engine.train.corpus import built_files

    tok = TextTokenizer.load(model)
    texts: list[str] = []
    pkg: list[int] = []
    labels: dict[str, int] = {}
    for f in built_files(corpus)["train"][:max_files]:
        t = f.read()
        if t:
            texts.append(t)
            pkg.append(labels.setdefault(f.key.split(":", 1)[0], len(labels)))
    if not texts:
        raise NgramError(f"{corpus}: no training files")
    ids, pks = [], []
    for i in range(0, len(texts), 256):
        for j, row in enumerate(tok.encode_batch(texts[i : i + 256])):
            ids.append(np.asarray(row + [-1], dtype=np.int64))
            pks.append(np.full(len(row) + 1, pkg[i + j], dtype=np.int64))
    return np.concatenate(ids), np.concatenate(pks), len(labels)


def build_table(
    corpus: str,
    model: str,
    orders: Sequence[int] = (4, 5, 6),
    min_count: int = 3,
    top: int = 2,
    min_packages: int = 2,
    max_files: int | None = None,
) -> NgramTable:
    """Counts the train side of a `dlm-lsp corpus` folder with `model`'s tokenizer."""
    t0 = time.time()
    a, pk, packages = corpus_tokens(corpus, model, max_files)
    log.info("%d packages, %.1f M tokens, %.0f s", packages, a.size / 1e6, time.time() - t0)
    parts = []
    for k in orders:
        parts.append(count_order(a, pk, k, min_count, top, min_packages))
        log.info("order %d: %d contexts, %.0f s", k, parts[-1][0].size, time.time() - t0)
    ctx = np.concatenate([p[0] for p in parts])
    ctx, first = np.unique(ctx, return_index=True)  # sorted; a hash two orders share (2^-64) keeps one
    nxt = np.concatenate([p[1] for p in parts])[first]
    prob = np.concatenate([p[2] for p in parts])[first]
    return NgramTable(ctx, nxt, prob, tuple(orders))


def add_ngram_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--corpus", default="runs/corpus", help="a folder built by `dlm-lsp corpus` (its train side is counted)"
    )
    p.add_argument(
        "--model", default="default", help="the model whose tokenizer counts it (and whose folder gets the table)"
    )
    p.add_argument("--out", default=None, help=f"where to write it (default: MODEL/{NGRAM_FILE})")
    p.add_argument("--orders", default="4,5,6", help="context lengths in tokens")
    p.add_argument("--min-count", type=int, default=3, help="contexts seen fewer times are left out")
    p.add_argument("--top", type=int, default=2, help="next tokens kept per context")
    p.add_argument(
        "--min-packages", type=int, default=2, help="a next token is kept only if this many packages write it"
    )
    p.add_argument("--max-files", type=int, default=None, help="count only the first N training files (smoke runs)")


def run_ngram(args: argparse.Namespace) -> int:
    from engine.weights.checkpoint import resolve_model_path

    folder = resolve_model_path(args.model)
    orders = tuple(int(x) for x in args.orders.split(","))
    table = build_table(args.corpus, str(folder), orders, args.min_count, args.top, args.min_packages, args.max_files)
    out = Path(args.out) if args.out else folder / NGRAM_FILE
    about = {
        "corpus": Path(args.corpus).name,
        "min_count": args.min_count,
        "top": args.top,
        "min_packages": args.min_packages,
        "contexts": len(table),
    }
    table.save(out, tokenizer_digest(folder), about)
    print(f"{out}: {len(table)} contexts, orders {orders}, {out.stat().st_size / 1e6:.1f} MB")
    return 0
