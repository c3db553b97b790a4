# Research probe, kept as it ran at commit 53dcfeb; not maintained: it may not run against today's layout.
"""What the first fill of a fresh process costs on the CPU against the next ones (the reason the
engine's warm-up is off on the CPU by default: engine/serve/service.py, EngineService.warm_up).

The default model, one thread, six fills of 16 slots at different places of engine/decode/sampler.py; run it
idle, a few times (each run is a fresh process):

    .venv/bin/python docs/research/scripts/first_fill.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.api import DecodeOptions  # noqa: E402
from engine.weights.load import load_checkpoint  # noqa: E402
from engine.decode.sampler import fill
from engine.decode.forward import build_canvas


def main() -> int:
    torch.set_num_threads(1)
    model, tok, cfg = load_checkpoint(None, torch.device("cpu"), torch.float32)
    src = (ROOT / "engine" / "sampler.py").read_text()
    ms = []
    for i in range(6):
        prefix = tok.encode(src[1000 + 300 * i: 4000 + 300 * i])[-480:]
        suffix = tok.encode(src[4100 + 300 * i: 4600 + 300 * i])[:40]
        canvas = build_canvas(prefix, suffix, 16, cfg, DecodeOptions())
        t0 = time.perf_counter()
        fill(model, canvas)
        ms.append((time.perf_counter() - t0) * 1000)
    print("fills (ms): " + " ".join(f"{x:.0f}" for x in ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
