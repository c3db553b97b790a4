"""Checkpoint folders in the HF layout: config.json + model.safetensors (+ shards) + tokenizer.json.

Weights are read with safetensors only: nothing is unpickled, no remote code runs, nothing is
downloaded. A name is a local folder or a repo id already in the local Hugging Face cache. Each
weights file's header is checked before safetensors parses it (`check_safetensors`): a header length
over 100 MB or past the end of the file, a header that is not JSON, a tensor whose bytes are not in
the file or whose dtype is not a float are refused with an error naming the file.
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.model.config import ConfigError, ModelConfig
from engine.model.transformer import Transformer
from engine.tokenizer import TextTokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
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


SERVING_FILE = "serving.json"  # per-model serving defaults written by the project (today: the fill gate)


def _weight(v) -> bool:
    return 0 <= v <= 50


def serving_defaults(folder: Path) -> dict:
    """The model's own serving defaults from `serving.json` in its folder: {"min_confidence": float in
    [0, 1]} (the confidence gate chosen from its held-out accepted-vs-shown curve), {"decode":
    {...}} (DecodeOptions it was tuned with: api.MODEL_DECODE_KEYS, and "ngram_kinds" /
    "local_ngram_kinds" / "workspace_ngram_kinds" / "stop_below_kinds": those per hole kind) and {"calibrator": {...}} (the
    gate's acceptance model, dlm_lsp.fill.gate). Missing, unreadable or
    out-of-range values are left out (the server's own defaults), never an error."""
    path = Path(folder) / SERVING_FILE
    try:
        if not path.is_file() or path.stat().st_size > 64 * 1024:
            return {}
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict = {}
    gate = raw.get("min_confidence")
    if _number(gate) and 0.0 <= gate <= 1.0:
        out["min_confidence"] = float(gate)
    # decoding the model was tuned with (the context copy boost): only known keys, in range
    dec = raw.get("decode") if isinstance(raw.get("decode"), dict) else {}
    ok = {k: v for k, v in dec.items() if (k in ("copy_bigram", "copy_unigram", "copy_far", "names") and _number(v) and 0 <= v <= 20)
          or (k == "copy_order" and isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 8)
          or (k == "copy_chain" and isinstance(v, bool))
          or (k == "stop_below" and _number(v) and 0 <= v < 1)}
    for key in ("ngram", "local_ngram", "workspace_ngram"):  # the corpus n-gram memory, the fill's own, the workspace's
        if _number(dec.get(key)) and 0 <= dec[key] <= 50:
            ok[key] = float(dec[key])
    # per hole kind (api.KIND_DECODE_KEYS): the n-gram weights, and the stop (a line hole's best stop need not be a block's)
    for key, in_range in (("ngram", _weight), ("local_ngram", _weight), ("workspace_ngram", _weight),
                          ("stop_below", lambda v: 0 <= v < 1)):
        kinds = dec.get(f"{key}_kinds") if isinstance(dec.get(f"{key}_kinds"), dict) else {}
        kinds = {k: float(v) for k, v in kinds.items() if isinstance(k, str) and _number(v) and in_range(v)}
        if kinds:
            ok[f"{key}_kinds"] = kinds
    if ok:
        out["decode"] = ok
    # the calibrated gate (dlm_lsp.fill.gate.Calibrator), checked by the server that applies it
    if isinstance(raw.get("calibrator"), dict):
        out["calibrator"] = raw["calibrator"]
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# A real header is a few kB per thousand tensors; safetensors itself stops at the same 100 MB.
HEADER_LIMIT = 100 * 1024 * 1024
# weights are floats; the loader casts them to the device's dtype (integer or bool tensors would be
# assigned as they are and fail only at the first step)
WEIGHT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def _regular_file(path: Path) -> os.stat_result:
    """stat of `path`, which must be a regular file (not a FIFO or device that would block or never end)."""
    try:
        st = path.stat()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path} is not a regular file")
    return st


def check_safetensors(path: Path, dtypes: dict[str, int] = WEIGHT_DTYPES) -> dict:
    """Returns the safetensors header of `path` after checking it against the file, before any
    parser sees it; raises CheckpointError naming the file and what is wrong. `dtypes`: the
    allowed dtypes and their sizes (weights: floats; engine/bias/ngram.py's table: its integer ids too)."""
    size = _regular_file(path).st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): a safetensors file starts with an "
                                  "8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > HEADER_LIMIT:
            raise CheckpointError(f"{path}: the header claims {n:,} bytes, over the {HEADER_LIMIT // 2**20} MB "
                                  "limit; not a safetensors file, or a corrupted one")
        if 8 + n > size:
            raise CheckpointError(f"{path} is truncated: the header claims {n:,} bytes, the file has {size - 8:,} "
                                  "after the length")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: bad safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: bad safetensors header (not a JSON object)")
    data = size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(t, dict) and isinstance(t.get("shape"), list) and isinstance(t.get("data_offsets"), list)
                and len(t["data_offsets"]) == 2
                and all(isinstance(x, int) and x >= 0 for x in t["shape"] + t["data_offsets"])):
            raise CheckpointError(f"{path}: bad safetensors header entry for tensor {name!r}")
        if t.get("dtype") not in dtypes:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {t.get('dtype')!r}; "
                                  f"{'weights' if dtypes is WEIGHT_DTYPES else 'its tensors'} must be one of {', '.join(dtypes)}")
        begin, end = t["data_offsets"]
        if end - begin != math.prod(t["shape"]) * dtypes[t["dtype"]]:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {t['shape']} but {end - begin} bytes")
        if end > data:
            raise CheckpointError(f"{path} is truncated: tensor {name!r} ends at byte {end:,} of the data, the file "
                                  f"has {data:,}")
    return header


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    check_safetensors(path)
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - whatever safetensors finds, the message names the file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _shard_names(index: Path) -> list[str]:
    """The shard files an index lists; each must be a plain .safetensors name inside its folder."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
    for s in shards:
        if not (isinstance(s, str) and s == Path(s).name and not s.startswith(".") and s.endswith(".safetensors")):
            raise CheckpointError(f"{index}: shard {s!r} is not a .safetensors file name in {index.parent}")
    return shards


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Reads model.safetensors, the shards listed in model.safetensors.index.json, or a delta folder
    (delta.json + delta.safetensors over a base found on this machine: engine/weights/delta.py)."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.exists():
        return _load_safetensors(single)
    if index.exists():
        sd: dict[str, torch.Tensor] = {}
        for s in _shard_names(index):
            sd.update(_load_safetensors(folder / s))
        return sd
    if (folder / "delta.json").exists():
        from engine.weights.delta import load_delta_state_dict

        return load_delta_state_dict(folder)
    pickles = sorted(p.name for ext in ("bin", "pt", "pth", "ckpt") for p in folder.glob(f"*.{ext}"))
    if pickles:
        raise CheckpointError(f"{folder} has only pickle weights ({', '.join(pickles)}), which are never loaded "
                              "(unpickling can run code); convert them to safetensors")
    raise CheckpointError(f"no model.safetensors in {folder}")


def load_checkpoint(name=None, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Returns (model in eval mode, tokenizer, config) for a checkpoint folder of this project's format."""
    folder = resolve_model_path(name)
    from engine.families import is_family_checkpoint, load_family  # Dream, LLaDA, ... (engine/families)

    if is_family_checkpoint(folder):
        return load_family(folder, device, dtype)
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
    from engine.model.transformer import rope_tables

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
