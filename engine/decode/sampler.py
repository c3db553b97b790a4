"""Masked-diffusion infill decoding: pure pieces (schedule, confidence, selection) plus one loop.

canvas = prefix + n mask slots + suffix. Each step predicts every masked slot, commits the most
confident ones (LLaDA k-per-step schedule, or Fast-dLLM threshold: every slot >= tau, at least one)
and leaves the rest masked. Slots filled with padding / end-of-text are dropped from the fill, so a
canvas with surplus slots gives a variable-length fill; decoding ends when no mask is left or every
remaining mask is confidently padding.

The state of one job lives in `Canvas`; `forward` runs a *batch* of canvases (engine/decode/cache.py: full
forward or cached step) so the service can put several jobs into one pass. `reference_fill` is the
naive oracle the fast loop is tested against, token for token.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.api import DecodeOptions
from engine.decode.cache import BatchContext, Rows, forward_cached, forward_full
from engine.model.config import ModelConfig
from engine.families import dreamon, wedlm
from engine.families.blocks import block_eligible
from engine.bias.ngram import add_hit
from kernels import slot_stats

SELECTIONS = ("threshold", "topk", "timesteps")
# Dream's default eps: its timesteps run from 1 down to eps (generation_utils, DreamGenerationConfig)
TIMESTEP_EPS = 1e-3
CONFIDENCES = ("max_prob", "margin", "neg_entropy")

# ---------------------------------------------------------------- pure pieces


def schedule(n_masked: int, steps: int) -> list[int]:
    """Tokens to commit at each step, LLaDA-style: n split as evenly as possible, larger first."""
    steps = max(1, min(steps, n_masked))
    base, rem = divmod(n_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def timestep_schedule(n_masked: int, steps: int, eps: float = TIMESTEP_EPS) -> list[int]:
    """Tokens to commit at each step, Dream-style (maskgit_plus / entropy): with timesteps
    t_i = linspace(1, eps, steps + 1), step i commits int(m * (1 - t_{i+1} / t_i)) of the m slots
    still masked (every one at the last step), in float32 as Dream computes it. Steps that would
    commit nothing are left out: they change no token, so the next step sees the same canvas."""
    ts = torch.linspace(1, eps, steps + 1)
    out, m = [], n_masked
    for i in range(steps):
        k = int(torch.tensor(m) * (1 - ts[i + 1] / ts[i])) if i < steps - 1 else m
        if k > 0:
            out.append(k)
            m -= k
    return out


def confidence_from_stats(max_prob, top2_prob, entropy, kind: str) -> torch.Tensor:
    """Confidence per slot from softmax statistics: max prob, top1 - top2 margin, or -entropy."""
    if kind == "max_prob":
        return max_prob
    if kind == "margin":
        return max_prob - top2_prob
    if kind == "neg_entropy":
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


def _end_at_padding(pick: list[int], pred_l: list[float], values: torch.Tensor, ends, pad_id: int,
                    end_id: int | None = None):
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


class Successors(Mapping):
    """The copy boost's near table, looked up as it is needed: run (1..`order` ids) -> the sorted
    distinct ids that follow it somewhere in the context (no run crosses a special id, no special id
    follows). A run that never occurs, or is followed only by special ids, is not a key. Each lookup
    is one far_successors scan of the context array, which also answers every shorter tail of the
    run (copy_bias asks the longest first); answers are kept for the canvas's later steps. Building
    the whole table up front cost ~5 ms a fill at 512 tokens (order 3); a fill asks a few dozen runs."""

    def __init__(self, context: list[int], special: tuple, order: int):
        self.order = order
        self._arr = far_ids(context, special, limit=len(context) or 1)
        self._memo: dict[tuple, list[int]] = {}

    def _lookup(self, run: tuple) -> list[int]:
        if not 0 < len(run) <= self.order:
            return []  # not a key (and no tail of it is memoized from here)
        got = self._memo.get(run)
        if got is None:
            found = far_successors(self._arr, run) if self._arr is not None else []
            for k in range(1, len(run) + 1):
                self._memo[run[len(run) - k :]] = found[k - 1] if k <= len(found) else []
            got = self._memo[run]
        return got

    def __getitem__(self, run: tuple) -> list[int]:
        got = self._lookup(tuple(run))
        if not got:
            raise KeyError(run)
        return got

    def get(self, run, default=None):
        return self._lookup(tuple(run)) or default

    def _table(self) -> dict[tuple, list[int]]:  # every key (iteration, len, ==: tests and debugging)
        a = [] if self._arr is None else self._arr.tolist()
        runs = {tuple(a[i - k : i]) for i in range(1, len(a)) for k in range(1, self.order + 1)
                if i - k >= 0 and a[i] >= 0 and min(a[i - k : i]) >= 0}
        return {r: self[r] for r in runs}

    def __iter__(self):
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def copy_tables(context: list[int], special: tuple, order: int = 1) -> tuple[list[int], Successors]:
    """The context copy boost's tables (DecodeOptions.copy_*): the distinct ids of the canvas's
    prefix + suffix, and for each run of 1..`order` ids the ids that follow it there (no run
    crosses a special id), as a lazily filled mapping (Successors)."""
    return sorted(set(context) - set(special)), Successors(context, special, order)


def far_ids(ids: list[int], special: tuple, limit: int = 16384) -> np.ndarray | None:
    """The copy boost's far side (FillJob.lookup tokenized): the last `limit` ids as an array, every
    special id as -1 so that no run matches across it. None when empty."""
    if not ids:
        return None
    a = np.asarray(ids[-limit:], dtype=np.int64)
    a[np.isin(a, [t for t in special if t is not None])] = -1
    return a


def far_successors(far: np.ndarray, run: tuple) -> list[list[int]]:
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


def copy_bias(left: list[tuple], uni: list[int], succ: dict[tuple, list[int]], vocab: int,
              opts: DecodeOptions, dtype=torch.float32, device="cpu", far: np.ndarray | None = None) -> torch.Tensor:
    """(M, V) logit bias of the context copy boost for M slots; `left[r]`: the committed ids just
    left of slot r (up to copy_order, nearest last; empty when its neighbour is still masked).
    `copy_unigram` on every context id; k x `copy_bigram` on the ids that follow the slot's last k
    ids somewhere in the context, for the longest such k. With a far side (`far`, FillJob.lookup)
    and `copy_far`, an id gains the larger of that and k' x `copy_far`, k' its longest match there."""
    bias = torch.zeros(len(left), vocab, dtype=dtype, device=device)
    far_w = opts.copy_far if far is not None else 0
    for r, run in enumerate(left):
        gain: dict[int, float] = {}
        for w, found in ((opts.copy_bigram, lambda k: succ.get(tuple(run[-k:]), ())),
                         (far_w, (lambda fs: lambda k: fs[k - 1] if k <= len(fs) else ())(
                             far_successors(far, run) if far_w else []))):
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


def chain_copy_bias(left: list[tuple], chain: list[bool], logits: torch.Tensor, tables: tuple, opts: DecodeOptions,
                    order: int, far: np.ndarray | None = None, restrict=None) -> torch.Tensor:
    """copy_bias for draft chaining (DecodeOptions.copy_chain), row by row from the left: row r's
    run is `left[r]`, or, when `chain[r]` (its left neighbour is row r - 1's slot, masked and
    predicted now), row r - 1's run plus row r - 1's prediction: the argmax of its logits + bias
    after `restrict(r - 1, row)` (the mask ban, token healing), cut to `order`."""
    bias = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
    runs: list[tuple] = []
    for r in range(len(left)):
        run = left[r]
        if chain[r] and r > 0:
            row = logits[r - 1] + bias[r - 1]
            if restrict is not None:
                row = restrict(r - 1, row)
            run = (runs[r - 1] + (int(row.argmax()),))[-order:]
        runs.append(run)
        bias[r] = copy_bias([run], *tables, logits.shape[-1], opts, dtype=logits.dtype, device=logits.device, far=far)[0]
    return bias


def left_runs(ids: list[int], slot_pos: list[int], order: int, mask_id: int) -> list[tuple]:
    """For each slot position, the committed ids just left of it (up to `order`, stopping at a mask)."""
    out = []
    for p in slot_pos:
        run = []
        q = p - 1
        while q >= 0 and len(run) < order and ids[q] != mask_id:
            run.append(ids[q])
            q -= 1
        out.append(tuple(reversed(run)))
    return out


def ngram_skip(cfg) -> tuple:
    """Ids that keep a left run out of the n-gram memory: its contexts never hold them."""
    return (cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id)


def trim_fill(ids: list[int], pad_id: int, eos_id: int) -> list[int]:
    """Fill tokens without padding, cut at the first end-of-text."""
    out = []
    for t in ids:
        if t == eos_id:
            break
        if t != pad_id:
            out.append(t)
    return out


def check_options(o: DecodeOptions) -> None:
    """Raises ValueError for options no loop can run (checked when a job is admitted, not mid-batch)."""
    if o.selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {o.selection!r}")
    if o.confidence not in CONFIDENCES:
        raise ValueError(f"confidence must be one of {CONFIDENCES}, got {o.confidence!r}")
    if o.steps is not None and o.steps < 1:
        raise ValueError(f"steps must be None or >= 1, got {o.steps}")
    if o.temperature < 0 or o.refresh_every < 0 or o.block < 0 or o.window < 0:
        raise ValueError("temperature, refresh_every, block and window must be >= 0")
    if (o.copy_bigram or 0) < 0 or (o.copy_unigram or 0) < 0 or (o.copy_far or 0) < 0 or (o.names or 0) < 0 \
            or (o.brackets or 0) < 0 or (o.ngram or 0) < 0 or (o.local_ngram or 0) < 0 \
            or (o.workspace_ngram or 0) < 0 or (o.copy_order is not None and not 1 <= o.copy_order <= 8):
        raise ValueError("copy_bigram, copy_unigram, copy_far, names, brackets, ngram, local_ngram and workspace_ngram "
                         "must be >= 0 "
                         "and copy_order in 1..8")
    if o.stop_below is not None and not 0 <= o.stop_below < 1:
        raise ValueError(f"stop_below must be in [0, 1), got {o.stop_below}")
    if o.stop_below and not o.pad_left:
        raise ValueError("stop_below ends a fill as pad_left does: it needs pad_left")
    if o.reuse_budget < 0:
        raise ValueError(f"reuse_budget must be >= 0, got {o.reuse_budget}")


# ---------------------------------------------------------------- one job's state


@dataclass
class Canvas:
    """prefix + slots + suffix token ids and which slots are still masked."""

    ids: torch.Tensor  # (L,) long
    start: int  # first slot
    n: int  # number of slots
    masked: torch.Tensor  # (n,) bool
    opts: DecodeOptions
    cfg: ModelConfig
    active_pos: torch.Tensor  # (A,) absolute positions of the active span
    plan: list[int] = field(default_factory=list)  # top-k schedule still to run
    n_masked: int = 0  # slots still masked (kept on the host: no device sync to know it)
    steps: int = 0
    tokens_per_step: list[int] = field(default_factory=list)
    ms_per_step: list[float] = field(default_factory=list)
    rows_forwarded: int = 0  # rows run through the model, summed over this job's forwards (Fill.forwarded_tokens)
    kv: list | None = None  # per layer (k, v) buffers (1, Hkv, L, Dh); the first ctx_len rows are the context
    kv_pos: torch.Tensor | None = None  # (L,) absolute positions of the kv rows (block-causal models only)
    ctx_len: int = 0
    n_frozen: int = 0
    frozen: torch.Tensor | None = None  # (n,) slots whose K/V are in the context (not run by cached steps)
    ctx_version: int = 0  # bumped at every refill, so a batch's padded copy knows to recopy
    since_refresh: int = 0  # steps since (and including) the last full forward
    generator: torch.Generator | None = None
    done: bool = False
    deadline_hit: bool = False
    cancelled: bool = False
    slot_prob: list[float] = field(default_factory=list)  # per slot: its token's probability when committed
    full_ms: float = 0.0  # last full-forward step, the estimate for the next one (0: unknown)
    cached_ms: float = 0.0  # last cached step
    final_step: bool = False  # this step commits every mask (deadline): set before its forward
    _masked_at: tuple = (-1, None)  # (steps, masked slot indices): computed once per step
    slot_kv: list | None = None  # with a window: per layer (k, v) (1, H, n, Dh) of the slots at the last full forward
    # token healing (TextTokenizer.heal): slot `heal_slot` (0, or 1 after slot 0 took a shorter piece
    # of the healed text) may only take the ids in `heal`; it is the leftmost masked slot while open
    heal: torch.Tensor | None = None
    heal_open: bool = False
    heal_slot: int = 0
    heal_then: dict = field(default_factory=dict)  # piece id at slot 0 -> (ids) slot 1 may then take
    heal_whole: torch.Tensor | None = None  # slot 0's ids that re-type the whole text (a final step's)
    copy: tuple | None = None  # (ids, successors) of the context copy boost (copy_tables), None: off
    copy_far: np.ndarray | None = None  # the boost's far side (far_ids of FillJob.lookup), None: none
    names: object = None  # engine.bias.names.NameBias of identifier-aware decoding (DecodeOptions.names), None: off
    ngram: object = None  # engine.bias.ngram.NgramTable of the corpus n-gram memory (DecodeOptions.ngram), None: off
    local: object = None  # engine.bias.ngram.LocalNgram of the fill's own texts (DecodeOptions.local_ngram), None: off
    local_near: list | None = None  # the context's ids for `local` (attach_far adds the lookup's)
    workspace: object = None  # engine.bias.ngram.WorkspaceView (FillJob.workspace, DecodeOptions.workspace_ngram), None: off
    stop_ids: tuple = ()  # ids that end the fill like padding (DecodeOptions.stop_newline: line breaks)
    middle: dreamon.Middle | None = None  # DreamOn: the middle grows and shrinks (engine/families/dreamon.py)
    reuse: tuple | None = None  # (engine.decode.reuse.ReuseCache, session key): approximate context reuse (None: off)
    reused: int = 0  # context rows whose K/V the first forward took from the session (Fill.reused_tokens)

    @classmethod
    def build(cls, prefix: list[int], suffix: list[int], n: int, cfg: ModelConfig, opts: DecodeOptions,
              context_tokens: int = 512, device="cpu", heal: list[int] | None = None,
              heal_then: dict[int, list[int]] | None = None) -> "Canvas":
        """Cuts prefix/suffix to fit `context_tokens` (and the model) around n mask slots. Token
        healing (the caller removed the healed tail from the prefix): `heal`, the ids slot 0 may
        take; `heal_then`, for those that are a shorter piece of the tail, the ids slot 1 may then
        take. Slot 1 waits for slot 0 while any piece is possible."""
        if cls is Canvas and cfg.canvas == "reorder":  # recipe (c)'s layout: its own forward (engine/decode/reorder.py)
            from engine.decode.reorder import ReorderCanvas

            return ReorderCanvas.build(prefix, suffix, n, cfg, opts, context_tokens, device, heal, heal_then)
        check_options(opts)
        if n < 1:
            raise ValueError("a fill needs at least one mask slot")
        # positions past the training window are untrained: never build a longer canvas
        context_tokens = min(context_tokens, cfg.context_len or cfg.max_seq_len, cfg.max_seq_len)
        if n > context_tokens:
            raise ValueError(f"{n} mask slots do not fit a context of {context_tokens} tokens")
        room = context_tokens - n
        # keep the suffix to at most a third of the room: the prefix says more about the fill
        s_keep = min(len(suffix), room // 3)
        p_keep = min(len(prefix), room - s_keep)
        prefix, suffix = prefix[len(prefix) - p_keep :], suffix[:s_keep]
        middle = None
        if cfg.expand_token_id is not None:  # DreamOn: BOS + prefix + a short middle + suffix + EOS
            prefix, suffix, n, middle = dreamon.layout(prefix, suffix, n, cfg, context_tokens)
            opts, heal, heal_then = dreamon.options(opts), None, None
        if cfg.logits_shift and not prefix:
            # the logit at i-1 predicts token i: the first slot needs a token before it
            if cfg.bos_token_id is None or room < 1:
                raise ValueError("this model shifts logits: it needs at least one token before the hole")
            prefix = [cfg.bos_token_id]
        ids = torch.tensor(prefix + [cfg.mask_token_id] * n + suffix, dtype=torch.long, device=device)
        start = len(prefix)
        a0 = start - (1 if cfg.logits_shift else 0)
        c = cls(ids=ids, start=start, n=n, masked=torch.ones(n, dtype=torch.bool, device=device), opts=opts,
                cfg=cfg, active_pos=torch.arange(a0, start + n, device=device),
                frozen=torch.zeros(n, dtype=torch.bool, device=device), n_masked=n, slot_prob=[0.0] * n,
                middle=middle)
        if heal:
            then = heal_then or {}
            special = (cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id)
            every = set(heal).union(*then.values())  # set operations: a heal list may hold a thousand ids
            if min(every) < 0 or max(every) >= cfg.vocab_size or not every.isdisjoint(special):
                raise ValueError("heal ids must be ordinary tokens of the vocabulary")
            if not set(then) <= set(heal) or not all(then.values()) or (then and n < 2):
                raise ValueError("heal_then: pieces must be heal ids with ids for slot 1, on 2+ slots")
            ids_t = lambda xs: torch.tensor(sorted(set(xs)), dtype=torch.long, device=device)  # noqa: E731
            c.heal, c.heal_open = ids_t(heal), True
            c.heal_then = {p: ids_t(v) for p, v in then.items()}
            whole = [i for i in heal if i not in then]
            if not whole:
                raise ValueError("heal: no id re-types the whole tail")
            c.heal_whole = ids_t(whole)
        if opts.local_ngram:  # the fill's own n-gram counts the context (cut as here) and the lookup
            skip = set(ngram_skip(cfg))
            c.local_near = [[-1 if t in skip else t for t in part] for part in (prefix, suffix)]
        if opts.copy_bigram or opts.copy_unigram or opts.copy_far:
            c.copy = copy_tables(prefix + suffix, (cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id),
                                 max(1, opts.copy_order or 1))
        if opts.selection == "topk":
            c.plan = schedule(n, opts.steps or max(1, n // 2))
        elif opts.selection == "timesteps":
            c.plan = timestep_schedule(n, opts.steps or n)
        if opts.temperature > 0:
            c.generator = torch.Generator(device=device).manual_seed(opts.seed)
        return c

    @property
    def active(self) -> tuple[int, int]:
        """Span of positions whose hidden states a step needs (one more on the left when shifted)."""
        return self.start - (1 if self.cfg.logits_shift else 0), self.start + self.n

    @property
    def ctx(self) -> list | None:
        """Per layer (k, v) of the cached context, (1, H, ctx_len, Dh); None before the first full forward."""
        if self.kv is None:
            return None
        return [(k[:, :, : self.ctx_len], v[:, :, : self.ctx_len]) for k, v in self.kv]

    def slot_ids(self) -> list[int]:
        return self.ids[self.start : self.start + self.n].tolist()

    def fill_ids(self) -> list[int]:
        """Committed fill tokens so far: padding dropped, cut at end-of-text, masks left out."""
        slots = self.slot_ids()
        return trim_fill([t for t, m in zip(slots, self.masked.tolist()) if not m], self.cfg.pad_token_id, self.cfg.eos_token_id)

    def fill_confidence(self) -> float:
        """Geometric mean of the probabilities the fill's tokens had when committed (1.0 for an
        empty fill): how sure the model was of the text it wrote, for gating what is shown."""
        slots, masked, probs = self.slot_ids(), self.masked.tolist(), self.slot_prob
        logs = []
        for t, m, p in zip(slots, masked, probs):
            if m or t == self.cfg.pad_token_id:
                continue
            if t == self.cfg.eos_token_id:
                break
            logs.append(math.log(max(p, 1e-12)))
        return math.exp(sum(logs) / len(logs)) if logs else 1.0

    def heal_ids(self, final: bool) -> torch.Tensor:
        """The ids the healed slot may take this step: a final step at slot 0 must re-type the
        whole tail (slot 1 is committed in the same step, unrestricted)."""
        return self.heal_whole if final and self.heal_slot == 0 else self.heal

    def attach_far(self, lookup: list[int] | None) -> None:
        """Gives the copy boost its far side: the ids of FillJob.lookup (off unless copy_far), and
        builds the fill's own n-gram from them and the context (off unless local_ngram). Called once
        per fill, with or without a lookup."""
        far = far_ids(lookup, ngram_skip(self.cfg)) if lookup else None
        if far is not None and self.copy is not None and self.opts.copy_far:
            self.copy_far = far
        if self.opts.local_ngram and self.local_near is not None:
            from engine.bias.ngram import LocalNgram

            self.local = LocalNgram([far] + self.local_near)

    def copy_bias(self, slot_idx: torch.Tensor, logits: torch.Tensor | None = None, restrict=None) -> torch.Tensor:
        """(M, V) context copy bias for these slots, from the tokens left of them right now. With
        `copy_chain` and the slots' (M, V) `logits`, a slot right of a slot predicted in this step
        takes that slot's prediction (argmax of its biased row after `restrict(r, row)`) as its left
        neighbour (chain_copy_bias)."""
        order = max(1, self.opts.copy_order or 1)
        slots = slot_idx.tolist()
        left = left_runs(self.ids.tolist(), [self.start + j for j in slots], order, self.cfg.mask_token_id)
        if logits is None or not self.opts.copy_chain or self.opts.temperature > 0:
            return copy_bias(left, *self.copy, self.cfg.vocab_size, self.opts, device=self.ids.device, far=self.copy_far)
        chain = [r > 0 and slots[r - 1] == j - 1 for r, j in enumerate(slots)]
        return chain_copy_bias(left, chain, logits, self.copy, self.opts, order, self.copy_far, restrict)

    def memory_runs(self, slot_idx: torch.Tensor) -> list[tuple]:
        """These slots' committed left runs at the longest order any n-gram memory reads (the corpus
        table, the fill's own, the workspace's): one pass over the canvas for all of them."""
        order = max(t.max_order for t in (self.ngram, self.local, self.workspace) if t is not None)
        return left_runs(self.ids.tolist(), [self.start + j for j in slot_idx.tolist()], order, self.cfg.mask_token_id)

    def add_ngram(self, logits: torch.Tensor, slot_idx: torch.Tensor, left: list[tuple] | None = None) -> None:
        """Adds the corpus n-gram memory to these slots' (M, V) logits in place, from the committed
        ids left of them (`left`: memory_runs(slot_idx), when the caller has them)."""
        table = self.ngram
        left = self.memory_runs(slot_idx) if left is None else left
        table.add_bias(logits, [run[-table.max_order :] for run in left], self.opts.ngram, ngram_skip(self.cfg))

    def add_local(self, logits: torch.Tensor, slot_idx: torch.Tensor, left: list[tuple] | None = None) -> None:
        """Adds the fill's own n-gram (DecodeOptions.local_ngram) to these slots' (M, V) logits in
        place, from the committed ids left of them; where it has no context, the workspace's n-gram
        (DecodeOptions.workspace_ngram, `workspace`) instead. `left`: memory_runs(slot_idx)."""
        local, ws = self.local, self.workspace
        order = max(t.max_order for t in (local, ws) if t is not None)
        left = self.memory_runs(slot_idx) if left is None else left
        skip = set(ngram_skip(self.cfg))
        for r, run in enumerate(left):
            run = run[-order:]
            if not run or not skip.isdisjoint(run):
                continue
            hit, w = (local.next_probs(run), self.opts.local_ngram) if local is not None else (None, 0.0)
            if hit is None and ws is not None:
                hit, w = ws.next_probs(run), self.opts.workspace_ngram
            if hit is not None:
                add_hit(logits, r, hit, w)

    def masked_slots(self) -> torch.Tensor:
        """(M,) indices of the still-masked slots, ascending; one nonzero per step, shared by the
        forward (which slots to run) and the commit."""
        if self._masked_at[0] != self.steps:
            self._masked_at = (self.steps, torch.nonzero(self.masked).flatten())
        return self._masked_at[1]

    def window_now(self, final: bool = False) -> int:
        """Slots this step predicts from the left (0: every masked slot): the window, unless the
        step is the last one and must commit everything."""
        w = self.opts.window
        if w <= 0 or final or self.last_step_due() or self.n_masked <= w:
            return 0
        return w

    def window_outside(self) -> torch.Tensor | None:
        """(E,) masked slots right of this step's window (their K/V come from the last full
        forward instead of being run), or None when the step predicts every masked slot."""
        w = self.window_now(self.final_step)
        return self.masked_slots()[w:] if w else None

    def needs_full(self) -> bool:
        """True when this step must run the whole sequence (no cache yet, or a refresh is due)."""
        o = self.opts
        return (not o.cache) or self.kv is None or (o.refresh_every > 0 and self.since_refresh >= o.refresh_every)

    def next_step_ms(self) -> float:
        """Estimated duration of the next step (0 when nothing has been measured yet)."""
        return self.full_ms if self.needs_full() else (self.cached_ms or self.full_ms)

    def last_step_due(self) -> bool:
        """True when the step budget (`steps` with threshold selection) is down to one step."""
        return self.opts.selection == "threshold" and self.opts.steps is not None and self.steps + 1 >= self.opts.steps


# ---------------------------------------------------------------- forward + commit


def forward(model, canvases: list[Canvas], batch_ctx: BatchContext | None = None) -> list[Rows]:
    """Hidden states for a batch: one full forward for the canvases that need one, one cached step
    for the rest. Returns per canvas (hidden (R, D), their positions (R,)), in order."""
    if canvases and canvases[0].cfg.canvas == "reorder":  # causal, masks last: engine/decode/reorder.py
        from engine.decode import reorder

        return reorder.forward(model, canvases, batch_ctx)
    full = [c for c in canvases if c.needs_full()]
    cached = [c for c in canvases if not c.needs_full()]
    hs: dict[int, Rows] = {}
    keyed = [c for c in full if c.reuse is not None and c.kv is None]  # a first forward with a session
    if keyed:
        from engine.decode import reuse

        for c in keyed:  # each against its own session's K/V
            hs[id(c)] = reuse.forward_first(model, c)
        full = [c for c in full if id(c) not in hs]
    if full and full[0].ids.is_cuda:
        hs.update(zip(map(id, full), forward_full(model, full)))
    else:
        # a full forward is compute-bound on a CPU: batching saves nothing there and padding costs
        for c in full:
            hs[id(c)] = forward_full(model, [c])[0]
    if cached:
        hs.update(zip(map(id, cached), forward_cached(model, cached, batch_ctx)))
    return [hs[id(c)] for c in canvases]


def commit(model, c: Canvas, rows: Rows, final: bool) -> int:
    """Predicts the masked slots of one canvas from the hidden states of a forward and commits some
    (all when `final`). Returns how many slots were committed; sets c.done when nothing is left."""
    cfg, o = c.cfg, c.opts
    h_rows, pos = rows  # (R, D), (R,) ascending positions
    if final and not c.final_step and c.window_now():
        raise RuntimeError("a final step must be announced (Canvas.final_step) before its forward")
    w = c.window_now(final)
    slot_idx = c.masked_slots()  # (M,)
    outside = slot_idx[w:] if w else None  # masked slots this step does not predict
    if w:
        slot_idx = slot_idx[:w]
    # the hidden state at position p predicts slot p (shifted: slot p+1): find each masked slot's row
    want = slot_idx + (c.start - (1 if cfg.logits_shift else 0))  # (M,) positions
    h = h_rows[torch.searchsorted(pos, want)]  # (M, D)
    if o.temperature > 0 or c.copy is not None or c.names is not None or c.ngram is not None or c.local is not None \
            or c.workspace is not None:  # full rows
        logits = model.logits(h).float()  # (M, V)
        if c.names is not None and c.middle is None:  # identifier-aware decoding, the leftmost masked slot
            row = name_row(c, int(slot_idx[0]), final)
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
        if o.temperature > 0:
            logits = logits / o.temperature
        logits[:, cfg.mask_token_id] = float("-inf")  # a slot may never be filled with a mask
        if c.middle is not None and c.middle.expand_banned(c.n, final):  # DreamOn's middle at its longest
            logits[:, cfg.expand_token_id] = float("-inf")
        if c.heal_open:  # the healed slot (the first row) only among its candidates
            logits[0] = heal_logits(logits[0], c.heal_ids(final or c.last_step_due()))
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
    elif c.middle is not None and c.middle.expand_banned(c.n, final):  # DreamOn's middle at its longest
        max_p, pred, top2_p, ent = dreamon.stats_without_expand(model, h, cfg)
    else:
        max_p, pred, top2_p, ent = slot_stats(h, model.norm.weight, model.norm.eps, model.head_weight, cfg.mask_token_id)
        if c.heal_open:  # the healed slot (the first row): the distribution renormalized over its candidates
            logp = heal_logits(model.logits(h[:1]).float()[0], c.heal_ids(final or c.last_step_due())).log_softmax(-1)
            top = logp.topk(2)
            p = logp.exp()
            max_p, pred, top2_p, ent = (max_p.clone(), pred.clone(), top2_p.clone(), ent.clone())
            max_p[0], pred[0], top2_p[0] = p[top.indices[0]], top.indices[0], p[top.indices[1]]
            ent[0] = -(p * logp.clamp_min(-1e30)).sum()
    conf = confidence_from_stats(max_p, top2_p, ent, o.confidence)
    # decide on the host: one transfer of a few dozen numbers beats a dozen tiny tensor ops per step
    conf_l, maxp_l, pred_l = torch.stack([conf.double(), max_p.double(), pred.double()]).tolist()
    slot_l = slot_idx.tolist()
    # a line break the healed slots re-type lies before the cursor: no stop while the heal is open
    ends = (cfg.pad_token_id, cfg.eos_token_id) + (() if c.heal_open else c.stop_ids)
    if final or c.last_step_due() or all(t in ends and p >= o.pad_stop for t, p in zip(pred_l, maxp_l)):
        pick = list(range(len(conf_l)))
    else:
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
        pick = [elig[i] for i in sub]
        if o.stop_below and o.selection == "threshold" and cfg.family != "wedlm" and not c.heal_open and elig and elig[0] == 0 \
                and all(x < o.threshold for x in conf_e) and maxp_l[0] < o.stop_below:
            pick, pred_l[0] = [0], cfg.eos_token_id  # unsure at the leftmost masked slot: the fill ends there
            pred = pred.clone()
            pred[0] = cfg.eos_token_id
    values = pred.clone()
    n_tail = 0  # masked slots right of the window committed as padding
    if o.block > 0 or o.pad_left or o.window > 0:
        pick, values = _end_at_padding(pick, pred_l, values, ends, cfg.pad_token_id,
                                       cfg.eos_token_id if o.pad_left else None)
        if outside is not None and any(int(pred_l[i]) in ends for i in pick):
            # the fill ended inside the window: every slot right of it is padding too
            c.ids[c.start + outside] = cfg.pad_token_id
            c.masked[outside] = False
            n_tail = outside.numel()
            c.n_masked -= n_tail
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
    c.steps += 1
    c.tokens_per_step.append(len(pick) + n_tail)
    c.done = c.n_masked == 0
    if cfg.family == "wedlm":  # its authors' stream ends at a stop token with nothing masked before it
        c.done = c.done or wedlm.finished(c.slot_ids(), c.masked.tolist(), c.keep, (cfg.eos_token_id,))
    if c.middle is not None:  # DreamOn: a committed expand / end-of-text resizes the middle
        dreamon.edit(c, chosen.tolist())
    return len(pick)


def name_row(c: Canvas, j: int, final: bool) -> torch.Tensor | None:
    """The identifier penalty (engine/bias/names.py) of slot j, the leftmost masked one: None when a
    committed slot before it ends the fill."""
    done = c.ids[c.start : c.start + j].tolist()
    if any(t in (c.cfg.pad_token_id, c.cfg.eos_token_id) for t in done):
        return None
    heal = c.heal_ids(final or c.last_step_due()).tolist() if c.heal_open and j == c.heal_slot else None
    return c.names.slot_row(done, heal)


def record_step(c: Canvas, was_full: bool, ms: float) -> None:
    """Keeps a step's wall time: the job's stats, and the estimate for its next step of that kind."""
    c.ms_per_step.append(ms)
    if was_full:
        c.full_ms = ms
    else:
        c.cached_ms = ms


@torch.inference_mode()
def step(model, canvases: list[Canvas], final: list[bool] | None = None, batch_ctx: BatchContext | None = None) -> None:
    """One denoising step for a batch of canvases: forward, then each commits its own slots."""
    final = final or [False] * len(canvases)
    for c, f in zip(canvases, final):
        c.final_step = f
    t0 = time.perf_counter()
    was_full = [c.needs_full() for c in canvases]
    hs = forward(model, canvases, batch_ctx)
    for c, h, f in zip(canvases, hs, final):
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


def fill(model, canvas: Canvas, deadline: float | None = None, cancelled=lambda: False) -> DecodeResult:
    """Denoises one canvas to the end. Between steps: a cancelled job stops at once; when the next
    step would pass the deadline it becomes the last one and commits every remaining mask."""
    while not canvas.done:
        if cancelled():
            canvas.cancelled = True
            break
        final = deadline_due(canvas, deadline)
        canvas.deadline_hit |= final
        step(model, [canvas], [final])
    return DecodeResult(canvas.fill_ids(), canvas.steps, canvas.tokens_per_step, canvas.ms_per_step,
                        cancelled=canvas.cancelled, deadline_hit=canvas.deadline_hit,
                        confidence=canvas.fill_confidence())


# ---------------------------------------------------------------- the oracle


@torch.no_grad()
def reference_fill(model, prefix: list[int], suffix: list[int], n: int, opts: DecodeOptions,
                   context_tokens: int = 512, heal: list[int] | None = None,
                   heal_then: dict[int, list[int]] | None = None, lookup: list[int] | None = None,
                   stop_ids: list[int] | None = None, names=None, ngram=None,
                   workspace: list[list[int]] | None = None) -> list[int]:
    """Naive sampler kept as the oracle: full recompute every step, full softmax over the vocabulary
    in fp64, plain Python selection. Temperature 0 only. Returns the fill's token ids. `heal`,
    `heal_then`: token healing, as in Canvas.build; `lookup`: the copy boost's far side (ids); `stop_ids`: Canvas.stop_ids;
    `names`: Canvas.names (engine.bias.names.NameBias); `ngram`: Canvas.ngram (engine.bias.ngram.NgramTable);
    `workspace`: the workspace's files as id lists, the filled one left out (DecodeOptions.workspace_ngram)."""
    assert opts.temperature == 0, "the oracle is deterministic"
    cfg = model.cfg
    c = Canvas.build(prefix, suffix, n, cfg, opts, context_tokens, heal=heal, heal_then=heal_then)  # the same cut
    c.attach_far(lookup)
    c_prefix, c_suffix = c.ids[: c.start].tolist(), c.ids[c.start + c.n :].tolist()
    lookup = (lookup or [])[-16384:]  # far_ids keeps as much
    c.stop_ids = tuple(stop_ids or ())
    ends = (cfg.pad_token_id, cfg.eos_token_id) + c.stop_ids
    assert c.middle is None, "DreamOn's growing middle has its own oracle (tests/test_families_decode.py)"
    then = dict(heal_then or {})
    h_slot, h_ids = (0, set(heal)) if heal else (None, set())
    seq, s = c.ids.tolist(), c.start
    masked = list(range(n))
    plan = {"topk": lambda: schedule(n, opts.steps or max(1, n // 2)),
            "timesteps": lambda: timestep_schedule(n, opts.steps or n)}.get(opts.selection, list)()
    shift = 1 if cfg.logits_shift else 0
    steps = 0
    groups: list[list[int]] = []  # slots committed at each step (the reorder layout's cache order)
    while masked:
        ends_now = ends if h_slot is None else (cfg.pad_token_id, cfg.eos_token_id)  # no stop while healing
        if cfg.canvas == "reorder":  # the whole reordered row, recomputed, its logits in logical order
            from engine.decode.reorder import reference_logits

            logits = reference_logits(model, seq, s, n, groups).double()
        else:
            logits = model(torch.tensor([seq]))[0].double()  # (L, V)
        if c.copy is not None:  # the context copy boost, from each masked slot's left neighbour now
            left = []
            for j in masked:  # the committed run just left of slot j, written out plainly
                run, q = [], s + j - 1
                while q >= 0 and len(run) < max(1, opts.copy_order or 1) and seq[q] != cfg.mask_token_id:
                    run.insert(0, seq[q])
                    q -= 1
                left.append(tuple(run))
            budget_now = opts.selection == "threshold" and opts.steps is not None and steps + 1 >= opts.steps
            if opts.copy_chain and c.middle is None and cfg.family != "wedlm":
                # draft chaining: slot j - 1 masked too -> its biased, restricted argmax continues j's run
                bias = torch.zeros(len(masked), logits.shape[-1], dtype=torch.float64)
                runs: list[tuple] = []
                for r, j in enumerate(masked):
                    run = left[r]
                    if r > 0 and masked[r - 1] == j - 1:
                        row = logits[s + j - 1 - shift] + bias[r - 1]
                        row[cfg.mask_token_id] = float("-inf")
                        if h_slot is not None and j - 1 == h_slot:
                            allowed = sorted(h_ids - set(then) if budget_now and h_slot == 0 else h_ids)
                            row = torch.where(torch.isin(torch.arange(row.shape[0]), torch.tensor(allowed)), row,
                                              torch.full_like(row, float("-inf")))
                        run = (runs[r - 1] + (int(torch.argmax(row)),))[-max(1, opts.copy_order or 1):]
                    runs.append(run)
                    bias[r] = copy_bias([run], *c.copy, logits.shape[-1], opts, dtype=torch.float64, far=c.copy_far)[0]
            else:
                bias = copy_bias(left, *c.copy, logits.shape[-1], opts, dtype=torch.float64, far=c.copy_far)
            for r, j in enumerate(masked):
                logits[s + j - shift] += bias[r]
        if ngram is not None and opts.ngram:  # the corpus n-gram memory, from each masked slot's committed left run
            for j in masked:
                run, q = [], s + j - 1
                while q >= 0 and len(run) < max(ngram.orders) and seq[q] != cfg.mask_token_id:
                    run.insert(0, seq[q])
                    q -= 1
                hit = ngram.next_probs(tuple(run)) if run and not set(run) & set(ngram_skip(cfg)) else None
                for t, p in zip(*hit) if hit is not None else ():  # the longest stored context's next ids
                    logits[s + j - shift, int(t)] += opts.ngram * float(p)
        if opts.local_ngram or (opts.workspace_ngram and workspace is not None):
            # the fill's own n-gram: count the contexts in the lookup and the context, plainly; where
            # none is followed often enough, the same over the workspace's files
            texts = [[-1 if t in ngram_skip(cfg) else t for t in x] for x in (lookup or [], c_prefix, c_suffix)]
            sources = ([(texts, opts.local_ngram)] if opts.local_ngram else []) \
                + ([(workspace, opts.workspace_ngram)] if opts.workspace_ngram and workspace is not None else [])
            for j in masked:
                run, q = [], s + j - 1
                while q >= 0 and len(run) < 6 and seq[q] != cfg.mask_token_id:
                    run.insert(0, seq[q])
                    q -= 1
                if not run or set(run) & set(ngram_skip(cfg)):
                    continue
                for src, weight in sources:
                    hit = False
                    for k in (6, 5, 4, 3):  # the longest context followed at least twice
                        if k > len(run):
                            continue
                        nexts = [x[i + k] for x in src for i in range(len(x) - k) if x[i + k] >= 0
                                 and tuple(x[i : i + k]) == tuple(run[-k:])]
                        if len(nexts) >= 2:
                            ranked = sorted(set(nexts), key=lambda t: (-nexts.count(t), t))[:2]
                            for t in ranked:
                                logits[s + j - shift, t] += weight * nexts.count(t) / len(nexts)
                            hit = True
                            break
                    if hit:
                        break
        budget_out = opts.selection == "threshold" and opts.steps is not None and steps + 1 >= opts.steps
        if names is not None:  # identifier-aware decoding: the leftmost masked slot, all left of it committed
            j0 = masked[0]
            done = seq[s : s + j0]
            if not any(t in (cfg.pad_token_id, cfg.eos_token_id) for t in done):
                cands = None
                if h_slot is not None and j0 == h_slot:
                    cands = sorted(h_ids - set(then) if budget_out and h_slot == 0 else h_ids)
                row = names.slot_row(done, cands)
                if row is not None:
                    logits[s + j0 - shift] += row.double()
        logits[:, cfg.mask_token_id] = float("-inf")
        if h_slot is not None:  # the healed slot: only its candidates (a last step at slot 0: whole ones)
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
            keep[sorted(h_ids - set(then) if budget_out and h_slot == 0 else h_ids)] = True
            logits[s + h_slot - shift, ~keep] = float("-inf")
        probs = F.softmax(logits, dim=-1)
        cand, max_p = [], {}
        for j in masked:
            p = probs[s + j - shift]
            top = torch.topk(p, 2)
            tok = int(torch.argmax(p))
            mp, t2 = float(p[tok]), float(top.values[1])
            ent = float(-(p[p > 0] * p[p > 0].log()).sum())
            conf = {"max_prob": mp, "margin": mp - t2, "neg_entropy": -ent}[opts.confidence]
            is_pad = tok in ends_now
            cand.append((j, tok, conf, is_pad and mp >= opts.pad_stop))
            max_p[j] = mp
        if opts.window > 0 and not budget_out:  # only the leftmost `window` masked slots are predicted
            cand = cand[: opts.window]
        if budget_out or all(x[3] for x in cand):
            chosen = cand
        else:
            if opts.block > 0:  # only the leftmost block that still has masks
                lo = min(masked) // opts.block * opts.block
                cand_e = [x for x in cand if lo <= x[0] < lo + opts.block]
            else:
                cand_e = cand
            if opts.pad_left:  # padding only at the leftmost masked slot
                first = min(masked)
                cand_e = [x for x in cand_e if x[0] == first or x[1] not in ends_now] \
                    or [x for x in cand if x[0] == first]
            if h_slot == 0 and then:  # slot 1 waits while slot 0 may take a piece of the tail
                cand_e = [x for x in cand_e if x[0] != 1]
            if cfg.block_size:  # block-causal: only the leftmost absolute block (sub-block) that has masks
                unit = cfg.sub_block_size if cfg.sub_block_size and cfg.block_size % cfg.sub_block_size == 0 else cfg.block_size
                lead = [x for x in cand if x[0] == min(masked)]
                if cfg.logits_shift and (s + min(masked)) % cfg.block_size == 0:  # predicted from the block before
                    cand_e = lead
                blk = (s + min(masked)) // unit
                cand_e = [x for x in cand_e if (s + x[0]) // unit == blk] or lead
            ranked = sorted(cand_e, key=lambda x: (-x[2], x[0]))
            if opts.selection in ("topk", "timesteps"):
                chosen = ranked[: plan.pop(0) if plan else 1]
            else:
                chosen = [x for x in cand_e if x[2] >= opts.threshold] or ranked[:1]
                first = min(masked)
                if opts.stop_below and cfg.family != "wedlm" and h_slot is None and cand_e and cand_e[0][0] == first \
                        and not any(x[2] >= opts.threshold for x in cand_e) and max_p[first] < opts.stop_below:
                    chosen = [(first, cfg.eos_token_id, 0, 0)]  # stop when unsure: the end, at the leftmost slot
        if opts.block > 0 or opts.pad_left or opts.window > 0:  # a committed padding/end slot ends the fill
            ends_at = [x[0] for x in chosen if x[1] in ends_now]
            if ends_at:
                cut = min(ends_at)
                chosen = [x for x in chosen if x[0] < cut] + [(cut, cfg.eos_token_id if opts.pad_left else
                                                               next(x[1] for x in chosen if x[0] == cut), 0, 0)] \
                    + [(j, cfg.pad_token_id, 0, 0) for j in masked if j > cut]
        for j, tok, _, _ in chosen:
            seq[s + j] = tok
            masked.remove(j)
            if j == h_slot:
                if j == 0 and tok in then and not budget_out:
                    h_slot, h_ids = 1, set(then[tok])
                else:
                    h_slot = None
        groups.append(sorted(x[0] for x in chosen))
        steps += 1
    return trim_fill(seq[s : s + n], cfg.pad_token_id, cfg.eos_token_id)


__all__ = [
    "Canvas", "BatchContext", "DecodeResult", "check_options", "commit", "confidence_from_stats", "deadline_due",
    "eligible_slots", "fill", "forward", "forward_cached", "forward_full", "heal_logits", "reference_fill", "schedule", "select_threshold",
    "select_topk", "step", "timestep_schedule", "trim_fill",
]
