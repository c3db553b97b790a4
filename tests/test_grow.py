"""engine/train/grow.py: a grown checkpoint computes what its source computed (new blocks add nothing until
trained), its optimizer file carries the old blocks' moments to their new places and none for the new
blocks, and `train --resume` continues it on the same plan."""

from __future__ import annotations

import json

import pytest
import torch

from engine.train.grow import grow_checkpoint, layer_plan
from engine.train.loop import OPTIMIZER_FILE, TrainArgs, load_optimizer, load_raw_weights, train
from engine.weights.load import load_checkpoint, read_state_dict

TINY = dict(
    max_files=10,
    dim=32,
    n_layers=3,
    n_heads=2,
    ffn_dim=64,
    seq_len=128,
    vocab=512,
    batch=4,
    val_examples=16,
    warmup=2,
    threads=1,
    progress=False,
    total_hours=100.0,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("grow") / "run"
    train(TrainArgs(out=str(out), max_steps=4, **TINY))
    return out / "last"


def test_layer_plan_puts_each_new_block_after_its_source():
    assert layer_plan(3, [0, 2]) == [(0, False), (0, True), (1, False), (2, False), (2, True)]
    assert layer_plan(2, [1, 1]) == [(0, False), (1, False), (1, True), (1, True)]
    with pytest.raises(ValueError, match="blocks 0-2"):
        layer_plan(3, [3])


def test_grown_model_gives_the_same_logits(trained, tmp_path):
    cfg = grow_checkpoint(trained, tmp_path / "g", after=[0, 2])
    assert cfg.n_layers == 5
    small, tok, _ = load_checkpoint(trained)
    big, tok2, cfg2 = load_checkpoint(tmp_path / "g")
    assert cfg2.n_layers == 5 and tok2.vocab_size == tok.vocab_size
    ids = torch.tensor([tok.encode("def add(a, b):\n    return a + b\n")])
    with torch.no_grad():
        a, b = small(ids), big(ids)
    a, b = (x[0] if isinstance(x, tuple) else x for x in (a, b))
    assert torch.allclose(a, b, atol=1e-5)
    sd = read_state_dict(tmp_path / "g")
    assert torch.equal(sd["layers.1.attn.wq.weight"], sd["layers.0.attn.wq.weight"])  # a copy of block 0
    assert not sd["layers.1.attn.wo.weight"].any() and not sd["layers.1.mlp.w2.weight"].any()
    assert sd["layers.1.attn.wq.weight"].any()
    assert torch.equal(sd["layers.3.mlp.w1.weight"], read_state_dict(trained)["layers.2.mlp.w1.weight"])
    state = json.loads((tmp_path / "g" / "training_state.json").read_text())
    assert state["step"] == json.loads((trained / "training_state.json").read_text())["step"]


def test_grown_optimizer_moves_old_moments_and_leaves_new_blocks_fresh(trained, tmp_path):
    grow_checkpoint(trained, tmp_path / "g", after=[1])
    big, _, _ = load_checkpoint(tmp_path / "g")
    opt = torch.optim.AdamW(big.parameters())
    load_optimizer(opt, big, tmp_path / "g" / OPTIMIZER_FILE)
    names = dict(big.named_parameters())
    old = load_raw_weights(trained / OPTIMIZER_FILE)
    from safetensors import safe_open

    with safe_open(str(trained / OPTIMIZER_FILE), framework="pt") as f:
        old_m = f.get_tensor("exp_avg.layers.2.mlp.w1.weight").float()
    assert torch.equal(opt.state[names["layers.3.mlp.w1.weight"]]["exp_avg"], old_m)  # block 2 is now 3
    assert names["layers.2.mlp.w1.weight"] not in opt.state  # the new block: fresh state
    assert int(opt.state[names["layers.3.mlp.w1.weight"]]["step"]) == 4
    raw = load_raw_weights(tmp_path / "g" / OPTIMIZER_FILE)
    assert torch.equal(raw["layers.3.attn.wq.weight"], old["layers.2.attn.wq.weight"])
    assert not raw["layers.2.attn.wo.weight"].any()


def test_train_resumes_a_grown_checkpoint(trained, tmp_path):
    grow_checkpoint(trained, tmp_path / "g", after=[0])
    out = tmp_path / "more"
    train(TrainArgs(out=str(out), resume=str(tmp_path / "g"), max_steps=7, **{**TINY, "n_layers": 4}))
    sd = read_state_dict(out / "last")
    assert sd["layers.1.attn.wo.weight"].any()  # the new block learned something
    assert (
        json.loads((out / "last" / "training_state.json").read_text())["step"] == 4 + 7
    )  # max_steps counts this run's steps
