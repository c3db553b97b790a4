# Research probe, kept as it ran at commit 6cb4e16; not maintained: it may not run against today's layout.
"""Probe: the fill's own n-gram over the whole workspace (every other file of the hole's package, not
only the 12k characters of retrieved snippets). Measured before anything is built (docs/MODEL.md,
"Session 22"). It patches the eval and the sampler: every evaluated file is tokenized once; per
package, every (context of k ids, next id) pair is counted (engine.bias.ngram.pair_counts); a hole's table
is its package's counts minus its own file's (a file never informs its own holes: in an editor the
line being typed is not on disk yet). At a masked slot, for the longest context of WSNG_ORDERS ids
ending its left run that is followed >= WSNG_MIN times, its 2 most frequent next ids gain WSNG_W x P,
beside the shipped local n-gram (WSNG_ONLY_MISS=1: only where the local n-gram has no context).
Every other argument goes to `dlm-lsp` (an `eval` with --corpus and --retrieve package):

    WSNG_W=4 .venv/bin/python docs/research/scripts/workspace_ngram_probe.py eval --corpus runs/corpus \
        --heldout all --threads 1 --neighbours 3 --retrieve package --min-confidence 0 --kinds line \
        --per-kind 1000 --json F
"""
import os
import sys
import time

import numpy as np

from dlm_lsp.measure import evaluate as E
from engine.bias import ngram as ng
from engine.decode import sampler as S

W = float(os.environ.get("WSNG_W", "4"))
ORDERS = tuple(sorted((int(x) for x in os.environ.get("WSNG_ORDERS", "3,4,5,6").split(",")), reverse=True))
MINC = int(os.environ.get("WSNG_MIN", "2"))
ONLY_MISS = os.environ.get("WSNG_ONLY_MISS", "0") == "1"
TOP = 2

CUR = {"key": None}
PKG: dict = {}  # package -> {k: (hash, next, count)} sorted by (hash, next)
OWN: dict = {}  # file key -> {k: (hash, next, count)}


def _pairs(a: np.ndarray, k: int):
    h, nx, c, _ = ng.pair_counts(a, np.zeros_like(a), k)
    return h, nx, c


def build(files: dict, model: str) -> None:
    from engine.weights.checkpoint import resolve_model_path
    from engine.tokenizer import TextTokenizer

    t0 = time.time()
    tok = TextTokenizer.load(str(resolve_model_path(model or "default")))
    keys = sorted(files)
    ids = {}
    for i in range(0, len(keys), 128):
        for k, row in zip(keys[i : i + 128], tok.encode_batch([files[k] for k in keys[i : i + 128]])):
            ids[k] = np.asarray(row, dtype=np.int64)
    by_pkg: dict = {}
    for k in keys:
        by_pkg.setdefault(k.split("/", 1)[0], []).append(k)
    for p, ks in by_pkg.items():
        a = np.concatenate([np.r_[ids[k], -1] for k in ks])
        PKG[p] = {k: _pairs(a, k) for k in ORDERS}
        for f in ks:
            OWN[f] = {k: _pairs(np.r_[ids[f], -1], k) for k in ORDERS}
    print(f"[probe] workspace n-gram: {len(PKG)} packages, {sum(v.size for v in ids.values()) / 1e6:.1f} M tokens, "
          f"{time.time() - t0:.0f} s", file=sys.stderr, flush=True)


class WsView:
    def __init__(self, key: str):
        self.pkg, self.own = PKG.get(key.split("/", 1)[0]), OWN.get(key)
        self.max_order = ORDERS[0]

    def next_probs(self, run: tuple):
        for k in ORDERS:
            if k > len(run):
                continue
            key = np.uint64(ng.context_hash(run[-k:]))
            h, nx, c = self.pkg[k]
            lo, hi = np.searchsorted(h, key, "left"), np.searchsorted(h, key, "right")
            if hi <= lo:
                continue
            ids, cnt = nx[lo:hi], c[lo:hi].copy()
            oh, onx, oc = self.own[k]
            lo2, hi2 = np.searchsorted(oh, key, "left"), np.searchsorted(oh, key, "right")
            for j in range(lo2, hi2):  # the hole's own file does not count
                cnt[ids == onx[j]] -= oc[j]
            tot = int(cnt.sum())
            if tot < MINC:
                continue
            pick = np.lexsort((ids, -cnt))[:TOP]
            pick = pick[cnt[pick] > 0]
            return ids[pick], (cnt[pick] / tot).astype(np.float32)
        return None


orig_call = E.Filler.__call__
orig_attach = S.Canvas.attach_far
orig_add_local = S.Canvas.add_local
orig_retrieval = E.retrieval_fn


def call(self, hole):
    CUR["key"] = hole.key
    return orig_call(self, hole)


def retrieval_fn(files, scope, n=0):
    build(dict(files), os.environ.get("WSNG_MODEL", ""))
    return orig_retrieval(files, scope, n)


def attach_far(self, lookup):
    orig_attach(self, lookup)
    self.ws = WsView(CUR["key"]) if CUR["key"] and CUR["key"] in OWN and W else None


def add_ws(self, logits, slot_idx):
    ws = getattr(self, "ws", None)
    if ws is None:
        return
    runs = S.left_runs(self.ids.tolist(), [self.start + j for j in slot_idx.tolist()], ws.max_order, self.cfg.mask_token_id)
    if ONLY_MISS and self.local is not None:
        runs = [r if self.local.next_probs(r) is None else () for r in runs]
    ng.add_bias(ws, logits, runs, W, S.ngram_skip(self.cfg))


def add_local(self, logits, slot_idx, left=None):
    orig_add_local(self, logits, slot_idx, left)
    add_ws(self, logits, slot_idx)


E.Filler.__call__ = call
E.retrieval_fn = retrieval_fn
S.Canvas.attach_far = attach_far
S.Canvas.add_local = add_local
from dlm_lsp.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
