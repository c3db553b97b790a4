# Research probe, kept as it ran at commit 7c9dba8; not maintained: it may not run against today's layout.
"""Writes a random-weight checkpoint of a real model's shapes in that family's real file layout.

For timing and memory only (the weights are noise): config.json with the family's keys, a
tokenizer.json whose special tokens sit at the family's real ids (a small byte-level BPE below
them: tests/families_tiny.tokenizer_json), tokenizer_config.json naming the mask token where the
real checkpoint does, and safetensors under the family's tensor names (bf16, as published), sharded
with a model.safetensors.index.json when asked.

    python docs/research/scripts/make_random_checkpoint.py open-dcoder-0.5b runs/random/open-dcoder-0.5b
    python docs/research/scripts/make_random_checkpoint.py dream-7b runs/random/dream-7b --shards 4
    python docs/research/scripts/make_random_checkpoint.py dream-tiny /tmp/dream-tiny

Write it under runs/ (ignored by git): a 0.5B checkpoint is ~1 GB, a 7B one ~15 GB.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

QWEN2_KEYS = dict(hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
                  use_sliding_window=False, sliding_window=None, attention_dropout=0.0, torch_dtype="bfloat16")

# name -> (config.json, extra special tokens {token: id}, tokenizer_config.json)
SHAPES = {
    # Open-dCoder-0.5B is a Qwen2.5-Coder-0.5B checkpoint: plain Qwen2 config, tied head, tokenizer's mask token
    "open-dcoder-0.5b": (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
                              num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                              tie_word_embeddings=True, eos_token_id=151643, bos_token_id=151643, **QWEN2_KEYS),
                         {"<|mask|>": 151665}, {"mask_token": "<|mask|>", "eos_token": "<|endoftext|>"}),
    # Dream-7B / Dream-Coder-7B: Qwen2.5-7B shapes, ids in config.json, untied head
    "dream-7b": (dict(architectures=["DreamModel"], model_type="Dream", hidden_size=3584, intermediate_size=18944,
                      num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                      tie_word_embeddings=False, mask_token_id=151666, pad_token_id=151643, bos_token_id=151665,
                      eos_token_id=151643, **QWEN2_KEYS),
                 {"<|beginoftext|>": 151665, "<|mask|>": 151666}, {"mask_token": "<|mask|>"}),
    # the same layout at test size (scripts/gpu_check.sh with TINY=1, tests)
    "dream-tiny": (dict(architectures=["DreamModel"], model_type="Dream", hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=152064,
                        tie_word_embeddings=False, mask_token_id=151666, pad_token_id=151643, bos_token_id=151665,
                        eos_token_id=151643, **QWEN2_KEYS),
                   {"<|beginoftext|>": 151665, "<|mask|>": 151666}, {"mask_token": "<|mask|>"}),
}


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Qwen2 tensor names and shapes for a config.json (q/k/v biases, o_proj without)."""
    D, F, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd = D // cfg["num_attention_heads"]
    Q, KV = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                    p + "self_attn.q_proj.weight": (Q, D), p + "self_attn.q_proj.bias": (Q,),
                    p + "self_attn.k_proj.weight": (KV, D), p + "self_attn.k_proj.bias": (KV,),
                    p + "self_attn.v_proj.weight": (KV, D), p + "self_attn.v_proj.bias": (KV,),
                    p + "self_attn.o_proj.weight": (D, Q), p + "mlp.gate_proj.weight": (F, D),
                    p + "mlp.up_proj.weight": (F, D), p + "mlp.down_proj.weight": (D, F)})
    return out


def write(name: str, folder: Path, shards: int = 1, seed: int = 0) -> Path:
    """Writes the checkpoint `name` (a SHAPES key) to folder; returns the folder."""
    import torch
    from safetensors.torch import save_file

    from tests.families_tiny import QWEN_SPECIALS, tokenizer_json

    cfg, specials, tok_cfg = SHAPES[name]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "tokenizer.json").write_text(tokenizer_json({**QWEN_SPECIALS, **specials}))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    shapes = tensor_shapes(cfg)
    names = list(shapes)
    g = torch.Generator().manual_seed(seed)

    def tensor(n):  # norms at 1, everything else small noise: finite activations through every layer
        s = shapes[n]
        return torch.ones(s, dtype=torch.bfloat16) if n.endswith("norm.weight") else (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)

    if shards == 1:
        save_file({n: tensor(n) for n in names}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    weight_map = {}
    per = -(-len(names) // shards)
    for k in range(shards):  # one shard in memory at a time
        part = names[k * per : (k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensor(n) for n in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("folder", type=Path)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if (args.folder / "config.json").exists():
        print(f"{args.folder} exists: kept")
        return 0
    write(args.shape, args.folder, args.shards, args.seed)
    print(f"wrote {args.folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
