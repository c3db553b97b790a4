"""`dlm-lsp bench --next-edit`: what a next edit costs beside a fill, measured side by side.

For each edit case (`dlm-lsp corpus --edits DIR`'s held-out cases, a stable pick; or with --quick a
few made here), at the case's cursor and in this order, on one engine (one thread by default, as
the issue's target is stated):
  fill      - the server's fill at that cursor (headless.fill_document: context, engine, post-processing)
  APPROACH  - each engine next-edit approach asked (default surprise+memory and window): the
              server's EditRequest for that cursor and its recent edits (suggest.edit_request), run
              on the engine (EngineService.run_now)
  propagate - the rule-based suggestion (no model), for scale
The first --warmup cases are run and not counted. Latencies are wall-clock per request on this
machine; what is comparable across machines is the ratio of each approach's p95 to the fill's p95
in the same run. Budgets are generous (--budget-ms, default 10 s), so a slow request is timed, not cut
short; the share that hit the deadline is reported anyway.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dlm_lsp.fill import edit_gate, suggest
from dlm_lsp.fill.documents import Document, language_id_for_path
from dlm_lsp.headless import fill_document
from dlm_lsp.measure.edit_eval import KEY as HISTORY_KEY
from dlm_lsp.measure.edit_eval import EditCase, read_cases, replay
from engine.api import EDIT_APPROACHES, EngineError

KEY = "file:///bench.py"
DEFAULT_APPROACHES = ("surprise+memory", "window")


def add_bench_edit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--next-edit",
        action="store_true",
        help="next edits beside fills at the same cursors, side by side (dlm_lsp/measure/bench_edit.py)",
    )
    p.add_argument(
        "--edit-cases", default=None, metavar="DIR", help="--next-edit: `dlm-lsp corpus --edits DIR`'s cases"
    )
    p.add_argument("--cases", type=int, default=60, help="--next-edit: cases timed (a stable pick; default 60)")
    p.add_argument("--warmup", type=int, default=3, help="--next-edit: cases run first and not counted")
    p.add_argument(
        "--edit-approaches",
        default=",".join(DEFAULT_APPROACHES),
        help=f"--next-edit: engine approaches, comma-separated (of {', '.join(EDIT_APPROACHES)})",
    )
    p.add_argument("--budget-ms", type=int, default=10_000, help="--next-edit: each request's deadline")


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-quantile of xs (nearest rank), None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(times: Sequence[float], cut: int) -> dict[str, Any]:
    return {
        "n": len(times),
        "p50_ms": _round(percentile(times, 0.5)),
        "p95_ms": _round(percentile(times, 0.95)),
        "mean_ms": _round(sum(times) / len(times)) if times else None,
        "deadline_hit": cut,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def time_case(engine: Any, case: EditCase, approaches: Sequence[str], budget_ms: int) -> dict[str, tuple[float, bool]]:
    """{kind: (ms, deadline hit)} for the fill, each approach and propagate at the case's cursor."""
    out: dict[str, tuple[float, bool]] = {}
    doc = Document(KEY, language_id_for_path(case.path or "x.py"), 1, case.document)
    t0 = time.perf_counter()
    fill = fill_document(engine, doc, case.cursor, budget_ms)
    out["fill"] = ((time.perf_counter() - t0) * 1000, fill.deadline_hit)
    _, history = replay(case.old, case.edits)
    recent = history.recent(HISTORY_KEY, suggest.RECENT_EDITS)
    language = language_id_for_path(case.path or "x.py")
    for approach in (*approaches, "propagate"):
        t0 = time.perf_counter()
        req = suggest.edit_request(
            case.document, case.cursor, recent, approach, time.monotonic() + budget_ms / 1000, language=language
        )
        hit = False
        if req is not None and req.job is not None:
            try:
                rewrite = engine.run_now(req.job)
                hit = rewrite.deadline_hit
            except EngineError:  # a window past max_tokens: the server's null, timed as it is
                pass
        elif req is not None:
            suggest.baseline(req, edit_gate.shipped())
        out[approach] = ((time.perf_counter() - t0) * 1000, hit)
    return out


def run_bench_edit(args: argparse.Namespace, model_path: str | None) -> int:
    from engine.serve.service import EngineService

    approaches = [a.strip() for a in str(args.edit_approaches).split(",") if a.strip()]
    bad = [a for a in approaches if a not in EDIT_APPROACHES]
    if bad:
        print(f"bench: unknown next-edit approach {', '.join(bad)} (of {', '.join(EDIT_APPROACHES)})", file=sys.stderr)
        return 2
    tmp = None
    try:
        if args.edit_cases:
            cases = read_cases(Path(args.edit_cases), args.cases + args.warmup)
            source = str(args.edit_cases)
        elif args.quick:
            tmp = tempfile.TemporaryDirectory(prefix="dlm-bench-edit-")
            cases, source = quick_cases(), "quick (made here)"
        else:
            print(
                "bench: --next-edit needs --edit-cases DIR (`dlm-lsp corpus --edits DIR`) or --quick", file=sys.stderr
            )
            return 2
        if len(cases) <= args.warmup:
            print(f"bench: {len(cases)} cases, not more than --warmup {args.warmup}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
        engine = EngineService(model_path, device=args.device, threads=args.threads)
        try:
            engine.load()
        except Exception as e:  # noqa: BLE001
            print(f"bench: {e}", file=sys.stderr)
            return 2
        kinds = ["fill", *approaches, "propagate"]
        times: dict[str, list[float]] = {k: [] for k in kinds}
        cut = dict.fromkeys(kinds, 0)
        t_start = time.monotonic()
        for i, case in enumerate(cases):
            got = time_case(engine, case, approaches, args.budget_ms)
            if i < args.warmup:
                continue
            for k, (ms, hit) in got.items():
                times[k].append(ms)
                cut[k] += hit
        engine.close()
        res = {k: summary(times[k], cut[k]) for k in kinds}
        fill_p95 = res["fill"]["p95_ms"]
        for k in kinds[1:]:
            p95 = res[k]["p95_ms"]
            res[k]["p95_vs_fill"] = round(p95 / fill_p95, 2) if p95 is not None and fill_p95 else None
        out = {
            "mode": "next-edit",
            "results": res,
            "settings": {
                "cases": len(cases) - args.warmup,
                "warmup": args.warmup,
                "source": source,
                "approaches": approaches,
                "budget_ms": args.budget_ms,
                "threads": args.threads,
                "device": args.device,
                "model": model_path or "default",
                "cpu": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "elapsed_s": round(time.monotonic() - t_start, 1),
            },
        }
        print(table(res))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(out, indent=1) + "\n")
        return 0
    finally:
        if tmp is not None:
            tmp.cleanup()


def table(res: dict[str, dict[str, Any]]) -> str:
    rows = ["| request | n | p50 ms | p95 ms | p95 / fill p95 | deadline hit |", "|---|--:|--:|--:|--:|--:|"]
    for k, r in res.items():
        ratio = r.get("p95_vs_fill")
        rows.append(
            f"| {k} | {r['n']} | {r['p50_ms']} | {r['p95_ms']} | {'-' if ratio is None else ratio} | {r['deadline_hit']} |"
        )
    return "\n".join(rows)


def quick_cases() -> list[EditCase]:
    """A few rename cases made here (no corpus): a parameter renamed at its definition, the cursor
    after it, the truth its next use."""
    out = []
    for i in range(6):
        name = f"value{i}"
        old = f"def scale{i}({name}, factor):\n    total = {name} * factor\n    return total + {name}\n"
        start = old.index(name)
        edits = [(start, name, "x")]
        document = old[:start] + "x" + old[start + len(name) :]
        use = document.index(name)
        truth = (use, name, "x")
        truth_document = document[:use] + "x" + document[use + len(name) :]
        out.append(EditCase(f"quick{i}", "repeat", old, edits, document, start + 1, truth, truth_document, "q.py"))
    return out
