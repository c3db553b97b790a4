"""Weight files read safely: safetensors headers checked before any parser sees them, shards listed from their index.

Weights are read with safetensors only: nothing is unpickled, no remote code runs, nothing is
downloaded. Each weights file's header is checked against the file (`check_safetensors`): a header
length over 100 MB or past the end of the file, a header that is not JSON, a tensor whose bytes are
not in the file or whose dtype is not a float are refused with an error naming the file. A sharded
folder's index (model.safetensors.index.json) may name only plain .safetensors files inside the
folder; a folder with only pickle weights (.bin, .pt, ...) is refused, never unpickled.

The bottom layer of model loading: engine/families and engine/weights read weights through this
module, and it imports neither.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

from safetensors.torch import load_file


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found or loaded; the message says what to do next."""


# A real header is a few kB per thousand tensors; safetensors itself stops at the same 100 MB.
HEADER_LIMIT = 100 * 1024 * 1024
# weights are floats; the loader casts them to the device's dtype (integer or bool tensors would be
# assigned as they are and fail only at the first step)
WEIGHT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def regular_file(path: Path) -> os.stat_result:
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
    size = regular_file(path).st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{path} is truncated ({size} bytes): a safetensors file starts with an 8-byte header length"
            )
        (n,) = struct.unpack("<Q", head)
        if n > HEADER_LIMIT:
            raise CheckpointError(
                f"{path}: the header claims {n:,} bytes, over the {HEADER_LIMIT // 2**20} MB "
                "limit; not a safetensors file, or a corrupted one"
            )
        if 8 + n > size:
            raise CheckpointError(
                f"{path} is truncated: the header claims {n:,} bytes, the file has {size - 8:,} after the length"
            )
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
        if not (
            isinstance(t, dict)
            and isinstance(t.get("shape"), list)
            and isinstance(t.get("data_offsets"), list)
            and len(t["data_offsets"]) == 2
            and all(isinstance(x, int) and x >= 0 for x in t["shape"] + t["data_offsets"])
        ):
            raise CheckpointError(f"{path}: bad safetensors header entry for tensor {name!r}")
        if t.get("dtype") not in dtypes:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {t.get('dtype')!r}; "
                f"{'weights' if dtypes is WEIGHT_DTYPES else 'its tensors'} must be one of {', '.join(dtypes)}"
            )
        begin, end = t["data_offsets"]
        if end - begin != math.prod(t["shape"]) * dtypes[t["dtype"]]:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {t['shape']} but {end - begin} bytes")
        if end > data:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} ends at byte {end:,} of the data, the file has {data:,}"
            )
    return header


def load_safetensors(path: Path) -> dict:
    """The tensors of one weights file (name -> CPU torch.Tensor), its header checked first."""
    check_safetensors(path)
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - whatever safetensors finds, the message names the file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def shard_names(index: Path) -> list[str]:
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


def has_weights(folder: Path) -> bool:
    """True when `folder` has model.safetensors or a shard index (model.safetensors.index.json)."""
    return (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists()


def refuse_pickles(folder: Path) -> None:
    """Raises CheckpointError when `folder` has pickle weights (which are never loaded) and nothing else."""
    pickles = sorted(p.name for ext in ("bin", "pt", "pth", "ckpt") for p in folder.glob(f"*.{ext}"))
    if pickles:
        raise CheckpointError(
            f"{folder} has only pickle weights ({', '.join(pickles)}), which are never loaded "
            "(unpickling can run code); convert them to safetensors"
        )


def weight_paths(folder: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json lists, in order."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        return [folder / s for s in shard_names(index)]
    refuse_pickles(folder)
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def read_weights(folder: Path) -> dict:
    """The state dict (name -> CPU torch.Tensor) of model.safetensors or of every shard its index lists."""
    sd: dict = {}
    for path in weight_paths(folder):
        sd.update(load_safetensors(path))
    return sd
