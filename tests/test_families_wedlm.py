"""WeDLM decodes as its authors' engine does (Tencent/WeDLM `wedlm/engine/wedlm_decoder.py` and
`wedlm/engine/sampler.py`, read for facts and re-implemented here): the streaming window over the
reordered causal canvas, at temperature 0, equals a plain full-recompute loop run with the
`transformers` Qwen3ForCausalLM class on reordered ids and position ids, token for token and step
for step; the rule's parameters matter (guards); the engine's infill extension, cancel, deadline,
batching and the service work on it; WeDLM-7B's Qwen2-style layout computes what Qwen2ForCausalLM does."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.api import DecodeOptions, FillJob
from engine.decode.cache import BatchContext
from engine.decode.forward import build_canvas
from engine.decode.sampler import fill
from engine.decode.sampler import step as fill_step
from engine.families import wedlm
from engine.families.loader import load_family
from tests.families_tiny import SPECS, Spec, _qwen, reference_logits, reference_model, seed_of, write_checkpoint

HEAD_SCALE = 16.0  # a power of two (exact in fp32 and fp64): a random unit-scale head is near uniform
# (entropies ~11.4 nats, all within 0.01), so no threshold would ever pass; x16 spreads them over ~0.7-2.2
PROMPTS = ["def add(a, b):\n    ret", "x = 1\nfor i in range(3):\n    x += i  # a longer prefix\n"]
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def wq(tmp_path_factory):
    """(folder, engine model fp64, tokenizer, config, transformers model fp64): the tiny WeDLM-8B
    checkpoint (tests/families_tiny.py layout) with its head scaled by HEAD_SCALE in the file and in
    the reference alike."""
    folder = write_checkpoint(SPECS["wedlm"], tmp_path_factory.mktemp("wedlm") / "wedlm", seed=seed_of("wedlm"))
    sd = load_file(str(folder / "model.safetensors"))
    sd["lm_head.weight"] = sd["lm_head.weight"] * HEAD_SCALE
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = copy.deepcopy(reference_model(SPECS["wedlm"], seed=seed_of("wedlm"), dtype=torch.float64))
    with torch.no_grad():
        hf.lm_head.weight.mul_(HEAD_SCALE)
    model, tok, cfg = load_family(folder, "cpu", torch.float64)
    return folder, model, tok, cfg, hf


@pytest.fixture
def rule(monkeypatch):
    """Sets the engine's WeDLM parameters (module data, the authors' defaults otherwise)."""

    def set_(window=16, threshold=0.4, penalty=0.02):
        monkeypatch.setattr(wedlm, "WINDOW", window)
        monkeypatch.setattr(wedlm, "ENTROPY_THRESHOLD", threshold)
        monkeypatch.setattr(wedlm, "POS_PENALTY", penalty)
        return dict(window=window, threshold=threshold, penalty=penalty)

    return set_


# ---------------------------------------------------------------- the authors' loop, re-implemented


@torch.no_grad()
def wedlm_stream_generate(
    hf,
    prompt: list[int],
    max_tokens: int,
    mask_id: int,
    stop: set[int],
    window: int = 16,
    threshold: float | None = 0.4,
    penalty: float = 0.02,
    suffix: list[int] | None = None,
    order: str = "logical",
    rule: str = "entropy",
    confidence: float = 0.9,
):
    """WeDLM's streaming decoding at temperature 0 (its WeDLMDecoder + Sampler), full recompute with
    a transformers model. Generated position p (0-based, after the prompt) sits at position id
    len(prompt) + p. The window starts as `window` masks; each step:
      1. refill: as many masks join the window's right end as it has committed tokens at its left;
      2. forward: [prompt][every committed token, logical order][the window's masks, logical order],
         causal attention in that row order, logical position ids (the authors: the prompt and the
         pruned tokens come from the K/V cache, the window's observed tokens and masks are run);
      3. prune: the window's leading committed run leaves it into the output; a stop token there, or
         `max_tokens` output tokens, ends generation;
      4. among the window's masks, H = entropy of the logits (whole vocabulary), d = distance from
         the window's first mask: commit every mask with H + penalty d < threshold to its argmax, else
         the one with the lowest H + penalty d (threshold None: always that one).
    Returns (output tokens up to and including a stop token, tokens committed per step).

    The engine's infill extension (the authors have no infill) when `suffix` is given: the suffix
    is observed context after the prompt at position ids from len(prompt) + max_tokens on, and the
    window never runs past position max_tokens - 1. Guards: `order="commit"` lays committed tokens
    out in the order they were committed (the project's recipe (c)) instead of logically;
    `rule="max_prob"` commits by probability >= `confidence` (hf_compat's block decoding's test)."""
    P = len(prompt)
    ctx_ids = list(prompt) + list(suffix or [])
    ctx_pos = list(range(P)) + [P + max_tokens + i for i in range(len(suffix or []))]
    tok: dict[int, int] = {}  # generated position -> committed token
    when: dict[int, int] = {}  # generated position -> the step it was committed at
    pruned, win, out, per_step = 0, window, [], []
    if suffix is not None:
        win = min(win, max_tokens)
    for step in range(10 * (max_tokens + window)):
        lead = 0
        while pruned + lead < pruned + win and pruned + lead in tok:
            lead += 1
        grow = lead if suffix is None else min(lead, max_tokens - pruned - win)
        win += grow
        masks = [p for p in range(pruned, pruned + win) if p not in tok]
        key = (lambda p: p) if order == "logical" else (lambda p: (when[p], p))
        seen = sorted(tok, key=key)
        ids = ctx_ids + [tok[p] for p in seen] + [mask_id] * len(masks)
        pos = ctx_pos + [P + p for p in seen] + [P + p for p in masks]
        logits = reference_logits(hf, torch.tensor([ids]), "causal", pos=torch.tensor([pos]))[0]
        mask_logits = logits[len(ids) - len(masks) :]  # (M, V)
        done = False
        for p in range(pruned, pruned + lead):
            out.append(tok[p])
            if tok[p] in stop or len(out) >= max_tokens:
                done = True
                break
        pruned, win = pruned + lead, win - lead
        if done or not masks:
            break
        probs = torch.softmax(mask_logits, dim=-1)
        x0 = probs.argmax(-1)
        if rule == "entropy":
            ent = torch.distributions.Categorical(logits=mask_logits).entropy()
            adj = ent + penalty * (torch.tensor(masks, dtype=ent.dtype) - masks[0])
            pick = torch.nonzero(adj < threshold).flatten().tolist() if threshold is not None else []
            pick = pick or [int(adj.argmin())]
        else:
            p_max = probs.max(-1).values
            pick = torch.nonzero(p_max >= confidence).flatten().tolist() or [int(p_max.argmax())]
        for k in pick:
            tok[masks[k]] = int(x0[k])
            when[masks[k]] = step
        per_step.append(len(pick))
    return out, per_step


def _cut(ids: list[int], stop: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in stop:
            return ids[:i]
    return ids


def _opts(**kw) -> DecodeOptions:
    return DecodeOptions(**{"heal": False, **kw})


# ---------------------------------------------------------------- equal to the authors' loop

CASES = [
    (0, 8, dict()),
    (1, 12, dict()),
    (0, 12, dict(threshold=None)),
    (1, 10, dict(threshold=1.0)),
    (0, 16, dict(threshold=2.0)),
    (1, 12, dict(threshold=2.0, penalty=0.2)),
    (0, 12, dict(window=4, threshold=1.5)),
]


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("prompt,n,params", CASES)
def test_wedlm_fill_equals_its_authors_streaming_loop(wq, rule, cache, prompt, n, params):
    """A prefix-only fill of n slots is the authors' generation with max_tokens = n (token for
    token, and the tokens committed at each step); the exact K/V cache and a full recompute agree."""
    _, model, tok, cfg, hf = wq
    assert (cfg.family, cfg.canvas, cfg.mask_token_id, cfg.eos_token_id) == ("wedlm", "reorder", 151665, 151643)
    p = rule(**params)
    prefix = tok.encode(PROMPTS[prompt])
    c = build_canvas(prefix, [], n, cfg, _opts(cache=cache))
    assert c.keep == n and c.n == n + p["window"] - 1  # the window runs past the fill, as the authors' does
    r = fill(model, c)
    want, per_step = wedlm_stream_generate(hf, prefix, n, cfg.mask_token_id, {cfg.eos_token_id}, **p)
    assert len(want) == n  # no end-of-text from this random model: every case runs to max_tokens
    assert r.ids == _cut(want, {cfg.eos_token_id})
    assert r.tokens_per_step == per_step


def test_the_cases_exercise_parallel_and_out_of_order_commits(wq, rule):
    """Not a left-to-right decode in disguise: some steps commit several tokens, some commit a slot
    right of a mask, and the default rule commits one (lowest adjusted entropy) per step here."""
    _, model, tok, cfg, hf = wq
    seen_parallel = seen_jump = False
    for prompt, n, params in CASES:
        rule(**params)
        c = build_canvas(tok.encode(PROMPTS[prompt]), [], n, cfg, _opts())
        while not c.done:
            before = c.masked.clone()
            fill_step(model, [c])
            got = torch.nonzero(before & ~c.masked).flatten().tolist()
            seen_parallel |= len(got) > 1
            seen_jump |= any(bool(before[:j].any()) for j in got)
    assert seen_parallel and seen_jump


def test_the_rule_matters(wq):
    """Guards: on these cases a window of 4, no position penalty, the recipe-(c) layout (committed
    tokens in commit order) and a max-probability threshold each change at least one fill, so the
    equality above pins the authors' rule."""
    _, _, tok, cfg, hf = wq
    variants = {
        "window 4": dict(window=4),
        "no penalty": dict(penalty=0.0),
        "commit order": dict(order="commit"),
        "max prob": dict(rule="max_prob", confidence=0.5),
    }
    differs = {k: False for k in variants}
    for prompt, n, params in CASES[:5]:
        prefix = tok.encode(PROMPTS[prompt])
        base = {**dict(window=16, threshold=0.4, penalty=0.02), **params}
        want, _ = wedlm_stream_generate(hf, prefix, n, cfg.mask_token_id, {cfg.eos_token_id}, **base)
        for name, v in variants.items():
            if not differs[name]:
                got, _ = wedlm_stream_generate(hf, prefix, n, cfg.mask_token_id, {cfg.eos_token_id}, **{**base, **v})
                differs[name] = got != want
    assert all(differs.values()), differs


@pytest.fixture
def steered_eos(wq):
    """The eos row of both heads set to a x the mean direction of the slots' final hidden states, so
    that end-of-text wins some slots (12-12.25: it does, after a few tokens); restored afterwards."""
    _, model, tok, cfg, hf = wq
    eos = cfg.eos_token_id
    c = build_canvas(tok.encode(PROMPTS[0]), [], 12, cfg, _opts())
    with torch.no_grad():
        hn = model.norm(model.hidden(c.ids[None])[0, c.start :])  # (n, D) what the head sees
        u = hn.mean(0) / hn.mean(0).norm()
    saved = (model.head_weight[eos].clone(), hf.lm_head.weight[eos].clone())

    def steer(a: float) -> None:
        with torch.no_grad():
            model.head_weight[eos] = a * u
            hf.lm_head.weight[eos] = a * u

    yield steer
    with torch.no_grad():
        model.head_weight[eos], hf.lm_head.weight[eos] = saved


@pytest.mark.parametrize("a", [12.0, 12.25])
def test_end_of_text_ends_the_stream_as_the_authors_stop(wq, rule, steered_eos, a):
    """A committed end-of-text with nothing masked before it ends the fill at the step the authors'
    loop stops (its next prune), before every slot is decoded."""
    _, model, tok, cfg, hf = wq
    p = rule(threshold=1.0)
    steered_eos(a)
    prefix = tok.encode(PROMPTS[0])
    want, per_step = wedlm_stream_generate(hf, prefix, 16, cfg.mask_token_id, {cfg.eos_token_id}, **p)
    assert want[-1] == cfg.eos_token_id and len(want) < 16  # the steering does make it stop early
    c = build_canvas(prefix, [], 16, cfg, _opts())
    r = fill(model, c)
    assert r.ids == want[:-1] and r.tokens_per_step == per_step and c.n_masked > 0


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("params", [dict(), dict(threshold=2.0)])
def test_infill_extension_equals_its_own_loop(wq, rule, cache, params):
    """With a suffix (the engine's extension): the suffix is observed context at its logical
    positions, no slot past the n, and the window stops at the last slot."""
    _, model, tok, cfg, hf = wq
    p = rule(**params)
    prefix, suffix = tok.encode(PROMPTS[0]), tok.encode(SUFFIX)
    c = build_canvas(prefix, suffix, 10, cfg, _opts(cache=cache))
    assert c.n == c.keep == 10
    r = fill(model, c)
    want, per_step = wedlm_stream_generate(hf, prefix, 10, cfg.mask_token_id, {cfg.eos_token_id}, suffix=suffix, **p)
    assert r.ids == _cut(want, {cfg.eos_token_id}) and r.tokens_per_step == per_step
    plain, _ = wedlm_stream_generate(hf, prefix, 10, cfg.mask_token_id, {cfg.eos_token_id}, **p)
    assert plain != want  # the suffix is seen


# ---------------------------------------------------------------- the engine's semantics on it


def test_deadline_commits_every_mask_and_cancel_stops(wq):
    _, model, tok, cfg, _ = wq
    prefix = tok.encode(PROMPTS[0])
    c = build_canvas(prefix, [], 10, cfg, _opts())
    r = fill(model, c, deadline=time.monotonic() - 1)
    assert r.steps == 1 and r.deadline_hit and not bool(c.masked.any()) and len(r.ids) <= 10
    assert cfg.mask_token_id not in c.slot_ids()
    c = build_canvas(prefix, [], 10, cfg, _opts())
    r = fill(model, c, cancelled=lambda: c.steps >= 2)
    assert r.cancelled and r.steps == 2 and sum(r.tokens_per_step) == 10 + 15 - int(c.masked.sum())
    c = build_canvas(prefix, tok.encode(SUFFIX), 10, cfg, _opts())
    fill_step(model, [c])
    fill_step(model, [c], final=[True])  # a deadline mid-fill: the rest at once, window lifted
    assert c.done and not bool(c.masked.any()) and c.tokens_per_step[-1] == 10 - c.tokens_per_step[0]


def test_batched_steps_equal_each_alone(wq, rule):
    """Two WeDLM canvases (one with a suffix) stepped together through one BatchContext give each
    one's own fill: the batch path keeps each canvas's committed run and re-runs the rest."""
    _, model, tok, cfg, _ = wq
    rule(threshold=2.0)
    jobs = [(tok.encode(PROMPTS[0]), [], 12), (tok.encode(PROMPTS[1]), tok.encode(SUFFIX), 9)]
    alone = [fill(model, build_canvas(p, s, n, cfg, _opts())).ids for p, s, n in jobs]
    cs = [build_canvas(p, s, n, cfg, _opts()) for p, s, n in jobs]
    bctx = BatchContext()
    while not all(c.done for c in cs):
        fill_step(model, [c for c in cs if not c.done], batch_ctx=bctx)
    assert [c.fill_ids() for c in cs] == alone


def test_cached_steps_keep_only_the_committed_run(wq, rule):
    """The cache holds the prompt and the left-contiguous committed run, in logical order; every
    other committed slot is forwarded again at each step (the authors' window)."""
    _, model, tok, cfg, _ = wq
    rule(threshold=2.0)
    c = build_canvas(tok.encode(PROMPTS[0]), [], 16, cfg, _opts())
    ctx = c.start
    while not c.done:
        fill_step(model, [c])
        run = next((j for j, m in enumerate(c.masked.tolist()) if m), c.n)
        cached = c.cache_order
        assert cached == list(range(len(cached))) and len(cached) <= run
        assert c.ctx_len == ctx + len(cached)


def test_service_fills_with_wedlm(wq):
    """The resident service loads the folder like any model (fp32) and answers a job, healing on."""
    from engine.serve.service import EngineService

    folder = wq[0]
    svc = EngineService(str(folder), device="cpu")
    svc.load()
    out = svc.run_now(FillJob(prefix=PROMPTS[0], suffix=SUFFIX, max_tokens=6, options=DecodeOptions()))
    assert out.steps >= 1 and len(out.token_ids) <= 7 and svc.cfg.mask_token_id not in out.token_ids
    out = svc.run_now(FillJob(prefix=PROMPTS[1], max_tokens=6, options=DecodeOptions()))
    assert out.steps >= 1 and len(out.token_ids) <= 7


# ---------------------------------------------------------------- WeDLM-7B's layout


def test_wedlm_7b_layout_equals_qwen2(tmp_path):
    """WeDLM-7B (Qwen2.5 base) has `attention_bias: true, qk_norm: false` in the same WeDLM config:
    q/k/v biases, no o_proj bias, no q/k norm - what Qwen2ForCausalLM computes."""
    spec = Spec(
        "wedlm-7b",
        "Qwen2ForCausalLM",
        _qwen(
            "wedlm",
            ["WeDLMForCausalLM"],
            False,
            attention_bias=True,
            qk_norm=False,
            mask_token_id=None,
            eos_token_id=151643,
            pad_token_id=151643,
            bos_token_id=151643,
        ),
        {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
    )
    folder = write_checkpoint(spec, tmp_path / "w7", seed=11)
    assert json.loads((folder / "config.json").read_text())["qk_norm"] is False
    model, _, cfg = load_family(folder, "cpu", torch.float64)
    assert (cfg.qkv_bias, cfg.out_bias, cfg.qk_norm, cfg.mask_token_id) == (True, False, False, 151665)
    ref = reference_model(spec, seed=11)
    ids = torch.randint(0, 1000, (1, 14), generator=torch.Generator().manual_seed(3))
    masked = torch.zeros(14, dtype=torch.bool)
    masked[[5, 6, 10, 13]] = True
    ids[0, masked] = cfg.mask_token_id
    order = torch.cat([torch.nonzero(~masked).flatten(), torch.nonzero(masked).flatten()])
    want = reference_logits(ref, ids[:, order], "causal", pos=order[None])
    with torch.no_grad():
        got = model(ids[:, order], pos=order[None])
    assert (got - want).abs().max().item() <= 1e-10
