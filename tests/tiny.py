"""Tiny random-weight checkpoints in the project's format, for tests (no downloads)."""

from __future__ import annotations

from pathlib import Path

from engine.model.config import ModelConfig
from engine.model.transformer import Transformer
from engine.tokenizer import BOS, EOS, MASK, PAD, train_bpe
from engine.weights.checkpoint import save_checkpoint

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i)\n",
    "function f(x) { return x * 2; }\n",
] * 20


def make_tiny_checkpoint(
    folder,
    attention: str = "bidirectional",
    logits_shift: bool = False,
    seed: int = 0,
    dim: int = 32,
    n_layers: int = 2,
    vocab: int = 300,
    printable: bool = False,
    canvas: str | None = None,
) -> Path:
    """Writes a random-weight checkpoint (canvas="reorder" with attention="causal": recipe (c)'s
    layout, engine/decode/reorder.py). printable=True zeroes the (tied) embedding rows of every
    token that does not decode to printable ASCII (special tokens included), so greedy fills are
    readable text that never ends in padding - what protocol tests need from a model."""
    tok = train_bpe(CORPUS, vocab)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=2,
        ffn_dim=dim * 2,
        max_seq_len=1024,
        attention=attention,
        logits_shift=logits_shift,
        canvas=canvas,
        mask_token_id=tok.token_id(MASK),
        pad_token_id=tok.token_id(PAD),
        eos_token_id=tok.token_id(EOS),
        bos_token_id=tok.token_id(BOS),
    ).validate()
    model = Transformer(cfg)
    model.init_weights(seed)
    if printable:
        import torch

        with torch.no_grad():
            for tid in range(tok.vocab_size):
                text = tok.decode([tid])
                if not text.strip() or not all(" " <= ch <= "~" for ch in text):
                    model.tok_embeddings.weight[tid].zero_()
    save_checkpoint(folder, model, tok)
    return Path(folder)


def tiny_service(folder, seed: int):
    """A loaded one-thread EngineService on a tiny checkpoint written to `folder` (the module-scoped
    `service` fixture of the decoding-option tests)."""
    from engine.serve.service import EngineService

    svc = EngineService(str(make_tiny_checkpoint(folder, seed=seed)), device="cpu", threads=1)
    svc.load()
    return svc
