"""Loads a model folder, whatever kind it is: the one place that tells the kinds apart.

`load_checkpoint(name)` resolves the name (engine/weights/checkpoint.py) and then:
- a family checkpoint (a Hugging Face config.json: Dream, LLaDA, ...) loads through the family
  registry (engine/families);
- otherwise the folder is this project's own format (config.json of ModelConfig, tokenizer.json)
  and its weights are read by `read_state_dict`, which takes, in this order: model.safetensors,
  the shards a model.safetensors.index.json lists (engine/weights/shard.py writes them), or a delta
  folder (delta.json + delta.safetensors over a base found on this machine: engine/weights/delta.py).
  A folder with only pickle weights is refused, never unpickled.
`load_ar_model(name)` loads the autoregressive twin of an evaluation: a plain Llama folder (a base
model from `dlm-lsp base-model`, or an HF cache snapshot: engine/weights/base_models.py) as the engine's
causal LM, anything else as load_checkpoint does.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from engine.families import is_family_checkpoint, load_family
from engine.model.config import ConfigError, ModelConfig
from engine.model.transformer import Transformer, rope_tables
from engine.model.weight_files import CheckpointError, has_weights, read_weights, refuse_pickles
from engine.tokenizer import TextTokenizer
from engine.weights.base_models import is_causal_lm, load_causal_lm
from engine.weights.checkpoint import resolve_model_path
from engine.weights.delta import DELTA_JSON, load_delta_state_dict

CPU_INIT_PARAMS = 64_000_000  # models up to this size are built on the CPU (see load_checkpoint)


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Reads model.safetensors, the shards listed in model.safetensors.index.json, or a delta folder
    (delta.json + delta.safetensors over a base found on this machine: engine/weights/delta.py)."""
    if has_weights(folder):
        return read_weights(folder)
    if (folder / DELTA_JSON).exists():
        return load_delta_state_dict(folder)
    refuse_pickles(folder)
    raise CheckpointError(f"no model.safetensors in {folder}")


def load_checkpoint(
    name: str | os.PathLike | None = None, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[Transformer, TextTokenizer, ModelConfig]:
    """Returns (model in eval mode, tokenizer, config) for a model name: a family checkpoint, or a
    checkpoint folder of this project's format (whole, sharded or a delta)."""
    folder = resolve_model_path(name)
    if is_family_checkpoint(folder):  # Dream, LLaDA, ... (engine/families)
        return load_family(folder, device, dtype)
    try:
        cfg = ModelConfig.load(folder)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    if not (folder / "tokenizer.json").exists():
        raise CheckpointError(f"no tokenizer.json in {folder}")
    tok = TextTokenizer.load(folder)
    sd = read_state_dict(folder)
    # A large model is built on the meta device (no memory, no random init) and a small one on the
    # CPU: the meta device's init runs through torch's Python reference ops, whose first use imports
    # torch._dynamo, 1.1 s of a cold start on a 2-core CPU against 0.04 s to init the 4 M default
    small = sum(t.numel() for t in sd.values()) <= CPU_INIT_PARAMS
    with contextlib.nullcontext() if small else torch.device("meta"):
        model = Transformer(cfg)
    missing = set(model.state_dict()) - set(sd)
    unexpected = set(sd) - set(model.state_dict())
    if missing or unexpected:
        raise CheckpointError(
            f"{folder}: weights do not match config (missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})"
        )
    model.load_state_dict(sd, assign=True)
    # rope tables are non-persistent buffers (on meta for a large model): rebuild them on the real device
    cos, sin = rope_tables(cfg)
    model.rope_cos, model.rope_sin = cos, sin
    dtype = dtype or torch.float32
    model = model.to(device=device, dtype=dtype).eval()
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model, tok, cfg


def load_ar_model(
    name: str | os.PathLike | None, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[Transformer, TextTokenizer, ModelConfig]:
    """Returns (model in eval mode, tokenizer, config) for an autoregressive model: a plain Llama folder
    (LlamaForCausalLM) as the engine's causal LM (base_models.load_causal_lm), else as load_checkpoint."""
    folder = resolve_model_path(name)
    if is_causal_lm(folder):
        return load_causal_lm(folder, device=device, dtype=dtype)
    return load_checkpoint(folder, device=device, dtype=dtype)
