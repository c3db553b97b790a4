"""The engine's fill path on family checkpoints: the canvas (literal prefix + masks + suffix), the
family's logit shift and special ids from its files, the existing sampler; and two families' own
decoding at temperature 0, re-implemented here from their authors' descriptions as oracles the
engine's fill equals token for token: LLaDA's low-confidence remasking in semi-autoregressive
blocks, and Dream's `maskgit_plus` / `entropy` with its timestep schedule (shifted logits)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.api import DecodeOptions, FillJob
from engine.checkpoint import load_checkpoint
from engine.sampler import Canvas, fill, reference_fill
from engine.sampler import step as fill_step
from tests.families_tiny import family_folders  # noqa: F401 (fixture)

DECODING = ["dream", "llada", "coda", "sdar", "fast-dllm-v2", "open-dcoder"]
PREFIX, SUFFIX = "def add(a, b):\n    ret", "\n\nfor i in range(10):\n    print(i)\n"


@pytest.fixture(scope="module")
def loaded(family_folders):
    """family -> (folder, model, tokenizer, config), loaded through load_checkpoint like `--model`."""
    return {name: (family_folders[name], *load_checkpoint(family_folders[name])) for name in DECODING}


@torch.no_grad()
def llada_low_confidence_remasking(model, prompt: list[int], suffix: list[int], gen_length: int, steps: int,
                                   block_length: int, mask_id: int) -> list[int]:
    """LLaDA's sampler at temperature 0 (its generate.py, re-implemented): the canvas is split into
    blocks decoded left to right with steps // blocks steps each; a step predicts every position
    (argmax), and commits the `k` masked positions of the current block whose predicted token has
    the highest probability, k spreading the block's masks evenly over its steps (larger first)."""
    x = torch.tensor([prompt + [mask_id] * gen_length + suffix])
    P = len(prompt)
    n_blocks = gen_length // block_length
    per_block = steps // n_blocks
    for b in range(n_blocks):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        n_mask = int((x[0, lo:hi] == mask_id).sum())
        quota = [n_mask // per_block + (1 if i < n_mask % per_block else 0) for i in range(per_block)]
        for k in quota:
            logits = model(x)  # (1, L, V) the model's own output at each position (LLaDA: unshifted)
            x0 = logits.argmax(-1)
            p = F.softmax(logits.double(), dim=-1).gather(-1, x0[..., None])[..., 0]  # (1, L)
            conf = torch.full_like(p, float("-inf"))
            in_block = torch.zeros_like(x, dtype=torch.bool)
            in_block[:, lo:hi] = True
            sel = (x == mask_id) & in_block
            conf[sel] = p[sel]
            idx = torch.topk(conf[0], k).indices
            x[0, idx] = x0[0, idx]
    return x[0, P : P + gen_length].tolist()


@torch.no_grad()
def dream_diffusion_generate(model, prompt: list[int], suffix: list[int], gen_length: int, steps: int, mask_id: int,
                             alg: str = "maskgit_plus", eps: float = 1e-3) -> list[int]:
    """Dream's sampler at temperature 0 (generation_utils `_sample`, re-implemented): logits are
    shifted right by one (position p is predicted at p - 1); with timesteps linspace(1, eps, steps + 1)
    step i commits int(m * (1 - t_{i+1} / t_i)) of the m masked positions (all at the last step),
    those with the highest confidence: the max probability (maskgit_plus) or the negative entropy."""
    x = torch.tensor([prompt + [mask_id] * gen_length + suffix])
    P = len(prompt)
    ts = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_id
        logits = model(x)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        probs = torch.softmax(logits[mask_index], dim=-1)  # (M, V)
        conf, x0 = probs.max(dim=-1)
        if alg == "entropy":
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)
        m = mask_index.sum()
        k = int(m * (1 - ts[i + 1] / ts[i])) if i < steps - 1 else int(m)
        if k > 0:
            idx = torch.topk(conf, k).indices
            new = torch.full_like(x0, mask_id)
            new[idx] = x0[idx]
            x[mask_index] = new
    return x[0, P : P + gen_length].tolist()


@pytest.mark.parametrize("alg,confidence", [("maskgit_plus", "max_prob"), ("entropy", "neg_entropy")])
@pytest.mark.parametrize("steps", [6, 16])
def test_dream_fill_equals_dream_diffusion_generate(loaded, alg, confidence, steps):
    _, model, tok, cfg = loaded["dream"]
    assert cfg.logits_shift and cfg.mask_token_id == 151666
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    opts = DecodeOptions(selection="timesteps", steps=steps, confidence=confidence, cache=False, window=0,
                         pad_left=False, heal=False, freeze=False, pad_stop=2.0)
    c = Canvas.build(prefix, suffix, 16, cfg, opts)
    fill(model, c)
    assert c.slot_ids() == dream_diffusion_generate(model, prefix, suffix, 16, steps, cfg.mask_token_id, alg)


@pytest.mark.parametrize("steps", [8, 16])
def test_llada_fill_equals_llada_low_confidence_remasking(loaded, steps):
    _, model, tok, cfg = loaded["llada"]
    assert not cfg.logits_shift and cfg.mask_token_id == 126336
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    opts = DecodeOptions(selection="topk", steps=steps, block=8, confidence="max_prob", cache=False, window=0,
                         pad_left=False, heal=False, freeze=False, pad_stop=2.0)
    c = Canvas.build(prefix, suffix, 16, cfg, opts)
    fill(model, c)
    want = llada_low_confidence_remasking(model, prefix, suffix, 16, steps, 8, cfg.mask_token_id)
    assert c.slot_ids() == want
    assert c.steps == steps and c.tokens_per_step == [16 // steps] * steps


@pytest.mark.parametrize("name", DECODING)
def test_family_fill_equals_the_engine_oracle(loaded, name):
    """Each family through the fast loop (no cache: exact) and the naive oracle, with its shift,
    mask id and topology from its files; then the server's default options run to the end."""
    _, model, tok, cfg = loaded[name]
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    opts = DecodeOptions(threshold=0.3, cache=False, window=0, heal=False)
    got = fill(model, Canvas.build(prefix, suffix, 8, cfg, opts)).ids
    assert got == reference_fill(model, prefix, suffix, 8, opts)
    exact_cache = DecodeOptions(threshold=0.3, cache=True, refresh_every=1, window=0, heal=False)
    assert fill(model, Canvas.build(prefix, suffix, 8, cfg, exact_cache)).ids == got
    r = fill(model, Canvas.build(prefix, suffix, 8, cfg, DecodeOptions(heal=False, window=4)))
    assert all(0 <= t < cfg.vocab_size and t != cfg.mask_token_id for t in r.ids)


def test_block_causal_families_decode_block_by_block(loaded):
    """SDAR / Fast-dLLM v2: a step commits only slots of the leftmost block (absolute positions)
    that still has masks, in the fast loop and the oracle alike."""
    _, model, tok, cfg = loaded["sdar"]
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    opts = DecodeOptions(threshold=0.0, cache=False, window=0, heal=False, pad_left=False)  # commit all it may
    c = Canvas.build(prefix, suffix, 12, cfg, opts)
    committed = []
    while not c.done:
        before = c.masked.clone()
        fill_step(model, [c])
        committed.append({(c.start + int(i)) // cfg.block_size for i in torch.nonzero(before & ~c.masked).flatten()})
    assert all(len(b) == 1 for b in committed) and [min(b) for b in committed] == sorted(min(b) for b in committed)
    assert fill(model, Canvas.build(prefix, suffix, 12, cfg, opts)).ids == reference_fill(model, prefix, suffix, 12, opts)


def test_shifted_family_needs_a_token_before_the_hole_and_takes_bos_from_its_files(loaded):
    _, _, tok, cfg = loaded["dream"]
    assert cfg.logits_shift and cfg.bos_token_id == 151665
    c = Canvas.build([], tok.encode(SUFFIX), 4, cfg, DecodeOptions())
    assert int(c.ids[0]) == 151665 and c.start == 1


def test_service_fills_with_a_family_checkpoint(loaded):
    """The resident service loads a family folder like any model and answers a job."""
    from engine.service import EngineService

    folder = loaded["dream"][0]
    svc = EngineService(str(folder), device="cpu")
    svc.load()
    out = svc.run_now(FillJob(prefix=PREFIX, suffix=SUFFIX, max_tokens=6, options=DecodeOptions(threshold=0.3)))
    assert out.steps >= 1 and len(out.token_ids) <= 7  # 6 slots + one for the healed tail


@pytest.mark.parametrize("name", ["sdar", "fast-dllm-v2"])
def test_block_causal_batched_cached_steps_equal_single_canvases(loaded, name):
    """The batch path keeps each context row's absolute position (BatchContext): a batch of two
    block-causal canvases with cached steps and a window gives each one's own fill."""
    from engine.cache import BatchContext

    _, model, tok, cfg = loaded[name]
    opts = DecodeOptions(threshold=0.3, heal=False, window=4)
    jobs = [(tok.encode(PREFIX), tok.encode(SUFFIX), 10), (tok.encode("x = 1\n"), tok.encode("\nprint(x)\n"), 7)]
    alone = [fill(model, Canvas.build(p, s, n, cfg, opts)).ids for p, s, n in jobs]
    cs = [Canvas.build(p, s, n, cfg, opts) for p, s, n in jobs]
    bctx = BatchContext()
    while not all(c.done for c in cs):
        fill_step(model, [c for c in cs if not c.done], batch_ctx=bctx)
    assert [c.fill_ids() for c in cs] == alone
