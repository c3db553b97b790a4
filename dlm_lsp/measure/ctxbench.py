"""`dlm-lsp ctxbench`: the server's own per-keystroke work on a big file, without the engine.

Types into a document of N lines (held-out stdlib code, concatenated) at many cursor positions and
times what the server does around the model for each keystroke: the incremental didChange
(tree.edit + reparse), the cursor context (`context.build_request`) and post-processing
(`postprocess.finish` with the tree-sitter syntax check) of a fill. The fill is the text that
really follows the cursor, so the checks do the work a real fill needs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from dlm_lsp.fill import context, postprocess
from dlm_lsp.fill.documents import Document


def add_ctxbench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lines", type=int, default=5000, help="size of the document in lines")
    p.add_argument("--keystrokes", type=int, default=300, help="typed characters to time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, help="write results as JSON to this path")


def big_source(lines: int) -> str:
    """At least `lines` lines of real Python: held-out stdlib files, concatenated."""
    from engine.train.corpus import heldout_files

    texts = [t for t in (f.read() for f in heldout_files()) if t]
    out: list[str] = []
    while texts and len(out) < lines:  # the held-out files again if one pass is short (a 2 MB document)
        for t in texts:
            out.extend(t.splitlines())
            if len(out) >= lines:
                break
    return "\n".join(out[:lines]) + "\n"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_ctxbench(args: argparse.Namespace) -> int:
    text = big_source(args.lines)
    rng = random.Random(args.seed)
    doc = Document(uri="file:///bench.py", language_id="python", version=1, text=text)
    code_lines = [i for i, ln in enumerate(text.split("\n")) if len(ln.strip()) > 12]
    change_ms, ctx_ms, post_ms, cp_ms, total_ms = [], [], [], [], []
    typed = 0
    while typed < args.keystrokes:
        # a cursor in the middle of a code line; delete the rest of the line, then retype it
        row = rng.choice(code_lines)
        lines = doc.text.split("\n")
        line = lines[row]
        col = len(line) - len(line.lstrip()) + rng.randint(1, max(1, len(line.strip()) // 2))
        rest = line[col:]
        doc.apply_change((row, col), (row, len(line)), "")
        doc.version += 1
        doc.reparse(incremental=True)
        for k, ch in enumerate(rest[: min(10, args.keystrokes - typed)]):
            t0 = time.perf_counter()
            doc.apply_change((row, col + k), (row, col + k), ch)
            doc.version += 1
            doc.reparse(incremental=True)
            t1 = time.perf_counter()
            offset = doc.index().offset(row, col + k + 1)
            req = context.build_request(doc, offset)
            t2 = time.perf_counter()
            # as the server: no syntax check for a document too big for a tree (documents.py limits)
            check = (
                postprocess.SyntaxCheck(doc.text, doc.tree.copy(), doc.parser, offset) if doc.tree is not None else None
            )
            postprocess.finish(req, rest[k + 1 :], check)
            t3 = time.perf_counter()
            change_ms.append((t1 - t0) * 1000)
            ctx_ms.append((t2 - t1) * 1000)
            post_ms.append((t3 - t2) * 1000)
            cp_ms.append((t3 - t1) * 1000)
            total_ms.append((t3 - t0) * 1000)
        typed += min(10, len(rest), args.keystrokes - typed)
        # put the line back as it was
        cur = doc.text.split("\n")[row]
        doc.apply_change((row, 0), (row, len(cur)), line)
        doc.version += 1
        doc.reparse(incremental=True)
    res: dict[str, Any] = {
        "lines": doc.text.count("\n"),
        "bytes": len(doc.text.encode("utf-8", "surrogatepass")),
        "tree": doc.tree is not None,
        "keystrokes": typed,
    }
    series = (
        ("didchange", change_ms),
        ("context", ctx_ms),
        ("postprocess", post_ms),
        ("context_post", cp_ms),
        ("total", total_ms),
    )
    for name, xs in series:
        res[f"{name}_p50_ms"] = round(statistics.median(xs), 3)
        res[f"{name}_p95_ms"] = round(_pct(xs, 0.95), 3)
        res[f"{name}_max_ms"] = round(max(xs), 3)
    print(
        f"{res['lines']} lines, {res['bytes'] / 1e6:.1f} MB{'' if res['tree'] else ' (no syntax tree: over the size limit)'}, "
        f"{typed} keystrokes (didChange + reparse, context, post-processing):"
    )
    print(f"{'':12} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
    for name, _ in series:
        print(f"{name:12} {res[name + '_p50_ms']:8.2f} {res[name + '_p95_ms']:8.2f} {res[name + '_max_ms']:8.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return 0
