"""Training examples for next edits: the canvases engine/decode/rewrite.py decodes, with the rewrite
the truth makes as targets (B), and wrong visible tokens the model learns to doubt (C).

An edit case (engine/train/edit_pairs.py's format; `load_case` gives the document the user holds and
the document after the truth) becomes one canvas, prefix + the window's slots + suffix:

  window  the whole lines the server rewrites (`edit_window`): dlm_lsp/fill/nextedit.py's
          `window_lines` at the cursor, mirrored here (engine/ never imports dlm_lsp; a test holds the
          two equal); when the truth lies outside the cursor's window, the same rule at the truth.
  (a) "window": every slot masked at serving (rewrite.py `window_slots`): the window's tokens plus
          ceil(growth x them) of padding room; targets the window after the truth, then padding
          (server_canvas's end convention). A random share t of the slots is masked, the rest shows
          its target, as on a partly denoised canvas (with `ordered`, the left part shows).
  (b) "surprise": the window's own tokens shown; the runs a token diff of the window's ids and the
          new window's ids finds changed (an insertion marks the token after it), widened by `spread`
          as `surprising` widens, are masked with padding room after each run (rewrite.py
          `remask_slots`); a run's targets are its new tokens, then padding. A random share t of
          the runs' slots is masked, as in (a). A noise case, and with `decoy` an edit case too, also
          gets a run the scoring flagged though nothing changes there: its target is itself.
  Noise (truth null): the target is the window unchanged, so the model learns to keep it.
  Weights 1/(t x n) per masked slot (n the slots that start masked at serving), as server_canvas's.

The serving canvases' padding room and spread are EditJob's defaults (engine/api.py), so training and
serving lay out the same window the same way; a new window longer than its slots gets more room.

(C) `corrupt_visible`: layout (b)'s scoring forward reads each visible token's own probability, but no
objective ever showed the model a wrong visible token, so it never doubts one. On any Example, a share
of the visible (unmasked, non-special) tokens is replaced by plausible wrong ones (on an edit canvas
first the pre-edit token where the truth put a new one; else `pick`'s), and every visible position
gets a target, its true token. A target at position i means the token at i, as the masked targets
already do: loop.py's loss moves each target one row left for a logits-shifted model (shift_targets),
the row rewrite.py's `window_probs` reads a shifted model's probability of a visible token from.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import random
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.api import EditJob
from engine.tokenizer import TextTokenizer, common_prefix
from engine.train.edit_pairs import load_case
from engine.train.objective import Example, SpecialIds

LAYOUTS = ("window", "surprise")
GROWTH: float = EditJob.growth  # the server's padding room per masked run (ceil(growth x its tokens))
SPREAD: int = EditJob.spread  # the server's neighbours remasked either side of a surprising token
DECOY = 0.25  # share of edit cases whose layout (b) canvas also gets a run with nothing to change
# (C): every kept visible token of a corrupted example shares KEEP_TOTAL of loss weight, the corrupted
# ones share FIX_TOTAL (a masked canvas's weights sum to ~1): copying a shown token is easy and must not
# drown the masked loss, while a wrong token to doubt is the rare signal this objective exists for
KEEP_TOTAL = 0.1
FIX_TOTAL = 0.5
CORRUPT_TOKENS = 0.05  # share of an example's visible tokens corrupted (a stale window's few old names)
CONTEXT_CHARS = 8  # characters of prefix / suffix text tokenized per token of seq_len (more than enough)

_BREAK = re.compile(r"\r\n?|\n")  # LSP's line breaks, as dlm_lsp/fill/nextedit.py cuts lines
_IDENT = re.compile(r"[^\W\d]\w*")

# ---------------------------------------------------------------- the window (as the server picks it)


def window_lines(text: str, offset: int, above: int = 2, below: int = 8, max_lines: int = 12) -> tuple[int, int]:
    """(start, end) str offsets of the server's window around `offset`: a copy of
    dlm_lsp/fill/nextedit.py's `window_lines` (its docstring says the rules), which engine/ cannot import."""
    offset = max(0, min(offset, len(text)))
    if 0 < offset < len(text) and text[offset - 1] == "\r" and text[offset] == "\n":
        offset -= 1
    above = max(0, min(above, max_lines - 1))
    below = max(0, min(below, max_lines - 1 - above))
    start = _line_start(text, offset)
    for _ in range(above):
        if start == 0:
            break
        start = _line_start(text, start - (2 if text.startswith("\r\n", start - 2) else 1))
    end = _line_start(text, offset)
    for _ in range(below + 1):
        m = _BREAK.search(text, end)
        if m is None:
            return start, len(text)
        end = m.end()
    return start, end


def _line_start(text: str, offset: int) -> int:
    return max(text.rfind("\n", 0, offset), text.rfind("\r", 0, offset)) + 1


def truth_span(doc: str, after: str) -> tuple[int, int, int] | None:
    """(offset, old length, new length) of the one change that makes `after` of `doc` (their common
    head and tail left out), or None when they are equal."""
    if doc == after:
        return None
    head = common_prefix(doc, after)
    tail = common_prefix(doc[head:][::-1], after[head:][::-1])
    return head, len(doc) - head - tail, len(after) - head - tail


def edit_window(doc: str, cursor: int, truth: tuple[int, int] | None) -> tuple[int, int]:
    """(start, end) of the window an edit example rewrites: the server's window at the cursor when it
    holds the truth's (offset, old length) span, or for noise; else the same rule at the truth's start,
    stretched over whole lines to the span's end."""
    start, end = window_lines(doc, cursor)
    if truth is None:
        return start, end
    off, n_old = truth
    if start <= off and off + n_old <= end:
        return start, end
    start, end = window_lines(doc, off)
    e = off + n_old
    if e > end:
        at_line_start = doc[e - 1] == "\n" or (doc[e - 1] == "\r" and not doc.startswith("\n", e))
        m = None if at_line_start else _BREAK.search(doc, e)
        end = e if at_line_start else m.end() if m else len(doc)
    return start, end


# ---------------------------------------------------------------- the window's slots


def room(n: int, growth: float) -> int:
    """Padding-room slots after a masked run of n tokens (rewrite.py's `room`)."""
    return max(1, math.ceil(growth * n)) if n and growth > 0 else 0


def widen(marks: Sequence[bool], spread: int) -> list[bool]:
    """`marks` with `spread` neighbours either side of each True set too (rewrite.py's `widen`)."""
    out = [False] * len(marks)
    for i, m in enumerate(marks):
        if m:
            for j in range(max(0, i - spread), min(len(marks), i + spread + 1)):
                out[j] = True
    return out


@dataclass
class EditCanvas:
    """A window's slots: inputs, targets (-1: none), the weight of a masked slot, and per slot the
    window index it shows or stands for (None: padding room), whether serving starts it masked, and
    the pre-edit token where it shows a new one that replaced it (-1: none)."""

    ids: list[int]
    targets: list[int]
    weight: float
    src: list[int | None]
    run: list[bool]
    wrong: list[int]


def _reveal(n: int, m: int, rng: random.Random, ordered: float) -> tuple[list[bool], float]:
    """Which of n slots are masked, and the mask rate: each with probability t ~ U(0.02, 1) (one at
    least), or with probability `ordered` every slot from the j-th on (j up to the text's m tokens)."""
    if ordered > 0 and rng.random() < ordered:
        j = rng.randint(0, min(m, n - 1))
        return [i >= j for i in range(n)], (n - j) / n
    t = rng.uniform(0.02, 1.0)
    masked = [rng.random() < t for _ in range(n)]
    if not any(masked):
        masked[rng.randrange(n)] = True
    return masked, t


def _opcodes(old: Sequence[int], new: Sequence[int]) -> Sequence[tuple[str, int, int, int, int]]:
    return difflib.SequenceMatcher(None, list(old), list(new), autojunk=False).get_opcodes()


def window_canvas(
    old: list[int], new: list[int], ids: SpecialIds, rng: random.Random, growth: float = GROWTH, ordered: float = 0.0
) -> EditCanvas:
    """Layout (a): the window's tokens and their padding room, targets `new` then padding."""
    n = max(1, len(old) + room(len(old), growth), len(new))
    target = new + [ids.pad] * (n - len(new))
    was = [-1] * n
    for tag, i1, i2, j1, j2 in _opcodes(old, new):
        if tag == "replace":  # a new token shown in a slot stands where its old one stood
            for k in range(min(i2 - i1, j2 - j1)):
                was[j1 + k] = old[i1 + k]
    masked, t = _reveal(n, len(new), rng, ordered)
    return EditCanvas(
        [ids.mask if mk else tg for mk, tg in zip(masked, target)],
        [tg if mk else -1 for mk, tg in zip(masked, target)],
        1.0 / (t * n),
        [i if i < len(old) else None for i in range(n)],
        [True] * n,
        [-1 if mk else w for mk, w in zip(masked, was)],
    )


def remask_marks(old: list[int], new: list[int], rng: random.Random, spread: int, decoy: float) -> list[bool]:
    """Per window token: masked in layout (b). The tokens the diff replaces or deletes, the token after
    each insertion (the last one at the end), a decoy run (always for noise), each widened by `spread`."""
    marks = [False] * len(old)
    for tag, i1, i2, _, _ in _opcodes(old, new):
        if tag in ("replace", "delete"):
            marks[i1:i2] = [True] * (i2 - i1)
        elif tag == "insert" and old:
            marks[min(i1, len(old) - 1)] = True
    if old and (not any(marks) or rng.random() < decoy):
        i = rng.randrange(len(old))
        for k in range(i, min(len(old), i + rng.randint(1, 4))):
            marks[k] = True
    return widen(marks, spread)


def surprise_canvas(
    old: list[int],
    new: list[int],
    ids: SpecialIds,
    rng: random.Random,
    growth: float = GROWTH,
    spread: int = SPREAD,
    decoy: float = DECOY,
) -> EditCanvas:
    """Layout (b): the window's tokens, each masked run (`remask_marks`) followed by its padding room;
    a run's slots target its new tokens, then padding. An empty window has no token to show: (a)."""
    if not old:
        return window_canvas(old, new, ids, rng, growth)
    remask = remask_marks(old, new, rng, spread, decoy)
    to_new = {i1 + k: j1 + k for tag, i1, i2, j1, _ in _opcodes(old, new) if tag == "equal" for k in range(i2 - i1)}
    src: list[int | None] = []
    shown: list[int] = []  # per slot: the token it shows (a run's slot: its target)
    run: list[bool] = []
    was: list[int] = []
    i = 0
    while i < len(old):
        if not remask[i]:  # kept: outside every run, so the diff keeps it (to_new has it)
            src.append(i)
            shown.append(old[i])
            run.append(False)
            was.append(-1)
            i += 1
            continue
        j = i
        while j < len(old) and remask[j]:
            j += 1
        seg = new[to_new[i - 1] + 1 if i else 0 : to_new[j] if j < len(old) else len(new)]
        n = max(j - i + room(j - i, growth), len(seg))
        src += [i + k if k < j - i else None for k in range(n)]
        shown += seg + [ids.pad] * (n - len(seg))
        run += [True] * n
        was += [old[i + k] if k < min(j - i, len(seg)) and old[i + k] != seg[k] else -1 for k in range(n)]
        i = j
    slots = [k for k, r in enumerate(run) if r]
    masked_at, t = _reveal(len(slots), len(slots), rng, 0.0)
    masked = [False] * len(src)
    for k, mk in zip(slots, masked_at):
        masked[k] = mk
    return EditCanvas(
        [ids.mask if mk else s for mk, s in zip(masked, shown)],
        [s if mk else -1 for mk, s in zip(masked, shown)],
        1.0 / (t * len(slots)),
        src,
        run,
        [-1 if mk else w for mk, w in zip(masked, was)],
    )


# ---------------------------------------------------------------- examples


@dataclass
class EditExample(Example):
    """An Example of an edit canvas: where the window's slots lie, and per position the pre-edit
    token a shown new token replaced (-1: none; corrupt_visible puts those back first)."""

    span: tuple[int, int] = (0, 0)
    wrong: list[int] | None = None


def edit_example(
    doc: str,
    after: str,
    cursor: int,
    tok: TextTokenizer,
    seq_len: int,
    ids: SpecialIds,
    rng: random.Random,
    layout: str = "window",
    ordered: float = 0.0,
    growth: float = GROWTH,
    spread: int = SPREAD,
    decoy: float = DECOY,
) -> EditExample | None:
    """An edit canvas for the document the user holds (`doc`, the cursor in it) and the document after
    the truth (`after`; `doc` itself for noise), or None when the window's slots do not fit seq_len.
    Prefix and suffix are cut as the server's canvas cuts them: the suffix to a third of the room at
    most, the text nearest the window kept."""
    if layout not in LAYOUTS:
        raise ValueError(f"edit layout must be one of {LAYOUTS}, got {layout!r}")
    span = truth_span(doc, after)
    start, end = edit_window(doc, cursor, span[:2] if span else None)
    new_end = end + (span[2] - span[1] if span else 0)
    reach = seq_len * CONTEXT_CHARS
    p_ids, old, new, s_ids = tok.encode_batch(
        [doc[max(0, start - reach) : start], doc[start:end], after[start:new_end], doc[end : end + reach]]
    )
    if layout == "window":
        c = window_canvas(old, new, ids, rng, growth, ordered)
    else:
        c = surprise_canvas(old, new, ids, rng, growth, spread, decoy)
    n = len(c.ids)
    if n > seq_len:
        return None
    free = seq_len - n
    s_keep = min(len(s_ids), free // 3)
    p_keep = min(len(p_ids), free - s_keep)
    p_ids, s_ids = p_ids[len(p_ids) - p_keep :], s_ids[:s_keep]
    p, s = len(p_ids), len(s_ids)
    return EditExample(
        p_ids + c.ids + s_ids,
        [-1] * p + c.targets + [-1] * s,
        c.weight,
        span=(p, p + n),
        wrong=[-1] * p + c.wrong + [-1] * s,
    )


Pick = Callable[[random.Random, int, Sequence[int]], int | None]


def corrupt_visible(
    example: Example,
    rng: random.Random,
    share: float,
    pick: Pick,
    special: Collection[int],
    reach: int = 64,
) -> Example:
    """`example` with round(share x its visible tokens) of them wrong, and a target at every visible
    position: its true token. Visible: not special (`special` holds the mask, padding and end ids) and
    without a target. An edit example's pre-edit tokens go back first; the rest come from
    `pick(rng, true id, the ids within `reach` of the position)` (None, the true id or a special id:
    that position is passed over). Kept tokens share KEEP_TOTAL of weight, wrong ones FIX_TOTAL."""
    inp, tgt = list(example.ids), list(example.targets)
    visible = [i for i, t in enumerate(inp) if t not in special and tgt[i] < 0]
    k = round(share * len(visible))
    wrong = getattr(example, "wrong", None) or [-1] * len(inp)
    first = [i for i in visible if wrong[i] >= 0 and wrong[i] != inp[i] and wrong[i] not in special]
    firsts = set(first)
    rest = [i for i in visible if i not in firsts]
    rng.shuffle(first)
    rng.shuffle(rest)
    changed: dict[int, int] = {}
    for i in first[:k]:
        changed[i] = wrong[i]
    for i in rest:
        if len(changed) >= k:
            break
        new = pick(rng, inp[i], example.ids[max(0, i - reach) : i + reach + 1])
        if new is not None and new != inp[i] and new not in special:
            changed[i] = new
    w = list(example.weight) if isinstance(example.weight, list) else [example.weight] * len(inp)
    keep_w, fix_w = KEEP_TOTAL / max(1, len(visible) - len(changed)), FIX_TOTAL / max(1, len(changed))
    for i in visible:
        tgt[i] = inp[i]
        w[i] = fix_w if i in changed else keep_w
    for i, new in changed.items():
        inp[i] = new
    return dataclasses.replace(example, ids=inp, targets=tgt, weight=w)


def window_pick(tok: TextTokenizer, special: Collection[int]) -> Pick:
    """corrupt_visible's usual pick: another token of the context, never a special one; for an
    identifier-like token an identifier-like one when the context has one (a plausible wrong name)."""
    named: dict[int, bool] = {}

    def is_name(t: int) -> bool:
        if t not in named:
            named[t] = bool(_IDENT.fullmatch(tok.token_text(t).strip()))
        return named[t]

    def pick(rng: random.Random, true_id: int, context: Sequence[int]) -> int | None:
        pool = sorted({t for t in context if t != true_id and t not in special})
        if pool and is_name(true_id):
            pool = [t for t in pool if is_name(t)] or pool
        return rng.choice(pool) if pool else None

    return pick


# ---------------------------------------------------------------- edit data


def parse_layouts(spec: str) -> dict[str, float]:
    """`--edit-layouts`: "window,surprise" (equal shares) or "window:3,surprise:1" as {layout: share},
    the shares summing to 1; ValueError saying what is wrong."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        name, _, share = part.partition(":")
        if name not in LAYOUTS or name in out:
            raise ValueError(f"edit layouts are {LAYOUTS}, each once, as NAME or NAME:SHARE; got {spec!r}")
        try:
            out[name] = float(share) if share else 1.0
        except ValueError:
            raise ValueError(f"edit layout {name!r}: share {share!r} is not a number") from None
        if not 0 <= out[name] < math.inf:
            raise ValueError(f"edit layout {name!r}: share {share!r} must be >= 0")
    total = sum(out.values())
    if total <= 0:
        raise ValueError(f"edit layouts {spec!r}: the shares add up to nothing")
    return {k: v / total for k, v in out.items()}


def load_edit_cases(folders: Sequence[str | Path]) -> list[tuple[Path, dict]]:
    """(folder, case) for every case whose side is "train" in every *.jsonl of `folders`: never a
    "heldout" or "heldout_packages" one (next edits are judged on those), nor one without a side."""
    out: list[tuple[Path, dict]] = []
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise ValueError(f"edit data {folder}: not a folder")
        for path in sorted(folder.glob("*.jsonl")):
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip() and (case := json.loads(line)).get("side") == "train":
                    out.append((folder, case))
    return out


def case_example(
    folder: Path,
    case: dict,
    tok: TextTokenizer,
    seq_len: int,
    ids: SpecialIds,
    rng: random.Random,
    layout: str,
    ordered: float = 0.0,
) -> EditExample | None:
    """edit_example for a case written under `folder`; ValueError when its edits do not apply."""
    doc, after = load_case(folder, case)
    return edit_example(doc, after, case["cursor"], tok, seq_len, ids, rng, layout, ordered)
