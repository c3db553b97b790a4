"""The GPU bench's shapes and tools (dlm_lsp/measure/gpu_bench.py): the three real shapes as config.json
keys read through their families' adapters, the random model built on the device, the bytes a step
must read, a device clock, the copy bandwidth, and what every section is given (`Setup`, `Built`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.decode.static import StaticStep
    from engine.model.config import ModelConfig
    from engine.model.transformer import Transformer
    from engine.tokenizer import TextTokenizer

# name -> (engine/families name, config.json keys as the checkpoint has them)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "dream-7b": (  # Dream-org/Dream-v0-Instruct-7B: Qwen2.5-7B shapes (../shared/FAMILIES.md)
        "dream",
        dict(
            architectures=["DreamModel"],
            model_type="Dream",
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=131072,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            hidden_act="silu",
            mask_token_id=151666,
            eos_token_id=151643,
            pad_token_id=151643,
            bos_token_id=151665,
        ),
    ),
    "llada-8b": (  # GSAI-ML/LLaDA-8B-Instruct: OLMo keys, 32/32 heads (full multi-head K/V)
        "llada",
        dict(
            architectures=["LLaDAModelLM"],
            model_type="llada",
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=32,
            mlp_hidden_size=12288,
            vocab_size=126464,
            embedding_size=126464,
            rope_theta=500000.0,
            max_sequence_length=4096,
            rms_norm_eps=1e-5,
            weight_tying=False,
            block_type="llama",
            activation_type="silu",
            layer_norm_type="rms",
            rope=True,
            alibi=False,
            include_bias=False,
            mask_token_id=126336,
            eos_token_id=126081,
            pad_token_id=126081,
        ),
    ),
    "sdar-8b": (  # JetLM/SDAR-8B-Chat: Qwen3-8B shapes, block-causal attention, block size 4
        "sdar",
        dict(
            architectures=["SDARForCausalLM"],
            model_type="sdar",
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            hidden_act="silu",
            attention_bias=False,
            block_size=4,
            mask_token_id=151669,
            eos_token_id=151643,
            bos_token_id=151643,
        ),
    ),
}
# --dry-run: the same families at 2 layers x 64 with the default model's tokenizer's vocabulary and
# special ids (the service's jobs are text, tokenized by it)
TINY_QWEN = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
TINY = {
    "dream-7b": TINY_QWEN,
    "llada-8b": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=128, embedding_size=8192),
    "sdar-8b": {**TINY_QWEN, "head_dim": 16},
}
TINY_IDS = dict(vocab_size=8192, mask_token_id=2, pad_token_id=0, eos_token_id=1, bos_token_id=3)


@dataclass
class Setup:
    """What every section reads."""

    dev: torch.device
    dtype: torch.dtype
    dry: bool
    context: int
    reps: int
    timed_steps: int  # cached steps timed per repetition
    modes: tuple[str, ...]  # "loop" (the eager loop), then the fixed-shape step's modes
    fast: str  # the fixed-shape mode the service runs here: "graph" on CUDA, "eager" on the CPU
    threads: int
    bandwidth_gb_s: float
    tok: TextTokenizer
    words: list[int]  # token ids for canvases built without text
    deadline: float  # time.monotonic() past which sections are skipped


@dataclass
class Built:
    name: str
    cfg: ModelConfig
    model: Transformer
    bytes_per_step: int
    floor_ms: float
    statics: dict[str, StaticStep] = field(default_factory=dict)  # per mode, kept across sections (graphs)
    step_ms: float = 0.0  # the fast mode's cached step at 32 rows, once measured (staggers arrivals)


def model_config(name: str, dry: bool) -> ModelConfig:
    """The engine's config of a shape from its config.json keys, through its family's adapter."""
    from engine.families.registry import FAMILIES
    from engine.families.specials import TokenFiles

    family, keys = MODELS[name]
    if dry:
        keys = {**keys, **TINY[name], **TINY_IDS}
    fam = next(f for f in FAMILIES if f.name == family)
    return fam.engine_config(keys, TokenFiles(keys, {}, {}, None))


def random_model(cfg: ModelConfig, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """The model built on the meta device, allocated once on `dev` in `dtype` (to_empty) and filled
    there with small normal noise: a 16 GB model never passes through host memory."""
    from engine.model.transformer import Transformer, rope_tables

    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype).to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.rope_cos, model.rope_sin = rope_tables(cfg, device=dev)  # fp32, computed on the device
    return model.eval()


def step_bytes(model: Transformer, context: int, rows: int) -> int:
    """Bytes one cached step must read: every weight it multiplies by (the head, not the embedding
    table, of which it gathers a few rows) and the K/V of the context and its own rows."""
    cfg = model.cfg
    weights = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if not (n == "tok_embeddings.weight" and model.output is not None)
    )
    kv = 2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim * (context + rows) * model.tok_embeddings.weight.element_size()
    return weights + kv


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Clock:
    """ms of a block: CUDA events on a GPU (synchronized at both ends), perf_counter on a CPU."""

    def __init__(self, dev: torch.device):
        self.dev, self.ms = dev, 0.0

    def __enter__(self) -> Clock:
        sync(self.dev)
        if self.dev.type == "cuda":
            self._a, self._b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._a.record()
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.dev.type == "cuda":
            self._b.record()
            self._b.synchronize()
            self.ms = self._a.elapsed_time(self._b)
        else:
            self.ms = (time.perf_counter() - self._t) * 1000


def copy_bandwidth(dev: torch.device, nbytes: int, iters: int) -> dict:
    """A large device copy: GB/s counting the bytes read and the bytes written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    with Clock(dev) as t:
        for _ in range(iters):
            dst.copy_(src)
    del src, dst
    return {"bytes": nbytes, "iters": iters, "ms": t.ms, "gb_s": 2 * nbytes * iters / (t.ms / 1000) / 1e9}
