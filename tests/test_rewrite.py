"""engine/decode/rewrite.py and EngineService's EditJob: each approach's canvas on each topology (tiny
random models: bidirectional, shifted, block-causal with and without the shift, causal reordered;
tiny family checkpoints for Fast-dLLM v2, WeDLM and DreamOn), the surprise threshold's ends,
the edit memory forcing a substitution, cancel and deadline, and the service's queue."""

from __future__ import annotations

import dataclasses
import time

import pytest

from engine.api import DecodeOptions, EditJob, EngineError, FillJob, Rewrite
from engine.decode import rewrite as rw
from engine.decode import sampler
from engine.decode.rewrite import EditRun, rewrite
from engine.model.transformer import Transformer
from engine.serve.service import EngineService
from engine.weights.load import load_checkpoint
from tests.families_tiny import SPECS, seed_of, write_checkpoint
from tests.tiny import make_tiny_checkpoint

PREFIX, WINDOW, SUFFIX = "def add(a, b):\n", "    return a + b\n", "\nprint(add(1, 2))\n"
OPTS = DecodeOptions(steps=3)  # at most 3 denoising steps: the code paths, not the model, are under test
TIMEOUT = 120
APPROACHES = ["window", "window+memory", "surprise", "memory", "surprise+memory"]
TOPOLOGIES = {
    "bidirectional": {},
    "shifted": {"logits_shift": True},
    "block-causal": {"attention": "block_causal", "block_size": 4},
    "block-causal-shifted": {"attention": "block_causal", "block_size": 4, "logits_shift": True},
    "causal-reorder": {"attention": "causal", "canvas": "reorder"},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("rewrite") / "tiny", seed=3)


@pytest.fixture(scope="module")
def models(folder):
    """topology -> (model, tokenizer, config): the tiny checkpoint's tokenizer and ids, each topology
    a random model of its own over them."""
    _, tok, cfg = load_checkpoint(folder)
    out = {}
    for name, kw in TOPOLOGIES.items():
        c = dataclasses.replace(cfg, **kw).validate()
        m = Transformer(c)
        m.init_weights(1)
        out[name] = (m.eval(), tok, c)
    return out


def _ids(tok, *texts):
    return [tok.encode(t) for t in texts]


def _run(model, tok, cfg, approach, edits=(), opts=OPTS, **kw):
    p, w, s = _ids(tok, PREFIX, kw.pop("window", WINDOW), SUFFIX)
    run = EditRun(p, w, s, [tuple(_ids(tok, o, n)) for o, n in edits], approach, cfg, opts, **kw)
    return run


def _check(r: Rewrite, tok, cfg, window_text: str) -> None:
    assert 0.0 <= r.confidence <= 1.0 and 0.0 <= r.min_confidence <= r.mean_confidence <= 1.0 + 1e-9
    assert cfg.mask_token_id not in r.token_ids
    if r.changed:
        assert r.text == tok.decode(r.token_ids)
    else:
        assert r.text == window_text


@pytest.mark.parametrize("approach", APPROACHES)
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_each_approach_runs_on_each_topology_and_decodes(models, topology, approach):
    model, tok, cfg = models[topology]
    run = rewrite(model, _run(model, tok, cfg, approach, edits=[("(a, b)", "(x, b)")], surprise=0.5))
    r = run.rewrite(tok.decode, WINDOW)
    _check(r, tok, cfg, WINDOW)
    assert run.done and not r.cancelled and r.steps <= 3
    assert r.window_tokens == len(tok.encode(WINDOW)) and r.remasked <= r.window_tokens
    assert r.scored == ("surprise" in approach)
    if approach == "window" or approach == "window+memory":
        assert r.remasked == r.window_tokens and r.slots > r.window_tokens  # padding room
    if approach == "memory":  # the rename's ` a` -> ` x` stands once in the window, with a neighbour either side
        assert r.memory_remasked == 0 or r.remasked == r.memory_remasked


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_a_surprise_threshold_of_0_changes_nothing_and_of_1_remasks_everything(models, topology):
    model, tok, cfg = models[topology]
    none = rewrite(model, _run(model, tok, cfg, "surprise", surprise=0.0)).rewrite(tok.decode, WINDOW)
    assert none.text == WINDOW and none.changed == 0 and none.remasked == 0 and none.steps == 0 and none.scored
    run = rewrite(model, _run(model, tok, cfg, "surprise", surprise=1.0))
    every = run.rewrite(tok.decode, WINDOW)
    n = len(tok.encode(WINDOW))
    assert every.remasked == n and every.slots == n + rw.room(n, 0.25) and every.steps >= 1
    assert run.canvas is not None and run.canvas.n_masked == 0
    _check(every, tok, cfg, WINDOW)


@pytest.mark.parametrize("approach", ["memory", "surprise+memory", "window+memory"])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_a_large_memory_bias_puts_the_new_token_where_the_old_stood(models, topology, approach):
    model, tok, cfg = models[topology]
    p, s = _ids(tok, PREFIX, SUFFIX)
    w = tok.encode("a + b\n")
    old = w[0]
    new = next(t for t in range(10, cfg.vocab_size) if t not in w and t not in p and t not in s)
    run = EditRun(p, w, s, [([old], [new])], approach, cfg, OPTS, surprise=0.0, spread=0, growth=0.0, memory=1e4)
    rewrite(model, run)
    r = run.rewrite(tok.decode, "a + b\n")
    assert run.canvas is not None and int(run.canvas.ids[run.canvas.start]) == new  # slot 0, where `old` stood
    if approach != "window+memory":  # only that slot was remasked: the rest stands as it was
        assert r.token_ids == [new] + w[1:] and r.changed == 1 and r.remasked == 1 and r.memory_remasked == 1
        assert r.scored == (approach == "surprise+memory")


def test_without_a_substitution_in_the_window_the_memory_alone_changes_nothing(models):
    model, tok, cfg = models["bidirectional"]
    run = _run(model, tok, cfg, "memory", edits=[("zzz", "yyy")])
    r = rewrite(model, run).rewrite(tok.decode, WINDOW)
    assert r.changed == 0 and r.steps == 0 and not r.scored and run.canvas is None


@pytest.mark.parametrize("approach", APPROACHES)
def test_a_run_cancelled_before_it_starts_gives_the_window_back(models, approach):
    model, tok, cfg = models["bidirectional"]
    run = rewrite(model, _run(model, tok, cfg, approach, surprise=1.0), cancelled=lambda: True)
    r = run.rewrite(tok.decode, WINDOW)
    assert r.cancelled and r.steps == 0 and r.text == WINDOW and r.changed == 0 and not r.scored


@pytest.mark.parametrize("topology", ["bidirectional", "block-causal", "causal-reorder"])
def test_a_deadline_already_past_commits_every_mask_in_one_step(models, topology):
    model, tok, cfg = models[topology]
    past = time.monotonic() - 1
    for approach in ("window", "memory"):
        run = _run(model, tok, cfg, approach, edits=[("(a, b)", "(x, b)")], opts=DecodeOptions())
        if run.canvas is None:  # the tokenizer spells no ` a` here: nothing for the memory to remask
            continue
        r = rewrite(model, run, deadline=past).rewrite(tok.decode, WINDOW)
        assert r.steps == 1 and r.deadline_hit and run.canvas.n_masked == 0
        _check(r, tok, cfg, WINDOW)
    # surprise: past the deadline before its scoring forward, nothing is masked yet: the window as it is
    run = rewrite(model, _run(model, tok, cfg, "surprise", surprise=1.0), deadline=past)
    r = run.rewrite(tok.decode, WINDOW)
    assert r.steps == 0 and r.deadline_hit and not r.scored and r.text == WINDOW and r.changed == 0


def test_layouts_that_do_not_apply_raise_engine_errors(models):
    model, tok, cfg = models["causal-reorder"]
    with pytest.raises(EngineError, match="masked"):
        _run(model, tok, cfg, "surprise", score="visible")
    run = rewrite(model, _run(model, tok, cfg, "surprise", score="masked", surprise=1.0))
    assert run.score == "masked" and run.scored
    _, tok, cfg = models["bidirectional"]
    dreamon = dataclasses.replace(cfg, expand_token_id=cfg.vocab_size - 1)
    for approach in ("surprise", "memory", "surprise+memory"):
        with pytest.raises(EngineError, match="DreamOn"):
            _run(model, tok, dreamon, approach)
    for bad in ("window+surprise", "vibes"):
        with pytest.raises(EngineError, match="approach"):
            _run(model, tok, cfg, bad)
    with pytest.raises(EngineError, match="max_tokens"):
        _run(model, tok, cfg, "window", max_tokens=3)
    with pytest.raises(EngineError, match="score"):
        _run(model, tok, cfg, "surprise", score="loud")


# block-causal with the shift and sub-blocks, WeDLM's causal reordered canvas, DreamOn's resizing middle
# (SDAR's plain block-causal topology is the "block-causal" tiny model above)
FAMILIES = ["fast-dllm-v2", "wedlm", "dreamon"]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("rewrite-families")
    return {name: load_checkpoint(write_checkpoint(SPECS[name], root / name, seed=seed_of(name))) for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_checkpoints_rewrite_or_refuse(families, family):
    model, tok, cfg = families[family]
    opts = DecodeOptions(steps=2)
    for approach in ("window+memory", "surprise+memory"):
        if family == "dreamon" and approach != "window+memory":
            with pytest.raises(EngineError, match="DreamOn"):
                _run(model, tok, cfg, approach, edits=[("(a, b)", "(x, b)")], opts=opts)
            continue
        run = rewrite(model, _run(model, tok, cfg, approach, edits=[("(a, b)", "(x, b)")], opts=opts, surprise=1.0))
        r = run.rewrite(tok.decode, WINDOW)
        _check(r, tok, cfg, WINDOW)
        assert run.done and r.remasked == len(tok.encode(WINDOW))
        assert r.steps <= 2 or family == "dreamon"  # DreamOn decodes on its own schedule (dreamon.options)


# ---------------------------------------------------------------- through the service


@pytest.fixture(scope="module")
def service(folder):
    svc = EngineService(str(folder), device="cpu", threads=1)
    svc.load()
    return svc


def test_run_now_answers_an_edit_job_with_a_rewrite(service):
    r = service.run_now(EditJob(prefix=PREFIX, window=WINDOW, suffix=SUFFIX, approach="surprise", options=OPTS))
    assert isinstance(r, Rewrite) and r.scored and r.compute_ms > 0
    _check(r, service.tok, service.cfg, WINDOW)
    with pytest.raises(EngineError, match="approach"):
        service.run_now(EditJob(prefix=PREFIX, window=WINDOW, approach="vibes"))


def test_the_worker_runs_edits_beside_fills_and_a_cancel_stops_an_edit_within_one_step(folder, monkeypatch):
    svc = EngineService(str(folder), device="cpu", threads=1)
    before = EditJob(prefix=PREFIX, window=WINDOW, approach="window")
    before.cancel()
    during = EditJob(prefix=PREFIX, window=WINDOW, approach="window", options=DecodeOptions(selection="topk", steps=8))
    edit = EditJob(prefix=PREFIX, window=WINDOW, suffix=SUFFIX, approach="surprise+memory", options=OPTS)
    fill = FillJob(prefix=PREFIX, max_tokens=6, options=OPTS)
    expired = EditJob(prefix=PREFIX, window=WINDOW, deadline=time.monotonic() - 1)
    real = sampler.step

    def step(model, canvases, final=None, *a, **kw):
        real(model, canvases, final, *a, **kw)
        if canvases[0].steps == 1 and canvases[0].plan:  # `during`'s topk plan: cancelled after its first step
            during.cancel()

    monkeypatch.setattr(rw.sampler, "step", step)
    futs = [svc.submit(j) for j in (before, during, edit, fill, expired)]
    svc.start()
    try:
        a, b, c, d, e = (f.result(TIMEOUT) for f in futs)
    finally:
        svc.close()
    assert a.cancelled and a.steps == 0 and a.text == WINDOW
    assert b.cancelled and b.steps == 1 and b.text == WINDOW and b.changed == 0
    assert isinstance(c, Rewrite) and not c.cancelled and c.scored
    assert d.steps >= 1 and not d.cancelled and isinstance(d.text, str)
    assert e.expired and e.text == WINDOW and e.steps == 0
    assert svc.stats["edit_jobs"] == 3 and svc.stats["cancelled_jobs"] == 2 and svc.stats["expired_jobs"] == 1


def test_padding_room_is_cut_to_fit_max_tokens():
    slots = rw.remask_slots([True, False, True, True], 1.0)
    assert slots.src == [0, None, 1, 2, 3, None, None] and slots.masked == [True, True, False, True, True, True, True]
    fitted = rw.fit(slots, 5)
    assert fitted.src == [0, None, 1, 2, 3] and fitted.masked == [True, True, False, True, True]
    assert rw.surprising([0.9, 0.01, 0.9, 0.9], 0.05, 1) == [True, True, True, False]
    assert rw.surprising([0.9, 0.01], 0.0, 1) == [False, False] and rw.surprising([1.0, 1.0], 1.0, 0) == [True, True]
