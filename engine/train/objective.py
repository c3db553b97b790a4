"""Training examples: the masked-diffusion objective and an infill objective shaped like the server's
requests.

Masked diffusion (LLaDA / MDLM): a window of tokens, each masked with probability t ~ U(0, 1);
cross-entropy on masked positions weighted 1/t.
Infill: clean prefix + n mask slots + clean suffix, cut at character positions (as an editor's cursor
cuts text, mid-word included); the middle's tokens fill the first slots and the surplus slots are
targeted to padding, so the model learns where a fill ends. A random share t of the slots is masked,
the rest shows its target, as in a partly denoised canvas. With probability `ordered` the canvas is
instead revealed from the left - its first j slots show their targets (j up to the middle's length)
and every later slot is masked - the state the server's left-to-right padding rule decodes from, where
the model must say whether the fill ends at the first masked slot.
Multi-hole infill (`multi_infill_example`): the same canvases, several to a window (each with its own
slots, end padding and mask rate), so far more of a window's positions are server-shaped targets than
with one hole per window (MODEL-NOTES: 4.6% of the positions with one hole).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.tokenizer import TextTokenizer

SLOT_BUCKETS = (8, 16, 24, 32, 48, 64)


@dataclass
class Example:
    ids: list[int]  # model input (with masks)
    targets: list[int]  # target id per position (-1: no loss)
    weight: float | list[float]  # loss weight per masked token (1 / (t * n)), or one per position
    # distillation (engine/train/distill.py): per position the teacher's top-k student ids (L, k) and their
    # probabilities (L, k), zero where the position has no soft target
    soft: tuple | None = None


@dataclass
class SpecialIds:
    mask: int
    pad: int
    eos: int


def mdlm_example(stream: Sequence[int], seq_len: int, ids: SpecialIds, rng: random.Random) -> Example:
    start = rng.randrange(0, max(1, len(stream) - seq_len))
    window = stream[start : start + seq_len]
    t = rng.uniform(0.02, 1.0)
    inp, tgt = [], []
    for tok in window:
        if rng.random() < t:
            inp.append(ids.mask)
            tgt.append(tok)
        else:
            inp.append(tok)
            tgt.append(-1)
    if all(x == -1 for x in tgt):
        i = rng.randrange(len(window))
        inp[i], tgt[i] = ids.mask, window[i]
    return Example(inp, tgt, 1.0 / (t * len(window)))


def cut_hole(text: str, rng: random.Random) -> tuple[int, int]:
    """Returns character offsets (a, b) of a middle, shaped like the server's hole kinds."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))
    code_lines = [i for i, ln in enumerate(lines) if ln.strip()]
    if not code_lines:
        a = rng.randrange(len(text))
        return a, min(len(text), a + rng.randint(1, 40))
    kind = rng.random()
    i = rng.choice(code_lines)
    line = lines[i].rstrip("\n")
    indent = len(line) - len(line.lstrip())
    if kind < 0.35:  # rest of line: cursor somewhere in the line, middle runs to its end
        a = starts[i] + rng.randint(indent, max(indent, len(line) - 1))
        return a, starts[i] + len(line)
    if kind < 0.65:  # block: one to eight whole lines, cursor at column 0 or after the indentation
        k = rng.randint(1, 8)
        j = min(len(lines), i + k)
        a = starts[i] + (indent if rng.random() < 0.5 else 0)
        b = starts[j] - (1 if rng.random() < 0.5 and j > i else 0)
        return a, max(a + 1, b)
    # middle: a span inside a line (code continues after it) or across lines
    a = starts[i] + rng.randint(indent, max(indent, len(line) - 1))
    b = a + rng.randint(1, 40)
    return a, min(b, len(text))


def infill_example(
    text: str,
    tok: TextTokenizer,
    seq_len: int,
    ids: SpecialIds,
    rng: random.Random,
    max_slots: int = 64,
    ordered: float = 0.0,
) -> Example | None:
    if len(text) < 20:
        return None
    a, b = cut_hole(text, rng)
    if b <= a:
        return None
    prefix, middle, suffix = text[max(0, a - 3000) : a], text[a:b], text[b : b + 2000]
    p_ids, m_ids, s_ids = tok.encode_batch([prefix, middle, suffix])
    if not m_ids:
        return None
    if len(m_ids) > max_slots:  # the rest of the middle moves into the suffix, still clean text
        s_ids = m_ids[max_slots:] + s_ids
        m_ids = m_ids[:max_slots]
    m = len(m_ids)
    if rng.random() < 0.6:
        n = rng.choice([s for s in SLOT_BUCKETS if s >= m] or [max_slots])
    else:
        n = min(max_slots, m + rng.randint(0, 16))
    n = max(n, m)
    room = seq_len - n
    s_keep = min(len(s_ids), rng.randint(0, room // 2))
    p_keep = min(len(p_ids), room - s_keep)
    p_ids, s_ids = p_ids[len(p_ids) - p_keep :], s_ids[:s_keep]
    canvas_target = m_ids + [ids.pad] * (n - m)
    if ordered > 0 and rng.random() < ordered:
        j = rng.randint(0, min(m, n - 1))  # the first masked slot is inside the middle or right after it
        masked = [i >= j for i in range(n)]
        t = (n - j) / n
    else:
        t = rng.uniform(0.02, 1.0)
        masked = [rng.random() < t for _ in range(n)]
        if not any(masked):
            masked[rng.randrange(n)] = True
    canvas = [ids.mask if mk else tg for mk, tg in zip(masked, canvas_target)]
    inp = p_ids + canvas + s_ids
    tgt = [-1] * len(p_ids) + [tg if mk else -1 for mk, tg in zip(masked, canvas_target)] + [-1] * len(s_ids)
    return Example(inp, tgt, 1.0 / (t * n))


def server_canvas(
    m_ids: list[int], ids: SpecialIds, rng: random.Random, ordered: float, max_slots: int
) -> tuple[list[int], list[int], float]:
    """(inputs, targets, weight) of one canvas for a middle: slots, end padding and masks as above."""
    m = len(m_ids)
    if rng.random() < 0.6:
        n = rng.choice([s for s in SLOT_BUCKETS if s >= m] or [max_slots])
    else:
        n = min(max_slots, m + rng.randint(0, 16))
    n = max(n, m)
    target = m_ids + [ids.pad] * (n - m)
    if ordered > 0 and rng.random() < ordered:
        j = rng.randint(0, min(m, n - 1))
        masked = [i >= j for i in range(n)]
        t = (n - j) / n
    else:
        t = rng.uniform(0.02, 1.0)
        masked = [rng.random() < t for _ in range(n)]
        if not any(masked):
            masked[rng.randrange(n)] = True
    inp = [ids.mask if mk else tg for mk, tg in zip(masked, target)]
    tgt = [tg if mk else -1 for mk, tg in zip(masked, target)]
    return inp, tgt, 1.0 / (t * n)


def multi_infill_example(
    text: str,
    tok: TextTokenizer,
    seq_len: int,
    ids: SpecialIds,
    rng: random.Random,
    holes: int = 4,
    max_slots: int = 64,
    ordered: float = 0.0,
    chars_per_token: float = 3.4,
) -> Example | None:
    """A window of `text` with up to `holes` server-shaped holes, each its own canvas (see above)."""
    if len(text) < 20:
        return None
    span = int(seq_len * chars_per_token)
    start = rng.randrange(0, max(1, len(text) - span))
    window = text[start : start + span]
    cuts = sorted(cut_hole(window, rng) for _ in range(holes))
    kept: list[tuple[int, int]] = []
    for a, b in cuts:  # non-overlapping, with clean text between holes
        if b > a and (not kept or a > kept[-1][1]):
            kept.append((a, b))
    if not kept:
        return None
    pieces, pos = [], 0
    for a, b in kept:
        pieces += [window[pos:a], window[a:b]]
        pos = b
    pieces.append(window[pos:])
    enc = tok.encode_batch(pieces)
    inp: list[int] = []
    tgt: list[int] = []
    wts: list[float] = []
    for k, piece in enumerate(enc):
        if k % 2 == 0:  # clean text
            piece = piece[: max(0, seq_len - len(inp))]
            inp += piece
            tgt += [-1] * len(piece)
            wts += [0.0] * len(piece)
            continue
        m_ids = piece[:max_slots]
        if not m_ids:
            continue
        c_inp, c_tgt, w = server_canvas(m_ids, ids, rng, ordered, max_slots)
        if len(inp) + len(c_inp) > seq_len:
            break
        inp += c_inp
        tgt += c_tgt
        wts += [w] * len(c_inp)
        if len(m_ids) < len(piece):  # the rest of a long middle stays as clean text
            rest = piece[max_slots:][: max(0, seq_len - len(inp))]
            inp += rest
            tgt += [-1] * len(rest)
            wts += [0.0] * len(rest)
    if all(t < 0 for t in tgt):
        return None
    return Example(inp, tgt, wts)


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pads a batch; key_valid is False at batch padding so no real token attends to it."""
    L = max(len(e.ids) for e in examples)
    B = len(examples)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    tgt = torch.full((B, L), -1, dtype=torch.long)
    valid = torch.zeros((B, L), dtype=torch.bool)
    w = torch.zeros((B, L), dtype=torch.float32)
    for i, e in enumerate(examples):
        n = len(e.ids)
        ids[i, :n] = torch.tensor(e.ids)
        tgt[i, :n] = torch.tensor(e.targets)
        valid[i, :n] = True
        w[i, :n] = torch.tensor(e.weight) if isinstance(e.weight, list) else e.weight
    out = {"ids": ids, "targets": tgt, "key_valid": valid, "weights": w}
    soft = [e.soft for e in examples if e.soft is not None]
    if soft:  # soft targets (distillation): zeros for the examples without them
        k = soft[0][0].shape[1]
        out["soft_ids"] = torch.zeros((B, L, k), dtype=torch.long)
        out["soft_p"] = torch.zeros((B, L, k), dtype=torch.float32)
        for i, e in enumerate(examples):
            if e.soft is not None:
                n = len(e.ids)
                out["soft_ids"][i, :n], out["soft_p"][i, :n] = e.soft
    return out
