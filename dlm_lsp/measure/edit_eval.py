"""`dlm-lsp eval --kinds edit`: next-edit suggestions on held-out edit cases, through the server's own
path (dlm_lsp/fill/suggest.py), scored against what the release did next.

    a case (engine/train/edit_pairs.py's JSONL): the old file with its replayed edits applied is the
    document; the edits go into an EditHistory as the server records didChanges, each with the text
    it changed and spaced past the coalescing gap (one edit each)
        v
    suggest.edit_request at the case's cursor -> EngineService.run_now(EditJob) per approach
    (EDIT_APPROACHES), beside two baselines without a model: "propagate" (suggest.baseline) and
    "silent" (never suggests)
        v
    suggest.judge at gate 0 (every shown suggestion keeps its confidence, so a gate can be fitted
    from --samples), scored against the truth document: the document after the truth hunk (noise:
    the document itself)

Per category (repeat, other, noise; "edits" is repeat + other) and approach:
  shown        a suggestion was made
  exact        ... and the document after it equals the truth document, trailing whitespace aside
  closer       ... and it brought the region (the window, widened to the truth hunk) nearer the
  farther      truth's region in character edit distance than not suggesting / took it further
  covered      cases whose truth hunk lies inside the window: exact is impossible for the others
  rev shown    shown suggestions that take back the last replayed edit (nextedit.is_reversal): must be 0
  rev blocked  raw rewrites that would have (is_reversal before judge), silenced
  ws shown     shown suggestions that change whitespace only: must be 0
  silent       share of cases without a suggestion (for noise, the right answer); the reasons are
               judge's, "no history", or "refused" (the engine refused the job: a window over max_tokens)
  p50/p95 ms   wall time of the engine call (run_now; the baseline's own call for propagate)
The curve: exact of shown and shown share at confidence gates 0, 0.1, ..., 0.9, from the same rows
that --samples writes (one per case and approach).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from dlm_lsp.fill import edit_gate, suggest
from dlm_lsp.fill.documents import language_id_for_path
from dlm_lsp.fill.history import EditHistory
from dlm_lsp.fill.nextedit import apply_edits, is_reversal, is_whitespace_only, window_lines
from engine.api import DEFAULT_CONTEXT_TOKENS, EDIT_APPROACHES, EngineError

if TYPE_CHECKING:
    from dlm_lsp.fill.edit_gate import EditGate
    from engine.api import EditJob, Rewrite

SIDES = ("heldout_packages", "heldout")  # the held-out sides of an edit-case folder: never "train"
CATEGORIES = ("repeat", "other", "noise")
GROUPS = (*CATEGORIES, "edits")  # "edits": the cases with a truth (repeat + other)
BASELINES = ("propagate", "silent")
GATES = tuple(round(0.1 * i, 1) for i in range(10))
KEY = "case"  # the one document each case's EditHistory holds


class EditEngine(Protocol):
    """What the eval runs EditJobs on: EngineService, or a test's stand-in. One with
    `context_budget()` gets its context size used, as the server does; else 512."""

    def run_now(self, job: EditJob) -> Rewrite: ...


@dataclass
class EditCase:
    """One case, loaded: the document the user holds, and the one after the truth."""

    id: str
    category: str
    old: str  # the file before the replayed edits
    edits: list[tuple[int, str, str]]  # each at its offset in the text as it is at that moment
    document: str
    cursor: int
    truth: tuple[int, str, str] | None  # in the document's offsets; None for noise
    truth_document: str
    path: str = ""  # the file's path in its package (its language: its extension)


@dataclass
class Sample:
    """One case under one approach, scored (a --samples row)."""

    id: str
    approach: str
    category: str
    shown: bool
    exact: bool
    closer: bool
    farther: bool
    confidence: float
    latency_ms: float | None  # the engine call; None for "silent"
    silent: str | None  # judge's reason (or "no history", "baseline") when nothing is shown
    covered: bool  # the truth hunk lies inside the window (noise: always)
    reversal: bool  # the raw rewrite takes back the last edit (is_reversal before judge)
    whitespace: bool  # shown, and whitespace only
    kind: str | None = None  # the edit gate's kind of a baseline's suggestion (edit_gate.kind_of)
    features: list[float] | None = None  # and the features it read (edit_gate.FEATURES), for calibrate-edits


# ----------------------------------------------------------------------------- cases


def read_cases(folder: Path, max_cases: int | None = None, sides: Sequence[str] = SIDES) -> list[EditCase]:
    """The held-out cases under `folder` (SIDES' JSONL files, or those of `sides`), every one in file
    order, or a stable pick of `max_cases` with each category in its share (_pick)."""
    from engine.train.edit_pairs import load_case

    rows: list[dict] = []
    for side in sides:
        path = Path(folder) / f"{side}.jsonl"
        if path.is_file():
            rows += [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if max_cases is not None:
        rows = _pick(rows, max_cases)
    out = []
    for r in rows:
        document, truth_document = load_case(Path(folder), r)
        old = (Path(folder) / r["file"]).read_text(encoding="utf-8")
        truth = (int(r["truth"][0]), str(r["truth"][1]), str(r["truth"][2])) if r["truth"] else None
        edits = [(int(o), str(a), str(b)) for o, a, b in r["edits"]]
        out.append(
            EditCase(
                r["id"], r["category"], old, edits, document, r["cursor"], truth, truth_document, r.get("path", "")
            )
        )
    return out


def _pick(rows: list[dict], n: int) -> list[dict]:
    """A stable pick of n rows, each category in its share: a category's rows in the order of a hash
    of their id (the case files were capped in that order, so a plain hash order is not a fair
    sample), interleaved by their place in that order."""
    by_cat: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: hashlib.sha256(f"eval:{r['id']}".encode()).hexdigest()):
        by_cat.setdefault(r["category"], []).append(r)
    ranked = [((i + 0.5) / len(rs), cat, r) for cat, rs in by_cat.items() for i, r in enumerate(rs)]
    return [r for _, _, r in sorted(ranked, key=lambda t: (t[0], t[1]))[:n]]


def replay(old: str, edits: Sequence[tuple[int, str, str]], gap: float | None = None) -> tuple[str, EditHistory]:
    """(the document, its history) after recording each edit as the server records a didChange: the
    text it changed passed along for the line context, `now` spaced past the coalescing gap so each
    edit stays one edit."""
    history = EditHistory()
    step = 2 * (history.gap if gap is None else gap) + 1.0
    text, now = old, 0.0
    for off, o, n in edits:
        history.record(KEY, off, o, n, now, text=text)
        text = text[:off] + n + text[off + len(o) :]
        now += step
    return text, history


# ----------------------------------------------------------------------------- scoring


def normalize(text: str) -> str:
    """Text with each line's trailing whitespace (and the text's) stripped."""
    return "\n".join(ln.rstrip() for ln in text.split("\n")).rstrip()


def distance(a: str, b: str) -> int:
    """The character edit distance (Levenshtein) of a and b; the common head and tail are cut first,
    so two versions of a window that differ in a few places cost little."""
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    a, b = a[head:], b[head:]
    tail = 0
    while tail < min(len(a), len(b)) and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    a, b = a[: len(a) - tail], b[: len(b) - tail]
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def covers(case: EditCase, start: int, end: int) -> bool:
    """True when the case's truth hunk lies inside the window [start, end) (noise: always)."""
    if case.truth is None:
        return True
    off, old, _ = case.truth
    return start <= off and off + len(old) <= end


def score(
    case: EditCase,
    approach: str,
    req: suggest.EditRequest | None,
    new_window: str | None,
    confidence: float,
    latency_ms: float | None,
    silent: str | None = None,
    least: float = 0.0,
    base: suggest.Baseline | None = None,
) -> Sample:
    """The sample of one rewrite of the case's window (`req` None: no request, nothing shown, for
    the reason `silent`, else "baseline" for the silent baseline and "no history"), shown when its
    `confidence` reaches `least`; `base`: the propagation baseline's, whose kind and features it keeps."""
    if req is None or new_window is None:
        silent = silent or ("baseline" if approach == "silent" else "no history")
        cov = covers(case, *window_lines(case.document, case.cursor))
        return Sample(
            case.id, approach, case.category, False, False, False, False, 0.0, latency_ms, silent, cov, False, False
        )
    reversal = new_window != req.window and is_reversal(req.recent, req.window, new_window, req.start)
    found = suggest.judge(req, new_window, confidence, gate=least)
    shown = found.silent is None
    after = apply_edits(case.document, found.edits) if shown else case.document
    exact = shown and normalize(after) == normalize(case.truth_document)
    # the region: the window widened to the truth hunk, in the document; the suggestion's edits and
    # the truth both lie inside it, so the same span with their length changes is theirs
    lo, hi = req.start, req.end
    if case.truth is not None:
        lo, hi = min(lo, case.truth[0]), max(hi, case.truth[0] + len(case.truth[1]))
    truth = case.truth_document[lo : hi + len(case.truth_document) - len(case.document)]
    before = distance(case.document[lo:hi], truth)
    now = distance(after[lo : hi + len(after) - len(case.document)], truth)
    return Sample(
        case.id,
        approach,
        case.category,
        shown,
        exact,
        shown and now < before,
        shown and now > before,
        float(confidence),
        latency_ms,
        found.silent,
        covers(case, req.start, req.end),
        reversal,
        shown and is_whitespace_only(req.window, new_window),
        None if base is None else base.kind,
        None if base is None else base.features,
    )


def run_case(
    case: EditCase,
    approaches: Sequence[str],
    engine: EditEngine | None,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    budget_ms: float | None = None,
    gate: EditGate | None = None,
) -> list[Sample]:
    """The case under each approach (EDIT_APPROACHES need `engine`; BASELINES do not), "propagate"
    scored and gated by `gate` (None: every suggestion shown, at confidence 1)."""
    document, history = replay(case.old, case.edits)
    if document != case.document:
        raise ValueError(f"{case.id}: the replayed edits do not give the case's document")
    recent = history.recent(KEY, suggest.RECENT_EDITS)
    out = []
    for approach in approaches:
        if approach == "silent":
            out.append(score(case, approach, None, None, 0.0, None))
            continue
        deadline = time.monotonic() + budget_ms / 1000 if budget_ms else None
        req = suggest.edit_request(
            document, case.cursor, recent, approach, deadline, context_tokens, language=language_id_for_path(case.path)
        )
        if req is None:
            out.append(score(case, approach, None, None, 0.0, None))
            continue
        t0 = time.perf_counter()
        base = None
        if req.job is None:
            base = suggest.baseline(req, gate)
            new_window, confidence = base.window, base.confidence
        else:
            assert engine is not None, "an engine approach needs an engine"
            try:
                rewrite = engine.run_now(req.job)
            except EngineError:  # a window past max_tokens: the server answers null, and so does this
                latency = (time.perf_counter() - t0) * 1000
                out.append(score(case, approach, None, None, 0.0, latency, silent="refused"))
                continue
            new_window, confidence = rewrite.text, rewrite.confidence
        latency = (time.perf_counter() - t0) * 1000
        least = 0.0 if base is None else base.least
        out.append(score(case, approach, req, new_window, confidence, latency, least=least, base=base))
    return out


# ----------------------------------------------------------------------------- the report


def _share(n: int, d: int) -> float | None:
    return round(n / d, 4) if d else None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)


def _group(samples: Iterable[Sample], group: str) -> list[Sample]:
    return [s for s in samples if s.category == group or (group == "edits" and s.category != "noise")]


def metrics(samples: Sequence[Sample]) -> dict[str, Any]:
    """One group's measures (see the module)."""
    n = len(samples)
    shown = [s for s in samples if s.shown]
    covered = [s for s in samples if s.covered]
    lat = [s.latency_ms for s in samples if s.latency_ms is not None]
    return {
        "cases": n,
        "covered": len(covered),
        "shown": len(shown),
        "shown_share": _share(len(shown), n),
        "exact": sum(s.exact for s in samples),
        "exact_share": _share(sum(s.exact for s in samples), n),
        "exact_of_shown": _share(sum(s.exact for s in shown), len(shown)),
        "exact_of_covered": _share(sum(s.exact for s in covered), len(covered)),
        "closer": sum(s.closer for s in samples),
        "farther": sum(s.farther for s in samples),
        "reversals_shown": sum(s.reversal and s.shown for s in samples),
        "reversals_blocked": sum(s.reversal and not s.shown for s in samples),
        "whitespace_shown": sum(s.whitespace for s in samples),
        "silent_share": _share(n - len(shown), n),
        "silent_reasons": dict(sorted(Counter(s.silent for s in samples if s.silent).items())),
        "p50_ms": _pct(lat, 0.5),
        "p95_ms": _pct(lat, 0.95),
    }


def curve(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Exact of shown and shown share at each of GATES: a suggestion is shown at gate g when it was
    shown at 0 and its confidence is at least g."""
    out = []
    for g in GATES:
        shown = [s for s in samples if s.shown and s.confidence >= g]
        out.append(
            {
                "gate": g,
                "shown": len(shown),
                "shown_share": _share(len(shown), len(samples)),
                "exact_of_shown": _share(sum(s.exact for s in shown), len(shown)),
                "closer": sum(s.closer for s in shown),
                "farther": sum(s.farther for s in shown),
            }
        )
    return out


def read_samples(path: Path) -> list[Sample]:
    """The samples a --samples file holds (several runs' files together make one report)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [Sample(**json.loads(ln)) for ln in lines if ln.strip()]


def report(samples: Sequence[Sample], approaches: Sequence[str]) -> dict[str, Any]:
    """{approach: {group: metrics}} and {approach: {group: curve}} over the samples."""
    results: dict[str, Any] = {}
    curves: dict[str, Any] = {}
    for a in approaches:
        mine = [s for s in samples if s.approach == a]
        results[a] = {g: metrics(_group(mine, g)) for g in GROUPS}
        curves[a] = {g: curve(_group(mine, g)) for g in GROUPS}
    return {"results": results, "curves": curves}


def _cell(v: Any) -> str:
    return "-" if v is None else f"{v:.0%}" if isinstance(v, float) and v <= 1 else str(v)


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The results as one Markdown table: a row per group and approach."""
    cols = [
        ("cases", "cases"),
        ("covered", "covered"),
        ("shown", "shown"),
        ("shown_share", "shown %"),
        ("exact", "exact"),
        ("exact_of_shown", "exact/shown"),
        ("closer", "closer"),
        ("farther", "farther"),
        ("reversals_shown", "rev shown"),
        ("reversals_blocked", "rev blocked"),
        ("whitespace_shown", "ws shown"),
        ("silent_share", "silent"),
        ("p50_ms", "p50 ms"),
        ("p95_ms", "p95 ms"),
    ]
    lines = [
        "| group | approach | " + " | ".join(h for _, h in cols) + " |",
        "|---|---|" + "---:|" * len(cols),
    ]
    for g in GROUPS:
        for a, by_group in results.items():
            m = by_group[g]
            if not m["cases"]:
                continue
            cells = [f"{m[k]:.1f}" if k.endswith("_ms") and m[k] is not None else _cell(m[k]) for k, _ in cols]
            lines.append(f"| {g} | {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_table(curves: dict[str, dict[str, list[dict]]]) -> str:
    """The gate curves: per approach with a confidence (the engine's), exact of shown / shown share
    for each group at each gate."""
    lines = ["| approach | gate | " + " | ".join(f"{g} exact/shown (shown %)" for g in GROUPS) + " |"]
    lines.append("|---|---:|" + "---:|" * len(GROUPS))
    for a, by_group in curves.items():
        if a in BASELINES:
            continue
        for i, gate in enumerate(GATES):
            cells = []
            for g in GROUPS:
                p = by_group[g][i]
                cells.append(f"{_cell(p['exact_of_shown'])} ({_cell(p['shown_share'])})")
            lines.append(f"| {a} | {gate:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command


def add_edit_eval_args(p: argparse.ArgumentParser) -> None:
    """The `eval --kinds edit` options (beside the fill eval's --model, --device, --threads, --json,
    --samples and --budget-ms, which it shares)."""
    p.add_argument(
        "--edit-cases",
        default=".cache/edit-cases",
        metavar="DIR",
        help="--kinds edit: the edit cases of `dlm-lsp corpus --edits DIR` (its held-out sides)",
    )
    p.add_argument(
        "--approaches",
        default=",".join(EDIT_APPROACHES),
        help="--kinds edit: comma-separated engine approaches (the propagate and silent baselines always run)",
    )
    p.add_argument("--max-cases", type=int, default=None, metavar="N", help="--kinds edit: a stable pick of N cases")
    p.add_argument(
        "--edit-side",
        choices=("heldout", "train"),
        default="heldout",
        help="--kinds edit: the held-out cases (default), or the train side's, for the baselines only (no "
        "model: one may have trained on them); a second set of cases for rules designed on the first",
    )
    p.add_argument(
        "--edit-gate",
        choices=("shipped", "none"),
        default="shipped",
        help="--kinds edit: propagate's suggestions gated as the server gates them (dlm_lsp/fill/edit_gate.json), "
        "or every one shown at confidence 1 (the samples to fit a gate on: dlm-lsp calibrate-edits)",
    )


def parse_approaches(text: str) -> list[str]:
    """The engine approaches named in `text`, then the baselines; ValueError for an unknown name."""
    names = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in names if a not in EDIT_APPROACHES and a not in BASELINES]
    if bad:
        raise ValueError(f"unknown approach {', '.join(bad)}: choose from {', '.join((*EDIT_APPROACHES, *BASELINES))}")
    ordered = [a for a in EDIT_APPROACHES if a in names]
    return ordered + list(BASELINES)


def load_edit_engine(args: argparse.Namespace) -> EditEngine:
    """The engine on this thread: --model (else the default), --device, --threads (else the
    resident worker's count, service.cpu_threads())."""
    from engine.serve.service import EngineService, cpu_threads

    engine = EngineService(args.model, device=args.device, threads=args.threads or cpu_threads())
    engine.load()
    return engine


def evaluate_cases(
    cases: Sequence[EditCase],
    approaches: Sequence[str],
    engine: EditEngine | None,
    budget_ms: float | None = None,
    samples_out: IO[str] | None = None,
    progress: IO[str] | None = None,
    gate: EditGate | None = None,
) -> list[Sample]:
    """Every case under every approach, each sample written to `samples_out` as it comes."""
    tokens = getattr(engine, "context_budget", lambda: None)() or DEFAULT_CONTEXT_TOKENS
    out: list[Sample] = []
    t0 = time.monotonic()
    for i, case in enumerate(cases, 1):
        got = run_case(case, approaches, engine, tokens, budget_ms, gate)
        out += got
        if samples_out is not None:
            for s in got:
                samples_out.write(json.dumps(asdict(s)) + "\n")
            samples_out.flush()
        if progress is not None and (i % 20 == 0 or i == len(cases)):
            print(f"[eval edit] {i}/{len(cases)} cases, {time.monotonic() - t0:.0f} s", file=progress, flush=True)
    return out


def run_edit_eval(args: argparse.Namespace, engine: EditEngine | None = None) -> int:
    """`dlm-lsp eval --kinds edit`: prints the table and the gate curves, writes --json and --samples."""
    t_start = time.time()
    if [k.strip() for k in args.kinds.split(",") if k.strip()] != ["edit"]:
        print("eval: --kinds edit runs alone (the fill kinds are another eval)", file=sys.stderr)
        return 2
    try:
        approaches = parse_approaches(args.approaches)
    except ValueError as e:
        print(f"eval: {e}", file=sys.stderr)
        return 2
    folder = Path(args.edit_cases)
    sides = SIDES if getattr(args, "edit_side", "heldout") == "heldout" else ("train",)
    if sides == ("train",) and any(a in EDIT_APPROACHES for a in approaches):
        print(
            "eval: --edit-side train runs the baselines only (--approaches ''): a model may have trained on it",
            file=sys.stderr,
        )
        return 2
    if not any((folder / f"{side}.jsonl").is_file() for side in sides):
        which = "held-out" if sides == SIDES else "train-side"
        print(f"eval: no {which} edit cases in {folder} (build them with dlm-lsp corpus --edits DIR)", file=sys.stderr)
        return 2
    cases = read_cases(folder, args.max_cases, sides)
    counts = Counter(c.category for c in cases)
    print(f"[eval edit] {len(cases)} cases: {dict(sorted(counts.items()))}", file=sys.stderr, flush=True)
    if engine is None and any(a in EDIT_APPROACHES for a in approaches):
        engine = load_edit_engine(args)
    samples_out = open(args.samples, "w", encoding="utf-8") if args.samples else None
    try:
        gate = edit_gate.shipped() if getattr(args, "edit_gate", "shipped") == "shipped" else None
        samples = evaluate_cases(cases, approaches, engine, args.budget_ms, samples_out, sys.stderr, gate)
    finally:
        if samples_out is not None:
            samples_out.close()
    rep = report(samples, approaches)
    print(table(rep["results"]))
    if any(a not in BASELINES for a in approaches):
        print()
        print(curve_table(rep["curves"]))
    out = {
        **rep,
        "meta": {
            "edit_cases": str(folder),
            "sides": list(sides),
            "cases": len(cases),
            "counts": dict(sorted(counts.items())),
            "max_cases": args.max_cases,
            "approaches": approaches,
            "model": getattr(engine, "model_name", None) or args.model,
            "budget_ms": args.budget_ms,
            "gates": list(GATES),
            "edit_gate": None if gate is None else gate.to_json(),
            "elapsed_s": round(time.time() - t_start, 1),
        },
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
    return 0
