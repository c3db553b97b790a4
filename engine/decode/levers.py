"""Every decoding lever a fill job asks for, wired into its canvas (the service's `_admit` calls `prepare`).

A job's prefix and suffix ids (the service tokenizes them, with its per-document texts) become a
canvas with, in this order:
  - token healing: the prefix's last tokens cut, slot 0 (and maybe 1) re-types them (engine/tokenizer.py);
  - the options: the job's over the model's tuned decoding (serving.json), the corpus n-gram off when
    the model has no table and only its tuned setting asked for it (a job asking for it fails);
  - the canvas itself (engine/decode/forward.py `build_canvas`);
  - the stop at a line break (single-line fills), the copy boost's far side and the fill's own n-gram
    (the job's lookup text), the workspace memory's view (less the filled document), the corpus n-gram;
  - identifier-aware decoding and the bracket rule (engine/bias/names.py);
  - the first step's cost estimate (deadlines), and reuse across keystrokes: exact for the reorder
    layout (SessionCache), approximate for full attention (engine/decode/reuse.py).

What the service owns and the levers read (its tokenizer, model config, n-gram table, memories,
caches, cost estimate) comes in an `Owned`, made afresh for each job.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.api import DecodeOptions, EngineError, FillJob, with_model_defaults
from engine.bias import names, ngram
from engine.decode import reuse
from engine.decode.canvas import Canvas
from engine.decode.forward import build_canvas
from engine.decode.reorder import ReorderCanvas, SessionCache

if TYPE_CHECKING:
    import torch

    from engine.model.config import ModelConfig
    from engine.tokenizer import Healing, TextTokenizer

LOOKUP_CHARS = 64 * 1024  # FillJob.lookup beyond this is cut (its end kept) before it is tokenized


@dataclass
class Owned:
    """What the service owns that a job's levers read."""

    tok: TextTokenizer
    cfg: ModelConfig
    device: torch.device
    decode_defaults: dict  # the model's tuned decoding (serving.json's "decode")
    ngram_table: ngram.NgramTable | None  # the model's ngram.safetensors, None when it has none
    workspaces: dict[str, ngram.WorkspaceNgram]  # the workspace memories, by FillJob.workspace
    corpus_names: names.NameSet  # the model's names.txt
    sessions: SessionCache  # per document: the last context's K/V (reorder layout only)
    reuse_cache: reuse.ReuseCache  # per document, full attention: DecodeOptions.reuse
    full_ms_per_token: float  # the running estimate of a full forward's cost per row


def prepare(job: FillJob, p_ids: list[int], s_ids: list[int], owned: Owned) -> tuple[Canvas, str]:
    """The job's canvas with every lever it asks for attached, and the text its healed slots re-type
    ("" without healing); EngineError for a job asking for what the model lacks."""
    heal = healing(job, p_ids, owned)
    if heal:  # slot 0 (and maybe 1) re-types the prefix's last k tokens and may extend them
        p_ids = p_ids[: -heal.k]
    opts = options(job, owned)
    canvas = build_canvas(
        p_ids,
        s_ids,
        job.max_tokens + (1 if heal else 0),
        owned.cfg,
        opts,
        job.context_tokens,
        owned.device,
        heal=heal.first if heal else None,
        heal_then=heal.then if heal else None,
    )
    attach_biases(canvas, job, opts, p_ids, owned)
    canvas.full_ms = owned.full_ms_per_token * canvas.ids.shape[0]
    attach_session(canvas, job, owned)
    return canvas, heal.text if heal else ""


def healing(job: FillJob, p_ids: list[int], owned: Owned) -> Healing | None:
    """How the fill re-types the prefix's tail (token healing), or None when off or nothing to heal."""
    # DreamOn's middle grows and shrinks: no slot stays slot 0 to re-type a healed tail
    return owned.tok.heal(p_ids) if job.options.heal and owned.cfg.expand_token_id is None else None


def options(job: FillJob, owned: Owned) -> DecodeOptions:
    """The job's decoding options over the model's tuned ones, the corpus n-gram off where the model
    has no table (EngineError when the job itself asked for it)."""
    opts = with_model_defaults(job.options, owned.decode_defaults, job.kind)  # the model's tuned decoding
    if opts.ngram and owned.ngram_table is None:
        if job.options.ngram:
            raise EngineError(
                f"ngram {job.options.ngram}: this model has no n-gram table "
                f"({ngram.NGRAM_FILE}; `dlm-lsp ngram` builds one)"
            )
        opts = dataclasses.replace(opts, ngram=0.0)  # the model's setting, its table missing: off
    return opts


def attach_biases(canvas: Canvas, job: FillJob, opts: DecodeOptions, p_ids: list[int], owned: Owned) -> None:
    """Attaches the stop at a line break, the far text, the n-gram memories and the names/bracket bias."""
    tok, cfg = owned.tok, owned.cfg
    if opts.stop_newline and cfg.expand_token_id is None and cfg.family != "wedlm":
        canvas.stop_ids = tok.newline_ids()  # a single-line fill ends at its line break
    if (job.lookup and canvas.copy is not None and opts.copy_far) or opts.local_ngram:
        # the copy boost's far side; the fill's own n-gram (its lookup and its context)
        canvas.attach_far(tok.encode_lines(job.lookup[-LOOKUP_CHARS:]) if job.lookup else None)
    if opts.workspace_ngram and job.workspace is not None:  # the workspace's n-gram, less the filled file
        mem = owned.workspaces.get(job.workspace)
        canvas.workspace = mem.view(exclude=job.document) if mem is not None else None
    if opts.ngram:  # the corpus n-gram memory
        canvas.ngram = owned.ngram_table
    if opts.names or opts.brackets:  # identifier-aware decoding (the names of the job's texts), the bracket rule
        known = names.known_names(job.prefix, job.suffix, job.lookup) if opts.names else names.NameSet(())
        canvas.names = names.NameBias(
            names.vocab_for(tok),
            [known, owned.corpus_names],
            opts.names or 0.0,
            tok.decode(p_ids[-48:]),
            tok.decode,
            brackets=opts.brackets or 0.0,
            ends=(cfg.pad_token_id, *cfg.end_ids) + tuple(canvas.stop_ids or ()),
        )


def attach_session(canvas: Canvas, job: FillJob, owned: Owned) -> None:
    """Attaches reuse across a document's keystrokes: exact (reorder layout) or approximate (full attention)."""
    if job.session is not None and isinstance(canvas, ReorderCanvas):  # exact reuse across keystrokes
        canvas.session, canvas.session_key = owned.sessions, job.session
    elif job.session is not None and reuse.applies(canvas):  # approximate reuse (full attention)
        canvas.reuse = (owned.reuse_cache, job.session)
