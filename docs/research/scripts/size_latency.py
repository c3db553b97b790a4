# Research probe, kept as it ran at commit f9245ec; not maintained: it may not run against today's layout.
"""What a model size costs a fill on this CPU: random weights of each shape, one thread, the same
canvas (480 tokens of prefix, 30 of suffix, 16 slots, 8 steps, the default decoding otherwise).

Only the ratio between shapes means anything (random weights commit in a fixed 8 steps here, a
trained model takes as many as its confidence needs); run it idle (stop other jobs first: `kill -STOP`).

    .venv/bin/python docs/research/scripts/size_latency.py [--shape 192x5x576 --shape 224x6x672 ...] [--reps 6]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from engine.api import DecodeOptions  # noqa: E402
from engine.model.transformer import ModelConfig, Transformer  # noqa: E402
from engine.decode.sampler import fill
from engine.decode.forward import build_canvas

SHAPES = ["192x5x576", "256x6x768", "224x6x672", "256x5x768", "192x7x576"]  # dim x layers x FFN; the default first


def fill_ms(dim: int, layers: int, ffn: int, reps: int) -> tuple[float, float]:
    """(parameters in millions, median ms of a fill after one warm-up)."""
    cfg = ModelConfig(vocab_size=8192, dim=dim, n_layers=layers, n_heads=4, ffn_dim=ffn, max_seq_len=1024,
                      context_len=512, mask_token_id=2, pad_token_id=0, eos_token_id=1, bos_token_id=3).validate()
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(4, 8000, (480,), generator=g).tolist()
    suffix = torch.randint(4, 8000, (30,), generator=g).tolist()
    times = []
    for _ in range(reps):
        canvas = build_canvas(prefix, suffix, 16, cfg, DecodeOptions(steps=8))
        t0 = time.perf_counter()
        fill(model, canvas)
        times.append(time.perf_counter() - t0)
    return model.num_params() / 1e6, statistics.median(times[1:]) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=None, help="DIMxLAYERSxFFN (repeatable)")
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = None
    for shape in args.shape or SHAPES:
        dim, layers, ffn = (int(x) for x in shape.split("x"))
        params, ms = fill_ms(dim, layers, ffn, args.reps)
        base = base or ms
        print(f"{shape}: {params:.2f}M parameters, fill {ms:.1f} ms ({ms / base:.2f}x the first)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
