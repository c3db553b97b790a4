"""Masked-diffusion infill decoding: pure pieces (schedule, confidence, selection) plus one loop.

canvas = prefix + n mask slots + suffix. Each step predicts every masked slot, commits the most
confident ones (LLaDA k-per-step schedule, or Fast-dLLM threshold: every slot >= tau, at least one)
and leaves the rest masked. Slots filled with padding / end-of-text are dropped from the fill, so a
canvas with surplus slots gives a variable-length fill; decoding ends when no mask is left or every
remaining mask is confidently padding.

The state of one job lives in `Canvas`; `forward_full` / `forward_cached` run a *batch* of canvases
so the service can put several jobs into one forward pass. `reference_fill` is the naive oracle.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.api import DecodeOptions
from engine.config import ModelConfig
from engine.model import Transformer
from kernels import slot_stats


# ---------------------------------------------------------------- pure pieces


def schedule(n_masked: int, steps: int) -> list[int]:
    """Tokens to commit at each step, LLaDA-style: n split as evenly as possible, larger first."""
    steps = max(1, min(steps, n_masked))
    base, rem = divmod(n_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def confidence_from_stats(max_prob, top2_prob, entropy, kind: str) -> torch.Tensor:
    """Confidence per slot from softmax statistics: max prob, top1 - top2 margin, or -entropy."""
    if kind == "max_prob":
        return max_prob
    if kind == "margin":
        return max_prob - top2_prob
    if kind == "neg_entropy":
        return -entropy
    raise ValueError(f"unknown confidence {kind!r}")


def select_topk(conf: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k most confident slots; ties go to the leftmost slot (stable, reproducible)."""
    order = torch.sort(conf, descending=True, stable=True).indices
    return order[: max(1, min(k, conf.numel()))]


def select_threshold(conf: torch.Tensor, tau: float) -> torch.Tensor:
    """Indices of every slot with confidence >= tau, and always at least the most confident one."""
    idx = torch.nonzero(conf >= tau).flatten()
    if idx.numel() == 0:
        idx = select_topk(conf, 1)
    return idx


def trim_fill(ids: list[int], pad_id: int, eos_id: int) -> list[int]:
    """Fill tokens without padding, cut at the first end-of-text."""
    out = []
    for t in ids:
        if t == eos_id:
            break
        if t != pad_id:
            out.append(t)
    return out


# ---------------------------------------------------------------- one job's state


@dataclass
class Canvas:
    """prefix + slots + suffix token ids and which slots are still masked."""

    ids: torch.Tensor  # (L,) long
    start: int  # first slot
    n: int  # number of slots
    masked: torch.Tensor  # (n,) bool
    opts: DecodeOptions
    cfg: ModelConfig
    plan: list[int] = field(default_factory=list)  # top-k schedule still to run
    steps: int = 0
    tokens_per_step: list[int] = field(default_factory=list)
    ms_per_step: list[float] = field(default_factory=list)
    ctx: list | None = None  # per layer (k, v) of context positions, (1, H, Lc, Dh)
    ctx_pos: torch.Tensor | None = None  # (Lc,) positions of the cached context
    since_refresh: int = 0
    generator: torch.Generator | None = None
    done: bool = False
    deadline_hit: bool = False

    @classmethod
    def build(cls, prefix: list[int], suffix: list[int], n: int, cfg: ModelConfig, opts: DecodeOptions,
              context_tokens: int = 512, device="cpu") -> "Canvas":
        if n < 1:
            raise ValueError("a fill needs at least one mask slot")
        room = max(0, context_tokens - n)
        # keep the suffix to at most a third of the room: the prefix says more about the fill
        s_keep = min(len(suffix), room // 3)
        p_keep = min(len(prefix), room - s_keep)
        if cfg.logits_shift and p_keep == 0:
            raise ValueError("this model shifts logits: it needs at least one token before the hole")
        prefix, suffix = prefix[len(prefix) - p_keep :], suffix[:s_keep]
        ids = torch.tensor(prefix + [cfg.mask_token_id] * n + suffix, dtype=torch.long, device=device)
        c = cls(ids=ids, start=len(prefix), n=n, masked=torch.ones(n, dtype=torch.bool, device=device), opts=opts, cfg=cfg)
        if opts.selection == "topk":
            c.plan = schedule(n, opts.steps or max(1, n // 2))
        if opts.temperature > 0:
            c.generator = torch.Generator(device=device).manual_seed(opts.seed)
        return c

    @property
    def active(self) -> tuple[int, int]:
        """Span of positions whose hidden states a step needs (one more on the left when shifted)."""
        s = self.start - (1 if self.cfg.logits_shift else 0)
        return s, self.start + self.n

    def slot_ids(self) -> list[int]:
        return self.ids[self.start : self.start + self.n].tolist()

    def fill_ids(self) -> list[int]:
        return trim_fill(self.slot_ids(), self.cfg.pad_token_id, self.cfg.eos_token_id)

    def needs_full(self) -> bool:
        """True when this step must run the whole sequence (no cache yet, or a refresh is due)."""
        o = self.opts
        return (not o.cache) or self.ctx is None or (o.refresh_every > 0 and self.since_refresh >= o.refresh_every)


# ---------------------------------------------------------------- forward passes (batched)


def _pad_stack(rows: list[torch.Tensor], fill) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), L) + tuple(rows[0].shape[1:]), fill, dtype=rows[0].dtype, device=rows[0].device)
    valid = torch.zeros(len(rows), L, dtype=torch.bool, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        valid[i, : r.shape[0]] = True
    return out, valid


@torch.no_grad()
def forward_full(model: Transformer, canvases: list[Canvas]) -> list[torch.Tensor]:
    """One full forward over each canvas's whole sequence (batched with padding). Refills each
    canvas's context K/V cache. Returns per canvas the hidden states of its active span (A, D)."""
    ids, valid = _pad_stack([c.ids for c in canvases], canvases[0].cfg.pad_token_id)
    want_kv = any(c.opts.cache for c in canvases)
    out = model.hidden(ids, key_valid=None if bool(valid.all()) else valid, return_kv=want_kv)
    h, kvs = out if want_kv else (out, None)
    res = []
    for i, c in enumerate(canvases):
        a0, a1 = c.active
        res.append(h[i, a0:a1])
        if c.opts.cache:
            L = c.ids.shape[0]
            keep = torch.ones(L, dtype=torch.bool, device=c.ids.device)
            keep[a0:a1] = False
            c.ctx = [(k[i : i + 1, :, :L][:, :, keep], v[i : i + 1, :, :L][:, :, keep]) for k, v in kvs]
            c.ctx_pos = torch.arange(L, device=c.ids.device)[keep]
            c.since_refresh = 0
    return res


@torch.no_grad()
def forward_cached(model: Transformer, canvases: list[Canvas]) -> list[torch.Tensor]:
    """A cheap step: only the active span of each canvas runs, attending to its cached context K/V
    (approximate for a bidirectional model: the context's K/V saw older canvas contents)."""
    spans = [c.ids[c.active[0] : c.active[1]] for c in canvases]
    poss = [torch.arange(*c.active, device=c.ids.device) for c in canvases]
    ids, valid = _pad_stack(spans, canvases[0].cfg.pad_token_id)
    pos, _ = _pad_stack(poss, 0)
    Lc = max(c.ctx[0][0].shape[2] for c in canvases)
    n_layers = len(canvases[0].ctx)
    if len(canvases) == 1:
        ctx, ctx_valid = canvases[0].ctx, None
    else:
        ctx = []
        for li in range(n_layers):
            ks, vs = [], []
            for c in canvases:
                k, v = c.ctx[li]
                padn = Lc - k.shape[2]
                ks.append(F.pad(k, (0, 0, 0, padn)))
                vs.append(F.pad(v, (0, 0, 0, padn)))
            ctx.append((torch.cat(ks), torch.cat(vs)))
        ctx_valid = torch.zeros(len(canvases), Lc, dtype=torch.bool, device=ids.device)
        for i, c in enumerate(canvases):
            ctx_valid[i, : c.ctx[0][0].shape[2]] = True
    h = model.hidden(ids, pos=pos, key_valid=None if bool(valid.all()) else valid, ctx=ctx, ctx_valid=ctx_valid)
    res = []
    for i, c in enumerate(canvases):
        c.since_refresh += 1
        res.append(h[i, : spans[i].shape[0]])
    return res


# ---------------------------------------------------------------- commit


def commit(model: Transformer, c: Canvas, h_active: torch.Tensor, final: bool) -> int:
    """Predicts the masked slots of one canvas from its active hidden states and commits some (all
    when `final`). Returns how many slots were committed; sets c.done when nothing is left."""
    cfg, o = c.cfg, c.opts
    slot_idx = torch.nonzero(c.masked).flatten()  # (M,)
    h = h_active[slot_idx]  # row r of the active span predicts slot r (shifted: the span starts one earlier)
    if o.temperature > 0:
        logits = model.logits(h).float() / o.temperature  # (M, V)
        logits[:, cfg.mask_token_id] = float("-inf")  # a slot may never be filled with a mask
        probs = logits.softmax(-1)
        pred = torch.multinomial(probs, 1, generator=c.generator).flatten()
        top2 = probs.topk(2, dim=-1).values
        max_p, top2_p = probs.gather(1, pred[:, None]).flatten(), top2[:, 1]
        ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    else:
        max_p, pred, top2_p, ent = slot_stats(h, model.norm.weight, model.norm.eps, model.head_weight, cfg.mask_token_id)
    conf = confidence_from_stats(max_p, top2_p, ent, o.confidence)
    is_pad = (pred == cfg.pad_token_id) | (pred == cfg.eos_token_id)
    if final or bool((is_pad & (max_p >= o.pad_stop)).all()):
        pick = torch.arange(slot_idx.numel(), device=conf.device)
    elif o.selection == "topk":
        k = c.plan.pop(0) if c.plan else 1
        pick = select_topk(conf, k)
    elif o.selection == "threshold":
        pick = select_threshold(conf, o.threshold)
    else:
        raise ValueError(f"unknown selection {o.selection!r}")
    pos = slot_idx[pick]
    c.ids[c.start + pos] = pred[pick]
    c.masked[pos] = False
    c.steps += 1
    c.tokens_per_step.append(int(pick.numel()))
    if not bool(c.masked.any()):
        c.done = True
    return int(pick.numel())


def step(model: Transformer, canvases: list[Canvas], final: list[bool] | None = None) -> None:
    """One denoising step for a batch of canvases: a full forward for those that need one, a cached
    step for the rest, then each commits its own slots."""
    final = final or [False] * len(canvases)
    t0 = time.perf_counter()
    full = [c for c in canvases if c.needs_full()]
    cached = [c for c in canvases if not c.needs_full()]
    hs: dict[int, torch.Tensor] = {}
    if full:
        for c, h in zip(full, forward_full(model, full)):
            hs[id(c)] = h
    if cached:
        for c, h in zip(cached, forward_cached(model, cached)):
            hs[id(c)] = h
    for c, f in zip(canvases, final):
        commit(model, c, hs[id(c)], f)
    ms = (time.perf_counter() - t0) * 1000 / len(canvases)
    for c in canvases:
        c.ms_per_step.append(ms)


@dataclass
class DecodeResult:
    ids: list[int]  # fill tokens (padding dropped)
    steps: int
    tokens_per_step: list[int]
    ms_per_step: list[float]
    cancelled: bool = False
    deadline_hit: bool = False


def fill(model: Transformer, canvas: Canvas, deadline: float | None = None, cancelled=lambda: False) -> DecodeResult:
    """Denoises one canvas to the end. Between steps: a cancelled job stops at once; when the next
    step would pass the deadline it becomes the last one and commits every remaining mask."""
    hit = False
    while not canvas.done:
        if cancelled():
            return DecodeResult(canvas.fill_ids(), canvas.steps, canvas.tokens_per_step, canvas.ms_per_step, cancelled=True)
        last = canvas.ms_per_step[-1] / 1000 if canvas.ms_per_step else 0.0
        final = deadline is not None and time.monotonic() + last >= deadline
        hit = hit or final
        step(model, [canvas], [final])
    return DecodeResult(canvas.fill_ids(), canvas.steps, canvas.tokens_per_step, canvas.ms_per_step, deadline_hit=hit)


# ---------------------------------------------------------------- the oracle


@torch.no_grad()
def reference_fill(model: Transformer, prefix: list[int], suffix: list[int], n: int, opts: DecodeOptions,
                   context_tokens: int = 512) -> list[int]:
    """Naive sampler kept as the oracle: full recompute every step, full softmax over the vocabulary,
    plain Python selection. Temperature 0 only. Returns the fill's token ids (padding dropped)."""
    assert opts.temperature == 0, "the oracle is deterministic"
    cfg = model.cfg
    c = Canvas.build(prefix, suffix, n, cfg, DecodeOptions(**{**opts.__dict__, "cache": False}), context_tokens)
    seq = c.ids.tolist()
    s = c.start
    masked = list(range(n))
    plan = schedule(n, opts.steps or max(1, n // 2)) if opts.selection == "topk" else []
    shift = 1 if cfg.logits_shift else 0
    while masked:
        logits = model(torch.tensor([seq]))[0]  # (L, V)
        logits[:, cfg.mask_token_id] = float("-inf")
        probs = F.softmax(logits.double(), dim=-1)
        cand = []
        for j in masked:
            p = probs[s + j - shift]
            top = torch.topk(p, 2)
            tok = int(torch.argmax(p))
            mp, t2 = float(p[tok]), float(top.values[1])
            ent = float(-(p[p > 0] * p[p > 0].log()).sum())
            conf = {"max_prob": mp, "margin": mp - t2, "neg_entropy": -ent}[opts.confidence]
            is_pad = tok in (cfg.pad_token_id, cfg.eos_token_id)
            cand.append((j, tok, conf, is_pad and mp >= opts.pad_stop))
        if all(x[3] for x in cand):
            chosen = cand
        else:
            ranked = sorted(cand, key=lambda x: (-x[2], x[0]))
            if opts.selection == "topk":
                k = plan.pop(0) if plan else 1
                chosen = ranked[:k]
            else:
                chosen = [x for x in cand if x[2] >= opts.threshold] or ranked[:1]
        for j, tok, _, _ in chosen:
            seq[s + j] = tok
            masked.remove(j)
    return trim_fill(seq[s : s + n], cfg.pad_token_id, cfg.eos_token_id)
