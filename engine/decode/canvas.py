"""One fill's state: `Canvas` holds prefix + n mask slots + suffix, which slots are still masked, the
context cache and the levers attached to the fill; plus the schedules and the option checks a canvas
is built with. A canvas knows no layout but its own: engine/decode/forward.py picks the layout.

Token healing (DecodeOptions.heal, on by default). The service cuts the prefix's tail that
TextTokenizer.heal chose (the partial word at the cursor, a trailing space, the indentation) and
adds one slot; the canvas makes the fill re-type that tail. Slot 0 may take only the ids that
extend the tail's text or are a shorter piece of it (`heal`); after a piece (`\\n       ` of
`\\n        `), slot 1 may take only the ids that extend the rest (` self`: `heal_then`). While slot
0 may still take a piece, slot 1 waits (it is not eligible), because what it may take depends on
slot 0's choice. A last step (the deadline's, or the step budget's: `last_step_due`) at slot 0 takes
only whole re-typings (`heal_whole`), since slot 1 is committed in the same step, unrestricted.
The healed slot's distribution is renormalised over its candidates, in the fast loop (full rows or
the fused slot statistics), the oracle (engine/decode/reference.py) and sampling alike, so its
confidence is the model's choice among the re-typings, not the share left after the rest was
struck. While the heal is open neither the line-break stop nor `stop_below` ends the fill: a line
break the healed slots re-type lies before the cursor. The autoregressive twin heals the same way
(engine/decode/autoregressive.py, `greedy_decode(heal=)`), so the eval compares like with like;
`dlm-lsp bench` turns healing off so that its canvases have exactly n slots, like the twin's n
tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

import numpy as np
import torch

from engine.api import SEED_RANGE, DecodeOptions
from engine.bias.copy import CopyTables, Run, chain_copy_bias, copy_bias, copy_tables, far_ids, left_runs, ngram_skip
from engine.bias.ngram import Hit, LocalNgram, add_hit
from engine.families import dreamon
from engine.model.config import ModelConfig

if TYPE_CHECKING:
    from engine.bias.names import NameBias
    from engine.bias.ngram import NgramTable, WorkspaceView
    from engine.decode.reuse import ReuseCache

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), each (1, Hkv, L, Dh)

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


def block_schedule(n_masked: int, steps: int, block: int) -> list[int]:
    """Tokens to commit at each step with semi-AR blocks of `block` slots (DecodeOptions.block), as
    LLaDA's generate.py plans them: every block gets steps // blocks steps, over which its own masks
    are split as `schedule` splits them (larger first), blocks left to right. 16 slots, blocks of 8,
    6 steps: [3, 3, 2, 3, 3, 2]. LLaDA asserts that the slots are a multiple of the block and the
    steps a multiple of the blocks; here a shorter last block (slots not a multiple of the block) is
    planned like the others, its fewer masks over the same steps per block, and a block gets at
    least one step: steps left over by the division are not run. block <= 0: one block, `schedule`."""
    if block <= 0:
        return schedule(n_masked, steps)
    n_blocks = -(-n_masked // block)
    per_block = max(1, steps // n_blocks)
    return [k for b in range(n_blocks) for k in schedule(min(block, n_masked - b * block), per_block)]


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


def trim_fill(ids: list[int], pad_id: int, eos_id: int | tuple[int, ...]) -> list[int]:
    """Fill tokens without padding, cut at the first end: end-of-text, or any of several ids
    (ModelConfig.end_ids)."""
    ends = (eos_id,) if isinstance(eos_id, int) else eos_id
    out = []
    for t in ids:
        if t in ends:
            break
        if t != pad_id:
            out.append(t)
    return out


def check_options(o: DecodeOptions) -> None:
    """Raises ValueError for options no loop can run (checked when a job is admitted, not mid-batch)."""
    if o.selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {o.selection!r}")
    if not SEED_RANGE[0] <= o.seed <= SEED_RANGE[1]:
        raise ValueError(f"seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}, got {o.seed}")
    if o.confidence not in CONFIDENCES:
        raise ValueError(f"confidence must be one of {CONFIDENCES}, got {o.confidence!r}")
    if o.steps is not None and o.steps < 1:
        raise ValueError(f"steps must be None or >= 1, got {o.steps}")
    if o.temperature < 0 or o.refresh_every < 0 or o.block < 0 or o.window < 0:
        raise ValueError("temperature, refresh_every, block and window must be >= 0")
    if (
        (o.copy_bigram or 0) < 0
        or (o.copy_unigram or 0) < 0
        or (o.copy_far or 0) < 0
        or (o.names or 0) < 0
        or (o.brackets or 0) < 0
        or (o.ngram or 0) < 0
        or (o.local_ngram or 0) < 0
        or (o.workspace_ngram or 0) < 0
        or (o.copy_order is not None and not 1 <= o.copy_order <= 8)
    ):
        raise ValueError(
            "copy_bigram, copy_unigram, copy_far, names, brackets, ngram, local_ngram and workspace_ngram "
            "must be >= 0 "
            "and copy_order in 1..8"
        )
    if o.stop_below is not None and not 0 <= o.stop_below < 1:
        raise ValueError(f"stop_below must be in [0, 1), got {o.stop_below}")
    if o.stop_below and not o.pad_left:
        raise ValueError("stop_below ends a fill as pad_left does: it needs pad_left")
    if o.reuse_budget < 0:
        raise ValueError(f"reuse_budget must be >= 0, got {o.reuse_budget}")
    if o.top_k is not None and (isinstance(o.top_k, bool) or not isinstance(o.top_k, int) or o.top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {o.top_k!r}")


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
    plan: list[int] = field(default_factory=list)  # commits of the steps still to run (topk: block_schedule)
    n_masked: int = 0  # slots still masked (kept on the host: no device sync to know it)
    steps: int = 0
    tokens_per_step: list[int] = field(default_factory=list)
    ms_per_step: list[float] = field(default_factory=list)
    rows_forwarded: int = 0  # rows run through the model, summed over this job's forwards (Fill.forwarded_tokens)
    kv: LayerKV | None = None  # per layer (k, v) buffers (1, Hkv, L, Dh); the first ctx_len rows are the context
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
    _masked_at: tuple[int, torch.Tensor | None] = (-1, None)  # (steps, masked slot indices): computed once per step
    # with a window: per layer (k, v) (1, H, n, Dh) of the slots at the last full forward
    slot_kv: LayerKV | None = None
    # token healing (TextTokenizer.heal): slot `heal_slot` (0, or 1 after slot 0 took a shorter piece
    # of the healed text) may only take the ids in `heal`; it is the leftmost masked slot while open
    heal: torch.Tensor | None = None
    heal_open: bool = False
    heal_slot: int = 0
    heal_then: dict[int, torch.Tensor] = field(default_factory=dict)  # piece id at slot 0 -> (ids) slot 1 may then take
    heal_whole: torch.Tensor | None = None  # slot 0's ids that re-type the whole text (a final step's)
    copy: CopyTables | None = None  # (ids, successors) of the context copy boost (copy_tables), None: off
    copy_far: np.ndarray | None = None  # the boost's far side (far_ids of FillJob.lookup), None: none
    names: NameBias | None = None  # identifier-aware decoding (DecodeOptions.names), None: off
    ngram: NgramTable | None = None  # the corpus n-gram memory (DecodeOptions.ngram), None: off
    local: LocalNgram | None = None  # the fill's own texts' n-gram (DecodeOptions.local_ngram), None: off
    local_near: list[list[int]] | None = None  # the context's ids for `local` (attach_far adds the lookup's)
    workspace: WorkspaceView | None = None  # FillJob.workspace's memory (DecodeOptions.workspace_ngram), None: off
    stop_ids: tuple[int, ...] = ()  # ids that end the fill like padding (DecodeOptions.stop_newline: line breaks)
    middle: dreamon.Middle | None = None  # DreamOn: the middle grows and shrinks (engine/families/dreamon.py)
    # (engine.decode.reuse.ReuseCache, session key): approximate context reuse (None: off)
    reuse: tuple[ReuseCache, str] | None = None
    reused: int = 0  # context rows whose K/V the first forward took from the session (Fill.reused_tokens)
    # a next edit's edit memory (engine/bias/edits.py EditBias, attached by engine/decode/rewrite.py):
    # (canvas, predicted slots (M,)) -> their (M, V) bias; None: off
    edit_bias: Callable[[Canvas, torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        prefix: list[int],
        suffix: list[int],
        n: int,
        cfg: ModelConfig,
        opts: DecodeOptions,
        context_tokens: int = 512,
        device: str | torch.device = "cpu",
        heal: list[int] | None = None,
        heal_then: dict[int, list[int]] | None = None,
    ) -> Self:
        """Cuts prefix/suffix to fit `context_tokens` (and the model) around n mask slots. Token
        healing (the caller removed the healed tail from the prefix): `heal`, the ids slot 0 may
        take; `heal_then`, for those that are a shorter piece of the tail, the ids slot 1 may then
        take. Slot 1 waits for slot 0 while any piece is possible."""
        if cls is Canvas and cfg.canvas is not None:  # a layout of its own: engine/decode/forward.build_canvas picks it
            raise ValueError(
                f"a {cfg.canvas!r} canvas is built by engine.decode.forward.build_canvas, not Canvas.build"
            )
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
        c = cls(
            ids=ids,
            start=start,
            n=n,
            masked=torch.ones(n, dtype=torch.bool, device=device),
            opts=opts,
            cfg=cfg,
            active_pos=torch.arange(a0, start + n, device=device),
            frozen=torch.zeros(n, dtype=torch.bool, device=device),
            n_masked=n,
            slot_prob=[0.0] * n,
            middle=middle,
        )
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
            c.copy = copy_tables(
                prefix + suffix,
                (cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id),
                max(1, opts.copy_order or 1),
            )
        if opts.selection == "topk":  # per semi-AR block when there are blocks (LLaDA's plan)
            c.plan = block_schedule(n, opts.steps or max(1, n // 2), opts.block)
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
    def ctx(self) -> LayerKV | None:
        """Per layer (k, v) of the cached context, (1, H, ctx_len, Dh); None before the first full forward."""
        if self.kv is None:
            return None
        return [(k[:, :, : self.ctx_len], v[:, :, : self.ctx_len]) for k, v in self.kv]

    def slot_ids(self) -> list[int]:
        return self.ids[self.start : self.start + self.n].tolist()

    def fill_ids(self) -> list[int]:
        """Committed fill tokens so far: padding dropped, cut at end-of-text, masks left out."""
        slots = self.slot_ids()
        return trim_fill(
            [t for t, m in zip(slots, self.masked.tolist()) if not m], self.cfg.pad_token_id, self.cfg.end_ids
        )

    def fill_confidence(self) -> float:
        """Geometric mean of the probabilities the fill's tokens had when committed (1.0 for an
        empty fill): how sure the model was of the text it wrote, for gating what is shown."""
        slots, masked, probs = self.slot_ids(), self.masked.tolist(), self.slot_prob
        ends = self.cfg.end_ids
        logs = []
        for t, m, p in zip(slots, masked, probs):
            if m or t == self.cfg.pad_token_id:
                continue
            if t in ends:
                break
            logs.append(math.log(max(p, 1e-12)))
        return math.exp(sum(logs) / len(logs)) if logs else 1.0

    def heal_ids(self, final: bool) -> torch.Tensor:
        """The ids the healed slot may take this step: a final step at slot 0 must re-type the
        whole tail (slot 1 is committed in the same step, unrestricted)."""
        ids = self.heal_whole if final and self.heal_slot == 0 else self.heal
        if ids is None:  # set together with heal_open by build (and heal_then's pieces by the commit)
            raise ValueError("this canvas has no token healing")
        return ids

    def attach_far(self, lookup: list[int] | None) -> None:
        """Gives the copy boost its far side: the ids of FillJob.lookup (off unless copy_far), and
        builds the fill's own n-gram from them and the context (off unless local_ngram). Called once
        per fill, with or without a lookup."""
        far = far_ids(lookup, ngram_skip(self.cfg)) if lookup else None
        if far is not None and self.copy is not None and self.opts.copy_far:
            self.copy_far = far
        if self.opts.local_ngram and self.local_near is not None:
            self.local = LocalNgram([far, *self.local_near])

    def copy_bias(
        self,
        slot_idx: torch.Tensor,
        logits: torch.Tensor | None = None,
        restrict: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(M, V) context copy bias for these slots, from the tokens left of them right now. With
        `copy_chain` and the slots' (M, V) `logits`, a slot right of a slot predicted in this step
        takes that slot's prediction (argmax of its biased row after `restrict(r, row)`) as its left
        neighbour (chain_copy_bias)."""
        tables = self.copy
        if tables is None:  # the sampler asks only with the boost on
            raise ValueError("the context copy boost is off on this canvas")
        order = max(1, self.opts.copy_order or 1)
        slots = slot_idx.tolist()
        left = left_runs(self.ids.tolist(), [self.start + j for j in slots], order, self.cfg.mask_token_id)
        if logits is None or not self.opts.copy_chain or self.opts.temperature > 0:
            return copy_bias(left, *tables, self.cfg.vocab_size, self.opts, device=self.ids.device, far=self.copy_far)
        chain = [r > 0 and slots[r - 1] == j - 1 for r, j in enumerate(slots)]
        return chain_copy_bias(left, chain, logits, tables, self.opts, order, self.copy_far, restrict)

    def memory_runs(self, slot_idx: torch.Tensor) -> list[Run]:
        """These slots' committed left runs at the longest order any n-gram memory reads (the corpus
        table, the fill's own, the workspace's): one pass over the canvas for all of them."""
        order = max(t.max_order for t in (self.ngram, self.local, self.workspace) if t is not None)
        return left_runs(self.ids.tolist(), [self.start + j for j in slot_idx.tolist()], order, self.cfg.mask_token_id)

    def add_ngram(self, logits: torch.Tensor, slot_idx: torch.Tensor, left: list[Run] | None = None) -> None:
        """Adds the corpus n-gram memory to these slots' (M, V) logits in place, from the committed
        ids left of them (`left`: memory_runs(slot_idx), when the caller has them)."""
        table = self.ngram
        if table is None:  # the sampler asks only with the memory on
            raise ValueError("the corpus n-gram memory is off on this canvas")
        left = self.memory_runs(slot_idx) if left is None else left
        weight = self.opts.ngram or 0.0  # set whenever the memory is (engine/decode/levers.py)
        table.add_bias(logits, [run[-table.max_order :] for run in left], weight, ngram_skip(self.cfg))

    def add_local(self, logits: torch.Tensor, slot_idx: torch.Tensor, left: list[Run] | None = None) -> None:
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
            hit: Hit | None = None
            w = 0.0
            if local is not None:  # its weight is set whenever it is (attach_far), the workspace's too (levers)
                hit, w = local.next_probs(run), self.opts.local_ngram or 0.0
            if hit is None and ws is not None:
                hit, w = ws.next_probs(run), self.opts.workspace_ngram or 0.0
            if hit is not None:
                add_hit(logits, r, hit, w)

    def masked_slots(self) -> torch.Tensor:
        """(M,) indices of the still-masked slots, ascending; one nonzero per step, shared by the
        forward (which slots to run) and the commit."""
        steps, slots = self._masked_at
        if steps != self.steps or slots is None:
            slots = torch.nonzero(self.masked).flatten()
            self._masked_at = (self.steps, slots)
        return slots

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
