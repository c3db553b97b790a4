"""A small pre-norm transformer: bidirectional for masked diffusion, causal for the AR twin.

Llama-shaped (RMSNorm, RoPE, SwiGLU) plus RMS QK-norm. The forward pass is split in two so the
decoding loop can run the expensive part on few positions:
  hidden(ids, ...) -> pre-norm hidden states (B, L, D), optionally with each layer's K/V
  logits(h)        -> final norm + LM head (B, L, V)
Context K/V (`ctx`) lets a step run only the canvas positions against the cached prefix/suffix
K/V (Fast-dLLM DualCache) and lets the causal twin decode with a KV cache; both use one code path.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.config import ModelConfig

KV = tuple[torch.Tensor, torch.Tensor]  # (B, H, L, Dh) each, RoPE already applied to K
# A context may also be given as (k_buf, v_buf, n): buffers whose first n rows are the context, with
# room after them. The call writes its own K/V at rows n.. and attends to the buffer's first n + L rows:
# no concatenation (which copies the whole context, every layer, every step).


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32: bf16 sums of squares lose too much for tiny dims
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns cos, sin of shape (max_seq_len, head_dim) in the rotate-half (HF Llama) layout."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    t = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, L, Dh); cos/sin: (B, 1, L, Dh)
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rot * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, mask, ctx: KV | None, is_causal: bool):
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)
        k = self.wk(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        new_kv = (k, v)
        if ctx is not None and len(ctx) == 3:  # in place: write after the context's n rows
            kb, vb, n = ctx
            kb[:, :, n : n + L] = k
            vb[:, :, n : n + L] = v
            k, v = kb[:, :, : n + L], vb[:, :, : n + L]
        elif ctx is not None:
            k = torch.cat([ctx[0], k], dim=2)
            v = torch.cat([ctx[1], v], dim=2)
        # with cached context the causal mask is built explicitly (SDPA's is_causal aligns top-left)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None and ctx is None)
        out = out.transpose(1, 2).reshape(B, L, -1)
        return self.wo(out), new_kv


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, ctx, is_causal):
        a, kv = self.attn(self.attn_norm(x), cos, sin, mask, ctx, is_causal)
        x = x + a
        x = x + self.mlp(self.ffn_norm(x))
        return x, kv


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def causal(self) -> bool:
        return self.cfg.attention == "causal"

    def init_weights(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
                continue
            std = 0.02
            if name.endswith(("wo.weight", "w2.weight")):
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers)  # GPT-2 residual scaling
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * std)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def _mask(self, B, L, device, key_valid, ctx_valid, Lc):
        """Boolean attention mask (B, 1, L, Lc+L), True = attend; None when nothing is masked."""
        # a single causal query after its context sees everything: no mask (the AR decode step)
        if key_valid is None and ctx_valid is None and (not self.causal or Lc == 0 or L == 1):
            return None
        kv_self = key_valid if key_valid is not None else torch.ones(B, L, dtype=torch.bool, device=device)
        kv_ctx = ctx_valid if ctx_valid is not None else torch.ones(B, Lc, dtype=torch.bool, device=device)
        self_part = kv_self[:, None, None, :].expand(B, 1, L, L)
        eye = torch.eye(L, dtype=torch.bool, device=device)
        if self.causal:
            self_part = self_part & torch.ones(L, L, dtype=torch.bool, device=device).tril()
        # every query may at least see itself, so rows at padding stay finite
        self_part = self_part | eye
        ctx_part = kv_ctx[:, None, None, :].expand(B, 1, L, Lc)
        return torch.cat([ctx_part, self_part], dim=-1)

    def hidden(
        self,
        ids: torch.Tensor,  # (B, L)
        pos: torch.Tensor | None = None,  # (B, L) absolute positions; default 0..L-1 (+ctx length)
        key_valid: torch.Tensor | None = None,  # (B, L) False at batch padding
        ctx: list | None = None,  # per layer (k, v) (B, H, Lc, Dh), or (k_buf, v_buf, Lc) with room after Lc
        ctx_valid: torch.Tensor | None = None,  # (B, Lc)
        return_kv: bool = False,
    ):
        """Returns pre-norm hidden states (B, L, D), plus this call's per-layer K/V if return_kv."""
        B, L = ids.shape
        Lc = 0 if ctx is None else (ctx[0][2] if len(ctx[0]) == 3 else ctx[0][0].shape[2])
        if pos is None:
            pos = torch.arange(Lc, Lc + L, device=ids.device).expand(B, L)
        if int(pos.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(pos.max())} exceeds max_seq_len {self.cfg.max_seq_len}")
        cos = self.rope_cos[pos].unsqueeze(1).to(self.tok_embeddings.weight.dtype)  # (B, 1, L, Dh)
        sin = self.rope_sin[pos].unsqueeze(1).to(self.tok_embeddings.weight.dtype)
        mask = self._mask(B, L, ids.device, key_valid, ctx_valid, Lc)
        x = self.tok_embeddings(ids)
        kvs = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, mask, None if ctx is None else ctx[i], self.causal)
            if return_kv:
                kvs.append(kv)
        return (x, kvs) if return_kv else x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: (..., D) -> (..., V)."""
        return F.linear(self.norm(h), self.head_weight)

    def forward(self, ids, pos=None, key_valid=None):
        return self.logits(self.hidden(ids, pos, key_valid))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
