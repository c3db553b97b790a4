"""The fixed-shape cached step: a batch of canvases denoised by one forward and one commit whose every
shape is a bucket, with no host sync inside, so it compiles to one graph and can be CUDA-graph captured.

The eager cached step (engine/decode/cache.py + engine/decode/sampler.py `commit`) runs as many rows as
are live this step, builds its index tensors from Python lists, concatenates contexts, and decides the
commits on the host: on a GPU it is launch- and sync-bound. This step keeps the same decoding rule
(DualCache context, dKV freezing, the sliding window, LLaDA blocks, `pad_left`, `pad_stop`,
`stop_below`, block-causal order, threshold / top-k selection; engine/decode/sampler.py says what each
means) and lays the state out once per batch:

  K/V      (n_layers, B, Hkv, N, Dh), one buffer for every layer, N = C + T + 1 rows per batch slot:
           [0, C) the context a full forward left (Canvas.kv's first ctx_len rows, in its order),
           [C, C + T) the active span's rows by position (T = S + 1 for S slots: the logit-shift row
           first when the family shifts), row N - 1 a trash row that padded run rows write to
  rows     (B, T) token ids, positions; (B, S) masked / frozen / in-context flags and probabilities
  options  per batch slot as (B,) tensors, so one graph serves every job's options

A step's run rows are the live rows (not frozen, not masked right of the window) gathered to the front
of the span and padded to a bucket of ROWS (the host knows how many are live from the last step's
read-back, so it picks the bucket without a sync); each layer scatters their K/V into the span's rows
(frozen and outside-window rows keep the K/V they were last written with, as the eager step keeps them
in its context) and attends to all N rows under a mask built on the device. Selection, the end-of-fill
cut and freezing are tensor ops over (B, S). After the step the host reads one small (B, 2 + S) tensor:
how many slots are masked and committed-but-unfrozen per canvas, and the slots' probabilities.

Full forwards (a canvas's first, refreshes, a reuse session's first) stay with the eager path, and
`load` copies what they leave into the batch's buffers; so do canvases this step does not take
(`takes`: the biases that read the committed text on the host, sampling, healing while open, DreamOn,
the reorder layout). A canvas that leaves this step for the eager one is refreshed first (`release`).

On CUDA each (batch shape, run bucket) is captured once as a CUDA graph, warmed up when the shape is
first allocated so no user fill waits for a capture; on a CPU the step runs eagerly (torch.compile
did not beat the eager loop on the default model there) unless asked for (`mode="compile"`).
tests/test_static_step.py checks fills token for token against the eager loop, the one read-back per
step, and that the step compiles with fullgraph=True at every run bucket.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kernels import slot_stats

if TYPE_CHECKING:
    from engine.decode.canvas import Canvas
    from engine.model.transformer import Transformer

ROWS = (16, 32, 48, 64)  # run-row buckets; beyond the last, multiples of 16
SLOTS = (16, 32, 64, 128, 256, 512)  # slot-count buckets (S)
CONTEXT = (128, 256, 512, 1024, 2048, 4096, 8192)  # context-row buckets (C)
BATCH = (1, 2, 4, 8, 16)  # batch-slot buckets (B)
MODES = ("off", "eager", "compile", "graph")
CONFIDENCE_CODES = {"max_prob": 0, "margin": 1, "neg_entropy": 2}


def bucket(n: int, sizes: Sequence[int], step: int = 16) -> int:
    """The smallest size >= n, or n rounded up to `step` past the last."""
    for s in sizes:
        if n <= s:
            return s
    return -(-n // step) * step


def takes(c: Canvas) -> bool:
    """True when this canvas's next step can be the fixed-shape cached step: a plain layout with a
    cached context, and no lever that reads the committed text on the host or samples."""
    o, cfg = c.opts, c.cfg
    return (
        o.cache
        and not c.needs_full()
        and cfg.canvas is None
        and cfg.attention in ("bidirectional", "block_causal")
        and cfg.family != "wedlm"
        and o.temperature == 0
        and o.selection in ("threshold", "topk", "timesteps")
        and o.confidence in CONFIDENCE_CODES
        and o.top_k is None
        and not c.heal_open
        and c.middle is None
        and c.copy is None
        and c.names is None
        and c.ngram is None
        and c.local is None
        and c.workspace is None
        and c.edit_bias is None
    )


def release(c: Canvas) -> None:
    """A canvas leaving the fixed-shape step for the eager one: its eager context is stale, so its
    next step is a full forward (exactly what a refresh would do)."""
    c.kv = None


# ---------------------------------------------------------------- device state


@dataclass
class Shape:
    B: int  # batch slots
    S: int  # slots per canvas
    C: int  # context rows

    @property
    def T(self) -> int:  # span rows: the slots and the shift row
        return self.S + 1

    @property
    def N(self) -> int:  # key rows: context, span, trash
        return self.C + self.T + 1


class State:
    """Every tensor the step reads and writes, allocated once per Shape (their addresses are what a
    CUDA graph replays)."""

    def __init__(self, model: Transformer, shape: Shape, device: torch.device):
        cfg = model.cfg
        B, S, T, N = shape.B, shape.S, shape.T, shape.N
        dt = model.tok_embeddings.weight.dtype
        kv = (cfg.n_layers, B, cfg.kv_heads, N, cfg.head_dim)
        self.shape = shape
        self.k = torch.zeros(kv, dtype=dt, device=device)
        self.v = torch.zeros(kv, dtype=dt, device=device)
        z = lambda *s, dtype=torch.long: torch.zeros(s, dtype=dtype, device=device)  # noqa: E731
        self.key_ok = z(B, N, dtype=torch.bool)  # a valid key row (context rows, the span's own)
        self.key_pos = z(B, N)  # absolute position of every key row (block-causal masks)
        self.row_ids = z(B, T)  # the span's tokens by row
        self.masked = z(B, S, dtype=torch.bool)
        self.frozen = z(B, S, dtype=torch.bool)  # K/V kept (in the context or the span), not run
        self.slot_prob = z(B, S, dtype=torch.float32)
        # per batch slot options and layout
        self.start = z(B)  # position of slot 0
        self.shift = z(B)  # 1 when the family's logits are shifted (row 0 is the prefix's last token)
        self.n = z(B)  # slots in use
        self.window = z(B)
        self.block = z(B)
        self.pad_left = z(B, dtype=torch.bool)
        self.topk = z(B, dtype=torch.bool)  # top-k (or timesteps) selection, else threshold
        self.freeze = z(B, dtype=torch.bool)
        self.cut = z(B, dtype=torch.bool)  # block > 0 or pad_left or window > 0: an end cuts the tail
        self.conf_kind = z(B)  # CONFIDENCE_CODES
        self.tau = z(B, dtype=torch.float64)  # threshold, compared in float64 as the host compares
        self.pad_stop = z(B, dtype=torch.float64)
        self.stop_below = z(B, dtype=torch.float64)
        self.ends = torch.full((B, 8), -1, dtype=torch.long, device=device)  # end ids (padding, end, stops)
        # per step inputs, written by the host before each step
        self.final = z(B, dtype=torch.bool)  # commit every masked slot (deadline, step budget)
        self.k_plan = z(B)  # top-k: slots to commit this step
        self.out = z(B, 2 + S, dtype=torch.float32)  # the read-back: masked, unfrozen committed, probs
        self.key_ok[:, 0] = True  # a free batch slot attends somewhere: no NaN rows

    def tensors(self) -> list[torch.Tensor]:
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor)]

    def clone(self) -> State:
        """A copy with its own tensors (tests run one step two ways from the same state)."""
        out = copy.copy(self)
        for name, v in vars(self).items():
            if isinstance(v, torch.Tensor):
                setattr(out, name, v.clone())
        return out


@dataclass
class Member:
    canvas: Canvas
    slot: int
    version: int = -1  # Canvas.ctx_version loaded
    n_masked: int = 0
    unfrozen: int = 0  # committed slots not frozen yet (they run once more)


@dataclass
class Counters:
    steps: int = 0
    reads: int = 0  # device-to-host reads (one per step)
    loads: int = 0
    allocs: int = 0  # State allocations (growth); leaving never allocates
    captures: int = 0
    by_rows: dict[int, int] = field(default_factory=dict)


# ---------------------------------------------------------------- the step (no host sync below)


def _positions(s: State, R: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T) live rows, (B, R) the run rows' span indices (live first, in position order) and (B, R)
    which of them are live."""
    B, S = s.masked.shape
    T = S + 1
    j = torch.arange(S, device=s.masked.device)[None]  # (1, S)
    rank = s.masked.long().cumsum(1)  # (B, S) 1-based rank of each masked slot
    wide = s.final | (s.window == 0)
    in_window = wide[:, None] | (rank <= s.window[:, None])
    slot_live = ~s.frozen & ~(s.masked & ~in_window) & (j < s.n[:, None])  # (B, S)
    # row r holds position start - shift + r: slot r - shift, or the shift row (always live)
    r = torch.arange(T, device=s.masked.device)[None]  # (1, T)
    slot_of_row = (r - s.shift[:, None]).clamp(0, S - 1)
    live = torch.where(r < s.shift[:, None], True, slot_live.gather(1, slot_of_row))
    live &= r < (s.n + s.shift)[:, None]
    order = torch.sort((~live).to(torch.uint8), dim=1, stable=True).indices[:, :R]  # live first, by position
    return live, order, live.gather(1, order)


def _attention_mask(s: State, model: Transformer, q_pos: torch.Tensor) -> torch.Tensor:
    """(B, 1, R, N) True = attend: every valid key; block-causal families also by block order."""
    ok = s.key_ok[:, None, :].expand(-1, q_pos.shape[1], -1)  # (B, R, N)
    bs = model.cfg.block_size
    if model.cfg.attention == "block_causal" and bs:
        ok = ok & ((s.key_pos[:, None, :] // bs) <= (q_pos[:, :, None] // bs))
    return ok[:, None]


def _is_end(s: State, ids: torch.Tensor) -> torch.Tensor:
    """(B, S) True where ids are one of the canvas's end ids."""
    return (ids[:, :, None] == s.ends[:, None, :]).any(-1)


def _first(mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the first True per row (S when none)."""
    S = mask.shape[1]
    j = torch.arange(S, device=mask.device)[None]
    return torch.where(mask, j, S).amin(1)


def _select(
    s: State,
    model: Transformer,
    conf: torch.Tensor,
    max_p: torch.Tensor,
    pred: torch.Tensor,
    predicted: torch.Tensor,
    block_unit: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots to commit (B, S) and their tokens: engine/decode/sampler.py select_slots + pad_after_end."""
    B, S = s.masked.shape
    j = torch.arange(S, device=conf.device)[None]
    cfg = model.cfg
    ends = _is_end(s, pred)
    first = _first(s.masked)  # (B,) the leftmost masked slot
    leftmost = j == first[:, None]
    maxp64, conf64 = max_p.double(), conf.double()
    # everything at once: a final step, or every predicted slot is confidently an end
    sure_end = ends & (maxp64 >= s.pad_stop[:, None])
    commit_all = s.final | ~(predicted & ~sure_end).any(1)
    elig = predicted
    blk = s.block[:, None].clamp_min(1)
    elig = elig & ((s.block[:, None] <= 0) | (j < (first[:, None] // blk + 1) * blk))
    e2 = elig & (leftmost | ~ends)  # pad_left: padding only at the leftmost masked slot
    e2 = torch.where(e2.any(1, keepdim=True), e2, leftmost)
    elig = torch.where(s.pad_left[:, None], e2, elig)
    bs, unit = block_unit
    if bs:  # block-causal: the authors' block / sub-block order (engine/families/blocks.py)
        first_pos = s.start + first
        slot_pos = s.start[:, None] + j
        e3 = elig & ((slot_pos // unit) == (first_pos // unit)[:, None])
        e3 = torch.where(e3.any(1, keepdim=True), e3, leftmost)
        if cfg.logits_shift:  # a block's first position is committed alone
            e3 = torch.where((first_pos % bs == 0)[:, None], leftmost, e3)
        elig = e3
    conf_e = torch.where(elig, conf64, -math.inf)
    over = elig & (conf64 >= s.tau[:, None])
    best = j == conf_e.argmax(1, keepdim=True)  # the first maximum: the leftmost on ties
    thr = torch.where(over.any(1, keepdim=True), over, best)
    # top-k: the k most confident eligible slots, leftmost first on ties (a stable sort)
    order = torch.sort(conf_e, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, j.expand(B, S))
    k = torch.minimum(s.k_plan.clamp_min(1), elig.sum(1))
    top = elig & (rank < k[:, None])
    pick = torch.where(s.topk[:, None], top, thr)
    # stop when unsure at the leftmost masked slot (threshold selection only)
    p_first = maxp64.gather(1, first.clamp_max(S - 1)[:, None])[:, 0]
    stop = (
        ~s.topk & (s.stop_below > 0) & (elig & leftmost).any(1) & ~over.any(1) & (p_first < s.stop_below) & ~commit_all
    )
    pick = torch.where(stop[:, None], leftmost, pick)
    pick = torch.where(commit_all[:, None], predicted, pick)
    eos = cfg.eos_token_id
    values = torch.where(stop[:, None] & leftmost, eos, pred)
    # an end committed ends the fill: every masked slot after the first one is padding
    picked_end = pick & _is_end(s, values)
    first_end = _first(picked_end)
    tail = s.cut[:, None] & s.masked & (j > first_end[:, None])
    values = torch.where(tail, cfg.pad_token_id, values)
    at_end = (j == first_end[:, None]) & s.cut[:, None] & s.pad_left[:, None]
    values = torch.where(at_end, eos, values)
    return pick | tail, values


def cached_step(model: Transformer, s: State, R: int, block_unit: tuple[int, int]) -> None:
    """One fixed-shape cached step for every batch slot: R run rows each, one forward, one stats
    pass for the whole batch, the commits written into `s`. No host sync, no data-dependent shape."""
    B, S = s.masked.shape
    C = s.k.shape[3] - S - 2
    live, order, run_live = _positions(s, R)
    ids = s.row_ids.gather(1, order)  # (B, R)
    pos = (s.start - s.shift)[:, None] + order  # (B, R) absolute positions
    trash = s.k.shape[3] - 1
    at = torch.where(run_live, C + order, trash)  # padded run rows write to the trash row
    mask = _attention_mask(s, model, pos)
    pos = pos.clamp_max(model.cfg.max_seq_len - 1)  # padded rows only: live rows were checked on the host
    h = model.hidden_rows(ids, pos, mask, s.k, s.v, at)  # (B, R, D)
    # the hidden state at row r predicts slot r (shifted families: row 0 is the prefix's last token)
    max_p, pred, top2_p, ent = slot_stats(
        h.reshape(B * R, -1), model.norm.weight, model.norm.eps, model.head_weight, model.cfg.mask_token_id
    )

    def by_row(x: torch.Tensor, fill: float) -> torch.Tensor:  # (B * R,) run rows -> (B, S) slots
        out = torch.full((B, S + 1), fill, dtype=x.dtype, device=x.device)
        return out.scatter(1, order, x.view(B, R))[:, :S]

    max_p, pred, top2_p, ent = by_row(max_p, 0.0), by_row(pred, 0), by_row(top2_p, 0.0), by_row(ent, 0.0)
    kind = s.conf_kind[:, None]
    conf = torch.where(kind == 0, max_p, torch.where(kind == 1, max_p - top2_p, -ent))
    j = torch.arange(S, device=h.device)[None]
    rank = s.masked.long().cumsum(1)
    in_window = (s.final | (s.window == 0))[:, None] | (rank <= s.window[:, None])
    predicted = s.masked & in_window
    pick, values = _select(s, model, conf, max_p, pred, predicted, block_unit)
    # freezing (dKV): slots committed before this step, that ran in it, keep their K/V from now on
    freezable = ~s.masked
    if model.cfg.logits_shift:  # slot j's row also predicts slot j + 1: it must stay a query until that commits
        freezable = freezable & torch.cat([~s.masked[:, 1:], torch.ones_like(s.masked[:, :1])], 1)
    s.frozen |= s.freeze[:, None] & freezable & (j < s.n[:, None])
    # the commits
    newly = pick & s.masked
    s.slot_prob.copy_(torch.where(pick & predicted, max_p, s.slot_prob))
    shifted = s.shift[:, None] == 1
    old = torch.where(shifted, s.row_ids[:, 1:], s.row_ids[:, :S])
    new = torch.where(newly, values, old)
    s.row_ids.copy_(torch.where(shifted, torch.cat([s.row_ids[:, :1], new], 1), torch.cat([new, s.row_ids[:, S:]], 1)))
    s.masked &= ~newly
    s.out[:, 0] = s.masked.sum(1).float()
    s.out[:, 1] = (~s.masked & ~s.frozen & (j < s.n[:, None])).sum(1).float()
    s.out[:, 2:] = s.slot_prob


# ---------------------------------------------------------------- the host side


class StaticStep:
    """The batch's fixed-shape state and its steps. `mode`: "eager" runs cached_step as it is,
    "compile" through torch.compile(fullgraph=True), "graph" captures a CUDA graph per (shape, run
    bucket). One per engine; members join when their canvas first takes the step, leave when done."""

    def __init__(self, model: Transformer, mode: str = "eager", device: torch.device | str = "cpu"):
        if mode not in MODES or mode == "off":
            raise ValueError(f"mode must be one of {MODES[1:]}, got {mode!r}")
        if mode == "graph" and torch.device(device).type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.mode, self.device = model, mode, torch.device(device)
        self.state: State | None = None
        self.members: dict[int, Member] = {}  # id(canvas) -> member
        self.counters = Counters()
        cfg = model.cfg
        sub = getattr(cfg, "sub_block_size", 0) or 0
        bs = cfg.block_size if cfg.attention == "block_causal" else 0
        self.block_unit = (bs, sub if sub and bs and bs % sub == 0 else bs)
        self._compiled: Callable[..., None] | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.on_read: Callable[[], None] = lambda: None  # tests count the read-backs

    # ---- membership

    def _shape_for(self, canvases: Sequence[Canvas]) -> Shape:
        have = self.state.shape if self.state is not None else Shape(0, 0, 0)
        need_b = len({id(c) for c in canvases} | set(self.members))
        need_s = max(c.n for c in canvases)
        need_c = max(c.ids.shape[0] for c in canvases)
        return Shape(
            max(have.B, bucket(need_b, BATCH, 16)),
            max(have.S, bucket(need_s, SLOTS, 64)),
            max(have.C, bucket(need_c, CONTEXT, 1024)),
        )

    def _grow(self, shape: Shape) -> None:
        """A new State for a larger shape, the members' rows copied over (joins past the capacity only)."""
        old = self.state
        new = State(self.model, shape, self.device)
        self._warm(new)
        if old is not None:
            ob, os_, oc = old.shape.B, old.shape.S, old.shape.C
            for name, t in vars(old).items():
                if not isinstance(t, torch.Tensor) or name == "shape":
                    continue
                dst = getattr(new, name)
                if name in ("k", "v"):  # context rows keep their index; the span moves with C
                    dst[:, :ob, :, :oc] = t[:, :, :, :oc]
                    dst[:, :ob, :, shape.C : shape.C + os_ + 1] = t[:, :, :, oc : oc + os_ + 1]
                elif name in ("key_ok", "key_pos"):
                    dst[:ob, :oc] = t[:, :oc]
                    dst[:ob, shape.C : shape.C + os_ + 1] = t[:, oc : oc + os_ + 1]
                    if name == "key_ok":
                        dst[:, shape.N - 1] = False
                        dst[ob:, 0] = True
                elif t.dim() == 2 and name != "ends":
                    dst[:ob, : t.shape[1]] = t
                else:
                    dst[:ob] = t
        self.state = new
        self.counters.allocs += 1

    @torch.inference_mode()
    def reserve(self, batch: int, slots: int, context: int) -> None:
        """Allocates (and in graph mode captures) the state for this many jobs, slots and context
        tokens now, so no user fill waits for an allocation or a capture (the service's warm-up)."""
        want = Shape(bucket(batch, BATCH, 16), bucket(slots, SLOTS, 64), bucket(context, CONTEXT, 1024))
        have = self.state.shape if self.state is not None else Shape(0, 0, 0)
        shape = Shape(max(want.B, have.B), max(want.S, have.S), max(want.C, have.C))
        if shape != have:
            self._grow(shape)

    def _free_slot(self) -> int:
        used = {m.slot for m in self.members.values()}
        assert self.state is not None
        return next(b for b in range(self.state.shape.B) if b not in used)

    @torch.inference_mode()
    def leave(self, c: Canvas) -> None:
        """Frees the canvas's batch slot (its rows stop attending and committing); nothing is rebuilt."""
        m = self.members.pop(id(c), None)
        if m is None or self.state is None:
            return
        s, b = self.state, m.slot
        s.masked[b] = False
        s.n[b] = 0
        s.key_ok[b] = False
        s.key_ok[b, 0] = True

    def clear(self) -> None:
        for m in list(self.members.values()):
            release(m.canvas)
        self.members.clear()
        self.state = None
        self._graphs.clear()

    def load(self, m: Member) -> None:
        """Copies a canvas's state after an eager full forward (or the eager steps before it took this
        step) into its batch slot: the context rows as Canvas.kv has them, the span's rows, the flags."""
        c, s, b = m.canvas, self.state, m.slot
        assert s is not None and c.kv is not None and c.frozen is not None
        C, S = s.shape.C, s.shape.S
        shift = 1 if c.cfg.logits_shift else 0
        a0, Lc, n = c.start - shift, c.ctx_len, c.n
        for i, (kb, vb) in enumerate(c.kv):
            s.k[i, b, :, :Lc] = kb[0, :, :Lc]
            s.v[i, b, :, :Lc] = vb[0, :, :Lc]
            if c.slot_kv is not None:  # the slots' K/V at the last full forward (read right of the window)
                sk, sv = c.slot_kv[i]
                s.k[i, b, :, C + shift : C + shift + n] = sk[0]
                s.v[i, b, :, C + shift : C + shift + n] = sv[0]
        s.key_ok[b] = False
        s.key_ok[b, :Lc] = True
        span_ok = torch.zeros(S + 1, dtype=torch.bool, device=self.device)
        span_ok[: n + shift] = True
        span_ok[shift : shift + n] &= ~c.frozen  # frozen slots are in the context rows already
        s.key_ok[b, C : C + S + 1] = span_ok
        s.key_pos[b] = 0
        if c.kv_pos is not None:
            s.key_pos[b, :Lc] = c.kv_pos[:Lc]
        s.key_pos[b, C : C + S + 1] = torch.arange(a0, a0 + S + 1, device=self.device)
        s.row_ids[b] = c.cfg.pad_token_id
        s.row_ids[b, : n + shift] = c.ids[a0 : a0 + n + shift]
        s.masked[b] = False
        s.masked[b, :n] = c.masked
        s.frozen[b] = False
        s.frozen[b, :n] = c.frozen
        s.slot_prob[b] = 0.0
        s.slot_prob[b, :n] = torch.tensor(c.slot_prob, dtype=torch.float32)
        o = c.opts
        s.start[b], s.shift[b], s.n[b] = c.start, shift, n
        s.window[b], s.block[b] = o.window, o.block
        s.pad_left[b], s.freeze[b] = o.pad_left, o.freeze
        s.topk[b] = o.selection != "threshold"
        s.cut[b] = o.block > 0 or o.pad_left or o.window > 0
        s.conf_kind[b] = CONFIDENCE_CODES[o.confidence]
        s.tau[b], s.pad_stop[b], s.stop_below[b] = o.threshold, o.pad_stop, o.stop_below or 0.0
        ends = end_ids(c)
        if len(ends) > s.ends.shape[1]:
            raise ValueError(f"{len(ends)} end ids: the fixed-shape step takes at most {s.ends.shape[1]}")
        s.ends[b] = -1
        s.ends[b, : len(ends)] = torch.tensor(ends, dtype=torch.long)
        m.version = c.ctx_version
        m.n_masked = c.n_masked
        m.unfrozen = c.n - c.n_masked - c.n_frozen
        self.counters.loads += 1

    # ---- stepping

    def _run(self, R: int) -> None:
        s = self.state
        assert s is not None
        if self.mode == "eager":
            cached_step(self.model, s, R, self.block_unit)
        elif self.mode == "compile":
            if self._compiled is None:
                self._compiled = torch.compile(cached_step, fullgraph=True, dynamic=False)
            self._compiled(self.model, s, R, self.block_unit)
        else:
            g = self._graphs.get(R)
            if g is None:
                g = self._capture(s, R)
            g.replay()

    def _capture(self, s: State, R: int) -> torch.cuda.CUDAGraph:
        """Captures the step at run bucket R on `s`'s buffers. Only called on a State no member has
        loaded yet (`_warm`), since the warm-up runs commit on whatever the buffers hold."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # kernel selection, Triton compilation, cuBLAS workspaces: outside the graph
                cached_step(self.model, s, R, self.block_unit)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            cached_step(self.model, s, R, self.block_unit)
        self._graphs[R] = g
        self.counters.captures += 1
        return g

    def _warm(self, s: State) -> None:
        """Graph mode: captures every run bucket for a fresh State before anyone's rows are in it."""
        self._graphs.clear()
        if self.mode != "graph":
            return
        with torch.inference_mode():
            for R in run_buckets(s.shape.T):
                self._capture(s, R)

    @torch.inference_mode()
    def step(self, canvases: Sequence[Canvas], finals: Sequence[bool]) -> None:
        """One cached step for these canvases (each `takes`), in one forward; writes each canvas's
        commits, counts and done flag back as the eager step does."""
        shape = self._shape_for(canvases)
        if self.state is None or shape != self.state.shape:
            self._grow(shape)
        s = self.state
        assert s is not None
        ours = {id(c) for c in canvases}
        for key in [k for k in self.members if k not in ours]:  # not stepped now: out of this step's batch
            self.leave(self.members[key].canvas)
        live_rows = 0
        s.final.zero_()
        s.k_plan.zero_()
        for c, f in zip(canvases, finals):
            m = self.members.get(id(c))
            if m is None:
                m = self.members[id(c)] = Member(c, self._free_slot())
            if m.version != c.ctx_version:
                self.load(m)
            final = f or c.last_step_due()
            if c.opts.window <= 0 or final or m.n_masked <= c.opts.window:
                predicted = m.n_masked
            else:
                predicted = c.opts.window
            shift = 1 if c.cfg.logits_shift else 0
            live_rows = max(live_rows, shift + m.unfrozen + predicted)
            if c.start + c.n >= c.cfg.max_seq_len:
                raise ValueError(f"position {c.start + c.n} exceeds max_seq_len {c.cfg.max_seq_len}")
            if final:
                s.final[m.slot] = True
            if c.opts.selection != "threshold" and not final:
                s.k_plan[m.slot] = c.plan.pop(0) if c.plan else 1
            c.rows_forwarded += shift + m.unfrozen + predicted
        R = min(bucket(live_rows, ROWS), s.shape.T)
        R = next(r for r in run_buckets(s.shape.T) if r >= R)
        self._run(R)
        out = s.out.tolist()  # the step's one device-to-host read
        self.on_read()
        self.counters.reads += 1
        self.counters.steps += 1
        self.counters.by_rows[R] = self.counters.by_rows.get(R, 0) + 1
        for c in canvases:
            m = self.members[id(c)]
            row = out[m.slot]
            n_masked, unfrozen = int(row[0]), int(row[1])
            committed = m.n_masked - n_masked
            m.n_masked, m.unfrozen = n_masked, unfrozen
            self._write_back(c, m, row[2 : 2 + c.n])
            c.n_masked = n_masked
            c.n_frozen = c.n - n_masked - unfrozen
            c.steps += 1
            c.since_refresh += 1
            c.tokens_per_step.append(committed)
            c.done = n_masked == 0
            if c.done:
                self.leave(c)

    def _write_back(self, c: Canvas, m: Member, probs: list[float]) -> None:
        """The canvas's ids and masks as the eager commit leaves them (device copies, no read)."""
        s = self.state
        assert s is not None
        shift = 1 if c.cfg.logits_shift else 0
        b = m.slot
        c.ids[c.start : c.start + c.n] = s.row_ids[b, shift : shift + c.n]
        c.masked.copy_(s.masked[b, : c.n])
        c.slot_prob = probs


def run_buckets(T: int) -> list[int]:
    """The run-row buckets a span of T rows can use: ROWS up to T, then T itself."""
    out = [r for r in ROWS if r < T]
    return out + [T]


def end_ids(c: Canvas) -> list[int]:
    """The ids that end this canvas's fill, as the eager commit's `ends` (no healing: it is closed)."""
    cfg = c.cfg
    extra = tuple(getattr(cfg, "end_ids", ()) or ())
    out = [cfg.pad_token_id, cfg.eos_token_id, *extra, *c.stop_ids]
    return list(dict.fromkeys(t for t in out if t is not None and t >= 0))
