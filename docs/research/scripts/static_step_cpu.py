"""The fixed-shape cached step (engine/decode/static.py) against the eager loop on the CPU, side by
side in one run: the default model, one thread, levers off (the step takes no host-side bias), 24
cursors in the engine's own source x 16- and 64-slot fills at threshold 0.999 (many steps each), the
modes interleaved per fill. Prints each mode's cached-step p50/p95 and whether the fills are equal;
writes JSON.

    .venv/bin/python docs/research/scripts/static_step_cpu.py [OUT.json]
"""

from __future__ import annotations

import json
import random
import statistics
import sys

import torch

from engine.api import DecodeOptions
from engine.decode import sampler, static
from engine.decode.forward import build_canvas
from engine.weights.load import load_checkpoint

torch.set_num_threads(1)
model, tok, cfg = load_checkpoint(None, "cpu", torch.float32)
src = open("engine/decode/sampler.py").read() + open("engine/decode/canvas.py").read()
random.seed(1)
modes = {"loop": None, "eager": static.StaticStep(model, "eager"), "compile": static.StaticStep(model, "compile")}
opts = DecodeOptions(heal=False, threshold=0.999, pad_stop=1.1)
cuts = [src.index("\n    ", random.randrange(500, len(src) - 800)) + 5 for _ in range(24)]


def canvas(cut: int, n: int):
    return build_canvas(tok.encode(src[cut - 1500 : cut]), tok.encode(src[cut : cut + 500]), n, cfg, opts, 512)


for cut in cuts[:6]:  # compile every bucket first: compile time is not a step's
    for n in (16, 64):
        sampler.fill(model, canvas(cut, n), static=modes["compile"])
ms: dict[str, list[float]] = {m: [] for m in modes}
fills: dict[str, list[list[int]]] = {m: [] for m in modes}
for cut in cuts:
    for n in (16, 64):
        for m, st in modes.items():
            r = sampler.fill(model, canvas(cut, n), static=st)
            ms[m] += r.ms_per_step[1:]  # the cached steps (the first is the full forward)
            fills[m].append(r.ids)
out = {"cpu_threads": 1, "fills": len(fills["loop"])}
for m in modes:
    v = sorted(ms[m])
    out[m] = {"steps": len(v), "p50_ms": v[len(v) // 2], "p95_ms": v[int(len(v) * 0.95)], "mean_ms": statistics.mean(v)}
    print(f"{m:8s} {len(v)} cached steps  p50 {out[m]['p50_ms']:.2f} ms  p95 {out[m]['p95_ms']:.2f} ms")
out["fills_equal"] = {m: fills[m] == fills["loop"] for m in modes}
print("fills equal to the loop's:", out["fills_equal"])
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
