"""`dlm-lsp bench --incremental`: what a keystroke costs with and without context reuse, in one run.

A real file's text (--file, else the first held-out file long enough) is cut at a line start deep
enough to fill a --context canvas; the next --keys characters are taken out and typed back one at a
time at the cursor (the prefix grows by one character, the rest of the file stays as the suffix).
Each keystroke is a fill through EngineService.run_now with the server's decoding and --sizes' first
fill size, twice, side by side (the order alternating, so neither always runs on a warmer CPU):
  full   - no session key: the whole canvas is forwarded at the first step (full recompute)
  reuse  - the document's session key. Where the model's layout makes reuse exact (canvas "reorder",
           engine/decode/reorder.py) the engine takes the last keystroke's context K/V up to the first
           changed token and forwards only the rest, and both fills must be the same tokens. For a
           full-attention model (the bidirectional default, Dream, LLaDA) the reuse is approximate
           (engine/decode/reuse.py, DecodeOptions.reuse on for this run, with the --decode reuse_budget):
           unchanged tokens' K/V are reused with re-rotated keys, the changed tokens and the canvas
           are forwarded, and the staleness policy recomputes in full now and then; the share of
           keystrokes whose two fills are the same tokens is reported, not required.
and reports ms per keystroke (p50, p95), first-step ms, tokens forwarded per keystroke (Fill's
forwarded_tokens: every forward of the fill, context included), the keystrokes that reused context,
and how often the two fills were the same tokens. A layout with no reuse at all (block-causal,
DreamOn's growing middle) is measured with the full recompute only and reuse is reported as not
available; no reuse figure is made up for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.api import DecodeOptions, Fill, FillJob
from engine.decode.forward import build_canvas

if TYPE_CHECKING:
    from engine.model.config import ModelConfig
    from engine.serve.service import EngineService


def _p(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def reuse_kind(cfg: ModelConfig) -> str | None:
    """How the engine reuses a session's context for this model: "exact" (the reorder layout's
    SessionCache), "approximate" (full attention, engine/decode/reuse.py: EngineService._admit attaches it
    when DecodeOptions.reuse is on) or None (no reuse for this layout)."""
    if cfg.canvas == "reorder":
        return "exact"
    if cfg.attention == "bidirectional" and cfg.expand_token_id is None:
        return "approximate"
    return None


def typed_text(path: str | None, context: int, keys: int) -> tuple[str, str, str, str]:
    """(name, text before the cursor, the characters typed, the text after them). The cursor is at a
    line start past the file's middle, with at least 5 characters per context token before it."""
    name: str | None
    if path:
        name, text = path, Path(path).read_text(encoding="utf-8")
    else:
        from engine.train import corpus

        name, text = next(
            ((f.key, t) for f in corpus.heldout_files() if len(t := f.read() or "") >= context * 10 + keys), (None, "")
        )
        if name is None:
            raise SystemExit("bench: no held-out file is long enough for the context; lower --context or give --file")
    cut = text.find("\n", max(len(text) // 2, min(len(text), context * 5))) + 1
    if cut <= 0 or cut + keys > len(text):
        raise SystemExit(f"bench: {name} is too short to type {keys} characters past a {context}-token prefix")
    return name, text[:cut], text[cut : cut + keys], text[cut + keys :]


def _summary(fills: list[Fill], ms: list[float]) -> dict[str, float]:
    fwd = [f.forwarded_tokens for f in fills]
    return {
        "ms_p50": statistics.median(ms),
        "ms_p95": _p(ms, 0.95),
        "first_step_ms_p50": statistics.median(f.ms_per_step[0] for f in fills),
        "first_step_ms_p95": _p([f.ms_per_step[0] for f in fills], 0.95),
        "forwarded_tokens_mean": statistics.fmean(fwd),
        "forwarded_tokens_p95": _p(fwd, 0.95),
        "reused_tokens_mean": statistics.fmean(f.reused_tokens for f in fills),
        "reuse_share": sum(f.reused_tokens > 0 for f in fills) / len(fills),
        "steps_mean": statistics.fmean(f.steps for f in fills),
    }


def run_incremental(args: argparse.Namespace, svc: EngineService, opts: DecodeOptions, model_path: str | None) -> int:
    """Types the keystrokes, measures both ways, prints the table and writes --json."""

    cfg, tok, n = svc.cfg, svc.tok, int(str(args.sizes).split(",")[0])
    if cfg is None or tok is None:  # the caller has loaded the engine
        raise RuntimeError("bench: the engine is not loaded")
    keys = min(args.keys, 8) if args.quick else args.keys
    name, before, typed, after = typed_text(args.file, args.context, keys)
    kind = reuse_kind(cfg)
    exact, available = kind == "exact", kind is not None
    reuse_opts = dataclasses.replace(opts, reuse=True) if kind == "approximate" else opts
    p_ids, s_ids = tok.encode_batch([before, after])
    canvas_tokens = build_canvas(p_ids, s_ids, n, cfg, dataclasses.replace(opts, heal=False), args.context).ids.shape[0]

    def job(k: int, session: str | None) -> FillJob:
        return FillJob(
            prefix=before + typed[:k],
            suffix=after,
            max_tokens=n,
            context_tokens=args.context,
            options=reuse_opts if session else opts,
            session=session,
        )

    def timed(j: FillJob) -> tuple[Fill, float]:
        t0 = time.perf_counter()
        f = svc.run_now(j)
        return f, (time.perf_counter() - t0) * 1000

    modes = ("full", "reuse") if available else ("full",)
    session = f"bench-incremental-{time.time_ns()}"  # the typed document's key: no earlier request shares it
    for mode in modes:  # warm-up (allocator, kernels); the reuse run's keystroke 0 also starts the session
        timed(job(0, session if mode == "reuse" else None))
    runs: dict[str, tuple[list[Fill], list[float]]] = {m: ([], []) for m in modes}
    per_key = []
    for k in range(1, keys + 1):
        row: dict[str, Any] = {"k": k, "typed": typed[k - 1]}
        for mode in modes if k % 2 else modes[::-1]:
            seen = dict(svc._reuse.stats)
            f, ms = timed(job(k, session if mode == "reuse" else None))
            if mode == "reuse" and kind == "approximate":  # what the staleness policy decided
                row["reuse_outcome"] = next((o for o in svc._reuse.OUTCOMES if svc._reuse.stats[o] > seen[o]), None)
            runs[mode][0].append(f)
            runs[mode][1].append(ms)
            row.update(
                {
                    f"{mode}_ms": round(ms, 3),
                    f"{mode}_first_step_ms": round(f.ms_per_step[0], 3),
                    f"{mode}_forwarded": f.forwarded_tokens,
                    f"{mode}_reused": f.reused_tokens,
                    f"{mode}_steps": f.steps,
                }
            )
        per_key.append(row)
    full = _summary(*runs["full"])
    reuse = _summary(*runs["reuse"]) if available else None
    note = (
        None
        if available
        else (
            f"reuse is not available for this layout (attention {cfg.attention!r}, canvas {cfg.canvas!r}); only the full "
            "recompute was measured"
        )
    )
    fwd_full = sum(f.forwarded_tokens for f in runs["full"][0])
    same = [a.token_ids == b.token_ids for a, b in zip(runs["full"][0], runs["reuse"][0])] if available else None
    result = {
        "mode": "incremental",
        "reuse_available": available,
        "reuse_kind": kind,
        "reuse_note": note,
        "layout": {"attention": cfg.attention, "canvas": cfg.canvas},
        "file": name,
        "keystrokes": keys,
        "slots": n,
        "canvas_tokens": canvas_tokens,
        "full": full,
        "reuse": reuse,
        "speedup_p50": full["ms_p50"] / reuse["ms_p50"] if reuse is not None else None,
        "speedup_p95": full["ms_p95"] / reuse["ms_p95"] if reuse is not None else None,
        "first_step_speedup_p50": full["first_step_ms_p50"] / reuse["first_step_ms_p50"] if reuse is not None else None,
        "forwarded_ratio": sum(f.forwarded_tokens for f in runs["reuse"][0]) / fwd_full if available else None,
        # exact reuse must give the same tokens; approximate reuse reports how often it did
        "identical_fills": all(same) if exact and same is not None else None,
        "same_fills_share": sum(same) / len(same) if same is not None else None,
        "reuse_budget": reuse_opts.reuse_budget if kind == "approximate" else None,
        "full_recomputes": (
            sum(r.get("reuse_outcome", "reused") != "reused" for r in per_key) if kind == "approximate" else None
        ),
        "per_keystroke": per_key,
        "settings": {
            "model": model_path or "models/default",
            "context_tokens": args.context,
            "threads": args.threads,
            "device": args.device,
            "quick": bool(args.quick),
            "decode_options": dataclasses.asdict(opts),
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
    }
    _print(result, cfg, args)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


def _print(r: dict[str, Any], cfg: ModelConfig, args: argparse.Namespace) -> None:
    print(
        f"incremental: {r['keystrokes']} keystrokes typed one character at a time at the cursor of {r['file']} "
        f"(canvas {r['canvas_tokens']} tokens, {r['slots']} slots); layout attention={cfg.attention} "
        f"canvas={cfg.canvas}; {args.threads} thread(s)"
    )
    print(
        f"{'':20}{'ms p50':>9}{'ms p95':>9}{'first step p50':>16}{'tokens fwd mean':>17}{'p95':>7}"
        f"{'reused mean':>13}{'steps':>7}"
    )
    for mode in ("full", "reuse"):
        s = r[mode]
        label = "full recompute" if mode == "full" else f"{r['reuse_kind'] or ''} reuse".strip()
        if s is None:
            print(f"{label:20}{'n/a':>9}{'n/a':>9}{'n/a':>16}{'n/a':>17}{'n/a':>7}{'n/a':>13}{'n/a':>7}")
            continue
        print(
            f"{label:20}{s['ms_p50']:9.1f}{s['ms_p95']:9.1f}{s['first_step_ms_p50']:16.1f}"
            f"{s['forwarded_tokens_mean']:17.1f}{s['forwarded_tokens_p95']:7.0f}{s['reused_tokens_mean']:13.1f}"
            f"{s['steps_mean']:7.1f}"
        )
    if not r["reuse_available"]:
        print(r["reuse_note"])
        return
    tail = (
        f"identical fills: {r['identical_fills']}"
        if r["reuse_kind"] == "exact"
        else f"approximate (budget {r['reuse_budget']} changed tokens, {r['full_recomputes']} full recomputes): "
        f"the same fill on {r['same_fills_share']:.0%} of keystrokes"
    )
    print(
        f"{r['reuse_kind']} reuse {r['speedup_p50']:.2f}x faster per keystroke at p50 ({r['speedup_p95']:.2f}x at p95; "
        f"first step {r['first_step_speedup_p50']:.2f}x; target >= 3), forwarding {r['forwarded_ratio']:.3f} of the "
        f"rows; {r['reuse']['reuse_share']:.0%} of keystrokes reused context; {tail}"
    )
