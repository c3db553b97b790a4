"""The context copy boost: logit bias toward tokens that followed the same left run elsewhere in the
fill's context (and, with `copy_far`, in text the fill looked up), and the left runs every n-gram
bias reads. Pure functions over token ids; `Canvas` (engine/decode/canvas.py) keeps the tables.

The near side: a cache LM over the canvas's own prefix + suffix. A predicted slot's left run is its
last committed ids (up to `copy_order`, nearest last; none while its left neighbour is masked). An
id that follows the run's last k ids somewhere in that context gains k x `copy_bigram` nats, k the
longest such match: a longer match is stronger evidence that the same text goes on, and an id is
boosted once, at its longest match, not once per length. `copy_unigram` adds a flat gain to every
id of the context. No run crosses a special id and no special id gains. The successors are found
as runs are asked for (`Successors`, one numpy scan of the context each), and the bias goes on the
full logit rows before the mask and healing restrictions (the order: engine/decode/sampler.py).
Fields left at None take the model's own setting from its serving.json "decode"
(api.with_model_defaults, applied by the service when it admits a job), else off.

The far side (`copy_far`): the job's FillJob.lookup text (the workspace snippets, the document
beyond the windows), tokenized at admission, of which the last 16k tokens (`far_ids`) are searched
with numpy for the slot's run; an id gains the larger of its near gain and k x `copy_far`, k its
longest match there, so an id both sides predict is not counted twice. The far text is only
searched, never forwarded: it costs a scan, not model time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, TypeVar, overload

import numpy as np
import torch

from engine.api import DecodeOptions

if TYPE_CHECKING:
    from engine.model.config import ModelConfig

Run = tuple[int, ...]  # a slot's committed left run (nearest last)
Special = tuple[int | None, ...]  # special ids (a model may have no bos: None)
CopyTables = tuple[list[int], Mapping[Run, list[int]]]  # copy_tables: the context's ids, the successors
T = TypeVar("T")


class Successors(Mapping[Run, list[int]]):
    """The copy boost's near table, looked up as it is needed: run (1..`order` ids) -> the sorted
    distinct ids that follow it somewhere in the context (no run crosses a special id, no special id
    follows). A run that never occurs, or is followed only by special ids, is not a key. Each lookup
    is one far_successors scan of the context array, which also answers every shorter tail of the
    run (copy_bias asks the longest first); answers are kept for the canvas's later steps. Building
    the whole table up front cost ~5 ms a fill at 512 tokens (order 3); a fill asks a few dozen runs."""

    def __init__(self, context: list[int], special: Special, order: int):
        self.order = order
        self._arr = far_ids(context, special, limit=len(context) or 1)
        self._memo: dict[Run, list[int]] = {}

    def _lookup(self, run: Run) -> list[int]:
        if not 0 < len(run) <= self.order:
            return []  # not a key (and no tail of it is memoized from here)
        got = self._memo.get(run)
        if got is None:
            found = far_successors(self._arr, run) if self._arr is not None else []
            for k in range(1, len(run) + 1):
                self._memo[run[len(run) - k :]] = found[k - 1] if k <= len(found) else []
            got = self._memo[run]
        return got

    def __getitem__(self, run: Run) -> list[int]:
        got = self._lookup(tuple(run))
        if not got:
            raise KeyError(run)
        return got

    @overload
    def get(self, run: Run, /) -> list[int] | None: ...
    @overload
    def get(self, run: Run, default: list[int] | T, /) -> list[int] | T: ...
    def get(self, run: Run, default: object = None) -> object:
        return self._lookup(tuple(run)) or default

    def _table(self) -> dict[Run, list[int]]:  # every key (iteration, len, ==: tests and debugging)
        a = [] if self._arr is None else self._arr.tolist()
        runs = {
            tuple(a[i - k : i])
            for i in range(1, len(a))
            for k in range(1, self.order + 1)
            if i - k >= 0 and a[i] >= 0 and min(a[i - k : i]) >= 0
        }
        return {r: self[r] for r in runs}

    def __iter__(self) -> Iterator[Run]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def copy_tables(context: list[int], special: Special, order: int = 1) -> tuple[list[int], Successors]:
    """The context copy boost's tables (DecodeOptions.copy_*): the distinct ids of the canvas's
    prefix + suffix, and for each run of 1..`order` ids the ids that follow it there (no run
    crosses a special id), as a lazily filled mapping (Successors)."""
    return sorted(set(context) - set(special)), Successors(context, special, order)


def far_ids(ids: list[int], special: Special, limit: int = 16384) -> np.ndarray | None:
    """The copy boost's far side (FillJob.lookup tokenized): the last `limit` ids as an array, every
    special id as -1 so that no run matches across it. None when empty."""
    if not ids:
        return None
    a = np.asarray(ids[-limit:], dtype=np.int64)
    a[np.isin(a, [t for t in special if t is not None])] = -1
    return a


def far_successors(far: np.ndarray, run: Run) -> list[list[int]]:
    """For k = 1..len(run): the distinct ids that follow the run's last k ids somewhere in `far`
    (out[k - 1]; an empty list once no occurrence is left)."""
    out: list[list[int]] = []
    if not run or far.shape[0] < 2:
        return out
    pos = np.flatnonzero(far[:-1] == run[-1])  # occurrences of the last id; successor at pos + 1
    for k in range(1, len(run) + 1):
        if k > 1:
            pos = pos[pos >= k - 1]
            pos = pos[far[pos - (k - 1)] == run[-k]]
        if pos.size == 0:
            break
        nxt = far[pos + 1]
        out.append(np.unique(nxt[nxt >= 0]).tolist())
    return out


def copy_bias(
    left: list[Run],
    uni: list[int],
    succ: Mapping[Run, list[int]],
    vocab: int,
    opts: DecodeOptions,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    far: np.ndarray | None = None,
) -> torch.Tensor:
    """(M, V) logit bias of the context copy boost for M slots; `left[r]`: the committed ids just
    left of slot r (up to copy_order, nearest last; empty when its neighbour is still masked).
    `copy_unigram` on every context id; k x `copy_bigram` on the ids that follow the slot's last k
    ids somewhere in the context, for the longest such k. With a far side (`far`, FillJob.lookup)
    and `copy_far`, an id gains the larger of that and k' x `copy_far`, k' its longest match there."""
    bias = torch.zeros(len(left), vocab, dtype=dtype, device=device)
    far_w = opts.copy_far if far is not None else 0
    for r, run in enumerate(left):
        gain: dict[int, float] = {}
        for w, found in (
            (opts.copy_bigram, lambda k, run=run: succ.get(tuple(run[-k:]), ())),
            (
                far_w,
                (lambda fs: lambda n: fs[n - 1] if n <= len(fs) else ())(
                    far_successors(far, run) if far_w and far is not None else []
                ),
            ),
        ):
            if not w:
                continue
            seen: set[int] = set()
            for k in range(len(run), 0, -1):  # longest match first: its successors get the most
                for t in found(k):
                    if t not in seen:
                        seen.add(t)
                        gain[t] = max(gain.get(t, 0.0), k * w)
        if gain:
            bias[r, list(gain)] = torch.tensor(list(gain.values()), dtype=dtype, device=device)
    if opts.copy_unigram and uni:
        bias[:, uni] += opts.copy_unigram
    return bias


def chain_copy_bias(
    left: list[Run],
    chain: list[bool],
    logits: torch.Tensor,
    tables: CopyTables,
    opts: DecodeOptions,
    order: int,
    far: np.ndarray | None = None,
    restrict: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """copy_bias for draft chaining (DecodeOptions.copy_chain), row by row from the left: row r's
    run is `left[r]`, or, when `chain[r]` (its left neighbour is row r - 1's slot, masked and
    predicted now), row r - 1's run plus row r - 1's prediction: the argmax of its logits + bias
    after `restrict(r - 1, row)` (the mask ban, token healing), cut to `order`."""
    bias = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
    runs: list[Run] = []
    for r in range(len(left)):
        run = left[r]
        if chain[r] and r > 0:
            row = logits[r - 1] + bias[r - 1]
            if restrict is not None:
                row = restrict(r - 1, row)
            run = (runs[r - 1] + (int(row.argmax()),))[-order:]
        runs.append(run)
        bias[r] = copy_bias([run], *tables, logits.shape[-1], opts, dtype=logits.dtype, device=logits.device, far=far)[
            0
        ]
    return bias


def left_runs(ids: list[int], slot_pos: list[int], order: int, mask_id: int) -> list[Run]:
    """For each slot position, the committed ids just left of it (up to `order`, stopping at a mask)."""
    out = []
    for p in slot_pos:
        run: list[int] = []
        q = p - 1
        while q >= 0 and len(run) < order and ids[q] != mask_id:
            run.append(ids[q])
            q -= 1
        out.append(tuple(reversed(run)))
    return out


def ngram_skip(cfg: ModelConfig) -> Special:
    """Ids that keep a left run out of the n-gram memory: its contexts never hold them."""
    return (cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id)
