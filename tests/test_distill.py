"""engine/train/distill.py, candidate (e): a teacher with another tokenizer gives soft targets on the rows
where both tokenizations start a token at the same character, projected onto the student's ids;
shards append and are refused for another tokenizer or shape; training mixes them into the loss."""

from __future__ import annotations

import json

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.transformer import Transformer
from engine.tokenizer import BOS, EOS, MASK, PAD, train_bpe
from engine.train import corpus, distill
from engine.train.loop import Batches, TrainArgs, loss_on, train


@pytest.fixture(scope="module")
def texts():
    files = corpus.collect([], include_stdlib=True)[:10]
    return [t for t in (f.read() for f in files) if t]


@pytest.fixture(scope="module")
def student_tok(texts, tmp_path_factory):
    tok = train_bpe(texts, 512)
    folder = tmp_path_factory.mktemp("student")
    tok.save(folder)
    return tok, folder


@pytest.fixture(scope="module")
def teacher(texts):
    tok = train_bpe(texts[::-1][:6], 700)  # other merges: the boundaries differ in places
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        dim=32,
        n_layers=2,
        n_heads=2,
        ffn_dim=64,
        max_seq_len=2048,
        attention="causal",
        logits_shift=False,
        mask_token_id=tok.token_id(MASK),
        pad_token_id=tok.token_id(PAD),
        eos_token_id=tok.token_id(EOS),
        bos_token_id=tok.token_id(BOS),
    ).validate()
    model = Transformer(cfg)
    model.init_weights(3)
    return model.eval(), tok


def test_projection_takes_the_students_first_token_of_each_teacher_text(teacher, student_tok):
    _, t_tok = teacher
    s_tok, _ = student_tok
    proj = distill.projection(t_tok, s_tok, specials={t_tok.token_id(MASK)})
    assert proj.shape == (t_tok.vocab_size,)
    assert proj[t_tok.token_id(MASK)] == -1
    added = {i for i, t in t_tok.tok.get_added_tokens_decoder().items() if t.special}
    assert added and all(int(proj[v]) == -1 for v in added)  # the teacher's own special tokens carry nothing
    checked = 0
    for v in range(t_tok.vocab_size):
        text = t_tok.token_text(v)
        if int(proj[v]) < 0:
            assert v == t_tok.token_id(MASK) or v in added or not text or "\ufffd" in text
            continue
        assert int(proj[v]) == s_tok.encode(text)[0]
        checked += 1
    assert checked > 500  # all but the specials and the byte pieces of the 256-byte alphabet


def test_window_targets_equal_a_brute_force_projection(teacher, student_tok, texts):
    model, t_tok = teacher
    s_tok, _ = student_tok
    text = texts[0][:1500]
    s_ids, s_starts = distill._offsets(s_tok, text)
    proj = distill.projection(t_tok, s_tok)
    top_ids, top_p, has = distill.window_targets(model, t_tok, proj, s_tok.vocab_size, text, s_starts, k=4)
    t_ids, t_starts = distill._offsets(t_tok, text)
    assert not has[0] and 0.5 < float(has.float().mean()) < 1.0  # aligned mostly, not everywhere
    teacher_starts = set(t_starts[1:])
    for i in range(len(s_starts)):
        assert bool(has[i]) == (i > 0 and s_starts[i] in teacher_starts), i
    logits = model(torch.tensor(t_ids)[None])[0]
    for i in [i for i in range(len(s_starts)) if has[i]][:5]:
        j = t_starts.index(s_starts[i]) - 1  # the teacher position that predicts the token starting there
        p = logits[j].softmax(-1)
        want = torch.zeros(s_tok.vocab_size)
        for v in range(t_tok.vocab_size):
            if proj[v] >= 0:
                want[proj[v]] += p[v]
        vals, idx = want.topk(4)
        torch.testing.assert_close(top_p[i], vals, atol=1e-5, rtol=1e-4)
        assert set(top_ids[i].tolist()) == set(idx.tolist()) or torch.allclose(vals[-2:], vals[-1:])  # ties aside


def test_shards_append_and_are_refused_for_another_tokenizer_or_shape(teacher, student_tok, texts, tmp_path):
    model, t_tok = teacher
    s_tok, _ = student_tok
    out = tmp_path / "targets"
    man = distill.build_targets(
        model, t_tok, s_tok, texts, out, windows=3, k=4, seq_len=64, shard_windows=2, log=lambda *_: None
    )
    assert man["windows"] == 3 and man["shards"] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    man = distill.build_targets(
        model, t_tok, s_tok, texts, out, windows=2, k=4, seq_len=64, shard_windows=2, log=lambda *_: None
    )
    assert man["windows"] == 5 and len(man["shards"]) == 3
    assert json.loads((out / distill.MANIFEST).read_text())["rows_with_target"] == man["rows_with_target"] > 0
    t = distill.load_targets(out, s_tok)
    assert len(t) == 5 and t.top_ids.shape == (5, 64, 4) and int(t.lens.max()) <= 64
    for w in range(5):  # each window's ids are the student's own tokens of some train file
        ids = t.ids[w, : int(t.lens[w])].tolist()
        assert any(s_tok.decode(ids) in text for text in texts)
        assert bool((t.ids[w, int(t.lens[w]) :] == -1).all())
    with pytest.raises(distill.DistillError, match="another student tokenizer"):
        distill.load_targets(out, t_tok)
    with pytest.raises(distill.DistillError, match="k = 4"):
        distill.build_targets(model, t_tok, s_tok, texts, out, windows=1, k=8, seq_len=64, log=lambda *_: None)
    with pytest.raises(distill.DistillError, match="no readable"):
        distill.load_targets(tmp_path / "nothing")


def test_kd_loss_mixes_the_hard_and_the_soft_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    logp = logits.log_softmax(-1)
    tgt = torch.tensor([1, 2, 3])
    ids = torch.tensor([[1, 5], [7, 2], [0, 0]])
    p = torch.tensor([[1.0, 0.0], [0.3, 0.3], [0.0, 0.0]])  # row 2: no soft target
    got = distill.kd_loss(logits, tgt, ids, p, 0.5)
    torch.testing.assert_close(got[0], -logp[0, 1])  # a one-hot teacher on the hard target: the plain CE
    torch.testing.assert_close(got[1], 0.5 * -logp[1, 2] + 0.5 * -(0.5 * logp[1, 7] + 0.5 * logp[1, 2]))  # renormalized
    torch.testing.assert_close(got[2], -logp[2, 3])
    torch.testing.assert_close(distill.kd_loss(logits, tgt, ids, p, 0.0), -logp.gather(1, tgt[:, None])[:, 0])


def test_training_draws_teacher_windows_and_their_soft_targets_change_the_loss(teacher, student_tok, texts, tmp_path):
    model, t_tok = teacher
    s_tok, s_folder = student_tok
    out = tmp_path / "targets"
    distill.build_targets(model, t_tok, s_tok, texts, out, windows=4, k=4, seq_len=128, log=lambda *_: None)
    args = TrainArgs(distill=str(out), kd_share=1.0, infill_share=0.0, seq_len=128)
    data = Batches(texts, s_tok, args, seed=0)
    b = data.batch(4)
    assert "soft_p" in b and float(b["soft_p"].sum()) > 0
    masked = b["targets"] >= 0
    assert float(b["soft_p"][~masked].sum()) == 0  # soft targets sit on masked rows only
    for w in range(4):  # every teacher window's ids are one stored window's
        n = int((b["key_valid"][w]).sum())
        want = b["targets"][w, :n].where(masked[w, :n], b["ids"][w, :n])
        assert any(torch.equal(want.int(), data.targets.ids[i, :n]) for i in range(len(data.targets)))
    cfg = ModelConfig(
        vocab_size=s_tok.vocab_size,
        dim=32,
        n_layers=2,
        n_heads=2,
        ffn_dim=64,
        max_seq_len=256,
        logits_shift=True,
        mask_token_id=s_tok.token_id(MASK),
        pad_token_id=s_tok.token_id(PAD),
        eos_token_id=s_tok.token_id(EOS),
        bos_token_id=s_tok.token_id(BOS),
    ).validate()
    student = Transformer(cfg)
    student.init_weights(0)
    off = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    with torch.no_grad():
        hard = loss_on(student, b, "cpu", off)
        assert float(loss_on(student, b, "cpu", off, kd_weight=0.5)) != pytest.approx(float(hard))
        assert float(
            loss_on(student, {k: v for k, v in b.items() if not k.startswith("soft")}, "cpu", off, kd_weight=0.5)
        ) == pytest.approx(float(hard))
    # the whole loop: a tiny student trains a few steps with the targets (its tokenizer is theirs)
    run = tmp_path / "run"
    train(
        TrainArgs(
            out=str(run),
            tokenizer=str(s_folder),
            distill=str(out),
            kd_share=0.5,
            max_steps=3,
            max_files=10,
            dim=32,
            n_layers=2,
            n_heads=2,
            ffn_dim=64,
            seq_len=128,
            batch=4,
            val_examples=16,
            warmup=2,
            threads=1,
            progress=False,
        )
    )
    assert (run / "last" / "model.safetensors").exists()
    state = json.loads((run / "last" / "training_state.json").read_text())
    assert state["args"]["distill"] == str(out) and state["step"] == 3
    with pytest.raises(SystemExit, match="diffusion student"):
        Batches(texts, s_tok, TrainArgs(distill=str(out), objective="ar"), seed=0)


def test_soft_targets_move_left_with_the_hard_targets_of_a_shifted_model():
    from engine.train.loop import shift_rows, shift_targets

    tgt = torch.tensor([[-1, 5, -1, 7]])
    w = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    p = torch.zeros(1, 4, 2)
    p[0, 1, 0], p[0, 3, 1] = 0.9, 0.8
    t, _ = shift_targets(tgt, w)
    sp = shift_rows(p)
    assert t.tolist() == [[5, -1, 7, -1]]
    assert torch.equal(sp[0, :3], p[0, 1:]) and float(sp[0, 3].abs().sum()) == 0
    assert torch.equal((sp.sum(-1) > 0), (t >= 0))  # each soft row sits where its hard target went
