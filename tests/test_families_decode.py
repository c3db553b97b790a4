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
from engine.decode.forward import build_canvas
from engine.decode.reference import reference_fill
from engine.decode.sampler import fill
from engine.decode.sampler import step as fill_step
from engine.weights.load import load_checkpoint

DECODING = ["dream", "llada", "coda", "sdar", "fast-dllm-v2", "open-dcoder"]
PREFIX, SUFFIX = "def add(a, b):\n    ret", "\n\nfor i in range(10):\n    print(i)\n"


@pytest.fixture(scope="module")
def loaded(family_folders):
    """family -> (folder, model, tokenizer, config), loaded through load_checkpoint like `--model`."""
    return {name: (family_folders[name], *load_checkpoint(family_folders[name])) for name in DECODING}


@torch.no_grad()
def llada_low_confidence_remasking(
    model, prompt: list[int], suffix: list[int], gen_length: int, steps: int, block_length: int, mask_id: int
) -> list[int]:
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
def dream_diffusion_generate(
    model,
    prompt: list[int],
    suffix: list[int],
    gen_length: int,
    steps: int,
    mask_id: int,
    alg: str = "maskgit_plus",
    eps: float = 1e-3,
) -> list[int]:
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
    opts = DecodeOptions(
        selection="timesteps",
        steps=steps,
        confidence=confidence,
        cache=False,
        window=0,
        pad_left=False,
        heal=False,
        freeze=False,
        pad_stop=2.0,
    )
    c = build_canvas(prefix, suffix, 16, cfg, opts)
    fill(model, c)
    assert c.slot_ids() == dream_diffusion_generate(model, prefix, suffix, 16, steps, cfg.mask_token_id, alg)


@pytest.mark.parametrize("steps", [8, 16])
def test_llada_fill_equals_llada_low_confidence_remasking(loaded, steps):
    _, model, tok, cfg = loaded["llada"]
    assert not cfg.logits_shift and cfg.mask_token_id == 126336
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    opts = DecodeOptions(
        selection="topk",
        steps=steps,
        block=8,
        confidence="max_prob",
        cache=False,
        window=0,
        pad_left=False,
        heal=False,
        freeze=False,
        pad_stop=2.0,
    )
    c = build_canvas(prefix, suffix, 16, cfg, opts)
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
    got = fill(model, build_canvas(prefix, suffix, 8, cfg, opts)).ids
    assert got == reference_fill(model, prefix, suffix, 8, opts)
    exact_cache = DecodeOptions(threshold=0.3, cache=True, refresh_every=1, window=0, heal=False)
    assert fill(model, build_canvas(prefix, suffix, 8, cfg, exact_cache)).ids == got
    r = fill(model, build_canvas(prefix, suffix, 8, cfg, DecodeOptions(heal=False, window=4)))
    assert all(0 <= t < cfg.vocab_size and t != cfg.mask_token_id for t in r.ids)


def test_block_causal_families_decode_block_by_block(loaded):
    """SDAR / Fast-dLLM v2: a step commits only slots of the leftmost block (absolute positions)
    that still has masks, in the fast loop and the oracle alike."""
    _, model, tok, cfg = loaded["sdar"]
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    opts = DecodeOptions(threshold=0.0, cache=False, window=0, heal=False, pad_left=False)  # commit all it may
    c = build_canvas(prefix, suffix, 12, cfg, opts)
    committed = []
    while not c.done:
        before = c.masked.clone()
        fill_step(model, [c])
        committed.append({(c.start + int(i)) // cfg.block_size for i in torch.nonzero(before & ~c.masked).flatten()})
    assert all(len(b) == 1 for b in committed) and [min(b) for b in committed] == sorted(min(b) for b in committed)
    assert fill(model, build_canvas(prefix, suffix, 12, cfg, opts)).ids == reference_fill(
        model, prefix, suffix, 12, opts
    )


def test_shifted_family_needs_a_token_before_the_hole_and_takes_bos_from_its_files(loaded):
    _, _, tok, cfg = loaded["dream"]
    assert cfg.logits_shift and cfg.bos_token_id == 151665
    c = build_canvas([], tok.encode(SUFFIX), 4, cfg, DecodeOptions())
    assert int(c.ids[0]) == 151665 and c.start == 1


def test_service_fills_with_a_family_checkpoint(loaded):
    """The resident service loads a family folder like any model and answers a job."""
    from engine.serve.service import EngineService

    folder = loaded["dream"][0]
    svc = EngineService(str(folder), device="cpu")
    svc.load()
    out = svc.run_now(FillJob(prefix=PREFIX, suffix=SUFFIX, max_tokens=6, options=DecodeOptions(threshold=0.3)))
    assert out.steps >= 1 and len(out.token_ids) <= 7  # 6 slots + one for the healed tail


@pytest.mark.parametrize("name", ["sdar", "fast-dllm-v2"])
def test_block_causal_batched_cached_steps_equal_single_canvases(loaded, name):
    """The batch path keeps each context row's absolute position (BatchContext): a batch of two
    block-causal canvases with cached steps and a window gives each one's own fill."""
    from engine.decode.cache import BatchContext

    _, model, tok, cfg = loaded[name]
    opts = DecodeOptions(threshold=0.3, heal=False, window=4)
    jobs = [(tok.encode(PREFIX), tok.encode(SUFFIX), 10), (tok.encode("x = 1\n"), tok.encode("\nprint(x)\n"), 7)]
    alone = [fill(model, build_canvas(p, s, n, cfg, opts)).ids for p, s, n in jobs]
    cs = [build_canvas(p, s, n, cfg, opts) for p, s, n in jobs]
    bctx = BatchContext()
    while not all(c.done for c in cs):
        fill_step(model, [c for c in cs if not c.done], batch_ctx=bctx)
    assert [c.fill_ids() for c in cs] == alone


# ---------------------------------------------------------------- the block-causal families' own loops


def _cut_at(ids: list[int], stop: int) -> list[int]:
    return ids[: ids.index(stop)] if stop in ids else ids


@torch.no_grad()
def sdar_block_diffusion_generate(
    model, prompt: list[int], gen_length: int, mask_id: int, block: int, steps: int, threshold: float, stop: int
) -> list[int]:
    """SDAR's sampler (JetAstra/SDAR generate.py `block_diffusion_generate`, re-implemented) with
    greedy picks in place of sampling (its temperature -> 0): the sequence is padded with masks to
    whole blocks; each block from the prompt's last one on is denoised with `steps` steps, step s
    committing every mask whose probability exceeds `threshold` if there are at least k_s of them,
    else the k_s most probable (`low_confidence_dynamic`, k spread over the steps as
    get_num_transfer_tokens(block, steps)); generation stops after a block holding `stop`. The
    model is unshifted and block-causal, so a block's forward sees the blocks before it only."""
    P = len(prompt)
    n_blocks = -(-(P + gen_length) // block)
    x = prompt + [mask_id] * (n_blocks * block - P)
    quota = [block // steps + (1 if i < block % steps else 0) for i in range(steps)]
    for b in range(P // block, n_blocks):
        lo, hi = b * block, (b + 1) * block
        for s in range(steps + 1):
            masks = [p for p in range(lo, hi) if x[p] == mask_id]
            if not masks:
                break
            probs = F.softmax(model(torch.tensor([x[:hi]]))[0, lo:hi].float(), dim=-1)  # (block, V)
            p, x0 = probs.max(-1)
            conf = torch.full((block,), float("-inf"))
            idx = torch.tensor([q - lo for q in masks])
            conf[idx] = p[idx]
            high = conf > threshold
            pick = torch.nonzero(high).flatten() if int(high.sum()) >= quota[s] else torch.topk(conf, quota[s]).indices
            for i in pick.tolist():
                x[lo + i] = int(x0[i])
        if stop in x[P:]:
            break
    return x[P : P + gen_length]


@torch.no_grad()
def fast_dllm_v2_generate(
    model, prompt: list[int], gen_end: int, mask_id: int, block: int, sub: int, threshold: float, stop: int
) -> list[int]:
    """Fast-dLLM v2's `generate()` (its modeling file, re-implemented; temperature 0, no sub-block
    cache), up to position `gen_end` (a block boundary): a prompt ending on a block boundary first
    gets its next token from the last position's logits (autoregressive); then block by block the
    rest of the block is filled with masks and decoded sub-block by sub-block (`sub` positions,
    left to right), each step predicting the block's positions from the block forward with logits
    shifted right by one and committing the sub-block's masks whose probability exceeds
    `threshold`, and always its most probable one; a completed block's last position predicts the
    next block's first token (autoregressive again). It stops once `stop` is committed with no
    mask before it."""
    P = len(prompt)
    x = list(prompt)

    def logits_of(seq):  # (L, V) shifted: position p predicted at p - 1 (the first keeps its own)
        lg = model(torch.tensor([seq]))[0]
        return torch.cat([lg[:1], lg[:-1]])

    def stopped(seq):
        gen = seq[P:]
        return stop in gen and mask_id not in gen[: gen.index(stop)]

    if len(x) > block and len(x) % block == 0:
        x.append(int(model(torch.tensor([x]))[0, -1].argmax()))
    while len(x) < gen_end and not stopped(x):
        lo = len(x) // block * block
        hi = lo + block
        x += [mask_id] * (hi - len(x))
        for s0 in range(lo, hi, sub):
            while mask_id in x[s0 : s0 + sub] and not stopped(x):
                probs = F.softmax(logits_of(x)[s0 : s0 + sub].float(), dim=-1)  # (sub, V)
                p, x1 = probs.max(-1)
                is_mask = torch.tensor([t == mask_id for t in x[s0 : s0 + sub]])
                p = torch.where(is_mask, p, torch.tensor(float("-inf")))
                pick = (p > threshold) & is_mask
                pick[int(p.argmax())] = True
                for i in torch.nonzero(pick).flatten().tolist():
                    x[s0 + i] = int(x1[i])
        if not stopped(x) and hi < gen_end:  # the block is complete: the next block's first token
            x.append(int(model(torch.tensor([x]))[0, -1].argmax()))
    return x[P:gen_end]


def _exact(**kw) -> DecodeOptions:
    """Options under which the engine's loop is the authors' loop: no cache or window, no padding
    rules, nothing committed early as padding."""
    return DecodeOptions(
        **{
            **dict(
                cache=False, window=0, pad_left=False, heal=False, freeze=False, pad_stop=2.0, confidence="max_prob"
            ),
            **kw,
        }
    )


@pytest.mark.parametrize("threshold", [0.0, 0.05, 1.0])
@pytest.mark.parametrize("prefix_text", [PREFIX, "x = 1\nfor i in range(3):\n    x += i  # a longer prefix\n"])
def test_sdar_fill_equals_sdar_block_diffusion_generate(loaded, threshold, prefix_text):
    _, model, tok, cfg = loaded["sdar"]
    bs = cfg.block_size
    prefix, suffix = tok.encode(prefix_text), tok.encode(SUFFIX)
    n = 3 * bs - len(prefix) % bs  # the slots end on a block boundary: the suffix is in later blocks, never seen
    c = build_canvas(prefix, suffix, n, cfg, _exact(threshold=threshold))
    fill(model, c)
    want = sdar_block_diffusion_generate(model, prefix, n, cfg.mask_token_id, bs, bs, threshold, cfg.eos_token_id)
    assert _cut_at(c.slot_ids(), cfg.eos_token_id) == _cut_at(want, cfg.eos_token_id)
    if threshold == 1.0:  # one commit per step, block by block
        assert c.steps == n and c.tokens_per_step == [1] * n


@pytest.mark.parametrize("threshold", [0.0, 0.02, 1.0])
@pytest.mark.parametrize(
    "prefix_text", [PREFIX, "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n" * 2]
)
def test_fast_dllm_v2_fill_equals_its_block_and_sub_block_generate(loaded, threshold, prefix_text):
    _, model, tok, cfg = loaded["fast-dllm-v2"]
    bs, sub = cfg.block_size, cfg.sub_block_size
    assert cfg.logits_shift and bs == 16 and sub == 8  # two sub-blocks per block in the tiny config
    prefix, suffix = tok.encode(prefix_text), tok.encode(SUFFIX)
    P = len(prefix)
    end = (P // bs + 3) * bs  # three blocks after the prompt's (partial) one
    c = build_canvas(prefix, suffix, end - P, cfg, _exact(threshold=threshold))
    order = []
    while not c.done:
        before = c.masked.clone()
        fill_step(model, [c])
        order.append(sorted(P + int(i) for i in torch.nonzero(before & ~c.masked).flatten()))
    want = fast_dllm_v2_generate(model, prefix, end, cfg.mask_token_id, bs, sub, threshold, cfg.eos_token_id)
    assert _cut_at(c.slot_ids(), cfg.eos_token_id) == _cut_at(want, cfg.eos_token_id)
    # each step commits inside one sub-block, sub-blocks in order; a block's first position alone
    assert all(len({p // sub for p in step}) == 1 for step in order)
    assert [min(s) // sub for s in order] == sorted(min(s) // sub for s in order)
    assert all(step == [step[0]] for step in order if step[0] % bs == 0)


def test_fast_dllm_v2_prompt_on_a_block_boundary_starts_autoregressively(loaded):
    _, model, tok, cfg = loaded["fast-dllm-v2"]
    bs = cfg.block_size
    prefix = (tok.encode(PREFIX * 3))[: 2 * bs]  # exactly two blocks: the first slot is a block's first position
    c = build_canvas(prefix, tok.encode(SUFFIX), 2 * bs, cfg, _exact(threshold=0.0))
    fill_step(model, [c])
    assert c.tokens_per_step == [1] and not bool(c.masked[0]) and bool(c.masked[1:].all())
    fill(model, c)
    want = fast_dllm_v2_generate(
        model, prefix, 4 * bs, cfg.mask_token_id, bs, cfg.sub_block_size, 0.0, cfg.eos_token_id
    )
    assert _cut_at(c.slot_ids(), cfg.eos_token_id) == _cut_at(want, cfg.eos_token_id)


# ---------------------------------------------------------------- DreamOn's growing and shrinking middle


@torch.no_grad()
def dreamon_sample(
    model,
    prompt: list[int],
    n_mask: int,
    suffix: list[int],
    max_new: int,
    mask_id: int,
    expand_id: int,
    eos_id: int,
    alg: str,
) -> tuple[list[int], dict]:
    """DreamOn's `_sample` (its generation_utils, re-implemented) at temperature 0 with one token
    per step: the canvas is `prompt` (BOS + prefix) + n_mask masks + `suffix` (suffix + EOS);
    each step predicts every mask with logits shifted right by one, bans the expand token once the
    middle has `max_new` tokens or the budget (2 x max_gen_len) is spent, and commits the mask
    with the highest confidence (max probability: maskgit_plus; sum p log p: entropy); a committed
    EOS is deleted, then every expand token becomes two masks. Returns the middle and counts."""
    x = prompt + [mask_id] * n_mask + suffix
    P, num_gen = len(prompt), n_mask
    max_length = max_new + len(x) - n_mask
    max_gen_len = max_length - P
    budget = 2 * max_gen_len
    seen = {"expand": 0, "delete": 0, "steps": 0}
    for _ in range(2 * max_gen_len + 2 * budget):
        window = P + num_gen + len(suffix)
        masks = [p for p in range(window) if x[p] == mask_id]
        if not masks:
            break
        lg = model(torch.tensor([x[:window]]))[0]
        lg = torch.cat([lg[:1], lg[:-1]])[masks].float()  # (M, V)
        if window == max_length or budget == 0:
            lg[:, expand_id] -= 1e9
        probs = torch.softmax(lg, dim=-1)
        conf, x0 = probs.max(-1)
        if alg == "entropy":
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)
        k = int(torch.topk(conf, 1).indices[0])
        x[masks[k]] = int(x0[k])
        seen["steps"] += 1
        for p in sorted((p for p in masks if x[p] == eos_id), reverse=True):
            del x[p]
            num_gen -= 1
            seen["delete"] += 1
        for p in sorted((p for p in range(P + num_gen) if x[p] == expand_id), reverse=True):
            x[p : p + 1] = [mask_id, mask_id]
            num_gen += 1
            budget -= 1
            seen["expand"] += 1
        assert P + num_gen + len(suffix) <= max_length
    return x[P : P + num_gen], seen


@pytest.fixture(scope="module")
def dreamon(family_folders):
    """The tiny DreamOn checkpoint and a way to make its random model use expand and end-of-text:
    steer(a) sets both head rows to a times the mean direction of the slots' final hidden states
    (end-of-text slightly shorter), so a decides how often they win; the decoding rules are then
    exercised, not only their absence."""
    model, tok, cfg = load_checkpoint(family_folders["dreamon"])
    assert cfg.family == "dreamon" and cfg.expand_token_id == 151667 and cfg.logits_shift
    c = build_canvas(tok.encode(PREFIX), tok.encode(SUFFIX), 12, cfg, DecodeOptions())
    with torch.no_grad():
        hn = model.norm(model.hidden(c.ids[None])[0, c.start - 1 : c.start + c.n - 1])  # (n, D) what the head sees
        u = hn.mean(0) / hn.mean(0).norm()

    def steer(a: float) -> None:
        with torch.no_grad():
            model.head_weight[cfg.expand_token_id] = a * u
            model.head_weight[cfg.eos_token_id] = 0.98 * a * u

    return model, tok, cfg, steer


@pytest.mark.parametrize("alg,confidence", [("maskgit_plus", "max_prob"), ("entropy", "neg_entropy")])
@pytest.mark.parametrize("start,max_new", [(4, 12), (8, 8), (12, 20)])
@pytest.mark.parametrize("a", [0.76, 0.8])
def test_dreamon_fill_equals_dreamon_sample(dreamon, monkeypatch, alg, confidence, start, max_new, a):
    from engine.families import dreamon as dm

    model, tok, cfg, steer = dreamon
    steer(a)
    monkeypatch.setattr(dm, "START_SLOTS", start)
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    c = build_canvas(prefix, suffix, max_new, cfg, DecodeOptions(confidence=confidence))  # the family pins the rest
    assert c.n == min(start, max_new) and int(c.ids[0]) == cfg.bos_token_id and int(c.ids[-1]) == cfg.eos_token_id
    r = fill(model, c)
    want, seen = dreamon_sample(
        model,
        [cfg.bos_token_id] + prefix,
        min(start, max_new),
        suffix + [cfg.eos_token_id],
        max_new,
        cfg.mask_token_id,
        cfg.expand_token_id,
        cfg.eos_token_id,
        alg,
    )
    assert c.slot_ids() == want and c.n == len(want) <= max_new
    assert r.steps == seen["steps"] and r.tokens_per_step == [1] * r.steps
    assert cfg.mask_token_id not in want and cfg.expand_token_id not in want


def test_dreamon_decoding_grows_and_shrinks_the_middle(dreamon, monkeypatch):
    """The oracle test is not vacuous: with the stronger steering the middle expands and deletes."""
    from engine.families import dreamon as dm

    model, tok, cfg, steer = dreamon
    steer(0.8)
    monkeypatch.setattr(dm, "START_SLOTS", 12)
    prefix, suffix = tok.encode(PREFIX), tok.encode(SUFFIX)
    _, seen = dreamon_sample(
        model,
        [cfg.bos_token_id] + prefix,
        12,
        suffix + [cfg.eos_token_id],
        20,
        cfg.mask_token_id,
        cfg.expand_token_id,
        cfg.eos_token_id,
        "maskgit_plus",
    )
    assert seen["expand"] >= 1 and seen["delete"] >= 1, seen
    sizes = []
    c = build_canvas(prefix, suffix, 20, cfg, DecodeOptions())
    while not c.done:
        fill_step(model, [c])
        sizes.append(c.n)
    assert max(sizes) > 12 and any(b < a for a, b in zip(sizes, sizes[1:])), sizes


def test_dreamon_at_its_longest_never_expands_and_a_final_step_leaves_no_mask(dreamon, monkeypatch):
    from engine.families import dreamon as dm

    model, tok, cfg, steer = dreamon
    steer(0.8)
    monkeypatch.setattr(dm, "START_SLOTS", 12)
    c = build_canvas(tok.encode(PREFIX), tok.encode(SUFFIX), 12, cfg, DecodeOptions())  # already at its longest
    fill(model, c)
    assert c.n <= 12 and cfg.expand_token_id not in c.slot_ids()
    c = build_canvas(tok.encode(PREFIX), tok.encode(SUFFIX), 20, cfg, DecodeOptions())
    fill_step(model, [c], final=[True])  # a deadline: everything at once, expand banned
    assert c.done and not bool(c.masked.any()) and cfg.expand_token_id not in c.slot_ids()


def test_service_fills_with_dreamon(family_folders):
    """The service runs DreamOn's loop (healing off: the middle has no fixed slot 0)."""
    from engine.serve.service import EngineService

    svc = EngineService(str(family_folders["dreamon"]), device="cpu")
    svc.load()
    out = svc.run_now(FillJob(prefix=PREFIX, suffix=SUFFIX, max_tokens=6, options=DecodeOptions()))
    assert out.steps >= 1 and len(out.token_ids) <= 6 and all(t != svc.cfg.expand_token_id for t in out.token_ids)
