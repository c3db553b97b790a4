"""Recipe (c): causal-attention diffusion with reordering (WeDLM-style), decoding.

The model is a plain causal decoder (`attention: "causal"`, `canvas: "reorder"` in config.json).
Rows are laid out in a *physical* order that differs from the text's *logical* order: observed tokens
first, masked slots last, every row at its logical position (RoPE positions = logical positions, the
`pos` of `Transformer.hidden`), strict causal attention in physical order. The logit at a masked slot
predicts that slot's own token (no shift). For a server-shaped fill:

    physical: [prefix][suffix][slots committed at step 1][... at step 2] ... [masked slots]
    logical:   0..P-1  P+n..   their slot positions P+j (in logical order within a step)   P+j

Because no row ever attends to a row after it, the K/V of the prefix, the suffix and every committed
slot never change once computed: the context is forwarded once, each step forwards only the slots
committed at the step before (their K/V join the cache, exactly) plus the masked slots, which attend to
the whole cache and causally to the masks left of them. Masks right of a sliding window are never seen
by those in it, so running only the window is exact too. The same property makes per-keystroke reuse
exact (`SessionCache`): a new request's context K/V are reused up to its first changed token.

A WeDLM checkpoint (family `wedlm`, engine/families/wedlm.py) decodes on the same canvas with its
authors' order instead: every committed slot in logical order, so only the left-contiguous committed
run is cached for good and the other committed slots are forwarded again each step,

    physical: [prefix][suffix][committed slots 0..r-1 (cached)][other committed slots][window masks]

with its streaming window (the masks within 16 positions of the leftmost one) and its selection rule.

Its training objective is in engine/train/objective.py (`layout`, `infill_example`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

import torch

from engine.api import DecodeOptions
from engine.decode.cache import BatchContext, Rows, need, pad_stack
from engine.decode.canvas import Canvas, LayerKV, trim_fill
from engine.families import wedlm
from engine.model.config import ModelConfig

if TYPE_CHECKING:
    from engine.model.transformer import Transformer

CUT_CHUNK = 64  # a too-long prefix is cut from the left in multiples of this many tokens (ReorderCanvas.build)

# ---------------------------------------------------------------- decoding


@dataclass
class ReorderCanvas(Canvas):
    """A Canvas (logical ids, masks, selection state: engine/decode/sampler.py's commit runs unchanged) whose
    K/V buffer holds, in physical order, the context [prefix][suffix] and then each committed slot.

    Two cache orders (`streaming`): recipe (c) caches every committed slot in the order it was
    committed; WeDLM (engine/families/wedlm.py) caches only the left-contiguous committed run, in
    logical order, and runs every other committed slot again each step, in logical order before the
    masks, as its authors' window does."""

    in_cache: list[bool] = field(default_factory=list)  # per slot: its committed token's K/V is cached
    cache_order: list[int] = field(default_factory=list)  # slots in the order their K/V joined the cache
    session: SessionCache | None = None  # per-keystroke reuse of the context's K/V (None: off)
    session_key: str | None = None
    reused: int = 0  # context rows taken from the session at the first forward (stats, tests): a full
    # recompute would have forwarded rows_forwarded + reused rows, since reuse changes only the first forward
    streaming: bool = False  # WeDLM's window and cache order
    keep: int = 0  # slots that make the fill (the rest: WeDLM's window past the last one); 0: all

    def __post_init__(self) -> None:
        self.in_cache = [False] * self.n
        self.streaming = self.cfg.family == "wedlm"
        self.keep = self.keep or self.n

    @classmethod
    def build(
        cls,
        prefix: list[int],
        suffix: list[int],
        n: int,
        cfg: ModelConfig,
        opts: DecodeOptions,
        context_tokens: int = 512,
        device: str | torch.device = "cpu",
        heal: list[int] | None = None,
        heal_then: dict[int, list[int]] | None = None,
    ) -> Self:
        """Canvas.build, except that a prefix too long for its room loses its head in whole chunks of
        CUT_CHUNK tokens, so its first rows (and every reusable K/V) stay put while the user types.
        WeDLM: its options (wedlm.options), and without a suffix WINDOW - 1 more slots after the n
        (where the authors' window runs past max_tokens), left out of the fill."""
        ctx = min(context_tokens, cfg.context_len or cfg.max_seq_len, cfg.max_seq_len)
        keep = n
        if cfg.family == "wedlm":
            opts = wedlm.options(opts)
            if not suffix:
                n = max(n, min(n + wedlm.WINDOW - 1, ctx))
        room = ctx - n
        p_room = room - min(len(suffix), room // 3)
        if room > 0 and len(prefix) > p_room:
            prefix = prefix[-(-(len(prefix) - p_room) // CUT_CHUNK) * CUT_CHUNK :]
        c = super().build(prefix, suffix, n, cfg, opts, context_tokens, device, heal, heal_then)
        c.keep = keep
        return c

    def fill_ids(self) -> list[int]:
        """Canvas.fill_ids over the first `keep` slots."""
        slots, masked = self.slot_ids()[: self.keep], self.masked.tolist()[: self.keep]
        return trim_fill([t for t, m in zip(slots, masked) if not m], self.cfg.pad_token_id, self.cfg.eos_token_id)

    def fill_confidence(self) -> float:
        """Canvas.fill_confidence over the first `keep` slots."""
        logs = []
        for t, m, p in zip(self.slot_ids()[: self.keep], self.masked.tolist(), self.slot_prob):
            if m or t == self.cfg.pad_token_id:
                continue
            if t == self.cfg.eos_token_id:
                break
            logs.append(math.log(max(p, 1e-12)))
        return math.exp(sum(logs) / len(logs)) if logs else 1.0

    def window_now(self, final: bool = False) -> int:
        """Canvas.window_now; WeDLM: the masked slots within WINDOW positions of the leftmost one
        (0: all of them, or a final step)."""
        if not self.streaming:
            return super().window_now(final)
        if final or self.last_step_due():
            return 0
        ms = self.masked_slots().tolist()
        k = wedlm.window_masks(ms)
        return 0 if k == len(ms) else k

    def joining(self, new: list[int]) -> list[int]:
        """The slots of `new` (committed, not cached, ascending) whose K/V this forward computes for
        good: all of them (recipe (c)); WeDLM: those extending the cached left-contiguous run."""
        if not self.streaming:
            return new
        out, j = [], len(self.cache_order)
        for s in new:
            if s != j:
                break
            out.append(s)
            j += 1
        return out

    def needs_full(self) -> bool:
        # exact cache: no refresh ever needed; cache=False recomputes the whole reordered row each step
        return (not self.opts.cache) or self.kv is None

    def context_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Lc,) ids and (Lc,) logical positions of the context: the prefix, then the suffix."""
        L, s, n = self.ids.shape[0], self.start, self.n
        pos = torch.cat([torch.arange(0, s), torch.arange(s + n, L)]).to(self.ids.device)
        return self.ids[pos], pos

    def pending(self) -> list[int]:
        """Slots committed since the last forward (their K/V are not cached yet), in logical order."""
        return [j for j, (m, c) in enumerate(zip(self.masked.tolist(), self.in_cache)) if not m and not c]

    def run_slots(self) -> torch.Tensor:
        """(M,) masked slots this step predicts (ascending): the window's, or all of them."""
        w = self.window_now(self.final_step)
        ms = self.masked_slots()
        return ms[:w] if w else ms

    def _cached(self, slots: list[int]) -> None:
        for j in slots:
            self.in_cache[j] = True
        self.cache_order += slots


def _alloc(c: ReorderCanvas, kvs: LayerKV) -> LayerKV:
    """K/V buffers (1, Hkv, L, Dh) per layer: room for the context, every slot, and a step's run rows
    (the canvas's `kv`, returned)."""
    k0, v0 = kvs[0]
    shape = (1, k0.shape[1], c.ids.shape[0], k0.shape[3])
    c.kv = [
        (torch.empty(shape, dtype=k0.dtype, device=k0.device), torch.empty(shape, dtype=v0.dtype, device=v0.device))
        for _ in kvs
    ]
    return c.kv


def _forward_full(model: Transformer, c: ReorderCanvas) -> Rows:
    """The whole reordered row in one forward: context, committed slots (cache order, then the last
    step's; WeDLM: logical order), masked slots. Fills the canvas's cache with everything but the
    masks (WeDLM: with the left-contiguous committed run only). With a session, the context's K/V are
    reused up to its first changed row and only the rest is run."""
    ctx_ids, ctx_pos = c.context_rows()
    kv = c.kv
    first = kv is None
    done = c.cache_order + c.pending()
    slots = torch.tensor(done, dtype=torch.long, device=c.ids.device) + c.start
    masks = c.run_slots() + c.start
    ids = torch.cat([ctx_ids, c.ids[slots], c.ids[masks]])
    pos = torch.cat([ctx_pos, slots, masks])
    session, key = c.session, c.session_key
    k = 0
    if session is not None and key is not None and first:
        got, past = session.lookup(key, ctx_ids, ctx_pos)
        if got and past is not None:  # lookup gives the K/V whenever it reuses rows
            k = got
            kv = _alloc(c, past)
            for (kb, vb), (pk, pv) in zip(kv, past):
                kb[:, :, :k] = pk[:, :, :k]
                vb[:, :, :k] = pv[:, :, :k]
            c.reused = k
    # with reused rows, only the rows from the first changed one run, against them (written in place after them)
    if k and kv is not None:
        h = model.hidden(
            ids[k:][None],
            pos=pos[k:][None],
            ctx=[(kb, vb, k) for kb, vb in kv],
            key_valid=torch.ones(1, ids.shape[0] - k, dtype=torch.bool, device=ids.device),
        )
    else:
        h, kvs = model.hidden(ids[None], pos=pos[None], return_kv=True)  # (1, R, D)
        if kv is None:  # the first forward
            kv = _alloc(c, kvs)
        for (kb, vb), (kk, vv) in zip(kv, kvs):
            kb[:, :, : kk.shape[2]] = kk
            vb[:, :, : vv.shape[2]] = vv
    c.rows_forwarded += ids.shape[0] - k
    Lc = ctx_ids.shape[0]
    if session is not None and key is not None and first:
        session.store(key, ctx_ids, ctx_pos, [(kb[:, :, :Lc], vb[:, :, :Lc]) for kb, vb in kv])
    c.cache_order = []
    c.in_cache = [False] * c.n
    join = c.joining(done)  # recipe (c): every committed slot; WeDLM: the run from slot 0 (first in `done`)
    c._cached(join)
    c.ctx_len = Lc + len(join)
    c.ctx_version += 1
    c.since_refresh = 1
    return h[0, Lc + len(done) - k :], masks


def _forward_cached(model: Transformer, canvases: list[ReorderCanvas], batch_ctx: BatchContext | None) -> list[Rows]:
    """One step for canvases with a cache: each runs its committed slots not cached yet (recipe (c):
    the last step's commits; WeDLM: every committed slot right of the left-contiguous run), then its
    masked slots."""
    plans = []
    for c in canvases:
        new = c.pending()
        slots = torch.tensor(new, dtype=torch.long, device=c.ids.device) + c.start
        masks = c.run_slots() + c.start
        plans.append((new, torch.cat([slots, masks]), masks))
    if len(canvases) == 1:
        c, (new, run, masks) = canvases[0], plans[0]
        # the step's K/V land right after the context in the canvas's own buffer (model.hidden's
        # (k_buf, v_buf, n) form), so the new commits' rows are cached in place; the masks' are overwritten
        # next step. key_valid forces the explicit causal mask (also with an empty context).
        h = model.hidden(
            c.ids[run][None],
            pos=run[None],
            ctx=[(kb, vb, c.ctx_len) for kb, vb in need(c.kv, "Canvas.kv")],
            key_valid=torch.ones(1, run.shape[0], dtype=torch.bool, device=run.device),
        )
        join = c.joining(new)  # the first of the run's rows: their K/V stay where they were written
        c._cached(join)
        c.ctx_len += len(join)
        c.since_refresh += 1
        c.rows_forwarded += run.shape[0]
        return [(h[0, len(new) :], masks)]
    ids, valid = pad_stack([c.ids[run] for c, (_, run, _) in zip(canvases, plans)], canvases[0].cfg.pad_token_id)
    pos, _ = pad_stack([run for _, run, _ in plans], 0)
    bctx = batch_ctx or BatchContext()
    bufs, Lc, ctx_valid = bctx.get(canvases)  # each member's cache, padded, topped up with last step's rows
    h, kvs = model.hidden(
        ids, pos=pos, key_valid=valid, ctx=[(k, v, Lc) for k, v in bufs], ctx_valid=ctx_valid, return_kv=True
    )
    out = []
    for i, (c, (new, run, masks)) in enumerate(zip(canvases, plans)):
        join = c.joining(new)
        g = len(join)
        for (kb, vb), (kk, vv) in zip(need(c.kv, "Canvas.kv"), kvs):  # the new commits' K/V join the canvas's own cache
            kb[0, :, c.ctx_len : c.ctx_len + g] = kk[i, :, :g]
            vb[0, :, c.ctx_len : c.ctx_len + g] = vv[i, :, :g]
        c._cached(join)
        c.ctx_len += g
        c.since_refresh += 1
        c.rows_forwarded += run.shape[0]
        out.append((h[i, len(new) : len(new) + masks.shape[0]], masks))
    return out


def forward(model: Transformer, canvases: list[ReorderCanvas], batch_ctx: BatchContext | None = None) -> list[Rows]:
    """sampler.forward for the reorder layout: per canvas the hidden states of the masked slots the
    step predicts and their logical positions (ascending), which is what sampler.commit reads."""
    full = [c for c in canvases if c.needs_full()]
    cached = [c for c in canvases if not c.needs_full()]
    hs = {id(c): _forward_full(model, c) for c in full}
    if cached:
        hs.update(zip(map(id, cached), _forward_cached(model, cached, batch_ctx)))
    return [hs[id(c)] for c in canvases]


def reference_logits(model: Transformer, seq: list[int], start: int, n: int, groups: list[list[int]]) -> torch.Tensor:
    """The oracle's forward (sampler.reference_fill): the whole reordered row recomputed - prefix,
    suffix, each step's commits (`groups`, in logical order), then every masked slot - and its logits
    put back in logical order, (L, V)."""
    L = len(seq)
    done = [j for g in groups for j in g]
    order = (
        list(range(start))
        + list(range(start + n, L))
        + [start + j for j in done]
        + [start + j for j in range(n) if j not in done]
    )
    logits = model(torch.tensor([[seq[p] for p in order]]), pos=torch.tensor([order]))[0]
    out = torch.empty_like(logits)
    out[torch.tensor(order)] = logits
    return out


# ---------------------------------------------------------------- per-keystroke reuse


class SessionCache:
    """Per session key (a document), the last request's context ids, positions and per-layer K/V.
    A new request reuses the rows up to its first changed (id, position) row: exact for this layout,
    since a row's K/V depend only on the rows before it. At most `size` sessions (least recent out)."""

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor, LayerKV]] = OrderedDict()
        self.stats = {"lookups": 0, "hits": 0, "rows_reused": 0, "rows_total": 0}

    def lookup(self, key: str, ids: torch.Tensor, pos: torch.Tensor) -> tuple[int, LayerKV | None]:
        """(k, per-layer K/V) with k the number of leading context rows equal to the stored ones
        (K/V None when k is 0)."""
        self.stats["lookups"] += 1
        self.stats["rows_total"] += ids.shape[0]
        e = self._entries.get(key)
        if e is None:
            return 0, None
        old_ids, old_pos, kv = e
        m = min(ids.shape[0], old_ids.shape[0])
        same = (ids[:m] == old_ids[:m]) & (pos[:m] == old_pos[:m])
        k = m if bool(same.all()) else int(torch.nonzero(~same)[0])
        if k == 0:
            return 0, None
        self._entries.move_to_end(key)
        self.stats["hits"] += 1
        self.stats["rows_reused"] += k
        return k, kv

    def clear(self) -> None:
        self._entries.clear()

    def store(self, key: str, ids: torch.Tensor, pos: torch.Tensor, kv: LayerKV) -> None:
        self._entries[key] = (ids.clone(), pos.clone(), [(k.clone(), v.clone()) for k, v in kv])
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)


__all__ = ["ReorderCanvas", "SessionCache", "forward", "reference_logits"]
