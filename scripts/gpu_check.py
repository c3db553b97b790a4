"""The GPU check of issue 13, one program: bf16-vs-fp32 parity for every family, then a 7B-shaped bench.

1. parity: each family's tiny random checkpoint (tests/families_tiny.py: the family's exact file
   layout) is loaded through the engine's normal path in fp32 on the CPU and in the device dtype
   (bf16 on CUDA) on the device; their logits on the same canvas are compared (max abs error
   relative to the largest logit, top-1 agreement), and one fill is decoded on the device (the
   sampler, the context cache, the slot-statistics kernel, DreamOn's resizing: every op of the
   decoding loop in that dtype).
2. kernels: the slot-statistics kernel (kernels/slot_stats.py) compiled for the device, on every case
   of tests/test_kernels.py (fp32/bf16/fp16 inputs, odd blockings, 152k vocabularies) plus the
   device's own launch settings, against its torch reference on the same device: max abs error per
   statistic and argmax agreement, each case held to its input dtype's (atol, rtol) with
   tests/test_kernels.py's `_compare` (argmax equal wherever the top two are further apart than the
   tolerance). (On the CPU, tests/test_kernels.py runs the same cases through
   Triton's interpreter; the tiny mode runs the three smallest here with TRITON_INTERPRET=1.)
3. bench: a random model of Dream-7B's shapes (Qwen2.5-7B: hidden 3584, 28 layers, 28/4 heads, FFN
   18944, vocab 152064), built on the meta device and filled in bf16 directly on the GPU (writing
   and reading 15 GB would spend the time budget on the disk): the first (full) forward of a
   512-token canvas, one cached step, fills of 32 and 64 slots (default decoding options), and a
   batch of 8 canvases stepped together against one at a time.

With --tiny (scripts/gpu_check.sh sets it for TINY=1 or when no CUDA GPU is visible) the same code
runs on the CPU with tiny shapes in fp32: that is what tests/test_gpu_check.py runs. Writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BF16_REL_TOL = 0.05  # max |bf16 - fp32| / max |fp32| logit; bf16 keeps ~3 significant digits per op


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def parity(dev: torch.device, dtype: torch.dtype, root: Path) -> dict:
    """Per family: fp32 CPU vs `dtype` on `dev` logits, and one fill decoded on `dev`."""
    from engine.api import DecodeOptions
    from engine.decode.forward import build_canvas
    from engine.decode.sampler import fill
    from engine.families.loader import load_family
    from tests.families_tiny import SPECS, seed_of, write_checkpoint

    out = {}
    for name, spec in SPECS.items():
        folder = write_checkpoint(spec, root / name, seed=seed_of(name))
        ref, tok, cfg = load_family(folder, "cpu", torch.float32, forward_only=True)
        model, _, _ = load_family(folder, dev, dtype, forward_only=True)
        ids = torch.tensor([tok.encode("def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n")])
        ids[0, 10:18] = cfg.mask_token_id  # a masked span, as decoding sees it
        with torch.no_grad():
            want = ref(ids)[0]  # (L, V)
            got = model(ids.to(dev))[0].float().cpu()
        rel = float((got - want).abs().max() / want.abs().max())
        top1 = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        row = {
            "max_abs_err": float((got - want).abs().max()),
            "rel_err": rel,
            "top1_agree": top1,
            "ok": rel <= BF16_REL_TOL or dtype == torch.float32 and rel <= 1e-4,
        }
        t0 = time.perf_counter()
        c = build_canvas(
            tok.encode("def add(a, b):\n    ret"),
            tok.encode("\n\nprint(add(1, 2))\n"),
            8,
            cfg,
            DecodeOptions(heal=False),
            device=dev,
        )
        r = fill(model, c)
        _sync(dev)
        row.update(
            fill_ok=all(0 <= t < cfg.vocab_size and t != cfg.mask_token_id for t in r.ids),
            fill_steps=r.steps,
            fill_ms=(time.perf_counter() - t0) * 1000,
        )
        row["ok"] = row["ok"] and row["fill_ok"]
        out[name] = row
        del model, ref
    return out


def kernels(dev: torch.device, tiny: bool) -> dict:
    """The compiled (or, tiny, interpreted) slot-statistics kernel against its torch reference."""
    import importlib
    import os

    ks = importlib.import_module("kernels.slot_stats")
    if not ks.triton_installed():
        return {"skipped": "Triton is not installed", "ok": True}
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return {
            "skipped": "no CUDA device and TRITON_INTERPRET unset (tests/test_kernels.py covers the CPU)",
            "ok": True,
        }
    # per input dtype (dtype, atol, rtol) and the comparison of tests/test_kernels.py: bf16/fp16 heads run
    # on tensor cores (the normed row rounded to the dtype), and an argmax must agree only where the
    # reference's top two are further apart than that tolerance
    from tests.test_kernels import CASES, DTYPES, _case_id, _compare, _inputs

    cases = (
        CASES[:3]
        if tiny
        else CASES
        + [
            (M, D, V, dt, 7, {})
            for M in (1, 8, 33)
            for D, V in ((192, 8192), (3584, 152064))
            for dt in ("fp32", "bf16")
        ]
    )
    rows, ok = {}, True
    for i, (M, D, V, dt, ban, kw) in enumerate(cases):
        h, nw, hw = (t.to(dev) for t in _inputs(M, D, V, DTYPES[dt][0], seed=i))
        got = ks.slot_stats_triton(h, nw, 1e-5, hw, ban=ban, **kw)
        want = ks.slot_stats_reference(h, nw, 1e-5, hw, ban=ban)
        errs = {
            n: float((a.double() - b.double()).abs().max())
            for n, a, b in zip(
                ("max_prob", "top2_prob", "entropy"), (got[0], got[2], got[3]), (want[0], want[2], want[3])
            )
        }
        agree = float((got[1] == want[1]).float().mean())
        banned = ban >= 0 and bool((got[1] == ban).any())
        _, atol, rtol = DTYPES[dt]
        try:
            _compare(got, want, atol, rtol)
            differs = None
        except AssertionError as e:
            differs = str(e)
        good = differs is None and not banned
        ok = ok and good
        row = {**errs, "argmax_agree": agree, "atol": atol, "rtol": rtol, "ok": good}
        if differs is not None or banned:
            row["differs"] = differs or f"the banned id {ban} was chosen"
        rows[_case_id((M, D, V, dt, ban, kw))] = row
    return {
        "cases": rows,
        "max_err": max(max(r[k] for k in ("max_prob", "top2_prob", "entropy")) for r in rows.values()),
        "ok": ok,
    }


def dream_7b_config(tiny: bool):
    """Dream-7B's engine config from its config.json keys (dlm-lsp bench --gpu's, through the family
    adapter); `tiny`: the same keys at 2 layers of 64."""
    from dlm_lsp.measure.gpu_setup import MODELS
    from engine.families.registry import FAMILIES
    from engine.families.specials import TokenFiles

    family, keys = MODELS["dream-7b"]
    if tiny:
        tiny_shapes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        keys = {**keys, **tiny_shapes, "num_key_value_heads": 2}
    fam = next(f for f in FAMILIES if f.name == family)
    return fam.engine_config(keys, TokenFiles(keys, {}, {}, None))


def bench(dev: torch.device, dtype: torch.dtype, tiny: bool, context: int, reps: int) -> dict:
    """First forward, cached step, 32/64-slot fills and a batch of 8 on a random Dream-7B."""
    from engine.api import DecodeOptions
    from engine.decode.cache import BatchContext
    from engine.decode.forward import build_canvas
    from engine.decode.sampler import fill, step

    cfg = dream_7b_config(tiny)
    t0 = time.perf_counter()
    from dlm_lsp.measure.gpu_setup import random_model  # the bench's: built on the meta device, filled on `dev`

    model = random_model(cfg, dev, dtype)
    _sync(dev)
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    words = torch.randint(0, 150000, (context,), generator=g).tolist()  # token ids only: no tokenizer needed
    opts = DecodeOptions(heal=False)

    def canvas(n, shift=0):
        room = context - n
        return build_canvas(
            words[shift : shift + room * 2 // 3],
            words[shift + room * 2 // 3 : shift + room],
            n,
            cfg,
            opts,
            context_tokens=context,
            device=dev,
        )

    def timed(fn):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        return (time.perf_counter() - t) * 1000

    for _ in range(2):  # warm-up: allocator, cuBLAS / Triton autotuning, lazy imports
        fill(model, canvas(32))
    out = {
        "params": sum(p.numel() for p in model.parameters()),
        "build_s": build_s,
        "canvas_tokens": context,
        "decode_options": dataclasses.asdict(opts),
    }
    firsts, cached = [], []
    for r in range(reps):
        c = canvas(32, r)
        firsts.append(timed(lambda c=c: step(model, [c])))
        cached.append(timed(lambda c=c: step(model, [c])))
    out["first_forward_ms"] = sorted(firsts)[len(firsts) // 2]
    out["cached_step_ms"] = sorted(cached)[len(cached) // 2]
    for n in (32, 64):
        ms, steps = [], []
        for r in range(reps):
            c = canvas(n, r)
            ms.append(timed(lambda c=c: fill(model, c)))
            steps.append(c.steps)
        out[f"fill{n}_ms"] = sorted(ms)[len(ms) // 2]
        out[f"fill{n}_steps"] = sorted(steps)[len(steps) // 2]
    # a batch of 8 canvases stepped together (the service's batching) against the same 8 one at a time
    cs = [canvas(32, r) for r in range(8)]
    serial = timed(lambda: [fill(model, c) for c in cs])
    cs = [canvas(32, r) for r in range(8)]
    bctx = BatchContext()

    def together():
        while not all(c.done for c in cs):
            step(model, [c for c in cs if not c.done], batch_ctx=bctx)

    batched = timed(together)
    out["batch8"] = {
        "slots": 32,
        "serial_ms": serial,
        "batched_ms": batched,
        "speedup": serial / batched,
        "steps": [c.steps for c in cs],
    }
    if dev.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(dev)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, fp32, tiny shapes (the test mode)")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args()
    tiny = args.tiny or not torch.cuda.is_available()
    dev = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    if tiny:
        torch.set_num_threads(1)
    import importlib

    ks = importlib.import_module("kernels.slot_stats")  # the package re-exports the function under this name

    res = {
        "mode": "tiny" if tiny else "gpu",
        "device": torch.cuda.get_device_name(0) if not tiny else platform.processor() or "cpu",
        "dtype": str(dtype),
        "torch": torch.__version__,
        "kernels": ks.backend(),
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlm-gpu-check-") as tmp:
        res["parity"] = parity(dev, dtype, Path(tmp))
    res["parity_s"] = time.perf_counter() - t0
    for name, row in res["parity"].items():
        print(
            f"parity {name:>13}: rel err {row['rel_err']:.2e}, top-1 agree {row['top1_agree']:.2f}"
            + (f", fill {row['fill_steps']} steps {row['fill_ms']:.0f} ms" if "fill_ms" in row else "")
            + ("" if row["ok"] else "  FAIL"),
            flush=True,
        )
    t0 = time.perf_counter()
    res["kernels"] = kernels(dev, tiny)
    res["kernels_s"] = time.perf_counter() - t0
    kr = res["kernels"]
    print(
        "kernels: "
        + (
            kr["skipped"]
            if "skipped" in kr
            else f"{len(kr['cases'])} cases, max abs error {kr['max_err']:.2e}" + ("" if kr["ok"] else "  FAIL")
        ),
        flush=True,
    )
    if not args.skip_bench:
        t0 = time.perf_counter()
        res["bench_dream_7b"] = bench(
            dev, dtype, tiny, args.context or (160 if tiny else 512), args.reps or (1 if tiny else 3)
        )
        res["bench_s"] = time.perf_counter() - t0
        b = res["bench_dream_7b"]
        print(
            f"dream-7b{' (tiny shapes)' if tiny else ''}: {b['params'] / 1e9:.2f}B params; first forward "
            f"{b['first_forward_ms']:.1f} ms, cached step {b['cached_step_ms']:.1f} ms, fill32 {b['fill32_ms']:.0f} ms "
            f"({b['fill32_steps']} steps), fill64 {b['fill64_ms']:.0f} ms ({b['fill64_steps']} steps), batch of 8 "
            f"{b['batch8']['speedup']:.2f}x",
            flush=True,
        )
    res["ok"] = all(r["ok"] for r in res["parity"].values()) and res["kernels"]["ok"]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
