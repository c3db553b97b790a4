"""Tiny random checkpoints in each family's exact file layout, written from a `transformers` model.

The reference model (Qwen2ForCausalLM / Qwen3ForCausalLM / LlamaForCausalLM) is built from the
family's own config.json keys (LLaDA's OLMo-style keys are translated here, independently of the
engine), given seeded unit-scale weights, and saved under the family's tensor names (LLaDA's
`model.transformer.blocks.N...`), sharded with an index where the real checkpoints are. The
tokenizer is a small byte-level BPE whose special tokens sit at the family's real ids (the vocab
has a gap below them), named in the files where the real checkpoint names them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
TEXT = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n", "class Point:\n    pass\n"]

# the tiny shapes every family shares (GQA 4/2; Qwen3 gets an explicit head_dim != hidden / heads)
SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@dataclass
class Spec:
    """One family's tiny checkpoint: its config.json, tokenizer files and tensor-name layout."""

    family: str
    hf_class: str  # transformers class name
    config: dict  # config.json exactly as written
    specials: dict  # token -> id, placed in tokenizer.json
    tokenizer_config: dict = field(default_factory=dict)
    special_tokens_map: dict = field(default_factory=dict)
    shards: int = 1
    llada_names: bool = False


def _qwen(mtype: str, archs: list[str], qwen3: bool, **extra) -> dict:
    c = {
        "architectures": archs,
        "model_type": mtype,
        **SHAPES,
        "hidden_act": "silu",
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
        "use_cache": False,
    }
    if qwen3:
        c.update(head_dim=16, attention_bias=False)
    c.update(extra)
    return c


SPECS = {
    # Dream: ids in config.json (Dream-org/Dream-v0-Instruct-7B); sharded with an index
    "dream": Spec(
        "dream",
        "Qwen2ForCausalLM",
        _qwen(
            "Dream",
            ["DreamModel"],
            False,
            mask_token_id=151666,
            pad_token_id=151643,
            bos_token_id=151665,
            eos_token_id=151643,
        ),
        {**QWEN_SPECIALS, "<|beginoftext|>": 151665, "<|mask|>": 151666},
        tokenizer_config={"mask_token": "<|mask|>", "bos_token": "<|beginoftext|>", "eos_token": "<|endoftext|>"},
        shards=2,
    ),
    # LLaDA: OLMo keys, renamed tensors, mask only as config.json id + added token (not a mask_token)
    "llada": Spec(
        "llada",
        "LlamaForCausalLM",
        {
            "architectures": ["LLaDAModelLM"],
            "model_type": "llada",
            "activation_type": "silu",
            "alibi": False,
            "attention_layer_norm": False,
            "block_type": "llama",
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "mlp_hidden_size": 64,
            "mlp_ratio": 4,
            "embedding_size": 126464,
            "vocab_size": 126464,
            "include_bias": False,
            "include_qkv_bias": False,
            "layer_norm_type": "rms",
            "layer_norm_with_affine": True,
            "rms_norm_eps": 1e-5,
            "rope": True,
            "rope_theta": 500000.0,
            "max_sequence_length": 4096,
            "mask_token_id": 126336,
            "eos_token_id": 126081,
            "pad_token_id": 126081,
            "scale_logits": False,
            "input_emb_norm": False,
            "weight_tying": False,
            "use_cache": False,
        },
        {"<|startoftext|>": 126080, "<|endoftext|>": 126081, "<|mdm_mask|>": 126336},
        tokenizer_config={"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>"},
        shards=3,
        llada_names=True,
    ),
    # CoDA: Qwen3; the mask named by the tokenizer files only
    "coda": Spec(
        "coda",
        "Qwen3ForCausalLM",
        _qwen("CoDA", ["CoDALanguageModel"], True, eos_token_id=151643, bos_token_id=151643),
        {**QWEN_SPECIALS, "<|mask|>": 151669},
        special_tokens_map={"mask_token": {"content": "<|mask|>"}, "pad_token": "<|endoftext|>"},
    ),
    # SDAR / TraDo: Qwen3, block-causal with the block size in config.json
    "sdar": Spec(
        "sdar",
        "Qwen3ForCausalLM",
        _qwen(
            "sdar",
            ["SDARForCausalLM"],
            True,
            block_size=4,
            mask_token_id=151669,
            bos_token_id=151643,
            eos_token_id=151643,
        ),
        {**QWEN_SPECIALS, "<|MASK|>": 151669},
    ),
    # Fast-dLLM v2: Qwen2, block-causal (bd_size), mask only as the added token |<MASK>|
    "fast-dllm-v2": Spec(
        "fast-dllm-v2",
        "Qwen2ForCausalLM",
        _qwen(
            "Fast_dLLM_Qwen", ["Fast_dLLM_QwenForCausalLM"], False, bd_size=16, eos_token_id=151645, bos_token_id=151643
        ),
        {**QWEN_SPECIALS, "|<MASK>|": 151665},
        tokenizer_config={"pad_token": "<|endoftext|>"},
    ),
    # WeDLM-8B: Qwen3 (q/k norm, no bias), plain causal; its config.json keys (`qk_norm`, a null
    # `mask_token_id`: the authors' code then uses 151665), end-of-text and padding 151643; an untied
    # head as its bases (Qwen3-8B, Qwen2.5-7B) have (a tied random head predicts the mask id itself)
    "wedlm": Spec(
        "wedlm",
        "Qwen3ForCausalLM",
        _qwen(
            "wedlm",
            ["WeDLMForCausalLM"],
            True,
            tie_word_embeddings=False,
            qk_norm=True,
            mask_token_id=None,
            eos_token_id=151643,
            pad_token_id=151643,
            bos_token_id=151643,
        ),
        dict(QWEN_SPECIALS),
    ),
    # Open-dCoder: a plain Qwen2 config (tied, like Qwen2.5-Coder-0.5B); the tokenizer's mask token
    "open-dcoder": Spec(
        "open-dcoder",
        "Qwen2ForCausalLM",
        _qwen("qwen2", ["Qwen2ForCausalLM"], False, tie_word_embeddings=True, eos_token_id=151643, bos_token_id=151643),
        {**QWEN_SPECIALS, "<|mask|>": 151665},
        tokenizer_config={"mask_token": "<|mask|>", "pad_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    ),
    # DreamOn: Dream's config and files plus the expand token <|expand|> (151667) among the added tokens
    "dreamon": Spec(
        "dreamon",
        "Qwen2ForCausalLM",
        _qwen(
            "Dream",
            ["DreamModel"],
            False,
            mask_token_id=151666,
            pad_token_id=151643,
            bos_token_id=151665,
            eos_token_id=151643,
        ),
        {**QWEN_SPECIALS, "<|beginoftext|>": 151665, "<|mask|>": 151666, "<|expand|>": 151667},
        tokenizer_config={"mask_token": "<|mask|>", "bos_token": "<|beginoftext|>", "eos_token": "<|endoftext|>"},
    ),
}


def tokenizer_json(specials: dict) -> str:
    """A byte-level BPE (256 bytes + a few merges at ids 0..) with `specials` at their given ids."""
    alpha = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alpha)}
    merges = []
    for a, b in [
        ("Ġ", "Ġ"),
        ("ĠĠ", "ĠĠ"),
        ("d", "e"),
        ("de", "f"),
        ("r", "e"),
        ("re", "t"),
        ("i", "n"),
        ("Ġ", "in"),
        ("p", "r"),
        ("pr", "in"),
        ("prin", "t"),
        ("Ġ", "r"),
    ]:
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    d = json.loads(tok.to_str())
    d["added_tokens"] = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for t, i in sorted(specials.items(), key=lambda x: x[1])
    ]
    for t, i in specials.items():  # the model vocab holds them at their real ids (a gap below: tiny vocab)
        d["model"]["vocab"][t] = i
    return json.dumps(d)


def hf_config(spec: Spec, dtype=torch.float64):
    """The transformers config for the reference model, from the family's own config.json."""
    import transformers

    c = dict(spec.config)
    if spec.llada_names:  # OLMo keys -> Llama keys (the test's own translation)
        c = dict(
            hidden_size=c["d_model"],
            num_hidden_layers=c["n_layers"],
            num_attention_heads=c["n_heads"],
            num_key_value_heads=c["n_kv_heads"],
            intermediate_size=c["mlp_hidden_size"],
            vocab_size=c["embedding_size"],
            rms_norm_eps=c["rms_norm_eps"],
            rope_theta=c["rope_theta"],
            max_position_embeddings=c["max_sequence_length"],
            tie_word_embeddings=c["weight_tying"],
            attention_bias=c["include_bias"],
            mlp_bias=c["include_bias"],
            hidden_act="silu",
        )
        cls = transformers.LlamaConfig
    else:
        for k in ("architectures", "model_type", "torch_dtype"):
            c.pop(k, None)
        cls = transformers.Qwen3Config if spec.hf_class == "Qwen3ForCausalLM" else transformers.Qwen2Config
    cfg = cls(**c)
    cfg._attn_implementation = "sdpa"
    return cfg


_MODELS: dict = {}  # the few most recent reference models (each holds a 152k-row vocabulary)


def reference_model(spec: Spec, seed: int = 0, dtype=torch.float64):
    """The transformers model with seeded unit-scale weights (fp32 values, so every dtype holds them
    exactly): projections ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.1). Built once per
    (family, seed, dtype) in a test session; callers must not modify it."""
    key = (spec.family, seed, dtype)
    if key not in _MODELS:
        while len(_MODELS) >= 4:
            _MODELS.pop(next(iter(_MODELS)))
        _MODELS[key] = _build_reference(spec, seed, dtype)
    return _MODELS[key]


def _build_reference(spec: Spec, seed: int, dtype):
    import transformers

    cfg = hf_config(spec)
    torch.manual_seed(seed)
    model = getattr(transformers, spec.hf_class)(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                v = 1 + 0.1 * torch.randn(p.shape, generator=g)
            elif name.endswith(".bias"):
                v = 0.1 * torch.randn(p.shape, generator=g)
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=g)
            else:
                v = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            p.copy_(v)
    return model.to(dtype).eval()


LLAMA_TO_LLADA = [
    (r"^model\.embed_tokens\.weight$", "model.transformer.wte.weight"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"model.transformer.blocks.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"model.transformer.blocks.\1.ff_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.", r"model.transformer.blocks.\1.\2_proj."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"model.transformer.blocks.\1.attn_out."),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.", r"model.transformer.blocks.\1.ff_proj."),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.", r"model.transformer.blocks.\1.up_proj."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"model.transformer.blocks.\1.ff_out."),
    (r"^model\.norm\.", "model.transformer.ln_f."),
    (r"^lm_head\.", "model.transformer.ff_out."),
]


def write_checkpoint(spec: Spec, folder: Path, seed: int = 0) -> Path:
    """Writes config.json, tokenizer files and safetensors (sharded + index when spec.shards > 1)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = reference_model(spec, seed, torch.float32)
    sd = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied checkpoints store the embedding only
        if spec.llada_names:
            for pat, rep in LLAMA_TO_LLADA:
                if re.match(pat, name):
                    name = re.sub(pat, rep, name)
                    break
        sd[name] = t.detach().contiguous()
    (folder / "config.json").write_text(json.dumps(spec.config, indent=2))
    (folder / "tokenizer.json").write_text(tokenizer_json(spec.specials))
    for fname, d in (
        ("tokenizer_config.json", spec.tokenizer_config),
        ("special_tokens_map.json", spec.special_tokens_map),
    ):
        if d:
            (folder / fname).write_text(json.dumps(d, indent=2))
    names = sorted(sd)
    if spec.shards == 1:
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    weight_map = {}
    for k in range(spec.shards):
        part = names[k :: spec.shards]
        fname = f"model-{k + 1:05d}-of-{spec.shards:05d}.safetensors"
        save_file({n: sd[n] for n in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )
    return folder


def reference_logits(model, ids: torch.Tensor, attention: str, block: int = 0, pos: torch.Tensor | None = None):
    """Logits (B, L, V) of the transformers model run with a family's attention: `bidirectional`
    through an all-zeros 4-D additive mask, `block_causal` through the block mask (blocks by
    absolute position), `causal` through the model's own causal mask; explicit position ids. With
    reordered position ids (WeDLM) the causal mask is passed explicitly in row order: given position
    ids that go down, transformers would take the row for packed sequences and cut the mask there."""
    B, L = ids.shape
    dt = next(model.parameters()).dtype
    reordered = pos is not None
    pos = torch.arange(L)[None].expand(B, L) if pos is None else pos
    if attention == "causal" and reordered:
        tril = torch.ones(L, L, dtype=torch.bool).tril()
        mask = torch.zeros(B, 1, L, L, dtype=dt).masked_fill(~tril, torch.finfo(dt).min)
    elif attention == "causal":
        mask = None
    elif attention == "bidirectional":
        mask = torch.zeros(B, 1, L, L, dtype=dt)
    else:
        blk = pos // block
        allowed = blk[:, None, :] <= blk[:, :, None]  # (B, L, L) key block <= query block
        mask = torch.zeros(B, 1, L, L, dtype=dt).masked_fill(~allowed[:, None], torch.finfo(dt).min)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def seed_of(name: str) -> int:
    return list(SPECS).index(name)


@pytest.fixture(scope="session")
def family_folders(tmp_path_factory) -> dict[str, Path]:
    """family -> its tiny checkpoint folder, written once per test session (import it as a fixture)."""
    root = tmp_path_factory.mktemp("families")
    return {name: write_checkpoint(spec, root / name, seed=seed_of(name)) for name, spec in SPECS.items()}
