"""The supported checkpoints already in the local Hugging Face cache (read only, no network), and
`dlm-lsp models`, which lists them beside the supported families."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from engine.families.loader import family_config, is_family_checkpoint
from engine.families.registry import FAMILIES
from engine.model.config import ConfigError


def hub_dir() -> Path:
    """HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub (as huggingface_hub does)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser() / "hub"


@dataclass
class CachedModel:
    repo_id: str
    path: Path  # the snapshot folder
    family: str | None  # None: not a supported checkpoint
    detail: str  # shapes and ids, or why it is not supported


def scan(hub: Path | None = None) -> list[CachedModel]:
    """Every model snapshot in the cache with a config.json, newest snapshot per repo first."""
    hub = hub or hub_dir()
    out: list[CachedModel] = []
    if not hub.is_dir():
        return out
    for repo in sorted(hub.glob("models--*")):
        repo_id = repo.name[len("models--") :].replace("--", "/")
        ref = repo / "refs" / "main"
        snaps = [repo / "snapshots" / ref.read_text().strip()] if ref.is_file() else []
        snaps += sorted((p for p in (repo / "snapshots").glob("*") if p not in snaps), reverse=True)
        snap = next((s for s in snaps if (s / "config.json").is_file()), None)
        if snap is None:
            continue
        if not is_family_checkpoint(snap):
            out.append(CachedModel(repo_id, snap, "dlm-lsp", "this project's own format"))
            continue
        try:
            fam, cfg = family_config(snap)
        except ConfigError as e:
            out.append(CachedModel(repo_id, snap, None, str(e).replace(str(snap) + ": ", "")))
            continue
        detail = (
            f"{cfg.n_layers}x{cfg.dim}, {cfg.n_heads}/{cfg.kv_heads} heads, vocab {cfg.vocab_size}, "
            f"{cfg.attention}{f' {cfg.block_size}' if cfg.block_size else ''}, "
            f"{'shifted' if cfg.logits_shift else 'unshifted'}, mask {cfg.mask_token_id}"
        )
        out.append(CachedModel(repo_id, snap, fam.name, detail + ("" if fam.decodes else " (forward only)")))
    return out


def add_models_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache", default=None, help="Hugging Face hub cache folder (default: HF_HUB_CACHE / HF_HOME / ~/.cache)"
    )


def run_models(args: argparse.Namespace) -> int:
    print("supported families:")
    for f in FAMILIES:
        extra = f" - {f.note}" if f.note else ""
        topo = f.attention + (" + reorder" if f.canvas == "reorder" else "")
        print(
            f"  {f.name:13} {f.title}: {topo}{', shifted' if f.logits_shift else ''}; "
            f"= transformers {f.hf_class}; {f.licence}{'' if f.decodes else ' (forward only)'}{extra}"
        )
    hub = Path(args.cache).expanduser() if args.cache else hub_dir()
    found = scan(hub)
    print(f"\ncheckpoints in {hub}:" + ("" if found else " none"))
    for m in found:
        tag = m.family or "unsupported"
        print(f"  {m.repo_id:45} {tag:13} {m.detail}")
    if any(m.family and m.family != "dlm-lsp" for m in found):
        print(
            '\nuse one with: dlm-lsp complete FILE:LINE:COL --model <repo id>, or initializationOptions {"model": "<repo id>"}'
        )
    return 0
