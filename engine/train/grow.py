"""Depth growth: a trained checkpoint made deeper without changing what it computes.

The size question of issue 12 ("a bigger model, or more steps of this one?") at equal compute: the 4 M
default stopped gaining line exact match from more training while its held-out loss still fell, which
points at capacity. Training a bigger model from scratch would spend the 12 CPU-hours already in the
small one again; growing it keeps them. Each new block is a copy of the block it follows, with its two
output projections (attention `wo`, MLP `w2`) zeroed: a pre-norm block whose outputs are zero adds
nothing to the residual stream, so the grown model's logits equal the original's exactly, and its
copied query/key/value and gate/up weights start from features the trained block already computes.

`grow_checkpoint` writes a folder `dlm-lsp train --resume` continues: the EMA weights grown, the
tokenizer, the training state (hours, step: the plan goes on), and, when the source has one, its
optimizer file grown the same way: raw weights, and AdamW's moments for the blocks that existed
(renumbered); the new blocks have none, so `load_optimizer` leaves them to a fresh AdamW state.

    python docs/research/scripts/grow_model.py runs/v2b-long/last runs/grow8/start --after 1,2,3
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from engine.model.config import ModelConfig

ZEROED = ("attn.wo.weight", "mlp.w2.weight", "attn.wo.bias", "mlp.w2.bias")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def layer_plan(n_layers: int, after: list[int]) -> list[tuple[int, bool]]:
    """For each block of the grown model, (the source block it is built from, whether it is new).
    A new block follows each source block listed in `after` (once per listing)."""
    bad = [i for i in after if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"--after names blocks {bad}; the model has blocks 0-{n_layers - 1}")
    plan = []
    for i in range(n_layers):
        plan.append((i, False))
        plan.extend((i, True) for _ in range(after.count(i)))
    return plan


def grow_state(
    sd: dict[str, torch.Tensor], plan: list[tuple[int, bool]], prefix: str = "", new_blocks: bool = True
) -> dict[str, torch.Tensor]:
    """Renumbers `prefix + layers.i.*` keys by `plan`. A new block copies its source block's tensors
    (output projections zeroed) when `new_blocks`, or is left out (optimizer moments: fresh state)."""
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        m = _LAYER.match(k[len(prefix) :]) if k.startswith(prefix) else None
        if m is None:
            out[k] = v
        else:
            by_layer.setdefault(int(m.group(1)), {})[m.group(2)] = v
    for j, (i, new) in enumerate(plan):
        if new and not new_blocks:
            continue
        for rest, v in by_layer.get(i, {}).items():
            out[f"{prefix}layers.{j}.{rest}"] = torch.zeros_like(v) if new and rest in ZEROED else v.clone()
    return out


def grow_checkpoint(src: Path, dst: Path, after: list[int]) -> ModelConfig:
    """Writes the grown checkpoint of folder `src` into `dst` (see the module docstring)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.weights.load import read_state_dict

    src, dst = Path(src), Path(dst)
    cfg = ModelConfig.load(src)
    plan = layer_plan(cfg.n_layers, after)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(grow_state(read_state_dict(src), plan), str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg.n_layers = len(plan)
    cfg.validate().save(dst)
    for name in ("tokenizer.json", "training_state.json", "train_log.jsonl", "serving.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    opt = src / "optimizer.safetensors"
    if opt.exists():
        with safe_open(str(opt), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        grown = grow_state({k: v for k, v in tensors.items() if k.startswith("weight.")}, plan, "weight.")
        for moment in ("exp_avg.", "exp_avg_sq."):
            grown.update(
                grow_state({k: v for k, v in tensors.items() if k.startswith(moment)}, plan, moment, new_blocks=False)
            )
        steps = {k: torch.tensor(v) for k, v in json.loads(meta.get("steps", "{}")).items()}
        grown_steps = {k: float(v) for k, v in grow_state(steps, plan, new_blocks=False).items()}
        save_file(grown, str(dst / "optimizer.safetensors"), metadata={**meta, "steps": json.dumps(grown_steps)})
    return cfg
