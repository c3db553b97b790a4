"""Checkpoint folders in the HF layout: config.json + model.safetensors (+ shards) + tokenizer.json.

Weights are read with safetensors only: nothing is unpickled, no remote code runs, nothing is
downloaded. A name is a local folder or a repo id already in the local Hugging Face cache.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.config import ConfigError, ModelConfig
from engine.model import Transformer
from engine.tokenizer import TextTokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "default"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found or loaded; the message says what to do next."""


def resolve_model_path(name: str | os.PathLike | None) -> Path:
    """Returns the local folder for `name`: None -> the embedded default model; a folder; or a repo
    id ("org/name") found in the local Hugging Face cache. Never downloads."""
    if name is None or str(name) in ("", "default"):
        path = DEFAULT_MODEL_DIR
        if not (path / "config.json").exists():
            raise CheckpointError(f"the default model is missing at {path}; run `dlm-lsp train`")
        return path
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    if "/" in str(name) and not p.exists():
        hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
        snaps = hub / f"models--{str(name).replace('/', '--')}" / "snapshots"
        ref = hub / f"models--{str(name).replace('/', '--')}" / "refs" / "main"
        if ref.exists() and (snaps / ref.read_text().strip()).is_dir():
            return snaps / ref.read_text().strip()
        if snaps.is_dir():
            found = sorted(d for d in snaps.iterdir() if (d / "config.json").exists())
            if found:
                return found[-1]
    raise CheckpointError(f"model {name!r} is neither a local folder nor in the local Hugging Face cache")


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Reads model.safetensors or the shards listed in model.safetensors.index.json."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.exists():
        return load_file(str(single))
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        sd: dict[str, torch.Tensor] = {}
        for s in shards:
            sd.update(load_file(str(folder / s)))
        return sd
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise CheckpointError(f"{folder} has only pickle weights (.bin/.pt); convert them to safetensors")
    raise CheckpointError(f"no model.safetensors in {folder}")


def load_checkpoint(name=None, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Returns (model in eval mode, tokenizer, config) for a checkpoint folder of this project's format."""
    folder = resolve_model_path(name)
    try:
        cfg = ModelConfig.load(folder)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    if not (folder / "tokenizer.json").exists():
        raise CheckpointError(f"no tokenizer.json in {folder}")
    tok = TextTokenizer.load(folder)
    with torch.device("meta"):
        model = Transformer(cfg)
    sd = read_state_dict(folder)
    missing = set(model.state_dict()) - set(sd)
    unexpected = set(sd) - set(model.state_dict())
    if missing or unexpected:
        raise CheckpointError(f"{folder}: weights do not match config (missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})")
    model.load_state_dict(sd, assign=True)
    # rope tables are non-persistent buffers, still on meta: rebuild them on the real device
    from engine.model import rope_tables

    cos, sin = rope_tables(cfg)
    model.rope_cos, model.rope_sin = cos, sin
    dtype = dtype or torch.float32
    model = model.to(device=device, dtype=dtype).eval()
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model, tok, cfg


def save_checkpoint(folder, model: Transformer, tok: TextTokenizer, extra: dict | None = None) -> None:
    """Writes config.json, model.safetensors and tokenizer.json (+ training metadata) into folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.cfg.save(folder)
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    tmp = folder / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    tok.save(folder)
    if extra is not None:
        (folder / "training_state.json").write_text(json.dumps(extra, indent=2) + "\n")
