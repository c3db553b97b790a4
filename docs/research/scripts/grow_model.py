# Research probe, kept as it ran at commit 6116ca2; not maintained: it may not run against today's layout.
"""Depth growth of a checkpoint (engine/train/grow.py): new blocks that add nothing until trained, so that
`dlm-lsp train --resume DST` continues the run, bigger, on the same plan.

    .venv/bin/python docs/research/scripts/grow_model.py runs/v2b-long/last runs/grow8/start --after 1,2,3
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine.train.grow import grow_checkpoint  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="checkpoint folder (its optimizer.safetensors, if any, is grown too)")
    p.add_argument("dst", help="the grown checkpoint's folder")
    p.add_argument("--after", required=True, help="comma-separated blocks each followed by a new block")
    a = p.parse_args()
    cfg = grow_checkpoint(Path(a.src), Path(a.dst), [int(x) for x in a.after.split(",")])
    print(f"{a.dst}: {cfg.n_layers} blocks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
