"""Recipe (c), causal diffusion with reordering (engine/decode/reorder.py): the training layout, the exact
cached decode against the full-recompute oracle, the engine's semantics on it (deadline, cancel,
healing, batching), per-keystroke reuse, and a smoke training run the engine then serves."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch

from engine.api import DecodeOptions, FillJob
from engine.decode import forward as fwd
from engine.decode import reorder, sampler
from engine.decode.cache import BatchContext
from engine.decode.forward import build_canvas
from engine.decode.reference import reference_fill
from engine.decode.sampler import fill
from engine.model.config import ConfigError, ModelConfig
from engine.train import reorder as reorder_objective
from engine.train.objective import SpecialIds
from tests.engine_models import peaked_model

PAD = 249  # a token the peaked seed-0 model predicts often: padding and early ends happen on the oracle's path


def _io(seed: int, n_prefix: int = 13, n_suffix: int = 6):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(4, 300, (n_prefix,), generator=g).tolist(),
        torch.randint(4, 300, (n_suffix,), generator=g).tolist(),
    )


def _reorder_model(seed: int = 0):
    m = peaked_model(causal=True, seed=seed, pad=PAD)
    m.cfg.canvas = "reorder"
    m.cfg.validate()
    return m


@pytest.fixture(scope="module")
def models():
    # seed 1's fills also depend on the order of a step's commits in the cache (seed 0's do not)
    return {seed: _reorder_model(seed) for seed in (0, 1)}


@pytest.fixture(scope="module")
def model(models):
    return models[0]


# ---------------------------------------------------------------- config


def test_config_canvas_needs_causal_unshifted_attention():
    assert ModelConfig.from_dict({"attention": "causal", "canvas": "reorder"}).canvas == "reorder"
    assert ModelConfig.from_dict({}).canvas is None
    for bad in (
        {"canvas": "reorder"},
        {"attention": "causal", "canvas": "reorder", "logits_shift": True},
        {"attention": "causal", "canvas": "sideways"},
    ):
        with pytest.raises(ConfigError, match="canvas"):
            ModelConfig.from_dict(bad)


# ---------------------------------------------------------------- the objective

IDS = SpecialIds(mask=2, pad=0, eos=1)


def _logical(ex):
    """The example put back in logical order, with every masked row's target in place."""
    seq = [None] * len(ex.ids)
    for i, t, p in zip(ex.ids, ex.targets, ex.pos):
        seq[p] = t if i == IDS.mask else i
    return seq


def test_window_example_puts_unmasked_rows_first_at_their_positions():
    stream = list(range(10, 210))
    for seed in range(20):
        ex = reorder_objective.window_example(stream, 64, IDS, random.Random(seed))
        assert sorted(ex.pos) == list(range(64))
        masked = [i == IDS.mask for i in ex.ids]
        k = masked.index(True)
        assert not any(masked[:k]) and all(masked[k:])  # observed first, masks last
        assert ex.pos[:k] == sorted(ex.pos[:k]) and ex.pos[k:] == sorted(ex.pos[k:])  # logical order in each
        seq = _logical(ex)
        assert seq == stream[seq[0] - 10 : seq[0] - 10 + 64]  # the window, contiguous
        assert all((t >= 0) == m for t, m in zip(ex.targets, masked))  # loss on masked rows only, no shift
        w = {round(x, 9) for x, m in zip(ex.weight, masked) if m}
        assert len(w) == 1  # 1 / (t * L) on every masked row


@pytest.mark.parametrize("holes", [1, 4])
def test_infill_example_layout(holes):
    from engine.tokenizer import EOS, MASK, train_bpe
    from engine.tokenizer import PAD as PAD_T
    from tests.tiny import CORPUS

    tok = train_bpe(CORPUS, 300)
    ids = SpecialIds(mask=tok.token_id(MASK), pad=tok.token_id(PAD_T), eos=tok.token_id(EOS))
    text = "".join(CORPUS[:8]) * 3
    seen_revealed = seen_steps = 0
    for seed in range(30):
        ex = reorder_objective.infill_example(text, tok, 128, ids, random.Random(seed), holes=holes, ordered=0.5)
        if ex is None:
            continue
        L = len(ex.ids)
        assert L <= 128 and sorted(ex.pos) == list(range(L))
        masked = [i == ids.mask for i in ex.ids]
        k = masked.index(True)
        assert not any(masked[:k]) and all(masked[k:]) and ex.pos[k:] == sorted(ex.pos[k:])
        assert all((t >= 0) == m for t, m in zip(ex.targets, masked))
        slots = {p for p, m in zip(ex.pos, masked) if m}
        # the observed rows: clean text first (logical order), then the revealed slots (logical order)
        clean = [r for r in range(k) if ex.weight[r] == 0.0]
        revealed = [r for r in range(k) if ex.weight[r] != 0.0]
        assert clean == list(range(len(clean))) and ex.pos[: len(clean)] == sorted(ex.pos[: len(clean)])
        assert revealed == list(range(len(clean), k))
        rp = ex.pos[len(clean) : k]  # in up to REVEAL_STEPS groups (decode steps), each in logical order
        descents = sum(b < a for a, b in zip(rp, rp[1:]))
        assert descents < reorder_objective.REVEAL_STEPS
        seen_revealed += bool(revealed)
        seen_steps += descents > 0
        if holes == 1:  # [prefix][suffix]: the canvas's slots are one gap in the clean rows' positions
            cp = ex.pos[: len(clean)]
            gaps = [b - a for a, b in zip(cp, cp[1:]) if b - a > 1]
            canvas = sorted(slots | {ex.pos[r] for r in revealed})
            assert canvas == list(range(canvas[0], canvas[-1] + 1))
            assert len(gaps) <= 1 and (not gaps or gaps[0] == len(canvas) + 1)
        seq = _logical(ex)
        assert tok.decode([t for t in seq if t != ids.pad]) in text  # the logical text is the source's
    assert seen_revealed and seen_steps


def test_auxiliary_next_token_targets_never_see_their_answer():
    ids, tgt = [5, 6, 2, 7, 8, 9, 2, 2, 10], [-1, -1, 11, -1, -1, -1, 12, 13, -1]
    groups = [0, 0, 2, 0, 1, 1, 2, 2, 0]
    ex = reorder_objective.layout(
        ids, tgt, [0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0], groups, mask_id=2, ar_weight=0.6
    )
    assert ex.pos == [0, 1, 3, 8, 4, 5, 2, 6, 7]
    phys = {p: r for r, p in enumerate(ex.pos)}
    ar = {ex.pos[r]: (t, w) for r, (i, t, w) in enumerate(zip(ex.ids, ex.targets, ex.weight)) if i != 2 and t >= 0}
    # 0->1, 3->4 (4 is a later row), 4->5; never 8 (no successor) nor 5->6 (a mask); 1->2 is a mask
    assert sorted(ar) == [0, 3, 4]
    assert all(t == ids[p + 1] and phys[p + 1] > phys[p] for p, (t, _) in ar.items())
    assert abs(sum(w for _, w in ar.values()) - 0.6) < 1e-9
    assert [t for i, t in zip(ex.ids, ex.targets) if i == 2] == [11, 12, 13]  # the masks keep their own targets
    off = reorder_objective.layout(ids, tgt, [0.0] * 9, groups, mask_id=2)
    assert all(t < 0 for i, t in zip(off.ids, off.targets) if i != 2)


def test_collate_carries_logical_positions():
    a = reorder_objective.layout([5, 2, 6], [-1, 7, -1], [0, 1, 0], [0, 2, 0], 2)
    b = reorder_objective.layout([5, 2], [-1, 8], [0, 1], [0, 2], 2)
    batch = reorder_objective.collate_reorder([a, b], pad_id=0)
    assert batch["pos"].tolist() == [[0, 2, 1], [0, 1, 0]]
    assert batch["ids"].tolist() == [[5, 6, 2], [5, 2, 0]] and batch["key_valid"][1].tolist() == [True, True, False]


def test_the_layout_matters(model):
    """Guards the objective and the decode: the same rows at physical instead of logical positions, or
    in logical instead of physical order, give other logits at the masked slots."""
    prefix, suffix = _io(3)
    n = 5
    ctx = prefix + suffix
    ids = torch.tensor([ctx + [model.cfg.mask_token_id] * n])
    logical = torch.tensor([list(range(13)) + list(range(13 + n, 13 + n + 6)) + list(range(13, 13 + n))])
    right = model(ids, pos=logical)[0, -n:]
    assert not torch.allclose(right, model(ids)[0, -n:], atol=1e-3)  # positions 0..L-1 in physical order
    in_place = torch.tensor([prefix + [model.cfg.mask_token_id] * n + suffix])
    assert not torch.allclose(right, model(in_place)[0, 13 : 13 + n], atol=1e-3)  # slots in place, causal
    assert torch.allclose(right, reorder.reference_logits(model, in_place[0].tolist(), 13, n, [])[13 : 13 + n])


# ---------------------------------------------------------------- decoding: cached == oracle

CASES = list(itertools.product(("threshold", "topk"), (False, True), (0, 3), (False, True)))


@pytest.mark.parametrize(
    "sel,cache,window,pad_left",
    CASES,
    ids=[f"{s}-{'cache' if c else 'nocache'}-w{w}{'-padleft' if p else ''}" for s, c, w, p in CASES],
)
def test_cached_decode_matches_oracle(models, sel, cache, window, pad_left):
    for model, (seed, n, pad_stop) in itertools.product(
        models.values(), ((0, 3, 0.9), (1, 7, 0.3), (2, 12, 0.9), (3, 9, 0.3))
    ):
        prefix, suffix = _io(seed)
        o = DecodeOptions(
            selection=sel, threshold=0.5, pad_stop=pad_stop, cache=cache, window=window, pad_left=pad_left
        )
        want = reference_fill(model, prefix, suffix, n, o)
        c = build_canvas(prefix, suffix, n, model.cfg, o)
        got = fill(model, c)
        assert isinstance(c, reorder.ReorderCanvas)
        assert got.ids == want, f"seed {seed}: cached {got.ids} != oracle {want} (steps {got.tokens_per_step})"
        assert sum(got.tokens_per_step) == n and not got.cancelled and not got.deadline_hit


def test_semi_ar_blocks_and_margin_confidence_match_oracle(models):
    for model, seed in itertools.product(models.values(), (4, 5)):
        prefix, suffix = _io(seed)
        for o in (
            DecodeOptions(threshold=0.5, block=2, window=0, pad_left=False),
            DecodeOptions(confidence="margin", threshold=0.3, pad_stop=0.3),
        ):
            assert fill(model, build_canvas(prefix, suffix, 9, model.cfg, o)).ids == reference_fill(
                model, prefix, suffix, 9, o
            )


def test_oracle_cases_commit_out_of_order_and_in_parallel(model):
    """Guards the oracle test: fills commit several slots in a step, commit a slot right of a masked
    one (so the cache order is not the logical order), and end early on padding."""
    parallel = out_of_order = early = 0
    for seed, n in itertools.product(range(4), (7, 12)):
        prefix, suffix = _io(seed)
        for o in (DecodeOptions(threshold=0.5, pad_left=False, window=0), DecodeOptions(threshold=0.5, pad_stop=0.3)):
            c = build_canvas(prefix, suffix, n, model.cfg, o)
            r = fill(model, c)
            parallel += max(r.tokens_per_step) > 1
            early += len(r.ids) < n
            out_of_order += c.cache_order != sorted(c.cache_order)
    assert parallel and out_of_order and early


def test_committed_slots_kv_are_exact(model):
    """After some cached steps the canvas's cache equals the K/V of one full forward over the same
    reordered rows (context, then the committed slots in cache order)."""
    prefix, suffix = _io(5, n_prefix=20)
    c = build_canvas(
        prefix, suffix, 10, model.cfg, DecodeOptions(selection="topk", steps=5, pad_stop=2.0, pad_left=False)
    )
    for _ in range(3):
        sampler.step(model, [c])
    with torch.inference_mode():
        fwd.forward(model, [c])  # the last step's commits join the cache
    ctx_ids, ctx_pos = c.context_rows()
    slots = torch.tensor(c.cache_order) + c.start
    ids, pos = torch.cat([ctx_ids, c.ids[slots]]), torch.cat([ctx_pos, slots])
    _, kvs = model.hidden(ids[None], pos=pos[None], return_kv=True)
    assert c.ctx_len == ids.shape[0] and len(c.cache_order) == 6
    for (kb, vb), (k, v) in zip(c.kv, kvs):
        torch.testing.assert_close(kb[:, :, : c.ctx_len], k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vb[:, :, : c.ctx_len], v, atol=1e-5, rtol=1e-5)


def test_cached_steps_forward_only_new_commits_and_masks(model):
    prefix, suffix = _io(6, n_prefix=30, n_suffix=10)
    seen = []
    orig = model.hidden

    def spy(ids, *a, **kw):
        seen.append(ids.shape[1])
        return orig(ids, *a, **kw)

    c = build_canvas(prefix, suffix, 8, model.cfg, DecodeOptions(selection="topk", steps=4, pad_stop=2.0, window=0))
    model.hidden = spy
    try:
        fill(model, c)
    finally:
        del model.hidden
    assert seen[0] == 30 + 10 + 8  # the context and every mask, once
    assert seen[1:] == [2 + 6, 2 + 4, 2 + 2]  # then 2 commits a step: the last step's, plus the masks left


def test_empty_context_decodes_causally(model):
    """No prefix and no suffix: the cached steps have an empty context and must still be causal."""
    for o in (DecodeOptions(threshold=0.5, window=0), DecodeOptions(selection="topk", steps=3, pad_stop=2.0, window=2)):
        assert fill(model, build_canvas([], [], 6, model.cfg, o)).ids == reference_fill(model, [], [], 6, o)


# ---------------------------------------------------------------- the engine's semantics


def test_deadline_commits_everything_and_cancel_stops(model):
    prefix, suffix = _io(7)
    c = build_canvas(prefix, suffix, 9, model.cfg, DecodeOptions(selection="topk", steps=9, pad_stop=2.0))
    r = fill(model, c, deadline=time.monotonic() - 1)
    assert r.steps == 1 and r.deadline_hit and r.tokens_per_step == [9] and not bool(c.masked.any())
    assert r.ids == reference_fill(model, prefix, suffix, 9, DecodeOptions(steps=1, pad_stop=2.0))
    c = build_canvas(prefix, suffix, 9, model.cfg, DecodeOptions(selection="topk", steps=9, pad_stop=2.0))
    r = fill(model, c, cancelled=lambda: c.steps >= 2)
    assert r.cancelled and r.steps == 2 and int(c.masked.sum()) == 7
    # a step budget: the last step commits every mask (the window is lifted for it)
    r = fill(model, build_canvas(prefix, suffix, 12, model.cfg, DecodeOptions(steps=2, threshold=0.99, window=3)))
    assert r.steps <= 2 and sum(r.tokens_per_step) == 12
    assert 0 < r.confidence <= 1


def test_healing_restricts_slot_0(model):
    cfg = model.cfg
    for seed, window, cache in itertools.product((7, 9, 11), (0, 3), (False, True)):
        prefix, suffix = _io(seed)
        heal = [i for i in _io(seed + 1000, n_prefix=8)[0] if i not in (cfg.pad_token_id, cfg.eos_token_id)][:6]
        free = reference_fill(model, prefix, suffix, 6, DecodeOptions(threshold=0.5))
        then = {free[0]: _io(seed + 3000, n_prefix=6)[0]} if free and free[0] not in (PAD, cfg.eos_token_id) else {}
        heal = sorted(set(heal) | set(then))
        o = DecodeOptions(threshold=0.5, window=window, cache=cache)
        want = reference_fill(model, prefix, suffix, 6, o, heal=heal, heal_then=then)
        c = build_canvas(prefix, suffix, 6, cfg, o, heal=heal, heal_then=then)
        got = fill(model, c)
        assert got.ids == want and got.ids[0] in heal and not c.heal_open
        if got.ids[0] in then:
            assert got.ids[1] in then[got.ids[0]]


def test_batched_steps_equal_each_alone(model):
    jobs = [(_io(60 + i, n_prefix=9 + 5 * i, n_suffix=2 * i), n) for i, n in enumerate((5, 8, 11))]
    for o in (DecodeOptions(threshold=0.5, window=3), DecodeOptions(selection="topk", pad_stop=2.0, pad_left=False)):
        alone = [fill(model, build_canvas(p, s, n, model.cfg, o)).ids for (p, s), n in jobs]
        canvases = [build_canvas(p, s, n, model.cfg, o) for (p, s), n in jobs]
        ctx = BatchContext()
        while any(not c.done for c in canvases):
            sampler.step(model, [c for c in canvases if not c.done], batch_ctx=ctx)
        assert [c.fill_ids() for c in canvases] == alone


# ---------------------------------------------------------------- per-keystroke reuse


def test_session_reuse_equals_full_recompute_over_typed_keystrokes(model):
    """Typing one token at a time at the cursor (and once deleting two): with a session, each fill
    reuses the context K/V up to its first changed row and equals the fill without reuse."""
    prefix, suffix = _io(40, n_prefix=60, n_suffix=12)
    typed = _io(41, n_prefix=8)[0]
    sessions = reorder.SessionCache()
    seqs = [prefix[: 40 + k] for k in range(6)] + [prefix[:43], prefix[:43] + typed[:3]]
    o = DecodeOptions(threshold=0.5)
    reused = []
    for p in seqs:
        c = build_canvas(p, suffix, 8, model.cfg, o)
        c.session, c.session_key = sessions, "doc"
        got = fill(model, c)
        assert got.ids == fill(model, build_canvas(p, suffix, 8, model.cfg, o)).ids
        assert got.ids == reference_fill(model, p, suffix, 8, o)
        reused.append(c.reused)
    # each keystroke reuses the unchanged prefix (the suffix moved: its positions follow the prefix)
    assert reused == [0, 40, 41, 42, 43, 44, 43, 43]
    # a prefix longer than its room is cut in whole chunks: the cut stays put while typing, reuse goes on
    doc = _io(42, n_prefix=200)[0]
    hits = 0
    for k in range(10):
        c = build_canvas(doc[: 150 + 3 * k], suffix, 8, model.cfg, o, context_tokens=128)
        c.session, c.session_key = sessions, "long"
        got = fill(model, c)
        assert got.ids == reference_fill(model, doc[: 150 + 3 * k], suffix, 8, o, context_tokens=128)
        assert c.start <= 128 - 8 - 12 and c.start > 128 - 8 - 12 - reorder.CUT_CHUNK
        hits += c.reused > 0
    assert hits >= 7
    other = build_canvas(suffix, prefix, 8, model.cfg, o)
    other.session, other.session_key = sessions, "other document"
    fill(model, other)
    assert other.reused == 0 and sessions.stats["hits"] == 7 + hits


# ---------------------------------------------------------------- training, then serving


def test_smoke_training_run_writes_a_checkpoint_the_engine_serves(tmp_path):
    from engine.serve.service import EngineService
    from engine.train.loop import TrainArgs, train
    from engine.weights.load import load_checkpoint
    from tests.tiny import CORPUS, make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(CORPUS[:4] * 3):
        (src / f"m{i}.py").write_text(text * 8)
    args = TrainArgs(
        out=str(tmp_path / "run"),
        objective="reorder",
        holes=4,
        max_files=10,
        max_steps=5,
        batch=2,
        sources=[str(src)],
        stdlib=False,
        seq_len=128,
        dim=32,
        n_layers=2,
        n_heads=2,
        ffn_dim=64,
        tokenizer=str(tiny),
        val_examples=16,
        progress=False,
        minutes=5,
        reorder_ar=0.5,
    )
    out = train(args)
    _, _, cfg = load_checkpoint(out / "best")
    assert cfg.canvas == "reorder" and cfg.attention == "causal"
    svc = EngineService(str(out / "best"), device="cpu", threads=1)
    svc.load()
    assert isinstance(svc.cfg, ModelConfig) and svc.cfg.canvas == "reorder"
    jobs = [
        FillJob(prefix="def add(a, b):\n    return", suffix="\n", max_tokens=8),
        FillJob(prefix="import os\nimport", max_tokens=5, options=DecodeOptions(window=2)),
    ]
    one = [svc.run_now(j) for j in jobs]
    assert all(f.steps >= 1 and f.slots >= 5 for f in one)
    # per-keystroke reuse through the service: a typed sequence with a session key fills as without
    text = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x"
    typed = [FillJob(prefix=text[: len(text) - 12 + k], suffix="\n", max_tokens=6) for k in range(12)]
    plain = [svc.run_now(j).token_ids for j in typed]
    keyed = [svc.run_now(FillJob(prefix=j.prefix, suffix=j.suffix, max_tokens=6, session="doc")) for j in typed]
    assert [f.token_ids for f in keyed] == plain and svc._sessions.stats["hits"] >= 10
    assert keyed[0].reused_tokens == 0 and sum(f.reused_tokens > 0 for f in keyed) >= 10
    svc.start()  # the worker batches jobs submitted together
    try:
        futs = [
            svc.submit(FillJob(prefix=j.prefix, suffix=j.suffix, max_tokens=j.max_tokens, options=j.options))
            for j in jobs
        ]
        assert [f.result(timeout=60).token_ids for f in futs] == [f.token_ids for f in one]
    finally:
        svc.close()
    # an AR checkpoint resumes into recipe (c) unchanged; a bidirectional one is refused
    ar = train(TrainArgs(**{**args.__dict__, "out": str(tmp_path / "ar"), "objective": "ar", "max_steps": 1}))
    again = train(
        TrainArgs(**{**args.__dict__, "out": str(tmp_path / "c"), "resume": str(ar / "last"), "max_steps": 1})
    )
    assert load_checkpoint(again / "last")[2].canvas == "reorder"
    with pytest.raises(SystemExit, match="canvas"):
        train(TrainArgs(**{**args.__dict__, "out": str(tmp_path / "x"), "resume": str(tiny), "max_steps": 1}))


def test_session_key_crosses_the_engine_socket():
    from engine.clients.wire import job_from_message, job_message

    assert job_from_message(job_message(FillJob(prefix="x", session="file:///a.py"))).session == "file:///a.py"
    assert job_from_message(job_message(FillJob(prefix="x"))).session is None
    with pytest.raises(ValueError, match="session"):
        job_from_message({"prefix": "x", "session": 3})


# ---------------------------------------------------------------- per-keystroke reuse, counted


@pytest.fixture(scope="module")
def tiny_services(tmp_path_factory):
    """Services over tiny random checkpoints of both layouts (real tokenizer, real service path)."""
    from engine.serve.service import EngineService
    from tests.tiny import make_tiny_checkpoint

    out = {}
    for name, kw in (("reorder", dict(attention="causal", canvas="reorder")), ("bidirectional", {})):
        svc = EngineService(
            str(make_tiny_checkpoint(tmp_path_factory.mktemp(name) / "m", **kw)), device="cpu", threads=1
        )
        svc.load()
        out[name] = svc
    return out


def _counted(svc, monkeypatch, job: FillJob):
    """(the job's Fill, the rows model.hidden was given while it ran): the counter's oracle."""
    seen = []
    inner = type(svc.model).hidden.__get__(svc.model)

    def hidden(ids, *a, **kw):
        seen.append(ids.shape[0] * ids.shape[1])  # one job: batch 1, no padding
        return inner(ids, *a, **kw)

    monkeypatch.setattr(svc.model, "hidden", hidden)
    try:
        return svc.run_now(job), sum(seen)
    finally:
        monkeypatch.undo()


def _typed() -> str:
    from tests.tiny import CORPUS

    return "".join(dict.fromkeys(CORPUS)) * 2  # ~600 characters of code


TYPED = _typed()


def test_fill_counts_the_rows_it_forwards_and_what_reuse_saved(tiny_services, monkeypatch):
    svc = tiny_services["reorder"]
    cut = 300

    def job(k, session):
        return FillJob(prefix=TYPED[: cut + k], suffix=TYPED[cut + 20 : cut + 60], max_tokens=8, session=session)

    before = dict(svc.stats)
    first, rows = _counted(svc, monkeypatch, job(0, "doc"))
    assert first.reused_tokens == 0 and first.forwarded_tokens == rows == first.recompute_tokens > 0
    fills = [first]
    for k in (1, 2, 3):  # one character typed at the cursor, each a keystroke of the same document
        f, rows = _counted(svc, monkeypatch, job(k, "doc"))
        plain, plain_rows = _counted(svc, monkeypatch, job(k, None))  # the same job, no reuse
        assert f.forwarded_tokens == rows and plain.forwarded_tokens == plain_rows
        assert f.reused_tokens > 0 and plain.reused_tokens == 0
        assert f.forwarded_tokens < f.recompute_tokens == plain.forwarded_tokens == plain.recompute_tokens
        assert f.token_ids == plain.token_ids and f.steps == plain.steps
        fills += [f, plain]
    # nothing reusable: another document, or the cursor jumped to the start (every context row moved)
    for other in (job(3, "another document"), FillJob(prefix="", suffix=TYPED[:200], max_tokens=8, session="doc")):
        f, rows = _counted(svc, monkeypatch, other)
        plain, _ = _counted(svc, monkeypatch, FillJob(prefix=other.prefix, suffix=other.suffix, max_tokens=8))
        assert f.reused_tokens == 0 and f.forwarded_tokens == rows == f.recompute_tokens == plain.forwarded_tokens
        fills += [f, plain]
    assert svc.stats["forwarded_tokens"] - before["forwarded_tokens"] == sum(f.forwarded_tokens for f in fills)
    assert svc.stats["reused_tokens"] - before["reused_tokens"] == sum(f.reused_tokens for f in fills)


def test_a_bidirectional_fill_counts_its_rows_and_reuses_only_approximately(tiny_services, monkeypatch):
    """Exact reuse is the reorder layout's: a bidirectional model with DecodeOptions.reuse off never
    reuses; with it on (the default) its next keystroke reuses approximately (engine/decode/reuse.py)."""
    from engine.api import DecodeOptions

    svc = tiny_services["bidirectional"]
    for k in (0, 1):
        f, rows = _counted(
            svc,
            monkeypatch,
            FillJob(
                prefix=TYPED[: 300 + k], suffix="\n", max_tokens=8, session="doc", options=DecodeOptions(reuse=False)
            ),
        )
        assert f.reused_tokens == 0 and f.forwarded_tokens == rows == f.recompute_tokens
        assert f.forwarded_tokens > f.steps  # the first forward alone ran the whole canvas
    for k in (0, 1):
        f, rows = _counted(
            svc, monkeypatch, FillJob(prefix=TYPED[: 300 + k], suffix="\n", max_tokens=8, session="doc2")
        )
        assert f.forwarded_tokens == rows and f.recompute_tokens == rows + f.reused_tokens
        assert (f.reused_tokens > 0) == (k == 1)  # the second keystroke reuses the first one's context


def test_fill_row_counts_cross_the_engine_socket():
    import json

    from engine.api import Fill
    from engine.clients.wire import fill_from_message, fill_message

    f = Fill(text="x", tokens=1, steps=3, slots=8, reused_tokens=170, forwarded_tokens=42)
    back = fill_from_message(json.loads(json.dumps(fill_message(f))))
    assert (back.forwarded_tokens, back.reused_tokens, back.recompute_tokens) == (42, 170, 212)
