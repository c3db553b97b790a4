"""Model configuration, read from a checkpoint folder's config.json."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that cannot describe a model this engine runs."""


@dataclass
class ModelConfig:
    """Shape and special ids of a checkpoint. Nothing here is a constant in code: every id comes
    from the checkpoint's files, because mask/pad ids collide across model families."""

    vocab_size: int = 8192
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 768
    max_seq_len: int = 1024
    context_len: int | None = None  # longest sequence the model was trained on; fills are cut to it
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = True  # without it a tiny bidirectional model's attention collapses (REFERENCES s.5)
    tie_embeddings: bool = True
    attention: str = "bidirectional"  # "bidirectional" (diffusion) or "causal" (the AR twin)
    logits_shift: bool = False  # True: the logit at i-1 predicts token i (Dream-style)
    mask_token_id: int = 2
    pad_token_id: int = 0
    eos_token_id: int = 1
    bos_token_id: int | None = 3
    model_type: str = "dlm-lsp"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> "ModelConfig":
        if self.dim % self.n_heads:
            raise ConfigError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.attention not in ("bidirectional", "causal"):
            raise ConfigError(f"attention must be 'bidirectional' or 'causal', got {self.attention!r}")
        for name in ("mask_token_id", "pad_token_id", "eos_token_id"):
            tid = getattr(self, name)
            if not 0 <= tid < self.vocab_size:
                raise ConfigError(f"{name}={tid} outside vocab of {self.vocab_size}")
        return self

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known}).validate()

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"no config.json at {p}") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from e
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, folder: str | Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
