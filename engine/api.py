"""The engine's public types: a FillJob goes in, a Fill comes out. Text and token ids only; the
engine knows nothing of URIs, documents or editors."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

_ids = itertools.count(1)


class EngineError(RuntimeError):
    """A job the engine could not run (bad input, model failure); fails that job only."""


# the seeds torch's generators take (Generator.manual_seed): wider ones overflow inside torch
SEED_RANGE = (-(2**63), 2**64 - 1)

# The context a fill is given unless a client asks for another (FillJob.context_tokens): on the CPU a
# fill's first forward grows with its context, so it stays at the 512 tokens every model was served
# with before; on a CUDA device a forward is memory-bound, and 4096 tokens cost little more than 512.
CPU_CONTEXT_TOKENS = 512
CUDA_CONTEXT_TOKENS = 4096
# what a client assumes of an engine that reports no budget (an older daemon, another FIM API)
DEFAULT_CONTEXT_TOKENS = CPU_CONTEXT_TOKENS


def context_budget(device: str, max_seq_len: int, context_len: int | None = None) -> int:
    """The context tokens a fill gets by default on `device` ("cpu", "cuda", "cuda:N"): the model's
    trained window (`context_len`, else `max_seq_len`, never past `max_seq_len`), at most
    CUDA_CONTEXT_TOKENS on a CUDA device and CPU_CONTEXT_TOKENS on any other."""
    window = min(context_len or max_seq_len, max_seq_len)
    cap = CUDA_CONTEXT_TOKENS if str(device).startswith("cuda") else CPU_CONTEXT_TOKENS
    return max(1, min(window, cap))


def reported_context_tokens(info: dict | None) -> int:
    """The context budget an engine reports with its state (info["context_tokens"]), else
    DEFAULT_CONTEXT_TOKENS: an engine that reports none (an older daemon, a FIM API not dlm-lsp's)."""
    value = (info or {}).get("context_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else DEFAULT_CONTEXT_TOKENS


@dataclass
class DecodeOptions:
    """How the canvas is denoised. Defaults are what the server uses."""

    steps: int | None = None  # None: as many as the selection rule needs (threshold) / n // 2 (k-per-step)
    selection: str = "threshold"  # "threshold" (Fast-dLLM) or "topk" (LLaDA k-per-step schedule)
    confidence: str = "max_prob"  # "max_prob", "margin" (top1 - top2) or "neg_entropy"
    threshold: float = 0.9  # commit every slot whose confidence >= threshold, always at least one
    pad_stop: float = 0.9  # stop when every masked slot predicts padding with at least this probability
    temperature: float = 0.0  # 0: deterministic argmax
    cache: bool = True  # reuse prefix/suffix K/V between steps (DualCache)
    refresh_every: int = 0  # 0: never refresh the context K/V; k: a full forward every k steps (1: exact)
    freeze: bool = True  # cached steps skip slots committed two steps ago: their K/V join the context
    # LLaDA semi-autoregressive blocks: only masked slots in the leftmost block that still has masks may
    # be committed, and a committed padding/end slot ends the fill (every later slot becomes padding).
    # Without it a weak model commits the confident padding at the canvas's right end first and the
    # padding cascades leftwards into an empty fill (the early-EOS effect LLaDA reports). 0: off.
    block: int = 0
    # padding only from the left: a slot may be committed as padding/end only when it is the leftmost
    # masked slot, and that commit ends the fill (every later slot becomes padding, and text committed
    # further right is cut). The padding run at the canvas's right end then cannot grow leftwards
    # over slots the model has not decided.
    pad_left: bool = True
    # sliding semi-AR window: only the leftmost `window` masked slots are predicted and may be
    # committed, and a committed padding/end slot ends the fill. Cached steps then run only those slots;
    # the masked slots right of the window are attended to through the K/V of the last full forward
    # (Fast-dLLM DualCache keeps later blocks the same way). The final (deadline / step-budget) step
    # lifts the window and commits every mask. 0: off. 16: on 80 held-out holes per kind the same
    # quality as no window (8 lost some), with cheaper steps on 64-slot canvases.
    window: int = 16
    # token healing: the prefix's last tokens (the partial word at the cursor, a trailing space) are
    # removed and slot 0 re-types them, restricted to tokens whose text starts with them
    # (engine.tokenizer.TextTokenizer.heal); the fill's text leaves the re-typed part out.
    heal: bool = True
    # context copy boost, a cache LM over the canvas's own prefix and suffix (`copy_bias` in
    # engine/decode/sampler.py): a predicted slot's logits gain `copy_bigram` nats for each token that follows
    # its left neighbour's token somewhere in that context, and `copy_unigram` for every token that
    # occurs in it. 0: off. `copy_order` > 1 matches longer runs (prompt-lookup style): a token that
    # follows the same last k committed tokens (k <= copy_order) somewhere in the context gains
    # k x copy_bigram instead. None: the model's own setting (serving.json "decode", tuned on its
    # held-out eval; engine.weights.checkpoint.serving_defaults), else off (0, order 1).
    copy_bigram: float | None = None
    copy_unigram: float | None = None
    copy_order: int | None = None
    # the copy boost's far side: the job's `lookup` text (the document beyond the context window,
    # other open files) is searched the same way for the slot's last k committed tokens; a token that
    # follows them only there gains k x `copy_far` (one the near context already boosts gains nothing
    # more). 0: off; None: the model's setting, else off.
    copy_far: float | None = None
    # identifier-aware decoding (engine/bias/names.py): at the leftmost masked slot, a token that would
    # make the identifier under way one that is in none of the job's texts (prefix, suffix, lookup)
    # nor the keywords and builtins loses `names` nats. 0: off; None: the model's setting, else off.
    names: float | None = None
    # the corpus n-gram memory (engine/bias/ngram.py, the model folder's ngram.safetensors): a masked slot
    # whose committed left run ends in a stored context of the training corpus (the longest, 4-6
    # tokens) gains `ngram` x P(next | context) nats on the context's stored next tokens. 0: off;
    # None: the model's setting for the job's hole kind (serving.json "decode": "ngram", and
    # "ngram_kinds" per FillJob.kind), else off. Needs the table beside the weights.
    ngram: float | None = None
    # the fill's own n-gram (engine/bias/ngram.py, LocalNgram): the corpus memory's rule over the job's own
    # texts (its lookup and its context): a masked slot whose committed left run ends in a context of
    # 3-6 tokens followed at least twice there gains `local_ngram` x P(next | context) on its two most
    # frequent next tokens. 0: off; None: the model's setting for the job's hole kind (serving.json
    # "decode": "local_ngram", and "local_ngram_kinds" per FillJob.kind), else off.
    local_ngram: float | None = None
    # the workspace's n-gram (engine/bias/ngram.py, WorkspaceNgram): the same rule over every file of the
    # workspace less the filled one (FillJob.workspace), used where the fill's own n-gram has no
    # context. 0: off; None: the model's setting for the job's hole kind (serving.json "decode":
    # "workspace_ngram", "workspace_ngram_kinds"), else off. No effect on a job without a workspace.
    workspace_ngram: float | None = None
    # the bracket rule (engine/bias/names.py, NameBias.bracket_row): at the leftmost masked slot, with a
    # bracket open on the cursor's line, a token closing another kind loses `brackets` nats, and so
    # do the ends (padding, end of text, the line-break stop) while a bracket the fill opened is
    # open. 0: off; None: the model's setting, else off.
    brackets: float | None = None
    # a single-line fill ends at its line break: a slot predicting a whitespace-only token with a
    # line break in it (the tokenizer's `newline_ids`) is an end, like padding (it may be committed
    # only as the leftmost masked slot under pad_left, ends the fill, and "every masked slot
    # predicts an end" stops it). The server's text after the line break is cut anyway; this saves
    # the steps spent past it. None: on for the line and middle holes of dlm_lsp.fill.context
    # (to_fill_job), off for a bare job.
    stop_newline: bool | None = None
    # stop when unsure: in a threshold step where no slot reaches the threshold and the leftmost masked
    # slot's best token has a probability below `stop_below`, the fill ends at that slot (committed as
    # the end, as pad_left does; every later slot becomes padding, text committed further right is
    # cut) instead of forcing a guess there. A fill is then the text the model was sure of, and the
    # steps a guessed tail would take are never run. Needs pad_left; not while a healed slot is open;
    # never on a final (deadline / step-budget) step. 0: off; None: the model's setting for the job's
    # hole kind (serving.json "decode": "stop_below", and "stop_below_kinds" per FillJob.kind), else off.
    stop_below: float | None = None
    # draft chaining for the copy boost (prompt-lookup drafts in parallel): a predicted slot whose
    # left neighbour is a masked slot predicted in the same step takes its left run from that
    # neighbour's prediction (argmax, after its own boost), so a copied run can be boosted, and
    # committed, several slots per step. Temperature 0 only. None: the model's setting, else off.
    copy_chain: bool | None = None
    # approximate per-keystroke context reuse for full-attention models (engine/decode/reuse.py): with the
    # job's session key, the first forward reuses the last request's context K/V where its tokens are
    # unchanged (keys re-rotated where positions moved) and runs only the changed tokens + the canvas.
    # A full recompute once `reuse_budget` changed tokens have accumulated since the last full forward,
    # on a cursor jump, or when the model or these options change. On by default since session 8: on
    # 1,000 held-out line holes, each with its last 8 characters typed first, the fills scored the
    # same as recomputed ones (exact 0.068 vs 0.067, accepted 0.372 vs 0.371; docs/research/38-architecture-figures.md).
    # False: exact full recomputes (the causal reorder layout reuses exactly whatever this says:
    # engine/decode/reorder.py). Jobs without a session key never reuse.
    reuse: bool = True
    reuse_budget: int = 32
    seed: int = 0  # the sampling generator's seed, within SEED_RANGE
    # the confidence over each slot's k best tokens: the logits are cut to the top k before the
    # softmax, so the probability a slot is ranked (and sampled) by is renormalised over them. Dream's
    # `diffusion_generate` called as its README shows does this with k = 50 (transformers puts
    # top_k=50 in its generation config): top_k=50 is Dream's loop. Runs the full-row path (not the
    # fused slot statistics). None: off.
    top_k: int | None = None


@dataclass
class FillJob:
    """One fill: prefix + `max_tokens` mask slots + suffix. Deadline is time.monotonic() seconds."""

    prefix: str
    suffix: str = ""
    max_tokens: int = 32
    deadline: float | None = None
    options: DecodeOptions = field(default_factory=DecodeOptions)
    context_tokens: int = DEFAULT_CONTEXT_TOKENS  # prefix + slots + suffix are cut to fit this many tokens
    # a document's key: where the model's layout makes it exact (canvas "reorder"), the engine reuses
    # the K/V of the last request of this session up to the first changed context token; for a
    # full-attention model it reuses them approximately when DecodeOptions.reuse says so
    session: str | None = None
    # text from beyond the context window (the rest of the document, other open files): never
    # forwarded through the model, only searched by the copy boost (DecodeOptions.copy_far)
    lookup: str = ""
    # the hole's kind (dlm_lsp.fill.context: "line", "args", "middle", "block"), None for a bare job: picks
    # the model's per-kind decoding (serving.json "decode" "ngram_kinds", "stop_below_kinds", ...)
    kind: str | None = None
    # the workspace memory this fill reads (DecodeOptions.workspace_ngram): the name its files were
    # given to the engine under (EngineService.workspace_files), and the filled document's key there,
    # whose own counts are left out; None: none
    workspace: str | None = None
    document: str | None = None
    job_id: int = field(default_factory=lambda: next(_ids))
    submitted_at: float = field(default_factory=time.monotonic)
    cancel_event: threading.Event = field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()


@dataclass
class Fill:
    """What came out of a job. `cancelled` fills carry whatever text was committed so far."""

    text: str
    tokens: int  # non-padding tokens in the fill
    steps: int  # denoising steps (forward passes over the canvas) taken
    slots: int  # mask slots on the canvas
    cancelled: bool = False
    deadline_hit: bool = False  # the remaining masks were committed in one last step
    expired: bool = False  # its deadline had passed while it was queued: answered empty, never run
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    tokens_per_step: list[int] = field(default_factory=list)
    ms_per_step: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # geometric mean of the probabilities of the fill's tokens when they were committed (1.0: empty)
    confidence: float = 1.0
    # context rows whose K/V came from this session's last request (exact per-keystroke reuse; 0: none)
    reused_tokens: int = 0
    # rows run through the model, summed over every forward of the fill (context recompute included)
    forwarded_tokens: int = 0

    @property
    def latency_ms(self) -> float:
        return self.queue_ms + self.compute_ms

    @property
    def recompute_tokens(self) -> int:
        """Rows the fill would have forwarded without reuse: reuse skips rows of the first forward only."""
        return self.forwarded_tokens + self.reused_tokens


MODEL_DECODE_KEYS = (
    "copy_bigram",
    "copy_unigram",
    "copy_order",
    "copy_far",
    "copy_chain",
    "names",
    "brackets",
    "stop_below",
    "ngram",
    "local_ngram",
    "workspace_ngram",
)  # DecodeOptions a model's serving.json may set
KIND_DECODE_KEYS = (
    "ngram",
    "local_ngram",
    "workspace_ngram",
    "stop_below",
)  # ... and per hole kind, as "<key>_kinds": {kind: value}


def with_model_defaults(o: DecodeOptions, model_decode: dict, kind: str | None = None) -> DecodeOptions:
    """`o` with each model-tunable field left at None taken from the model's serving defaults
    (serving.json "decode"; for a job of hole kind `kind`, "ngram_kinds"[kind] before "ngram", and
    so for each of KIND_DECODE_KEYS), else its off value."""
    import dataclasses

    off = {
        "copy_bigram": 0.0,
        "copy_unigram": 0.0,
        "copy_order": 1,
        "copy_far": 0.0,
        "copy_chain": False,
        "names": 0.0,
        "brackets": 0.0,
        "stop_below": 0.0,
        "ngram": 0.0,
        "local_ngram": 0.0,
        "workspace_ngram": 0.0,
    }
    model_decode = dict(model_decode)
    for key in KIND_DECODE_KEYS:
        if kind is not None and kind in model_decode.get(f"{key}_kinds", {}):
            model_decode[key] = model_decode[f"{key}_kinds"][kind]
    fill = {k: model_decode.get(k, off[k]) for k in MODEL_DECODE_KEYS if getattr(o, k) is None}
    return dataclasses.replace(o, **fill) if fill else o


def decode_options(overrides: str | dict | None = None) -> DecodeOptions:
    """DecodeOptions with `overrides` applied: a dict, or a JSON object as a string (a CLI flag such
    as --decode '{"pad_left": false}'). Unknown keys raise ValueError naming them."""
    import dataclasses
    import json

    if not overrides:
        return DecodeOptions()
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as e:
            raise ValueError(f"decode options must be a JSON object: {e}") from None
    if not isinstance(overrides, dict):
        raise ValueError("decode options must be a JSON object")
    known = {f.name for f in dataclasses.fields(DecodeOptions)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"unknown decode options {bad}; known: {sorted(known)}")
    return dataclasses.replace(DecodeOptions(), **overrides)


# ---------------------------------------------------------------- next edits

# EditJob.approach: "+"-joined flags. "window": the whole window is masked and re-written, with padding
# room (engine/decode/rewrite.py, layout (a)); "surprise": the window stays on the canvas and one forward
# scores its tokens, the unlikely ones (and their neighbours) are masked and denoised (layout (b));
# "memory": the recent edits' token substitutions (engine/bias/edits.py) bias the masked slots toward
# their new tokens, and, without "window", the slots holding an old token are masked too. "window" and
# "surprise" exclude each other; "memory" goes with either or alone.
EDIT_APPROACHES = ("window", "window+memory", "surprise", "memory", "surprise+memory")


def edit_flags(approach: str) -> frozenset[str]:
    """EditJob.approach as its set of flags; ValueError for a combination not in EDIT_APPROACHES."""
    parts = approach.split("+") if isinstance(approach, str) else []
    flags = frozenset(parts)
    canonical = "+".join(f for f in ("window", "surprise", "memory") if f in flags)
    if len(flags) != len(parts) or canonical.count("+") != len(parts) - 1 or canonical not in EDIT_APPROACHES:
        raise ValueError(f"approach must be one of {EDIT_APPROACHES}, got {approach!r}")
    return flags


@dataclass
class EditJob:
    """One next edit: rewrite `window` (the document between `prefix` and `suffix`) after the recent
    `edits` ((old, new) texts, oldest first). Deadline is time.monotonic() seconds. The edits are not
    put on the canvas (no model here was trained on a rendering of them; the prefix and the window
    already show their result): they act through the edit memory ("memory" in `approach`)."""

    prefix: str
    window: str
    suffix: str = ""
    edits: list[tuple[str, str]] = field(default_factory=list)
    approach: str = "surprise+memory"  # EDIT_APPROACHES
    # the most slots the window's canvas may have: its tokens (a longer window is refused) and as much
    # of the padding room as fits
    max_tokens: int = 128
    deadline: float | None = None
    options: DecodeOptions = field(default_factory=DecodeOptions)
    context_tokens: int = DEFAULT_CONTEXT_TOKENS  # prefix + window slots + suffix are cut to fit this many
    # "surprise": a window token whose probability is below `surprise` is masked, with `spread` tokens
    # either side; each masked span (and the "window" layout's window) gets ceil(growth x its length)
    # more masked slots after it, so the rewrite may grow (padding in a slot drops it: it may shrink)
    surprise: float = 0.05
    spread: int = 1
    growth: float = 0.25
    memory: float = 4.0  # nats the edit memory adds to a substitution's new token ("memory")
    # how "surprise" scores: "visible" reads each window token's own probability with the window shown
    # (one forward; the logit shift respected); "masked" with the whole window masked (one forward: what
    # the model would write there from the context alone); "auto": visible, except on the causal
    # reordered layout, whose rows past the context are only trained as masks ("masked" there)
    score: str = "auto"
    job_id: int = field(default_factory=lambda: next(_ids))
    submitted_at: float = field(default_factory=time.monotonic)
    cancel_event: threading.Event = field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()


@dataclass
class Rewrite:
    """What came out of an EditJob: the window's new text. A cancelled or expired job, and one where
    nothing was surprising, gives the window back unchanged (changed == 0)."""

    text: str
    confidence: float = 1.0  # geometric mean of the committed (rewritten) tokens' probabilities (1.0: none)
    steps: int = 0  # denoising steps (the surprise scoring forward is not one: `scored`)
    cancelled: bool = False
    deadline_hit: bool = False  # the remaining masks were committed in one last step
    expired: bool = False  # its deadline had passed while it was queued: answered unchanged, never run
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    changed: int = 0  # window tokens changed: per differing run of a token diff, the longer side's length
    # the gate's inputs: the probabilities of the tokens the rewrite wrote into changed runs (a run that
    # only deletes counts the confidence of the slots it emptied)
    min_confidence: float = 1.0
    mean_confidence: float = 1.0
    remasked: int = 0  # window tokens masked on the canvas (every one for "window")
    memory_remasked: int = 0  # ... of them because an edit's old token stood there
    slots: int = 0  # masked slots on the canvas (padding room included)
    scored: bool = False  # a surprise scoring forward ran
    window_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # the new window's ids

    @property
    def latency_ms(self) -> float:
        return self.queue_ms + self.compute_ms
