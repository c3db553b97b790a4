"""A next-edit suggestion from a document, its cursor and its recent edits: the engine's EditJob for the
window around the cursor, and the engine's Rewrite judged into edits or silence.

One path for the server (dlm/nextEdit), the headless command and the eval: the window is computed
in one place (nextedit.window_lines), the rewrite becomes minimal replacements (nextedit.line_edits),
and the restraint rules hold for every caller:
  - nothing when the window comes back unchanged, or changed in whitespace only;
  - nothing that would take back the user's last edit (nextedit.is_reversal);
  - nothing below the confidence gate.
The propagation-only baseline ("propagate": the recent edits' substitutions carried to the next run of
the window's lines that hold them in the same role, no model; nextedit.propagation) goes through the
same judgement, so it is compared on equal terms; its confidence is the edit gate's probability
(edit_gate.EditGate) and its gate the edit gate's for the suggestion's kind, unless the user set one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dlm_lsp.fill.edit_gate import EditGate, features, kind_of
from dlm_lsp.fill.history import Edit
from dlm_lsp.fill.nextedit import (
    comments_of,
    is_reversal,
    is_whitespace_only,
    line_edits,
    noncode_spans,
    propagation,
    window_lines,
)
from engine.api import DEFAULT_CONTEXT_TOKENS, EDIT_APPROACHES, EditJob

# the approaches a client may ask for: the engine's layouts, and the baseline without a model
APPROACHES = (*EDIT_APPROACHES, "propagate")
DEFAULT_APPROACH = "propagate"  # what the server asks by default (options.next_edit_approach)
RECENT_EDITS = 3  # the edits the engine sees: the last few, as the eval's cases replay
PROPAGATE_BELOW = 12  # the lines below the cursor's that "propagate" looks through (no model to pay for)


@dataclass
class EditRequest:
    """The window around the cursor and what the engine is asked to do with it."""

    start: int  # the window's str offsets in the document
    end: int
    window: str
    recent: list[Edit]
    job: EditJob | None  # None for "propagate" (no engine)
    approach: str
    cursor: int | None = None  # the document offset asked at (None: the window's start)
    # for "propagate": the window's strings and comments (window offsets) and the comment openers
    noncode: list[tuple[int, int]] = field(default_factory=list)
    comments: tuple[str, ...] = ()


@dataclass
class Suggestion:
    """A judged rewrite: `edits` (document str offsets, non-overlapping, in order) when shown, else
    empty with `silent` saying why ("unchanged", "whitespace", "reversal", "unsure", "no edits")."""

    edits: list[tuple[int, int, str]] = field(default_factory=list)
    confidence: float = 0.0
    silent: str | None = None
    new_window: str | None = None


def edit_pairs(recent: Sequence[Edit]) -> list[tuple[str, str]]:
    """Each edit as (old line, new line) text: the line around it as it was and as it became, so the
    engine's token diff sees whole tokens (the edit memory's substitutions)."""
    return [(e.before + e.old_text + e.after, e.before + e.new_text + e.after) for e in recent]


def edit_request(
    text: str,
    offset: int,
    recent: Sequence[Edit],
    approach: str = DEFAULT_APPROACH,
    deadline: float | None = None,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    max_tokens: int = 512,  # room for a 12-line window of long lines (256 refused 6 of 728 eval windows)
    language: str | None = None,
) -> EditRequest | None:
    """The request for a suggestion at `offset` in a document of LSP `language`, or None when there
    is nothing to go on (no recent edit). ValueError for an approach not in APPROACHES."""
    if approach not in APPROACHES:
        raise ValueError(f"next-edit approach must be one of {APPROACHES}, got {approach!r}")
    if not recent:
        return None
    if approach == "propagate":  # no model: the window may reach as far as the occurrences do
        start, end = window_lines(text, offset, below=PROPAGATE_BELOW, max_lines=PROPAGATE_BELOW + 3)
    else:
        start, end = window_lines(text, offset)
    window = text[start:end]
    if approach != "propagate":
        job = EditJob(
            prefix=text[:start],
            window=window,
            suffix=text[end:],
            edits=edit_pairs(recent),
            approach=approach,
            max_tokens=max_tokens,
            deadline=deadline,
            context_tokens=context_tokens,
        )
        return EditRequest(start, end, window, list(recent), job, approach, offset)
    comments = comments_of(language)
    noncode = window_noncode(text, start, end, comments)
    return EditRequest(start, end, window, list(recent), None, approach, offset, noncode, comments)


def window_noncode(text: str, start: int, end: int, comments: tuple[str, ...]) -> list[tuple[int, int]]:
    """The strings and comments of text[start:end], in window offsets, read from the document's
    start (a string opened above the window is one inside it)."""
    out = []
    for a, b in noncode_spans(text[:end], comments):
        if b > start:
            out.append((max(a, start) - start, b - start))
    return out


@dataclass
class Baseline:
    """The propagation-only rewrite of a request's window (the window itself when nothing applies),
    its confidence (the edit gate's probability; 1.0 without a gate), the least confidence the gate
    shows for its kind (0.0 without), and the kind and features the gate read (None: nothing changed)."""

    window: str
    confidence: float = 1.0
    least: float = 0.0
    kind: str | None = None
    features: list[float] | None = None


def baseline(req: EditRequest, gate: EditGate | None = None) -> Baseline:
    """The propagation-only suggestion for the request, scored by `gate` (edit_gate.shipped() in
    the server) when one is given."""
    cursor = None if req.cursor is None else req.cursor - req.start
    found = propagation(req.recent, req.window, cursor, req.noncode, req.comments)
    if found is None:
        return Baseline(req.window)
    out = Baseline(found.window, kind=kind_of(found), features=features(found))
    if gate is not None:
        out.confidence, out.least = gate.probability(found), gate.gate(found)
    return out


def least_shown(user: float | None, least: float) -> float:
    """The gate a suggestion must reach: the user's nextEditMinConfidence when set (for every
    kind), else the edit gate's `least` for the suggestion's kind."""
    return least if user is None else user


def judge(req: EditRequest, new_window: str, confidence: float, gate: float = 0.0) -> Suggestion:
    """The suggestion a rewrite of the request's window makes, or silence and why."""
    if new_window == req.window:
        return Suggestion(confidence=confidence, silent="unchanged", new_window=new_window)
    if is_whitespace_only(req.window, new_window):
        return Suggestion(confidence=confidence, silent="whitespace", new_window=new_window)
    if is_reversal(req.recent, req.window, new_window, req.start):
        return Suggestion(confidence=confidence, silent="reversal", new_window=new_window)
    if confidence < gate:
        return Suggestion(confidence=confidence, silent="unsure", new_window=new_window)
    edits = [(req.start + a, req.start + b, t) for a, b, t in line_edits(req.window, new_window)]
    if not edits:
        return Suggestion(confidence=confidence, silent="no edits", new_window=new_window)
    return Suggestion(edits, confidence, None, new_window)
