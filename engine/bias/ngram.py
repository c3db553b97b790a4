"""The corpus n-gram memory (DecodeOptions.ngram): what the training corpus says follows the last
few committed tokens, added to a masked slot's logits.

The default model is capacity-bound: more training and a bigger model stopped buying line holes
(docs/research/23-s14-second-cooldown-default-d-deltas.md to 26-s17-size-experiment.md). A table of the corpus's own continuations holds what 4 M parameters
cannot. For every context of 4-6 tokens of the model's tokenizer (no context crosses a file) that
occurs at least `min_count` times in the train side of the corpus, the table keeps its `top` most
frequent next tokens among those seen in at least `min_packages` different packages (the stdlib
counts as one; a continuation only one project writes is that project's memory, not Python's), with
P(next | context) = count / the context's count. At a masked slot whose committed left run ends in a
stored context (the longest one), each stored next token gains `weight` x P nats.

The table is `ngram.safetensors` in the model's folder (`dlm-lsp ngram` builds it from a corpus):
`ctx` (N,) the contexts' 64-bit hashes, sorted; `next` (N, top) token ids, -1 where a context has
fewer; `prob` (N, top) float16. Its metadata names the orders and the sha256 of the tokenizer.json
it was counted with: a table whose tokenizer is not the model's is refused. Read with safetensors
after the header is checked (engine.model.weight_files.check_safetensors): nothing is unpickled.

The weight is per hole kind (serving.json "decode" "ngram", and "ngram_kinds" per FillJob.kind); it
is added in `commit` after the copy boost (the order: engine/decode/sampler.py) and in the oracle
alike. A job that asks for `ngram` itself from a model without a table fails with an error saying
how to build one; the model's own setting without its table is off, so a model folder copied
without its table still serves.

Two more memories apply the same rule (the longest stored context ending a slot's committed left
run; its most frequent next ids gain weight x P) to the project's own text:
- `LocalNgram` (DecodeOptions.local_ngram), the fill's own n-gram, counted per fill over the job's
  texts: its lookup (the workspace snippets, the document beyond the windows) and its context
  (prefix and suffix as cut), no context crossing a part, a special id or the hole. Contexts of 3-6
  ids followed at least twice there; their 2 most frequent next ids. Built when the canvas attaches
  its far text (Canvas.attach_far), a few thousand ids hashed per position, so a lookup is one
  vector comparison rather than a table built per keystroke. It weighs a project's habits by how
  often they recur, where the copy boost gives every id that ever followed the run the same gain.
- `WorkspaceNgram` (DecodeOptions.workspace_ngram): the same over every file of a workspace less
  the filled one, used only where the fill's own n-gram has no context (Canvas.add_local). The
  engine keeps one per workspace name (EngineService.workspace_files: tokenized and counted on the
  caller's thread, never the worker's; at most WORKSPACE_MAX_TOKENS, 1 M); a refresh counts a new
  snapshot that is swapped in whole, so fills never see a half-counted one. A job names the memory
  and its document (FillJob.workspace, FillJob.document), whose own pairs `view(exclude)` subtracts.
Both weights are per hole kind like `ngram` ("local_ngram_kinds", "workspace_ngram_kinds").
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from engine.bias.copy import Run

log = logging.getLogger(__name__)

NGRAM_FILE = "ngram.safetensors"
MULT = 0x9E3779B97F4A7C15
M64 = (1 << 64) - 1
TABLE_DTYPES = {"U64": 8, "I16": 2, "I32": 4, "F16": 2, "F32": 4}


class NgramError(RuntimeError):
    """A table that cannot be built or loaded; the message says why."""


Hit = tuple[np.ndarray, np.ndarray]  # next_probs: (next ids, P(next | context))


class Memory(Protocol):
    """What reads an n-gram memory: NgramTable, LocalNgram, WorkspaceView."""

    max_order: int

    def next_probs(self, run: Run) -> Hit | None: ...


def context_hash(ids: Iterable[int]) -> int:
    """A context's 64-bit hash (oldest id first): h = (h + id + 1) * MULT mod 2^64."""
    h = 0
    for t in ids:
        h = ((h + int(t) + 1) * MULT) & M64
    return h


def tokenizer_digest(folder: str | Path) -> str:
    return hashlib.sha256((Path(folder) / "tokenizer.json").read_bytes()).hexdigest()


class NgramTable:
    """The loaded table. `bias(runs, vocab)`: the (M, V) logit bias for M slots' left runs."""

    def __init__(self, ctx: np.ndarray, nxt: np.ndarray, prob: np.ndarray, orders: tuple[int, ...]):
        if ctx.ndim != 1 or nxt.shape != prob.shape or nxt.ndim != 2 or nxt.shape[0] != ctx.shape[0]:
            raise NgramError(f"table shapes do not agree: ctx {ctx.shape}, next {nxt.shape}, prob {prob.shape}")
        if ctx.size > 1 and not bool((ctx[1:] > ctx[:-1]).all()):
            raise NgramError("table contexts must be sorted and unique")
        if not orders or min(orders) < 1 or max(orders) > 16:
            raise NgramError(f"table orders must be in 1..16, got {orders}")
        # kept as stored (int16 ids, float16 probabilities: 32 MB for the default's 2 M contexts), widened per lookup
        self.ctx, self.nxt, self.prob = ctx.astype(np.uint64, copy=False), nxt, prob
        self.orders = tuple(sorted(orders, reverse=True))  # longest first
        self.max_order = self.orders[0]

    def __len__(self) -> int:
        return int(self.ctx.size)

    def next_probs(self, run: Run) -> Hit | None:
        """(next ids, P(next | context)) for the longest stored context that ends `run`, or None."""
        for k in self.orders:
            if k > len(run):
                continue
            key = np.uint64(context_hash(run[-k:]))
            i = int(np.searchsorted(self.ctx, key))
            if i < self.ctx.size and self.ctx[i] == key:
                keep = self.nxt[i] >= 0
                return self.nxt[i][keep].astype(np.int64), self.prob[i][keep].astype(np.float32)
        return None

    def add_bias(
        self, logits: torch.Tensor, runs: list[Run], weight: float, skip: tuple[int | None, ...] = ()
    ) -> torch.Tensor:
        """Adds to `logits` (M, V), in place: row r gains `weight` x P(next | the longest stored
        context ending runs[r]) on each stored next token; a run holding an id of `skip` (padding,
        end, mask) gains nothing. Returns `logits`."""
        return add_bias(self, logits, runs, weight, skip)

    def save(self, path: Path, tokenizer_sha256: str, about: dict | None = None) -> None:
        from safetensors.numpy import save_file

        meta = {
            "orders": json.dumps(sorted(self.orders)),
            "tokenizer_sha256": tokenizer_sha256,
            "about": json.dumps(about or {}),
        }
        nxt_dtype = np.int16 if int(self.nxt.max(initial=0)) < 32768 else np.int32  # -1: none
        save_file(
            {"ctx": self.ctx, "next": self.nxt.astype(nxt_dtype), "prob": self.prob.astype(np.float16)},
            str(path),
            metadata=meta,
        )


def add_bias(
    table: Memory, logits: torch.Tensor, runs: list[Run], weight: float, skip: tuple[int | None, ...] = ()
) -> torch.Tensor:
    """NgramTable.add_bias for any table with `next_probs(run)` (NgramTable, LocalNgram)."""
    skipped = set(skip)
    for r, run in enumerate(runs):
        if not run or not skipped.isdisjoint(run):
            continue
        hit = table.next_probs(run)
        if hit is not None:
            add_hit(logits, r, hit, weight)
    return logits


def add_hit(logits: torch.Tensor, r: int, hit: Hit, weight: float) -> None:
    """Row r of `logits` (M, V) gains weight x P on each of next_probs' (ids, P) `hit`, in place."""
    ids, p = hit
    ok = ids < logits.shape[-1]
    if ok.any():
        logits[r, torch.from_numpy(ids[ok]).to(logits.device)] += torch.from_numpy(weight * p[ok]).to(
            logits.device, logits.dtype
        )


LOCAL_ORDERS = (3, 4, 5, 6)
LOCAL_MIN_COUNT = 2
LOCAL_TOP = 2


class LocalNgram:
    """The fill's own n-gram (DecodeOptions.local_ngram): the corpus memory's rule applied to the job's
    texts, the copy boost's far side (FillJob.lookup: the workspace snippets, the document beyond the
    window) and the context (prefix and suffix), counted instead of matched. For the longest context
    of LOCAL_ORDERS ids that ends a slot's left run and is followed at least LOCAL_MIN_COUNT times in
    those texts, its LOCAL_TOP most frequent next ids (ties: the smaller id), P = count / the
    context's count. Where the copy boost gives any id that follows the last <= 3 ids somewhere
    the same k x weight, this weighs a project's habits by how often they recur.

    `parts`: id arrays, -1 where no context may cross (special ids, the hole); none crosses parts.
    Each order's context hash is kept per position, so a lookup is one comparison over the texts'
    ids (a few thousand), not a table built per keystroke (docs/research/30-s21-local-ngram.md)."""

    def __init__(
        self,
        parts: Sequence[Sequence[int] | np.ndarray | None],
        orders: tuple[int, ...] = LOCAL_ORDERS,
        min_count: int = LOCAL_MIN_COUNT,
        top: int = LOCAL_TOP,
    ):
        chunks = [np.r_[np.asarray(p, dtype=np.int64), -1] for p in parts if p is not None and len(p)]
        self.a = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        self.orders = tuple(sorted(orders, reverse=True))  # longest first
        self.max_order, self.min_count, self.top = self.orders[0], min_count, top
        self.hashes: dict[int, np.ndarray] = {}  # k -> (n - k,) hash of a[p - k : p] at next position p; 0: none
        for k in self.orders:
            if self.a.size > k:
                h, ok = context_hashes(self.a, k)
                h[~ok] = 0
                self.hashes[k] = h

    def __len__(self) -> int:
        return int(self.a.size)

    def next_probs(self, run: Run) -> Hit | None:
        """(next ids, P(next | context)) for the longest context ending `run` seen often enough, or None."""
        for k in self.orders:
            h = self.hashes.get(k)
            if h is None or k > len(run):
                continue
            key = context_hash(run[-k:])
            if key == 0:
                continue
            at = np.flatnonzero(h == np.uint64(key))
            if at.size < self.min_count:
                continue
            ids, counts = np.unique(self.a[at + k], return_counts=True)
            pick = np.lexsort((ids, -counts))[: self.top]  # most frequent first, ties by the smaller id
            return ids[pick], (counts[pick] / at.size).astype(np.float32)
        return None

    def add_bias(
        self, logits: torch.Tensor, runs: list[Run], weight: float, skip: tuple[int | None, ...] = ()
    ) -> torch.Tensor:
        return add_bias(self, logits, runs, weight, skip)


Counts = tuple[np.ndarray, np.ndarray, np.ndarray]  # one order's sorted (context hash, next id, count) pairs
Pairs = tuple[np.ndarray, np.ndarray]  # one order's (context hash, next id) of a file, sorted by hash
WORKSPACE_MAX_TOKENS = 1_000_000  # a workspace memory holds at most this many ids (put() refuses more)


class WorkspaceNgram:
    """The workspace's n-gram (DecodeOptions.workspace_ngram): the fill's own n-gram's rule over every
    file of the workspace, not only the ~12k characters of retrieved snippets in the lookup.

    put(key, ids) / remove(key) change the files (their ids are kept, int32: 4 bytes a token);
    refresh() counts every (context, next id) pair of LOCAL_ORDERS over them (pair_counts) into a new
    snapshot, swapped in whole (about 1 s per million tokens: the writer's thread calls it, never a
    fill); view(exclude) gives a fill the snapshot less one file's pairs, counted from the ids the
    snapshot holds for it: the filled document never counts (in an editor the line being typed is
    not on disk yet; in the eval the hole's own file holds its answer). Memory, measured on 1 M tokens
    of held-out code: 2.7 M pairs (43 MB) plus the ids (4 MB); the process's RSS grew by 134 MB, the
    rest being what the allocator kept of the count's temporaries (docs/research/31-s22-workspace-ngram.md).

    Used only where the fill's own n-gram has no context (Canvas.add_local): on the held-out line
    holes it is a fallback, not a second vote (docs/research/31-s22-workspace-ngram.md)."""

    def __init__(
        self,
        orders: tuple[int, ...] = LOCAL_ORDERS,
        min_count: int = LOCAL_MIN_COUNT,
        top: int = LOCAL_TOP,
        max_tokens: int = WORKSPACE_MAX_TOKENS,
    ):
        import threading

        self.orders = tuple(sorted(orders, reverse=True))
        self.max_order, self.min_count, self.top, self.max_tokens = self.orders[0], min_count, top, max_tokens
        self._files: dict[str, np.ndarray] = {}  # key -> its ids (int32)
        self._lock = threading.Lock()
        # ({k: (hash, next, count)}, {key: ids}) as counted
        self._snap: tuple[dict[int, Counts], dict[str, np.ndarray]] | None = None
        # key -> its pairs in the snapshot (view's cache), emptied with the snapshot
        self._own: dict[str, dict[int, Pairs]] = {}
        self.tokens = 0
        self.stale = False  # files changed since the snapshot

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key: str) -> bool:
        return key in self._files

    @property
    def counted(self) -> bool:
        """Whether views have a snapshot to read (a refresh counted at least one file)."""
        return self._snap is not None

    def put(self, key: str, ids: npt.ArrayLike) -> bool:
        """File `key` now holds `ids` (counted at the next refresh); False (nothing changed) when the
        memory would exceed max_tokens."""
        a = np.asarray(ids, dtype=np.int32)
        with self._lock:
            old = self._files.get(key)
            old_n = 0 if old is None else old.size
            if self.tokens - old_n + a.size > self.max_tokens:
                return False
            if old is not None and np.array_equal(old, a):
                return True
            self._files[key] = a
            self.tokens += int(a.size) - old_n
            self.stale = True
        return True

    def remove(self, key: str) -> None:
        with self._lock:
            got = self._files.pop(key, None)
            if got is not None:
                self.tokens -= got.size
                self.stale = True

    def refresh(self) -> None:
        """Counts the files as they are now into the snapshot views read (outside the lock: fills go
        on reading the old one meanwhile)."""
        with self._lock:
            files, self.stale = dict(self._files), False
        merged: dict[int, Counts] = {}
        if files:
            a = np.concatenate([np.r_[ids.astype(np.int64), -1] for ids in files.values()])
            zeros = np.zeros(a.size, dtype=np.int64)
            for k in self.orders:
                if a.size > k:
                    h, nx, n, _ = pair_counts(a, zeros, k)
                    merged[k] = (h, nx.astype(np.int32), n.astype(np.int32))
        with self._lock:
            self._snap, self._own = ((merged, files) if files else None), {}

    def view(self, exclude: str | None = None) -> WorkspaceView | None:
        """The table a fill reads: the last snapshot less `exclude`'s pairs (None before the first
        refresh or when it held no file)."""
        with self._lock:
            snap, own_cache = self._snap, self._own
        if snap is None:
            return None
        merged, files = snap
        own: dict[int, Pairs] = {}
        if exclude is not None and exclude in files:
            cached = own_cache.get(exclude)
            if cached is not None:
                own = cached
            else:  # each order's (context hash, next id) of the file, sorted by hash
                a = np.r_[files[exclude].astype(np.int64), -1]
                for k in self.orders:
                    if a.size > k:
                        h, ok = context_hashes(a, k)
                        at = np.flatnonzero(ok)
                        o = np.argsort(h[at], kind="stable")
                        own[k] = (h[at][o], a[k:][at][o])
                with self._lock:
                    if self._own is own_cache:
                        own_cache[exclude] = own
        return WorkspaceView(merged, own, self.orders, self.min_count, self.top)


class WorkspaceView:
    """One fill's workspace table: `merged` ({k: (hash, next, count)}, sorted) less `own` ({k: (hash,
    next)} of the excluded file's positions, sorted by hash)."""

    def __init__(
        self, merged: dict[int, Counts], own: dict[int, Pairs], orders: tuple[int, ...], min_count: int, top: int
    ):
        self.merged, self.own, self.orders = merged, own, orders
        self.max_order, self.min_count, self.top = orders[0], min_count, top

    def next_probs(self, run: Run) -> Hit | None:
        """(next ids, P(next | context)) for the longest context ending `run` that the workspace,
        less the excluded file, follows at least min_count times; None when there is none."""
        for k in self.orders:
            if k > len(run) or k not in self.merged:
                continue
            key = np.uint64(context_hash(run[-k:]))
            h, nx, n = self.merged[k]
            lo, hi = int(np.searchsorted(h, key, "left")), int(np.searchsorted(h, key, "right"))
            if hi <= lo:
                continue
            ids, cnt = nx[lo:hi], n[lo:hi].copy()
            if k in self.own:  # the excluded file's pairs are a subset of the merged ones
                oh, onx = self.own[k]
                a, b = int(np.searchsorted(oh, key, "left")), int(np.searchsorted(oh, key, "right"))
                if b > a:
                    for t, c in zip(*np.unique(onx[a:b], return_counts=True)):
                        cnt[ids == t] -= c
            tot = int(cnt.sum())
            if tot < self.min_count:
                continue
            pick = np.lexsort((ids, -cnt))[: self.top]  # most frequent first, ties by the smaller id
            pick = pick[cnt[pick] > 0]
            return ids[pick].astype(np.int64), (cnt[pick] / tot).astype(np.float32)
        return None


def load_table(folder: str | Path) -> NgramTable | None:
    """The model folder's table (NGRAM_FILE), None when it has none; NgramError when the file is bad
    or was counted with another tokenizer."""
    from engine.model.weight_files import CheckpointError, check_safetensors

    path = Path(folder) / NGRAM_FILE
    if not path.exists():
        return None
    try:
        header = check_safetensors(path, dtypes=TABLE_DTYPES)
    except CheckpointError as e:
        raise NgramError(str(e)) from None
    meta = header.get("__metadata__") or {}
    names = {k for k in header if k != "__metadata__"}
    if (
        names != {"ctx", "next", "prob"}
        or header["ctx"].get("dtype") != "U64"
        or header["next"].get("dtype") not in ("I16", "I32")
        or header["prob"].get("dtype") not in ("F16", "F32")
    ):
        raise NgramError(
            f"{path}: expected tensors ctx (U64), next (I16 or I32) and prob (F16 or F32), found "
            f"{ {k: header[k].get('dtype') for k in sorted(names)} }"
        )
    want = tokenizer_digest(folder) if (Path(folder) / "tokenizer.json").exists() else None
    if meta.get("tokenizer_sha256") != want:
        raise NgramError(
            f"{path} was counted with another tokenizer than {Path(folder) / 'tokenizer.json'}; "
            "rebuild it with `dlm-lsp ngram`"
        )
    try:
        orders = tuple(int(k) for k in json.loads(meta.get("orders", "[]")))
        from safetensors.numpy import load_file

        z = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - whatever safetensors or json finds, the message names the file
        raise NgramError(f"{path}: not a readable n-gram table ({e})") from None
    return NgramTable(z["ctx"], z["next"], z["prob"], orders)


# ---------------------------------------------------------------- building


def context_hashes(a: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """For each next position p = k .. len(a) - 1: context_hash(a[p - k : p]) and whether that context
    and a[p] are all ids (no -1), as two (len(a) - k,) arrays."""
    n, au, mult = a.size, a.astype(np.uint64), np.uint64(MULT)
    ok = a[k:] >= 0
    h = np.zeros(n - k, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(k, 0, -1):  # oldest id first, as context_hash
            ok &= a[k - j : n - j] >= 0
            h = (h + au[k - j : n - j] + np.uint64(1)) * mult
    return h, ok


def pair_counts(a: np.ndarray, pk: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (context of exactly k ids, next id) pair in `a` (-1 between files; no context crosses
    one), sorted by (context hash, next id): (hashes, next ids, counts, packages each pair is seen in;
    `pk`: each position's package)."""
    h, ok = context_hashes(a, k)
    h, nx, pg = h[ok], a[k:][ok], pk[k:][ok]
    if h.size == 0:  # no context of k ids followed by an id (files shorter than the order)
        none = np.zeros(0, dtype=np.int64)
        return h, nx, none, none
    order = np.lexsort((pg, nx, h))
    h, nx, pg = h[order], nx[order], pg[order]
    del order
    brk = np.r_[True, (h[1:] != h[:-1]) | (nx[1:] != nx[:-1])]
    pair = np.flatnonzero(brk)
    new_pkg = brk | np.r_[True, pg[1:] != pg[:-1]]
    pf = np.add.reduceat(new_pkg.astype(np.int64), pair)
    return h[pair], nx[pair], np.diff(np.r_[pair, h.size]), pf


def count_order(
    a: np.ndarray, pk: np.ndarray, k: int, min_count: int, top: int, min_packages: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contexts of exactly k ids in `a` (-1 between files) and their kept continuations:
    (hashes (C,), next (C, top), prob (C, top)), for contexts seen >= min_count times with at least
    one next id seen in >= min_packages packages (`pk`: each position's package); ranked by count,
    ties by id."""
    ph, pn, pc, pf = pair_counts(a, pk, k)
    first = np.r_[True, ph[1:] != ph[:-1]]
    starts = np.flatnonzero(first)
    tot = np.add.reduceat(pc, starts)
    gid = np.cumsum(first) - 1
    good = pf >= min_packages
    o2 = np.lexsort((-pc, ~good, gid))  # per context: kept pairs first, most frequent first (stable: by id)
    pn, pc, gid, good = pn[o2], pc[o2], gid[o2], good[o2]
    rank = np.arange(pn.size) - starts[gid]
    sel = (rank < top) & good & (tot[gid] >= min_count)
    has = np.zeros(starts.size, dtype=bool)
    has[gid[sel]] = True
    row = np.cumsum(has) - 1  # each kept context's row
    nxt = np.full((int(has.sum()), top), -1, dtype=np.int64)
    prob = np.zeros((int(has.sum()), top), dtype=np.float32)
    nxt[row[gid[sel]], rank[sel]] = pn[sel]
    prob[row[gid[sel]], rank[sel]] = pc[sel] / tot[gid[sel]]
    return ph[starts][has], nxt, prob
