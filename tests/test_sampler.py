"""The sampler: pure pieces, the fast loop against the naive oracle, variable length, the context
cache, cancel and deadline."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from engine.api import DecodeOptions
from engine.decode import forward as fwd
from engine.decode import sampler
from engine.decode.cache import BatchContext
from engine.decode.canvas import schedule, trim_fill
from engine.decode.forward import build_canvas
from engine.decode.reference import reference_fill
from engine.decode.sampler import fill, select_threshold, select_topk
from engine.model.config import ModelConfig
from tests.engine_models import MockModel, peaked_model

# a token the peaked seed-0 models predict often: calling it padding puts padding and early stops on
# the oracle's path too
PAD = 249


def _io(seed: int, n_prefix: int = 13, n_suffix: int = 6, vocab: int = 300):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(4, vocab, (n_prefix,), generator=g).tolist(),
        torch.randint(4, vocab, (n_suffix,), generator=g).tolist(),
    )


@pytest.fixture(scope="module")
def models():
    return {shift: peaked_model(logits_shift=shift, pad=PAD) for shift in (False, True)}


# ---------------------------------------------------------------- pure pieces


def test_schedule_splits_evenly_larger_first():
    assert schedule(10, 4) == [3, 3, 2, 2]
    assert schedule(5, 5) == [1] * 5
    assert schedule(3, 10) == [1, 1, 1]  # never more steps than tokens
    assert schedule(7, 1) == [7]
    for n, s in itertools.product(range(1, 20), range(1, 12)):
        plan = schedule(n, s)
        assert sum(plan) == n and plan == sorted(plan, reverse=True) and max(plan) - min(plan) <= 1


def test_confidence_kinds():
    mp, t2, ent = torch.tensor([0.9, 0.5]), torch.tensor([0.05, 0.45]), torch.tensor([0.4, 0.8])
    assert torch.equal(sampler.confidence_from_stats(mp, t2, ent, "max_prob"), mp)
    assert torch.allclose(sampler.confidence_from_stats(mp, t2, ent, "margin"), torch.tensor([0.85, 0.05]))
    assert torch.equal(sampler.confidence_from_stats(mp, t2, ent, "neg_entropy"), -ent)
    with pytest.raises(ValueError):
        sampler.confidence_from_stats(mp, t2, ent, "vibes")


def test_selection_rules():
    conf = [0.2, 0.95, 0.5, 0.95, 0.91]
    assert select_topk(conf, 2) == [1, 3]  # ties: leftmost first
    assert select_topk(conf, 0) == [1]  # always at least one
    assert len(select_topk(conf, 99)) == 5
    assert select_threshold(conf, 0.9) == [1, 3, 4]
    assert select_threshold(conf, 0.99) == [1]  # nothing above tau: the best one alone


def test_trim_fill_drops_padding_and_cuts_at_eos():
    assert trim_fill([5, 0, 6, 1, 7, 0], pad_id=0, eos_id=1) == [5, 6]
    assert trim_fill([0, 0], pad_id=0, eos_id=1) == []


def test_bad_options_are_refused_when_the_canvas_is_built():
    cfg = ModelConfig(vocab_size=50)
    for bad in (DecodeOptions(selection="best"), DecodeOptions(confidence="gut"), DecodeOptions(steps=0)):
        with pytest.raises(ValueError):
            build_canvas([5, 6], [], 4, cfg, bad)
    with pytest.raises(ValueError):
        build_canvas([5, 6], [], 0, cfg, DecodeOptions())


def test_context_is_cut_to_fit_and_keeps_the_prefix_end():
    cfg = ModelConfig(vocab_size=50, max_seq_len=64)
    c = build_canvas(list(range(4, 44)), list(range(4, 34)), 8, cfg, DecodeOptions(), context_tokens=32)
    assert c.ids.shape[0] <= 32 and c.n == 8
    assert c.ids[: c.start].tolist()[-1] == 43  # the tokens next to the cursor survive
    c = build_canvas(list(range(4, 44)), [], 8, cfg, DecodeOptions(), context_tokens=4096)
    assert c.ids.shape[0] == 48  # clamped to the model's max_seq_len only when needed


def test_shifted_model_with_empty_prefix_gets_bos():
    cfg = ModelConfig(vocab_size=50, logits_shift=True, bos_token_id=3)
    c = build_canvas([], [7, 8], 4, cfg, DecodeOptions())
    assert c.ids[0].item() == 3 and c.start == 1


# ---------------------------------------------------------------- fast loop == oracle


ORACLE_CASES = [
    pytest.param(
        sel,
        conf,
        cache,
        shift,
        n,
        block,
        pad_left,
        id=f"{sel}-{conf}-{'cache' if cache else 'nocache'}-{'shift' if shift else 'noshift'}-n{n}-b{block}"
        + ("-padleft" if pad_left else ""),
    )
    for sel, conf, cache, shift, n, block, pad_left in itertools.product(
        ("threshold", "topk"),
        ("max_prob", "margin", "neg_entropy"),
        (False, True),
        (False, True),
        (3, 7),
        (0, 2),
        (False, True),
    )
]


@pytest.mark.parametrize("sel,conf,cache,shift,n,block,pad_left", ORACLE_CASES)
def test_fast_loop_matches_oracle(models, sel, conf, cache, shift, n, block, pad_left):
    model = models[shift]
    tau = {"max_prob": 0.5, "margin": 0.3, "neg_entropy": -1.5}[conf]
    for seed, pad_stop in ((n, 0.9), (n + 100, 0.3)):
        prefix, suffix = _io(seed)
        o = DecodeOptions(
            selection=sel,
            confidence=conf,
            threshold=tau,
            pad_stop=pad_stop,
            cache=cache,
            refresh_every=1,
            block=block,
            pad_left=pad_left,
            window=0,
        )
        want = reference_fill(model, prefix, suffix, n, o)
        got = fill(model, build_canvas(prefix, suffix, n, model.cfg, o))
        assert got.ids == want, f"seed {seed}: fast {got.ids} != oracle {want} (steps {got.tokens_per_step})"
        assert sum(got.tokens_per_step) == n and not got.cancelled and not got.deadline_hit


def test_oracle_cases_exercise_padding_and_parallel_commits(models):
    """Guards the oracle test itself: the chosen models and inputs do drop padding, stop early on
    padding and commit several slots in one threshold step."""
    dropped = early = parallel = 0
    for shift, n, seed in itertools.product((False, True), (3, 7), (3, 7, 103, 107)):
        prefix, suffix = _io(seed)
        for o in (
            DecodeOptions(threshold=0.5, pad_stop=0.3, cache=False, pad_left=False, window=0),
            DecodeOptions(threshold=0.5, cache=False, pad_left=False, window=0),
        ):
            r = fill(models[shift], build_canvas(prefix, suffix, n, models[shift].cfg, o))
            dropped += len(r.ids) < n
            parallel += max(r.tokens_per_step) > 1
            early += r.steps < n and len(r.ids) < n
    assert dropped and early and parallel


def test_steps_budget_with_threshold_selection(models):
    prefix, suffix = _io(5)
    o = DecodeOptions(threshold=0.999, steps=2, cache=False)
    r = fill(models[False], build_canvas(prefix, suffix, 7, models[False].cfg, o))
    assert r.steps == 2 and r.ids == reference_fill(models[False], prefix, suffix, 7, o)


def test_topk_default_schedule_commits_two_per_step(models):
    prefix, suffix = _io(6)
    r = fill(
        models[False], build_canvas(prefix, suffix, 8, models[False].cfg, DecodeOptions(selection="topk", cache=False))
    )
    assert r.tokens_per_step == [2, 2, 2, 2] or r.steps < 4  # (padding may end it sooner)


def test_temperature_sampling_is_reproducible_with_a_seed(models):
    prefix, suffix = _io(8)
    m = models[False]
    runs = [
        fill(m, build_canvas(prefix, suffix, 7, m.cfg, DecodeOptions(temperature=1.0, seed=s, pad_stop=2.0))).ids
        for s in (1, 1, 2, 3, 4)
    ]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[1:]}) > 1


# ---------------------------------------------------------------- context cache


class Counting:
    """Wraps a model and records the (batch, positions) of every hidden() call."""

    def __init__(self, model):
        self.m, self.calls = model, []
        self.cfg, self.norm = model.cfg, model.norm

    @property
    def head_weight(self):
        return self.m.head_weight

    def hidden(self, ids, *a, **kw):
        self.calls.append(tuple(ids.shape))
        return self.m.hidden(ids, *a, **kw)

    def logits(self, h):
        return self.m.logits(h)


def _with(o: DecodeOptions, **kw) -> DecodeOptions:
    return DecodeOptions(**{**o.__dict__, **kw})


@pytest.mark.parametrize("shift", [False, True])
def test_refresh_every_step_is_exactly_uncached(models, shift):
    prefix, suffix = _io(11, n_prefix=20)
    for o in (DecodeOptions(threshold=0.5), DecodeOptions(selection="topk", steps=9)):
        plain = fill(models[shift], build_canvas(prefix, suffix, 9, models[shift].cfg, _with(o, cache=False)))
        refreshed = fill(models[shift], build_canvas(prefix, suffix, 9, models[shift].cfg, _with(o, refresh_every=1)))
        assert refreshed.ids == plain.ids and refreshed.tokens_per_step == plain.tokens_per_step


@pytest.mark.parametrize("shift", [False, True])
def test_cached_steps_run_only_the_canvas(models, shift):
    m = Counting(models[shift])
    prefix, suffix = _io(12, n_prefix=30, n_suffix=10)
    n = 9
    c = build_canvas(prefix, suffix, n, m.cfg, DecodeOptions(selection="topk", steps=n, freeze=False))
    r = fill(m, c)
    L = c.ids.shape[0]
    assert m.calls[0] == (1, L)
    assert all(call == (1, n + shift) for call in m.calls[1:]) and len(m.calls) == r.steps > 1
    assert not bool(c.masked.any())


def test_frozen_slots_leave_the_cached_steps(models):
    m = Counting(models[False])
    prefix, suffix = _io(13, n_prefix=30, n_suffix=10)
    n = 9
    c = build_canvas(prefix, suffix, n, m.cfg, DecodeOptions(selection="topk", steps=n, pad_stop=2.0))
    fill(m, c)
    sizes = [call[1] for call in m.calls[1:]]
    # one slot committed per step; it still runs once with its token, then its K/V are cached
    assert sizes == [n] + [n - k for k in range(1, n - 1)]
    assert c.ctx_len == c.ids.shape[0] - 1  # everything but the last slot ended up in the context


def test_cached_fill_is_complete_and_close_to_uncached(models):
    prefix, suffix = _io(14, n_prefix=40, n_suffix=10)
    m = models[False]
    exact = fill(m, build_canvas(prefix, suffix, 9, m.cfg, DecodeOptions(cache=False, pad_stop=2.0)))
    for freeze in (False, True):
        c = build_canvas(prefix, suffix, 9, m.cfg, DecodeOptions(freeze=freeze, pad_stop=2.0))
        r = fill(m, c)
        assert not bool(c.masked.any()) and sum(r.tokens_per_step) == 9
        assert len(r.ids) == len(exact.ids)


@pytest.mark.parametrize("every", [2, 3])
def test_refresh_every_k_steps(models, every):
    m = Counting(models[False])
    prefix, suffix = _io(15, n_prefix=25)
    c = build_canvas(
        prefix,
        suffix,
        7,
        m.cfg,
        DecodeOptions(selection="topk", steps=7, refresh_every=every, pad_stop=2.0, pad_left=False, window=0),
    )
    r = fill(m, c)
    full = [i for i, call in enumerate(m.calls) if call[1] == c.ids.shape[0]]
    assert r.steps == 7 and full == list(range(0, 7, every))


@pytest.mark.parametrize("shift", [False, True])
def test_batched_full_forward_equals_single(models, shift):
    """forward_full with rows of different lengths (the path CUDA batches take): the same hidden
    states and the same cached context as one canvas at a time."""
    from engine.decode.cache import forward_full

    m = models[shift]
    o = DecodeOptions()

    def make():
        return [
            build_canvas(*_io(40 + i, n_prefix=8 + 9 * i, n_suffix=2 * i), n, m.cfg, o) for i, n in enumerate((4, 7, 2))
        ]

    with torch.inference_mode():
        batched, singles = make(), make()
        hb = forward_full(m, batched)
        hs = [forward_full(m, [c])[0] for c in singles]
    for (h1, p1), (h2, p2), cb, cs in zip(hb, hs, batched, singles):
        torch.testing.assert_close(h1, h2, atol=1e-5, rtol=1e-5)
        assert torch.equal(p1, p2) and cb.ctx_len == cs.ctx_len
        for (kb, vb), (ks_, vs) in zip(cb.ctx, cs.ctx):
            torch.testing.assert_close(kb, ks_, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(vb, vs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shift", [False, True])
def test_batched_steps_equal_single_steps(models, shift):
    """Three canvases of different lengths in one batch (padding, key_valid, ctx_valid, positions)
    give the same fills as each alone, with caching on and off."""
    jobs = [(_io(20 + i, n_prefix=10 + 7 * i, n_suffix=3 * i), n) for i, n in enumerate((5, 9, 3))]
    _batched_equals_alone(
        models[shift],
        jobs,
        (
            DecodeOptions(threshold=0.5, cache=False),
            DecodeOptions(threshold=0.5),
            DecodeOptions(selection="topk", freeze=False),
        ),
    )


def _batched_equals_alone(m, jobs, options) -> None:
    for o in options:
        alone = [fill(m, build_canvas(p, s, n, m.cfg, o)).ids for (p, s), n in jobs]
        canvases = [build_canvas(p, s, n, m.cfg, o) for (p, s), n in jobs]
        ctx = BatchContext()
        while any(not c.done for c in canvases):
            sampler.step(m, [c for c in canvases if not c.done], batch_ctx=ctx)
        assert [c.fill_ids() for c in canvases] == alone, o
        if o.cache:
            assert ctx.builds <= len(jobs)  # reused across steps, rebuilt only when a member leaves


# ---------------------------------------------------------------- variable length (mock model)


def _mock(n_real: int, real_logit: float, pad_logit: float, start: int, V: int = 50, eos_at: int | None = None):
    cfg = ModelConfig(vocab_size=V, dim=V, mask_token_id=2, pad_token_id=0, eos_token_id=1, bos_token_id=3)

    def script(ids, pos):  # slot j predicts token 10+j for j < n_real, then padding
        out = torch.zeros(len(pos), V)
        for r, p in enumerate(pos.tolist()):
            j = p - start
            if 0 <= j < n_real:
                out[r, 10 + j] = real_logit
            elif eos_at is not None and j == eos_at:
                out[r, 1] = real_logit
            elif j > 0:
                out[r, 20 if eos_at is not None else 0] = pad_logit
        return out

    return MockModel(cfg, script)


def test_surplus_slots_stop_early_as_padding():
    m = _mock(3, real_logit=8.0, pad_logit=7.0, start=4)  # real p=0.98 > padding p=0.96 >= pad_stop
    c = build_canvas([5, 6, 7, 8], [], 10, m.cfg, DecodeOptions(selection="topk", steps=10, cache=False))
    r = fill(m, c)
    assert r.ids == [10, 11, 12]
    assert r.tokens_per_step == [1, 1, 1, 7]  # the 7 padding slots went in one step
    assert reference_fill(m, [5, 6, 7, 8], [], 10, c.opts) == r.ids


def test_unsure_padding_does_not_stop_early():
    m = _mock(3, real_logit=8.0, pad_logit=2.0, start=4)  # padding p=0.13 < pad_stop
    r = fill(
        m,
        build_canvas(
            [5, 6, 7, 8],
            [],
            10,
            m.cfg,
            DecodeOptions(selection="topk", steps=10, cache=False, pad_left=False, window=0),
        ),
    )
    assert r.ids == [10, 11, 12] and r.steps == 10


def test_threshold_commits_every_confident_slot_at_once():
    m = _mock(3, real_logit=8.0, pad_logit=7.0, start=4)
    r = fill(m, build_canvas([5, 6, 7, 8], [], 10, m.cfg, DecodeOptions(pad_left=False, window=0)))
    assert r.ids == [10, 11, 12] and r.tokens_per_step == [10]
    # padding from the left (the default): the text first, then padding at slot 3 ends the fill
    r = fill(m, build_canvas([5, 6, 7, 8], [], 10, m.cfg, DecodeOptions()))
    assert r.ids == [10, 11, 12] and r.tokens_per_step == [3, 7]


def test_end_of_text_inside_the_canvas_cuts_the_fill():
    m = _mock(3, real_logit=8.0, pad_logit=7.0, start=4, eos_at=3)
    r = fill(m, build_canvas([5, 6, 7, 8], [], 8, m.cfg, DecodeOptions(threshold=0.5)))
    assert r.ids == [10, 11, 12]


# ---------------------------------------------------------------- cancel and deadline


def test_cancel_stops_within_one_step(models):
    m = models[False]
    prefix, suffix = _io(30)
    c = build_canvas(prefix, suffix, 9, m.cfg, DecodeOptions(selection="topk", steps=9, pad_stop=2.0))
    r = fill(m, c, cancelled=lambda: c.steps >= 1)
    assert r.cancelled and r.steps == 1 and int(c.masked.sum()) == 8
    r = fill(m, build_canvas(prefix, suffix, 9, m.cfg, DecodeOptions()), cancelled=lambda: True)
    assert r.cancelled and r.steps == 0 and r.ids == []


def test_past_deadline_commits_everything_in_one_step(models):
    m = models[False]
    prefix, suffix = _io(31)
    c = build_canvas(prefix, suffix, 9, m.cfg, DecodeOptions(selection="topk", steps=9, pad_stop=2.0))
    r = fill(m, c, deadline=time.monotonic() - 1)
    assert r.steps == 1 and r.deadline_hit and r.tokens_per_step == [9]
    assert m.cfg.mask_token_id not in c.slot_ids() and not bool(c.masked.any())


def test_deadline_bounds_a_slow_fill():
    V = 50
    cfg = ModelConfig(vocab_size=V, dim=V, mask_token_id=2, pad_token_id=0, eos_token_id=1)
    deadline = time.monotonic() + 60  # set below, once the canvas is built
    past = []  # per forward: was the deadline already past when it began?

    def slow(ids, pos):
        past.append(time.monotonic() >= deadline)
        if len(past) == 3:  # the third forward ends past the deadline, however fast the machine
            while time.monotonic() < deadline:
                time.sleep(0.005)
        out = torch.zeros(len(pos), V)
        out[:, 10] = 3.0
        return out

    m = MockModel(cfg, slow)
    c = build_canvas([5, 6], [], 30, cfg, DecodeOptions(selection="topk", steps=30, cache=False))
    deadline = time.monotonic() + 0.5  # the first forwards begin well before it, on any machine
    r = fill(m, c, deadline=deadline)
    assert r.deadline_hit and not bool(c.masked.any()) and 3 <= r.steps < 10
    # the step after the deadline commits every mask: at most one forward begins past it
    assert past[:3] == [False, False, False] and past.count(True) <= 1, past
    far = fill(
        m,
        build_canvas([5, 6], [], 3, cfg, DecodeOptions(selection="topk", steps=3, cache=False)),
        deadline=time.monotonic() + 60,
    )
    assert not far.deadline_hit and far.steps == 3


def test_canvas_never_exceeds_the_training_window():
    """A model trained on 64-token windows gets canvases of at most 64 tokens, prefix cut first."""
    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=2, ffn_dim=64, context_len=64)
    prefix, suffix = list(range(10, 210)), list(range(10, 110))
    c = build_canvas(prefix, suffix, 8, cfg, DecodeOptions(), context_tokens=512)
    assert c.ids.shape[0] == 64
    assert c.ids[: c.start].tolist() == prefix[-c.start :]  # the prefix keeps its end
    unclamped = build_canvas(
        prefix,
        suffix,
        8,
        ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=2, ffn_dim=64),
        DecodeOptions(),
        context_tokens=512,
    )
    assert unclamped.ids.shape[0] > 64


def test_semi_ar_blocks_commit_left_to_right_and_padding_ends_the_fill():
    """With blocks of 2, slots are committed block by block from the left even when the right end is
    the most confident, and the first committed padding turns every later slot into padding."""
    from engine.decode.sampler import eligible_slots

    assert eligible_slots([0, 1, 2, 3, 4], 2) == [0, 1]
    assert eligible_slots([1, 4, 5], 2) == [0]
    assert eligible_slots([3, 4, 6], 2) == [0]
    assert eligible_slots([3, 4, 6], 0) == [0, 1, 2]
    # mock: 3 real tokens, then padding, padding more confident than text (the cascade's cause)
    model = _mock(n_real=3, real_logit=3.0, pad_logit=9.0, start=3)
    prefix, suffix = [5, 6, 7], [8]
    plain = fill(
        model,
        build_canvas(
            prefix, suffix, 8, model.cfg, DecodeOptions(threshold=0.99, cache=False, pad_left=False, window=0)
        ),
    )
    semi = fill(model, build_canvas(prefix, suffix, 8, model.cfg, DecodeOptions(threshold=0.99, cache=False, block=2)))
    assert semi.ids == reference_fill(model, prefix, suffix, 8, DecodeOptions(threshold=0.99, cache=False, block=2))
    assert len(semi.ids) == 3  # text in slots 0-2, then padding ends the fill
    assert semi.tokens_per_step[0] <= 2  # the first step may only touch the first block
    assert plain.tokens_per_step[0] >= 5  # the confident padding goes first without blocks


def test_pad_left_commits_padding_only_at_the_leftmost_masked_slot():
    """With pad_left the confident padding at the right end waits; text goes first, and padding
    committed at the leftmost masked slot ends the fill."""
    model = _mock(n_real=3, real_logit=3.0, pad_logit=9.0, start=3)
    prefix, suffix = [5, 6, 7], [8]
    o = DecodeOptions(threshold=0.99, cache=False, pad_left=True)
    r = fill(model, build_canvas(prefix, suffix, 8, model.cfg, o))
    assert r.ids == reference_fill(model, prefix, suffix, 8, o)
    assert len(r.ids) == 3 and r.tokens_per_step[0] == 1  # one text slot (no padding) in the first step
    assert r.tokens_per_step[-1] == 8 - 3  # the padding ends the fill in one step


def test_end_at_padding_with_an_end_id_cuts_text_further_right():
    import torch

    # masked slots 0..4 predict: text, pad, text, pad, text; slots 1 and 2 are picked
    from engine.decode.canvas import trim_fill
    from engine.decode.sampler import _end_at_padding

    pred = [11.0, 0.0, 12.0, 0.0, 13.0]
    pick, values = _end_at_padding([1, 2], pred, torch.tensor([11, 0, 12, 0, 13]), (0, 1), pad_id=0)
    assert pick == [1, 2, 3, 4] and values.tolist() == [11, 0, 0, 0, 0]  # slot 2's text becomes padding
    pick, values = _end_at_padding([1, 2], pred, torch.tensor([11, 0, 12, 0, 13]), (0, 1), pad_id=0, end_id=1)
    assert values.tolist() == [11, 1, 0, 0, 0]
    # a canvas [text, END, committed text further right]: the fill stops at the end
    assert trim_fill([7, 1, 9], pad_id=0, eos_id=1) == [7]
    assert trim_fill([7, 0, 9], pad_id=0, eos_id=1) == [7, 9]


def test_fill_confidence_is_the_geometric_mean_of_the_committed_text_probabilities():
    import math

    sure = fill(
        _mock(3, real_logit=8.0, pad_logit=7.0, start=4),
        build_canvas([5, 6, 7, 8], [], 10, _mock(3, 8.0, 7.0, 4).cfg, DecodeOptions(cache=False)),
    )
    unsure = fill(
        _mock(3, real_logit=2.0, pad_logit=7.0, start=4),
        build_canvas([5, 6, 7, 8], [], 10, _mock(3, 2.0, 7.0, 4).cfg, DecodeOptions(cache=False, pad_left=True)),
    )
    p_sure = math.exp(8.0) / (math.exp(8.0) + 48)  # the token's softmax prob over 49 non-mask logits
    p_unsure = math.exp(2.0) / (math.exp(2.0) + 48)
    assert sure.ids == [10, 11, 12] and sure.confidence == pytest.approx(p_sure, rel=1e-5)
    assert unsure.ids == [10, 11, 12] and unsure.confidence == pytest.approx(p_unsure, rel=1e-5)
    assert build_canvas([5, 6, 7, 8], [], 4, _mock(0, 8.0, 7.0, 4).cfg, DecodeOptions()).fill_confidence() == 1.0


# ---------------------------------------------------------------- sliding window


WINDOW_CASES = [
    pytest.param(
        sel,
        cache,
        shift,
        block,
        pad_left,
        id=f"{sel}-{'cache' if cache else 'nocache'}-{'shift' if shift else 'noshift'}-b{block}"
        + ("-padleft" if pad_left else ""),
    )
    for sel, cache, shift, block, pad_left in itertools.product(
        ("threshold", "topk"), (False, True), (False, True), (0, 2), (False, True)
    )
]


@pytest.mark.parametrize("sel,cache,shift,block,pad_left", WINDOW_CASES)
def test_windowed_fast_loop_matches_oracle(models, sel, cache, shift, block, pad_left):
    model = models[shift]
    for seed, pad_stop, n in ((7, 0.9, 7), (107, 0.3, 7), (9, 0.9, 9)):
        prefix, suffix = _io(seed)
        o = DecodeOptions(
            selection=sel,
            threshold=0.5,
            pad_stop=pad_stop,
            cache=cache,
            refresh_every=1,
            block=block,
            pad_left=pad_left,
            window=3,
        )
        want = reference_fill(model, prefix, suffix, n, o)
        got = fill(model, build_canvas(prefix, suffix, n, model.cfg, o))
        assert got.ids == want, f"seed {seed}: fast {got.ids} != oracle {want} (steps {got.tokens_per_step})"
        assert sum(got.tokens_per_step) == n


def test_window_limits_what_a_step_predicts_and_commits():
    """3 real tokens then padding, padding the most confident: with a window of 2 the first step may
    only commit slots 0-1, and the padding at slot 3 ends the fill with every slot right of it."""
    model = _mock(n_real=3, real_logit=9.0, pad_logit=9.0, start=3)
    prefix, suffix = [5, 6, 7], [8]
    o = DecodeOptions(threshold=0.9, cache=False, pad_left=False, window=2)
    r = fill(model, build_canvas(prefix, suffix, 10, model.cfg, o))
    assert r.ids == [10, 11, 12] == reference_fill(model, prefix, suffix, 10, o)
    assert r.tokens_per_step == [2, 8]  # slots 0-1; then slot 2, padding at 3 and the 6 slots after it


@pytest.mark.parametrize("shift", [False, True])
def test_windowed_cached_steps_run_only_the_window(models, shift):
    m = Counting(models[shift])
    prefix, suffix = _io(16, n_prefix=30, n_suffix=10)
    n, w = 9, 3
    c = build_canvas(
        prefix, suffix, n, m.cfg, DecodeOptions(selection="topk", steps=n, pad_stop=2.0, pad_left=False, window=w)
    )
    r = fill(m, c)
    assert not bool(c.masked.any()) and sum(r.tokens_per_step) == n and r.steps == n
    # one slot per step: the window's masked slots and the slot committed last step; shifted, also the
    # committed slots whose right neighbour is still masked (they predict it), never the whole canvas
    sizes = [call[1] for call in m.calls[1:]]
    assert m.calls[0][1] == c.ids.shape[0] and max(sizes) <= (w + 1 if not shift else n - 1)
    assert sizes[0] == w + 1 + shift  # the window, the slot committed by the full step (and the one before them)
    # the same fill with the window but no cache (the window decides what is committed, not the cache)
    exact = fill(
        models[shift],
        build_canvas(
            prefix,
            suffix,
            n,
            m.cfg,
            DecodeOptions(selection="topk", steps=n, pad_stop=2.0, pad_left=False, window=w, cache=False),
        ),
    )
    assert len(r.ids) == len(exact.ids)


def test_windowed_deadline_step_commits_every_mask():
    m = Counting(peaked_model(pad=0))  # padding it never predicts: no fill ends early here
    prefix, suffix = _io(17, n_prefix=30)
    c = build_canvas(
        prefix, suffix, 12, m.cfg, DecodeOptions(selection="topk", steps=12, pad_stop=2.0, pad_left=False, window=2)
    )
    sampler.step(m, [c])
    sampler.step(m, [c])
    assert m.calls[-1][1] <= 3  # windowed cached step
    sampler.step(m, [c], final=[True])
    assert m.calls[-1][1] >= 10 and not bool(c.masked.any())  # the final step ran and committed every mask
    c2 = build_canvas(prefix, suffix, 12, m.cfg, DecodeOptions(pad_left=False, window=2))
    sampler.step(m, [c2])
    with torch.inference_mode():
        h = fwd.forward(m, [c2])[0]  # a windowed forward, then asked to commit everything: refused
    with pytest.raises(RuntimeError, match="announced"), torch.inference_mode():
        sampler.commit(m, c2, h, final=True)


def test_batched_windowed_steps_equal_single_steps(models):
    """Canvases with windows of outside slots of different lengths in one batch (the padded extra
    context) give the same fills as each alone."""
    jobs = [(_io(50 + i, n_prefix=10 + 7 * i, n_suffix=3 * i), n) for i, n in enumerate((5, 9, 12))]
    _batched_equals_alone(
        models[False],
        jobs,
        (
            DecodeOptions(threshold=0.5, window=3),
            DecodeOptions(selection="topk", freeze=False, window=2),
            DecodeOptions(selection="topk", window=4, pad_stop=2.0, pad_left=False),
        ),
    )


def test_window_cases_differ_from_unwindowed_ones(models):
    """Guards the windowed oracle test: on its inputs the window changes some fills."""
    diff = 0
    for sel, shift, (seed, pad_stop, n) in itertools.product(
        ("threshold", "topk"), (False, True), ((7, 0.9, 7), (107, 0.3, 7), (9, 0.9, 9))
    ):
        prefix, suffix = _io(seed)
        o = DecodeOptions(selection=sel, threshold=0.5, pad_stop=pad_stop, cache=False, window=3)
        diff += reference_fill(models[shift], prefix, suffix, n, o) != reference_fill(
            models[shift], prefix, suffix, n, _with(o, window=0)
        )
    assert diff >= 2


# ---------------------------------------------------------------- token healing


def _heal_ids(seed: int, cfg) -> list[int]:
    """Six ordinary ids slot 0 may take (never mask, padding or end)."""
    return [i for i in _io(seed, n_prefix=8)[0] if i not in (cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id)][:6]


HEAL_CASES = [
    pytest.param(
        sel,
        cache,
        shift,
        window,
        id=f"{sel}-{'cache' if cache else 'nocache'}-{'shift' if shift else 'noshift'}-w{window}",
    )
    for sel, cache, shift, window in itertools.product(("threshold", "topk"), (False, True), (False, True), (0, 3))
]


def _heal_chain(model, prefix, suffix, n, seed, o):
    """Healing candidates where slot 0's free choice is a piece: slot 1 must then take one of six ids."""
    free = reference_fill(model, prefix, suffix, n, _with(o, window=0))
    piece = free[0] if free and free[0] not in (model.cfg.pad_token_id, model.cfg.eos_token_id) else 40
    heal = sorted(set(_heal_ids(seed + 1000, model.cfg)) | {piece})
    return heal, {piece: _heal_ids(seed + 3000, model.cfg)}


@pytest.mark.parametrize("sel,cache,shift,window", HEAL_CASES)
def test_healed_fast_loop_matches_oracle(models, sel, cache, shift, window):
    """Slot 0 restricted to the healing candidates (and, after a piece, slot 1 to its ids): the fast
    loop and the oracle agree token for token; the healed slots always hold candidates (never
    padding, so never an empty fill)."""
    model = models[shift]
    for (seed, n, pad_stop), chain in itertools.product(((7, 7, 0.9), (107, 5, 0.3), (9, 9, 0.9)), (False, True)):
        prefix, suffix = _io(seed)
        o = DecodeOptions(selection=sel, threshold=0.5, pad_stop=pad_stop, cache=cache, refresh_every=1, window=window)
        heal, then = (
            _heal_chain(model, prefix, suffix, n, seed, o) if chain else (_heal_ids(seed + 1000, model.cfg), {})
        )
        want = reference_fill(model, prefix, suffix, n, o, heal=heal, heal_then=then)
        c = build_canvas(prefix, suffix, n, model.cfg, o, heal=heal, heal_then=then)
        got = fill(model, c)
        assert got.ids == want, f"seed {seed}: fast {got.ids} != oracle {want} (steps {got.tokens_per_step})"
        assert got.ids and got.ids[0] in heal and not c.heal_open
        if got.ids[0] in then:
            assert len(got.ids) > 1 and got.ids[1] in then[got.ids[0]]


def test_heal_chain_cases_take_pieces_and_slot_1_waits(models):
    """Guards the chained cases: slot 0 does take the piece, slot 1 is committed only after it, and
    a step-budget (last) step re-types the whole tail at slot 0."""
    pieces = 0
    for shift, (seed, n) in itertools.product((False, True), ((7, 7), (107, 5), (9, 9))):
        m = models[shift]
        prefix, suffix = _io(seed)
        o = DecodeOptions(selection="topk", steps=n, pad_stop=2.0, cache=False, window=0)
        heal, then = _heal_chain(m, prefix, suffix, n, seed, o)
        c = build_canvas(prefix, suffix, n, m.cfg, o, heal=heal, heal_then=then)
        order = []
        while not c.done:
            before = c.masked.clone()
            sampler.step(m, [c])
            order += [j for j in range(n) if before[j] and not c.masked[j]]
        pieces += c.ids[c.start].item() in then
        assert order.index(0) < order.index(1)
        last = build_canvas(prefix, suffix, n, m.cfg, DecodeOptions(steps=1, window=0), heal=heal, heal_then=then)
        r = fill(m, last)
        assert r.steps == 1 and r.ids[0] in heal and r.ids[0] not in then
    assert pieces >= 4


def test_healing_changes_fills_and_refuses_special_ids(models):
    """Guards the healed oracle test: without the restriction slot 0 is mostly something else."""
    outside = 0
    for shift, seed in itertools.product((False, True), (7, 107, 9)):
        prefix, suffix = _io(seed)
        heal = _heal_ids(seed + 1000, models[shift].cfg)
        o = DecodeOptions(threshold=0.5, cache=False)
        free = reference_fill(models[shift], prefix, suffix, 5, o)
        outside += not free or free[0] not in heal
    assert outside >= 4
    cfg = models[False].cfg
    for bad in ([cfg.pad_token_id], [cfg.mask_token_id, 5], [cfg.vocab_size]):
        with pytest.raises(ValueError, match="heal"):
            build_canvas([5, 6], [], 4, cfg, DecodeOptions(), heal=bad)


def test_healed_sampling_draws_slot_0_from_the_candidates(models):
    for seed in range(6):
        prefix, suffix = _io(seed)
        heal = _heal_ids(seed + 2000, models[False].cfg)
        o = DecodeOptions(temperature=1.5, seed=seed)
        r = fill(models[False], build_canvas(prefix, suffix, 6, models[False].cfg, o, heal=heal))
        assert r.ids[0] in heal


def test_batched_healed_canvases_equal_each_alone(models):
    """A healed canvas (one restricted row) batched with plain ones steps as it does alone."""
    m = models[False]
    jobs = [
        (_io(60 + i, n_prefix=9 + 5 * i, n_suffix=2 * i), n, _heal_ids(70 + i, m.cfg) if i != 1 else None)
        for i, n in enumerate((5, 8, 11))
    ]
    for o in (DecodeOptions(threshold=0.5, window=3), DecodeOptions(selection="topk", pad_stop=2.0)):
        alone = [fill(m, build_canvas(p, s, n, m.cfg, o, heal=h)).ids for (p, s), n, h in jobs]
        canvases = [build_canvas(p, s, n, m.cfg, o, heal=h) for (p, s), n, h in jobs]
        ctx = BatchContext()
        while any(not c.done for c in canvases):
            sampler.step(m, [c for c in canvases if not c.done], batch_ctx=ctx)
        assert [c.fill_ids() for c in canvases] == alone


# ---------------------------------------------------------------- the context copy boost


def test_copy_tables_and_bias():
    from engine.bias.copy import copy_bias, copy_tables, left_runs

    uni, succ = copy_tables([5, 6, 7, 5, 8, 1, 9], special=(1,))
    assert uni == [5, 6, 7, 8, 9] and succ == {(5,): [6, 8], (6,): [7], (7,): [5]}  # nothing across the special id
    o = DecodeOptions(copy_bigram=2.0, copy_unigram=0.5)
    b = copy_bias([(5,), (), (3,)], uni, succ, 12, o)
    assert b.shape == (3, 12)
    assert b[0, 6] == b[0, 8] == 2.5 and b[0, 7] == 0.5 and b[0, 0] == 0.0  # bigram + unigram
    assert b[1].tolist() == b[2].tolist() and b[1, 6] == 0.5 and b[1, 0] == 0.0  # masked / unseen left: unigram only
    # longer runs (copy_order 3): the successor of the longest matching run gets k x copy_bigram
    uni, succ = copy_tables([4, 5, 6, 9, 5, 7], special=(), order=3)
    assert succ[(4, 5, 6)] == [9] and succ[(5,)] == [6, 7] and succ[(9, 5)] == [7]
    b = copy_bias([(4, 5), (8, 5)], uni, succ, 12, DecodeOptions(copy_bigram=1.0, copy_order=3))
    assert b[0, 6] == 2.0 and b[0, 7] == 1.0  # (4, 5) -> 6 matched with k=2; 5 -> 7 only with k=1
    assert b[1, 6] == b[1, 7] == 1.0  # (8, 5) never occurs: the one-token match only
    assert left_runs([4, 5, 2, 7, 8, 2], [2, 5, 0], 2, mask_id=2) == [(4, 5), (7, 8), ()]


def _copy_tables_plainly(context: list[int], special: tuple, order: int) -> dict[tuple, list[int]]:
    """The near table written out: every run of 1..order non-special ids -> the non-special ids after it."""
    succ: dict[tuple, set[int]] = {}
    for i in range(1, len(context)):
        for k in range(1, order + 1):
            run = tuple(context[i - k : i])
            if i - k >= 0 and context[i] not in special and not any(t in special for t in run):
                succ.setdefault(run, set()).add(context[i])
    return {r: sorted(v) for r, v in succ.items()}


def test_lazy_successors_match_the_whole_table():
    from engine.bias.copy import copy_tables

    rng = np.random.default_rng(1)
    for _ in range(200):
        ctx = rng.integers(0, 7, size=int(rng.integers(0, 50))).tolist()
        order = int(rng.integers(1, 4))
        uni, succ = copy_tables(ctx, special=(0, 3), order=order)
        want = _copy_tables_plainly(ctx, (0, 3), order)
        assert uni == sorted(set(ctx) - {0, 3})
        for _ in range(10):  # looked up one run at a time, longest first as copy_bias does, in any order
            run = tuple(rng.integers(1, 7, size=int(rng.integers(1, order + 1))).tolist())
            for k in range(len(run), 0, -1):
                assert succ.get(run[-k:], []) == want.get(run[-k:], []) and (run[-k:] in succ) == (run[-k:] in want)
        assert succ.get((1,) * (order + 1)) is None  # longer than the order: not a key, nothing memoized
        assert dict(succ) == want  # the whole mapping, after the lookups filled part of its memo


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("window,cache,order", [(0, False, 1), (0, True, 1), (3, True, 1), (3, True, 3)])
def test_copy_boost_fast_loop_matches_oracle_and_changes_fills(shift, window, cache, order):
    from engine.model.config import ModelConfig
    from engine.model.transformer import Transformer

    # an untrained model (flat distributions, unlike the peaked ones), so a boost of a few nats decides
    cfg = ModelConfig(
        vocab_size=300,
        dim=32,
        n_layers=2,
        n_heads=2,
        ffn_dim=64,
        max_seq_len=512,
        logits_shift=shift,
        mask_token_id=2,
        pad_token_id=PAD,
        eos_token_id=1,
        bos_token_id=3,
    ).validate()
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    changed = 0
    for seed in range(6):
        prefix, suffix = _io(seed, n_prefix=40, n_suffix=10)
        base = DecodeOptions(threshold=0.5, cache=cache, refresh_every=1, window=window, pad_left=True)
        boosted = DecodeOptions(
            threshold=0.5,
            cache=cache,
            refresh_every=1,
            window=window,
            pad_left=True,
            copy_bigram=3.0,
            copy_unigram=0.5,
            copy_order=order,
        )
        got = fill(model, build_canvas(prefix, suffix, 7, model.cfg, boosted))
        assert got.ids == reference_fill(model, prefix, suffix, 7, boosted), f"seed {seed}"
        changed += got.ids != fill(model, build_canvas(prefix, suffix, 7, model.cfg, base)).ids
    assert changed  # the boost is not a no-op on these inputs


def _far_successors_plainly(far: list[int], run: tuple) -> list[list[int]]:
    """far_successors written out: for each k, the ids after every occurrence of run[-k:]."""
    out = []
    for k in range(1, len(run) + 1):
        nxt = {far[i + k] for i in range(len(far) - k) if tuple(far[i : i + k]) == tuple(run[-k:]) and far[i + k] >= 0}
        if not any(tuple(far[i : i + k]) == tuple(run[-k:]) for i in range(len(far) - k)):
            break
        out.append(sorted(nxt))
    return out


def test_far_side_of_the_copy_boost():
    from engine.bias.copy import copy_bias, copy_tables, far_ids, far_successors

    far = far_ids([9, 4, 5, 6, 1, 4, 5, 7, 3, 5, 8, 4, 5], special=(1, 3, None))
    assert far.tolist() == [9, 4, 5, 6, -1, 4, 5, 7, -1, 5, 8, 4, 5]  # specials can neither match nor follow
    assert far_ids([], special=(1,)) is None and far_ids(list(range(20)), (), limit=5).tolist() == [15, 16, 17, 18, 19]
    assert far_successors(far, (4, 5)) == [[6, 7, 8], [6, 7]]
    assert far_successors(far, (9, 4, 5)) == [[6, 7, 8], [6, 7], [6]]
    assert far_successors(far, (2, 5)) == [[6, 7, 8]] and far_successors(far, (6,)) == [[]]  # 6 -> only a special
    assert far_successors(far, (7, 1)) == []  # 1 never occurs (it became -1)
    rng = np.random.default_rng(0)
    for _ in range(200):  # against the plain version on random streams
        ids = rng.integers(0, 6, size=int(rng.integers(2, 40))).tolist()
        f = far_ids(ids, special=(0,))
        run = tuple(rng.integers(1, 6, size=int(rng.integers(1, 4))).tolist())
        assert far_successors(f, run) == _far_successors_plainly(f.tolist(), run), (ids, run)
    # in the bias: the near context first, the far side only for ids not boosted yet
    uni, succ = copy_tables([4, 5, 6], special=(), order=3)
    o = DecodeOptions(copy_bigram=2.0, copy_order=3, copy_far=1.0)
    b = copy_bias([(9, 4, 5), (8,)], uni, succ, 12, o, far=far)
    assert b[0, 6] == 4.0  # near (4, 5) -> 6 at k = 2 beats the far side's (9, 4, 5) -> 6 at k = 3
    assert b[0, 7] == 2.0 and b[0, 8] == 1.0  # far only: (4, 5) -> 7 at k = 2, 5 -> 8 at k = 1
    assert b[1, 4] == 1.0 and float(b[1].abs().sum()) == 1.0  # 8 -> 4 in the far side only
    strong = copy_bias([(9, 4, 5)], uni, succ, 12, DecodeOptions(copy_bigram=2.0, copy_order=3, copy_far=2.0), far=far)
    assert strong[0, 6] == 6.0  # the larger of near (2 x 2) and far (3 x 2), not their sum
    off = copy_bias([(9, 4, 5)], uni, succ, 12, DecodeOptions(copy_bigram=2.0, copy_order=3, copy_far=0.0), far=far)
    assert off[0, 7] == 0.0 and off[0, 6] == 4.0  # copy_far 0: the far side is ignored


@pytest.mark.parametrize("window,cache", [(0, False), (3, True)])
def test_copy_far_fast_loop_matches_oracle_and_changes_fills(window, cache):
    from engine.model.config import ModelConfig
    from engine.model.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=300,
        dim=32,
        n_layers=2,
        n_heads=2,
        ffn_dim=64,
        max_seq_len=512,
        mask_token_id=2,
        pad_token_id=PAD,
        eos_token_id=1,
        bos_token_id=3,
    ).validate()
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    changed = 0
    for seed in range(6):
        prefix, suffix = _io(seed, n_prefix=30, n_suffix=8)
        lookup, _ = _io(100 + seed, n_prefix=200, n_suffix=0)
        o = DecodeOptions(
            threshold=0.5, cache=cache, refresh_every=1, window=window, copy_bigram=1.0, copy_order=2, copy_far=3.0
        )
        c = build_canvas(prefix, suffix, 7, model.cfg, o)
        c.attach_far(lookup)
        got = fill(model, c)
        assert got.ids == reference_fill(model, prefix, suffix, 7, o, lookup=lookup), f"seed {seed}"
        changed += got.ids != fill(model, build_canvas(prefix, suffix, 7, model.cfg, o)).ids
    assert changed  # the far side is not a no-op on these inputs


def test_a_seed_torch_cannot_take_is_refused_when_the_job_is_admitted():
    """torch's generators take seeds in SEED_RANGE; a wider one is a bad job, not an overflow mid-fill."""
    from engine.api import SEED_RANGE
    from engine.decode.canvas import check_options

    for ok in SEED_RANGE:
        check_options(DecodeOptions(temperature=0.5, seed=ok))
    for bad in (SEED_RANGE[0] - 1, SEED_RANGE[1] + 1):
        with pytest.raises(ValueError, match="seed"):
            check_options(DecodeOptions(temperature=0.5, seed=bad))
