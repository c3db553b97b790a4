"""Context K/V reuse for batches of canvases (Fast-dLLM DualCache, plus dKV-style freezing).

A full forward runs a canvas's whole sequence (prefix + slots + suffix) and keeps the K/V of the
context: the prefix and suffix, and with `freeze` every slot already committed. A cached step then
runs only the slots that are not in the context - the masked ones and those committed at the step
before - attending to the cached K/V. After a cached step the slots that went in with their committed
token are *frozen*: their K/V join the context and later steps no longer run them (dKV-Cache,
"delayed" caching: a slot is cached one step after its commit, when its K/V saw its own token).
Without `freeze` every step reruns every slot (DualCache).

With a sliding `window` a cached step runs only the leftmost `window` masked slots (plus committed
slots not frozen yet); the masked slots right of it are attended to through the K/V they had at the
last full forward, as DualCache treats the blocks after the current one.

Both are approximations for a bidirectional model: cached K/V saw the canvas as it was when they
were computed. `refresh_every` bounds how stale they get; refreshing every step is exactly the
uncached computation.

The context lives in a buffer per canvas allocated once with room for the whole sequence (gpt-fast
style): freezing writes rows in place, and a step's attention writes its own K/V right after the
context and attends to a view of the buffer, so nothing is re-concatenated. A batch pads its members' contexts
into one buffer (`BatchContext`) that is kept across steps and only topped up with newly frozen rows.
Rows of a batch are right-padded; padding is masked out of attention with `key_valid` / `ctx_valid`,
and every row keeps its own absolute positions.

A block-causal model (SDAR, Fast-dLLM v2) masks by absolute position, so the context's rows carry
their positions too (`Canvas.kv_pos`, `ctx_pos` in `model.hidden`); the other topologies need none.
There the prefix's K/V are exact (no earlier block sees the canvas); the suffix's are stale only
where a suffix token shares a block with a slot or follows it, which the slots never see otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:  # the sampler imports this module; the type only matters to readers
    from engine.decode.canvas import Canvas, LayerKV
    from engine.model.transformer import Transformer

Rows = tuple[torch.Tensor, torch.Tensor]  # hidden states (R, D) and their absolute positions (R,)
T = TypeVar("T")


def need(value: T | None, what: str) -> T:
    """`value`, which a full forward set before any cached step reads it (Canvas.kv, frozen, slot_kv)."""
    if value is None:
        raise RuntimeError(f"{what} is not set: a cached step runs only after the canvas's first full forward")
    return value


def _split_kv(out: Any, want_kv: bool) -> tuple[torch.Tensor, LayerKV]:
    """model.hidden's answer as (hidden states, per layer (k, v)); no K/V (empty) unless `want_kv`."""
    if want_kv:
        h, kvs = out
        return h, kvs
    return out, []


def pad_stack(rows: list[torch.Tensor], fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pads 1-D rows to one (B, L) tensor; returns it and the (B, L) validity mask."""
    L = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), L), fill, dtype=rows[0].dtype, device=rows[0].device)
    valid = torch.zeros(len(rows), L, dtype=torch.bool, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        valid[i, : r.shape[0]] = True
    return out, valid


def freezable(c: Canvas) -> torch.Tensor:
    """(n,) slots whose K/V may live in the context: committed (so their input is their token) and,
    when logits are shifted, not needed as a query (slot j's hidden state predicts slot j+1)."""
    if not c.opts.freeze:
        return torch.zeros_like(c.masked)
    ok = ~c.masked
    if c.cfg.logits_shift:
        ok = ok.clone()
        ok[:-1] &= ~c.masked[1:]
    return ok


def run_positions(c: Canvas, outside: torch.Tensor | None = None) -> torch.Tensor:
    """(R,) absolute positions a cached step runs (ascending): the active span minus the frozen slots
    and minus the masked slots `outside` the window."""
    if c.n_frozen == 0 and outside is None:
        return c.active_pos
    keep = torch.ones(c.active_pos.shape[0], dtype=torch.bool, device=c.ids.device)
    shift = 1 if c.cfg.logits_shift else 0
    if c.n_frozen:
        keep[shift:] = ~need(c.frozen, "Canvas.frozen")
    if outside is not None:
        keep[shift + outside] = False
    return c.active_pos[keep]


def _by_position(c: Canvas) -> bool:
    """True when the model masks by absolute position, so the context needs its rows' positions."""
    return c.cfg.attention == "block_causal"


def forward_full(model: Transformer, canvases: list[Canvas]) -> list[Rows]:
    """One forward over each canvas's whole sequence (batched with padding); refills the context of
    canvases that cache. Returns per canvas the hidden states of its active span and their positions."""
    valid: torch.Tensor | None
    if len(canvases) == 1:
        ids, valid = canvases[0].ids[None], None  # (1, L): no padding, no mask
    else:
        ids, valid = pad_stack([c.ids for c in canvases], canvases[0].cfg.pad_token_id)
        valid = None if bool(valid.all()) else valid
    want_kv = any(c.opts.cache for c in canvases)
    h, kvs = _split_kv(model.hidden(ids, key_valid=valid, return_kv=want_kv), want_kv)  # kvs: every cache wants
    res = []
    for i, c in enumerate(canvases):
        a0, a1 = c.active
        res.append((h[i, a0:a1], c.active_pos))
        c.since_refresh = 1
        c.rows_forwarded += c.ids.shape[0]  # its own rows, not the batch's padding
        if not c.opts.cache:
            continue
        L = c.ids.shape[0]
        fz = freezable(c)
        keep = torch.ones(L, dtype=torch.bool, device=c.ids.device)
        keep[a0:a1] = False
        keep[c.start : c.start + c.n] |= fz
        idx = torch.nonzero(keep).flatten()  # (Lc,) context positions, in order
        if c.kv is None:
            shape = (1,) + kvs[0][0].shape[1:2] + (L,) + kvs[0][0].shape[3:]  # (1, H, L, Dh)
            c.kv = [
                (torch.empty(shape, dtype=k.dtype, device=k.device), torch.empty(shape, dtype=v.dtype, device=v.device))
                for k, v in kvs
            ]
        for (kb, vb), (k, v) in zip(c.kv, kvs):
            kb[0, :, : idx.numel()] = k[i, :, idx]
            vb[0, :, : idx.numel()] = v[i, :, idx]
        if _by_position(c):
            if c.kv_pos is None:
                c.kv_pos = torch.zeros(L, dtype=torch.long, device=c.ids.device)
            c.kv_pos[: idx.numel()] = idx
        c.ctx_len = idx.numel()
        if c.opts.window > 0:  # the slots' K/V as of now: masked slots right of later windows read them
            s0, s1 = c.start, c.start + c.n
            c.slot_kv = [(k[i : i + 1, :, s0:s1].clone(), v[i : i + 1, :, s0:s1].clone()) for k, v in kvs]
        c.frozen = fz.clone()
        c.n_frozen = int(fz.sum())
        c.ctx_version += 1
    return res


def _may_freeze(c: Canvas) -> bool:
    """True when some committed slot is not in the context yet (host-side counts, no sync)."""
    return c.opts.freeze and (c.n - c.n_masked) > c.n_frozen


def _freeze_rows(c: Canvas, run_pos: torch.Tensor, kvs: LayerKV, row: int) -> None:
    """Moves the K/V of slots that just ran with their committed token into the canvas's context."""
    frozen = need(c.frozen, "Canvas.frozen")
    slots = torch.nonzero(freezable(c) & ~frozen).flatten()
    if slots.numel() == 0:
        return
    rows = torch.searchsorted(run_pos, c.start + slots)  # every unfrozen slot ran this step
    k0, k1 = c.ctx_len, c.ctx_len + rows.numel()
    for (kb, vb), (k, v) in zip(need(c.kv, "Canvas.kv"), kvs):
        kb[0, :, k0:k1] = k[row, :, rows]
        vb[0, :, k0:k1] = v[row, :, rows]
    if c.kv_pos is not None:
        c.kv_pos[k0:k1] = c.start + slots
    c.ctx_len = k1
    frozen[slots] = True
    c.n_frozen += rows.numel()


class BatchContext:
    """The padded (B, H, Lc, Dh) context of a batch, kept across steps: rebuilt when the batch's
    members change, a member's row recopied when its context was refilled, and otherwise only topped
    up with the rows its members froze since the last step."""

    def __init__(self) -> None:
        self._members: list[Canvas] = []
        self._versions: list[int | None] = []
        self._copied: list[int] = []
        self._kv: LayerKV = []
        self._valid: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None  # (B, cap) the rows' absolute positions (block_causal)
        self.builds = 0  # how many times the padded buffer was allocated (tests, stats)

    def get(self, canvases: Sequence[Canvas]) -> tuple[LayerKV, int, torch.Tensor | None]:
        """Returns (per layer (k, v) buffers (B, H, cap, Dh) whose first Lc rows are the batch's
        padded context, Lc, ctx_valid (B, Lc) or None) for this batch, in order."""
        if len(canvases) != len(self._members) or any(a is not b for a, b in zip(canvases, self._members)):
            # room for the longest context, then the most outside slots and the most run rows after it
            B = len(canvases)
            cap = max(need(c.kv, "Canvas.kv")[0][0].shape[2] for c in canvases) + 2 * max(c.n for c in canvases) + 2
            self._kv = [
                (
                    torch.zeros((B,) + k.shape[1:2] + (cap,) + k.shape[3:], dtype=k.dtype, device=k.device),
                    torch.zeros((B,) + v.shape[1:2] + (cap,) + v.shape[3:], dtype=v.dtype, device=v.device),
                )
                for k, v in need(canvases[0].kv, "Canvas.kv")
            ]
            self._valid = torch.zeros(B, cap, dtype=torch.bool, device=canvases[0].ids.device)
            self._pos = torch.zeros(B, cap, dtype=torch.long, device=canvases[0].ids.device)
            self._members, self._versions, self._copied = list(canvases), [None] * B, [0] * B
            self.builds += 1
        for i, c in enumerate(canvases):
            valid, pos = need(self._valid, "BatchContext's validity"), need(self._pos, "BatchContext's positions")
            if self._versions[i] != c.ctx_version:  # refilled by a full forward: recopy the row
                self._versions[i], self._copied[i] = c.ctx_version, 0
                valid[i] = False
            a, b = self._copied[i], c.ctx_len
            if b > a:
                for (bk, bv), (k, v) in zip(self._kv, need(c.kv, "Canvas.kv")):
                    bk[i, :, a:b] = k[0, :, a:b]
                    bv[i, :, a:b] = v[0, :, a:b]
                if c.kv_pos is not None:
                    pos[i, a:b] = c.kv_pos[a:b]
                valid[i, a:b] = True
                self._copied[i] = b
        Lc = max(self._copied)
        return self._kv, Lc, (None if min(self._copied) == Lc else need(self._valid, "BatchContext's validity")[:, :Lc])

    def positions(self) -> torch.Tensor | None:
        """(B, cap) absolute positions of the buffer's rows (block-causal models; else unused)."""
        return self._pos

    def clear(self) -> None:
        self._members, self._versions, self._copied, self._kv, self._valid = [], [], [], [], None
        self._pos = None


def _write_outside(
    bufs: LayerKV, row: int, Lc: int, c: Canvas, outside: torch.Tensor, pos: torch.Tensor | None = None
) -> None:
    """Writes a canvas's masked slots right of its window (their K/V at the last full forward) into
    rows Lc.. of batch row `row` of the buffers (and their positions into `pos` (B, cap) if given)."""
    E = outside.numel()
    for (kb, vb), (sk, sv) in zip(bufs, need(c.slot_kv, "Canvas.slot_kv")):
        kb[row, :, Lc : Lc + E] = sk[0, :, outside]
        vb[row, :, Lc : Lc + E] = sv[0, :, outside]
    if pos is not None:
        pos[row, Lc : Lc + E] = c.start + outside


def _put_outside(
    bufs: LayerKV,
    Lc: int,
    canvases: Sequence[Canvas],
    outs: list[torch.Tensor | None],
    ctx_valid: torch.Tensor | None,
    pos: torch.Tensor | None = None,
) -> tuple[int, torch.Tensor]:
    """Batch version: each canvas's outside slots go into its row of the buffers after the padded
    context. Returns the new context length and its (B, Lc + E) validity."""
    B, E = len(canvases), max(0 if o is None else o.numel() for o in outs)
    dev = canvases[0].ids.device
    ev = torch.zeros(B, E, dtype=torch.bool, device=dev)
    for i, (c, o) in enumerate(zip(canvases, outs)):
        if o is not None:
            ev[i, : o.numel()] = True
            _write_outside(bufs, i, Lc, c, o, pos)
    cv = ctx_valid if ctx_valid is not None else torch.ones(B, Lc, dtype=torch.bool, device=dev)
    return Lc + E, torch.cat([cv, ev], 1)


def forward_cached(model: Transformer, canvases: list[Canvas], batch_ctx: BatchContext | None = None) -> list[Rows]:
    """A cheap step: only each canvas's unfrozen active positions run, attending to its cached
    context. Returns per canvas those positions' hidden states and the positions."""
    outs = [c.window_outside() for c in canvases]
    runs = [run_positions(c, o) for c, o in zip(canvases, outs)]
    want_kv = any(_may_freeze(c) for c in canvases)
    if len(canvases) == 1:
        c, rp, o = canvases[0], runs[0], outs[0]
        Lc = c.ctx_len
        kv = need(c.kv, "Canvas.kv")
        kv_pos = None if c.kv_pos is None else c.kv_pos[None]  # (1, L) block-causal only
        if o is not None:  # the outside slots' K/V go right after the context; the run rows after them
            _write_outside(kv, 0, Lc, c, o, kv_pos)
            Lc += o.numel()
        ctx = [(k, v, Lc) for k, v in kv]  # the buffer holds the whole sequence: room for every row
        # only block-causal models take positions (keyword arguments for model.hidden)
        extra: dict[str, Any] = {} if kv_pos is None else {"ctx_pos": kv_pos[:, :Lc]}
        out = model.hidden(c.ids[rp][None], pos=rp[None], ctx=ctx, return_kv=want_kv, **extra)  # (1, R, D)
    else:
        ids, valid = pad_stack([c.ids[rp] for c, rp in zip(canvases, runs)], canvases[0].cfg.pad_token_id)
        pos, _ = pad_stack(runs, 0)
        bctx = batch_ctx or BatchContext()
        bufs, Lc, ctx_valid = bctx.get(canvases)
        bpos = bctx.positions() if _by_position(canvases[0]) else None
        if any(o is not None for o in outs):
            Lc, ctx_valid = _put_outside(bufs, Lc, canvases, outs, ctx_valid, bpos)
        extra = {} if bpos is None else {"ctx_pos": bpos[:, :Lc]}  # as above
        out = model.hidden(
            ids,
            pos=pos,
            key_valid=None if bool(valid.all()) else valid,
            ctx=[(k, v, Lc) for k, v in bufs],
            ctx_valid=ctx_valid,
            return_kv=want_kv,
            **extra,
        )
    h, kvs = _split_kv(out, want_kv)  # kvs: only where a canvas may freeze rows
    res = []
    for i, (c, rp) in enumerate(zip(canvases, runs)):
        res.append((h[i, : rp.shape[0]], rp))
        c.since_refresh += 1
        c.rows_forwarded += rp.shape[0]
        if want_kv and _may_freeze(c):
            _freeze_rows(c, rp, kvs, i)
    return res
