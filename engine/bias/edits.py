"""The edit memory: the recent edits' token substitutions, as a logit bias on a rewrite's slots and as
a rule for which of the window's tokens to remask (engine/decode/rewrite.py). Pure functions over
token ids, like the copy boost (engine/bias/copy.py).

A user's edit (old text -> new text) is diffed token by token (`substitutions`): each differing run
becomes a substitution old ids -> new ids. An insertion or deletion has no old token to stand on, so
it is widened by the unchanged token either side (`x)` -> `x: int)`), which also keeps it from
firing wherever its one neighbour occurs. Where a substitution's old ids occur again in the window
(`EditMemory.occurrences`), the k-th old id's slot is proposed the k-th new id (`proposals`; padding
where the new run is shorter, so the slot empties), and a masked slot whose committed left run ends
with the new run's first k ids is proposed its (k+1)-th (`EditBias`, the chain: how a longer new run
spills into the padding room after it). Each proposed id gains `weight` nats, once however many
substitutions propose it. The chain reads the canvas as it is at each step, so it follows the
model's own choices; it fires only in masked spans that hold an occurrence (`live`), never elsewhere.

A byte-level tokenizer spells a word after `(` and after a space with different ids, so a rename
seen as `(a` -> `(x` would miss ` a` in the window: `word_edits` gives the edit's renamed words as
text pairs with and without a leading space, which the service tokenizes beside the edit itself.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

Sub = tuple[tuple[int, ...], tuple[int, ...]]  # (old ids, new ids)


def substitutions(edits: Sequence[tuple[Sequence[int], Sequence[int]]], special: Sequence[int] = ()) -> list[Sub]:
    """The token substitutions of the edits ((old ids, new ids) each, oldest first): every differing
    run of a token diff, insertions and deletions widened by the unchanged token either side; none
    that touch a special id, none twice, the most recent last."""
    out: list[Sub] = []
    bad = set(special)
    for old, new in edits:
        old, new = list(old), list(new)
        sm = difflib.SequenceMatcher(None, old, new, autojunk=False)
        for tag, i1, i2, j1, j2 in sm.get_opcodes():
            if tag == "equal":
                continue
            if tag != "replace":  # nothing (or nothing new) to stand on: take the neighbours along
                if i1 > 0 and j1 > 0:
                    i1, j1 = i1 - 1, j1 - 1
                if i2 < len(old) and j2 < len(new):
                    i2, j2 = i2 + 1, j2 + 1
            sub = (tuple(old[i1:i2]), tuple(new[j1:j2]))
            if not sub[0] or sub[0] == sub[1] or bad.intersection(sub[0] + sub[1]):
                continue
            if sub in out:
                out.remove(sub)
            out.append(sub)
    return out


_WORD = re.compile(r"\w+|[^\w\s]")


def word_edits(old: str, new: str) -> list[tuple[str, str]]:
    """The edit's renamed words as text pairs, each also with a leading space: a byte-level tokenizer
    spells `a` after `(` and ` a` after a space with different ids, so the edit's own tokens
    (`(a` -> `(x`) would miss the other spellings in the window. Only a word replaced by a word (a
    word diff's differing run that is one identifier on each side): tokenized alone, any other run
    would lose the spacing around it."""
    a, b = _WORD.findall(old), _WORD.findall(new)
    out: list[tuple[str, str]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        o, n = "".join(a[i1:i2]), "".join(b[j1:j2])
        if tag == "replace" and o.isidentifier() and n.isidentifier():
            out += [(o, n), (" " + o, " " + n)]
    return out


class EditMemory:
    """Substitutions (`substitutions`) and the weight their new ids gain, over one vocabulary."""

    def __init__(self, subs: list[Sub], weight: float, vocab_size: int, pad_id: int):
        if weight < 0:
            raise ValueError(f"the edit memory's weight must be >= 0, got {weight}")
        self.subs, self.weight, self.vocab_size, self.pad_id = subs, weight, vocab_size, pad_id
        self.max_new = max((len(new) for _, new in subs), default=0)

    def occurrences(self, window: Sequence[int]) -> list[list[tuple[int, int]]]:
        """Per window index, the (substitution, k) whose old ids occur there with this index as
        their k-th."""
        out: list[list[tuple[int, int]]] = [[] for _ in window]
        w = list(window)
        for s, (old, _) in enumerate(self.subs):
            m = len(old)
            for i in range(len(w) - m + 1):
                if tuple(w[i : i + m]) == old:
                    for k in range(m):
                        out[i + k].append((s, k))
        return out

    def stale(self, window: Sequence[int]) -> list[bool]:
        """Per window index: an old id of some substitution stands there (in a whole occurrence)."""
        return [bool(o) for o in self.occurrences(window)]

    def proposals(self, window: Sequence[int]) -> list[list[int]]:
        """Per window index, the ids the substitutions propose for it: the k-th old id's slot the
        k-th new id, or padding past the end of a shorter new run."""
        out = []
        for occ in self.occurrences(window):
            ids = {self.subs[s][1][k] if k < len(self.subs[s][1]) else self.pad_id for s, k in occ}
            out.append(sorted(ids))
        return out

    def chain(self, run: Sequence[int]) -> list[int]:
        """The ids that continue a committed left run (nearest last) inside some new run: new[k]
        where the run ends with new[:k], 1 <= k < len(new)."""
        out = set()
        for _, new in self.subs:
            for k in range(1, len(new)):
                if len(run) >= k and tuple(run[len(run) - k :]) == new[:k]:
                    out.add(new[k])
        return sorted(out)


class SlotCanvas(Protocol):
    """What the bias reads of a canvas (engine/decode/canvas.py's Canvas)."""

    ids: torch.Tensor  # (L,) long
    start: int


@dataclass
class EditBias:
    """The edit memory on one canvas: per slot the ids proposed where an old id stood (`stood`) and
    whether the chain may fire there (`live`). Called by the sampler (Canvas.edit_bias) with the
    canvas and the predicted slots (M,); returns their (M, V) bias."""

    memory: EditMemory
    stood: list[list[int]]  # per slot: the proposals of the window token that stood there
    live: list[bool]  # per slot: in a masked span that holds an occurrence
    mask_id: int

    def left_run(self, ids: list[int], p: int) -> list[int]:
        """The committed ids left of position p (nearest last), padding skipped, stopping at a mask."""
        run: list[int] = []
        q = p - 1
        while q >= 0 and len(run) < self.memory.max_new and ids[q] != self.mask_id:
            if ids[q] != self.memory.pad_id:
                run.append(ids[q])
            q -= 1
        return run[::-1]

    def __call__(self, c: SlotCanvas, slot_idx: torch.Tensor) -> torch.Tensor:
        slots = slot_idx.tolist()
        bias = torch.zeros(len(slots), self.memory.vocab_size, device=c.ids.device)  # (M, V)
        w = self.memory.weight
        ids = c.ids.tolist() if any(j < len(self.live) and self.live[j] for j in slots) else []
        for r, j in enumerate(slots):
            if j >= len(self.stood):  # a slot DreamOn's resizing middle added: no window token stood there
                continue
            want = list(self.stood[j])
            if self.live[j]:
                want += self.memory.chain(self.left_run(ids, c.start + j))
            if want:
                bias[r, torch.tensor(sorted(set(want)), dtype=torch.long, device=bias.device)] = w
        return bias


__all__ = ["EditBias", "EditMemory", "Sub", "substitutions", "word_edits"]
