"""One fill without an editor: `dlm-lsp complete PATH:LINE:COL` and `dlm-lsp demo`.

Both go through the server's own path - documents.Document -> context.build_request ->
context.to_fill_job -> engine -> postprocess.finish with the same syntax check - so what they
print is what an editor would show for the same cursor (minus typing-through and scheduling).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dlm_lsp.fill import context, postprocess
from dlm_lsp.fill.documents import Document, language_id_for_path
from dlm_lsp.fill.gate import Calibrator, kind_gate
from dlm_lsp.options import InitializationOptions
from engine.api import DEFAULT_CONTEXT_TOKENS
from engine.paths import EXAMPLES_DIR

if TYPE_CHECKING:
    from engine.api import Fill, FillJob
    from engine.serve.service import EngineService


class FillEngine(Protocol):
    """What a one-shot fill runs on: EngineService (load_engine), or a test's stand-in. An engine with
    `serving` (the model's serving defaults), `workspace_files` (a workspace memory) and
    `context_budget()` (its context for the model and device; else 512) gets them used."""

    def run_now(self, job: FillJob) -> Fill: ...


DEMO_FILE = EXAMPLES_DIR / "tide_log.py"

# Holes for the demo: (text that ends right at the cursor, the original text cut out there).
DEMO_HOLES = [
    ("level = line.split()\n        when = datetime.strptime(", 'f"{day} {clock}", "%Y-%m-%d %H:%M"'),
    ("    def tidal_range(self) -> float:\n        ", "return self.high - self.low"),
    ("self.add(Reading.parse(line))\n            added += 1\n        return ", "added"),
    ('the extreme readings."""\n    if not ', "readings"),
    (
        "for a, b in zip(self.readings, self.readings[1:]):\n            ",
        "if b.when - a.when > longest:\n                found.append((a.when, b.when))",
    ),
    ("    levels = [r.level for r in readings]\n    mean = ", "sum(levels) / len(levels)"),
]


@dataclass
class HeadlessFill:
    """A fill computed outside the server, with what the JSON output reports."""

    text: str
    start: tuple[int, int]  # LSP (line, character), 0-based, UTF-16
    end: tuple[int, int]
    hole_kind: str
    latency_ms: float
    steps: int
    tokens: int
    raw: str
    dropped: str | None
    deadline_hit: bool
    confidence: float = 1.0  # the engine's confidence in its fill (Fill.confidence)

    def as_json(self) -> dict:
        return {
            "text": self.text,
            "range": {
                "start": {"line": self.start[0], "character": self.start[1]},
                "end": {"line": self.end[0], "character": self.end[1]},
            },
            "hole_kind": self.hole_kind,
            "latency_ms": round(self.latency_ms, 1),
            "steps": self.steps,
            "tokens": self.tokens,
            "raw": self.raw,
            "dropped": self.dropped,
            "deadline_hit": self.deadline_hit,
            "confidence": round(self.confidence, 4),
        }


def load_engine(model: str | None = None, device: str = "auto") -> EngineService:
    """Loads the engine on this thread (raises with a readable message if the model is missing).
    The one-shot commands fill on this thread, so it gets the resident worker's thread count
    (DLM_THREADS, else service.cpu_threads(): the cores less one): with torch's default of one
    thread per core, a busy core elsewhere (a build, a training job) made each step spin in OpenMP's
    barriers, and a ~100 ms fill took ~2 s and hit its deadline after one step (session 8)."""
    from engine.serve.service import EngineService, _env_threads, cpu_threads

    engine = EngineService(model=model, device=device, threads=_env_threads() or cpu_threads())
    engine.load()
    return engine


def fill_document(
    engine: FillEngine,
    doc: Document,
    offset: int,
    budget_ms: int = 300,
    max_fill_tokens: int = 64,
    filters: bool = True,
    min_confidence: float | None = None,
    neighbours: str = "",
    workspace: str | None = None,
) -> HeadlessFill:
    """Runs the server's context -> engine -> postprocess path for one cursor (`neighbours`: the
    cross-file far text, context.build_request's; `workspace`: the engine's workspace memory the
    job names, the document left out, as the server's jobs do)."""
    arrival = time.monotonic()
    # the server's context: the engine's budget for its model and device (EngineService.context_budget)
    tokens = getattr(engine, "context_budget", lambda: None)() or DEFAULT_CONTEXT_TOKENS
    req = context.build_request(doc, offset, max_fill_tokens, tokens, neighbours=neighbours)
    job = context.to_fill_job(req, arrival + budget_ms / 1000.0, tokens)
    if workspace is not None:
        from dlm_lsp.fill.documents import uri_key

        job.workspace, job.document = workspace, uri_key(doc.uri)
    fill = engine.run_now(job)
    check = (
        postprocess.SyntaxCheck(doc.text, doc.tree, doc.parser, offset) if doc.tree is not None and filters else None
    )
    gate = InitializationOptions().min_confidence if min_confidence is None else min_confidence
    if gate is None:  # the model's own gate for this hole kind, as the server applies it
        gate = kind_gate(getattr(engine, "serving", {}).get("min_confidence"), req.hole_kind)
    cal = Calibrator.from_json(getattr(engine, "serving", {}).get("calibrator"))
    fin = postprocess.finish(
        req, fill.text, check, filters=filters, confidence=fill.confidence, min_confidence=gate, calibrator=cal
    )
    latency = (time.monotonic() - arrival) * 1000
    idx = doc.index()
    start = idx.position(offset)
    end = idx.position(offset + fin.replace_len)
    return HeadlessFill(
        fin.text,
        start,
        end,
        req.hole_kind,
        latency,
        fill.steps,
        fill.tokens,
        fill.text,
        fin.dropped,
        fill.deadline_hit,
        fill.confidence,
    )


class PositionError(ValueError):
    """A cursor position outside the file (`dlm-lsp complete` says so in one line, exit code 2)."""


WORKSPACE_SPACE = "workspace"  # the name of the workspace memory complete() gives the engine


def workspace_snippets(folder: str, doc: Document, offset: int, engine: object = None) -> str:
    """The cross-file far text the server would give this cursor with `folder` as its workspace
    (dlm_lsp.fill.workspace, walked once here); with an `engine` that keeps a workspace memory
    (workspace_files), its files go there too, as the server's walk sends them."""
    from dlm_lsp.fill.retrieval import SNIPPET_CHARS
    from dlm_lsp.fill.workspace import WorkspaceIndex

    ws = WorkspaceIndex([Path(folder).resolve()], serves=lambda lang: lang == doc.language_id, yield_s=0)
    if engine is not None and hasattr(engine, "workspace_files"):
        ws.on_files = lambda changes: engine.workspace_files(WORKSPACE_SPACE, changes)
    ws.focus([doc.uri])  # a big workspace: the files nearest this one first, as the server's walk after a fill
    ws.scan()
    return ws.cross_file(doc.uri, doc.text, offset, doc.language_id, [], SNIPPET_CHARS) or ""


def complete(
    path: str,
    line: int,
    col: int,
    model: str | None = None,
    as_json: bool = False,
    budget_ms: int | None = None,
    device: str = "auto",
    engine: FillEngine | None = None,
    filters: bool = True,
    workspace: str | None = None,
) -> str:
    """Returns what `dlm-lsp complete PATH:LINE:COL` prints (1-based line and column, columns in
    characters): the fill, or with as_json one JSON object. `workspace`: a folder whose other files
    give the fill its cross-file context, as the server's workspace does."""
    text = Path(path).read_text(encoding="utf-8")
    doc = Document(Path(path).resolve().as_uri(), language_id_for_path(path), 1, text)
    idx = doc.index()
    lines = len(idx.starts)
    if not 1 <= line <= lines:
        raise PositionError(f"line {line} is outside {path} (lines 1 to {lines}); give PATH:LINE:COL, 1-based")
    width = len(idx.line_text(line - 1))
    if not 1 <= col <= width + 1:
        raise PositionError(
            f"column {col} is outside line {line} of {path} (columns 1 to {width + 1}); give PATH:LINE:COL, 1-based"
        )
    offset = idx.starts[line - 1] + col - 1
    engine = engine or load_engine(model, device)
    near = workspace_snippets(workspace, doc, offset, engine) if workspace else ""
    budget = budget_ms if budget_ms is not None else InitializationOptions().budget_ms
    res = fill_document(
        engine,
        doc,
        offset,
        budget,
        filters=filters,
        neighbours=near,
        workspace=WORKSPACE_SPACE if workspace and hasattr(engine, "workspace_files") else None,
    )
    if as_json:
        return json.dumps(res.as_json())
    return res.text


def _parse_location(loc: str) -> tuple[str, int, int]:
    path, line, col = loc.rsplit(":", 2)
    return path, int(line), int(col)


def add_complete_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("location", metavar="PATH:LINE:COL", help="file and 1-based line and column of the cursor")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (text, range, hole_kind, latency_ms, steps, tokens)"
    )
    p.add_argument("--model", default=None, help="model folder or HF cache id (default: the embedded model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--budget-ms", type=int, default=None, help="deadline for the fill (default 300)")
    p.add_argument("--raw", action="store_true", help="skip the post-processing filters")
    p.add_argument(
        "--workspace",
        default=None,
        metavar="DIR",
        help="cross-file context from this folder's other files, as the server's workspace (workspaceContext)",
    )


def run_complete(args: argparse.Namespace) -> int:
    try:
        path, line, col = _parse_location(args.location)
    except ValueError:
        print(f"expected PATH:LINE:COL, got {args.location!r}", file=sys.stderr)
        return 2
    if not Path(path).is_file():
        print(f"no such file: {path}", file=sys.stderr)
        return 2
    if args.workspace is not None and not Path(args.workspace).is_dir():
        print(f"no such folder: {args.workspace}", file=sys.stderr)
        return 2
    print(
        complete(
            path,
            line,
            col,
            model=args.model,
            as_json=args.json,
            budget_ms=args.budget_ms,
            device=args.device,
            filters=not args.raw,
            workspace=args.workspace,
        )
    )
    return 0


# ----------------------------------------------------------------------------- demo


def demo_holes(text: str) -> list[tuple[str, int, str]]:
    """(text with the hole cut out, cursor offset, the original text) for each demo hole found."""
    out = []
    for before, truth in DEMO_HOLES:
        i = text.find(before + truth)
        if i == -1:
            continue
        cursor = i + len(before)
        out.append((text[:cursor] + text[cursor + len(truth) :], cursor, truth))
    return out


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", default=str(DEMO_FILE), help="example file (default examples/tide_log.py)")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--budget-ms", type=int, default=None, help="deadline per fill (default 300)")


def run_demo(args: argparse.Namespace) -> int:
    path = Path(getattr(args, "file", None) or DEMO_FILE)
    text = path.read_text(encoding="utf-8")
    t0 = time.monotonic()
    engine = load_engine(getattr(args, "model", None), getattr(args, "device", "auto"))
    print(f"model {engine.model_name or 'default'} on {engine.device} loaded in {time.monotonic() - t0:.1f} s")
    budget = getattr(args, "budget_ms", None) or InitializationOptions().budget_ms
    holes = demo_holes(text)
    if not holes:
        print(f"{path.name} has none of the demo holes", file=sys.stderr)
        return 1
    lang = language_id_for_path(str(path))
    # one warm-up fill: the first forward pass pays one-time allocation costs
    fill_document(engine, Document("file:///warmup", lang, 1, holes[0][0]), holes[0][1], budget)
    for cut, cursor, truth in holes:
        doc = Document(path.resolve().as_uri(), lang, 1, cut)
        res = fill_document(engine, doc, cursor, budget)
        line, col = doc.index().row_col(cursor)
        print(
            f"\n{path.name}:{line + 1}:{col + 1}  {res.hole_kind:6}  {res.latency_ms:6.1f} ms  "
            f"{res.steps:2d} steps  {res.tokens:2d} tokens  confidence {res.confidence:.2f}"
            f"{'  (deadline)' if res.deadline_hit else ''}"
        )
        print(f"  line : {doc.index().line_text(line).strip()}")
        print(f"  truth: {_show(truth)}")
        print(f"  fill : {_show(res.text) if res.text else '(nothing shown: ' + (res.dropped or 'empty') + ')'}")
        if res.text != res.raw.rstrip():
            print(f"  raw  : {_show(res.raw)}")
    return 0


def _show(s: str, width: int = 100) -> str:
    s = s.replace("\n", "\u23ce ")
    return s if len(s) <= width else s[: width - 1] + "\u2026"
