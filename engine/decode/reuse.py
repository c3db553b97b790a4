"""Approximate per-keystroke context reuse for full-attention models (the default, Dream, LLaDA).

Consecutive requests for one document (FillJob.session) differ by a few tokens near the cursor. The
first forward of a fill (engine/decode/cache.py `forward_full`) computes the K/V of the whole context
(prefix + suffix) only to throw them away at the next keystroke. Here the engine keeps, per session,
the last request's context token ids, positions and per-layer K/V (`ReuseCache`), and the next
request's first forward runs only

    the context tokens that changed + the canvas (its active span),

attending to the unchanged tokens' cached K/V and to each other. The cached step path then goes on
as after a full forward (a DualCache context: reused rows, then the recomputed ones).

Which tokens are unchanged (`plan`): the cursor splits the context in two parts, matched separately.
In each part the longest run of equal tokens on one diagonal (old row i + offset = new row i, the
offset within MAX_SHIFT) is kept: typing at the cursor changes or appends the prefix's last tokens
(offset 0), a prefix cut to its room loses head tokens as it grows (offset = the tokens lost), the
suffix's head changes when the text after the cursor does. Everything outside the two runs is
recomputed. Positions: the suffix moves right when the prefix grows (and the prefix moves left
when its head is cut), so a reused key's RoPE rotation is for its old position. RoPE composes,
R(new) = R(new - old) R(old), so the cached, rotated key is rotated by the difference (`rerotate`),
with cos/sin of the difference taken from the model's own tables by the angle-difference identities:
the result is the key a recomputation at the new position gives for the same hidden input, to
rounding (tests/test_reuse_approx.py checks it at the K level). Storing pre-RoPE keys instead would
need the same rotation of every cached key at every request (the attention wants rotated keys) and a
second key layout in model.py; re-rotating touches only rows whose position moved. The entry keeps
each key as it was computed, with the position it was rotated for (`kpos`): every request rotates
from that original, so rounding never accumulates over keystrokes (bf16 on CUDA).

Why approximate: with full attention an unchanged token's K/V saw the old neighbours (the tokens
that changed, and the relative offsets before the shift). Staleness policy: a request recomputes
everything (and the entry starts afresh) when
  - there is no entry, or it was made by another model (DecodeOptions do not matter: they steer the
    denoising steps, while a first forward's context K/V depend only on the model and the canvas's
    tokens and positions, which the plan compares; a change of hole kind while typing, and with it
    the stop or the slot count, keeps the entry);
  - the changed tokens accumulated since the last full forward would pass `DecodeOptions.reuse_budget`
    (a changed token is a new context row recomputed, an old row dropped, a slot more or fewer);
  - the cursor jumped (or the document is not the lineage of the entry's): the prefix's changed tail
    (the rows before the cursor not reused), the suffix's changed head (after the cursor) or the
    prefix's changed head is longer than JUMP_TOKENS, or a part has nothing in common with the old one.
The context window sliding (the prefix's head cut as the prefix grows, or a head line dropped by
dlm_lsp.fill.context) is a diagonal offset like any other: its dropped rows count against the budget, and
a slide of more than JUMP_TOKENS is a jump. A literal "recompute whenever the window slides" would
recompute at every keystroke once a prefix is longer than its room, since the canvas cuts it one
token at a time.

The session entry is replaced whole, only after a first forward has run to the end: a job that
fails or is cancelled before that leaves the previous entry as it was, and the entry never aliases a
canvas's buffers (later steps write there). Exact layouts keep their own exact path (the reorder
layout's SessionCache, engine/decode/reorder.py); this module only takes bidirectional canvases (`applies`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.decode.cache import Rows, forward_full

if TYPE_CHECKING:
    from engine.decode.canvas import Canvas
    from engine.model.transformer import Transformer

JUMP_TOKENS = 32  # a change this far (in tokens) from the cursor, or more changed there, is a cursor jump
MAX_SHIFT = 64  # diagonals searched for a part's unchanged run (a slide or a re-tokenized head up to this)


def applies(c: Canvas) -> bool:
    """True when approximate reuse may serve this canvas: asked for, a cached context, full attention,
    and a fixed canvas (DreamOn's growing middle re-forwards its own way)."""
    return bool(c.opts.reuse and c.opts.cache and c.cfg.attention == "bidirectional" and c.middle is None)


def rotation(
    cos: torch.Tensor, sin: torch.Tensor, old: torch.Tensor, new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of (new - old) per row and frequency, (R, Dh), from the model's RoPE tables' own
    values (cos(a - b) = cos a cos b + sin a sin b, sin(a - b) = sin a cos b - cos a sin b)."""
    co, so, cn, sn = cos[old], sin[old], cos[new], sin[new]  # (R, Dh)
    return cn * co + sn * so, sn * co - cn * so


def rotate(k: torch.Tensor, cd: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
    """Keys (..., R, Dh) turned by a rotation from `rotation` (rotate-half layout)."""
    kf = k.float()
    x1, x2 = kf.chunk(2, dim=-1)
    return (kf * cd + torch.cat([-x2, x1], dim=-1) * sd).to(k.dtype)


def rerotate(
    k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, old: torch.Tensor, new: torch.Tensor
) -> torch.Tensor:
    """Keys rotated (RoPE, rotate-half layout) for positions `old` -> the same keys rotated for `new`.
    k: (..., R, Dh); old, new: (R,); cos, sin: the model's tables (max_seq_len, Dh). The difference's
    cos/sin come from the tables' own values (`rotation`), so the result equals a recomputation at
    `new` to fp32 rounding."""
    return rotate(k, *rotation(cos, sin, old, new))


def segments(*idx: torch.Tensor) -> list[tuple[int, ...]]:
    """Equal-length 1-D index tensors cut where any of them stops counting up by one: per piece,
    (each tensor's first index, ..., the piece's length). The reuse plan's rows are a few contiguous
    runs, and a slice copy is many times cheaper than an index copy on these small tensors."""
    n = idx[0].shape[0]
    if n == 0:
        return []
    if n == 1:
        cuts = [0, 1]
    else:
        steps = torch.stack([x[1:] - x[:-1] for x in idx])
        cuts = [0, *(torch.nonzero((steps != 1).any(0)).flatten() + 1).tolist(), n]
    firsts = [x[torch.tensor(cuts[:-1], device=x.device)].tolist() for x in idx]
    return [(*(f[i] for f in firsts), cuts[i + 1] - cuts[i]) for i in range(len(cuts) - 1)]


def best_run(new: torch.Tensor, old: torch.Tensor, max_shift: int = MAX_SHIFT, near: int = 4) -> tuple[int, int, int]:
    """(j0, j1, o) with new[j0:j1] == old[j0 + o : j1 + o] the longest such run over |o| <= max_shift
    (ties: the smallest |o|, then the earliest run); (0, 0, 0) when no token matches.

    The diagonals |o| <= `near` are searched first: a farther diagonal overlaps the other text on
    fewer rows than its |o| takes away, so when none of them overlaps on more rows than the run found
    near, none can beat it (a tie goes to the nearer one anyway) and they are not searched. A keystroke
    leaves the run on diagonal 0 or 1, so this is the common case; the answer is the same either way."""
    Ln, Lo = new.shape[0], old.shape[0]
    if Ln == 0 or Lo == 0:
        return 0, 0, 0
    offs = sorted(range(-min(max_shift, Ln - 1), min(max_shift, Lo - 1) + 1), key=lambda o: (abs(o), o))
    first = [o for o in offs if abs(o) <= near]
    j0, j1, o = _best_on(new, old, first)
    rest = offs[len(first) :]
    # rows a diagonal o can match on: new rows j with 0 <= j + o < Lo
    if not rest or j1 - j0 >= max(min(Ln, Lo - o) - max(0, -o) for o in rest):
        return j0, j1, o
    return _best_on(new, old, offs)


def _best_on(new: torch.Tensor, old: torch.Tensor, offs: list[int]) -> tuple[int, int, int]:
    """best_run over the diagonals `offs`, in that order of preference."""
    Ln, Lo = new.shape[0], old.shape[0]
    o_t = torch.tensor(offs, device=new.device)  # (O,)
    j = torch.arange(Ln, device=new.device)  # (Ln,)
    src = j[None] + o_t[:, None]  # (O, Ln) the old row each new row would be on that diagonal
    eq = (src >= 0) & (src < Lo) & (new[None] == old[src.clamp(0, Lo - 1)])
    idx = j.expand_as(eq)
    last_miss = torch.where(eq, torch.full_like(idx, -1), idx).cummax(dim=1).values
    run = idx - last_miss  # (O, Ln) length of the equal run ending at each new row (0 on a miss)
    flat = int(run.flatten().argmax())
    d, end = divmod(flat, Ln)
    length = int(run[d, end])
    if length == 0:
        return 0, 0, 0
    return end + 1 - length, end + 1, offs[d]


@dataclass
class Entry:
    """One session's last context, its rows in position order: the prefix's `split` rows, then the suffix's."""

    ids: torch.Tensor  # (Lc,)
    pos: torch.Tensor  # (Lc,) positions in that request's canvas
    kpos: torch.Tensor  # (Lc,) the position each cached key is rotated for (its row's pos when computed)
    kv: torch.Tensor  # (n_layers, 2, Hkv, Lc, Dh): every layer's K and V, each row as it was computed
    split: int
    n: int  # that request's slots
    stale: int  # changed tokens reused over since the last full forward
    fingerprint: tuple

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) views (1, Hkv, Lc, Dh), the layout of Canvas.kv."""
        return [(kv[0][None], kv[1][None]) for kv in self.kv]


@dataclass
class Plan:
    """What a first forward reuses: new context rows `new_rows` take the entry's rows `old_rows`; the
    other new context rows (`run_rows`) are recomputed. Indices into the context rows (position order)."""

    entry: Entry
    new_rows: torch.Tensor  # (R,)
    old_rows: torch.Tensor  # (R,)
    run_rows: torch.Tensor  # (C,)
    changed: int


def fingerprint(model: Transformer, c: Canvas) -> tuple:
    """What an entry must share with a request to be reused: the model. Not the DecodeOptions: what
    they change that the first forward sees (healing's re-typed tokens, the slot count, the window's
    span) is in the canvas's ids and positions, which `plan` compares row by row."""
    return (id(model), c.cfg.vocab_size, c.cfg.n_layers)


def context_rows(c: Canvas) -> tuple[torch.Tensor, int]:
    """(Lc,) positions of a canvas's context at its first forward (everything but the active span),
    ascending, and how many are the prefix's (before the active span)."""
    a0, a1 = c.active
    L = c.ids.shape[0]
    pos = torch.cat([torch.arange(0, a0), torch.arange(a1, L)]).to(c.ids.device)
    return pos, a0


class ReuseCache:
    """Per session key, the last first-forward's context (`Entry`); at most `size` sessions (least
    recent out). `stats` counts lookups by outcome and the rows reused (service stats, tests, bench)."""

    OUTCOMES = ("reused", "full_new", "full_model", "full_stale", "full_jump")

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self.stats = {"lookups": 0, "rows_reused": 0, "rows_total": 0, **{k: 0 for k in self.OUTCOMES}}

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def clear(self) -> None:
        self._entries.clear()

    def put(self, key: str, e: Entry) -> None:
        self._entries[key] = e
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def plan(self, key: str, fp: tuple, ids: torch.Tensor, split: int, n: int, budget: int) -> tuple[Plan | None, str]:
        """(the reuse plan, "reused") or (None, why a full recompute: one of OUTCOMES)."""
        self.stats["lookups"] += 1
        self.stats["rows_total"] += ids.shape[0]
        e = self._entries.get(key)
        outcome, p = self._plan(e, fp, ids, split, n, budget)
        self.stats[outcome] += 1
        if p is not None:
            self.stats["rows_reused"] += p.new_rows.numel()
        return p, outcome

    @staticmethod
    def _plan(
        e: Entry | None, fp: tuple, ids: torch.Tensor, split: int, n: int, budget: int
    ) -> tuple[str, Plan | None]:
        if e is None:
            return "full_new", None
        if e.fingerprint != fp:
            return "full_model", None
        dev = ids.device
        P, S, oP, oS = split, ids.shape[0] - split, e.split, e.ids.shape[0] - e.split
        pj0, pj1, po = best_run(ids[:P], e.ids[:oP])
        sj0, sj1, so = best_run(ids[P:], e.ids[oP:])
        if (P and oP and pj1 == pj0) or (S > JUMP_TOKENS and oS and sj1 == sj0):
            return "full_jump", None  # a part with nothing in common: another place, or another text
        # the prefix's rows just before the cursor not reused (new ones, old ones)
        near = max(P - pj1, oP - (pj1 + po)) if pj1 > pj0 else P
        head = max(pj0, pj0 + po) if pj1 > pj0 else 0  # the prefix's head rows not reused (new ones, old ones)
        after = max(sj0, sj0 + so) if sj1 > sj0 else 0  # the suffix's head rows not reused (new ones, old ones)
        if max(near, head, after) > JUMP_TOKENS:
            return "full_jump", None
        new_rows = torch.cat([torch.arange(pj0, pj1, device=dev), P + torch.arange(sj0, sj1, device=dev)])
        old_rows = torch.cat(
            [torch.arange(pj0 + po, pj1 + po, device=dev), oP + torch.arange(sj0 + so, sj1 + so, device=dev)]
        )
        R = new_rows.numel()
        changed = (ids.shape[0] - R) + (e.ids.shape[0] - R) + abs(n - e.n)
        if R == 0 or e.stale + changed > budget:
            return "full_stale", None
        keep = torch.ones(ids.shape[0], dtype=torch.bool, device=dev)
        keep[new_rows] = False
        return "reused", Plan(e, new_rows, old_rows, torch.nonzero(keep).flatten(), changed)


def forward_first(model: Transformer, c: Canvas) -> Rows:
    """The first forward of a canvas with a session (`Canvas.reuse` = (ReuseCache, key)): with a
    plan, only the changed context rows and the active span run, against the reused rows' K/V
    (re-rotated where their position moved); else the full forward. Either way the session's entry
    is then replaced by this request's context. Returns what cache.forward_full returns for it.

    Every layer's K and V live in one (n_layers, 2, Hkv, L, Dh) buffer whose per-layer views are the
    canvas's `kv`: a contiguous piece of rows is one copy for all layers, not one per layer and
    tensor (this path runs at every keystroke; its copies are what reuse costs beyond the model)."""
    return forward_first_batch(model, [c])[0]


@dataclass
class _Hit:
    """A first forward that reuses: its canvas, session, context rows and plan."""

    c: Canvas
    store: ReuseCache
    key: str
    ids: torch.Tensor  # (Lc,) the context's ids
    pos: torch.Tensor  # (Lc,) their positions
    split: int
    p: Plan

    @property
    def run(self) -> torch.Tensor:
        """(C + A,) positions run: the changed context rows, then the active span."""
        return torch.cat([self.pos[self.p.run_rows], self.c.active_pos])


def forward_first_batch(model: Transformer, canvases: list[Canvas]) -> list[Rows]:
    """forward_first for several canvases with sessions: the misses each run their full forward, the
    hits run in one forward together (each canvas's reused rows and its recomputed ones in its row of
    one batch buffer, attending under a mask to its own rows only). One hit alone runs unmasked, as
    forward_first always has. Returns per canvas what forward_first returns, in order."""
    out: dict[int, Rows] = {}
    hits: list[_Hit] = []
    for c in canvases:
        if c.reuse is None:  # engine/decode/forward.py sends only canvases with a session here
            raise ValueError("forward_first needs a canvas with a session (Canvas.reuse)")
        store, key = c.reuse
        pos, split = context_rows(c)
        ids = c.ids[pos]
        fp = fingerprint(model, c)
        p, _ = store.plan(key, fp, ids, split, c.n, c.opts.reuse_budget)
        if p is None:
            out[id(c)] = _forward_miss(model, c, store, key, ids, pos, split, fp)
        else:
            hits.append(_Hit(c, store, key, ids, pos, split, p))
    if len(hits) == 1:
        out[id(hits[0].c)] = _forward_hit(model, hits[0])
    elif hits:
        out.update(zip((id(x.c) for x in hits), _forward_hits(model, hits)))
    return [out[id(c)] for c in canvases]


def _forward_miss(
    model: Transformer,
    c: Canvas,
    store: ReuseCache,
    key: str,
    ids: torch.Tensor,
    pos: torch.Tensor,
    split: int,
    fp: tuple,
) -> Rows:
    """No plan: the full forward, whose context becomes the session's entry."""
    rows = forward_full(model, [c])[0]
    Lc = c.ctx_len  # forward_full's context: every row but the active span, in position order
    if c.kv is None:  # forward_full fills it: reuse applies only to canvases that cache (`applies`)
        raise RuntimeError("forward_full left no context K/V to keep")
    stacked = torch.stack([torch.stack([k[0, :, :Lc], v[0, :, :Lc]]) for k, v in c.kv])
    store.put(key, Entry(ids.clone(), pos.clone(), pos.clone(), stacked, split, c.n, 0, fp))
    return rows


def _reused_rows(model: Transformer, x: _Hit, buf: torch.Tensor) -> None:
    """Writes the entry's reused rows into rows 0..R of `buf` (n_layers, 2, Hkv, >= R, Dh), moved keys
    re-rotated by the difference of positions."""
    p, e = x.p, x.p.entry
    R = p.new_rows.numel()
    new_pos, old_kpos = x.pos[p.new_rows], e.kpos[p.old_rows]
    moved = torch.nonzero(new_pos != old_kpos).flatten()
    # the rows as contiguous pieces (slices): reused rows <- the entry's, moved keys re-rotated by the difference
    for r0, o0, ln in segments(torch.arange(R, device=moved.device), p.old_rows):
        buf[:, :, :, r0 : r0 + ln] = e.kv[:, :, :, o0 : o0 + ln]
    for m0, ln in segments(moved):
        cd, sd = rotation(model.rope_cos, model.rope_sin, old_kpos[m0 : m0 + ln], new_pos[m0 : m0 + ln])
        buf[:, 0, :, m0 : m0 + ln] = rotate(buf[:, 0, :, m0 : m0 + ln], cd, sd)


def _forward_hit(model: Transformer, x: _Hit) -> Rows:
    """One hit alone: its reused rows and then the run rows in its own buffer, no mask."""
    e = x.p.entry
    L = x.c.ids.shape[0]
    nl, _, hkv, _, dh = e.kv.shape
    buf = torch.empty((nl, 2, hkv, L, dh), dtype=e.kv.dtype, device=e.kv.device)  # room for the context and the span
    _reused_rows(model, x, buf)
    R, run = x.p.new_rows.numel(), x.run
    kv = [(buf[i, 0][None], buf[i, 1][None]) for i in range(nl)]
    # the run rows' K/V land in place after the reused ones: [reused][recomputed context][active span]
    h = model.hidden(x.c.ids[run][None], pos=run[None], ctx=[(kb, vb, R) for kb, vb in kv])  # (1, C+A, D)
    return _adopt(x, buf, kv, h[0])


def _forward_hits(model: Transformer, hits: list[_Hit]) -> list[Rows]:
    """Several hits in one forward (Transformer.hidden_rows): row b of one (n_layers, 2, B, Hkv, N, Dh)
    buffer holds hit b's reused rows, then its run rows' K/V, scattered there by the forward; each
    attends only to its own rows. Each canvas's `kv` is a view of its row: nothing is copied after."""
    e0 = hits[0].p.entry
    nl, _, hkv, _, dh = e0.kv.shape
    B = len(hits)
    dev = e0.kv.device
    runs = [x.run for x in hits]
    N = max(x.c.ids.shape[0] for x in hits) + 1  # every canvas's rows, and a trash row for the padding
    # zeros: a canvas's rows past its own are read under the mask (weight 0), and 0 * NaN from
    # uninitialised memory would be NaN
    buf = torch.zeros((nl, 2, B, hkv, N, dh), dtype=e0.kv.dtype, device=dev)
    Q = max(r.numel() for r in runs)
    ids = torch.full((B, Q), hits[0].c.cfg.pad_token_id, dtype=torch.long, device=dev)
    pos = torch.zeros((B, Q), dtype=torch.long, device=dev)
    at = torch.full((B, Q), N - 1, dtype=torch.long, device=dev)  # padded query rows write to the trash row
    key_ok = torch.zeros((B, N), dtype=torch.bool, device=dev)
    for b, (x, run) in enumerate(zip(hits, runs)):
        _reused_rows(model, x, buf[:, :, b])
        R, q = x.p.new_rows.numel(), run.numel()
        ids[b, :q], pos[b, :q] = x.c.ids[run], run
        at[b, :q] = torch.arange(R, R + q, device=dev)
        key_ok[b, : R + q] = True
    mask = key_ok[:, None, None, :].expand(B, 1, Q, N)
    h = model.hidden_rows(ids, pos, mask, buf[:, 0], buf[:, 1], at)  # (B, Q, D)
    out = []
    for b, (x, run) in enumerate(zip(hits, runs)):
        row = buf[:, :, b]  # (n_layers, 2, Hkv, N, Dh)
        kv = [(row[i, 0][None], row[i, 1][None]) for i in range(nl)]
        out.append(_adopt(x, row, kv, h[b, : run.numel()]))
    return out


def _adopt(x: _Hit, buf: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], h: torch.Tensor) -> Rows:
    """The canvas as forward_full leaves it, from a hit's buffer (n_layers, 2, Hkv, >= R + C + A, Dh)
    holding [reused][recomputed context][active span] and the run rows' hidden states (C + A, D); the
    session's new entry. Returns the active span's hidden states and positions."""
    c, p, e = x.c, x.p, x.p.entry
    R, C = p.new_rows.numel(), p.run_rows.numel()
    nl = buf.shape[0]
    # the new entry, in position order: reused rows as the entry had them (original keys and kpos), the
    # recomputed rows as computed now (in the buffer after the reused ones)
    Lc = x.pos.shape[0]
    kpos = x.pos.clone()
    kpos[p.new_rows] = e.kpos[p.old_rows]
    entry_kv = torch.empty((nl, 2, buf.shape[2], Lc, buf.shape[4]), dtype=e.kv.dtype, device=e.kv.device)
    for n0, o0, ln in segments(p.new_rows, p.old_rows):
        entry_kv[:, :, :, n0 : n0 + ln] = e.kv[:, :, :, o0 : o0 + ln]
    done = R
    for r0, ln in segments(p.run_rows):
        entry_kv[:, :, :, r0 : r0 + ln] = buf[:, :, :, done : done + ln]
        done += ln
    # the canvas as forward_full leaves it (every slot masked: nothing frozen)
    c.kv = kv
    c.ctx_len = R + C
    c.frozen = torch.zeros(c.n, dtype=torch.bool, device=c.ids.device)
    c.n_frozen = 0
    c.ctx_version += 1
    c.since_refresh = 1
    c.rows_forwarded += C + c.active_pos.shape[0]
    c.reused = R
    if c.opts.window > 0:  # the slots' K/V as of now (masked slots right of later windows read them)
        s0 = R + C + c.start - c.active[0]  # slot 0's row in the buffer
        slots = buf[:, :, :, s0 : s0 + c.n].clone()
        c.slot_kv = [(slots[i, 0][None], slots[i, 1][None]) for i in range(nl)]
    x.store.put(
        x.key, Entry(x.ids.clone(), x.pos.clone(), kpos, entry_kv, x.split, c.n, e.stale + p.changed, e.fingerprint)
    )
    return h[C:], c.active_pos


__all__ = [
    "Entry",
    "JUMP_TOKENS",
    "MAX_SHIFT",
    "Plan",
    "ReuseCache",
    "applies",
    "best_run",
    "context_rows",
    "fingerprint",
    "forward_first",
    "forward_first_batch",
    "rerotate",
    "rotate",
    "rotation",
    "segments",
]
