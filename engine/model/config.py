"""Model configuration, read from a checkpoint folder's config.json.

`ModelConfig` is what the one decoder (engine/model/transformer.py) needs to know about a checkpoint,
so that no family's choice is a constant in code:
  shapes        grouped-query attention (`n_kv_heads`; None: as many as `n_heads`) and a per-head
                width `head_size` where it is not dim // n_heads (Qwen3's `head_dim`)
  biases        on the q/k/v projections (Qwen2), the attention output, the MLP
  QK-norm       per-head RMSNorm of queries and keys
  RoPE          `rope_theta` and linear scaling (`rope_linear_factor`: positions divided by it)
  topology      `attention`: bidirectional (diffusion), causal (the AR twin, WeDLM) or block-causal
                with `block_size` (SDAR, Fast-dLLM v2; `sub_block_size` for the latter's sub-blocks),
                blocks by absolute position; `canvas` "reorder" is recipe (c)'s causal reordered layout
  logit shift   `logits_shift`: the logit at i-1 predicts token i (Dream-style models, the default
                among them: recipe (b) adapts an autoregressive model and keeps its shift); without
                it the logit at a masked slot predicts that slot
  context_len   the longest sequence the model was trained on; fills are cut to it
  special ids   mask, pad, end-of-text, beginning-of-text and DreamOn's expand (a predicted expand
                becomes two masks), each from the checkpoint's files: the same id means different
                tokens in different families; `end_ids`, every id that ends a fill (end-of-text and
                the end-of-turn ids of chat checkpoints, `eot_token_ids`).
`validate()` refuses, naming the value, what the decoder cannot run (a topology without its block
size, a reordered canvas on a non-causal or shifted model, an id outside the vocabulary).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that cannot describe a model this engine runs."""


ATTENTIONS = ("bidirectional", "causal", "block_causal")
CANVASES = (None, "reorder")


@dataclass
class ModelConfig:
    """Shape and special ids of a checkpoint. Nothing here is a constant in code: every id comes
    from the checkpoint's files, because mask/pad ids collide across model families."""

    vocab_size: int = 8192
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention (Qwen2/3, LLaDA-GQA); None: n_heads
    head_size: int | None = None  # per-head width when it is not dim // n_heads (Qwen3's `head_dim`)
    ffn_dim: int = 768
    max_seq_len: int = 1024
    context_len: int | None = None  # longest sequence the model was trained on; fills are cut to it
    rope_theta: float = 10000.0
    rope_linear_factor: float = 1.0  # rope_scaling {"type": "linear", "factor": f}: positions divided by f
    norm_eps: float = 1e-5
    qk_norm: bool = True  # without it a tiny bidirectional model's attention collapses (REFERENCES s.5)
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    out_bias: bool = False  # bias on the attention output projection (Llama attention_bias)
    mlp_bias: bool = False
    tie_embeddings: bool = True
    # "bidirectional" (diffusion), "causal" (the AR twin, WeDLM) or "block_causal" (SDAR, Fast-dLLM v2:
    # position p sees every position q with q // block_size <= p // block_size, blocks aligned to 0)
    attention: str = "bidirectional"
    block_size: int = 0  # block_causal only
    logits_shift: bool = False  # True: the logit at i-1 predicts token i (Dream-style)
    # canvas layout: None, the slots in place between prefix and suffix; "reorder" (recipe (c),
    # engine/decode/reorder.py): causal attention in physical order [prefix][suffix][committed slots][masks],
    # each row at its logical position, the logit at a masked slot predicting that slot's own token
    canvas: str | None = None
    mask_token_id: int = 2
    pad_token_id: int = 0
    eos_token_id: int = 1
    bos_token_id: int | None = 3
    model_type: str = "dlm-lsp"
    family: str = "dlm-lsp"  # engine/families name of the adapter that read the checkpoint
    expand_token_id: int | None = None  # DreamOn: a predicted expand becomes two masks (engine/families/dreamon.py)
    sub_block_size: int = 0  # Fast-dLLM v2: a block's sub-blocks are decoded left to right (engine/families/blocks.py)
    # ids besides end-of-text that end a fill as it does (`end_ids`): an instruct LLaDA's <|eot_id|>,
    # config.json's further eos ids; from the checkpoint's files (engine/families/specials.py)
    eot_token_ids: tuple[int, ...] = ()

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every id that ends a fill: end-of-text first, then `eot_token_ids`."""
        return (self.eos_token_id, *(t for t in self.eot_token_ids if t != self.eos_token_id))

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def validate(self) -> ModelConfig:
        if self.head_size is None and self.dim % self.n_heads:
            raise ConfigError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"attention must be one of {', '.join(map(repr, ATTENTIONS))}, got {self.attention!r}")
        if self.canvas not in CANVASES:
            raise ConfigError(f"canvas must be one of {', '.join(map(repr, CANVASES))}, got {self.canvas!r}")
        if self.canvas == "reorder" and (self.attention != "causal" or self.logits_shift):
            raise ConfigError("canvas 'reorder' needs attention 'causal' and no logits_shift")
        if (self.attention == "block_causal") != (self.block_size > 0):
            raise ConfigError(
                f"block_size {self.block_size} goes with attention 'block_causal' only (got {self.attention!r})"
            )
        for name in ("mask_token_id", "pad_token_id", "eos_token_id"):
            tid = getattr(self, name)
            if not 0 <= tid < self.vocab_size:
                raise ConfigError(f"{name}={tid} outside vocab of {self.vocab_size}")
        self.eot_token_ids = tuple(self.eot_token_ids)  # config.json holds a list
        if any(not 0 <= t < self.vocab_size or t == self.mask_token_id for t in self.eot_token_ids):
            raise ConfigError(
                f"eot_token_ids {list(self.eot_token_ids)}: outside vocab of {self.vocab_size} or the mask"
            )
        return self

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known}).validate()

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
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
