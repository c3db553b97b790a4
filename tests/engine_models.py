"""Models for engine tests: random transformers with peaked predictions, and a mock model whose
predictions the test writes down.

A freshly initialised model (std 0.02) predicts nearly uniform distributions, so every confidence is
~1/V and a threshold is never met; `peaked_model` uses unit-scale weights and an untied head so slots
disagree, some cross the threshold and argmax ties are out of reach of float noise.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from engine.model.config import ModelConfig
from engine.model.transformer import Transformer
from engine.weights.checkpoint import save_checkpoint
from engine.weights.load import load_checkpoint
from tests.tiny import make_tiny_checkpoint


def peaked_weights(model: Transformer, seed: int = 0, head_std: float = 1.0) -> Transformer:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            elif name == "output.weight":
                p.copy_(torch.randn(p.shape, generator=g) * head_std)
            elif name == "tok_embeddings.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # (out, in): unit-variance outputs, so attention and MLPs matter
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return model.eval()


def peaked_model(
    logits_shift: bool = False,
    causal: bool = False,
    seed: int = 0,
    vocab: int = 300,
    dim: int = 32,
    n_layers: int = 2,
    pad: int = 0,
    eos: int = 1,
    mask: int = 2,
) -> Transformer:
    cfg = ModelConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=n_layers,
        n_heads=2,
        ffn_dim=2 * dim,
        max_seq_len=512,
        logits_shift=logits_shift,
        attention="causal" if causal else "bidirectional",
        tie_embeddings=False,
        mask_token_id=mask,
        pad_token_id=pad,
        eos_token_id=eos,
        bos_token_id=3,
    )
    return peaked_weights(Transformer(cfg.validate()), seed)


def peaked_checkpoint(folder, seed: int = 0, logits_shift: bool = False) -> Path:
    """A tiny checkpoint folder (real BPE tokenizer) whose weights are peaked_weights."""
    folder = Path(folder)
    make_tiny_checkpoint(folder, logits_shift=logits_shift, seed=seed)
    _, tok, cfg = load_checkpoint(folder)
    cfg.tie_embeddings = False
    model = peaked_weights(Transformer(cfg), seed)
    save_checkpoint(folder, model, tok)
    return folder


class MockModel(nn.Module):
    """Same interface as Transformer for the sampler (hidden / logits / norm / head_weight / cfg), but
    the logits at each position come from `script(ids, pos) -> (L, V)`, written by the test.

    The sampler applies the final RMSNorm itself (kernels.slot_stats), so the mock makes that norm a
    fixed scale: with eps far above mean(h^2), rsqrt(mean(h^2) + eps) ~= eps^-1/2, and a head of
    eps^1/2 * I gives logits == hidden states to ~1e-7.
    """

    EPS = 1e10

    def __init__(self, cfg: ModelConfig, script):
        super().__init__()
        self.cfg, self.script = cfg, script
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(cfg.vocab_size), requires_grad=False)
        self.norm.eps = self.EPS
        self.register_buffer("head_weight", torch.eye(cfg.vocab_size) * self.EPS**0.5)
        self.calls: list[tuple[int, int]] = []  # (batch, positions) of every hidden() call

    @property
    def causal(self) -> bool:
        return False

    def hidden(self, ids, pos=None, key_valid=None, ctx=None, ctx_valid=None, return_kv=False):
        B, L = ids.shape
        Lc = 0 if ctx is None else ctx[0][0].shape[2]
        if pos is None:
            pos = torch.arange(Lc, Lc + L).expand(B, L)
        self.calls.append((B, L))
        h = torch.stack([self.script(ids[b], pos[b]) for b in range(B)]).float()  # (B, L, V)
        if not return_kv:
            return h
        kv = torch.zeros(B, 1, L, 1)
        return h, [(kv, kv)]

    def logits(self, h):
        return h

    def forward(self, ids, pos=None, key_valid=None):
        return self.hidden(ids, pos, key_valid)


def cpu_vendor() -> str:
    """GenuineIntel / AuthenticAMD (/proc/cpuinfo): the same ISA level rounds differently across
    vendors (tests/test_families_default.py and its capture script compare on the same kind only)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
