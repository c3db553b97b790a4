"""engine/model/transformer.py and engine/decode/autoregressive.py: the cached-context path, batching masks, and greedy
decoding with a KV cache against full recomputation."""

from __future__ import annotations

import pytest
import torch

from engine.decode.autoregressive import fim_prompt, greedy_decode, reference_greedy
from tests.engine_models import peaked_model


def _ids(n, seed=0, vocab=300):
    return torch.randint(4, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_span_against_its_own_context_equals_the_full_forward():
    """Running a middle span against the cached K/V of everything else, at its absolute positions,
    reproduces the full forward exactly when nothing changed (RoPE positions, ctx order)."""
    m = peaked_model()
    ids = _ids(30)
    h, kvs = m.hidden(ids, return_kv=True)
    a0, a1 = 12, 19
    keep = torch.ones(30, dtype=torch.bool)
    keep[a0:a1] = False
    ctx = [(k[:, :, keep], v[:, :, keep]) for k, v in kvs]
    hs = m.hidden(ids[:, a0:a1], pos=torch.arange(a0, a1)[None], ctx=ctx)
    torch.testing.assert_close(hs, h[:, a0:a1], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_causal_steps_with_a_kv_cache_equal_the_full_forward():
    m = peaked_model(causal=True)
    ids = _ids(20, seed=1)
    full = m.hidden(ids)
    _, kvs = m.hidden(ids[:, :12], return_kv=True)
    # several new tokens at once (causal mask against the context) and one alone (no mask at all)
    h = m.hidden(ids[:, 12:19], pos=torch.arange(12, 19)[None], ctx=kvs)
    torch.testing.assert_close(h, full[:, 12:19], atol=1e-5, rtol=1e-5)
    _, kvs = m.hidden(ids[:, :19], return_kv=True)
    h = m.hidden(ids[:, 19:], pos=torch.tensor([[19]]), ctx=kvs)
    torch.testing.assert_close(h, full[:, 19:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_causal_rows_against_an_empty_context_stay_causal():
    """A cache that holds nothing yet (a reorder canvas with no prefix or suffix) must not turn a
    causal model's rows bidirectional."""
    m = peaked_model(causal=True)
    ids = _ids(9, seed=2)
    full = m.hidden(ids)
    cfg = m.cfg
    empty = torch.zeros(1, cfg.kv_heads, 0, cfg.head_dim)
    kvs = [(empty, empty) for _ in range(cfg.n_layers)]  # zero-length K/V per layer
    h = m.hidden(ids, pos=torch.arange(9)[None], ctx=kvs)
    torch.testing.assert_close(h, full, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(h, peaked_model(causal=False).hidden(ids), atol=1e-3)  # the topology matters


@torch.no_grad()
@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_rows_equal_single_rows(causal):
    m = peaked_model(causal=causal)
    rows = [_ids(n, seed=n)[0] for n in (9, 15, 4)]
    L = max(len(r) for r in rows)
    ids = torch.zeros(3, L, dtype=torch.long)
    valid = torch.zeros(3, L, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], valid[i, : len(r)] = r, True
    h = m.hidden(ids, key_valid=valid)
    assert torch.isfinite(h).all()  # padding rows see at least themselves: no NaN
    for i, r in enumerate(rows):
        torch.testing.assert_close(h[i, : len(r)], m.hidden(r[None])[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_batched_context_with_ctx_valid_equals_single_rows():
    m = peaked_model()
    seqs = [_ids(n, seed=10 + n)[0] for n in (14, 22)]
    spans = [(5, 9), (10, 13)]
    singles, ctxs = [], []
    for s, (a0, a1) in zip(seqs, spans):
        h, kvs = m.hidden(s[None], return_kv=True)
        keep = torch.ones(len(s), dtype=torch.bool)
        keep[a0:a1] = False
        ctxs.append([(k[:, :, keep], v[:, :, keep]) for k, v in kvs])
        singles.append(h[0, a0:a1])
    Lc = max(c[0][0].shape[2] for c in ctxs)
    A = max(a1 - a0 for a0, a1 in spans)
    ctx = []
    for li in range(len(ctxs[0])):
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, Lc - t.shape[2]))  # noqa: E731
        ctx.append((torch.cat([pad(c[li][0]) for c in ctxs]), torch.cat([pad(c[li][1]) for c in ctxs])))
    ctx_valid = torch.zeros(2, Lc, dtype=torch.bool)
    ids = torch.zeros(2, A, dtype=torch.long)
    pos = torch.zeros(2, A, dtype=torch.long)
    valid = torch.zeros(2, A, dtype=torch.bool)
    for i, (s, (a0, a1), c) in enumerate(zip(seqs, spans, ctxs)):
        ctx_valid[i, : c[0][0].shape[2]] = True
        ids[i, : a1 - a0], pos[i, : a1 - a0], valid[i, : a1 - a0] = s[a0:a1], torch.arange(a0, a1), True
    h = m.hidden(ids, pos=pos, key_valid=valid, ctx=ctx, ctx_valid=ctx_valid)
    for i, (a0, a1) in enumerate(spans):
        torch.testing.assert_close(h[i, : a1 - a0], singles[i], atol=1e-5, rtol=1e-5)
    # the same context in buffers with room after it (k_buf, v_buf, Lc): the call writes its own K/V
    # there instead of concatenating, and gets the same hidden states and the same returned K/V
    bufs = [
        (
            torch.full((2, k.shape[1], Lc + A + 3, k.shape[3]), float("nan")),
            torch.full((2, v.shape[1], Lc + A + 3, v.shape[3]), float("nan")),
        )
        for k, v in ctx
    ]
    for (kb, vb), (k, v) in zip(bufs, ctx):
        kb[:, :, :Lc], vb[:, :, :Lc] = k, v
    h2, kv2 = m.hidden(
        ids, pos=pos, key_valid=valid, ctx=[(kb, vb, Lc) for kb, vb in bufs], ctx_valid=ctx_valid, return_kv=True
    )
    _, kv1 = m.hidden(ids, pos=pos, key_valid=valid, ctx=ctx, ctx_valid=ctx_valid, return_kv=True)
    torch.testing.assert_close(h2, h, atol=1e-6, rtol=1e-6)
    for (kb, _vb), (k1, _v1), (k2, _v2) in zip(bufs, kv1, kv2):
        torch.testing.assert_close(k2, k1)
        torch.testing.assert_close(kb[:, :, Lc : Lc + A], k1)  # written in place after the context
        assert bool(kb[:, :, Lc + A :].isnan().all())  # and nothing past the call's rows


def test_positions_past_max_seq_len_are_refused():
    m = peaked_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        m.hidden(_ids(4), pos=torch.tensor([[0, 1, 2, m.cfg.max_seq_len]]))


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_decode_with_kv_cache_equals_full_recompute(seed):
    m = peaked_model(causal=True, seed=seed)
    prompt = _ids(17, seed=seed)[0].tolist()
    r = greedy_decode(m, prompt, 12)
    assert r.ids == reference_greedy(m, prompt, 12)
    assert len(r.ms_per_token) == 11 and r.prefill_ms > 0
    assert len(set(r.ids)) > 1  # the model is not stuck on one token: the test can tell orders apart


def test_greedy_decode_stops_and_refuses_bidirectional_models():
    m = peaked_model(causal=True)
    prompt = _ids(10, seed=3)[0].tolist()
    full = greedy_decode(m, prompt, 8).ids
    stop = full[3]
    assert greedy_decode(m, prompt, 8, stop_ids=(stop,)).ids == full[: full.index(stop)]
    with pytest.raises(ValueError):
        greedy_decode(peaked_model(), prompt, 4)
    with pytest.raises(ValueError):
        greedy_decode(m, prompt, m.cfg.max_seq_len)


def test_fim_prompt_uses_the_tokenizers_markers():
    class Tok:
        ids = {"<|fim_prefix|>": 4, "<|fim_suffix|>": 5, "<|fim_middle|>": 6}

        def token_id(self, t):
            return self.ids.get(t)

    assert fim_prompt([10, 11], [12], Tok()) == [4, 10, 11, 5, 12, 6]
    Tok.ids = {}
    assert fim_prompt([10, 11], [12], Tok()) == [10, 11]
