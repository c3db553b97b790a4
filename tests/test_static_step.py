"""The fixed-shape cached step (engine/decode/static.py) against the eager loop it replaces: the same
fills token for token, the same steps, one read-back per step, no rebuild when a job leaves, and a
step that dynamo traces as one graph (fullgraph=True) at every run bucket."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.api import DecodeOptions, FillJob
from engine.decode import sampler, static
from engine.decode.forward import build_canvas
from engine.weights.load import load_checkpoint

SOURCE = (
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path, name=None):\n"
    "        self.path = path\n        self.name = name or os.path.basename(path)\n\n"
    "    def read(self):\n        with open(self.path) as f:\n            return f.read()\n\n"
    "    def lines(self):\n        out = []\n        for line in self.read().splitlines():\n"
    "            if line.strip():\n                out.append(line)\n        return out\n\n\n"
    "def main(argv):\n    cfg = Config(argv[1])\n    for line in cfg.lines():\n        print(line)\n"
    "    return 0\n\n\nif __name__ == '__main__':\n    sys.exit(main(sys.argv))\n"
)
# cursor offsets: the start of a body, mid-line, a blank line between definitions
CURSORS = (SOURCE.index("        out = []"), SOURCE.index("cfg.lines()"), SOURCE.index("def main") - 1)
CASES = {  # options the step must decode exactly as the eager loop does
    "defaults": DecodeOptions(heal=False),
    "strict threshold": DecodeOptions(heal=False, threshold=0.999),
    "no window": DecodeOptions(heal=False, window=0, threshold=0.99),
    "small window, no pad_left": DecodeOptions(heal=False, window=4, pad_left=False, threshold=0.99),
    "topk one a step": DecodeOptions(heal=False, selection="topk", steps=64),
    "llada blocks": DecodeOptions(heal=False, selection="topk", steps=32, block=8, window=0),
    "no freezing, margin": DecodeOptions(heal=False, freeze=False, confidence="margin", threshold=0.95),
    "entropy, refreshes": DecodeOptions(heal=False, confidence="neg_entropy", threshold=-0.5, refresh_every=3),
    "stop below": DecodeOptions(heal=False, threshold=0.999, stop_below=0.5),
    "pad stop off": DecodeOptions(heal=False, threshold=0.999, pad_stop=1.1),
}


@pytest.fixture(scope="module")
def default():
    model, tok, cfg = load_checkpoint(None, "cpu", torch.float32)
    return model, tok, cfg


def _canvas(tok, cfg, cursor: int, n: int, opts: DecodeOptions):
    return build_canvas(tok.encode(SOURCE[:cursor]), tok.encode(SOURCE[cursor:]), n, cfg, opts, 512)


def _same(a: sampler.DecodeResult, b: sampler.DecodeResult) -> None:
    assert (a.ids, a.steps, a.tokens_per_step) == (b.ids, b.steps, b.tokens_per_step)
    assert a.confidence == pytest.approx(b.confidence, abs=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_fills_equal_the_eager_loop_token_for_token(default, case):
    model, tok, cfg = default
    st = static.StaticStep(model, "eager")
    opts, steps = CASES[case], 0
    for cursor in CURSORS:
        for n in (5, 24, 64):
            eager = sampler.fill(model, _canvas(tok, cfg, cursor, n, opts))
            fixed = sampler.fill(model, _canvas(tok, cfg, cursor, n, opts), static=st)
            _same(eager, fixed)
            steps += eager.steps
    assert st.counters.steps > 0  # the fixed-shape step ran (every fill's first step is a full forward)
    assert st.counters.reads == st.counters.steps  # one small read-back per step, no other
    assert not st.members  # every finished fill left the batch


def test_a_final_step_commits_every_mask_as_the_eager_one(default):
    model, tok, cfg = default
    st = static.StaticStep(model, "eager")
    opts = DecodeOptions(heal=False, threshold=0.999, pad_stop=1.1)
    a, b = (_canvas(tok, cfg, CURSORS[0], 48, opts) for _ in range(2))
    for finals in ([False], [False], [True]):
        sampler.step(model, [a], finals)
        sampler.step(model, [b], finals, static=st)
    assert a.done and b.done and a.fill_ids() == b.fill_ids() and a.tokens_per_step == b.tokens_per_step


def test_a_batch_in_one_step_equals_each_canvas_alone(default):
    """Canvases of different lengths and options share one forward and one stats pass; each decodes
    as it would alone. A job leaving frees its slot without rebuilding the batch's buffers."""
    model, tok, cfg = default
    jobs = [
        (CURSORS[0], 64, CASES["strict threshold"]),
        (CURSORS[1], 24, CASES["topk one a step"]),
        (CURSORS[2], 5, CASES["small window, no pad_left"]),
        (CURSORS[0], 32, CASES["llada blocks"]),
    ]
    alone = [sampler.fill(model, _canvas(tok, cfg, *j)) for j in jobs]
    st = static.StaticStep(model, "eager")
    canvases = [_canvas(tok, cfg, *j) for j in jobs]
    batched_steps = 0
    while any(not c.done for c in canvases):
        live = [c for c in canvases if not c.done]
        allocs = st.counters.allocs
        sampler.step(model, live, static=st)
        batched_steps += len(live) > 1 and all(static.takes(c) or c.done for c in live)
        if st.counters.allocs > 1:  # the first step allocates; later steps only when the batch grows
            assert st.counters.allocs == allocs
    assert batched_steps > 0
    assert st.counters.allocs == 1
    for r, c in zip(alone, canvases):
        assert (r.ids, r.tokens_per_step) == (c.fill_ids(), c.tokens_per_step)


def test_the_step_traces_as_one_graph_at_every_run_bucket(default):
    """torch.compile(fullgraph=True) fails on any graph break: a .item(), a .tolist(), a shape or a
    branch that depends on data. The step traces whole at every run bucket and gives what eager gives."""
    model, tok, cfg = default
    st = static.StaticStep(model, "eager")
    c = _canvas(tok, cfg, CURSORS[0], 64, CASES["strict threshold"])
    sampler.step(model, [c])  # the full forward
    sampler.step(model, [c], static=st)  # allocates the batch's state and loads the canvas
    state = st.state
    assert state is not None
    buckets = static.run_buckets(state.shape.T)
    assert buckets == [16, 32, 48, 64, 65]
    for R in buckets:
        torch._dynamo.reset()
        compiled = torch.compile(static.cached_step, fullgraph=True, dynamic=False, backend="aot_eager")
        a, b = state.clone(), state.clone()
        with torch.inference_mode():
            compiled(model, a, R, st.block_unit)
            static.cached_step(model, b, R, st.block_unit)
        for x, y in zip(a.tensors(), b.tensors()):
            assert torch.equal(x, y)


def test_takes_only_what_it_decodes_exactly(default):
    model, tok, cfg = default
    plain = _canvas(tok, cfg, CURSORS[0], 16, DecodeOptions(heal=False))
    assert not static.takes(plain)  # before its first (full) forward
    sampler.step(model, [plain])
    assert static.takes(plain)
    for opts in (
        DecodeOptions(heal=False, temperature=0.5),
        DecodeOptions(heal=False, cache=False),
        DecodeOptions(heal=False, copy_bigram=2.0),
    ):
        c = _canvas(tok, cfg, CURSORS[0], 16, opts)
        sampler.step(model, [c])
        assert not static.takes(c)


def test_graph_mode_needs_a_gpu_and_modes_are_checked(default):
    model = default[0]
    with pytest.raises(ValueError, match="CUDA"):
        static.StaticStep(model, "graph", "cpu")
    with pytest.raises(ValueError, match="mode"):
        static.StaticStep(model, "fast")


def test_buckets():
    assert [static.bucket(n, static.ROWS) for n in (1, 16, 17, 64, 65, 100)] == [16, 16, 32, 64, 80, 112]
    assert static.run_buckets(25) == [16, 25]


@pytest.mark.parametrize("name", ["dream", "llada", "coda", "sdar", "fast-dllm-v2", "open-dcoder"])
def test_family_fills_equal_the_eager_loop(family_folders, name):
    """Shifted logits (Dream), LLaDA blocks, block-causal order and sub-blocks (SDAR, Fast-dLLM v2)."""
    model, tok, cfg = load_checkpoint(family_folders[name])
    prefix, suffix = tok.encode("def add(a, b):\n    ret"), tok.encode("\n\nfor i in range(10):\n    print(i)\n")
    st = static.StaticStep(model, "eager")
    for opts in (
        DecodeOptions(heal=False, threshold=0.3, window=0),
        DecodeOptions(heal=False, threshold=0.6, window=4),
        DecodeOptions(heal=False, selection="topk", steps=12, block=4, window=0),
    ):
        for n in (6, 12):
            eager = sampler.fill(model, build_canvas(prefix, suffix, n, cfg, opts))
            fixed = sampler.fill(model, build_canvas(prefix, suffix, n, cfg, opts), static=st)
            _same(eager, fixed)
    assert st.counters.steps > 0


def test_the_service_fills_through_the_step_as_through_the_eager_loop(family_folders):
    from engine.serve.service import EngineService

    jobs = [
        FillJob(prefix="def add(a, b):\n    ret", suffix="\n", max_tokens=n, options=dataclasses.replace(o, heal=False))
        for n in (6, 12)
        for o in (DecodeOptions(threshold=0.5), DecodeOptions(selection="topk", steps=12, window=0))
    ]
    answers = {}
    for mode in ("off", "eager"):
        svc = EngineService(str(family_folders["dream"]), device="cpu", step_mode=mode, max_batch=4).start()
        try:
            assert svc.wait_ready(60)
            futures = [svc.submit(dataclasses.replace(j)) for j in jobs]
            answers[mode] = [f.result(60).text for f in futures]
            if mode == "eager":
                assert svc._static is not None and svc._static.counters.steps > 0
        finally:
            svc.close()
    assert answers["eager"] == answers["off"]


def test_reserve_allocates_once_for_the_jobs_to_come(default):
    """The service's warm-up reserves the buffers a full batch needs: jobs within them allocate nothing."""
    model, tok, cfg = default
    st = static.StaticStep(model, "eager")
    st.reserve(4, 65, 512 + 65)
    assert st.counters.allocs == 1 and st.state is not None
    assert (st.state.shape.B, st.state.shape.S, st.state.shape.C) == (4, 128, 1024)
    canvases = [_canvas(tok, cfg, cursor, 64, CASES["strict threshold"]) for cursor in CURSORS]
    while any(not c.done for c in canvases):
        sampler.step(model, [c for c in canvases if not c.done], static=st)
    assert st.counters.allocs == 1 and st.counters.steps > 0


def test_the_service_with_sessions_cancels_and_a_batch_through_the_step(family_folders):
    """Typed keystrokes with a session key (reuse hits load the step from views of the session's
    buffer), jobs arriving together (batched steps) and a cancelled one: the same texts as the eager
    loop, the cancelled job answered, nothing left in the step's batch."""
    from engine.serve.service import EngineService

    doc = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    ret"
    opts = DecodeOptions(heal=False, threshold=0.6)
    typed = [FillJob(prefix=doc[:k], suffix="\n", max_tokens=8, options=opts, session="doc") for k in range(52, 58)]
    together = [FillJob(prefix=doc[:k], suffix="\n", max_tokens=12, options=opts) for k in (40, 45, 50)]
    answers, static_steps = {}, 0
    for mode in ("off", "eager"):
        svc = EngineService(str(family_folders["dream"]), device="cpu", step_mode=mode, max_batch=4).start()
        try:
            assert svc.wait_ready(60)
            texts = [svc.submit(dataclasses.replace(j)).result(60).text for j in typed]
            futures = [svc.submit(dataclasses.replace(j)) for j in together]
            texts += [f.result(60).text for f in futures]
            gone = dataclasses.replace(together[0], options=dataclasses.replace(opts, threshold=0.999))
            fut = svc.submit(gone)
            gone.cancel()
            assert fut.result(60) is not None  # answered, cancelled or finished
            answers[mode] = texts
            if mode == "eager":
                assert svc._static is not None
                static_steps = svc._static.counters.steps
                assert svc._reuse.stats["reused"] > 0
        finally:
            svc.close()
    assert static_steps > 0
    assert answers["eager"] == answers["off"]
