"""`dlm-lsp bench --gpu`: the engine's step costs on one lent GPU in five minutes, nothing downloaded.

Three real shapes with random weights, built on the meta device and materialised in bf16 directly on
the GPU (never in host memory), their ModelConfig read from config.json keys through the families'
own adapters (engine/families): Dream-7B (Qwen2.5-7B shapes, logits shifted, GQA 28/4), LLaDA-8B
(full multi-head K/V) and SDAR-8B (Qwen3-8B shapes, block-causal attention in blocks of 4).

  bandwidth     a large device-to-device copy, GB/s (bytes read + written); every step time is
                also given as a multiple of its floor, the bytes one step must read (the weights
                it multiplies by, the head included and the embedding table left out, plus the
                K/V of the context) over that bandwidth
  cached_step   ms per cached step at the full context (2048 tokens) for 16, 32 and 48 run rows, by
                step mode: `loop` (the eager loop: forward_cached + sampler.commit), `eager` (the
                fixed-shape step of engine/decode/static.py run as it is) and `graph` (the same step
                replayed as a CUDA graph). A top-k schedule of one slot a step with no window and no
                freezing keeps every slot running, so each step runs the same rows; a fresh canvas
                per repetition, its first (full) forward and first cached step untimed
  profile       torch.profiler over a few steps at 32 rows: host kernel launches, CUDA graph
                launches, device kernels, host syncs and device-to-host copies per step, and the
                SDPA backend the attention ran (flash / efficient / cudnn / math, from the aten op
                dispatched and the kernels' names)
  forced        end-to-end fills of 32 and 64 slots under forced schedules of 4, 8 and 16 steps
                (selection "topk": random weights would otherwise commit one slot a step), the
                eager loop against the fast mode
  reuse         typed keystrokes through EngineService with a session key (the document one
                character longer each time; the first request a miss with a full prefill) against
                the same requests without one (full attention only: engine/decode/reuse.py)
  concurrency   8 requests of mixed lengths arriving a cached step apart against the same 8 one at a
                time: aggregate tokens/s
  cancel        a 64-step fill cancelled after a few steps: ms until its future is answered

`--dry-run` runs the same code on the CPU with tiny shapes of the same families in fp32 (2 layers,
dim 64, vocabulary 8192, context 128), where the `graph` mode is skipped (CUDA graphs need CUDA; the
fast mode there is `eager`): tests/test_gpu_bench.py runs it, so the GPU bench cannot rot between
leases. Prints a table naming the card and torch, writes JSON (after every section, so a run stopped by
its time limit keeps what it measured), and skips what would pass `--budget-s`. Here: the command and
its table; the shapes, the build and the clock in gpu_setup.py; the sections in gpu_steps.py (token
ids straight into the sampler) and gpu_service.py (text through EngineService). Every other `bench`
is dlm_lsp/measure/bench.py, whose arguments this command's parser extends.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dlm_lsp.measure.gpu_service import cancel, concurrency, reuse_hits
from dlm_lsp.measure.gpu_setup import MODELS, Built, Setup, copy_bandwidth, model_config, random_model, step_bytes, sync
from dlm_lsp.measure.gpu_steps import cached_steps, forced, profile


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """`dlm-lsp bench`'s arguments (dlm_lsp/measure/bench.py) plus --gpu and --dry-run."""
    from dlm_lsp.measure import bench

    bench.add_bench_args(p)
    p.set_defaults(context=None)  # 512 for the CPU bench, 2048 for --gpu, 128 for --dry-run
    g = p.add_argument_group("--gpu: random weights of real shapes on one GPU (issue 37)")
    g.add_argument("--gpu", action="store_true", help="the GPU bench: Dream-7B, LLaDA-8B, SDAR-8B shapes in bf16")
    g.add_argument("--dry-run", action="store_true", help="the GPU bench's code on the CPU with tiny shapes (fp32)")
    g.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    g.add_argument("--budget-s", type=float, default=240.0, help="skip sections that would start past this (s)")


def run_bench(args: argparse.Namespace) -> int:
    """`bench --gpu` / `--dry-run` here, every other bench in dlm_lsp/measure/bench.py."""
    if args.gpu or args.dry_run:
        return run_gpu_bench(args)
    from dlm_lsp.measure import bench

    args.context = args.context or 512
    return bench.run_bench(args)


SECTIONS: tuple[tuple[str, Callable[[Setup, Built], dict]], ...] = (
    ("cached_step", cached_steps),
    ("profile", profile),
    ("forced", forced),
    ("reuse", reuse_hits),
    ("concurrency", concurrency),
    ("cancel", cancel),
)


# ---------------------------------------------------------------- the run


def measure_model(s: Setup, name: str, row: dict[str, Any], save: Callable[[], None]) -> None:
    """Builds one shape on the device and runs every section on it into `row`, saving after each (a
    failing section fails alone)."""
    cfg = model_config(name, s.dry)
    t = time.perf_counter()
    model = random_model(cfg, s.dev, s.dtype)
    sync(s.dev)
    build_s = time.perf_counter() - t
    nbytes = step_bytes(model, s.context, 32)
    m = Built(name, cfg, model, nbytes, nbytes / (s.bandwidth_gb_s * 1e6))
    row |= {
        "family": cfg.family,
        "shape": {
            k: getattr(cfg, k)
            for k in ("n_layers", "dim", "n_heads", "kv_heads", "head_dim", "ffn_dim", "vocab_size", "attention")
        }
        | {"block_size": cfg.block_size, "logits_shift": cfg.logits_shift},
        "params": model.num_params(),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "bytes_per_step": nbytes,
        "floor_ms": m.floor_ms,
        "build_s": build_s,
    }
    print(f"{name}: {row['params'] / 1e9:.2f}B params built in {build_s:.1f} s; floor {m.floor_ms:.2f} ms", flush=True)
    for section, fn in SECTIONS:
        if time.monotonic() > s.deadline:
            row[section] = {"skipped": "time budget (--budget-s)"}
            continue
        t = time.perf_counter()
        try:
            row[section] = fn(s, m)
        except Exception as e:  # noqa: BLE001 - one section's failure must not cost the lease the others
            traceback.print_exc()
            row[section] = {"error": f"{type(e).__name__}: {e}"}
        print(f"  {section}: {time.perf_counter() - t:.1f} s", flush=True)
        save()
    m.statics.clear()
    del model, m
    gc.collect()
    if s.dev.type == "cuda":
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(s.dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(s.dev)


def run_gpu_bench(args: argparse.Namespace) -> int:
    """The GPU bench (or its dry run): every model, every section; 1 when a section failed, 2 for bad arguments."""
    from engine.paths import DEFAULT_MODEL_DIR
    from engine.tokenizer import TextTokenizer

    dry = bool(args.dry_run)
    if not dry and not torch.cuda.is_available():
        print("bench --gpu: no CUDA device is visible (--dry-run runs the same code on the CPU)", file=sys.stderr)
        return 2
    names = [n.strip() for n in str(args.models).split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        print(f"bench --gpu: unknown model(s) {unknown or names}; known: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    dev = torch.device("cpu" if dry else "cuda")
    if dry:
        torch.set_num_threads(args.threads)
    context = args.context or (128 if dry else 2048)
    g = torch.Generator().manual_seed(1)
    bw = copy_bandwidth(dev, 2**24 if dry else 2**30, 5 if dry else 20)
    modes = ("loop", "eager") if dry else ("loop", "eager", "graph")
    s = Setup(
        dev=dev,
        dtype=torch.float32 if dry else torch.bfloat16,
        dry=dry,
        context=context,
        reps=1 if dry else max(1, args.reps),
        timed_steps=4 if dry else 8,
        modes=modes,
        fast=modes[-1],
        threads=args.threads,
        bandwidth_gb_s=bw["gb_s"],
        tok=TextTokenizer.load(DEFAULT_MODEL_DIR),
        words=torch.randint(4, 8000, (context + 64,), generator=g).tolist(),
        deadline=started + args.budget_s,
    )

    res: dict[str, Any] = {
        "mode": "dry-run" if dry else "gpu",
        "device": torch.cuda.get_device_name(dev) if not dry else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(s.dtype).removeprefix("torch."),
        "kernels": importlib.import_module("kernels.slot_stats").backend(),
        "context_tokens": context,
        "reps": s.reps,
        "modes": list(modes),
        "graph": "captured per (shape, run bucket)" if not dry else "skipped: CUDA graphs need a CUDA device",
        "bandwidth": bw,
        "models": {},
        "complete": False,
    }
    out = Path(args.json_out or ("runs/gpu_bench/dry_run.json" if dry else "docs/research/measurements/gpu_bench.json"))
    print(f"{res['device']}, torch {res['torch']}, {res['dtype']}: copy bandwidth {bw['gb_s']:.0f} GB/s", flush=True)

    def save() -> None:
        res["elapsed_s"] = time.monotonic() - started
        _write(out, res)

    for name in names:
        res["models"][name] = {}
        if time.monotonic() > s.deadline:
            res["models"][name]["skipped"] = "time budget (--budget-s)"
            continue
        try:
            measure_model(s, name, res["models"][name], save)
        except Exception as e:  # noqa: BLE001 - a shape that cannot be built (memory) fails alone
            traceback.print_exc()
            res["models"][name]["error"] = f"{type(e).__name__}: {e}"
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        save()
    res["complete"] = True
    _write(out, res)
    print_table(res)
    print(f"wrote {out}")
    failed = [n for n, row in res["models"].items() if "error" in row] + [
        f"{n}.{k}" for n, row in res["models"].items() for k, v in row.items() if isinstance(v, dict) and "error" in v
    ]
    if failed:
        print(f"bench --gpu: failed sections: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _write(path: Path, res: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")


# ---------------------------------------------------------------- the table


def print_table(res: dict) -> None:
    print(
        f"\n{res['device']} | torch {res['torch']} (CUDA {res['cuda']}) | {res['dtype']} | "
        f"context {res['context_tokens']} | copy {res['bandwidth']['gb_s']:.0f} GB/s"
    )
    modes: Sequence[str] = res["modes"]
    print(f"{'model':<10}{'rows':>5}" + "".join(f"{m + ' ms':>11}{'x floor':>8}" for m in modes) + f"{'floor ms':>10}")
    for name, row in res["models"].items():
        for rows, by_mode in (row.get("cached_step") or {}).get("rows", {}).items():
            cells = "".join(
                f"{by_mode[m]['ms']:11.2f}{by_mode[m]['floor_ratio']:8.1f}" if m in by_mode else f"{'-':>19}"
                for m in modes
            )
            print(f"{name:<10}{rows:>5}{cells}{row['floor_ms']:10.2f}")
    print(
        f"\n{'model':<10}{'mode':>7}{'launch/st':>10}{'graphs/st':>10}{'kern/st':>9}{'sync/st':>8}{'dtoh/st':>8}  sdpa"
    )
    for name, row in res["models"].items():
        for mode, p in (row.get("profile") or {}).items():
            if isinstance(p, dict) and "ops_per_step" in p:
                print(
                    f"{name:<10}{mode:>7}{p['launches_per_step']:10.1f}{p['graph_launches_per_step']:10.1f}"
                    f"{p['kernels_per_step']:9.1f}{p['syncs_per_step']:8.1f}{p['dtoh_copies_per_step']:8.1f}  "
                    + ("/".join(p["sdpa"]) or "-")
                )
    fast = res["modes"][-1]
    print(f"\n{'model':<10}{'fill':>8}{'loop ms':>10}{fast + ' ms':>10}{'speedup':>9}")
    for name, row in res["models"].items():
        for key, f in (row.get("forced") or {}).items():
            if isinstance(f, dict) and "speedup" in f:
                print(f"{name:<10}{key:>8}{f['loop']['ms']:10.1f}{f[fast]['ms']:10.1f}{f['speedup']:9.2f}")
    print()
    for name, row in res["models"].items():
        r, c, k = row.get("reuse") or {}, row.get("concurrency") or {}, row.get("cancel") or {}
        parts = []
        if "first_forward_ms" in (row.get("cached_step") or {}):
            parts.append(f"first forward {row['cached_step']['first_forward_ms']:.1f} ms")
        if "hits" in r:
            parts.append(
                f"reuse: miss {r['first_ms']:.0f} ms, hit p50 {r['hit_ms_p50'] or float('nan'):.1f} ms "
                f"({r['hits']}/{r['keystrokes']}), no session {r['no_session_ms_p50']:.1f} ms"
            )
        if "not_applicable" in r:
            parts.append(f"reuse n/a ({row['shape']['attention']})")
        if "ratio" in c:
            parts.append(
                f"8 concurrent {c['concurrent']['tokens_per_s']:.0f} tok/s vs one {c['one_at_a_time']['tokens_per_s']:.0f}"
                f" = {c['ratio']:.2f}x"
            )
        if "latency_ms_p50" in k:
            parts.append(f"cancel p50 {k['latency_ms_p50']:.1f} ms (step {k['step_ms']:.1f} ms)")
        skipped = [sec for sec, v in row.items() if isinstance(v, dict) and ("skipped" in v or "error" in v)]
        if skipped:
            parts.append(f"skipped/failed: {', '.join(skipped)}")
        print(f"{name}: " + "; ".join(parts))
