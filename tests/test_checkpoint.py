"""engine/weights/checkpoint.py, load.py and engine/model/weight_files.py: the HF-style folder round trip and the
errors that say what to do next."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from engine.model.weight_files import CheckpointError
from engine.weights.checkpoint import resolve_model_path, save_checkpoint
from engine.weights.load import load_checkpoint, read_state_dict
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=3)


def test_round_trip_gives_the_same_logits(tiny, tmp_path):
    model, tok, cfg = load_checkpoint(tiny)
    assert not model.training and cfg.mask_token_id == tok.token_id("<|mask|>")
    ids = torch.tensor([tok.encode("def add(a, b):\n    return")])
    with torch.no_grad():
        want = model(ids)
    save_checkpoint(tmp_path / "copy", model, tok, extra={"step": 1})
    again, _, _ = load_checkpoint(tmp_path / "copy")
    with torch.no_grad():
        torch.testing.assert_close(again(ids), want)
    assert json.loads((tmp_path / "copy" / "training_state.json").read_text()) == {"step": 1}


def test_rope_tables_are_real_after_a_meta_load(tiny):
    model, _, _ = load_checkpoint(tiny)
    assert model.rope_cos.device.type == "cpu" and torch.isfinite(model.rope_cos).all()


def test_bf16_load(tiny):
    model, _, _ = load_checkpoint(tiny, dtype=torch.bfloat16)
    assert model.head_weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).float()).all()


def test_sharded_weights(tiny, tmp_path):
    sd = read_state_dict(tiny)
    names = sorted(sd)
    half = len(names) // 2
    folder = tmp_path / "sharded"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (folder / f).write_bytes((tiny / f).read_bytes())
    save_file({k: sd[k] for k in names[:half]}, str(folder / "a.safetensors"))
    save_file({k: sd[k] for k in names[half:]}, str(folder / "b.safetensors"))
    index = {"weight_map": {k: "a.safetensors" if i < half else "b.safetensors" for i, k in enumerate(names)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _, _ = load_checkpoint(folder)
    assert torch.equal(model.state_dict()["norm.weight"], sd["norm.weight"])


def _copy(tiny, dst, skip=()):
    dst.mkdir()
    for f in tiny.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_errors_say_what_is_wrong(tiny, tmp_path):
    with pytest.raises(CheckpointError, match="neither a local folder"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_checkpoint(_copy(tiny, tmp_path / "notok", skip=("tokenizer.json",)))
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(_copy(tiny, tmp_path / "nocfg", skip=("config.json",)))
    pickles = _copy(tiny, tmp_path / "pickles", skip=("model.safetensors",))
    (pickles / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="convert them to safetensors"):
        load_checkpoint(pickles)
    wrong = _copy(tiny, tmp_path / "wrong")
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["n_layers"] += 1
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="do not match"):
        load_checkpoint(wrong)
    bad = _copy(tiny, tmp_path / "badcfg")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(bad)


def test_repo_ids_resolve_from_the_local_hf_cache_only(tiny, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snap = hub / "models--org--tiny" / "snapshots" / "abc123"
    snap.parent.mkdir(parents=True)
    _copy(tiny, snap)
    (hub / "models--org--tiny" / "refs").mkdir(parents=True)
    (hub / "models--org--tiny" / "refs" / "main").write_text("abc123\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert resolve_model_path("org/tiny") == snap
    with pytest.raises(CheckpointError):
        resolve_model_path("org/absent")


# ----------------------------------------------------------------------------- corrupted weights


def _header(path) -> tuple[int, dict]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8 : 8 + n])


def _corrupt(kind: str, tiny, folder):
    """A copy of `tiny` whose model.safetensors is broken in one way."""
    import struct

    folder = _copy(tiny, folder)
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    n, header = _header(f)
    if kind == "truncated":
        f.write_bytes(raw[: len(raw) - 100])
    elif kind == "tiny-file":
        f.write_bytes(raw[:5])
    elif kind == "huge-header":  # a header length claiming 10 GB
        f.write_bytes(struct.pack("<Q", 10 * 2**30) + raw[8:])
    elif kind == "past-the-end":
        f.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    elif kind == "bad-header":
        f.write_bytes(raw[:8] + b"\xff{not json" + raw[8 + 10 :])
    elif kind == "wrong-dtype":
        name = next(k for k in header if k != "__metadata__" and header[k]["dtype"] == "F32")
        header[name]["dtype"] = "I32"  # same size: only the type is wrong
        body = json.dumps(header).encode().ljust(n)
        f.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    elif kind == "fifo":
        f.unlink()
        os.mkfifo(f)
    return folder


@pytest.mark.parametrize(
    "kind,match",
    [
        ("truncated", "is truncated: tensor"),
        ("tiny-file", "is truncated \\(5 bytes\\)"),
        ("huge-header", "claims 10,737,418,240 bytes, over the 100 MB limit"),
        ("past-the-end", "is truncated: the header claims"),
        ("bad-header", "bad safetensors header \\(not JSON"),
        ("wrong-dtype", "has dtype 'I32'; weights must be one of F64, F32, F16, BF16"),
        ("fifo", "is not a regular file"),
    ],
)
def test_a_corrupted_weights_file_is_refused_naming_the_file(tiny, tmp_path, kind, match):
    folder = _corrupt(kind, tiny, tmp_path / kind)
    with pytest.raises(CheckpointError, match=match) as err:
        load_checkpoint(folder)
    assert str(folder / "model.safetensors") in str(err.value)


def test_pickle_weights_are_refused_and_never_unpickled(tiny, tmp_path):
    import pickle

    marker = tmp_path / "UNPICKLED"

    class Payload:  # unpickling this creates `marker`: what a malicious pytorch_model.bin would do
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    folder = _copy(tiny, tmp_path / "evil", skip=("model.safetensors",))
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    # the payload is live (it names os.mkdir and calls it on load), shown without running it:
    # nothing in this project unpickles, its tests included
    import pickletools

    ops = [op.name for op, _, _ in pickletools.genops((folder / "pytorch_model.bin").read_bytes())]
    assert "REDUCE" in ops and b"mkdir" in (folder / "pytorch_model.bin").read_bytes()
    with pytest.raises(CheckpointError, match=r"only pickle weights \(pytorch_model.bin\), which are never loaded"):
        load_checkpoint(folder)
    assert not marker.exists()  # ... and the loader never ran it


def test_an_index_cannot_name_shards_outside_its_folder(tiny, tmp_path):
    outside = _copy(tiny, tmp_path / "outside")
    folder = _copy(tiny, tmp_path / "sharded", skip=("model.safetensors",))
    index = {"weight_map": {"norm.weight": "../outside/model.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is not a .safetensors file name in"):
        load_checkpoint(folder)
    assert (outside / "model.safetensors").exists()


def test_the_header_check_accepts_every_shipped_weights_file():
    from engine.model.weight_files import check_safetensors
    from engine.paths import REPO_ROOT

    files = sorted((REPO_ROOT / "models").glob("*/model.safetensors"))
    assert files
    for f in files:
        header = check_safetensors(f)
        assert len(header) > 2


# ----------------------------------------------------------------------------- layering


def test_model_families_weights_import_each_other_only_downwards():
    """engine/model <- engine/families <- engine/weights: every import among them (module level or inside a
    function) goes down a layer or, inside one package, leaves no cycle."""
    import ast
    from pathlib import Path

    from engine.paths import REPO_ROOT

    layers = ("engine.model", "engine.families", "engine.weights")
    mods = {
        (pkg if p.stem == "__init__" else f"{pkg}.{p.stem}"): p
        for pkg in layers
        for p in (REPO_ROOT / pkg.replace(".", "/")).glob("*.py")
    }

    def layer(m: str) -> int:
        return next(i for i, pkg in enumerate(layers) if m == pkg or m.startswith(pkg + "."))

    edges: dict[str, set[str]] = {}
    for m, path in mods.items():
        out = edges.setdefault(m, set())
        for n in ast.walk(ast.parse(Path(path).read_text())):
            names = (
                [a.name for a in n.names]
                if isinstance(n, ast.Import)
                else [n.module, *(f"{n.module}.{a.name}" for a in n.names)]
                if isinstance(n, ast.ImportFrom) and n.module
                else []
            )
            for t in names:
                if t in mods and t != m:
                    out.add(t)
                    pkg = t.rpartition(".")[0]
                    if (
                        pkg in mods and pkg != m and not m.startswith(pkg + ".")
                    ):  # a submodule's import runs its package first
                        out.add(pkg)
    upward = sorted(f"{m} imports {t}" for m, ts in edges.items() for t in ts if layer(t) > layer(m))
    assert not upward

    def cycle_from(m: str, stack: list[str]) -> list[str] | None:
        for t in sorted(edges[m]):
            if t in stack:
                return stack[stack.index(t) :] + [t]
            found = cycle_from(t, stack + [t])
            if found:
                return found
        return None

    for m in sorted(mods):
        assert cycle_from(m, [m]) is None, " -> ".join(cycle_from(m, [m]))
