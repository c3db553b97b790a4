"""Greedy decoding with a KV cache for the causal twin: the baseline that diffusion decoding is timed
against (`dlm-lsp bench`). The twin is trained in fill-in-the-middle form, so its prompt is
<fim_prefix> prefix <fim_suffix> suffix <fim_middle> and it writes the middle one token at a time.

The cache is allocated once per decode with its final size (gpt-fast style): each step's attention
writes its token's K/V in place at the next row and attends to a view of the filled part, so nothing
is re-concatenated per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.decode.sampler import heal_logits
from engine.model.transformer import Transformer
from engine.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, TextTokenizer


@dataclass
class ARResult:
    ids: list[int]  # generated tokens (the stop token excluded)
    prefill_ms: float  # the prompt's forward pass (it also gives the first token)
    ms_per_token: list[float] = field(default_factory=list)  # each later token's step

    @property
    def total_ms(self) -> float:
        return self.prefill_ms + sum(self.ms_per_token)


def fim_prompt(prefix: list[int], suffix: list[int], tok: TextTokenizer) -> list[int]:
    """The twin's prompt: PSM order with the tokenizer's FIM markers (plain prefix if it has none)."""
    fp, fs, fm = (tok.token_id(t) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE))
    if fp is None or fs is None or fm is None:
        return list(prefix)
    return [fp] + list(prefix) + [fs] + list(suffix) + [fm]


@torch.inference_mode()
def greedy_decode(
    model: Transformer,
    prompt: list[int],
    n: int,
    stop_ids: tuple[int, ...] = (),
    heal: tuple[list[int], dict[int, list[int]]] | None = None,
) -> ARResult:
    """Returns up to n greedy tokens after `prompt`, decoded one per step with a KV cache; stops early
    at a token in stop_ids. `heal` = (first, then): token healing (engine.tokenizer.Healing): the
    first token is one of `first`; when it is a key of `then`, the second is one of its ids."""
    if not model.causal:
        raise ValueError("greedy_decode needs a causal model (attention='causal')")
    if not prompt or n < 1:
        raise ValueError("greedy_decode needs a non-empty prompt and n >= 1")
    cfg, dev = model.cfg, model.head_weight.device
    Lp = len(prompt)
    total = Lp + n - 1  # the last token is never fed back
    if total > cfg.max_seq_len:
        raise ValueError(f"prompt {Lp} + {n} tokens exceeds max_seq_len {cfg.max_seq_len}")

    t0 = time.perf_counter()
    h, kvs = model.hidden(torch.tensor([prompt], device=dev), return_kv=True)  # (1, Lp, D)
    dtype = kvs[0][0].dtype
    shape = (1, cfg.kv_heads, total, cfg.head_dim)  # K/V heads: fewer than query heads with GQA
    cache = [(torch.empty(shape, dtype=dtype, device=dev), torch.empty(shape, dtype=dtype, device=dev)) for _ in kvs]
    for (ck, cv), (k, v) in zip(cache, kvs):
        ck[:, :, :Lp], cv[:, :, :Lp] = k, v
    first = model.logits(h[0, -1])
    if heal:
        first = heal_logits(first, torch.tensor(heal[0], device=dev))
    tok = int(first.argmax())
    res = ARResult([], (time.perf_counter() - t0) * 1000)
    pos = Lp
    while True:
        if tok in stop_ids:
            break
        res.ids.append(tok)
        if len(res.ids) == n:
            break
        t1 = time.perf_counter()
        ids = torch.tensor([[tok]], device=dev)
        # the cache has room: the step writes its own K/V at row pos and attends to rows :pos+1
        h = model.hidden(ids, pos=torch.tensor([[pos]], device=dev), ctx=[(ck, cv, pos) for ck, cv in cache])
        nxt = model.logits(h[0, -1])
        if heal and len(res.ids) == 1 and res.ids[0] in heal[1]:  # the rest of the healed tail
            nxt = heal_logits(nxt, torch.tensor(heal[1][res.ids[0]], device=dev))
        tok = int(nxt.argmax())
        pos += 1
        res.ms_per_token.append((time.perf_counter() - t1) * 1000)
    return res


@torch.inference_mode()
def reference_greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """The oracle: full causal forward over the whole sequence for every token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq], device=model.head_weight.device))[0, -1].argmax()))
    return seq[len(prompt) :]
