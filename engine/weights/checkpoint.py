"""This project's checkpoint folders: where a model name is (`resolve_model_path`), how one is written
(`save_checkpoint`) and the serving defaults it carries (`serving_defaults`).

A folder holds config.json (engine/model/config.py), model.safetensors (or shards:
engine/weights/shard.py), tokenizer.json, and optionally serving.json and training_state.json. A name
is a local folder or a repo id already in the local Hugging Face cache; nothing is downloaded.
engine/weights/load.py reads a folder back, whatever kind it is; engine/model/weight_files.py reads
its weights files safely.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TypeGuard

from safetensors.torch import save_file

from engine.model.transformer import Transformer
from engine.model.weight_files import CheckpointError
from engine.paths import DEFAULT_MODEL_DIR
from engine.tokenizer import TextTokenizer


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
        hub = Path(
            os.environ.get("HF_HUB_CACHE")
            or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
        )
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


def _weight(v: float) -> bool:
    return 0 <= v <= 50


GATE_KINDS = ("line", "block", "middle", "args")  # the hole kinds a per-kind gate may name (the server's)


def serving_defaults(folder: Path) -> dict:
    """The model's own serving defaults from `serving.json` in its folder: {"min_confidence": float in
    [0, 1], or {hole kind: float in [0, 1]}} (the confidence gate chosen from its held-out
    accepted-vs-shown curve, for every kind or per kind; 1.0 hides a kind), {"decode":
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
    elif isinstance(gate, dict):  # one gate per hole kind (1.0: that kind is not shown by default)
        kinds = {k: float(v) for k, v in gate.items() if k in GATE_KINDS and _number(v) and 0.0 <= v <= 1.0}
        if kinds:
            out["min_confidence"] = kinds
    # decoding the model was tuned with (the context copy boost): only known keys, in range
    dec = raw.get("decode")
    if not isinstance(dec, dict):
        dec = {}
    ok: dict[str, object] = {
        k: v
        for k, v in dec.items()
        if (k in ("copy_bigram", "copy_unigram", "copy_far", "names") and _number(v) and 0 <= v <= 20)
        or (k == "copy_order" and isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 8)
        or (k == "copy_chain" and isinstance(v, bool))
        or (k == "stop_below" and _number(v) and 0 <= v < 1)
    }
    for key in ("ngram", "local_ngram", "workspace_ngram"):  # the corpus n-gram memory, the fill's own, the workspace's
        if _number(dec.get(key)) and 0 <= dec[key] <= 50:
            ok[key] = float(dec[key])
    # per hole kind (api.KIND_DECODE_KEYS): the n-gram weights, and the stop (a line hole's best stop need not be a block's)
    for key, in_range in (
        ("ngram", _weight),
        ("local_ngram", _weight),
        ("workspace_ngram", _weight),
        ("stop_below", lambda v: 0 <= v < 1),
    ):
        given = dec.get(f"{key}_kinds")
        if not isinstance(given, dict):
            given = {}
        kinds = {k: float(v) for k, v in given.items() if isinstance(k, str) and _number(v) and in_range(v)}
        if kinds:
            ok[f"{key}_kinds"] = kinds
    if ok:
        out["decode"] = ok
    # the calibrated gate (dlm_lsp.fill.gate.Calibrator), checked by the server that applies it
    if isinstance(raw.get("calibrator"), dict):
        out["calibrator"] = raw["calibrator"]
    return out


def _number(v: object) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def save_checkpoint(
    folder: str | os.PathLike, model: Transformer, tok: TextTokenizer, extra: dict | None = None
) -> None:
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
