"""engine/decode/reuse.py: approximate per-keystroke context reuse for full-attention models.

Reuse off is today's path bit for bit; an unchanged request after a full forward fills as a full
recompute; re-rotated keys equal keys recomputed at the new positions (alone, and in the buffer a
shifted keystroke leaves); the staleness policy (budget of changed tokens, cursor jump, other
options) recomputes in full; a keystroke forwards only the changed tokens and the canvas; a failed
or cancelled request leaves the session's entry whole; the exact reorder path is untouched.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine.api import DecodeOptions, EngineError, FillJob
from engine.decode import forward as fwd
from engine.decode import reuse, sampler
from engine.decode.canvas import Canvas
from engine.decode.forward import build_canvas
from engine.decode.reuse import ReuseCache, best_run, rerotate, segments
from engine.model.transformer import apply_rope
from engine.serve.service import EngineService
from tests.engine_models import peaked_checkpoint, peaked_model
from tests.tiny import CORPUS

OFF = DecodeOptions(threshold=0.5, reuse=False)
ON = dataclasses.replace(OFF, reuse=True)
TEXT = "".join(dict.fromkeys(CORPUS)) * 2  # ~600 characters of code
CUT = 300


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 300, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def model():
    return peaked_model(seed=3)


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = EngineService(
        str(peaked_checkpoint(tmp_path_factory.mktemp("reuse") / "peaked", seed=2)), device="cpu", threads=1
    )
    s.load()
    return s


def _job(k: int, session: str | None, opts: DecodeOptions = ON, shift: int = 0) -> FillJob:
    """The document typed up to CUT + k characters at the cursor (the rest of it stays the suffix)."""
    a = CUT + k - shift
    return FillJob(prefix=TEXT[:a], suffix=TEXT[CUT + 20 : CUT + 120], max_tokens=8, options=opts, session=session)


def _keyed(model, prefix, suffix, opts, store, key="doc", context_tokens=512, n=8) -> Canvas:
    c = build_canvas(prefix, suffix, n, model.cfg, opts, context_tokens)
    c.reuse = (store, key)
    return c


def _spy(svc, monkeypatch, after_first=None) -> list[int]:
    """Rows of every model.hidden call from now on (`after_first()` runs after the first one)."""
    seen: list[int] = []
    inner = type(svc.model).hidden.__get__(svc.model)

    def hidden(ids, *a, **kw):
        out = inner(ids, *a, **kw)
        seen.append(ids.shape[0] * ids.shape[1])
        if len(seen) == 1 and after_first is not None:
            after_first()
        return out

    monkeypatch.setattr(svc.model, "hidden", hidden)
    return seen


# ---------------------------------------------------------------- the option


def test_reuse_off_is_todays_fill_bit_for_bit(svc):
    before = dict(svc._reuse.stats)
    for k in range(5):
        keyed, plain = svc.run_now(_job(k, "off-doc", OFF)), svc.run_now(_job(k, None, OFF))
        assert keyed.token_ids == plain.token_ids and keyed.tokens_per_step == plain.tokens_per_step
        assert keyed.confidence == plain.confidence  # the same floats: the same computation
        assert keyed.forwarded_tokens == plain.forwarded_tokens and keyed.reused_tokens == plain.reused_tokens == 0
    assert svc._reuse.stats == before and svc._reuse.get("off-doc") is None  # the reuse path never ran


def test_reuse_needs_full_attention_and_a_cached_context(model):
    assert reuse.applies(build_canvas(_ids(1, 20), [], 4, model.cfg, ON))
    assert not reuse.applies(build_canvas(_ids(1, 20), [], 4, model.cfg, OFF))
    assert not reuse.applies(build_canvas(_ids(1, 20), [], 4, model.cfg, dataclasses.replace(ON, cache=False)))
    causal = peaked_model(causal=True)
    assert not reuse.applies(build_canvas(_ids(1, 20), [], 4, causal.cfg, ON))
    with pytest.raises(ValueError, match="reuse_budget"):
        build_canvas(_ids(1, 20), [], 4, model.cfg, dataclasses.replace(ON, reuse_budget=-1))


def test_the_exact_reorder_path_is_unchanged_with_reuse_on(tmp_path):
    from tests.tiny import make_tiny_checkpoint

    s = EngineService(
        str(make_tiny_checkpoint(tmp_path / "m", attention="causal", canvas="reorder")), device="cpu", threads=1
    )
    s.load()
    for k in range(3):
        keyed, plain = s.run_now(_job(k, "doc", ON)), s.run_now(_job(k, None, OFF))
        assert keyed.token_ids == plain.token_ids
    assert s._reuse.stats["lookups"] == 0 and s._sessions.stats["hits"] == 2  # its own exact SessionCache


# ---------------------------------------------------------------- exactness where it is exact


def test_an_unchanged_request_after_a_full_forward_is_a_full_recompute(model):
    prefix, suffix = _ids(10, 60), _ids(11, 20)
    store = ReuseCache()
    first, again, plain = (
        _keyed(model, prefix, suffix, ON, store),
        _keyed(model, prefix, suffix, ON, store),
        build_canvas(prefix, suffix, 8, model.cfg, ON),
    )
    h_first, h_again, h_plain = (fwd.forward(model, [c])[0] for c in (first, again, plain))
    assert first.reused == 0 and again.reused == 80 and store.stats["reused"] == 1
    assert torch.equal(h_first[0], h_plain[0])  # a new session's first forward is today's full forward
    torch.testing.assert_close(h_again[0], h_plain[0], atol=1e-5, rtol=1e-5)  # the canvas against the cached context
    assert again.rows_forwarded == 8 and plain.rows_forwarded == 88
    # and the whole fill: the same tokens
    store2 = ReuseCache()
    sampler.fill(model, _keyed(model, prefix, suffix, ON, store2))
    c = _keyed(model, prefix, suffix, ON, store2)
    assert sampler.fill(model, c).ids == sampler.fill(model, build_canvas(prefix, suffix, 8, model.cfg, ON)).ids
    assert c.reused == 80


def test_service_fill_of_an_unchanged_request_equals_the_full_recompute(svc):
    first = svc.run_now(_job(0, "same-doc"))
    again = svc.run_now(_job(0, "same-doc"))
    plain = svc.run_now(_job(0, None))
    assert first.reused_tokens == 0 and again.reused_tokens == svc._reuse.get("same-doc").ids.shape[0] > 50
    assert again.token_ids == plain.token_ids == first.token_ids


@pytest.mark.parametrize("delta", [1, 7, -3, 300])
def test_rerotated_keys_equal_keys_recomputed_at_the_new_positions(model, delta):
    attn = model.layers[0].attn
    L = 37  # odd
    x = torch.randn(1, L, model.cfg.dim, generator=torch.Generator().manual_seed(delta + 10))

    def keys(p):  # the layer's keys for hidden input x at positions p, as Attention.forward computes them
        k = attn.k_norm(attn.wk(x).view(1, L, attn.n_kv, attn.head_dim).transpose(1, 2))
        return apply_rope(k, model.rope_cos[p][None, None], model.rope_sin[p][None, None])

    old = torch.arange(20, 20 + L)
    new = old + delta
    torch.testing.assert_close(
        rerotate(keys(old), model.rope_cos, model.rope_sin, old, new), keys(new), atol=2e-5, rtol=1e-5
    )
    mixed = old + torch.arange(L) % 5 - 2  # a delta per row, some zero
    torch.testing.assert_close(
        rerotate(keys(old), model.rope_cos, model.rope_sin, old, mixed), keys(mixed), atol=2e-5, rtol=1e-5
    )


def test_a_shifted_suffix_reuses_its_keys_rotated_to_the_new_positions(model, monkeypatch):
    """Two tokens typed: the suffix moves right by two. Layer 0's K/V depend only on token and
    position, so there the reused rows must equal a full recompute's at the new positions; deeper
    layers saw the old neighbours (the approximation)."""
    prefix, suffix = _ids(20, 50), _ids(21, 30)
    store = ReuseCache()
    recorded = {}
    inner = reuse.forward_first

    def spy(m, c):  # which buffer rows the reusing forward took from the entry (its plan)
        plans = []
        real_plan = store.plan

        def plan(*a, **kw):
            p, why = real_plan(*a, **kw)
            plans.append(p)
            return p, why

        monkeypatch.setattr(store, "plan", plan)
        out = inner(m, c)
        monkeypatch.setattr(store, "plan", real_plan)
        recorded[id(c)] = plans[0]
        return out

    monkeypatch.setattr(reuse, "forward_first", spy)
    c0 = _keyed(model, prefix[:48], suffix, ON, store)
    fwd.forward(model, [c0])
    c1 = _keyed(model, prefix, suffix, ON, store)
    fwd.forward(model, [c1])
    full = build_canvas(prefix, suffix, 8, model.cfg, ON)
    fwd.forward(model, [full])
    p = recorded[id(c1)]
    assert c1.reused == 48 + 30 and p.run_rows.tolist() == [48, 49] and p.changed == 2
    pos, _ = reuse.context_rows(c1)
    full_pos = reuse.context_rows(full)[0].tolist()
    at = torch.tensor([full_pos.index(int(q)) for q in pos[p.new_rows]])  # the reused rows in the full context
    R = c1.reused
    for layer, close in ((0, True), (1, False)):
        k1, v1 = c1.kv[layer][0][0, :, :R], c1.kv[layer][1][0, :, :R]
        kf, vf = full.kv[layer][0][0, :, at], full.kv[layer][1][0, :, at]
        if close:
            torch.testing.assert_close(k1, kf, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(v1, vf, atol=2e-5, rtol=1e-5)
        else:  # the suffix's deeper K/V saw two tokens fewer: they differ (that is why reuse is approximate)
            assert (k1[:, 48:] - kf[:, 48:]).abs().max() > 1e-4
    # the recomputed rows (the two typed tokens) sit after the reused ones, equal to the full forward's at layer 0
    new_at = torch.tensor([full_pos.index(48), full_pos.index(49)])
    torch.testing.assert_close(c1.kv[0][0][0, :, R : R + 2], full.kv[0][0][0, :, new_at], atol=2e-5, rtol=1e-5)
    # the entry keeps every reused key as computed, with the position it is rotated for
    e = store.get("doc")
    assert e.kpos[:50].tolist() == list(range(50))
    assert torch.equal(e.kpos[50:], reuse.context_rows(c0)[0][48:])  # the suffix's keys: still for their old positions


# ---------------------------------------------------------------- matching and the staleness policy


def test_segments_cut_index_tensors_into_slices():
    t = torch.tensor
    assert segments(t([], dtype=torch.long)) == []
    assert segments(t([7])) == [(7, 1)]
    assert segments(t([0, 1, 2, 5, 6, 9])) == [(0, 3), (5, 2), (9, 1)]
    # pairs: a piece ends where either stops counting up by one
    assert segments(t([0, 1, 2, 3, 4]), t([3, 4, 5, 9, 10])) == [(0, 3, 3), (3, 9, 2)]
    new, old = t([0, 1, 2, 3, 10, 11, 12]), t([1, 2, 3, 4, 12, 13, 14])
    rows = torch.zeros(15)
    rows[old] = torch.arange(7.0) + 1
    got = torch.zeros(15)
    for n0, o0, ln in segments(new, old):
        got[n0 : n0 + ln] = rows[o0 : o0 + ln]
    want = torch.zeros(15)
    want[new] = rows[old]
    assert torch.equal(got, want)


def test_best_run_finds_the_unchanged_tokens_on_their_diagonal():
    t = torch.tensor
    old = t(_ids(30, 40))
    assert best_run(old, old) == (0, 40, 0)
    assert best_run(t(old.tolist()[:39] + [7]), old) == (0, 39, 0)  # the last token changed
    assert best_run(t(old.tolist()[3:] + [5, 6]), old) == (0, 37, 3)  # the head cut by three (the window slid)
    assert best_run(t([9, 9] + old.tolist()), old) == (2, 42, -2)  # two tokens more before it
    assert best_run(t([]), old) == (0, 0, 0) and best_run(t([1, 1]), t([2, 2])) == (0, 0, 0)


def test_best_run_searching_near_diagonals_first_gives_the_whole_search_answer():
    # the near-first shortcut must never change the answer: against the search of every diagonal at
    # once (near = max_shift), on edits near and far, shifts past `near`, repeats and short texts
    g = torch.Generator().manual_seed(3)
    for trial in range(400):
        vocab = 3 if trial % 4 == 0 else 50  # few distinct tokens: many equal runs on many diagonals
        old = torch.randint(0, vocab, (int(torch.randint(0, 90, (1,), generator=g)),), generator=g)
        new = old.clone()
        shift = int(torch.randint(-12, 13, (1,), generator=g))
        new = new[shift:] if shift > 0 else torch.cat([torch.randint(0, vocab, (-shift,), generator=g), new])
        for _ in range(int(torch.randint(0, 4, (1,), generator=g))):  # a few edits anywhere
            if new.numel():
                new[int(torch.randint(0, new.numel(), (1,), generator=g))] = int(
                    torch.randint(0, vocab, (1,), generator=g)
                )
        for ms in (4, 16, 64):
            assert best_run(new, old, ms) == best_run(new, old, ms, near=ms), (trial, ms)


def test_a_full_recompute_once_the_changed_tokens_pass_the_budget(model):
    prefix, suffix = _ids(40, 60), _ids(41, 20)
    opts = dataclasses.replace(ON, reuse_budget=6)
    store = ReuseCache()
    stale, reused = [], []
    for k in range(12):  # one token appended at the cursor per keystroke: one changed token each
        c = _keyed(model, prefix[: 40 + k], suffix, opts, store)
        got = sampler.fill(model, c)
        stale.append(store.get("doc").stale)
        reused.append(c.reused > 0)
        if k == 7:  # the budget's full recompute is today's fill, row for row
            plain = build_canvas(prefix[: 40 + k], suffix, 8, model.cfg, opts)
            assert got.ids == sampler.fill(model, plain).ids and c.rows_forwarded == plain.rows_forwarded
    assert stale == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]
    assert reused == [False] + [True] * 6 + [False] + [True] * 4
    assert store.stats["full_new"] == 1 and store.stats["full_stale"] == 1 and store.stats["reused"] == 10


def test_a_cursor_jump_another_text_or_another_model_recompute_in_full(model):
    prefix, suffix = _ids(50, 80), _ids(51, 20)
    store = ReuseCache()

    def outcome(p, s, opts=ON):
        before = dict(store.stats)
        c = _keyed(model, p, s, opts, store)
        fwd.forward(model, [c])
        (why,) = [k for k in ReuseCache.OUTCOMES if store.stats[k] > before[k]]
        assert (c.reused > 0) == (why == "reused")
        return why

    assert outcome(prefix, suffix) == "full_new"
    assert outcome(prefix[:75], prefix[75:] + suffix) == "reused"  # the cursor five tokens back: 10 changed
    assert outcome(prefix[:30], prefix[30:] + suffix) == "full_jump"  # 45 tokens back: a jump
    assert outcome(prefix, suffix) == "full_jump"  # and forward again
    assert outcome(prefix, suffix) == "reused"
    assert (
        outcome(prefix[:10] + _ids(52, 40) + prefix[10:], suffix) == "full_jump"
    )  # 40 tokens pasted before the cursor
    assert outcome(_ids(53, 80), _ids(54, 20)) == "full_jump"  # another text under the same key
    # options that steer only the steps keep the entry (a hole kind changing while typing)
    assert outcome(_ids(53, 80), _ids(54, 20), dataclasses.replace(ON, threshold=0.6, stop_newline=True)) == "reused"
    other = copy.deepcopy(model)  # another model under the same key: its K/V are not these
    before = dict(store.stats)
    fwd.forward(other, [_keyed(other, _ids(53, 80), _ids(54, 20), ON, store)])
    assert store.stats["full_model"] == before["full_model"] + 1
    assert outcome(_ids(53, 80), _ids(54, 20)) == "full_model"  # and back


def test_a_sliding_window_shifts_the_prefix_and_counts_what_it_dropped(model):
    """A prefix longer than its room loses a head token per token typed: its rows move left by one
    (re-rotated), the dropped row and the typed one count as changed."""
    doc, suffix = _ids(60, 140), _ids(61, 10)
    store = ReuseCache()
    stale = []
    for k in range(4):
        c = _keyed(model, doc[: 120 + k], suffix, ON, store, context_tokens=96)
        fwd.forward(model, [c])
        assert c.start == 96 - 8 - 10  # the prefix is cut to its room: the window slides
        stale.append(store.get("doc").stale)
        assert (c.reused > 0) == (k > 0)
    assert stale == [0, 2, 4, 6]


# ---------------------------------------------------------------- work per keystroke, failures


def test_a_keystroke_forwards_only_the_changed_tokens_and_the_canvas(svc, monkeypatch):
    plain_rows = []
    for k in range(5):
        seen = _spy(svc, monkeypatch)
        f = svc.run_now(_job(k, "typed-doc"))
        monkeypatch.undo()
        plain_seen = _spy(svc, monkeypatch)
        plain = svc.run_now(_job(k, None))
        monkeypatch.undo()
        canvas_rows = plain_seen[0]  # a full forward runs the whole canvas
        plain_rows.append(plain.forwarded_tokens)
        assert f.forwarded_tokens == sum(seen) and plain.forwarded_tokens == sum(plain_seen)
        if k == 0:
            assert f.reused_tokens == 0 and seen[0] == canvas_rows
            continue
        ctx = svc._reuse.get("typed-doc").ids.shape[0]
        assert f.reused_tokens >= ctx - 3  # one character changes a token or two of the context
        assert seen[0] == canvas_rows - f.reused_tokens  # the first forward: changed rows + the canvas
        assert f.recompute_tokens == f.forwarded_tokens + f.reused_tokens
        assert f.forwarded_tokens * 3 < plain.forwarded_tokens


def test_a_failed_or_cancelled_request_leaves_the_session_whole(svc, monkeypatch):
    key, slow = "fragile-doc", dataclasses.replace(ON, threshold=0.999)  # a slot a step: cancellable
    svc.run_now(_job(0, key, slow))
    e0 = svc._reuse.get(key)
    snapshot = [(k.clone(), v.clone()) for k, v in e0.layers()]
    ids0 = e0.ids.clone()

    def untouched():
        assert all(torch.equal(k, a) and torch.equal(v, b) for (k, v), (a, b) in zip(e0.layers(), snapshot))
        assert torch.equal(e0.ids, ids0)

    # the reusing forward fails: the job fails alone, the entry stays as it was
    def broken(*a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(svc.model, "hidden", broken)
    with pytest.raises(EngineError, match="boom"):
        svc.run_now(_job(1, key, slow))
    monkeypatch.undo()
    assert svc._reuse.get(key) is e0
    untouched()
    # cancelled before its first step: nothing ran, the entry stays
    j = _job(2, key, slow)
    j.cancel()
    assert svc.run_now(j).cancelled and svc._reuse.get(key) is e0
    # cancelled right after its first forward: the entry is that request's context, whole
    j = _job(12, key, slow)  # "self.x =" typed: the context changed
    _spy(svc, monkeypatch, after_first=j.cancel)
    f = svc.run_now(j)
    monkeypatch.undo()
    assert f.cancelled and f.reused_tokens > 0
    e = svc._reuse.get(key)
    assert e is not e0 and e.stale > 0
    n = e.ids.shape[0]
    assert e.pos.shape[0] == e.kpos.shape[0] == n and all(k.shape[2] == v.shape[2] == n for k, v in e.layers())
    untouched()  # the old entry's tensors were never written: the new one shares no buffer with it
    again = svc.run_now(_job(12, key, slow))  # the same request again: every context row reused
    assert again.reused_tokens == n and svc._reuse.get(key).stale == e.stale


def test_deleting_more_than_the_jump_before_the_cursor_is_a_jump(model):
    prefix, suffix = _ids(70, 90), _ids(71, 20)
    store = ReuseCache()
    for p, want in ((prefix, "full_new"), (prefix[:85], "reused"), (prefix[:50], "full_jump")):
        before = dict(store.stats)
        fwd.forward(model, [_keyed(model, p, suffix, dataclasses.replace(ON, reuse_budget=1000), store)])
        assert store.stats[want] == before[want] + 1, want


def test_reuse_is_on_by_default():
    """Default since session 8: the 1,000-hole eval (dlm-lsp eval --reuse-typing 8) held."""
    assert DecodeOptions().reuse is True and DecodeOptions().reuse_budget == 32


class _NanEmpty:
    """engine.decode.reuse's `torch`, whose `empty` gives NaN-filled memory: a row read before it is
    written poisons what reads it (even under a mask: 0 * NaN), as uninitialised memory may."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(shape, **kw):
        return torch.full(shape, float("nan"), **kw)


@pytest.mark.parametrize("poisoned", [False, True], ids=["plain", "nan-memory"])
def test_several_sessions_reuse_in_one_forward_as_each_alone(model, poisoned, monkeypatch):
    """Keystrokes in three documents at once (two reuse, one misses): the reusing first forwards run
    in one forward, each attending only to its own rows, and give what each gives alone: the same
    hidden states and context K/V to rounding, the same entries, and the same fills. With NaN for
    fresh memory, no row is read before it is written (the batch buffer's unused rows were read under
    the mask from uninitialised memory: NaN in one clean CI run, session 28)."""
    if poisoned:
        monkeypatch.setattr(reuse, "torch", _NanEmpty())
    docs = [(_ids(30 + d, 50 + 7 * d), _ids(40 + d, 12 + d)) for d in range(3)]
    typed = [(p + [7], s) for p, s in docs]  # one more token at each cursor

    def keystroke(batched: bool):
        store = ReuseCache()
        for d, (p, s) in enumerate(docs[:2]):  # the third document has no entry: a miss
            fwd.forward(model, [_keyed(model, p, s, ON, store, key=f"doc{d}")])
        cs = [_keyed(model, p, s, ON, store, key=f"doc{d}", n=6 + 2 * d) for d, (p, s) in enumerate(typed)]
        rows = reuse.forward_first_batch(model, cs) if batched else [reuse.forward_first(model, c) for c in cs]
        return store, cs, rows

    (s1, alone, r1), (s2, together, r2) = keystroke(False), keystroke(True)
    assert [c.reused > 0 for c in together] == [True, True, False]
    for a, b, (ha, pa), (hb, pb) in zip(alone, together, r1, r2):
        assert (a.reused, a.ctx_len, a.rows_forwarded) == (b.reused, b.ctx_len, b.rows_forwarded)
        assert torch.equal(pa, pb)
        torch.testing.assert_close(ha, hb, atol=1e-5, rtol=1e-5)
        for (ka, va), (kb, vb) in zip(a.kv, b.kv):
            torch.testing.assert_close(ka[..., : a.ctx_len, :], kb[..., : a.ctx_len, :], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(va[..., : a.ctx_len, :], vb[..., : a.ctx_len, :], atol=1e-5, rtol=1e-5)
    for key in ("doc0", "doc1", "doc2"):
        ea, eb = s1.get(key), s2.get(key)
        assert ea is not None and eb is not None
        assert torch.equal(ea.ids, eb.ids) and torch.equal(ea.kpos, eb.kpos) and ea.stale == eb.stale
        torch.testing.assert_close(ea.kv, eb.kv, atol=1e-5, rtol=1e-5)
    for a, b in zip(alone, together):  # and the fills from there
        assert sampler.fill(model, a).ids == sampler.fill(model, b).ids
