"""The GPU bench's service sections (dlm_lsp/measure/gpu_bench.py), jobs of text through EngineService
over the built model: per-keystroke reuse, 8 concurrent requests against one, cancel latency."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from dlm_lsp.measure.gpu_setup import Built, Setup
from engine.api import DecodeOptions, Fill, FillJob

if TYPE_CHECKING:
    from engine.serve.service import EngineService

CONCURRENT = (
    (8, 1.0),
    (64, 0.5),
    (16, 1.0),
    (48, 0.25),
    (24, 0.5),
    (40, 1.0),
    (32, 0.25),
    (56, 0.5),
)  # (slots, share of the context)


def document(functions: int = 160) -> str:
    """Deterministic Python text, some 40 tokens a function: the typed document of the service sections."""
    return "".join(
        f"def handler_{i}(request, limit={i % 7 + 1}):\n"
        f"    total = sum(item.size for item in request.items[:limit])\n"
        f"    return total * {i} + len(request.name)\n\n\n"
        for i in range(functions)
    )


def service(s: Setup, m: Built) -> EngineService:
    """An EngineService over the model already built (no checkpoint to load), running the fast mode."""
    from engine.decode.static import StaticStep
    from engine.serve.service import EngineService

    svc = EngineService(None, device=str(s.dev), threads=s.threads, warm_up=False, step_mode=s.fast)
    # load() reads a checkpoint folder; there is none, so the built model is handed over as load()
    # would leave it (the engine has no public call for an in-memory model)
    svc.model, svc.tok, svc.cfg, svc.device = m.model, s.tok, m.cfg, s.dev
    svc._static = StaticStep(m.model, s.fast, s.dev)
    return svc.start()


def _answer(fut: Future, timeout: float = 120.0) -> Fill:
    fill = fut.result(timeout=timeout)
    assert isinstance(fill, Fill)
    return fill


def _timed(svc: EngineService, job: FillJob) -> tuple[float, Fill]:
    t = time.monotonic()
    fill = _answer(svc.submit(job))
    return (time.monotonic() - t) * 1000, fill


def reuse_hits(s: Setup, m: Built) -> dict:
    """Typed keystrokes with a session key (reuse) against the same requests without one (full prefill)."""
    if m.cfg.attention != "bidirectional":
        return {"not_applicable": f"approximate reuse is for full attention; {m.name} is {m.cfg.attention}"}
    doc = document()
    cut, typed = len(doc) * 2 // 3, "result = compute(value, limit=42)"
    keys = 12 if not s.dry else 4
    opts = DecodeOptions(heal=False, selection="topk", steps=4)

    def job(k: int, session: str | None) -> FillJob:
        return FillJob(
            prefix=doc[:cut] + typed[:k],
            suffix=doc[cut : cut + 4000],
            max_tokens=16,
            options=opts,
            context_tokens=s.context,
            session=session,
        )

    svc = service(s, m)
    try:
        _timed(svc, job(0, None))  # warm-up: shapes, kernels, graphs
        keyed = [_timed(svc, job(k, f"gpu-bench-{m.name}")) for k in range(keys + 1)]
        plain = [_timed(svc, job(k, None)) for k in range(keys + 1)]
    finally:
        svc.close()
    first_ms, first = keyed[0]
    later = keyed[1:]
    hits = [(ms, f) for ms, f in later if f.reused_tokens > 0]
    hit_ms = statistics.median(ms for ms, _ in hits) if hits else None
    miss_ms = statistics.median(ms for ms, _ in plain[1:])
    return {
        "keystrokes": keys,
        "slots": 16,
        "first_ms": first_ms,
        "first_reused_tokens": first.reused_tokens,
        "first_forwarded_tokens": first.forwarded_tokens,
        "hits": len(hits),
        "hit_ms_p50": hit_ms,
        "hit_forwarded_tokens_p50": statistics.median(f.forwarded_tokens for _, f in hits) if hits else 0,
        "hit_reused_tokens_p50": statistics.median(f.reused_tokens for _, f in hits) if hits else 0,
        "no_session_ms_p50": miss_ms,
        "no_session_forwarded_tokens_p50": statistics.median(f.forwarded_tokens for _, f in plain[1:]),
        "speedup": miss_ms / hit_ms if hit_ms else None,
    }


def _mixed_jobs(s: Setup) -> list[FillJob]:
    """CONCURRENT's 8 jobs: slots and contexts mixed, cursors spread over the document."""
    doc = document()
    opts = DecodeOptions(heal=False, selection="topk", steps=8)
    jobs = []
    for i, (n, share) in enumerate(CONCURRENT):
        cut = len(doc) // 3 + i * 997
        ctx = max(int(s.context * share), n + 16)
        jobs.append(FillJob(doc[:cut], doc[cut : cut + 3000], max_tokens=n, options=opts, context_tokens=ctx))
    return jobs


def concurrency(s: Setup, m: Built) -> dict:
    """8 requests arriving one cached step apart against the same 8 one at a time: tokens/s."""
    doc = document()
    opts = DecodeOptions(heal=False, selection="topk", steps=8)
    largest = FillJob(
        doc[:9000], doc[9000:12000], max(n for n, _ in CONCURRENT), options=opts, context_tokens=s.context
    )
    svc = service(s, m)
    try:
        _timed(svc, largest)  # warm-up at the largest shape (the fixed-shape state, its graphs)
        t = time.monotonic()
        serial = [_timed(svc, j) for j in _mixed_jobs(s)]
        serial_s = time.monotonic() - t
    finally:
        svc.close()
    stagger = max(m.step_ms, 1.0) / 1000
    svc = service(s, m)
    try:
        for f in [svc.submit(j) for j in _mixed_jobs(s)]:  # warm-up: every batch slot at once (shapes, graphs)
            _answer(f)
        jobs = _mixed_jobs(s)
        t = time.monotonic()
        futs = []
        for i, j in enumerate(jobs):
            time.sleep(max(0.0, t + i * stagger - time.monotonic()))
            j.submitted_at = time.monotonic()
            futs.append(svc.submit(j))
        fills = [_answer(f) for f in futs]
        together_s = time.monotonic() - t
        batched = svc.stats["batched_steps"]
    finally:
        svc.close()
    one = sum(f.tokens for _, f in serial) / serial_s
    eight = sum(f.tokens for f in fills) / together_s
    return {
        "jobs": len(CONCURRENT),
        "slots": [n for n, _ in CONCURRENT],
        "context_tokens": [j.context_tokens for j in jobs],
        "stagger_ms": stagger * 1000,
        "one_at_a_time": {"s": serial_s, "tokens": sum(f.tokens for _, f in serial), "tokens_per_s": one},
        "concurrent": {
            "s": together_s,
            "tokens": sum(f.tokens for f in fills),
            "tokens_per_s": eight,
            "latency_ms_p50": statistics.median(f.latency_ms for f in fills),
            "batched_steps": batched,
        },
        "ratio": eight / one,
    }


def cancel(s: Setup, m: Built) -> dict:
    """A 64-step fill cancelled a few steps in: ms from cancel() to its answered future."""
    doc = document()
    cut = len(doc) // 2

    def job(steps: int) -> FillJob:
        opts = DecodeOptions(heal=False, selection="topk", steps=steps)
        return FillJob(doc[:cut], doc[cut : cut + 3000], max_tokens=64, options=opts, context_tokens=s.context)

    svc = service(s, m)
    try:
        _, probe = _timed(svc, job(8))  # warm-up, and what a step costs
        full_ms, step_ms = probe.ms_per_step[0], statistics.median(probe.ms_per_step[1:])
        rows = []
        for _ in range(3 if not s.dry else 2):
            j = job(64)
            fut = svc.submit(j)
            time.sleep((full_ms + 4 * step_ms) / 1000)
            t = time.monotonic()
            j.cancel()
            fill = _answer(fut)
            rows.append({"ms": (time.monotonic() - t) * 1000, "cancelled": fill.cancelled, "steps": fill.steps})
    finally:
        svc.close()
    ms = [r["ms"] for r in rows]
    return {
        "first_ms": full_ms,
        "step_ms": step_ms,
        "latency_ms_p50": statistics.median(ms),
        "latency_ms_max": max(ms),
        "runs": rows,
    }
