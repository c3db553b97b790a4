"""One pre-norm decoder architecture for every model the engine runs: the project's own checkpoints
and the open diffusion families (engine/families), which are data over this module.

Llama/Qwen2/Qwen3-shaped: RMSNorm, RoPE (optionally linearly scaled), SwiGLU, grouped-query attention
(`n_kv_heads`), optional q/k/v and output biases (Qwen2, Llama `attention_bias`), optional per-head
RMS QK-norm (Qwen3, and the project's models), tied or untied LM head. The attention topology is
data (`cfg.attention`): bidirectional (diffusion), causal (the AR twin, WeDLM) or block-causal
(SDAR, Fast-dLLM v2). The logit shift (Dream lineage) is honoured by the sampler, not here: logits
at position p are always the model's output at p. The forward pass is split in two so the
decoding loop can run the expensive part on few positions:
  hidden(ids, ...) -> pre-norm hidden states (B, L, D), optionally with each layer's K/V
  logits(h)        -> final norm + LM head (B, L, V)
Context K/V (`ctx`) lets a step run only the canvas positions against the cached prefix/suffix
K/V (Fast-dLLM DualCache) and lets the causal twin decode with a KV cache; both use one code path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, cast, overload

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.model.config import ModelConfig

KV = tuple[torch.Tensor, torch.Tensor]  # (B, Hkv, L, Dh) each, RoPE already applied to K
KV3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q (B, H, L, Dh), k, v (B, Hkv, L, Dh)
BufKV = tuple[torch.Tensor, torch.Tensor, int]  # (k_buf, v_buf, n): see below
CtxKV = KV | BufKV  # one layer's context
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


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns cos, sin of shape (max_seq_len, head_dim) in the rotate-half (HF Llama) layout."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    if cfg.rope_linear_factor != 1.0:  # linear scaling: as if every position were divided by the factor
        inv = inv / cfg.rope_linear_factor
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
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, q_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_dim, cfg.dim, bias=cfg.out_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        ctx: CtxKV | None,
        is_causal: bool,
    ) -> tuple[torch.Tensor, KV]:
        B, L, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
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
        # (an empty context leaves keys == queries, where SDPA's top-left alignment is right)
        causal = is_causal and mask is None and (ctx is None or k.shape[2] == L)
        return self._attend(q, k, v, mask, causal), new_kv

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV3:
        """q (B, H, L, Dh), k and v (B, Hkv, L, Dh) of these rows, RoPE applied."""
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)
        k = self.wk(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, L, Dh)
        v = self.wv(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
    ) -> torch.Tensor:
        """The output projection of attention from q (B, H, L, Dh) over k, v (B, Hkv, N, Dh): (B, L, D)."""
        B, H, L, Dh = q.shape
        if self.n_kv == self.n_heads:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        elif mask is None:  # each K/V head serves n_heads / n_kv query heads (flash attention takes GQA as is)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        else:
            # with a mask no fused kernel takes GQA (SDPA falls to the math backend, which repeats K/V
            # H / Hkv times): the grouped query heads fold into the query length instead, one
            # (G * L)-row query per K/V head (query head h = kv * G + g reads row g * L + r), so the
            # memory-efficient or cuDNN kernel runs it and K/V are never repeated
            G = H // self.n_kv
            qf = q.reshape(B, self.n_kv, G * L, Dh)
            mf = mask.repeat(1, 1, G, 1) if mask.shape[1] == 1 else mask.reshape(B, self.n_kv, G * L, -1)
            out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mf).reshape(B, H, L, Dh)
        return self.wo(out.transpose(1, 2).reshape(B, L, -1))

    def forward_rows(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        at: torch.Tensor,
    ) -> torch.Tensor:
        """The fixed-shape step's attention (engine/decode/static.py): writes these rows' K/V into rows
        `at` (B, L) of the buffers (B, Hkv, N, Dh) in place, then attends to all N rows under `mask`
        (B, 1, L, N). One scatter per buffer, no host sync, no shape that depends on data."""
        q, k, v = self._qkv(x, cos, sin)
        idx = at[:, None, :, None].expand(-1, self.n_kv, -1, self.head_dim)  # (B, Hkv, L, Dh)
        k_buf.scatter_(2, idx, k)
        v_buf.scatter_(2, idx, v)
        return self._attend(q, k_buf, v_buf, mask, False)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.mlp_bias)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        ctx: CtxKV | None,
        is_causal: bool,
    ) -> tuple[torch.Tensor, KV]:
        a, kv = self.attn(self.attn_norm(x), cos, sin, mask, ctx, is_causal)
        x = x + a
        x = x + self.mlp(self.ffn_norm(x))
        return x, kv

    def forward_rows(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        at: torch.Tensor,
    ) -> torch.Tensor:
        """Attention.forward_rows, then the MLP: the fixed-shape step's layer."""
        x = x + self.attn.forward_rows(self.attn_norm(x), cos, sin, mask, k_buf, v_buf, at)
        return x + self.mlp(self.ffn_norm(x))


class Transformer(nn.Module):
    # registered (non-persistent) buffers: declared so that attribute access is a Tensor, not nn.Module's union
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
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
                (nn.init.zeros_ if name.endswith(".bias") else nn.init.ones_)(p)
                continue
            std = 0.02
            if name.endswith(("wo.weight", "w2.weight")):
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers)  # GPT-2 residual scaling
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * std)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def _mask(
        self,
        B: int,
        L: int,
        device: torch.device,
        key_valid: torch.Tensor | None,
        ctx_valid: torch.Tensor | None,
        Lc: int,
        pos: torch.Tensor,
        ctx_pos: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Boolean attention mask (B, 1, L, Lc+L), True = attend; None when nothing is masked.
        Causal order is the order of the rows (the context first: WeDLM's reordered inputs keep their
        logical positions but attend in physical order); block-causal order is by absolute position."""
        if self.cfg.attention == "block_causal":
            return self._block_mask(B, L, device, key_valid, ctx_valid, Lc, pos, ctx_pos)
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

    def _block_mask(
        self,
        B: int,
        L: int,
        device: torch.device,
        key_valid: torch.Tensor | None,
        ctx_valid: torch.Tensor | None,
        Lc: int,
        pos: torch.Tensor,
        ctx_pos: torch.Tensor | None,
    ) -> torch.Tensor:
        """Block-causal (B, 1, L, Lc+L): a query sees the keys whose block (absolute position //
        block_size) is not after its own. The context's positions default to 0..Lc-1."""
        bs = self.cfg.block_size
        if Lc:
            if ctx_pos is None:
                ctx_pos = torch.arange(Lc, device=device).expand(B, Lc)
            key_pos = torch.cat([ctx_pos, pos], dim=1)  # (B, Lc+L)
        else:
            key_pos = pos
        ok = (key_pos[:, None, :] // bs) <= (pos[:, :, None] // bs)  # (B, L, Lc+L)
        valid = [
            v if v is not None else torch.ones(B, n, dtype=torch.bool, device=device)
            for v, n in ((ctx_valid, Lc), (key_valid, L))
        ]
        ok = ok & torch.cat(valid, dim=1)[:, None, :]
        ok[:, :, Lc:] |= torch.eye(L, dtype=torch.bool, device=device)  # padding rows stay finite
        return ok[:, None]

    @overload
    def hidden(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor | None = ...,
        key_valid: torch.Tensor | None = ...,
        ctx: Sequence[CtxKV] | None = ...,
        ctx_valid: torch.Tensor | None = ...,
        return_kv: Literal[False] = ...,
        ctx_pos: torch.Tensor | None = ...,
        attn_mask: torch.Tensor | None = ...,
    ) -> torch.Tensor: ...
    @overload
    def hidden(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor | None = ...,
        key_valid: torch.Tensor | None = ...,
        ctx: Sequence[CtxKV] | None = ...,
        ctx_valid: torch.Tensor | None = ...,
        *,
        return_kv: Literal[True],
        ctx_pos: torch.Tensor | None = ...,
        attn_mask: torch.Tensor | None = ...,
    ) -> tuple[torch.Tensor, list[KV]]: ...
    @overload
    def hidden(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor | None = ...,
        key_valid: torch.Tensor | None = ...,
        ctx: Sequence[CtxKV] | None = ...,
        ctx_valid: torch.Tensor | None = ...,
        return_kv: bool = ...,
        ctx_pos: torch.Tensor | None = ...,
        attn_mask: torch.Tensor | None = ...,
    ) -> torch.Tensor | tuple[torch.Tensor, list[KV]]: ...
    def hidden(
        self,
        ids: torch.Tensor,  # (B, L)
        pos: torch.Tensor | None = None,  # (B, L) absolute positions; default 0..L-1 (+ctx length)
        key_valid: torch.Tensor | None = None,  # (B, L) False at batch padding
        ctx: Sequence[CtxKV] | None = None,  # per layer (k, v) (B, H, Lc, Dh), or (k_buf, v_buf, Lc) with room after Lc
        ctx_valid: torch.Tensor | None = None,  # (B, Lc)
        return_kv: bool = False,
        ctx_pos: torch.Tensor | None = None,  # (B, Lc) the context's absolute positions (block_causal)
        attn_mask: torch.Tensor | None = None,  # (B, 1, L, L) True = attend: replaces the topology's mask
    ) -> torch.Tensor | tuple[torch.Tensor, list[KV]]:
        """Returns pre-norm hidden states (B, L, D), plus this call's per-layer K/V if return_kv.
        `attn_mask` (training only, no context) overrides the attention topology, e.g. the random
        causal-to-full mask of AR-to-diffusion adaptation (engine/train/loop.py `anneal_mask`)."""
        B, L = ids.shape
        Lc = 0 if ctx is None else (ctx[0][2] if len(ctx[0]) == 3 else ctx[0][0].shape[2])
        if pos is None:
            pos = torch.arange(Lc, Lc + L, device=ids.device).expand(B, L)
        if int(pos.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(pos.max())} exceeds max_seq_len {self.cfg.max_seq_len}")
        cos = self.rope_cos[pos].unsqueeze(1).to(self.tok_embeddings.weight.dtype)  # (B, 1, L, Dh)
        sin = self.rope_sin[pos].unsqueeze(1).to(self.tok_embeddings.weight.dtype)
        if attn_mask is not None and ctx is not None:
            raise ValueError("attn_mask overrides the topology of a whole sequence: no cached context")
        mask = self._mask(B, L, ids.device, key_valid, ctx_valid, Lc, pos, ctx_pos) if attn_mask is None else attn_mask
        causal = self.causal and attn_mask is None
        x = self.tok_embeddings(ids)
        kvs: list[KV] = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, mask, None if ctx is None else ctx[i], causal)
            if return_kv:
                kvs.append(kv)
        return (x, kvs) if return_kv else x

    def hidden_rows(
        self,
        ids: torch.Tensor,  # (B, R) the rows a fixed-shape step runs
        pos: torch.Tensor,  # (B, R) their absolute positions, < max_seq_len (the caller checks on the host)
        mask: torch.Tensor,  # (B, 1, R, N) True = attend
        k_buf: torch.Tensor,  # (n_layers, B, Hkv, N, Dh): one buffer for every layer's keys
        v_buf: torch.Tensor,  # (n_layers, B, Hkv, N, Dh)
        at: torch.Tensor,  # (B, R) the buffer row each run row's K/V is written to
    ) -> torch.Tensor:
        """Pre-norm hidden states (B, R, D) of a fixed-shape step (engine/decode/static.py): every shape
        is the caller's bucket, the attention topology is the caller's `mask`, each layer writes its
        K/V into the shared buffers at `at` and attends to all of them. Unlike `hidden` it reads nothing
        back to the host (no position check), so it compiles to one graph and can be captured."""
        cos = self.rope_cos[pos].unsqueeze(1).to(self.tok_embeddings.weight.dtype)  # (B, 1, R, Dh)
        sin = self.rope_sin[pos].unsqueeze(1).to(self.tok_embeddings.weight.dtype)
        x = self.tok_embeddings(ids)
        for i, layer in enumerate(self.layers):
            x = cast(Block, layer).forward_rows(x, cos, sin, mask, k_buf[i], v_buf[i], at)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: (..., D) -> (..., V)."""
        return F.linear(self.norm(h), self.head_weight)

    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor | None = None, key_valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (B, L, V); position p's logits are the model's output at p (shifted families
        predict token p+1 there: the sampler reads them one position to the left)."""
        return self.logits(self.hidden(ids, pos, key_valid))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
