"""Loads a family checkpoint: meta-device model, safetensors shard by shard, names mapped once.

The model is built on the meta device (no memory). Each shard's header is checked against the file
(engine/model/weight_files.py `check_safetensors`: offsets inside the file, byte counts matching shapes,
float dtypes only); then each tensor is renamed, allocated in the target dtype on the target device
and filled from the file in chunks through one 32 MB scratch buffer. Host memory holds the
converted weights plus that buffer (on CUDA, the buffer only): a memory-mapped read (safetensors
`safe_open`) kept the mapped pages of the whole file resident until it closed (1.6x the fp32 bytes
of a 0.5B model; docs/MODELS.md has the measurement). Nothing is unpickled, no remote code runs, nothing is
downloaded.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine.families.layouts import rename
from engine.families.registry import Family, detect
from engine.families.specials import TokenFiles
from engine.model.config import ConfigError, ModelConfig
from engine.model.transformer import Transformer, rope_tables
from engine.model.weight_files import CheckpointError, check_safetensors, weight_paths
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


def family_config(folder: Path) -> tuple[Family, ModelConfig]:
    """(Family, ModelConfig) of a family checkpoint folder, special ids from its files."""
    folder = Path(folder)
    cfg = read_config(folder)
    files = TokenFiles.read(folder, cfg)
    fam = detect(folder, cfg, files)
    return fam, fam.engine_config(cfg, files)


def load_family(
    folder: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    forward_only: bool = False,
) -> tuple[Transformer, TextTokenizer, ModelConfig]:
    """Returns (model in eval mode, tokenizer, config) for a family checkpoint. `forward_only`
    admits families the engine cannot decode yet (WeDLM) for parity checks."""
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
    for path in weight_paths(folder):
        header = check_safetensors(path)
        for name, shape, fill in read_tensors(path, header):
            _take(fam, cfg, name, shape, fill, want, sd, device, dtype, path)
    if cfg.tie_embeddings:
        sd.pop("output.weight", None)  # a tied checkpoint may still store its head; transformers ignores it
    missing = sorted(set(want) - set(sd))
    if missing:
        raise CheckpointError(
            f"{folder}: {fam.title} checkpoint lacks {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        )
    model.load_state_dict(sd, assign=True, strict=True)
    cos, sin = rope_tables(cfg, device=None)  # non-persistent buffers: computed on the CPU in fp32
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.eval(), tok, cfg


FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


CHUNK_BYTES = 32 * 2**20  # one read's size: the scratch memory a load needs beyond the weights


def read_tensors(path: Path, header: dict) -> Iterator[tuple[str, tuple[int, ...], Callable[[torch.Tensor], None]]]:
    """Yields (name, shape, fill) for each tensor of a checked safetensors file, in file order;
    fill(out) copies the tensor into `out` (any dtype and device, same number of elements) through
    one scratch buffer of CHUNK_BYTES, so no tensor is ever held twice in host memory."""
    entries = sorted(((n, t) for n, t in header.items() if n != "__metadata__"), key=lambda x: x[1]["data_offsets"][0])
    scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        base = 8 + n
        for name, t in entries:
            file_dtype = FILE_DTYPES[t["dtype"]]
            size = file_dtype.itemsize
            begin = t["data_offsets"][0]

            def fill(
                out: torch.Tensor,
                begin: int = begin,
                file_dtype: torch.dtype = file_dtype,
                size: int = size,
                name: str = name,
            ) -> None:
                flat, per = out.view(-1), CHUNK_BYTES // size
                for e0 in range(0, flat.numel(), per):
                    count = min(per, flat.numel() - e0)
                    buf = scratch[: count * size]
                    f.seek(base + begin + e0 * size)
                    # numpy's stubs declare ndarray's buffer protocol (__buffer__) for Python >= 3.12 only
                    if f.readinto(memoryview(buf.numpy())) != count * size:  # type: ignore[arg-type]
                        raise CheckpointError(f"{path} is truncated inside tensor {name!r}")
                    flat[e0 : e0 + count].copy_(buf.view(file_dtype))

            yield name, tuple(t["shape"]), fill


def _take(
    fam: Family,
    cfg: ModelConfig,
    name: str,
    shape: tuple[int, ...],
    fill: Callable[[torch.Tensor], None],
    want: dict[str, torch.Size],
    sd: dict[str, torch.Tensor],
    device: str | torch.device,
    dtype: torch.dtype,
    path: Path,
) -> None:
    """Reads one tensor, renamed and converted, into sd (shape-checked against the model)."""
    try:
        target = rename(fam.layout, name)
    except KeyError:
        raise CheckpointError(
            f"{path}: tensor {name!r} is not part of a {fam.title} model "
            f"(layout {fam.layout}); is this the right family?"
        ) from None
    if target is None:
        return
    if target not in want:
        if target == "output.weight" and cfg.tie_embeddings:
            return
        raise CheckpointError(
            f"{path}: tensor {name!r} ({target}) does not fit the config (biases or norms the config does not declare)"
        )
    if shape != tuple(want[target]):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {shape}, the config implies {tuple(want[target])}")
    out = torch.empty(shape, dtype=dtype, device=device)
    fill(out)
    sd[target] = out
