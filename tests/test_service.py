"""engine/serve/service.py: batching equals running alone, jobs joining mid-batch, failures that stay with
their job, cancel, deadline, per-job stats, load errors and shutdown."""

from __future__ import annotations

import time

import pytest

from engine.api import DecodeOptions, EngineError, FillJob
from engine.decode import forward as fwd
from engine.decode import sampler
from engine.serve import service
from engine.serve.service import EngineService
from tests.engine_models import peaked_checkpoint

TIMEOUT = 120

TEXTS = [
    ("def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"),
    (
        "import os\nimport sys\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
        "        self.y = y\n",
    ),
    ("for i in range(10):\n", ""),
    ("function f(x) { return x * 2; }\nfunction g(y) {", "}\n"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return peaked_checkpoint(tmp_path_factory.mktemp("svc") / "peaked", seed=1)


@pytest.fixture(scope="module")
def alone(folder):
    """A loaded service used on the calling thread: the unbatched answer for any job."""
    svc = EngineService(str(folder), device="cpu")
    svc.load()
    return svc


def _jobs(opts: DecodeOptions, sizes=(3, 5, 8, 11)) -> list[FillJob]:
    return [FillJob(prefix=p, suffix=s, max_tokens=n, options=opts) for (p, s), n in zip(TEXTS, sizes)]


def _same_as_alone(alone, job: FillJob, fill) -> None:
    solo = alone.run_now(FillJob(prefix=job.prefix, suffix=job.suffix, max_tokens=job.max_tokens, options=job.options))
    assert fill.token_ids == solo.token_ids, f"job {job.max_tokens}: batched {fill.token_ids} alone {solo.token_ids}"
    assert fill.tokens_per_step == solo.tokens_per_step


OPTIONS = [
    pytest.param(DecodeOptions(threshold=0.5), id="cache-freeze"),
    pytest.param(DecodeOptions(threshold=0.5, freeze=False), id="cache-span"),
    pytest.param(DecodeOptions(selection="topk", cache=False), id="nocache-topk"),
    pytest.param(DecodeOptions(confidence="margin", threshold=0.3, refresh_every=2), id="refresh2-margin"),
]


@pytest.mark.parametrize("opts", OPTIONS)
def test_jobs_arriving_together_share_steps_and_equal_running_alone(folder, alone, opts):
    svc = EngineService(str(folder), device="cpu")
    jobs = _jobs(opts)
    futs = [svc.submit(j) for j in jobs]  # queued before the worker starts: they arrive together
    svc.start()
    try:
        fills = [f.result(TIMEOUT) for f in futs]
    finally:
        svc.close()
    assert svc.stats["max_batch_seen"] == len(jobs) and svc.stats["batched_steps"] > 0
    for job, f in zip(jobs, fills):
        _same_as_alone(alone, job, f)
        assert f.steps == len(f.tokens_per_step) == len(f.ms_per_step) and sum(f.tokens_per_step) == f.slots
        assert f.queue_ms >= 0 and f.compute_ms > 0 and not f.cancelled


def test_a_job_joining_between_steps_equals_running_alone(folder, alone, monkeypatch):
    svc = EngineService(str(folder), device="cpu")
    opts = DecodeOptions(selection="topk", steps=11)
    jobs = _jobs(opts)
    late = FillJob(prefix=TEXTS[2][0] + "    x = i\n", suffix="", max_tokens=6, options=opts)
    late_fut = []
    real = sampler.commit

    def commit(model, c, rows, final):
        if not late_fut and c.steps == 1:  # the batch has taken a step: a new request arrives
            late_fut.append(svc.submit(late))
        return real(model, c, rows, final)

    monkeypatch.setattr(sampler, "commit", commit)
    futs = [svc.submit(j) for j in jobs[:3]]
    svc.start()
    try:
        fills = [f.result(TIMEOUT) for f in futs]
        late_fill = late_fut[0].result(TIMEOUT)
    finally:
        svc.close()
    monkeypatch.setattr(sampler, "commit", real)
    assert svc.stats["max_batch_seen"] == 4
    for job, f in zip(jobs[:3] + [late], fills + [late_fill]):
        _same_as_alone(alone, job, f)


def test_bad_jobs_fail_alone_and_the_worker_survives(folder, alone, monkeypatch):
    svc = EngineService(str(folder), device="cpu")
    opts = DecodeOptions(threshold=0.5, heal=False)  # no healing slot: canvases are told apart by their size
    good = _jobs(opts, sizes=(3, 5, 8, 11))
    empty = FillJob(prefix="x = ", max_tokens=0)
    nonsense = FillJob(prefix="x = ", options=DecodeOptions(selection="vibes"))
    cursed = FillJob(prefix="y = ", max_tokens=7, options=opts)  # commit raises for this one
    doomed = FillJob(prefix="z = ", max_tokens=9, options=opts)  # the batched forward raises while it is in

    real_commit, real_forward = sampler.commit, fwd.forward

    def commit(model, c, rows, final):
        if c.n == 7:
            raise RuntimeError("forced failure")
        return real_commit(model, c, rows, final)

    def forward(model, canvases, ctx=None):
        if any(c.n == 9 for c in canvases):
            raise RuntimeError("forced forward failure")
        return real_forward(model, canvases, ctx)

    monkeypatch.setattr(sampler, "commit", commit)
    monkeypatch.setattr(fwd, "forward", forward)
    futs = [svc.submit(j) for j in [good[0], empty, cursed, good[1], nonsense, doomed, good[2]]]
    svc.start()
    try:
        with pytest.raises(EngineError, match="max_tokens"):
            futs[1].result(TIMEOUT)
        with pytest.raises(EngineError, match="selection"):
            futs[4].result(TIMEOUT)
        with pytest.raises(EngineError, match="forced failure"):
            futs[2].result(TIMEOUT)
        with pytest.raises(EngineError, match="forced forward failure"):
            futs[5].result(TIMEOUT)
        fills = [futs[i].result(TIMEOUT) for i in (0, 3, 6)]
        monkeypatch.setattr(sampler, "commit", real_commit)
        monkeypatch.setattr(fwd, "forward", real_forward)
        after = svc.submit(good[3]).result(TIMEOUT)  # the worker is still alive
    finally:
        svc.close()
    for job, f in zip([good[0], good[1], good[2], good[3]], fills + [after]):
        _same_as_alone(alone, job, f)
    assert svc.stats["failed_jobs"] == 4


def test_cancel_stops_within_one_step(folder, monkeypatch):
    svc = EngineService(str(folder), device="cpu")
    before = FillJob(prefix=TEXTS[0][0], max_tokens=8)
    before.cancel()
    during = FillJob(prefix=TEXTS[1][0], max_tokens=8, options=DecodeOptions(selection="topk", steps=8, heal=False))
    real = sampler.commit

    def commit(model, c, rows, final):
        n = real(model, c, rows, final)
        if c.n == 8 and c.steps == 1:
            during.cancel()  # the user typed on: cancelled after its first step
        return n

    monkeypatch.setattr(sampler, "commit", commit)
    futs = [svc.submit(before), svc.submit(during)]
    svc.start()
    try:
        a, b = (f.result(TIMEOUT) for f in futs)
    finally:
        svc.close()
    assert a.cancelled and a.steps == 0 and a.text == ""
    assert b.cancelled and b.steps == 1
    assert svc.stats["cancelled_jobs"] == 2


def test_a_step_that_would_pass_the_deadline_is_the_last_with_every_slot_committed(folder):
    svc = EngineService(str(folder), device="cpu").start()
    try:
        assert svc.wait_ready(TIMEOUT)
        svc._full_ms_per_token = 1e6  # a (pretend) slow model: its first full forward would pass any deadline
        job = FillJob(
            prefix=TEXTS[1][0],
            max_tokens=12,
            deadline=time.monotonic() + 60,
            options=DecodeOptions(selection="topk", steps=12, pad_stop=2.0),
        )
        f = svc.submit(job).result(TIMEOUT)
    finally:
        svc.close()
    # every slot (12, and the healing slot when the prefix's tail is re-typed) in one step
    assert f.steps == 1 and f.deadline_hit and f.tokens_per_step == [f.slots] and f.slots in (12, 13)
    assert not f.cancelled
    assert svc.cfg.mask_token_id not in f.token_ids


def test_a_job_whose_deadline_passed_in_the_queue_is_answered_empty_without_running(folder, monkeypatch):
    svc = EngineService(str(folder), device="cpu").start()
    forwards = []
    real = fwd.forward

    def forward(model, canvases, ctx=None):
        forwards.append(len(canvases))
        return real(model, canvases, ctx)

    try:
        assert svc.wait_ready(TIMEOUT)
        monkeypatch.setattr(fwd, "forward", forward)
        late = svc.submit(FillJob(prefix=TEXTS[0][0], max_tokens=8, deadline=time.monotonic() - 0.01)).result(TIMEOUT)
        assert late.expired and late.text == "" and late.steps == 0 and not forwards
        on_time = svc.submit(FillJob(prefix=TEXTS[0][0], max_tokens=8, deadline=time.monotonic() + 60)).result(TIMEOUT)
        assert not on_time.expired and on_time.steps >= 1 and forwards
    finally:
        svc.close()
    assert svc.stats["expired_jobs"] == 1 and svc.stats["jobs"] == 1


def test_the_worker_runs_with_the_thread_count_it_reports(folder, monkeypatch):
    import torch

    from engine.serve import service

    seen = []
    real = fwd.forward

    def forward(model, canvases, ctx=None):
        seen.append(torch.get_num_threads())
        return real(model, canvases, ctx)

    monkeypatch.setattr(fwd, "forward", forward)
    monkeypatch.delenv("DLM_THREADS", raising=False)
    monkeypatch.setattr(service.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert service.cpu_threads() == 2  # three cores: one left for the server
    monkeypatch.setattr(service.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert service.cpu_threads() == 1
    monkeypatch.setattr(service.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert service.cpu_threads() == service.MAX_DEFAULT_THREADS
    # the worker sets its own count (OpenMP's is per thread): 2 here, not the 1 of OMP_NUM_THREADS=1
    monkeypatch.setattr(service.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    states = []
    svc = EngineService(str(folder), device="cpu", on_state=lambda s, info: states.append(info)).start()
    try:
        svc.submit(FillJob(prefix=TEXTS[0][0], max_tokens=4)).result(TIMEOUT)
    finally:
        svc.close()
    assert (svc.threads, svc.threads_from) == (2, "cores") and set(seen) == {2}
    assert states[-1]["threads"] == 2
    monkeypatch.setenv("DLM_THREADS", "3")
    assert (EngineService(threads=2).threads, EngineService().threads) == (2, 3)
    assert (EngineService(threads=2).threads_from, EngineService().threads_from) == ("option", "DLM_THREADS")


def test_load_failure_fails_jobs_instead_of_hanging(tmp_path):
    states = []
    svc = EngineService(str(tmp_path / "absent"), device="cpu", on_state=lambda s, info: states.append(s)).start()
    try:
        assert not svc.wait_ready(TIMEOUT)
        assert svc.state == "error" and "could not load" in svc.message
        with pytest.raises(EngineError):
            svc.submit(FillJob(prefix="x")).result(TIMEOUT)
    finally:
        svc.close()
    assert states[:2] == ["loading", "error"]


def test_close_answers_every_job(folder):
    svc = EngineService(str(folder), device="cpu")
    futs = [
        svc.submit(FillJob(prefix=p, max_tokens=40, options=DecodeOptions(selection="topk", steps=40)))
        for p, _ in TEXTS
    ]
    svc.start()
    assert svc.wait_ready(TIMEOUT)
    svc.close()
    for f in futs:
        try:
            f.result(TIMEOUT)  # finished or cancelled: either way an answer
        except EngineError:
            pass
    with pytest.raises(EngineError):
        svc.submit(FillJob(prefix="x")).result(TIMEOUT)


def test_healed_job_retypes_the_prefix_tail_and_leaves_it_out_of_the_text(alone):
    tok, prefix = alone.tok, "import os\nimpo"
    h = tok.heal(tok.encode(prefix))
    assert h and h.text and prefix.endswith(h.text)
    healed = alone.run_now(FillJob(prefix=prefix, max_tokens=6))
    plain = alone.run_now(FillJob(prefix=prefix, max_tokens=6, options=DecodeOptions(heal=False)))
    assert (healed.slots, plain.slots) == (7, 6)  # one more slot: the re-typed tail
    assert healed.token_ids[0] in h.first and tok.decode(healed.token_ids) == h.text + healed.text
    assert plain.text == tok.decode(plain.token_ids)


def test_the_warm_up_runs_before_the_first_job_and_changes_no_answer(folder, alone, monkeypatch):
    """On a GPU the worker fills a few canvases of its own before its first job (the kernel's variants
    compile then, not in a user's first keystrokes); forced on here, it must leave every answer and
    every job counter as they were."""
    calls = []
    real = sampler.fill
    monkeypatch.setattr(
        sampler, "fill", lambda model, canvas, *a, **k: calls.append(canvas.n) or real(model, canvas, *a, **k)
    )
    jobs = _jobs(DecodeOptions(threshold=0.5))
    svc = EngineService(str(folder), device="cpu", warm_up=True)
    futs = [svc.submit(j) for j in jobs]
    svc.start()
    try:
        fills = [f.result(TIMEOUT) for f in futs]
    finally:
        svc.close()
    assert calls == list(service.WARM_UP_SLOTS)  # the warm-up's own fills; jobs take the batched path
    assert svc.stats["warmup_fills"] == len(service.WARM_UP_SLOTS) and svc.stats["warmup_ms"] > 0
    assert svc.stats["jobs"] == len(jobs) and svc.stats["max_batch_seen"] == len(jobs)  # queued jobs still batch
    for job, f in zip(jobs, fills):
        _same_as_alone(alone, job, f)


def test_no_warm_up_on_the_cpu_by_default_and_a_failing_one_serves_on(folder, monkeypatch):
    svc = EngineService(str(folder), device="cpu").start()
    try:
        assert svc.submit(FillJob(prefix=TEXTS[0][0], max_tokens=4)).result(TIMEOUT).steps >= 1
        assert svc.stats["warmup_fills"] == 0 and svc.stats["warmup_ms"] == 0.0
    finally:
        svc.close()

    def broken(*a, **k):
        raise RuntimeError("kernel compilation failed")

    monkeypatch.setattr(sampler, "fill", broken)
    svc = EngineService(str(folder), device="cpu", warm_up=True).start()
    try:
        f = svc.submit(FillJob(prefix=TEXTS[1][0], max_tokens=4)).result(TIMEOUT)
        assert f.steps >= 1 and svc.stats["warmup_fills"] == 0 and svc.stats["jobs"] == 1
    finally:
        svc.close()
