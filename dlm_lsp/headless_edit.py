"""One next edit without an editor: `dlm-lsp next-edit FILE:LINE:COL --before OLDFILE`.

The user's recent edits are the line diff OLDFILE -> FILE (difflib's opcodes, top to bottom, each
trimmed to the characters that change), recorded into an EditHistory as the server records
didChanges, one edit each (spaced past the coalescing gap). Then the server's own path:
suggest.edit_request at the cursor -> the engine's rewrite (or suggest.baseline for "propagate") ->
suggest.judge with the server's default gate. It prints the suggestion as a unified diff of FILE, or
"no suggestion (reason)"; --json prints {edits: [{start, end, newText}], confidence, latency_ms,
silent} with LSP positions (0-based lines, UTF-16 characters), as dlm/nextEdit answers.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dlm_lsp.fill import edit_gate, suggest
from dlm_lsp.fill.documents import Document, language_id_for_path
from dlm_lsp.fill.history import EditHistory
from dlm_lsp.fill.nextedit import apply_edits
from dlm_lsp.headless import PositionError, load_engine
from dlm_lsp.options import InitializationOptions
from engine.api import DEFAULT_CONTEXT_TOKENS, EngineError

if TYPE_CHECKING:
    from dlm_lsp.fill.edit_gate import EditGate
    from dlm_lsp.fill.positions import LineIndex
    from engine.api import EditJob, Rewrite

KEY = "file"  # the one document the command's EditHistory holds


class EditEngine(Protocol):
    """What the command runs its EditJob on: EngineService (load_engine), or a test's stand-in."""

    def run_now(self, job: EditJob) -> Rewrite: ...


class InputError(ValueError):
    """A file the command cannot read as text (missing, a folder, a FIFO, binary): one line, exit 2."""


def read_text(path: str) -> str:
    """The text of a regular UTF-8 file; InputError for anything else (a FIFO is never opened: it
    would block)."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"no such file: {path}")
    if not p.is_file():
        raise InputError(f"not a regular file: {path}")
    data = p.read_bytes()
    if b"\0" in data:
        raise InputError(f"{path} is a binary file, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def diff_edits(before: str, after: str) -> list[tuple[int, str, str]]:
    """The line diff before -> after as edits (offset in the text as it is at that moment, old text,
    new text), top to bottom, each trimmed to the characters that change."""
    ol, nl = before.splitlines(keepends=True), after.splitlines(keepends=True)
    starts = [0]
    for line in ol:
        starts.append(starts[-1] + len(line))
    out, shift = [], 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ol, nl, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        old, new = "".join(ol[i1:i2]), "".join(nl[j1:j2])
        head = 0
        while head < min(len(old), len(new)) and old[head] == new[head]:
            head += 1
        tail = 0
        while tail < min(len(old), len(new)) - head and old[-1 - tail] == new[-1 - tail]:
            tail += 1
        out.append((starts[i1] + shift + head, old[head : len(old) - tail], new[head : len(new) - tail]))
        shift += len(new) - len(old)
    return out


def history_of(before: str, after: str) -> EditHistory:
    """The EditHistory the server would hold after the user made the diff before -> after, one
    didChange per edit, each past the coalescing gap."""
    history = EditHistory()
    text, now = before, 0.0
    for off, old, new in diff_edits(before, after):
        history.record(KEY, off, old, new, now, text=text)
        text = text[:off] + new + text[off + len(old) :]
        now += 2 * history.gap + 1.0
    return history


def cursor_offset(idx: LineIndex, path: str, line: int, col: int) -> int:
    """The str offset of 1-based `line` and `col` (characters) in the indexed text; PositionError
    outside it."""
    if not 1 <= line <= len(idx.starts):
        raise PositionError(
            f"line {line} is outside {path} (lines 1 to {len(idx.starts)}); give PATH:LINE:COL, 1-based"
        )
    width = len(idx.line_text(line - 1))
    if not 1 <= col <= width + 1:
        raise PositionError(
            f"column {col} is outside line {line} of {path} (columns 1 to {width + 1}); give PATH:LINE:COL, 1-based"
        )
    return idx.starts[line - 1] + col - 1


def suggestion(
    text: str,
    offset: int,
    recent: list,
    approach: str,
    engine: EditEngine | None,
    gate: float | None,
    language: str | None = None,
    scorer: EditGate | None = None,
) -> suggest.Suggestion | None:
    """The server's dlm/nextEdit path for one cursor: the judged rewrite, or None without a recent
    edit. An engine that refuses the job (a window over max_tokens) is silence, as the server's null.
    `gate`: the user's least confidence (None: the edit gate's per kind); `scorer`: the edit gate
    (None: the shipped one)."""
    tokens = getattr(engine, "context_budget", lambda: None)() or DEFAULT_CONTEXT_TOKENS
    req = suggest.edit_request(text, offset, recent, approach, context_tokens=tokens, language=language)
    if req is None:
        return None
    if req.job is None:
        b = suggest.baseline(req, scorer or edit_gate.shipped())
        return suggest.judge(req, b.window, b.confidence, suggest.least_shown(gate, b.least))
    assert engine is not None, "an engine approach needs an engine"
    try:
        rewrite = engine.run_now(req.job)
    except EngineError as e:
        return suggest.Suggestion(silent=f"refused: {e}")
    return suggest.judge(req, rewrite.text, rewrite.confidence, suggest.least_shown(gate, 0.0))


def next_edit(
    path: str,
    line: int,
    col: int,
    before_path: str,
    approach: str | None = None,
    model: str | None = None,
    device: str = "auto",
    as_json: bool = False,
    engine: EditEngine | None = None,
    min_confidence: float | None = None,
) -> str:
    """What `dlm-lsp next-edit PATH:LINE:COL --before OLD` prints (1-based line and column);
    `min_confidence` as the server's nextEditMinConfidence (None: the edit gate's per kind)."""
    text, before = read_text(path), read_text(before_path)
    idx = Document(Path(path).resolve().as_uri(), language_id_for_path(path), 1, text).index()
    offset = cursor_offset(idx, path, line, col)
    options = InitializationOptions()
    approach = approach or options.next_edit_approach
    if approach not in suggest.APPROACHES:
        raise ValueError(f"next-edit approach must be one of {suggest.APPROACHES}, got {approach!r}")
    recent = history_of(before, text).recent(KEY, suggest.RECENT_EDITS)
    if recent and approach != "propagate":  # nothing to go on without an edit: no engine to load
        engine = engine or load_engine(model, device)
    t0 = time.monotonic()
    lang = language_id_for_path(path)
    gate = options.next_edit_min_confidence if min_confidence is None else min_confidence
    found = suggestion(text, offset, recent, approach, engine, gate, lang)
    latency = (time.monotonic() - t0) * 1000
    silent = "no recent edit" if found is None else found.silent
    edits = found.edits if found is not None and found.silent is None else []
    if as_json:
        return json.dumps(
            {
                "edits": [
                    {"start": _position(idx.position(a)), "end": _position(idx.position(b)), "newText": t}
                    for a, b, t in edits
                ],
                "confidence": round(found.confidence, 4) if found is not None else None,
                "latency_ms": round(latency, 1),
                "silent": silent,
            }
        )
    if not edits:
        return f"no suggestion ({silent})"
    return unified_diff(text, apply_edits(text, edits), path)


def _position(pos: tuple[int, int]) -> dict[str, int]:
    return {"line": pos[0], "character": pos[1]}


def unified_diff(old: str, new: str, path: str) -> str:
    """old -> new as a unified diff of `path` (a last line without its break marked as git marks it)."""
    out = []
    for ln in difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True), path, path):
        out.append(ln if ln.endswith(("\n", "\r")) else ln + "\n\\ No newline at end of file\n")
    return "".join(out).rstrip("\n")


def add_next_edit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("location", metavar="PATH:LINE:COL", help="the file as it is now, and the 1-based cursor")
    p.add_argument(
        "--before", required=True, metavar="OLDFILE", help="the file before the user's edits (the diff is the history)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (edits, confidence, latency_ms, silent)")
    p.add_argument(
        "--approach",
        default=None,
        choices=suggest.APPROACHES,
        help=f"the engine's layout, or propagate (no model) (default {suggest.DEFAULT_APPROACH})",
    )
    p.add_argument("--model", default=None, help="model folder or HF cache id (default: the embedded model)")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--min-confidence",
        type=float,
        default=None,
        metavar="P",
        help="show a suggestion whose confidence reaches P, for every kind, as the server's nextEditMinConfidence "
        "(default: the edit gate's per kind, dlm_lsp/fill/edit_gate.json; 0 shows all the rules make)",
    )


def run_next_edit(args: argparse.Namespace) -> int:
    if not args.verbose:  # a one-shot command: its output, not the engine's log lines
        logging.getLogger().setLevel(logging.CRITICAL)
    try:
        path, line_s, col_s = args.location.rsplit(":", 2)
        line, col = int(line_s), int(col_s)
    except ValueError:
        print(f"expected PATH:LINE:COL, got {args.location!r}", file=sys.stderr)
        return 2
    if args.min_confidence is not None and not 0.0 <= args.min_confidence <= 1.0:
        print("dlm-lsp next-edit: --min-confidence must be 0..1", file=sys.stderr)
        return 2
    try:
        out = next_edit(
            path, line, col, args.before, args.approach, args.model, args.device, args.json, None, args.min_confidence
        )
    except (InputError, PositionError) as e:
        print(f"dlm-lsp next-edit: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
