"""Softmax statistics of masked slots: final RMSNorm + LM head + max prob, argmax, second prob and
entropy per slot. The torch reference lives here; the Triton kernel joins it in the same module."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def slot_stats_reference(h: torch.Tensor, norm_w: torch.Tensor, eps: float, head_w: torch.Tensor, ban: int = -1):
    """h: (M, D) pre-norm hidden states of masked slots; head_w: (V, D); `ban` is a token id that may
    never be predicted (the mask token), or -1.
    Returns (max_prob (M,), argmax (M,) long, top2_prob (M,), entropy (M,)), all fp32."""
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
    logits = F.linear(x, head_w.float())  # (M, V)
    if ban >= 0:
        logits[:, ban] = float("-inf")
    logp = logits.log_softmax(-1)
    top = logp.topk(2, dim=-1)
    p = logp.exp()
    ent = -(p * logp.clamp_min(-1e30)).sum(-1)  # p=0 at a banned id: 0 * -inf would be nan
    return top.values[:, 0].exp(), top.indices[:, 0], top.values[:, 1].exp(), ent


def slot_stats(h, norm_w, eps, head_w, ban: int = -1):
    return slot_stats_reference(h, norm_w, eps, head_w, ban)
