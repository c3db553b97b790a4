"""WeDLM's streaming-window decoding: its authors' rule, on the engine's reordered causal canvas.

WeDLM (Tencent/WeDLM; read in `wedlm/engine/wedlm_decoder.py`, `wedlm/engine/sampler.py`,
`wedlm/sampling_params.py`, `wedlm/config.py`) is a Qwen2.5 / Qwen3 decoder run with plain causal
attention. Its engine decodes a stream:
- a window of `wedlm_window_size` (16) positions starts at the leftmost still-masked position;
  each step runs the window's observed tokens first (logical order), then its masks (logical
  order), every row at its logical position id, against the K/V of the prompt and of every token
  already left of the window;
- after that forward the window's leading run of committed tokens is "pruned": it leaves the
  window, its K/V stay in the cache (they depend on nothing after them), and the window refills
  with masks on the right, so it spans the 16 positions from the new leftmost mask;
- among the window's masks, with H the entropy of a mask's predicted distribution (over the whole
  vocabulary) and d its distance from the window's first mask, every mask with
  H + `wedlm_pos_penalty_factor` (0.02) x d < `wedlm_entropy_threshold` (0.4) is committed to its
  argmax token (temperature 0), else the single mask with the lowest H + 0.02 d;
- a stop token (the tokenizer's end-of-text) reaching the pruned stream ends generation; so does
  `max_tokens` (the window itself runs up to 16 positions past it; what it commits there is dropped).

So in physical order a step is [prompt][every committed token, logical order][window masks], the
left-contiguous committed run exactly cached and every other committed token re-run, which is
what ReorderCanvas does for this family (engine/decode/reorder.py). A prefix-only fill of n slots gets
WINDOW - 1 hidden slots after them, as the authors' window runs past max_tokens, and is the
authors' generation with max_tokens = n; with a suffix the suffix is the engine's extension
(the authors have no infill): it is observed context at its logical positions right after the
prefix, and the window stops at the last slot. tests/test_families_wedlm.py re-implements the
authors' loop with `transformers` as the oracle.

The engine keeps one deliberate difference: a slot is never filled with the mask id (the authors'
argmax may pick it; a trained WeDLM gives it ~0 probability at a mask), so the entropy is taken
over the vocabulary without the mask id.
"""

from __future__ import annotations

import dataclasses

from engine.api import DecodeOptions

# the authors' defaults (wedlm/config.py Config.wedlm_window_size, wedlm/sampling_params.py
# SamplingParams.wedlm_entropy_threshold / wedlm_pos_penalty_factor); module data, as DreamOn's
# START_SLOTS: tests set other values to show the rule matters
WINDOW = 16
ENTROPY_THRESHOLD: float | None = 0.4  # None: one commit per step, the lowest adjusted entropy
POS_PENALTY = 0.02


def options(opts: DecodeOptions) -> DecodeOptions:
    """The engine options under which its commit runs WeDLM's rule, whatever was asked: the family's
    own window (not `window`, which counts masked slots), no semi-AR block or padding rule, and
    entropy as the confidence (the rule reads it back as -confidence)."""
    return dataclasses.replace(
        opts,
        window=0,
        block=0,
        pad_left=False,
        pad_stop=2.0,
        freeze=False,
        selection="threshold",
        confidence="neg_entropy",
    )


def window_masks(masked_slots: list[int]) -> int:
    """How many of the masked slots (ascending) lie in the window: the WINDOW positions from the
    leftmost one."""
    if not masked_slots:
        return 0
    end = masked_slots[0] + WINDOW
    return sum(1 for s in masked_slots if s < end)


def select(slots: list[int], entropy: list[float], first: int) -> list[int]:
    """Indices into `slots` (masked slot numbers, ascending, all in the window) to commit this step:
    every slot whose entropy + POS_PENALTY x (slot - first) is below ENTROPY_THRESHOLD, else the
    one with the lowest such value (the leftmost on ties, as argmin). `first`: the window's first mask."""
    adj = [e + POS_PENALTY * (s - first) for s, e in zip(slots, entropy)]
    if ENTROPY_THRESHOLD is not None:
        pick = [i for i, a in enumerate(adj) if a < ENTROPY_THRESHOLD]
        if pick:
            return pick
    return [min(range(len(adj)), key=lambda i: (adj[i], i))]


def finished(slot_ids: list[int], masked: list[bool], keep: int, stop: tuple) -> bool:
    """True when the authors' stream would have ended: the first `keep` slots are all committed, or a
    stop token is committed with no mask before it."""
    for t, m in zip(slot_ids[:keep], masked[:keep]):
        if m:
            return False
        if t in stop:
            return True
    return True
