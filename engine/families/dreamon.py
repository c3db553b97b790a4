"""DreamOn's variable-length middle: an expand token becomes two masks, an end-of-text is deleted.

DreamOn (Dream-org/DreamOn-v0-7B, HKUNLP; `generation_utils.py` `DreamOnGenerationMixin._sample`,
and the README's `process_infilling_prompt`) is a Dream-Coder model trained with two more states
for a masked slot, so the middle need not have the right length in advance:
- the canvas is BOS + prefix + a few masks + suffix + EOS (the authors start with 4 to 16 masks);
- each step predicts every mask (logits shifted, as Dream) and commits the single most confident
  one (`number_transfer_tokens` = 1, by max probability or negative entropy);
- a committed end-of-text (the checkpoint's eos id) is removed from the middle: it shrinks;
- a committed expand token (the checkpoint's expand id) is replaced by two masks: it grows;
- the expand token is banned (its logit pushed to -1e9) once the middle is at its longest
  (`max_new_tokens`, here the job's slot count) or the expand budget (2 x (middle + suffix)
  tokens) is spent; the loop stops when no mask is left, or after 2 x that length + 2 x the
  budget steps.
The engine runs this on its own Canvas: `layout` builds it, `options` pins the decoding rules that
make it exact (no context cache, one commit per step, no window, no healing), and `edit` resizes the
middle after each commit. tests/test_families_decode.py re-implements the authors' loop as the
oracle and the engine's fill equals it token for token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.api import DecodeOptions
from engine.model.config import ModelConfig

if TYPE_CHECKING:  # engine.decode.canvas imports this module
    from engine.decode.canvas import Canvas
    from engine.model.transformer import Transformer

START_SLOTS = 16  # masks the middle starts with (the authors' evaluation: min_gen_len 16); it grows from there


@dataclass
class Middle:
    """The middle's length limits for one canvas."""

    max_slots: int  # the longest the middle may grow (the job's slots)
    budget: int  # expansions left
    step_cap: int  # the authors' loop bound

    def expand_banned(self, n: int, final: bool) -> bool:
        """True when this step may not predict the expand token: the middle is at its longest, the
        budget is spent, or the step is the last one (nothing may be left masked after it)."""
        return final or n >= self.max_slots or self.budget <= 0


def layout(
    prefix: list[int], suffix: list[int], n: int, cfg: ModelConfig, context_tokens: int
) -> tuple[list[int], list[int], int, Middle]:
    """(BOS + prefix, suffix + EOS, masks to start with, limits) for a middle of at most n slots;
    the prefix's oldest and the suffix's last tokens make room for BOS and EOS in the context."""
    over = len(prefix) + n + len(suffix) + 2 - context_tokens
    if over > 0:
        cut_s = min(len(suffix), over // 2)
        suffix = suffix[: len(suffix) - cut_s]
        prefix = prefix[min(len(prefix), over - cut_s) :]
    prefix = ([cfg.bos_token_id] if cfg.bos_token_id is not None else []) + prefix
    suffix = suffix + [cfg.eos_token_id]
    gen = n + len(suffix)  # the authors' max_gen_len: max_length - prefix length
    return prefix, suffix, min(n, START_SLOTS), Middle(max_slots=n, budget=2 * gen, step_cap=6 * gen)


def options(opts: DecodeOptions) -> DecodeOptions:
    """The decoding options DreamOn's loop needs, whatever was asked: the canvas changes length, so
    no context cache, window, block or padding rule; one commit per step (a threshold above every
    confidence commits exactly the most confident slot); no token healing."""
    return dataclasses.replace(
        opts,
        cache=False,
        freeze=False,
        window=0,
        block=0,
        pad_left=False,
        heal=False,
        selection="threshold",
        threshold=2.0,
        steps=None,
        pad_stop=2.0,
    )


def stats_without_expand(
    model: Transformer, h: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """slot_stats for slot rows h (M, D) with the mask and the expand token both banned (torch; the
    rare steps where the middle is at its longest)."""
    logits = model.logits(h).float()  # (M, V)
    logits[:, [cfg.mask_token_id, cfg.expand_token_id]] = float("-inf")
    logp = logits.log_softmax(-1)
    top = logp.topk(2, dim=-1)
    p = logp.exp()
    ent = -(p * logp.clamp_min(-1e30)).sum(-1)
    return top.values[:, 0].exp(), top.indices[:, 0], top.values[:, 1].exp(), ent


def edit(c: Canvas, committed: list[int]) -> None:
    """After a commit: committed end-of-text slots leave the middle, committed expand slots become
    two masks (deletions first, as the authors do); then c.done is set."""
    cfg, mid = c.cfg, c.middle
    assert mid is not None, "dreamon.edit runs on DreamOn canvases only (Canvas.build sets their middle)"
    slots, masked, probs = c.slot_ids(), c.masked.tolist(), list(c.slot_prob)
    gone = {j for j in committed if slots[j] == cfg.eos_token_id}
    grow = {j for j in committed if slots[j] == cfg.expand_token_id} - gone
    if gone or grow:
        new_s, new_m, new_p = [], [], []
        for j, (t, m, p) in enumerate(zip(slots, masked, probs)):
            if j in gone:
                continue
            if j in grow:
                new_s += [cfg.mask_token_id] * 2
                new_m += [True, True]
                new_p += [0.0, 0.0]
            else:
                new_s.append(t)
                new_m.append(m)
                new_p.append(p)
        mid.budget -= len(grow)
        resize(c, new_s, new_m, new_p)
    c.done = c.n_masked == 0 or c.steps >= mid.step_cap


def resize(c: Canvas, slots: list[int], masked: list[bool], probs: list[float]) -> None:
    """Gives the canvas a middle of len(slots) slots; everything sized by the slot count is rebuilt
    and the context K/V dropped (the next step is a full forward)."""
    dev = c.ids.device
    c.ids = torch.cat([c.ids[: c.start], torch.tensor(slots, dtype=torch.long, device=dev), c.ids[c.start + c.n :]])
    c.n = len(slots)
    c.masked = torch.tensor(masked, dtype=torch.bool, device=dev)
    c.n_masked = sum(masked)
    c.slot_prob = probs
    c.active_pos = torch.arange(c.start - (1 if c.cfg.logits_shift else 0), c.start + c.n, device=dev)
    c.frozen = torch.zeros(c.n, dtype=torch.bool, device=dev)
    c.n_frozen, c.ctx_len = 0, 0
    c.kv = c.kv_pos = c.slot_kv = None
    c._masked_at = (-1, None)
