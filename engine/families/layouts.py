"""Checkpoint layouts: a family's config.json keys -> the shape fields of ModelConfig, and its tensor
names -> engine/model/transformer.py's. Four layouts cover every family: `qwen2` (q/k/v biases), `qwen3`
(per-head q/k RMS norm, explicit head_dim), `wedlm` (either, as its config says), and `llada`
(OLMo-style names over a Llama block).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from engine.model.config import ConfigError

# The rope tables are precomputed up to the model's window; an editor's context is a few thousand
# tokens, and a 128k table of a 128-wide head would take 128 MB.
MAX_POSITIONS = 16384

# HF Qwen2/Qwen3/Llama names -> engine names (one place, applied at load time)
HF_NAMES = [
    (r"^model\.embed_tokens\.weight$", "tok_embeddings.weight"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"layers.\1.attn_norm.weight"),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", r"layers.\1.ffn_norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)$", r"layers.\1.attn.wq.\2"),
    (r"^model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)$", r"layers.\1.attn.wk.\2"),
    (r"^model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)$", r"layers.\1.attn.wv.\2"),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)$", r"layers.\1.attn.wo.\2"),
    (r"^model\.layers\.(\d+)\.self_attn\.q_norm\.weight$", r"layers.\1.attn.q_norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.k_norm\.weight$", r"layers.\1.attn.k_norm.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.(weight|bias)$", r"layers.\1.mlp.w1.\2"),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.(weight|bias)$", r"layers.\1.mlp.w3.\2"),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.(weight|bias)$", r"layers.\1.mlp.w2.\2"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^lm_head\.weight$", "output.weight"),
]
# LLaDA (OLMo code): model.transformer.blocks.N.* -> the same engine names
LLADA_NAMES = [
    (r"^model\.transformer\.wte\.weight$", "tok_embeddings.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.attn_norm\.weight$", r"layers.\1.attn_norm.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_norm\.weight$", r"layers.\1.ffn_norm.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.q_proj\.(weight|bias)$", r"layers.\1.attn.wq.\2"),
    (r"^model\.transformer\.blocks\.(\d+)\.k_proj\.(weight|bias)$", r"layers.\1.attn.wk.\2"),
    (r"^model\.transformer\.blocks\.(\d+)\.v_proj\.(weight|bias)$", r"layers.\1.attn.wv.\2"),
    (r"^model\.transformer\.blocks\.(\d+)\.attn_out\.(weight|bias)$", r"layers.\1.attn.wo.\2"),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_proj\.(weight|bias)$", r"layers.\1.mlp.w1.\2"),
    (r"^model\.transformer\.blocks\.(\d+)\.up_proj\.(weight|bias)$", r"layers.\1.mlp.w3.\2"),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_out\.(weight|bias)$", r"layers.\1.mlp.w2.\2"),
    (r"^model\.transformer\.ln_f\.weight$", "norm.weight"),
    (r"^model\.transformer\.ff_out\.weight$", "output.weight"),
]
# buffers some exporters wrote next to the weights; recomputed by the engine
IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rope\.(inv_freq|cos|sin).*)$")

NAME_MAPS = {"qwen2": HF_NAMES, "qwen3": HF_NAMES, "wedlm": HF_NAMES, "llada": LLADA_NAMES}


def rename(layout: str, name: str) -> str | None:
    """The engine's name for a checkpoint tensor; None for a buffer the engine recomputes. Raises
    KeyError for a name the layout does not know (it would be a weight the engine cannot compute)."""
    if IGNORED.search(name):
        return None
    for pat, rep in NAME_MAPS[layout]:
        if re.match(pat, name):
            return re.sub(pat, rep, name)
    raise KeyError(name)


def _rope(cfg: dict) -> tuple[float, float]:
    """(theta, linear factor) from `rope_theta` + `rope_scaling`, or transformers 5's `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return theta, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, 1.0
    if kind == "linear":
        return theta, float(scaling["factor"])
    raise ConfigError(f"rope scaling {kind!r} is not supported (supported: none, 'linear')")


def _require(cfg: dict, key: str, ok: Callable[[Any], object], what: str) -> None:
    if key in cfg and not ok(cfg[key]):
        raise ConfigError(f"config.json {key}={cfg[key]!r}: {what}")


def shape_fields(layout: str, cfg: dict) -> dict:
    """ModelConfig fields (shapes, biases, norms, rope, head tying) for a config.json of `layout`."""
    if layout == "llada":
        return _llada(cfg)
    _require(cfg, "hidden_act", lambda v: v == "silu", "only SiLU-gated MLPs are supported")
    _require(cfg, "use_sliding_window", lambda v: not v, "sliding-window attention is not supported")
    try:
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        out: dict[str, object] = dict(
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            ffn_dim=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
        )
    except KeyError as e:
        raise ConfigError(f"config.json has no {e.args[0]!r}") from None
    hd = cfg.get("head_dim")
    out["head_size"] = int(hd) if hd and int(hd) * heads != dim else None
    out["rope_theta"], out["rope_linear_factor"] = _rope(cfg)
    out["norm_eps"] = float(cfg.get("rms_norm_eps", 1e-6))
    out["tie_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    out["max_seq_len"] = min(int(cfg.get("max_position_embeddings", MAX_POSITIONS)), MAX_POSITIONS)
    if layout == "qwen2":  # Qwen2 always has q/k/v biases and none on o_proj
        out.update(qkv_bias=True, out_bias=False, qk_norm=False)
    elif layout == "wedlm":  # one config for both bases (Tencent/WeDLM hf_compat/configuration_wedlm.py):
        # `attention_bias` (default True) on q/k/v only, never on o_proj; `qk_norm` (Qwen3) - WeDLM-7B
        # (Qwen2.5) has bias and no norm, WeDLM-8B (Qwen3) norm and no bias
        bias = bool(cfg.get("attention_bias", True))
        out.update(qkv_bias=bias, out_bias=False, qk_norm=bool(cfg.get("qk_norm", not bias)))
    else:  # qwen3
        bias = bool(cfg.get("attention_bias", False))
        out.update(qkv_bias=bias, out_bias=bias, qk_norm=True)
    return out


def _llada(cfg: dict) -> dict:
    """LLaDA's OLMo-style config: a Llama block (RMSNorm, RoPE, SwiGLU), no biases unless asked."""
    _require(cfg, "block_type", lambda v: v == "llama", "only LLaDA's 'llama' block is supported")
    _require(cfg, "activation_type", lambda v: v in ("silu", "swiglu"), "only SiLU-gated MLPs are supported")
    _require(cfg, "layer_norm_type", lambda v: v == "rms", "only RMS layer norms are supported")
    _require(cfg, "alibi", lambda v: not v, "ALiBi is not supported")
    _require(cfg, "rope", lambda v: bool(v), "models without RoPE are not supported")
    _require(cfg, "attention_layer_norm", lambda v: not v, "attention layer norm is not supported")
    _require(cfg, "scale_logits", lambda v: not v, "scaled logits are not supported")
    _require(cfg, "input_emb_norm", lambda v: not v, "input embedding norm is not supported")
    _require(cfg, "layer_norm_with_affine", lambda v: bool(v), "norms without weights are not supported")
    try:
        dim, heads = int(cfg["d_model"]), int(cfg["n_heads"])
        n_layers = int(cfg["n_layers"])
    except KeyError as e:
        raise ConfigError(f"config.json has no {e.args[0]!r}") from None
    kv = 1 if cfg.get("multi_query_attention") else int(cfg.get("n_kv_heads") or heads)
    ffn = cfg.get("mlp_hidden_size") or int(cfg.get("mlp_ratio", 4)) * dim
    bias = bool(cfg.get("include_bias", False))
    theta, factor = _rope(cfg)
    return dict(
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=kv,
        head_size=None,
        ffn_dim=int(ffn),
        vocab_size=int(cfg.get("embedding_size") or cfg["vocab_size"]),
        rope_theta=theta,
        rope_linear_factor=factor,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(cfg.get("weight_tying", False)),
        max_seq_len=min(int(cfg.get("max_sequence_length", MAX_POSITIONS)), MAX_POSITIONS),
        qkv_bias=bias or bool(cfg.get("include_qkv_bias", False)),
        out_bias=bias,
        mlp_bias=bias,
        qk_norm=False,
    )
