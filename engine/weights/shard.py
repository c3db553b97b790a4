"""Sharded safetensors: splits a checkpoint folder's weights into files of at most N MiB each, in place.

The Hugging Face layout that engine.weights.load.read_state_dict reads:
  model-00001-of-00003.safetensors ... + model.safetensors.index.json {"metadata": {"total_size"},
  "weight_map": {tensor name: shard file}}
Used by the GPU recipe (scripts/gpu_train.sh): files that come back from the device machine are
limited in size. A tensor is never split; one larger than the limit is an error.

    python -m engine.weights.shard runs/gpu/best --max-mb 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"
MIB = 1024 * 1024


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(sd: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Returns tensor names grouped into shards of at most `max_bytes` (in state-dict order)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in sd.items():
        n = _nbytes(t)
        if n > max_bytes:
            raise ValueError(
                f"tensor {name} has {n} bytes, more than the shard limit of {max_bytes}; "
                "raise the limit or shrink the model"
            )
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def save_sharded(folder: str | Path, sd: dict[str, torch.Tensor], max_bytes: int) -> list[str]:
    """Writes `sd` as shards + index into folder (removing any model.safetensors); returns the shard
    file names. Each file holds at most `max_bytes` of tensor data (plus a small header)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in sd.items()}
    groups = plan_shards(sd, max_bytes)
    n = len(groups)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for old in folder.glob("model-*-of-*.safetensors"):
        if old.name not in names:
            old.unlink()
    weight_map = {}
    for fname, group in zip(names, groups):
        tmp = folder / (fname + ".tmp")
        save_file({k: sd[k] for k in group}, str(tmp), metadata={"format": "pt"})
        tmp.replace(folder / fname)
        weight_map.update({k: fname for k in group})
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in sd.values())}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    single = folder / "model.safetensors"
    if single.exists():
        single.unlink()  # read_state_dict prefers the single file: it must not shadow the shards
    return names


def shard_checkpoint(folder: str | Path, max_mb: float = 16) -> list[str]:
    """Splits a checkpoint folder's model.safetensors into shards of at most `max_mb` MiB, in place."""
    folder = Path(folder)
    single = folder / "model.safetensors"
    if not single.exists():
        if (folder / INDEX).exists():
            return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
        raise FileNotFoundError(f"no model.safetensors in {folder}")
    return save_sharded(folder, load_file(str(single)), int(max_mb * MIB))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.weights.shard", description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", help="checkpoint folders to shard in place")
    p.add_argument("--max-mb", type=float, default=16, help="largest shard, MiB (default 16)")
    a = p.parse_args(argv)
    for f in a.folders:
        names = shard_checkpoint(f, a.max_mb)
        print(f"{f}: {len(names)} shard(s) of at most {a.max_mb:g} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
