# Research probe, kept as it ran at commit 6cb4e16; not maintained: it may not run against today's layout.
"""The probe that measured the fill's own n-gram before it was built (docs/MODEL.md, "Session 21";
docs/measurements/s21/probe_*.json). It patches the sampler: at attach_far a table is counted
(engine.bias.ngram.count_order) over the lookup's ids and, with FARNG_NEAR=1, the canvas's own ids, and
added beside the corpus memory with weight FARNG_W (orders FARNG_ORDERS, min count FARNG_MIN); only
for jobs with a lookup. The built lever is DecodeOptions.local_ngram (engine/ngram.LocalNgram); this
stays as the record of the probe. Every other argument goes to `dlm-lsp`:

    FARNG_W=4 FARNG_NEAR=1 .venv/bin/python docs/research/scripts/local_ngram_probe.py eval --corpus runs/corpus \
        --heldout all --threads 1 --neighbours 3 --retrieve package --min-confidence 0 --kinds line \
        --per-kind 1000 --decode '{"local_ngram": 0}' --json F
"""
import os
import sys

import numpy as np

from engine.bias import ngram as ng
from engine.decode import sampler as S

W = float(os.environ.get("FARNG_W", "4"))
ORDERS = tuple(int(x) for x in os.environ.get("FARNG_ORDERS", "3,4,5,6").split(","))
MINC = int(os.environ.get("FARNG_MIN", "2"))
NEAR = os.environ.get("FARNG_NEAR", "0") == "1"

orig_attach = S.Canvas.attach_far
orig_add = S.Canvas.add_ngram


def attach_far(self, lookup):
    orig_attach(self, lookup)
    self.far_table = None
    parts = []
    if lookup:
        parts.append(S.far_ids(lookup, (self.cfg.mask_token_id, self.cfg.pad_token_id, self.cfg.eos_token_id, self.cfg.bos_token_id)))
    if NEAR:
        a = np.asarray(self.ids.tolist(), dtype=np.int64)
        for t in (self.cfg.mask_token_id, self.cfg.pad_token_id, self.cfg.eos_token_id, self.cfg.bos_token_id):
            if t is not None:
                a[a == t] = -1
        parts.append(a)
    parts = [p for p in parts if p is not None and p.size]
    if not parts:
        return
    a = np.concatenate([np.r_[p, -1] for p in parts])
    pk = np.zeros_like(a)
    tabs = [ng.count_order(a, pk, k, MINC, 2, 1) for k in ORDERS if a.size > k + 1]
    if not tabs:
        return
    ctx = np.concatenate([t[0] for t in tabs])
    if ctx.size == 0:
        return
    ctx, first = np.unique(ctx, return_index=True)
    self.far_table = ng.NgramTable(ctx, np.concatenate([t[1] for t in tabs])[first],
                                   np.concatenate([t[2] for t in tabs])[first], ORDERS)


def add_ngram(self, logits, slot_idx, left=None):
    orig_add(self, logits, slot_idx, left)
    t = getattr(self, "far_table", None)
    if t is not None and W:
        left = S.left_runs(self.ids.tolist(), [self.start + j for j in slot_idx.tolist()], t.max_order, self.cfg.mask_token_id)
        t.add_bias(logits, left, W, S.ngram_skip(self.cfg))


S.Canvas.attach_far = attach_far
S.Canvas.add_ngram = add_ngram
from dlm_lsp.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
