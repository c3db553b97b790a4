"""`dlm-lsp train` on a tiny budget: checkpoints, manifest, log, curve, resume, the AR twin, and the GPU
recipe's packed corpus + sharded checkpoints (run here on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from engine.train import corpus
from engine.train.loop import TrainArgs, train
from engine.weights.load import load_checkpoint, read_state_dict
from engine.weights.shard import INDEX, plan_shards, save_sharded, shard_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(
    max_files=10,
    dim=32,
    n_layers=2,
    n_heads=2,
    ffn_dim=64,
    seq_len=128,
    vocab=512,
    batch=4,
    val_examples=16,
    warmup=2,
    threads=1,
    progress=False,
)


def _log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny diffusion run through the CLI: 5 steps."""
    from dlm_lsp.cli import main

    out = tmp_path_factory.mktemp("train") / "run"
    rc = main(
        [
            "train",
            "--out",
            str(out),
            "--max-files",
            "10",
            "--dim",
            "32",
            "--n-layers",
            "2",
            "--n-heads",
            "2",
            "--ffn-dim",
            "64",
            "--seq-len",
            "128",
            "--vocab",
            "512",
            "--batch",
            "4",
            "--warmup",
            "2",
            "--max-steps",
            "5",
            "--threads",
            "1",
            "--no-progress",
        ]
    )
    assert rc == 0
    return out


def test_train_writes_loadable_checkpoints(run):
    for name in ("best", "last"):
        model, tok, cfg = load_checkpoint(run / name)
        assert cfg.attention == "bidirectional" and cfg.dim == 32 and cfg.n_layers == 2
        assert cfg.vocab_size == tok.vocab_size <= 512
        # special ids in the config are the tokenizer's own
        assert tok.decode([cfg.mask_token_id]) == "<|mask|>" and tok.decode([cfg.pad_token_id]) == "<|pad|>"
        with torch.no_grad():
            logits = model(torch.tensor([tok.encode("def f(x):\n    return x\n")]))
        assert logits.shape[-1] == cfg.vocab_size and torch.isfinite(logits).all()
        state = json.loads((run / name / "training_state.json").read_text())
        assert state["step"] == 5 and state["tokens"] > 0


def test_train_writes_split_log_and_curve(run):
    split = json.loads((run / "split.json").read_text())
    train_keys, held = set(split["train"]), set(split["heldout"])
    assert len(train_keys) == 10 and held and not train_keys & held
    assert all(corpus.is_heldout(k) for k in held) and not any(corpus.is_heldout(k) for k in train_keys)
    rows = _log(run)
    assert rows[-1]["step"] == 5 and "val_loss" in rows[-1]
    png = run / "train_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "best" / "train_curve.png").exists()


def test_resume_continues_the_step_count(run, tmp_path):
    out = tmp_path / "resumed"
    train(
        TrainArgs(
            out=str(out),
            resume=str(run / "last"),
            max_steps=3,
            **{k: v for k, v in TINY.items() if k not in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab")},
        )
    )
    state = json.loads((out / "last" / "training_state.json").read_text())
    assert state["step"] == 8  # 5 before + 3 now
    steps = [r["step"] for r in _log(out) if "val_loss" in r]
    assert steps == [5, 8]  # the earlier run's log is carried over
    # the resumed model keeps the checkpoint's tokenizer and shape
    _, tok0, cfg0 = load_checkpoint(run / "last")
    _, tok1, cfg1 = load_checkpoint(out / "last")
    assert cfg0 == cfg1 and tok0.encode("import os\n") == tok1.encode("import os\n")


def test_resume_with_longer_windows_extends_the_context_len(run, tmp_path):
    out = tmp_path / "longer"
    _, _, cfg0 = load_checkpoint(run / "last")
    args = {k: v for k, v in TINY.items() if k not in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab", "seq_len")}
    train(TrainArgs(out=str(out), resume=str(run / "last"), max_steps=1, seq_len=cfg0.context_len + 32, **args))
    _, _, cfg1 = load_checkpoint(out / "last")
    assert cfg1.context_len == cfg0.context_len + 32 and cfg1.dim == cfg0.dim


def test_ar_objective_trains_a_causal_twin(tmp_path):
    from engine.tokenizer import FIM_MIDDLE

    out = tmp_path / "ar"
    train(TrainArgs(out=str(out), objective="ar", max_steps=4, workers=2, **TINY))  # batches from 2 processes
    model, tok, cfg = load_checkpoint(out / "best")
    assert cfg.attention == "causal" and json.loads((out / "best" / "config.json").read_text())["attention"] == "causal"
    assert tok.token_id(FIM_MIDDLE) is not None
    assert json.loads((out / "last" / "training_state.json").read_text())["step"] == 4


# ----------------------------------------------------------------------------- GPU recipe, on CPU


def test_sharding_round_trips_and_respects_the_limit(tmp_path):
    sd = {f"w{i}": torch.randn(64, 64) for i in range(5)}  # 16 KiB each
    assert [len(g) for g in plan_shards(sd, 40 * 1024)] == [2, 2, 1]
    with pytest.raises(ValueError):
        plan_shards({"big": torch.zeros(1024)}, 1000)
    (tmp_path / "model.safetensors").write_bytes(b"stale")  # must not shadow the shards
    names = save_sharded(tmp_path, sd, 40 * 1024)
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (tmp_path / "model.safetensors").exists()
    assert all((tmp_path / n).stat().st_size <= 40 * 1024 + 1024 for n in names)  # + the small header
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"]["total_size"] == 5 * 64 * 64 * 4 and set(index["weight_map"]) == set(sd)
    back = read_state_dict(tmp_path)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_pack_corpus_keeps_the_split(tmp_path):
    from engine.train import pack

    out = tmp_path / "c.tar.xz"
    m = pack.pack(out, [], max_files=10)
    assert out.stat().st_size < 40 * 2**20
    keys = {e["key"] for e in m["train"]} | {e["key"] for e in m["heldout"]}
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        tar.extractall(tmp_path / "x", filter="data")
    assert "MANIFEST.json" in names
    # unpacked as --source x/stdlib, the files get the same keys and so the same split
    files = corpus.collect([tmp_path / "x" / "stdlib"], include_stdlib=False)
    assert {f.key for f in files} == keys
    train_files, held = corpus.split(files)
    assert {f.key for f in train_files} == {e["key"] for e in m["train"]}
    assert {f.key for f in held} == {e["key"] for e in m["heldout"]}


def _tiny_built_corpus(folder: Path) -> None:
    """A built corpus (`dlm-lsp corpus` layout) of three of this project's sources and one held-out file."""
    (folder / "files" / "p" / "p").mkdir(parents=True)
    sources = {
        "objective": "train/objective",
        "sampler": "decode/sampler",
        "model": "model/transformer",
        "tokenizer": "tokenizer",
    }
    for name, source in sources.items():
        (folder / "files" / "p" / "p" / f"{name}.py").write_text((ROOT / "engine" / f"{source}.py").read_text())
    (folder / "corpus.json").write_text(
        json.dumps(
            {
                "train": ["p:p/objective.py", "p:p/sampler.py", "p:p/model.py"],
                "heldout": [],
                "heldout_packages": ["p:p/tokenizer.py"],
            }
        )
    )


@pytest.mark.parametrize("kind", ["sources", "built"])
def test_gpu_recipe_on_cpu_writes_loadable_shards(tmp_path, kind):
    from engine.train import pack

    packed = tmp_path / "corpus.tar.xz"
    if kind == "sources":
        pack.pack(packed, [], max_files=10)
    else:  # engine/train/pack.py --built: gpu_train.sh trains it with --corpus, on its own sides
        _tiny_built_corpus(tmp_path / "built")
        pack.pack_built(packed, tmp_path / "built")
    run_dir, export = tmp_path / "gpu", tmp_path / "out"
    # two batch workers forked after the corpus was encoded in parallel, on multi-hole windows (whose
    # examples call encode_batch): the Rust thread pool must be off in them, even when asked for
    env = {
        **os.environ,
        "PY": sys.executable,
        "CORPUS": str(packed),
        "WORKERS": "2",
        "SHARD_MB": "0.07",
        "OUT": str(export),
        "LIMIT_S": "120",
        "TOKENIZERS_PARALLELISM": "true",
    }
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "gpu_train.sh"),
            str(run_dir),
            "--device",
            "cpu",
            "--max-steps",
            "3",
            "--dim",
            "32",
            "--n-layers",
            "2",
            "--n-heads",
            "2",
            "--ffn-dim",
            "64",
            "--vocab",
            "512",
            "--seq-len",
            "128",
            "--batch",
            "4",
            "--warmup",
            "2",
            "--threads",
            "1",
            "--holes",
            "4",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    best = run_dir / "best"
    shards = sorted(best.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and not (best / "model.safetensors").exists()
    assert all(s.stat().st_size <= 0.07 * 2**20 + 4096 for s in shards)
    model, tok, cfg = load_checkpoint(best)
    assert cfg.dim == 32 and json.loads((best / "training_state.json").read_text())["args"]["stdlib"] is False
    # trained on the packed files only, with the original split
    split = json.loads((run_dir / "split.json").read_text())
    if kind == "sources":
        assert split["train"] and all(k.startswith("stdlib:") and not corpus.is_heldout(k) for k in split["train"])
    else:
        assert split == {
            **split,
            "train": ["p:p/objective.py", "p:p/sampler.py", "p:p/model.py"],
            "heldout": ["p:p/tokenizer.py"],
        }
    # the export: shards as they are + one tar with the rest, which rebuilds a loadable checkpoint
    exported = sorted(p.name for p in (export / "best").iterdir())
    assert exported == sorted([s.name for s in shards] + ["rest.tar"])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with tarfile.open(export / "best" / "rest.tar") as tar:
        assert not any(n.endswith("optimizer.safetensors") for n in tar.getnames())  # twice the weights: stays there
        tar.extractall(ckpt, filter="data")
    for s in shards:
        (ckpt / s.name).write_bytes(s.read_bytes())
    model2, _, _ = load_checkpoint(ckpt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k])
    assert shard_checkpoint(best) == [s.name for s in shards]  # already sharded: a no-op


def test_pack_built_keeps_the_sides_and_relabels_this_stdlib(tmp_path):
    """engine.train.pack --built: the archive is a built corpus; stdlib files travel as files of their own."""
    from engine.train import pack

    folder = tmp_path / "built"
    (folder / "files" / "p" / "p").mkdir(parents=True)
    (folder / "files" / "p" / "p" / "a.py").write_text("def a():\n    return 1\n")
    (folder / "files" / "p" / "p" / "b.py").write_text("B = 2\n")
    (folder / "files" / "p" / "p" / "bad.py").write_bytes(b"\xff\xfe")  # not UTF-8: left out, as the trainer would
    (folder / "corpus.json").write_text(
        json.dumps(
            {
                "python": "3.x",
                "train": ["p:p/a.py", "stdlib:json/decoder.py", "p:p/bad.py"],
                "heldout": ["stdlib:json/encoder.py"],
                "heldout_packages": ["p:p/b.py"],
            }
        )
    )
    out = tmp_path / "c.tar.xz"
    m = pack.pack_built(out, folder)
    assert (m["train"], m["heldout"], m["heldout_packages"]) == (2, 1, 1)
    with tarfile.open(out) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    sides = corpus.built_files(tmp_path / "x")
    assert [f.key for f in sides["train"]] == ["p:p/a.py", "stdlib-here:json/decoder.py"]
    assert [f.key for f in sides["heldout"]] == ["stdlib-here:json/encoder.py"]
    stdlib = corpus.built_files(folder)["train"][1]
    assert sides["train"][1].read() == stdlib.read() and sides["heldout_packages"][0].read() == "B = 2\n"
    assert json.loads((tmp_path / "x" / "corpus.json").read_text())["python"] == "3.x"  # the rest of the summary kept
    with pytest.raises(SystemExit, match="over the"):
        pack.pack_built(tmp_path / "d.tar.xz", folder, limit_mb=1e-6)
    assert not (tmp_path / "d.tar.xz").exists()


def test_wsd_schedule_warms_once_and_decays_over_the_planned_hours():
    from engine.train.loop import wsd_lr

    a = TrainArgs(lr=1e-3, warmup=10, total_hours=10.0, decay_share=0.2)
    assert wsd_lr(a, 0, 0.0) == pytest.approx(1e-4)
    assert wsd_lr(a, 500, 5.0) == pytest.approx(1e-3)  # stable
    assert wsd_lr(a, 500, 8.0) == pytest.approx(1e-3)  # decay starts at 80%
    assert wsd_lr(a, 900, 9.0) == pytest.approx(1e-3 * 0.55)
    assert wsd_lr(a, 999, 10.0) == pytest.approx(1e-4)
    assert wsd_lr(a, 500, 5.0, warm_from=500) == pytest.approx(1e-4)  # a fresh optimizer re-warms


def test_resume_restores_the_optimizer_and_skips_the_warm_up(tmp_path):
    from engine.train.loop import OPTIMIZER_FILE, load_raw_weights

    args = {**TINY, "warmup": 50, "total_hours": 100.0, "holes": 3}
    first = tmp_path / "a"
    train(TrainArgs(out=str(first), max_steps=4, **args))
    saved = first / "last" / OPTIMIZER_FILE
    assert saved.exists()
    raw = load_raw_weights(saved)
    ema = read_state_dict(first / "last")
    assert set(raw) <= set(ema) and any(not torch.equal(raw[k], ema[k]) for k in raw)  # raw, not the EMA
    second = tmp_path / "b"
    train(TrainArgs(out=str(second), resume=str(first / "last"), max_steps=20, **args))
    lrs = [r["lr"] for r in _log(second) if "lr" in r and r["step"] > 4]
    # the log's first LR is step 23's: the warm-up continues from step 4 of 50 instead of restarting
    assert lrs[0] == pytest.approx(6e-4 * 24 / 50)
    fresh = tmp_path / "c"
    (tmp_path / "noopt").mkdir()
    for f in (first / "last").iterdir():
        if f.name != OPTIMIZER_FILE:
            (tmp_path / "noopt" / f.name).write_bytes(f.read_bytes())
    train(TrainArgs(out=str(fresh), resume=str(tmp_path / "noopt"), max_steps=20, **args))
    fresh_lrs = [r["lr"] for r in _log(fresh) if "lr" in r and r["step"] > 4]
    assert fresh_lrs[0] == pytest.approx(6e-4 * 20 / 50)  # without the saved state it warms up again


def test_until_hours_stops_at_a_point_of_the_budget_and_keeps_the_schedule(tmp_path):
    args = {**TINY, "warmup": 50, "total_hours": 100.0}
    first = tmp_path / "a"
    train(TrainArgs(out=str(first), max_steps=4, **args))
    done = json.loads((first / "last" / "training_state.json").read_text())
    second = tmp_path / "b"  # the budget point is already behind: saved at once, no step taken
    train(TrainArgs(out=str(second), resume=str(first / "last"), max_steps=20, until_hours=done["hours"], **args))
    state = json.loads((second / "last" / "training_state.json").read_text())
    assert state["step"] == 4 and state["args"]["total_hours"] == 100.0
    third = tmp_path / "c"  # a point ahead: training goes on to it (max_steps ends it first here)
    train(TrainArgs(out=str(third), resume=str(first / "last"), max_steps=3, until_hours=done["hours"] + 1, **args))
    assert json.loads((third / "last" / "training_state.json").read_text())["step"] == 7


def test_train_on_a_built_corpus_uses_its_sides(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "files" / "p" / "p").mkdir(parents=True)
    src = (ROOT / "engine" / "train" / "objective.py").read_text()
    (folder / "files" / "p" / "p" / "a.py").write_text(src)
    (folder / "files" / "p" / "p" / "b.py").write_text((ROOT / "engine" / "decode" / "sampler.py").read_text())
    (folder / "corpus.json").write_text(
        json.dumps({"train": ["p:p/a.py"], "heldout": [], "heldout_packages": ["p:p/b.py"]})
    )
    out = tmp_path / "run"
    train(TrainArgs(out=str(out), corpus=str(folder), max_steps=2, **TINY))
    split = json.loads((out / "split.json").read_text())
    assert split["train"] == ["p:p/a.py"] and split["heldout"] == ["p:p/b.py"]


# ----------------------------------------------------------------------------- recipe (b): AR -> diffusion


def test_anneal_mask_goes_from_causal_to_full():
    from engine.train.loop import anneal_mask

    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, 4:] = False  # batch padding
    g = torch.Generator().manual_seed(0)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    m0 = anneal_mask(valid, 0.0, g)
    assert torch.equal(m0[0, 0], causal)
    assert not m0[1, 0, :4, 4:].any() and torch.equal(m0[1, 0, 4:, 4:], torch.eye(2, dtype=torch.bool))
    m1 = anneal_mask(valid, 1.0, g)
    assert m1[0, 0].all() and not m1[1, 0, :4, 4:].any()
    half = anneal_mask(torch.ones(1, 64, dtype=torch.bool), 0.5, g)[0, 0]
    future = half.triu(1).sum().item() / (64 * 63 / 2)
    assert 0.4 < future < 0.6 and half[torch.ones(64, 64, dtype=torch.bool).tril()].all()


def test_shifted_loss_reads_each_target_one_position_to_the_left():
    from engine.train.loop import shift_targets

    tgt = torch.tensor([[5, -1, 7, -1, 9]])
    w = torch.tensor([[1.0, 0.0, 2.0, 0.0, 3.0]])
    t, ww = shift_targets(tgt, w)
    assert t.tolist() == [[-1, 7, -1, 9, -1]] and ww.tolist() == [[0.0, 2.0, 0.0, 3.0, 0.0]]


def test_certainty_adds_the_entropy_of_rows_already_predicted_right():
    from contextlib import nullcontext

    from engine.model.config import ModelConfig
    from engine.model.transformer import Transformer
    from engine.train.loop import loss_on

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40,
        dim=16,
        n_layers=1,
        n_heads=2,
        ffn_dim=32,
        max_seq_len=16,
        mask_token_id=1,
        pad_token_id=0,
        eos_token_id=2,
    )
    model = Transformer(cfg).eval()
    ids = torch.randint(3, 40, (2, 8))
    with torch.no_grad():
        logits = model(ids)
    pred = logits.argmax(-1)
    tgt = torch.full((2, 8), -1)
    tgt[0, :4] = pred[0, :4]  # predicted right
    tgt[1, :4] = (pred[1, :4] + 1) % 40  # predicted wrong: no entropy term
    w = torch.where(tgt >= 0, 0.5, 0.0)
    b = {"ids": ids, "targets": tgt, "key_valid": torch.ones(2, 8, dtype=torch.bool), "weights": w}
    with torch.no_grad():
        plain = float(loss_on(model, b, "cpu", nullcontext))
        sure = float(loss_on(model, b, "cpu", nullcontext, certainty=0.3))
    logp = logits[0, :4].log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1)
    assert sure == pytest.approx(plain + 0.3 * float((ent * 0.5).sum()) / 2, rel=1e-5)
    b["targets"] = torch.where(tgt >= 0, (pred + 1) % 40, -1)  # every row wrong: the cross-entropy alone
    with torch.no_grad():
        assert float(loss_on(model, b, "cpu", nullcontext, certainty=0.3)) == float(
            loss_on(model, b, "cpu", nullcontext)
        )


def test_adapting_an_ar_checkpoint_gives_a_shifted_bidirectional_model(tmp_path):
    from engine.train.loop import OPTIMIZER_FILE, anneal_mask

    ar = tmp_path / "ar"
    train(TrainArgs(out=str(ar), objective="ar", max_steps=3, total_hours=100.0, **TINY))
    ad = tmp_path / "adapted"
    train(
        TrainArgs(
            out=str(ad),
            resume=str(ar / "last"),
            objective="diffusion",
            anneal_steps=4,
            max_steps=6,
            total_hours=100.0,
            holes=2,
            **TINY,
        )
    )
    cfg = json.loads((ad / "last" / "config.json").read_text())
    assert cfg["attention"] == "bidirectional" and cfg["logits_shift"] is True
    state = json.loads((ad / "last" / "training_state.json").read_text())
    assert state["anneal_from"] == 3 and state["step"] == 9  # annealing counted from the AR phase's last step
    assert (ad / "last" / OPTIMIZER_FILE).exists()
    # a later segment continues the same annealing (fully open by now) instead of starting it again
    again = tmp_path / "again"
    train(
        TrainArgs(
            out=str(again),
            resume=str(ad / "last"),
            objective="diffusion",
            anneal_steps=4,
            max_steps=2,
            total_hours=100.0,
            holes=2,
            **TINY,
        )
    )
    assert json.loads((again / "last" / "training_state.json").read_text())["anneal_from"] == 3
    model, tok, mcfg = load_checkpoint(ad / "last")
    assert mcfg.logits_shift and mcfg.attention == "bidirectional"
    # the override really changes the attention: a causal mask gives other states than full attention
    ids = torch.randint(10, 400, (1, 12))
    with torch.no_grad():
        full = model.hidden(ids)
        causal = model.hidden(ids, attn_mask=anneal_mask(torch.ones(1, 12, dtype=torch.bool), 0.0))
        opened = model.hidden(ids, attn_mask=anneal_mask(torch.ones(1, 12, dtype=torch.bool), 1.0))
    assert torch.allclose(full, opened, atol=1e-5) and not torch.allclose(full, causal, atol=1e-3)
    # and the engine fills with it (the logit shift read from config.json): the cached fast path
    # equals the oracle token for token
    from engine.api import DecodeOptions
    from engine.decode.forward import build_canvas
    from engine.decode.reference import reference_fill
    from engine.decode.sampler import fill

    model.eval()
    prefix, suffix = tok.encode("def f(x):\n    return"), tok.encode("\n\ndef g():\n    pass\n")
    for opts in (DecodeOptions(heal=False), DecodeOptions(heal=False, threshold=0.0, window=0, pad_left=False)):
        got = fill(model, build_canvas(prefix, suffix, 6, mcfg, opts)).ids
        assert got == reference_fill(model, prefix, suffix, 6, opts)


def test_resuming_a_diffusion_checkpoint_as_ar_is_refused(run, tmp_path):
    with pytest.raises(SystemExit, match="cannot resume"):
        train(TrainArgs(out=str(tmp_path / "x"), resume=str(run / "last"), objective="ar", max_steps=1, **TINY))


def test_a_slimmed_optimizer_resumes_from_the_ema_without_re_warm_up(tmp_path):
    from engine.train.loop import OPTIMIZER_FILE, load_raw_weights, slim_optimizer

    args = {**TINY, "warmup": 50, "total_hours": 100.0}
    first = tmp_path / "a"
    train(TrainArgs(out=str(first), max_steps=4, **args))
    opt = first / "last" / OPTIMIZER_FILE
    before = opt.stat().st_size
    slim_optimizer(opt)
    assert opt.stat().st_size < before and load_raw_weights(opt) == {}
    second = tmp_path / "b"
    train(TrainArgs(out=str(second), resume=str(first / "last"), max_steps=20, **args))
    lrs = [r["lr"] for r in _log(second) if "lr" in r and r["step"] > 4]
    assert lrs[0] == pytest.approx(6e-4 * 24 / 50)  # the warm-up continues: the moments and steps were kept


def test_a_resume_with_the_optimizer_continues_the_ema_horizon(tmp_path):
    """The EMA in a checkpoint continues across segments: one resumed step moves it by the decay the
    run's step count gives (5/14 at step 4), not by a ramp restarted at the segment's first step (1/10),
    which replaced the EMA with the noisier raw weights at every resume."""
    from engine.train.loop import OPTIMIZER_FILE, load_raw_weights

    args = {**TINY, "warmup": 50, "total_hours": 100.0}
    first = tmp_path / "a"
    train(TrainArgs(out=str(first), max_steps=4, **args))
    ema_a = read_state_dict(first / "last")
    second = tmp_path / "b"
    train(TrainArgs(out=str(second), resume=str(first / "last"), max_steps=1, **args))
    ema_b = read_state_dict(second / "last")
    raw_b = load_raw_weights(second / "last" / OPTIMIZER_FILE)
    decay = 5 / 14
    moved = [k for k in raw_b if not torch.equal(raw_b[k], ema_a[k])]
    assert moved
    for k in moved:
        want = ema_a[k].float() * decay + raw_b[k].float() * (1 - decay)
        torch.testing.assert_close(ema_b[k].float(), want, rtol=1e-5, atol=1e-6)


def test_sigterm_ends_training_after_the_step_under_way_with_the_final_save(tmp_path, monkeypatch):
    import signal

    from engine.train import loop as train_mod

    calls = []
    real = train_mod.loss_on

    def loss_then_term(*a, **k):  # the third step is asked to stop while it runs (a `kill PID`)
        if torch.is_grad_enabled():  # a training step, not the held-out loss of a save
            calls.append(1)
        if len(calls) == 3 and torch.is_grad_enabled():
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(train_mod, "loss_on", loss_then_term)
    out = tmp_path / "run"
    train(TrainArgs(out=str(out), max_steps=50, minutes=30, **TINY))
    state = json.loads((out / "last" / "training_state.json").read_text())
    assert state["step"] == 3 and len(calls) == 3  # the step under way finished and was saved; no more
    assert signal.getsignal(signal.SIGTERM) is before  # the process's own handler is back
