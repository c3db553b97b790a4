"""Every family's tiny checkpoint (tests/families_tiny.py: its config.json keys, tokenizer files with
its special tokens at their real ids, its tensor names, shards with an index) loads through the
engine and computes the logits of the matching `transformers` class run with the family's
attention: 1e-10 in float64, 1e-4 in float32."""

from __future__ import annotations

import json

import pytest
import torch

from engine.families import FAMILIES, FamilyError, family_config, load_family
from engine.model.weight_files import CheckpointError
from engine.weights.load import load_checkpoint
from tests.families_tiny import SPECS, reference_logits, reference_model, write_checkpoint

transformers = pytest.importorskip("transformers")

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
ATTENTION = {f.name: f.attention for f in FAMILIES}


@pytest.fixture(scope="module")
def folders(family_folders):
    return family_folders


def _ids(L=24, B=1, seed=0):
    """Ids from the whole vocabulary, special tokens included (a canvas holds masks)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (B, L), generator=g) * 151 % 126000


def _engine(folder, dtype):
    return load_family(folder, dtype=dtype, forward_only=True)[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", list(SPECS))
def test_logits_equal_transformers(folders, name, dtype, record_property):
    spec = SPECS[name]
    fam, cfg = family_config(folders[name])
    assert fam.name == name
    ref = reference_model(spec, seed=list(SPECS).index(name), dtype=dtype)
    ids = _ids()
    want = reference_logits(ref, ids, fam.attention, cfg.block_size)
    with torch.no_grad():
        got = _engine(folders[name], dtype)(ids)
    diff = (got - want).abs().max().item()
    record_property("max_abs_diff", diff)
    print(f"{name} {dtype}: max abs diff {diff:.3g} (logits up to {want.abs().max().item():.3g})")
    assert diff <= TOL[dtype], f"{name} {dtype}: max abs diff {diff:.3g}"


def test_causal_and_full_attention_differ(folders):
    """The guard: with the same weights and inputs, the reference's causal and full-attention calls
    (and the engine's) give different logits, so parity cannot pass with the mask ignored."""
    spec = SPECS["dream"]
    ref = reference_model(spec, seed=0)
    ids = _ids()
    full, causal = reference_logits(ref, ids, "bidirectional"), reference_logits(ref, ids, "causal")
    assert (full - causal).abs().max() > 1e-2
    m = _engine(folders["dream"], torch.float64)
    m.cfg.attention = "causal"
    try:
        with torch.no_grad():
            torch.testing.assert_close(m(ids), causal, atol=1e-10, rtol=0)
    finally:
        m.cfg.attention = "bidirectional"
    sdar = reference_model(SPECS["sdar"], seed=list(SPECS).index("sdar"))
    block = reference_logits(sdar, ids, "block_causal", 4)
    for other in ("causal", "bidirectional"):
        assert (block - reference_logits(sdar, ids, other)).abs().max() > 1e-2


def test_wedlm_reordered_inputs_equal_transformers(folders):
    """WeDLM: observed tokens moved in front of the masks keep their logical positions; the causal
    forward over the reordered row equals the reference run with those ids and position ids."""
    fam, cfg = family_config(folders["wedlm"])
    ids = _ids(20)[0]
    masked = torch.zeros(20, dtype=torch.bool)
    masked[[3, 4, 9, 15, 16, 17]] = True
    ids[masked] = cfg.mask_token_id
    order = torch.cat([torch.nonzero(~masked).flatten(), torch.nonzero(masked).flatten()])
    r_ids, r_pos = ids[order][None], order[None]
    ref = reference_model(SPECS["wedlm"], seed=list(SPECS).index("wedlm"))
    want = reference_logits(ref, r_ids, "causal", pos=r_pos)
    with torch.no_grad():
        got = _engine(folders["wedlm"], torch.float64)(r_ids, pos=r_pos)
    assert (got - want).abs().max().item() <= 1e-10
    # and it is not the unreordered computation
    assert (got - reference_logits(ref, ids[None], "causal")).abs().max() > 1e-2


@torch.no_grad()
@pytest.mark.parametrize("name", ["sdar", "fast-dllm-v2", "wedlm"])
def test_cached_context_is_exact_where_the_topology_makes_it_so(folders, name):
    """Block-causal and causal: a span run against the cached K/V of the rest (prefix and a later
    block, at their absolute positions) equals the uncached forward."""
    m = _engine(folders[name], torch.float64)
    bs = m.cfg.block_size or 8
    ids = _ids(3 * bs)
    h, kvs = m.hidden(ids, return_kv=True)
    a0, a1 = bs, 2 * bs  # the second block (causal: everything after it is dropped)
    keep = torch.ones(3 * bs, dtype=torch.bool)
    keep[a0:a1] = False
    if m.cfg.attention == "causal":
        keep[a1:] = False
    ctx_pos = torch.nonzero(keep).flatten()[None]
    ctx = [(k[:, :, keep], v[:, :, keep]) for k, v in kvs]
    hs = m.hidden(ids[:, a0:a1], pos=torch.arange(a0, a1)[None], ctx=ctx, ctx_pos=ctx_pos)
    assert (hs - h[:, a0:a1]).abs().max().item() <= 1e-10


@torch.no_grad()
def test_full_attention_cache_is_an_approximation_and_its_error_is_reported(folders, record_property):
    """Bidirectional: once a canvas token changes, the cached context K/V are stale; the error of a
    cached step against the exact forward is measured (it is what refresh_every bounds)."""
    m = _engine(folders["dream"], torch.float64)
    ids = _ids(24)
    _, kvs = m.hidden(ids, return_kv=True)
    ids2 = ids.clone()
    ids2[0, 10] = (ids2[0, 10] + 1) % 1000  # one canvas token committed since the context was cached
    keep = torch.ones(24, dtype=torch.bool)
    keep[8:16] = False
    ctx = [(k[:, :, keep], v[:, :, keep]) for k, v in kvs]
    cached = m.logits(m.hidden(ids2[:, 8:16], pos=torch.arange(8, 16)[None], ctx=ctx))
    exact = m(ids2)[:, 8:16]
    err = (cached - exact).abs().max().item()
    record_property("stale_context_max_abs_logit_error", err)
    print(f"dream: stale-context cached step vs exact forward, max abs logit error {err:.3g}")
    assert err > 1e-6  # not exact (if it were, full attention would not be full)


def test_special_ids_come_from_the_files(folders):
    want = {  # family: (mask, pad, eos, bos) and the file each one is in
        "dream": (151666, 151643, 151643, 151665),
        "llada": (126336, 126081, 126081, 126080),
        "coda": (151669, 151643, 151643, 151643),
        "sdar": (151669, 151643, 151643, 151643),
        "fast-dllm-v2": (151665, 151643, 151645, 151643),
        "wedlm": (151665, 151643, 151643, 151643),  # mask: config.json's is null, the authors' default
        "open-dcoder": (151665, 151643, 151643, 151643),
        "dreamon": (151666, 151643, 151643, 151665),
    }
    for name, ids in want.items():
        _, cfg = family_config(folders[name])
        assert (cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == ids, name
    _, cfg = family_config(folders["dream"])
    assert cfg.expand_token_id is None and cfg.family == "dream"
    _, cfg = family_config(folders["dreamon"])  # same config as Dream: told apart by its expand token
    assert cfg.expand_token_id == 151667 and cfg.family == "dreamon"  # found by name among the added tokens
    _, cfg = family_config(folders["sdar"])
    assert (cfg.attention, cfg.block_size, cfg.logits_shift) == ("block_causal", 4, False)
    _, cfg = family_config(folders["fast-dllm-v2"])
    assert (cfg.attention, cfg.block_size, cfg.logits_shift, cfg.sub_block_size) == ("block_causal", 16, True, 8)


def test_unknown_and_unsupported_checkpoints_are_named(folders, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    with pytest.raises(CheckpointError, match=r"MambaForCausalLM.*mamba.*Supported: Dream"):
        load_checkpoint(tmp_path)
    # a plain Qwen2 checkpoint without a mask token is an autoregressive model
    qwen = tmp_path / "qwen"
    write_checkpoint(SPECS["open-dcoder"], qwen)
    (qwen / "tokenizer_config.json").write_text("{}")
    (qwen / "tokenizer.json").write_text(json.dumps(json.loads((qwen / "tokenizer.json").read_text())))
    cfg = json.loads((qwen / "tokenizer.json").read_text())
    cfg["added_tokens"] = [a for a in cfg["added_tokens"] if a["content"] != "<|mask|>"]
    del cfg["model"]["vocab"]["<|mask|>"]
    (qwen / "tokenizer.json").write_text(json.dumps(cfg))
    with pytest.raises(FamilyError, match="no mask token.*autoregressive"):
        family_config(qwen)
    # unknown rope scaling is refused with its name
    bad = tmp_path / "yarn"
    write_checkpoint(SPECS["sdar"], bad)
    c = json.loads((bad / "config.json").read_text())
    c["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match="rope scaling 'yarn' is not supported"):
        load_checkpoint(bad)
    # WeDLM is served now: its reordered causal canvas (tests/test_families_wedlm.py decodes it)
    _, _, cfg = load_checkpoint(folders["wedlm"])
    assert (cfg.family, cfg.attention, cfg.canvas) == ("wedlm", "causal", "reorder")


def test_pickle_only_family_checkpoints_are_refused(tmp_path):
    write_checkpoint(SPECS["coda"], tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        load_checkpoint(tmp_path)


def test_load_checkpoint_serves_a_family_from_the_local_hf_cache(folders, tmp_path, monkeypatch):
    """`--model org/name` resolves in HF_HUB_CACHE (no network) and loads through the family loader."""
    import shutil

    snap = tmp_path / "hub" / "models--Dream-org--Dream-Tiny" / "snapshots" / "abc123"
    shutil.copytree(folders["dream"], snap)
    (tmp_path / "hub" / "models--Dream-org--Dream-Tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--Dream-org--Dream-Tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model, tok, cfg = load_checkpoint("Dream-org/Dream-Tiny")
    assert cfg.family == "dream" and cfg.logits_shift and model.head_weight.dtype == torch.float32
    assert tok.token_id("<|mask|>") == cfg.mask_token_id == 151666
    from engine.families.hub import scan

    [m] = scan()
    assert (m.repo_id, m.family) == ("Dream-org/Dream-Tiny", "dream") and "mask 151666" in m.detail


def test_models_command_lists_families_and_cached_checkpoints(folders, tmp_path, monkeypatch, capsys):
    import shutil

    from dlm_lsp.cli import main

    for repo, name in (("GSAI-ML--LLaDA-Tiny", "llada"), ("Qwen--Qwen-AR", "open-dcoder")):
        snap = tmp_path / f"models--{repo}" / "snapshots" / "s1"
        shutil.copytree(folders[name], snap)
    (tmp_path / "models--Qwen--Qwen-AR" / "snapshots" / "s1" / "tokenizer_config.json").write_text("{}")
    assert main(["models", "--cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(f.name in out for f in FAMILIES)
    assert "GSAI-ML/LLaDA-Tiny" in out and "llada" in out and "mask 126336" in out
    # a Qwen2 checkpoint whose only mask evidence is gone is listed as unsupported, with the reason
    assert "Qwen/Qwen-AR" in out and "unsupported" in out


def test_seven_billion_shapes_build_on_the_meta_device():
    """The load path's first half at real size: Dream-7B's config (Qwen2.5-7B shapes) becomes a
    model on the meta device with the expected parameter count, no memory used."""
    from engine.families.registry import FAMILIES as F
    from engine.families.specials import TokenFiles
    from engine.model.transformer import Transformer

    dream = next(f for f in F if f.name == "dream")
    cfg = dict(
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
    )
    mc = dream.engine_config(cfg, TokenFiles(cfg, {}, {}, None))
    with torch.device("meta"):
        m = Transformer(mc)
    assert m.num_params() == 7_615_616_512  # Qwen2.5-7B: 7.61B
    assert m.head_weight.is_meta and mc.kv_heads == 4 and mc.max_seq_len == 16384


@torch.no_grad()
def test_dream_padded_batch_equals_the_pairwise_mask_reference(folders):
    """Dream batches left-padded rows with the pairwise mask valid[q] & valid[k] and positions
    cumsum(valid) - 1; the engine batches right-padded rows with key_valid. Valid positions agree."""
    ref = reference_model(SPECS["dream"], seed=list(SPECS).index("dream"))
    m = _engine(folders["dream"], torch.float64)
    rows = [_ids(14, seed=1)[0], _ids(9, seed=2)[0]]
    L = 14
    ids = torch.full((2, L), 151643)
    valid = torch.zeros(2, L, dtype=torch.bool)
    for i, r in enumerate(rows):  # left padding, as Dream's batches
        ids[i, L - len(r) :], valid[i, L - len(r) :] = r, True
    pair = valid[:, None, :, None] & valid[:, None, None, :]
    mask = torch.zeros(2, 1, L, L, dtype=torch.float64).masked_fill(~pair, torch.finfo(torch.float64).min)
    pos = (valid.long().cumsum(-1) - 1).clamp_min(0)
    want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    r_ids = torch.full((2, L), 151643)
    r_valid = torch.zeros(2, L, dtype=torch.bool)
    for i, r in enumerate(rows):  # the engine's right padding
        r_ids[i, : len(r)], r_valid[i, : len(r)] = r, True
    got = m(r_ids, key_valid=r_valid)
    for i, r in enumerate(rows):
        assert (got[i, : len(r)] - want[i, L - len(r) :]).abs().max().item() <= 1e-10


def test_gqa_causal_kv_cache_decoding_equals_full_recompute(folders):
    """The causal KV-cache path with grouped-query attention (WeDLM's 4 query / 2 K/V heads): greedy
    decoding with the cache equals recomputing the whole sequence every token."""
    from engine.decode.autoregressive import greedy_decode, reference_greedy

    m = _engine(folders["wedlm"], torch.float64)
    assert m.cfg.kv_heads == 2 and m.cfg.n_heads == 4
    prompt = _ids(10)[0].tolist()
    assert greedy_decode(m, prompt, 6).ids == reference_greedy(m, prompt, 6)


def test_chunked_reads_reassemble_every_tensor(folders, monkeypatch):
    """Tensors are read through a small scratch buffer in chunks (odd-sized here, so chunks split
    rows and elements of every width); the loaded weights equal a whole-file safetensors read."""
    from safetensors.torch import load_file

    import engine.families.loader as loader

    monkeypatch.setattr(loader, "CHUNK_BYTES", 1000)
    m = _engine(folders["llada"], torch.float64)
    sd = {}
    for p in sorted(folders["llada"].glob("*.safetensors")):
        sd.update(load_file(str(p)))
    assert torch.equal(m.layers[1].mlp.w2.weight, sd["model.transformer.blocks.1.ff_out.weight"].double())
    assert torch.equal(m.tok_embeddings.weight, sd["model.transformer.wte.weight"].double())
    assert torch.equal(m.output.weight, sd["model.transformer.ff_out.weight"].double())
