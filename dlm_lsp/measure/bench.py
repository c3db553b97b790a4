"""`dlm-lsp bench`: the engine alone (no LSP), timed on real held-out code.

For fills of 16/32/64 slots at a 512-token canvas (prefix + slots + suffix, as the server builds it):
  full    - the diffusion loop recomputing the whole canvas every step (no context cache)
  cached  - the server's default decoding: one full forward, then steps over the slots only
  ar      - a causal model of the same size decoding the same number of tokens greedily with a KV
            cache (the trained twin if one exists, else random weights: timing only)
and a batch of 4 concurrent jobs through the service against the same 4 jobs one at a time.
`--incremental` measures per-keystroke cost instead: full recompute vs context reuse on typed
keystrokes (dlm_lsp/measure/bench_incremental.py); `--cold-start` a new server's way to its first
fill, with and without the engine started with the process (dlm_lsp/measure/bench_cold.py);
`--next-edit` next edits beside fills at the same cursors (dlm_lsp/measure/bench_edit.py).
Ratios are measured in the same run, side by side, because this machine's CPU is shared. Prints a
table; --json writes the numbers and the settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from engine.api import DecodeOptions, FillJob
from engine.paths import DEFAULT_AR_DIR

if TYPE_CHECKING:
    from engine.model.config import ModelConfig
    from engine.model.transformer import Transformer
    from engine.serve.service import EngineService
    from engine.tokenizer import TextTokenizer

Hole = tuple[str, str, str]  # (file key, prefix, suffix)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="diffusion checkpoint folder (default: models/default)")
    p.add_argument(
        "--ar-model",
        default=None,
        help="causal twin checkpoint (default: models/default-ar if present, else random weights of the same shape)",
    )
    p.add_argument("--context", type=int, default=512, help="canvas tokens: prefix + slots + suffix")
    p.add_argument("--sizes", default="16,32,64", help="fill sizes in mask slots, comma-separated")
    p.add_argument("--holes", type=int, default=4, help="different cursor positions (held-out files)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per hole and size")
    p.add_argument("--batch", type=int, default=4, help="concurrent jobs for the batching measurement")
    p.add_argument("--batch-reps", type=int, default=3)
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch CPU threads (default: half the cores; oversubscribing a shared CPU is ruinous)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--threshold", type=float, default=None, help="override DecodeOptions.threshold")
    p.add_argument("--selection", default=None, choices=["threshold", "topk"], help="override DecodeOptions.selection")
    p.add_argument("--steps", type=int, default=None, help="override DecodeOptions.steps")
    p.add_argument(
        "--decode", default=None, metavar="JSON", help="""override any DecodeOptions, e.g. '{"pad_left": false}'"""
    )
    p.add_argument("--quick", action="store_true", help="tiny model (unless --model), one rep: for tests")
    p.add_argument(
        "--incremental",
        action="store_true",
        help="per-keystroke mode: full recompute vs context reuse on typed keystrokes (dlm_lsp/measure/bench_incremental.py)",
    )
    p.add_argument(
        "--cold-start",
        action="store_true",
        help="time new `dlm-lsp serve` processes to their first fill, with and without DLM_LSP_PRESTART "
        "(in-process, shared cold, shared running; --reps rounds; dlm_lsp/measure/bench_cold.py)",
    )
    p.add_argument("--keys", type=int, default=32, help="--incremental: keystrokes typed (default 32; 8 with --quick)")
    p.add_argument("--file", default=None, help="--incremental: the file typed into (default: a held-out file)")
    p.add_argument("--json", dest="json_out", default=None, help="write results as JSON to this path")
    from dlm_lsp.measure.bench_edit import add_bench_edit_args

    add_bench_edit_args(p)


# ---------------------------------------------------------------- inputs


def _holes(count: int, min_chars: int) -> list[Hole]:
    """(file key, prefix, suffix) cut at a line start of held-out files, prefix long enough to fill
    the context. Deterministic: the same files and cuts on every machine with this Python."""
    from engine.train import corpus

    out = []
    for f in corpus.heldout_files():
        text = f.read()
        if not text or len(text) < 2 * min_chars:
            continue
        cut = text.find("\n", len(text) // 2) + 1 or len(text) // 2
        out.append((f.key, text[:cut], text[cut:]))
        if len(out) == count:
            break
    if not out:
        raise SystemExit("bench: no held-out file is long enough for the context; lower --context")
    while len(out) < count:  # a small corpus: reuse files at other cuts
        key, p, s = out[len(out) % len(out)]
        text = p + s
        cut = text.find("\n", len(text) * (len(out) + 2) // (count + 3)) + 1
        out.append((key, text[:cut], text[cut:]))
    return out


def _tiny_checkpoint(folder: Path) -> Path:
    """A tiny random-weight checkpoint with a real BPE tokenizer (quick runs without a model)."""
    from engine.model.config import ModelConfig
    from engine.model.transformer import Transformer
    from engine.tokenizer import BOS, EOS, MASK, PAD, train_bpe
    from engine.train import corpus
    from engine.weights.checkpoint import save_checkpoint

    texts = [t for t in (f.read() for f in corpus.heldout_files()[:8]) if t]
    tok = train_bpe(texts, 512)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        dim=32,
        n_layers=2,
        n_heads=2,
        ffn_dim=64,
        max_seq_len=1024,
        mask_token_id=cast(int, tok.token_id(MASK)),  # SPECIALS: in every tokenizer train_bpe builds
        pad_token_id=cast(int, tok.token_id(PAD)),
        eos_token_id=cast(int, tok.token_id(EOS)),
        bos_token_id=tok.token_id(BOS),
    ).validate()
    model = Transformer(cfg)
    model.init_weights(0)
    save_checkpoint(folder, model, tok)
    return folder


def _ar_model(args: argparse.Namespace, cfg: ModelConfig) -> tuple[Transformer, bool, str]:
    """(causal model, trained?) - the twin from disk, or random weights of the diffusion model's shape."""
    from engine.model.transformer import Transformer
    from engine.weights.load import load_checkpoint

    # the committed twin belongs to the default model (same tokenizer); another model gets a random twin
    default_twin = args.model is None and not args.quick and (DEFAULT_AR_DIR / "config.json").exists()
    path = args.ar_model or (DEFAULT_AR_DIR if default_twin else None)
    if path is not None:
        model, _, acfg = load_checkpoint(path, args.device)
        if acfg.attention != "causal":
            raise SystemExit(f"bench: {path} is not a causal model (attention={acfg.attention!r})")
        if acfg.vocab_size != cfg.vocab_size:
            raise SystemExit(
                f"bench: {path} has a vocabulary of {acfg.vocab_size}, the diffusion model {cfg.vocab_size}: "
                "the twin must share the model's tokenizer"
            )
        return model, True, str(path)
    model = Transformer(dataclasses.replace(cfg, attention="causal"))
    model.init_weights(0)
    return model.to(args.device).eval(), False, "random weights, same config, attention=causal (timing only)"


# ---------------------------------------------------------------- measurements


def _p(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _diffusion(
    svc: EngineService, holes: list[Hole], n: int, opts: DecodeOptions, context: int, reps: int
) -> dict[str, float]:
    ms, steps, fill_tokens, first, later = [], [], [], [], []
    for _, prefix, suffix in holes:
        for _ in range(reps):
            t0 = time.perf_counter()
            f = svc.run_now(FillJob(prefix=prefix, suffix=suffix, max_tokens=n, context_tokens=context, options=opts))
            ms.append((time.perf_counter() - t0) * 1000)
            steps.append(f.steps)
            fill_tokens.append(f.tokens)
            first.append(f.ms_per_step[0])
            later.extend(f.ms_per_step[1:])
    med = statistics.median(ms)
    st = statistics.mean(steps)
    return {
        "ms_p50": med,
        "ms_p90": _p(ms, 0.9),
        "steps": st,
        "tokens_per_step": n / st,
        "fill_tokens": statistics.mean(fill_tokens),
        "slots_per_s": n / med * 1000,
        "first_step_ms": statistics.median(first),
        "later_step_ms": statistics.median(later) if later else 0.0,
    }


def _autoregressive(
    ar: Transformer,
    tok: TextTokenizer,
    cfg: ModelConfig,
    holes: list[Hole],
    n: int,
    context: int,
    reps: int,
    opts: DecodeOptions,
) -> dict[str, float]:
    from engine.decode.autoregressive import fim_prompt, greedy_decode
    from engine.decode.forward import build_canvas

    ms, prefill, per_token = [], [], []
    for _, prefix, suffix in holes:
        p_ids, s_ids = tok.encode_batch([prefix, suffix])
        c = build_canvas(p_ids, s_ids, n, cfg, opts, context)  # the very context the diffusion fill sees
        ids = c.ids.tolist()
        prompt = fim_prompt(ids[: c.start], ids[c.start + n :], tok)
        for _ in range(reps):
            t0 = time.perf_counter()
            r = greedy_decode(ar, prompt, n)  # always n tokens: the twin may not know when to stop
            ms.append((time.perf_counter() - t0) * 1000)
            prefill.append(r.prefill_ms)
            per_token.extend(r.ms_per_token)
    med = statistics.median(ms)
    return {
        "ms_p50": med,
        "ms_p90": _p(ms, 0.9),
        "steps": n,
        "tokens_per_step": 1.0,
        "fill_tokens": n,
        "slots_per_s": n / med * 1000,
        "first_step_ms": statistics.median(prefill),
        "later_step_ms": statistics.median(per_token) if per_token else 0.0,
    }


def _batching(
    svc: EngineService, holes: list[Hole], n: int, context: int, batch: int, reps: int, opts: DecodeOptions
) -> dict[str, Any]:
    def jobs() -> list[FillJob]:
        return [
            FillJob(prefix=p, suffix=s, max_tokens=n, context_tokens=context, options=opts)
            for _, p, s in (holes * batch)[:batch]
        ]

    serial, together, tokens = [], [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        for j in jobs():
            svc.submit(j).result()
        serial.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fills = [f.result() for f in [svc.submit(j) for j in jobs()]]
        together.append(time.perf_counter() - t0)
        tokens = sum(f.tokens for f in fills)
    s, t = statistics.median(serial), statistics.median(together)
    return {
        "jobs": batch,
        "slots": n,
        "serial_ms": s * 1000,
        "batched_ms": t * 1000,
        "serial_slots_per_s": batch * n / s,
        "batched_slots_per_s": batch * n / t,
        "fill_tokens": tokens,
        "speedup": s / t,
        "max_batch_seen": svc.stats["max_batch_seen"],
    }


def _break_even(rows: list[dict[str, Any]], n: int, ratio: float) -> float | None:
    """Slots per step at which an n-slot fill is `ratio` times faster than AR decoding of n tokens,
    from the measured step costs: first + (n/k - 1) * cached = AR / ratio. None if unreachable."""
    d = next(r for r in rows if r["mode"] == "cached" and r["n"] == n)
    a = next(r for r in rows if r["mode"] == "ar" and r["n"] == n)
    budget = a["ms_p50"] / ratio - d["first_step_ms"]
    if budget <= 0 or d["later_step_ms"] <= 0:
        return None
    return n / (budget / d["later_step_ms"] + 1)


# ---------------------------------------------------------------- the command


def run_bench(args: argparse.Namespace) -> int:
    from engine.serve.service import EngineService

    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in str(args.sizes).split(",") if x.strip()]
    if args.quick:
        args.holes, args.reps, args.batch_reps = min(args.holes, 2), 1, 1
    tmp = None
    model_path = args.model
    if model_path is None and args.quick:
        tmp = tempfile.TemporaryDirectory(prefix="dlm-bench-")
        model_path = str(_tiny_checkpoint(Path(tmp.name) / "tiny"))
    if args.cold_start:
        from dlm_lsp.measure.bench_cold import run_cold_start

        try:
            return run_cold_start(args, model_path)
        finally:
            if tmp is not None:
                tmp.cleanup()
    if args.next_edit:
        from dlm_lsp.measure.bench_edit import run_bench_edit

        try:
            return run_bench_edit(args, model_path)
        finally:
            if tmp is not None:
                tmp.cleanup()
    from engine.api import decode_options

    try:
        opts = decode_options(args.decode)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    for k in ("threshold", "selection", "steps"):
        if getattr(args, k) is not None:
            opts = dataclasses.replace(opts, **{k: getattr(args, k)})
    served = opts  # the server's decoding (healing on): what --incremental's keystrokes use
    if '"heal"' not in (args.decode or ""):
        # canvases of exactly n slots, like the AR twin's n tokens (healing would add one to some)
        opts = dataclasses.replace(opts, heal=False)

    svc = EngineService(model_path, device=args.device, threads=args.threads, max_batch=max(8, args.batch))
    try:
        svc.load()
    except Exception as e:  # noqa: BLE001
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if args.incremental:
        from dlm_lsp.measure.bench_incremental import run_incremental

        try:
            return run_incremental(args, svc, served, model_path)
        finally:
            if tmp is not None:
                tmp.cleanup()
    model, tok, cfg = svc.model, svc.tok, svc.cfg
    if model is None or tok is None or cfg is None:  # load() has set them
        raise RuntimeError("bench: the engine is not loaded")
    ar, ar_trained, ar_desc = _ar_model(args, cfg)
    holes = _holes(args.holes, min_chars=args.context * 5)
    full_opts = dataclasses.replace(opts, cache=False)
    print(
        f"model {model_path or 'models/default'}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
        f"{cfg.n_layers} layers x {cfg.dim}, vocab {cfg.vocab_size}; {args.device}, {args.threads} thread(s)"
    )
    print(f"AR baseline: {ar_desc}")
    effective = min(args.context, cfg.context_len or cfg.max_seq_len, cfg.max_seq_len)
    print(
        f"holes: {', '.join(h[0] for h in holes)}; canvas {args.context} tokens"
        + (
            f" (cut to {effective}: the model was trained on windows of {effective})"
            if effective < args.context
            else ""
        )
        + f"; {args.reps} reps per hole"
    )
    print(
        f"decoding: selection={opts.selection} threshold={opts.threshold} confidence={opts.confidence} "
        f"pad_stop={opts.pad_stop} steps={opts.steps} refresh_every={opts.refresh_every} window={opts.window} "
        f"heal={opts.heal}"
    )

    # warm up every path once (allocator, oneDNN primitives, lazy imports)
    _diffusion(svc, holes[:1], sizes[0], opts, args.context, 1)
    _diffusion(svc, holes[:1], sizes[0], full_opts, args.context, 1)
    _autoregressive(ar, tok, cfg, holes[:1], sizes[0], args.context, 1, opts)

    rows: list[dict[str, Any]] = []
    for n in sizes:
        for mode, fn in (
            ("full", lambda n=n: _diffusion(svc, holes, n, full_opts, args.context, args.reps)),
            ("cached", lambda n=n: _diffusion(svc, holes, n, opts, args.context, args.reps)),
            ("ar", lambda n=n: _autoregressive(ar, tok, cfg, holes, n, args.context, args.reps, opts)),
        ):
            r = {"mode": mode, "n": n, **fn()}
            rows.append(r)
            print(
                f"  {mode:>6} n={n:<3} {r['ms_p50']:8.1f} ms p50  {r['steps']:6.1f} steps  "
                f"{r['tokens_per_step']:5.2f} slots/step  {r['slots_per_s']:7.0f} slots/s",
                flush=True,
            )

    svc.start()  # the worker thread: the model is already loaded, it only serves
    svc.wait_ready(60)
    bn = 32 if 32 in sizes else sizes[0]
    batch = _batching(svc, holes, bn, args.context, args.batch, args.batch_reps, opts)
    svc.close()

    def get(mode: str, n: int, key: str = "ms_p50") -> float:
        return next((r[key] for r in rows if r["mode"] == mode and r["n"] == n), float("nan"))

    big = 64 if 64 in sizes else sizes[-1]
    result = {
        "cached_speedup": get("full", big) / get("cached", big),
        "ar_speedup_64": get("ar", big) / get("cached", big),
        "fill32_p50_ms": get("cached", 32 if 32 in sizes else sizes[0]),
        "tokens_per_step": statistics.mean(get("cached", n, "tokens_per_step") for n in sizes),
        "tokens_per_step_by_size": {str(n): get("cached", n, "tokens_per_step") for n in sizes},
        "fill_tokens_by_size": {str(n): get("cached", n, "fill_tokens") for n in sizes},
        "batch4_speedup": batch["speedup"],
        "step_costs_ms": {  # medians at the largest size: what a fill costs, whatever tokens/step the model reaches
            "diffusion_first_full": get("cached", big, "first_step_ms"),
            "diffusion_cached": get("cached", big, "later_step_ms"),
            "diffusion_full_recompute": get("full", big, "later_step_ms"),
            "ar_prefill": get("ar", big, "first_step_ms"),
            "ar_per_token": get("ar", big, "later_step_ms"),
        },
        "break_even_tokens_per_step_3x_ar": _break_even(rows, big, 3.0),
        "rows": rows,
        "batch": batch,
        "settings": {
            "model": model_path or "models/default",
            "ar_model": ar_desc,
            "ar_trained": ar_trained,
            "context_tokens": args.context,
            "effective_context_tokens": effective,
            "sizes": sizes,
            "holes": [h[0] for h in holes],
            "reps": args.reps,
            "batch_jobs": args.batch,
            "batch_reps": args.batch_reps,
            "threads": args.threads,
            "device": args.device,
            "quick": bool(args.quick),
            "decode_options": dataclasses.asdict(opts),
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "kernels": importlib.import_module("kernels.slot_stats").backend(),
            "speedup_size": big,
        },
    }
    print()
    print(
        f"{'':>10}{'full ms':>10}{'cached ms':>11}{'AR ms':>9}{'steps':>8}{'slots/step':>12}{'fill tok':>10}"
        f"{'cache x':>9}{'vs AR x':>9}"
    )
    for n in sizes:
        print(
            f"{'n=' + str(n):>10}{get('full', n):10.1f}{get('cached', n):11.1f}{get('ar', n):9.1f}"
            f"{get('cached', n, 'steps'):8.1f}{get('cached', n, 'tokens_per_step'):12.2f}"
            f"{get('cached', n, 'fill_tokens'):10.1f}{get('full', n) / get('cached', n):9.2f}"
            f"{get('ar', n) / get('cached', n):9.2f}"
        )
    print(
        f"batch of {args.batch} x {bn} slots: one at a time {batch['serial_ms']:.0f} ms, together "
        f"{batch['batched_ms']:.0f} ms -> {batch['speedup']:.2f}x aggregate throughput"
    )
    print(
        f"cached_speedup {result['cached_speedup']:.2f}x (target >= 3)  ar_speedup_{big} {result['ar_speedup_64']:.2f}x "
        f"(target >= 3)  fill32_p50 {result['fill32_p50_ms']:.1f} ms (target <= 100)  batch4 "
        f"{result['batch4_speedup']:.2f}x (target >= 2)"
    )
    sc = result["step_costs_ms"]
    print(
        f"step costs (n={big}, medians): diffusion first full forward {sc['diffusion_first_full']:.1f} ms, cached step "
        f"{sc['diffusion_cached']:.1f} ms, full-recompute step {sc['diffusion_full_recompute']:.1f} ms; AR prefill "
        f"{sc['ar_prefill']:.1f} ms, AR token {sc['ar_per_token']:.1f} ms"
    )
    be = result["break_even_tokens_per_step_3x_ar"]
    print(
        f"3x faster than AR at n={big} needs >= {be:.1f} slots/step"
        if be is not None
        else f"3x faster than AR at n={big} is out of reach at any slots/step: the first full forward alone costs "
        "more than a third of AR decoding"
    )
    if not ar_trained:
        print("note: the AR baseline has random weights (no trained twin found): its timing is valid, its text is not")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    if tmp is not None:
        tmp.cleanup()
    return 0
