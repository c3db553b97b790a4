# Research probe, kept as it ran at commit 514b07f; not maintained: it may not run against today's layout.
"""A probe (session 18): does a corpus n-gram memory help the 4 M default's fills? Since session 19
the lever is in the engine (engine/bias/ngram.py, `dlm-lsp ngram`, DecodeOptions.ngram); this script
stays to reproduce session 18's tables, counting with the engine's own functions.

The default model is capacity-bound (docs/MODEL.md, sessions 14-17: more training and a bigger model
no longer buy line holes). This probe asks whether the training corpus itself, as an n-gram table,
adds what 4 M parameters cannot hold. It measures before anything is built into the engine (as
docs/research/scripts/jedi_ceiling.py did for jedi).

    .venv/bin/python docs/research/scripts/ngram_probe.py build --corpus runs/corpus --out runs/ngram/table6.npz
    .venv/bin/python docs/research/scripts/ngram_probe.py eval --table runs/ngram/table6.npz --weight 8 --min-order 2 \
        -- --corpus runs/corpus --heldout all --threads 1 --neighbours 3 --min-confidence 0 --kinds line --per-kind 1000
    .venv/bin/python docs/research/scripts/ngram_probe.py prune --table runs/ngram/table6.npz --out runs/ngram/table_pruned.npz

`build` tokenizes the corpus's train side with the default model's tokenizer and counts, for every
context of k = 1..orders tokens (a 64-bit hash of the ids; no context crosses a file), the tokens
that follow it: the context's total count and its 8 most frequent next tokens among those seen in at
least 2 different packages (the stdlib counts as one), with their counts and package counts.
`eval` runs `dlm-lsp eval` in this process with one change to decoding: where the context copy
boost is computed (engine.decode.sampler.Canvas.copy_bias), a masked slot whose committed left run of
`min-order`.. `orders` tokens matches a stored context (the longest match, total count >= `min-count`,
next tokens seen in >= `min-packages` packages) gets `weight` x P_ngram(next | context) added to
its logits. With --weight 0 it reproduces `dlm-lsp eval` to the digit. The table is 176 MB
for 6 orders on the v2 corpus; the server's table is `dlm-lsp ngram`'s (32 MB, orders 4-6).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from engine.bias.ngram import context_hash, pair_counts  # noqa: E402
from engine.train.ngram_count import corpus_tokens  # noqa: E402 - the engine's own counting

TOP = 8
FIELDS = ("ctx", "tot", "sctx", "nxt", "cnt", "pf")


def build(args) -> None:
    t0 = time.time()
    a, pk, packages = corpus_tokens(args.corpus, args.model)
    print(f"{packages} packages, {a.size / 1e6:.1f} M tokens, {time.time() - t0:.0f} s", flush=True)
    out = {}
    for k in range(1, args.orders + 1):
        ph, pn, pc, pf = pair_counts(a, pk, k)
        first = np.r_[True, ph[1:] != ph[:-1]]
        starts = np.flatnonzero(first)
        tot = np.add.reduceat(pc, starts)
        gid = np.cumsum(first) - 1
        good = pf >= 2
        o2 = np.lexsort((-pc, ~good, gid))  # per context: kept pairs first, most frequent first
        ph, pn, pc, pf, gid, good = ph[o2], pn[o2], pc[o2], pf[o2], gid[o2], good[o2]
        sel = (np.arange(ph.size) - starts[gid] < TOP) & good
        has = np.zeros(starts.size, dtype=bool)
        has[gid[sel]] = True
        out[k] = dict(ctx=ph[starts][has], tot=tot[has], sctx=ph[sel], nxt=pn[sel].astype(np.int16),
                      cnt=pc[sel].astype(np.int32), pf=pf[sel].astype(np.int16))
        print(f"order {k}: {int(has.sum())} contexts, {int(sel.sum())} entries, {time.time() - t0:.0f} s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **{f"{k}_{f}": v for k, d in out.items() for f, v in d.items()})


def prune(args) -> None:
    """A smaller table: only orders `orders`, contexts seen >= `min_count` times, their `top` most
    frequent kept next tokens (what W 20 from 4 tokens of context uses; docs/MODEL.md, "Session 18")."""
    z = np.load(args.table)
    out = {}
    for k in (int(x) for x in args.orders.split(",")):
        d = {f: z[f"{k}_{f}"] for f in FIELDS}
        keep = d["tot"] >= args.min_count
        ctx, s = d["ctx"][keep], d["sctx"]
        starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
        rank = np.arange(s.size) - np.repeat(starts, np.diff(np.r_[starts, s.size]))
        sel = (rank < args.top) & np.isin(s, ctx)
        out.update({f"{k}_ctx": ctx, f"{k}_tot": d["tot"][keep].astype(np.int32), f"{k}_sctx": s[sel],
                    **{f"{k}_{f}": d[f][sel] for f in ("nxt", "cnt", "pf")}})
        print(f"order {k}: {ctx.size} contexts, {int(sel.sum())} entries", flush=True)
    np.savez(args.out, **out)
    print(f"{sum(v.nbytes for v in out.values()) / 1e6:.1f} MB", flush=True)


class Table:
    def __init__(self, path: str, min_order: int, min_count: int, min_packages: int):
        z = np.load(path)  # plain arrays: allow_pickle stays False
        orders = sorted({int(name.split("_")[0]) for name in z.files})
        self.tab = {k: {f: z[f"{k}_{f}"] for f in FIELDS} for k in orders}
        self.max_order, self.min_order = max(orders), min_order
        self.min_count, self.min_packages = min_count, min_packages

    def next_probs(self, run: tuple) -> tuple[np.ndarray, np.ndarray] | None:
        """(next ids, P(next | context)) for the longest stored context that ends `run`, or None."""
        for k in range(min(self.max_order, len(run)), self.min_order - 1, -1):
            d, key = self.tab[k], np.uint64(context_hash(run[-k:]))
            i = int(np.searchsorted(d["ctx"], key))
            if i == d["ctx"].size or d["ctx"][i] != key or d["tot"][i] < self.min_count:
                continue
            lo, hi = np.searchsorted(d["sctx"], key), np.searchsorted(d["sctx"], key, side="right")
            keep = d["pf"][lo:hi] >= self.min_packages
            if keep.any():
                return d["nxt"][lo:hi][keep].astype(np.int64), d["cnt"][lo:hi][keep] / float(d["tot"][i])
        return None


def evaluate(args, rest: list[str]) -> int:
    import torch

    import engine.decode.sampler as S
    from dlm_lsp.cli import main

    table = Table(args.table, args.min_order, args.min_count, args.min_packages)
    plain = S.Canvas.copy_bias

    def copy_bias(self, slot_idx, logits=None, restrict=None):
        bias = plain(self, slot_idx, logits, restrict)
        if not args.weight:
            return bias
        cfg = self.cfg
        special = {cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id}
        runs = S.left_runs(self.ids.tolist(), [self.start + j for j in slot_idx.tolist()], table.max_order,
                           cfg.mask_token_id)
        for r, run in enumerate(runs):
            if special.isdisjoint(run) and (hit := table.next_probs(run)) is not None:
                ids, p = hit
                bias[r, torch.from_numpy(ids)] += torch.from_numpy(args.weight * p).to(bias.dtype)
        return bias

    S.Canvas.copy_bias = copy_bias  # only reached with the copy boost on (the default's serving.json)
    return main(["eval", *rest])


def cli() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--corpus", default="runs/corpus")
    b.add_argument("--model", default=str(ROOT / "models" / "default"))
    b.add_argument("--orders", type=int, default=6)
    b.add_argument("--out", default="runs/ngram/table6.npz")
    pr = sub.add_parser("prune")
    pr.add_argument("--table", default="runs/ngram/table6.npz")
    pr.add_argument("--orders", default="4,5,6")
    pr.add_argument("--top", type=int, default=2)
    pr.add_argument("--min-count", type=int, default=3)
    pr.add_argument("--out", default="runs/ngram/table_pruned.npz")
    e = sub.add_parser("eval")
    e.add_argument("--table", default="runs/ngram/table6.npz")
    e.add_argument("--weight", type=float, default=8.0)
    e.add_argument("--min-order", type=int, default=2)
    e.add_argument("--min-count", type=int, default=3)
    e.add_argument("--min-packages", type=int, default=2)
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.cmd in ("build", "prune"):
        (build if args.cmd == "build" else prune)(args)
        return 0
    return evaluate(args, rest)


if __name__ == "__main__":
    sys.exit(cli())
