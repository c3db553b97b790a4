"""Masked-diffusion infill decoding: confidence and selection, `commit`, `step` and `fill`.

canvas = prefix + n mask slots + suffix (engine/decode/canvas.py). Each step predicts every masked slot,
commits the most confident ones (LLaDA k-per-step schedule, or Fast-dLLM threshold: every slot >= tau,
at least one) and leaves the rest masked. Slots filled with padding / end-of-text are dropped from the
fill, so a canvas with surplus slots gives a variable-length fill; decoding ends when no mask is left or
every remaining mask is confidently padding.

`step` runs a *batch* of canvases through one forward (engine/decode/forward.py: full forward or cached
step) so the service can put several jobs into one pass, then each canvas commits its own slots.
engine/decode/reference.py holds the naive oracle the loop is tested against, token for token.

The biases on a slot's logits (engine/bias/) need its whole row, so with any of them on (or with
sampling, or a `top_k`) `commit` computes the predicted slots' full logit rows (`biased_logits`)
instead of the fused slot statistics, and applies, in this order:
  1. identifier-aware decoding and the bracket rule (engine/bias/names.py), at the leftmost masked
     slot only: its left side is all committed text, so the identifier or bracket under way is
     known; none once a committed slot before it ended the fill, none on DreamOn's resizing canvas
  2. the context copy boost (engine/bias/copy.py), on the rows as they come, before the mask and
     healing restrictions; where it chains (a slot reads its left neighbour's pick of this step),
     that pick is taken from the neighbour's row with those restrictions applied (`restrict`)
  3. the n-gram memories (engine/bias/ngram.py): the corpus's, then the fill's own, or the
     workspace's where the fill's own has no context; all read the committed left runs, not chained;
     then a next edit's edit memory (engine/bias/edits.py, engine/decode/rewrite.py)
  4. temperature, then the restrictions: never a mask, no DreamOn expand at its longest middle, the
     healed slot only among its candidates (engine/decode/canvas.py, token healing). Restricting
     last makes the healed slot's distribution the biased one renormalised over its candidates.
  5. DecodeOptions.top_k: each row cut to its k best tokens (among those it may take), so the
     confidence (and a sample) is renormalised over them, as Dream's `diffusion_generate` does
     with the `top_k=50` its generation config carries.

Stop when unsure (DecodeOptions.stop_below): in a threshold step in which no eligible slot reaches
the threshold, the leftmost masked slot is eligible and its best token's probability is below
`stop_below`, that slot is committed as the end: the `pad_left` cut makes every later slot padding
and drops text committed further right, so the fill is the text the model was sure of and the steps
a guessed tail would take never run. Never while a healed slot is open, never on a last step (it
commits every mask), never for WeDLM (its authors' commit rule), and only with `pad_left`, whose cut
it is. The stopped fill is a prefix of the unstopped one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.decode import forward as fwd
from engine.decode.cache import BatchContext, Rows
from engine.decode.canvas import Canvas
from engine.decode.reorder import ReorderCanvas
from engine.decode.static import StaticStep, takes
from engine.families import dreamon, wedlm
from engine.families.blocks import block_eligible
from kernels import slot_stats

if TYPE_CHECKING:
    from engine.bias.names import NameBias
    from engine.model.transformer import Transformer

# per predicted slot: its token's probability, its token, the second best's probability, the entropy
# (None where the confidence does not read it)
Predictions = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def confidence_from_stats(
    max_prob: torch.Tensor, top2_prob: torch.Tensor, entropy: torch.Tensor | None, kind: str
) -> torch.Tensor:
    """Confidence per slot from softmax statistics: max prob, top1 - top2 margin, or -entropy."""
    if kind == "max_prob":
        return max_prob
    if kind == "margin":
        return max_prob - top2_prob
    if kind == "neg_entropy":
        if entropy is None:  # row_predictions computes it whenever the confidence reads it
            raise ValueError("the neg_entropy confidence needs the entropy")
        return -entropy
    raise ValueError(f"unknown confidence {kind!r}")


def select_topk(conf: list[float], k: int) -> list[int]:
    """Indices of the k most confident slots; ties go to the leftmost slot (stable, reproducible)."""
    order = sorted(range(len(conf)), key=lambda i: -conf[i])  # sorted() is stable: leftmost first on ties
    return order[: max(1, min(k, len(conf)))]


def select_threshold(conf: list[float], tau: float) -> list[int]:
    """Indices of every slot with confidence >= tau, and always at least the most confident one."""
    return [i for i, x in enumerate(conf) if x >= tau] or select_topk(conf, 1)


def eligible_slots(masked_slots: list[int], block: int) -> list[int]:
    """Indices (into masked_slots, ascending) that may be committed: all of them, or with semi-AR
    blocks of size `block` only those in the leftmost block that still has a masked slot."""
    if block <= 0:
        return list(range(len(masked_slots)))
    end = (masked_slots[0] // block + 1) * block
    return [i for i, s in enumerate(masked_slots) if s < end]


def _end_at_padding(
    pick: list[int],
    pred_l: list[float],
    values: torch.Tensor,
    ends: tuple[int, ...],
    pad_id: int,
    end_id: int | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Semi-AR: a committed padding/end slot ends the fill, so every masked slot after the first one
    is committed as padding in the same step (training lays a fill out as text, then padding).
    With `end_id` that first slot is committed as end-of-text, so text already committed further
    right (pad_left commits text anywhere) is cut from the fill too."""
    first_end = min((i for i in pick if int(pred_l[i]) in ends), default=None)
    if first_end is None:
        return pick, values
    tail = list(range(first_end + 1, len(pred_l)))
    values[tail] = pad_id
    if end_id is not None:
        values[first_end] = end_id
    return sorted(set(pick) | set(tail)), values


def heal_logits(row: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A (V,) logit row with every id outside `allowed` set to -inf (token healing)."""
    out = torch.full_like(row, float("-inf"))
    out[allowed] = row[allowed]
    return out


def commit(model: Transformer, c: Canvas, rows: Rows, final: bool) -> int:
    """Predicts the masked slots of one canvas from the hidden states of a forward and commits some
    (all when `final`). Returns how many slots were committed; sets c.done when nothing is left.

    The slots and their rows (`predicted_slots`), their predictions with every bias (`slot_predictions`),
    the choice on the host (`select_slots`, then `pad_after_end`), the writes (`write_commits`, `end_step`)."""
    if final and not c.final_step and c.window_now():
        raise RuntimeError("a final step must be announced (Canvas.final_step) before its forward")
    slot_idx, outside, h = predicted_slots(c, rows, final)
    max_p, pred, top2_p, ent = slot_predictions(model, c, slot_idx, h, final)
    conf = confidence_from_stats(max_p, top2_p, ent, c.opts.confidence)
    # decide on the host: one transfer of a few dozen numbers beats a dozen tiny tensor ops per step
    conf_l, maxp_l, pred_l = torch.stack([conf.double(), max_p.double(), pred.double()]).tolist()
    slot_l = slot_idx.tolist()
    # a line break the healed slots re-type lies before the cursor: no stop while the heal is open
    ends = (c.cfg.pad_token_id, *c.cfg.end_ids) + (() if c.heal_open else c.stop_ids)
    pick, stop = select_slots(c, conf_l, maxp_l, pred_l, slot_l, ends, final)
    if stop:  # unsure at the leftmost masked slot: the fill ends there
        pred_l[0] = c.cfg.eos_token_id
        pred = pred.clone()
        pred[0] = c.cfg.eos_token_id
    pick, values, n_tail = pad_after_end(c, pick, pred, pred_l, ends, outside)
    chosen = write_commits(c, slot_idx, pick, values, maxp_l, pred_l, slot_l, final)
    end_step(c, chosen, len(pick) + n_tail)
    return len(pick)


def predicted_slots(c: Canvas, rows: Rows, final: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The masked slots this step predicts (M,), those right of its window (or None), and the slots' hidden states (M, D)."""
    h_rows, pos = rows  # (R, D), (R,) ascending positions
    w = c.window_now(final)
    slot_idx = c.masked_slots()  # (M,)
    outside = slot_idx[w:] if w else None  # masked slots this step does not predict
    if w:
        slot_idx = slot_idx[:w]
    # the hidden state at position p predicts slot p (shifted: slot p+1): find each masked slot's row
    want = slot_idx + (c.start - (1 if c.cfg.logits_shift else 0))  # (M,) positions
    return slot_idx, outside, h_rows[torch.searchsorted(pos, want)]  # (M, D)


def slot_predictions(
    model: Transformer, c: Canvas, slot_idx: torch.Tensor, h: torch.Tensor, final: bool
) -> Predictions:
    """Per predicted slot: its token's probability, its token, the second best's probability and the
    entropy (None where the confidence does not read it), every bias and restriction applied."""
    cfg, o = c.cfg, c.opts
    if (
        o.temperature > 0
        or o.top_k is not None
        or c.copy is not None
        or c.names is not None
        or c.ngram is not None
        or c.local is not None
        or c.workspace is not None
        or c.edit_bias is not None
    ):  # full rows
        return row_predictions(c, biased_logits(model, c, slot_idx, h, final))
    if c.middle is not None and c.middle.expand_banned(c.n, final):  # DreamOn's middle at its longest
        return dreamon.stats_without_expand(model, h, cfg)
    allow = allow_row = None
    if c.heal_open:  # the healed slot (the first row): its distribution renormalized over its candidates
        allow = torch.zeros((1, cfg.vocab_size), dtype=torch.bool, device=h.device)
        allow[0, c.heal_ids(final or c.last_step_due())] = True
        allow_row = torch.full((h.shape[0],), -1, dtype=torch.long, device=h.device)
        allow_row[0] = 0
    norm = model.norm
    return slot_stats(h, norm.weight, norm.eps, model.head_weight, cfg.mask_token_id, allow=allow, allow_row=allow_row)


def biased_logits(model: Transformer, c: Canvas, slot_idx: torch.Tensor, h: torch.Tensor, final: bool) -> torch.Tensor:
    """The predicted slots' full logit rows (M, V) with every bias, the temperature and the restrictions applied."""
    cfg, o = c.cfg, c.opts
    logits = model.logits(h).float()  # (M, V)
    if c.names is not None and c.middle is None:  # identifier-aware decoding, the leftmost masked slot
        row = name_row(c, c.names, int(slot_idx[0]), final)
        if row is not None:
            logits[0] += row.to(logits.device, logits.dtype)
    if c.copy is not None:

        def restrict(r: int, row: torch.Tensor) -> torch.Tensor:  # what the row's pick must obey (chaining)
            row = row.clone()
            row[cfg.mask_token_id] = float("-inf")
            return heal_logits(row, c.heal_ids(final or c.last_step_due())) if r == 0 and c.heal_open else row

        chained = c.middle is None and cfg.family != "wedlm"
        logits += c.copy_bias(slot_idx, logits if chained else None, restrict)
    if c.ngram is not None or c.local is not None or c.workspace is not None:
        left = c.memory_runs(slot_idx)  # the committed left runs (not chained), read once for every memory
        if c.ngram is not None:  # the corpus n-gram memory
            c.add_ngram(logits, slot_idx, left)
        if c.local is not None or c.workspace is not None:  # the fill's own n-gram (the workspace's where it has none)
            c.add_local(logits, slot_idx, left)
    if c.edit_bias is not None:  # a next edit's edit memory (engine/bias/edits.py)
        logits += c.edit_bias(c, slot_idx).to(logits.device, logits.dtype)
    if o.temperature > 0:
        logits = logits / o.temperature
    logits[:, cfg.mask_token_id] = float("-inf")  # a slot may never be filled with a mask
    if c.middle is not None and c.middle.expand_banned(c.n, final):  # DreamOn's middle at its longest
        logits[:, cfg.expand_token_id] = float("-inf")
    if c.heal_open:  # the healed slot (the first row) only among its candidates
        logits[0] = heal_logits(logits[0], c.heal_ids(final or c.last_step_due()))
    if o.top_k is not None:  # the confidence (and a sample) over the k best tokens the slot may take
        logits = top_k_logits(logits, o.top_k)
    return logits


def top_k_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(M, V) logits with every token below each row's k-th best set to -inf (ties with it kept), as
    Dream's generation_utils `top_k_logits` filters before its softmax: the probabilities are then
    renormalised over the top k. A row with fewer than k finite logits is left as it is."""
    kth = logits.topk(min(k, logits.shape[-1]), dim=-1).values[:, -1:]  # (M, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def row_predictions(c: Canvas, logits: torch.Tensor) -> Predictions:
    """From full logit rows: each slot's token (sampled, or argmax) and its probability, the second
    best's probability and the entropy (None where the confidence does not read it)."""
    o = c.opts
    probs = logits.softmax(-1)
    top2 = probs.topk(2, dim=-1)
    if o.temperature > 0:
        pred = torch.multinomial(probs, 1, generator=c.generator).flatten()
        max_p = probs.gather(1, pred[:, None]).flatten()
    elif bool((top2.values[:, 0] > top2.values[:, 1]).all()):  # a unique top: argmax's answer, one pass fewer
        pred, max_p = top2.indices[:, 0], top2.values[:, 0]
    else:  # a tie at the top: argmax's first index, as ever
        pred = probs.argmax(-1)
        max_p = probs.gather(1, pred[:, None]).flatten()
    top2_p = top2.values[:, 1]
    # the entropy only where the confidence is made of it (two passes over the rows otherwise)
    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1) if o.confidence == "neg_entropy" else None
    return max_p, pred, top2_p, ent


def select_slots(
    c: Canvas,
    conf_l: list[float],
    maxp_l: list[float],
    pred_l: list[float],
    slot_l: list[int],
    ends: tuple[int, ...],
    final: bool,
) -> tuple[list[int], bool]:
    """The slots to commit (indices into the step's), and True when the fill stops at the leftmost (stop_below)."""
    cfg, o = c.cfg, c.opts
    if final or c.last_step_due() or all(t in ends and p >= o.pad_stop for t, p in zip(pred_l, maxp_l)):
        return list(range(len(conf_l))), False
    elig = eligible_slots(slot_l, o.block)
    if o.pad_left:  # padding may only be committed at the leftmost masked slot
        elig = [i for i in elig if i == 0 or int(pred_l[i]) not in ends] or [0]
    if c.heal_open and c.heal_slot == 0 and c.heal_then:  # slot 1 waits: slot 0 may take a piece
        elig = [i for i in elig if slot_l[i] != 1]
    if cfg.block_size:  # block-causal: the authors' block (and sub-block) order (engine/families/blocks.py)
        elig = block_eligible(cfg, c.start, slot_l, elig)
    conf_e = [conf_l[i] for i in elig]
    if cfg.family == "wedlm":  # its authors' rule: entropy + position penalty (engine/families/wedlm.py)
        sub = wedlm.select([slot_l[i] for i in elig], [-x for x in conf_e], slot_l[0])
    elif o.selection in ("topk", "timesteps"):
        sub = select_topk(conf_e, c.plan.pop(0) if c.plan else 1)
    else:
        sub = select_threshold(conf_e, o.threshold)
    if (
        o.stop_below
        and o.selection == "threshold"
        and cfg.family != "wedlm"
        and not c.heal_open
        and elig
        and elig[0] == 0
        and all(x < o.threshold for x in conf_e)
        and maxp_l[0] < o.stop_below
    ):
        return [0], True
    return [elig[i] for i in sub], False


def pad_after_end(
    c: Canvas,
    pick: list[int],
    pred: torch.Tensor,
    pred_l: list[float],
    ends: tuple[int, ...],
    outside: torch.Tensor | None,
) -> tuple[list[int], torch.Tensor, int]:
    """The slots to commit and their tokens, every slot after a committed end made padding; commits
    the masked slots right of the window as padding when the fill ended inside it, and gives their count."""
    cfg, o = c.cfg, c.opts
    values = pred.clone()
    n_tail = 0  # masked slots right of the window committed as padding
    if o.block > 0 or o.pad_left or o.window > 0:
        pick, values = _end_at_padding(
            pick, pred_l, values, ends, cfg.pad_token_id, cfg.eos_token_id if o.pad_left else None
        )
        if outside is not None and any(int(pred_l[i]) in ends for i in pick):
            # the fill ended inside the window: every slot right of it is padding too
            c.ids[c.start + outside] = cfg.pad_token_id
            c.masked[outside] = False
            n_tail = outside.numel()
            c.n_masked -= n_tail
    return pick, values, n_tail


def write_commits(
    c: Canvas,
    slot_idx: torch.Tensor,
    pick: list[int],
    values: torch.Tensor,
    maxp_l: list[float],
    pred_l: list[float],
    slot_l: list[int],
    final: bool,
) -> torch.Tensor:
    """Writes the picked slots' tokens, probabilities, masks and healing state; gives back their slots (positions in the fill)."""
    pick_t = torch.tensor(pick, device=slot_idx.device)
    chosen = slot_idx[pick_t]
    c.ids[c.start + chosen] = values[pick_t]
    for i in pick:
        c.slot_prob[slot_l[i]] = maxp_l[i]
    if c.heal_open and 0 in pick:  # the healed slot is slot_l[0] while open
        piece = int(pred_l[0])
        if c.heal_slot == 0 and piece in c.heal_then and not (final or c.last_step_due()):
            c.heal, c.heal_slot = c.heal_then[piece], 1  # slot 1 re-types the rest of the tail
        else:
            c.heal_open = False
    c.masked[chosen] = False
    c.n_masked -= len(pick)
    return chosen


def end_step(c: Canvas, chosen: torch.Tensor, committed: int) -> None:
    """Counts the step's `committed` slots and sets c.done; DreamOn's middle resizes at a committed expand / end."""
    c.steps += 1
    c.tokens_per_step.append(committed)
    c.done = c.n_masked == 0
    if c.cfg.family == "wedlm":  # its authors' stream ends at a stop token with nothing masked before it
        if not isinstance(c, ReorderCanvas):  # build_canvas gives WeDLM (canvas "reorder") its own
            raise TypeError("a WeDLM fill runs on a ReorderCanvas (engine/decode/reorder.py)")
        c.done = c.done or wedlm.finished(c.slot_ids(), c.masked.tolist(), c.keep, (c.cfg.eos_token_id,))
    if c.middle is not None:  # DreamOn: a committed expand / end-of-text resizes the middle
        dreamon.edit(c, chosen.tolist())


def name_row(c: Canvas, names: NameBias, j: int, final: bool) -> torch.Tensor | None:
    """The identifier penalty (engine/bias/names.py, the canvas's `names`) of slot j, the leftmost
    masked one: None when a committed slot before it ends the fill."""
    done = c.ids[c.start : c.start + j].tolist()
    if any(t == c.cfg.pad_token_id or t in c.cfg.end_ids for t in done):
        return None
    heal = c.heal_ids(final or c.last_step_due()).tolist() if c.heal_open and j == c.heal_slot else None
    return names.slot_row(done, heal)


def record_step(c: Canvas, was_full: bool, ms: float) -> None:
    """Keeps a step's wall time: the job's stats, and the estimate for its next step of that kind."""
    c.ms_per_step.append(ms)
    if was_full:
        c.full_ms = ms
    else:
        c.cached_ms = ms


@torch.inference_mode()
def step(
    model: Transformer,
    canvases: list[Canvas],
    final: list[bool] | None = None,
    batch_ctx: BatchContext | None = None,
    static: StaticStep | None = None,
) -> None:
    """One denoising step for a batch of canvases: forward, then each commits its own slots. With
    `static`, the canvases it takes run its fixed-shape cached step instead (engine/decode/static.py)."""
    final = final or [False] * len(canvases)
    for c, f in zip(canvases, final):
        c.final_step = f
    t0 = time.perf_counter()
    was_full = [c.needs_full() for c in canvases]
    taken = [static is not None and takes(c) for c in canvases]
    if static is not None and any(taken):
        static.step([c for c, t in zip(canvases, taken) if t], [f for f, t in zip(final, taken) if t])
    rest = [(c, f) for c, f, t in zip(canvases, final, taken) if not t]
    hs = fwd.forward(model, [c for c, _ in rest], batch_ctx) if rest else []
    for (c, f), h in zip(rest, hs):
        commit(model, c, h, f)
    ms = (time.perf_counter() - t0) * 1000  # every job in the batch waited the whole step
    for c, wf in zip(canvases, was_full):
        record_step(c, wf, ms)


@dataclass
class DecodeResult:
    ids: list[int]  # fill tokens (padding dropped)
    steps: int
    tokens_per_step: list[int]
    ms_per_step: list[float]
    cancelled: bool = False
    deadline_hit: bool = False
    confidence: float = 1.0  # Canvas.fill_confidence()


def deadline_due(c: Canvas, deadline: float | None, now: float | None = None) -> bool:
    """True when the next step would end past the deadline: it must be the last one."""
    if deadline is None:
        return False
    return (time.monotonic() if now is None else now) + c.next_step_ms() / 1000 >= deadline


def fill(
    model: Transformer,
    canvas: Canvas,
    deadline: float | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    static: StaticStep | None = None,
) -> DecodeResult:
    """Denoises one canvas to the end. Between steps: a cancelled job stops at once; when the next
    step would pass the deadline it becomes the last one and commits every remaining mask."""
    while not canvas.done:
        if cancelled():
            canvas.cancelled = True
            break
        final = deadline_due(canvas, deadline)
        canvas.deadline_hit |= final
        step(model, [canvas], [final], static=static)
    if static is not None:
        static.leave(canvas)
    return DecodeResult(
        canvas.fill_ids(),
        canvas.steps,
        canvas.tokens_per_step,
        canvas.ms_per_step,
        cancelled=canvas.cancelled,
        deadline_hit=canvas.deadline_hit,
        confidence=canvas.fill_confidence(),
    )


# ---------------------------------------------------------------- the oracle
