"""Loads a family checkpoint: meta-device model, safetensors shard by shard, names mapped once.

The model is built on the meta device (no memory), then each shard is memory-mapped
(`safe_open`), each tensor renamed, cast to the target dtype and moved to the target device one at
a time, so host memory holds at most the converted weights plus one tensor in flight. Headers are
checked (engine/checkpoint.py `check_safetensors`) before safetensors parses them; nothing is
unpickled, no remote code runs, nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ConfigError
from engine.families.layouts import rename
from engine.families.registry import Family, FamilyError, detect
from engine.families.specials import TokenFiles
from engine.model import Transformer, rope_tables
from engine.tokenizer import TextTokenizer


def read_config(folder: Path) -> dict:
    p = folder / "config.json"
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no config.json in {folder}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{p} is not a JSON object")
    return d


def is_family_checkpoint(folder: Path) -> bool:
    """True when config.json is a Hugging Face model config, not this project's own format."""
    try:
        cfg = read_config(Path(folder))
    except ConfigError:
        return False
    return cfg.get("model_type", "dlm-lsp") != "dlm-lsp" or "architectures" in cfg


def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json lists, in order."""
    from engine.checkpoint import CheckpointError, _shard_names

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        return [folder / s for s in _shard_names(index)]
    pickles = sorted(p.name for ext in ("bin", "pt", "pth", "ckpt") for p in folder.glob(f"*.{ext}"))
    if pickles:
        raise CheckpointError(f"{folder} has only pickle weights ({', '.join(pickles)}), which are never loaded "
                              "(unpickling can run code); convert them to safetensors")
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def family_config(folder: Path):
    """(Family, ModelConfig) of a family checkpoint folder, special ids from its files."""
    folder = Path(folder)
    cfg = read_config(folder)
    files = TokenFiles.read(folder, cfg)
    fam = detect(folder, cfg, files)
    return fam, fam.engine_config(cfg, files)


def load_family(folder, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                forward_only: bool = False):
    """Returns (model in eval mode, tokenizer, config) for a family checkpoint. `forward_only`
    admits families the engine cannot decode yet (WeDLM) for parity checks."""
    from engine.checkpoint import CheckpointError, check_safetensors

    folder = Path(folder)
    try:
        fam, cfg = family_config(folder)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    if not fam.decodes and not forward_only:
        raise CheckpointError(f"{folder}: {fam.title} loads, but the engine cannot decode it yet ({fam.note})")
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"no tokenizer.json in {folder} (only tokenizer.json is read; no slow tokenizers)")
    tok = TextTokenizer.load(folder)
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = Transformer(cfg)
    want = {k: v.shape for k, v in model.state_dict().items()}
    sd: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        check_safetensors(path)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    _take(fam, cfg, f, name, want, sd, device, dtype, path)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever safetensors finds, the message names the file
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if cfg.tie_embeddings:
        sd.pop("output.weight", None)  # a tied checkpoint may still store its head; transformers ignores it
    missing = sorted(set(want) - set(sd))
    if missing:
        raise CheckpointError(f"{folder}: {fam.title} checkpoint lacks {', '.join(missing[:4])}"
                              + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    model.load_state_dict(sd, assign=True, strict=True)
    cos, sin = rope_tables(cfg, device=None)  # non-persistent buffers: computed on the CPU in fp32
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.eval(), tok, cfg


def _take(fam: Family, cfg, f, name: str, want: dict, sd: dict, device, dtype, path: Path) -> None:
    """Reads one tensor, renamed and converted, into sd (shape-checked against the model)."""
    from engine.checkpoint import CheckpointError

    try:
        target = rename(fam.layout, name)
    except KeyError:
        raise CheckpointError(f"{path}: tensor {name!r} is not part of a {fam.title} model "
                              f"(layout {fam.layout}); is this the right family?") from None
    if target is None:
        return
    if target not in want:
        if target == "output.weight" and cfg.tie_embeddings:
            return
        raise CheckpointError(f"{path}: tensor {name!r} ({target}) does not fit the config (biases or norms "
                              "the config does not declare)")
    t = f.get_tensor(name)
    if tuple(t.shape) != tuple(want[target]):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, the config implies "
                              f"{tuple(want[target])}")
    sd[target] = t.to(device=device, dtype=dtype)
