"""Next edits, decoding: a window of the document rewritten on a canvas, ids in and ids out.

An EditJob (engine/api.py) names its approach as flags; this module lays its canvas out and runs it
through the fills' own machinery (engine/decode/forward.py's `build_canvas` and `forward`,
engine/decode/sampler.py's `step`), so every topology a fill runs on runs a rewrite too:

  (a) "window": prefix + the window as masked slots + suffix, the slots being the window's token
      count plus ceil(growth x it) of padding room, so the rewrite may grow or (padding, an end)
      shrink; denoised as a fill (the fill's padding rules included: text ends at its first end).
  (b) "surprise": the window's tokens stand on the canvas, and ONE forward scores them
      (`window_probs`): "visible", each token's own probability with the window shown (a shifted
      model's logit one position left, as the sampler reads it); "masked", with the whole window
      masked (what the model would write from the context alone). Tokens below `surprise` and
      `spread` neighbours either side are masked (`surprising`), each masked span gets
      ceil(growth x its length) masked slots of room after it (`remask_slots`), and only those are
      denoised; a committed padding or end empties its slot only (several spans: no pad_left, no
      sliding window, no semi-AR blocks, whose rules end the whole canvas at the first end). Nothing
      surprising: the window comes back unchanged, with no denoising step.
  (c) "memory" (engine/bias/edits.py): the recent edits' substitutions bias the masked slots where
      an old token stood toward its new one (Canvas.edit_bias, applied by the sampler after the
      n-gram memories); without "window", the window's old tokens are masked as well, scored or not
      ("memory" alone runs no scoring forward at all).

The edits are not rendered into the context: no model here was trained on such a rendering, and the
prefix and the window already show what the edits did. Their ids act through (c).

What applies where (checked by `check_layout`, EngineError otherwise): (a) on every layout; (b) and
(c)'s remasking on the plain canvas of every topology (bidirectional, block-causal, with or without
the logit shift) and on the causal reordered one (recipe (c), WeDLM), where "visible" scoring does not
apply (a row past the context is only trained as a mask: "auto" scores "masked" there); not on
DreamOn, whose canvas resizes a single middle.

Between steps, as for fills: a cancelled run stops (`EditRun.cancelled`; the window comes back
unchanged, since half a rewrite is no edit); when the next step would pass the deadline it is the
last and commits every mask. The scoring forward is due like a step: past the deadline before it,
there is nothing to commit yet, and the window comes back unchanged (deadline_hit, no step).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.api import DecodeOptions, EngineError, Rewrite, edit_flags
from engine.bias.edits import EditBias, EditMemory, substitutions
from engine.decode import forward as fwd
from engine.decode import sampler
from engine.decode.canvas import Canvas, block_schedule, check_options, timestep_schedule, trim_fill
from engine.decode.reorder import ReorderCanvas

if TYPE_CHECKING:
    from engine.model.config import ModelConfig
    from engine.model.transformer import Transformer

SCORES = ("auto", "visible", "masked")

# ---------------------------------------------------------------- pure pieces


def edit_options(o: DecodeOptions, spans: bool) -> DecodeOptions:
    """The options a rewrite's canvas decodes with: `o` without what belongs to a cursor's fill
    (token healing, the line-break stop, stop-when-unsure: a window is lines, and kept text may follow
    it) nor the levers the service attaches per fill job (names, brackets, the n-gram memories, the
    copy boost's far side, reuse across keystrokes); with several masked `spans` (layout (b)) also no
    pad_left, sliding window or semi-AR blocks, which end the whole canvas at its first end."""
    o = dataclasses.replace(
        o,
        heal=False,
        stop_newline=False,
        stop_below=0.0,
        names=0.0,
        brackets=0.0,
        ngram=0.0,
        local_ngram=0.0,
        workspace_ngram=0.0,
        copy_far=0.0,
        reuse=False,
    )
    return dataclasses.replace(o, pad_left=False, window=0, block=0) if spans else o


def room(n: int, growth: float) -> int:
    """Padding-room slots after a masked run of n tokens: ceil(growth x n), at least 1 for a non-empty run."""
    return max(1, math.ceil(growth * n)) if n and growth > 0 else 0


def surprising(probs: Sequence[float], threshold: float, spread: int) -> list[bool]:
    """Per token: below `threshold` (threshold 1: every token), or within `spread` tokens of one."""
    hit = [p < threshold or threshold >= 1 for p in probs]
    return widen(hit, spread)


def widen(marks: Sequence[bool], spread: int) -> list[bool]:
    """`marks` with `spread` neighbours either side of each True set too."""
    out = [False] * len(marks)
    for i, m in enumerate(marks):
        if m:
            for j in range(max(0, i - spread), min(len(marks), i + spread + 1)):
                out[j] = True
    return out


@dataclass
class Slots:
    """A rewrite canvas's slots: per slot the window index it holds or stands for (None: padding
    room) and whether it starts masked."""

    src: list[int | None]
    masked: list[bool]


def window_slots(n_window: int, growth: float) -> Slots:
    """Layout (a): every window token masked, then the padding room."""
    n = n_window + room(n_window, growth)
    n = max(n, 1)  # an empty window still gets a slot to write into
    return Slots([i if i < n_window else None for i in range(n)], [True] * n)


def remask_slots(remask: Sequence[bool], growth: float) -> Slots:
    """Layout (b): the window's tokens in order, the `remask`ed ones masked, each masked run followed
    by its padding room."""
    src: list[int | None] = []
    masked: list[bool] = []
    run = 0
    for i, m in enumerate(list(remask) + [False]):
        if m:
            run += 1
        elif run:
            src += [None] * room(run, growth)
            masked += [True] * room(run, growth)
            run = 0
        if i < len(remask):
            src.append(i)
            masked.append(m)
    return Slots(src, masked)


def fit(slots: Slots, cap: int) -> Slots:
    """`slots` with padding-room slots dropped from the right until at most `cap` are left (the
    window's own tokens always fit: EditRun checks them against max_tokens)."""
    src, masked = list(slots.src), list(slots.masked)
    j = len(src) - 1
    while len(src) > cap and j >= 0:
        if src[j] is None:
            del src[j], masked[j]
        j -= 1
    return Slots(src, masked)


def diff_stats(old: Sequence[int], new: Sequence[int], new_probs: Sequence[float]) -> tuple[int, list[float]]:
    """(changed, the probabilities of the new tokens in changed runs): per differing run of a token
    diff, the longer side's length."""
    changed, probs = 0, []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, list(old), list(new), autojunk=False).get_opcodes():
        if tag != "equal":
            changed += max(i2 - i1, j2 - j1)
            probs += list(new_probs[j1:j2])
    return changed, probs


def fill_slots(c: Canvas) -> int:
    """The slots of a canvas that make its text: WeDLM's canvas has a window's worth more without a
    suffix (ReorderCanvas.keep), DreamOn's middle resizes (its n now)."""
    return c.keep if isinstance(c, ReorderCanvas) else c.n


def check_layout(cfg: ModelConfig, flags: frozenset[str], score: str) -> str:
    """The scoring this model and approach use ("visible" / "masked"); EngineError where a layout
    does not apply to the model."""
    if score not in SCORES:
        raise EngineError(f"score must be one of {SCORES}, got {score!r}")
    if cfg.expand_token_id is not None and "window" not in flags:
        raise EngineError(
            "this model's canvas resizes one middle (DreamOn): it rewrites a window only with approach 'window'"
        )
    if cfg.canvas == "reorder":
        if score == "visible" and "surprise" in flags:
            raise EngineError(
                "the causal reordered canvas trains rows past the context only as masks: "
                "score 'masked' (or 'auto') scores a window there"
            )
        return "masked"
    return "visible" if score == "auto" else score


# ---------------------------------------------------------------- canvases


def build(
    prefix: list[int],
    suffix: list[int],
    window: list[int],
    slots: Slots,
    cfg: ModelConfig,
    opts: DecodeOptions,
    context_tokens: int,
    device: str | torch.device,
) -> Canvas:
    """The model's canvas (forward.build_canvas) with `slots`: their kept window tokens committed
    (probability 1), the rest masked; the step plan made for the masked ones."""
    c = fwd.build_canvas(prefix, suffix, len(slots.src), cfg, opts, context_tokens, device)
    keep = [j for j, m in enumerate(slots.masked) if not m]
    if keep:
        at = torch.tensor(keep, dtype=torch.long, device=c.ids.device)
        c.ids[c.start + at] = torch.tensor(
            [window[slots.src[j] or 0] for j in keep], dtype=torch.long, device=at.device
        )
        c.masked[at] = False
        c.n_masked -= len(keep)
        for j in keep:
            c.slot_prob[j] = 1.0
    o = c.opts
    if o.selection == "topk":  # Canvas.build planned every slot: plan the masked ones
        c.plan = block_schedule(c.n_masked, o.steps or max(1, c.n_masked // 2), o.block)
    elif o.selection == "timesteps":
        c.plan = timestep_schedule(c.n_masked, o.steps or c.n_masked)
    c.done = c.n_masked == 0
    return c


@torch.inference_mode()
def window_probs(model: Transformer, c: Canvas, window: list[int]) -> list[float]:
    """The probability of each window token at its slot from one forward of a scoring canvas (its
    first len(window) slots; the shifted logit one position left, as the sampler reads it)."""
    rows, pos = fwd.forward(model, [c])[0]  # (R, D), (R,) ascending
    want = torch.arange(len(window), device=pos.device) + (c.start - (1 if c.cfg.logits_shift else 0))
    h = rows[torch.searchsorted(pos, want)]  # (W, D)
    probs = model.logits(h).float().softmax(-1)  # (W, V)
    ids = torch.tensor(window, dtype=torch.long, device=probs.device)
    return probs.gather(1, ids[:, None]).flatten().tolist()


def score_canvas(
    prefix: list[int],
    suffix: list[int],
    window: list[int],
    cfg: ModelConfig,
    opts: DecodeOptions,
    context_tokens: int,
    device: str | torch.device,
    score: str,
) -> Canvas:
    """The canvas of the surprise scoring forward: the window shown ("visible") or masked
    ("masked"), no K/V kept, every masked slot run (final_step lifts any window)."""
    opts = dataclasses.replace(edit_options(opts, spans=True), cache=False)
    n = max(1, len(window))
    c = build(prefix, suffix, window, Slots(list(range(n)), [score == "masked"] * n), cfg, opts, context_tokens, device)
    c.final_step = True
    return c


# ---------------------------------------------------------------- a run


class EditRun:
    """One rewrite on the engine, ids in: `step` runs its next forward (the surprise scoring, then
    denoising steps) until `done`; `rewrite` gives the outcome. The service steps it on its worker
    between fill batches; `rewrite()` below runs it to the end on the calling thread."""

    def __init__(
        self,
        prefix: list[int],
        window: list[int],
        suffix: list[int],
        edits: Sequence[tuple[Sequence[int], Sequence[int]]],
        approach: str,
        cfg: ModelConfig,
        opts: DecodeOptions,
        *,
        max_tokens: int = 128,
        context_tokens: int = 512,
        device: str | torch.device = "cpu",
        surprise: float = 0.05,
        spread: int = 1,
        growth: float = 0.25,
        memory: float = 4.0,
        score: str = "auto",
    ):
        try:
            self.flags = edit_flags(approach)
            check_options(opts)
        except ValueError as e:
            raise EngineError(str(e)) from None
        if not 0 <= surprise <= 1 or spread < 0 or growth < 0 or memory < 0 or max_tokens < 1:
            raise EngineError("surprise must be in [0, 1]; spread, growth and memory >= 0; max_tokens >= 1")
        self.score = check_layout(cfg, self.flags, score)
        if len(window) > max_tokens:
            raise EngineError(f"the window has {len(window)} tokens; max_tokens is {max_tokens}")
        self.prefix, self.window, self.suffix = prefix, window, suffix
        self.cfg, self.opts, self.device = cfg, opts, device
        self.max_tokens, self.context_tokens = max_tokens, context_tokens
        self.surprise, self.spread, self.growth = surprise, spread, growth
        specials = [t for t in (cfg.mask_token_id, cfg.pad_token_id, cfg.bos_token_id, *cfg.end_ids) if t is not None]
        subs = substitutions(edits, specials) if "memory" in self.flags else []
        self.memory = EditMemory(subs, memory, cfg.vocab_size, cfg.pad_token_id) if subs and memory > 0 else None
        self.stale = self.memory.stale(window) if self.memory is not None else [False] * len(window)
        self.canvas: Canvas | None = None
        self.slots: Slots | None = None
        self.remasked = self.memory_remasked = 0
        self.scored = self.cancelled = self.deadline_hit = False
        self.full_ms = 0.0  # the estimated cost of a full forward (the service's), for the scoring's deadline
        self.done = False
        if "window" in self.flags:
            self._start(window_slots(len(window), growth), edit_options(opts, spans=False))
        elif "surprise" not in self.flags:  # the memory alone: no scoring forward
            self._remask([False] * len(window))

    def _start(self, slots: Slots, opts: DecodeOptions) -> None:
        """Builds the denoising canvas for `slots` (padding room cut from the right to fit
        max_tokens) with the edit memory attached."""
        slots = fit(slots, self.max_tokens)
        try:
            c = build(self.prefix, self.suffix, self.window, slots, self.cfg, opts, self.context_tokens, self.device)
        except ValueError as e:
            raise EngineError(f"bad edit job: {e}") from None
        c.full_ms = self.full_ms
        self.remasked = sum(1 for s, m in zip(slots.src, slots.masked) if m and s is not None)
        if self.memory is not None:
            c.edit_bias = self._bias(slots, c.n)
        self.canvas, self.slots, self.done = c, slots, c.done

    def _bias(self, slots: Slots, n_canvas: int) -> EditBias:
        """The edit memory on these slots (of `n_canvas`: WeDLM adds a window's worth without a
        suffix): proposals where an old token stood, the chain in masked runs that hold one."""
        memory = self.memory
        if memory is None:
            raise ValueError("no edit memory on this run")
        props = memory.proposals(self.window)
        n = len(slots.src)
        stood = [props[s] if m and s is not None else [] for s, m in zip(slots.src, slots.masked)]
        live = [False] * n
        j = 0
        while j < n:  # each masked run: live when an old token stood in it
            if not slots.masked[j]:
                j += 1
                continue
            k = j
            while k < n and slots.masked[k]:
                k += 1
            hot = any(slots.src[i] is not None and self.stale[slots.src[i] or 0] for i in range(j, k))
            live[j:k] = [hot] * (k - j)
            j = k
        extra = max(0, n_canvas - n)
        return EditBias(memory, stood + [[]] * extra, live + [False] * extra, self.cfg.mask_token_id)

    def _remask(self, surprised: list[bool]) -> None:
        """Layout (b) from the surprising tokens and the memory's stale ones; done when none."""
        marks = [a or b for a, b in zip(surprised, self.stale)]
        remask = widen(marks, self.spread)
        self.memory_remasked = sum(widen(self.stale, self.spread)) if self.memory is not None else 0
        if not any(remask):
            self.done = True
            return
        self._start(remask_slots(remask, self.growth), edit_options(self.opts, spans=True))

    def next_step_ms(self) -> float:
        """Estimated cost of the next forward (0: unknown)."""
        return self.canvas.next_step_ms() if self.canvas is not None else self.full_ms

    def deadline_due(self, deadline: float | None, now: float | None = None) -> bool:
        """True when the next forward would end past the deadline: it must be the last one."""
        if deadline is None:
            return False
        return (time.monotonic() if now is None else now) + self.next_step_ms() / 1000 >= deadline

    def step(self, model: Transformer, final: bool = False) -> None:
        """Runs the next forward: the scoring one (a `final` one is never run: the window stays as it
        is), else one denoising step of the canvas (a `final` one commits every mask)."""
        if self.done:
            return
        self.deadline_hit |= final
        c = self.canvas
        if c is None:  # the surprise scoring forward
            if final or not self.window:  # nothing to commit yet / nothing to score
                self.done = True
                return
            sc = score_canvas(
                self.prefix,
                self.suffix,
                self.window,
                self.cfg,
                self.opts,
                self.context_tokens,
                self.device,
                self.score,
            )
            probs = window_probs(model, sc, self.window)
            self.scored = True
            self._remask(surprising(probs, self.surprise, 0))
            return
        c.deadline_hit |= final
        sampler.step(model, [c], [final])
        self.done = c.done

    def new_ids(self) -> tuple[list[int], list[float]]:
        """The window's ids as the canvas has them now, and per id its probability (1 where kept)."""
        c, slots = self.canvas, self.slots
        if c is None or slots is None or self.cancelled:
            return list(self.window), [1.0] * len(self.window)
        ids, masked, probs = c.slot_ids(), c.masked.tolist(), c.slot_prob
        ends = (self.cfg.pad_token_id, *self.cfg.end_ids)
        out: list[int] = []
        out_p: list[float] = []
        if "window" in self.flags:  # a fill: text to its first end
            n = fill_slots(c)
            keep = trim_fill([t for t, m in zip(ids[:n], masked) if not m], self.cfg.pad_token_id, self.cfg.end_ids)
            committed = [(t, p) for t, m, p in zip(ids[:n], masked, probs) if not m and t != self.cfg.pad_token_id]
            return keep, [p for _, p in committed[: len(keep)]]
        for j, s in enumerate(slots.src):
            if masked[j]:  # never committed (a cancelled run): the window's own token
                if s is not None:
                    out.append(self.window[s])
                    out_p.append(1.0)
            elif ids[j] not in ends:  # padding or an end empties its slot only
                out.append(ids[j])
                out_p.append(probs[j])
        return out, out_p

    def rewrite(self, decode: Callable[[list[int]], str], window_text: str) -> Rewrite:
        """The outcome as a Rewrite (text by `decode`; the window's own text where unchanged)."""
        ids, probs = self.new_ids()
        changed, changed_p = diff_stats(self.window, ids, probs)
        c = self.canvas
        written: list[float] = []
        if c is not None and self.slots is not None and not self.cancelled:
            ends = (self.cfg.pad_token_id, *self.cfg.end_ids)
            now, ms, slots = c.slot_ids(), c.masked.tolist(), self.slots
            rewritten = [j for j in range(fill_slots(c)) if "window" in self.flags or slots.masked[j]]
            written = [c.slot_prob[j] for j in rewritten if not ms[j] and now[j] not in ends]
            if changed and not changed_p:  # a run that only deletes: the slots it emptied
                changed_p = [c.slot_prob[j] for j in rewritten if not ms[j]]
        conf = math.exp(sum(math.log(max(p, 1e-12)) for p in written) / len(written)) if written else 1.0
        return Rewrite(
            text=window_text if changed == 0 else decode(ids),
            confidence=conf,
            steps=c.steps if c is not None else 0,
            cancelled=self.cancelled,
            deadline_hit=self.deadline_hit,
            changed=changed,
            min_confidence=min(changed_p, default=1.0),
            mean_confidence=sum(changed_p) / len(changed_p) if changed_p else 1.0,
            remasked=self.remasked,
            memory_remasked=self.memory_remasked,
            slots=sum(self.slots.masked) if self.slots is not None else 0,
            scored=self.scored,
            window_tokens=len(self.window),
            token_ids=ids,
        )


def rewrite(
    model: Transformer,
    run: EditRun,
    deadline: float | None = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> EditRun:
    """Runs an EditRun to the end on the calling thread, as sampler.fill runs a canvas: between
    forwards a cancelled run stops, and the forward that would pass the deadline is the last. A
    run cancelled before it starts is answered cancelled, even one with nothing to run."""
    if cancelled():
        run.cancelled = True
        return run
    while not run.done:
        if cancelled():
            run.cancelled = True
            break
        run.step(model, run.deadline_due(deadline))
    return run


__all__ = [
    "EditRun",
    "Slots",
    "build",
    "check_layout",
    "edit_options",
    "remask_slots",
    "rewrite",
    "score_canvas",
    "surprising",
    "window_probs",
    "window_slots",
]
