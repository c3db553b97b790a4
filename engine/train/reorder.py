"""Recipe (c)'s objective: training examples for causal-attention diffusion with reordering (the
layout engine/decode/reorder.py decodes: observed tokens first, masked slots last, each row at its
logical position).

Training (`dlm-lsp train --objective reorder`):
- server-shaped infill (the canvases of engine/train/objective.py: n slots, end padding, some slots revealed,
  left-revealed share `ordered`; `holes` per window): [clean text][revealed slots][masked slots], the
  revealed slots in 1-4 groups (each in logical order) as a decode's steps leave them in the cache;
- masked-diffusion windows (t ~ U(0.02, 1)): unmasked tokens first, masked last, weight 1/t;
- optionally (`ar_weight` > 0) WeDLM's auxiliary next-token loss: an observed row predicts the next
  logical token when that token is observed and later in physical order (never a row it can see).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from engine.tokenizer import TextTokenizer
from engine.train.objective import Example, SpecialIds, collate, cut_hole, mdlm_example, server_canvas

# physical groups, in this order: clean text, a canvas's revealed slots as if committed over up to
# REVEAL_STEPS decode steps (groups REVEALED.., each in logical order, as the decode appends each step's
# commits after the earlier ones'), the masked slots
REVEAL_STEPS = 4
CLEAN, REVEALED, MASKED = 0, 1, 1 + REVEAL_STEPS
CanvasPart = tuple[list[int], list[int], float]  # one canvas's (inputs, targets, weight): objective.server_canvas


@dataclass
class ReorderExample(Example):
    pos: list[int] = field(default_factory=list)  # logical position of each (physical) row


def layout(
    ids: list[int], targets: list[int], weights: list[float], groups: list[int], mask_id: int, ar_weight: float = 0.0
) -> ReorderExample:
    """Physical order of a logically laid out example: rows sorted by group (CLEAN, REVEALED + k, MASKED),
    logical order within a group; each row keeps its logical position. With `ar_weight`, observed rows
    whose logical successor is observed and physically later also predict it (weights summing to
    ar_weight)."""
    order = sorted(range(len(ids)), key=lambda i: (groups[i], i))
    w = [weights[i] for i in order]
    ex = ReorderExample([ids[i] for i in order], [targets[i] for i in order], w, pos=order)
    if ar_weight > 0:
        phys = {p: r for r, p in enumerate(order)}  # logical position -> physical row
        rows = [
            r
            for r, p in enumerate(order)
            if ids[p] != mask_id and p + 1 < len(ids) and ids[p + 1] != mask_id and phys[p + 1] > r
        ]
        for r in rows:
            ex.targets[r] = ids[order[r] + 1]
            w[r] = ar_weight / len(rows)  # w is ex.weight
    return ex


def window_example(
    stream: Sequence[int], seq_len: int, ids: SpecialIds, rng: random.Random, ar_weight: float = 0.0
) -> ReorderExample:
    """A masked-diffusion window (mask rate t ~ U(0.02, 1), weight 1/t): unmasked tokens first, masked last."""
    e = mdlm_example(stream, seq_len, ids, rng)
    groups = [MASKED if t == ids.mask else CLEAN for t in e.ids]
    w = cast(float, e.weight)  # mdlm_example's weight is one number for the window
    return layout(e.ids, e.targets, [w] * len(e.ids), groups, ids.mask, ar_weight)


def infill_example(
    text: str,
    tok: TextTokenizer,
    seq_len: int,
    ids: SpecialIds,
    rng: random.Random,
    holes: int = 1,
    max_slots: int = 64,
    ordered: float = 0.0,
    ar_weight: float = 0.0,
    chars_per_token: float = 3.4,
) -> ReorderExample | None:
    """Server-shaped infill in the reorder layout. One hole: a prefix (up to 3000 characters) and a
    suffix cut around it as objective.infill_example does; several: a window of text with up to `holes`
    canvases, as objective.multi_infill_example. Each canvas comes from objective._canvas (n slots, end
    padding, random or left-revealed masks)."""
    if len(text) < 20:
        return None
    if holes <= 1:
        a, b = cut_hole(text, rng)
        if b <= a:
            return None
        p_ids, m_ids, s_ids = tok.encode_batch([text[max(0, a - 3000) : a], text[a:b], text[b : b + 2000]])
        if not m_ids:
            return None
        s_ids, m_ids = m_ids[max_slots:] + s_ids, m_ids[:max_slots]  # the rest of a long middle: clean text
        c_inp, c_tgt, w = server_canvas(m_ids, ids, rng, ordered, max_slots)
        room = seq_len - len(c_inp)
        s_keep = min(len(s_ids), rng.randint(0, room // 2))
        p_keep = min(len(p_ids), room - s_keep)
        pieces: list[list[int] | CanvasPart] = [p_ids[len(p_ids) - p_keep :], (c_inp, c_tgt, w), s_ids[:s_keep]]
    else:
        span = int(seq_len * chars_per_token)
        start = rng.randrange(0, max(1, len(text) - span))
        window = text[start : start + span]
        kept: list[tuple[int, int]] = []
        for a, b in sorted(cut_hole(window, rng) for _ in range(holes)):  # non-overlapping, text between
            if b > a and (not kept or a > kept[-1][1]):
                kept.append((a, b))
        if not kept:
            return None
        cuts, at = [], 0
        for a, b in kept:
            cuts += [window[at:a], window[a:b]]
            at = b
        cuts.append(window[at:])
        pieces, used = [], 0
        for k, piece in enumerate(tok.encode_batch(cuts)):
            if k % 2 == 0 or not piece[:max_slots]:
                piece = piece[: max(0, seq_len - used)]
                pieces.append(piece)
                used += len(piece)
                continue
            c = server_canvas(piece[:max_slots], ids, rng, ordered, max_slots)
            if used + len(c[0]) > seq_len:
                break
            pieces.append(c)
            used += len(c[0])
            rest = piece[max_slots:][: max(0, seq_len - used)]
            pieces.append(rest)
            used += len(rest)
    inp: list[int] = []
    tgt: list[int] = []
    wts: list[float] = []
    grp: list[int] = []
    for part in pieces:  # clean text (a list of ids) or a canvas (inputs, targets, weight)
        if isinstance(part, tuple):
            c_inp, c_tgt, w = part
            inp += c_inp
            tgt += c_tgt
            wts += [w] * len(c_inp)
            steps = rng.randint(1, REVEAL_STEPS)  # the revealed slots as the commits of this many steps
            grp += [MASKED if t == ids.mask else REVEALED + rng.randrange(steps) for t in c_inp]
        else:
            inp += part
            tgt += [-1] * len(part)
            wts += [0.0] * len(part)
            grp += [CLEAN] * len(part)
    if all(t < 0 for t in tgt):
        return None
    return layout(inp, tgt, wts, grp, ids.mask, ar_weight)


def collate_reorder(examples: list[ReorderExample], pad_id: int) -> dict[str, torch.Tensor]:
    """objective.collate plus "pos" (B, L): each row's logical position (0 at batch padding)."""
    b = collate(examples, pad_id)
    pos = torch.zeros_like(b["ids"])
    for i, e in enumerate(examples):
        pos[i, : len(e.pos)] = torch.tensor(e.pos)
    b["pos"] = pos
    return b
