"""Copies the bake-off candidates' last checkpoints (runs/<name>/last) to models/bakeoff/<name>, the
copies a fresh clone resumes from (scripts/bakeoff.sh), with the optimizer file slimmed
(engine.train.loop.slim_optimizer: moments and steps kept, raw weights dropped) so that four candidates fit
one session's commit limit.

    .venv/bin/python scripts/bakeoff_snapshot.py v2a v2-ar v2b v2c
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.train.loop import OPTIMIZER_FILE, slim_optimizer  # noqa: E402

KEEP = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "training_state.json",
    "train_log.jsonl",
    "train_curve.png",
    OPTIMIZER_FILE,
)


def snapshot(name: str, runs: Path = ROOT / "runs", dest: Path = ROOT / "models" / "bakeoff") -> Path:
    src, out = runs / name / "last", dest / name
    if not (src / OPTIMIZER_FILE).exists():
        raise SystemExit(f"{src}: no checkpoint with optimizer state")
    out.mkdir(parents=True, exist_ok=True)
    for f in KEEP:
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    slim_optimizer(out / OPTIMIZER_FILE)
    return out


if __name__ == "__main__":
    for n in sys.argv[1:] or ["v2a", "v2-ar", "v2b", "v2c"]:
        print(snapshot(n))
