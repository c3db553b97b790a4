"""Next edits through the shared engine (engine/serve/daemon.py, engine/clients/remote.py): an
EditJob's and a Rewrite's wire forms (engine/clients/wire.py) and hostile edit messages; a daemon
with the scripted engine in this process (exact order: a `hold` folder says when a job runs) for
cancel, interleaving, old-style fill messages and bad messages; a real daemon on a tiny checkpoint
(tests/slow_engine.py, whose steps are slowed so a job is still running when it is cancelled)
answering edits as the in-process engine does; a daemon older than next edits; and the HTTP engine,
which refuses edits at once. Tests wait for events and conditions, never for step times."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.api import DecodeOptions, EditJob, EngineError, Fill, FillJob, Rewrite
from engine.clients import wire
from engine.clients.remote import RemoteEngine
from engine.serve import daemon as engine_daemon
from tests.test_daemon import start_slow_daemon, wait_for

TIMEOUT = 120
PREFIX = "def add(a, b):\n"
WINDOW = "    return a + b\n"
SUFFIX = "\nprint(add(1, 2))\n"
# an edit of exactly 200 denoising steps on the tiny model (one slot per step, nothing ends it early)
LONG_OPTS = DecodeOptions(selection="topk", steps=200, heal=False, window=0, pad_left=False, pad_stop=1.1)
LONG_WINDOW = "    print(i)\n" * 20
NOT_JOB = ("job_id", "submitted_at", "cancel_event", "deadline")  # not on the wire (the deadline: as time left)


def same_job(a: EditJob, b: EditJob) -> dict:
    """The fields of `a` that differ from `b`'s ({} when the jobs are the same but for NOT_JOB)."""
    return {
        f.name: (getattr(a, f.name), getattr(b, f.name))
        for f in dataclasses.fields(EditJob)
        if f.name not in NOT_JOB and getattr(a, f.name) != getattr(b, f.name)
    }


def edit_job(**kw) -> EditJob:
    return EditJob(**{"prefix": PREFIX, "window": WINDOW, "suffix": SUFFIX, "edits": [("add", "plus")], **kw})


@pytest.fixture(scope="module")
def runtime() -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR for the module (short: socket paths have a 107-byte limit); daemon
    processes still running at the end are killed by pid (never this process: its daemons run on
    threads and each test stops its own)."""
    d = Path(tempfile.mkdtemp(prefix="dlmrt-", dir="/tmp"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(d))
        mp.setenv("DLM_ENGINE_IDLE_S", "60")  # a daemon a failed test leaves behind exits on its own
        yield d
        for st in engine_daemon.ask_all("status"):
            if st["pid"] != os.getpid():
                try:
                    os.kill(st["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
    shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- wire


def test_an_edit_job_crosses_the_wire_with_every_field_and_a_remaining_time_deadline():
    now = time.monotonic()
    job = EditJob(
        prefix="a\u00e9\U0001f600\n",
        window="    x = old(1)\n",
        suffix="z\ud800",  # a lone surrogate, as documents keep them
        edits=[("old", "new"), ("", "y"), ("a\nb", "")],
        approach="window+memory",
        max_tokens=77,
        deadline=now + 2.5,
        options=DecodeOptions(threshold=0.5, window=0, seed=-3, top_k=5, copy_bigram=1.5, stop_newline=True),
        context_tokens=300,
        surprise=0.125,
        spread=3,
        growth=0.5,
        memory=2.0,
        score="masked",
        submitted_at=now - 0.25,
    )
    msg = wire.job_message(job, now=now)
    assert msg == wire.edit_job_message(job, now=now)
    assert msg["type"] == "edit" and msg["edits"] == [["old", "new"], ["", "y"], ["a\nb", ""]]
    assert msg["remaining_s"] == pytest.approx(2.5) and msg["age_s"] == pytest.approx(0.25)
    back = wire.any_job_from_message(json.loads(json.dumps(msg)), now=100.0)
    assert isinstance(back, EditJob) and same_job(back, job) == {}
    assert back.deadline == pytest.approx(102.5) and back.submitted_at == pytest.approx(99.75)
    assert back.edits == [("old", "new"), ("", "y"), ("a\nb", "")]  # pairs again, not lists
    assert wire.edit_job_from_message({**msg, "remaining_s": None}).deadline is None
    # only prefix and window are required: the rest takes EditJob's defaults
    bare = wire.edit_job_from_message({"type": "edit", "prefix": "p", "window": "w"})
    assert same_job(bare, EditJob(prefix="p", window="w")) == {}
    # a fill's message is as before next edits (no "type"), and a fill decoder never takes an edit
    fill_msg = wire.job_message(FillJob(prefix="x", kind="line"))
    assert "type" not in fill_msg and isinstance(wire.any_job_from_message(fill_msg), FillJob)
    assert wire.any_job_from_message(fill_msg).kind == "line"  # FillJob.kind is the hole's kind, not the job's
    assert isinstance(wire.any_job_from_message({**fill_msg, "type": "fill"}), FillJob)
    with pytest.raises(ValueError, match="not a fill job"):
        wire.job_from_message(msg)
    with pytest.raises(ValueError, match="not an edit job"):
        wire.edit_job_from_message(fill_msg)


def test_a_rewrite_crosses_the_wire_and_a_bad_one_is_a_value_error():
    r = Rewrite(
        text="    return plus(a, b)\n",
        confidence=0.75,
        steps=4,
        cancelled=False,
        deadline_hit=True,
        expired=False,
        queue_ms=1.5,
        compute_ms=12.25,
        changed=3,
        min_confidence=0.5,
        mean_confidence=0.625,
        remasked=5,
        memory_remasked=2,
        slots=7,
        scored=True,
        window_tokens=6,
        token_ids=[5, 6, 7],
    )
    msg = json.loads(json.dumps(wire.rewrite_message(r)))
    assert wire.rewrite_from_message(msg) == r
    assert wire.rewrite_from_message({**msg, "from_a_newer_daemon": 1}) == r  # unknown fields are left out
    assert wire.rewrite_from_message({"text": "w"}) == Rewrite(text="w")
    for bad in (None, [], {}, {"text": 3}, {**msg, "steps": "4"}, {**msg, "token_ids": [1, "2"]}, {**msg, "scored": 1}):
        with pytest.raises(ValueError):
            wire.rewrite_from_message(bad)


GOOD = wire.edit_job_message(edit_job(deadline=time.monotonic() + 5))
HOSTILE = [
    None,
    [1],
    "edit",
    {k: v for k, v in GOOD.items() if k != "prefix"},  # missing fields
    {k: v for k, v in GOOD.items() if k != "window"},
    {**GOOD, "type": "teleport"},
    {**GOOD, "type": None},
    {**GOOD, "prefix": 3},
    {**GOOD, "window": None},
    {**GOOD, "suffix": ["x"]},
    {**GOOD, "edits": "old>new"},
    {**GOOD, "edits": [["a", "b", "c"]]},
    {**GOOD, "edits": [["a", 1]]},
    {**GOOD, "edits": ["ab"]},
    {**GOOD, "edits": [{"old": "a", "new": "b"}]},
    {**GOOD, "approach": "bogus"},  # unknown approach
    {**GOOD, "approach": "window+surprise"},
    {**GOOD, "approach": "memory+memory"},
    {**GOOD, "approach": 3},
    {**GOOD, "score": "loud"},
    {**GOOD, "max_tokens": "7"},  # wrong types
    {**GOOD, "max_tokens": True},
    {**GOOD, "max_tokens": 7.0},
    {**GOOD, "max_tokens": 10**30},  # huge numbers
    {**GOOD, "max_tokens": 0},
    {**GOOD, "context_tokens": -1},
    {**GOOD, "context_tokens": 2**64},
    {**GOOD, "spread": 10**9},
    {**GOOD, "surprise": 2},
    {**GOOD, "surprise": math.nan},
    {**GOOD, "growth": math.inf},
    {**GOOD, "growth": 1e300},
    {**GOOD, "memory": -1},
    {**GOOD, "remaining_s": "soon"},
    {**GOOD, "remaining_s": math.nan},
    {**GOOD, "remaining_s": math.inf},
    {**GOOD, "age_s": None},
    {**GOOD, "options": "fast"},
    {**GOOD, "options": {"nope": 1}},
    {**GOOD, "options": {"threshold": "high"}},
    {**GOOD, "options": {"threshold": math.nan}},
    {**GOOD, "options": {"heal": 1}},
    {**GOOD, "options": {"seed": 2**70}},
    {**GOOD, "options": {"steps": 10**30}},
    {**GOOD, "options": {"steps": 2.5}},
    {**GOOD, "options": {"top_k": [5]}},
]


@pytest.mark.parametrize("bad", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_edit_job_message_is_a_value_error(bad):
    with pytest.raises(ValueError):
        wire.any_job_from_message(json.loads(json.dumps(bad)))


def test_any_value_in_any_field_of_an_edit_job_decodes_or_is_a_value_error():
    """What the daemon relies on to survive a hostile peer: decoding raises ValueError, nothing else."""
    values = [None, True, 0, -1, 2**63, 10**40, 0.5, -1e308, math.nan, math.inf, "", "x", [], {}, [[1, 2]], [["a"]]]
    decoded = 0
    for key in [*GOOD, "options.threshold", "options.seed", "options.selection", "options.steps"]:
        for v in values:
            msg = json.loads(json.dumps(GOOD))
            if key.startswith("options."):
                msg["options"][key.split(".", 1)[1]] = v
            else:
                msg[key] = v
            try:
                wire.any_job_from_message(msg)
                decoded += 1
            except ValueError:
                pass
    assert decoded > 0  # some values fit some fields (a None suffix does not; a "" prefix does)


# ----------------------------------------------------------------------------- a scripted daemon


@contextmanager
def scripted_daemon(script: str) -> Iterator[str]:
    """An EngineDaemon in this process on the scripted engine (`scripted:<script>`); yields the model
    name a RemoteEngine reaches it by."""
    from dlm_lsp.measure.fuzz.scripted_engine import ScriptedEngine

    name = f"scripted:{script}"
    d = engine_daemon.EngineDaemon(
        name, "cpu", idle_s=60, service_factory=lambda m, dev, on_state, threads: ScriptedEngine(m, dev, on_state)
    )
    assert d.bind()
    t = threading.Thread(target=d.serve_forever, daemon=True)
    t.start()
    try:
        yield name
    finally:
        d.stop()
        t.join(TIMEOUT)


@contextmanager
def remote(name: str) -> Iterator[RemoteEngine]:
    r = RemoteEngine(name, "cpu")
    try:
        r.start()
        assert r.wait_ready(TIMEOUT), r.message
        yield r
    finally:
        r.close()


def test_fills_and_edits_interleaved_on_one_connection_are_each_answered_in_kind(runtime):
    with scripted_daemon("steps=2,step_ms=1,rewrite=add>plus") as name, remote(name) as r:
        jobs = [edit_job(), FillJob(prefix="x"), edit_job(window="add(1)\n"), FillJob(prefix="y"), edit_job()]
        futs = [r.submit(j) for j in jobs]  # all sent before any answer
        got = [f.result(TIMEOUT) for f in futs]
        assert [type(g) for g in got] == [Rewrite, Fill, Rewrite, Fill, Rewrite]
        assert [g.text for g in got] == ["    return a + b\n", "x = 1", "plus(1)\n", "x = 1", "    return a + b\n"]
        assert all(not g.cancelled and g.steps == 2 for g in got)


def test_an_edit_cancelled_while_it_runs_comes_back_cancelled_and_unchanged(runtime, tmp_path):
    hold = tmp_path / "hold"
    hold.mkdir()
    with scripted_daemon(f"steps=1,step_ms=1,rewrite=return>yield,hold={hold}") as name, remote(name) as r:
        job = edit_job()
        fut = r.submit(job)
        wait_for(lambda: (hold / "started-1").exists(), TIMEOUT, "the edit to run")
        job.cancel()  # forwarded to the daemon, which cancels its job; the engine answers it
        got = fut.result(TIMEOUT)
        assert isinstance(got, Rewrite) and got.cancelled and got.text == WINDOW
        already = edit_job()
        already.cancel()  # cancelled before it was sent: answered here, unchanged
        got = r.submit(already).result(TIMEOUT)
        assert isinstance(got, Rewrite) and got.cancelled and got.text == WINDOW
        (hold / "release").write_text("")
        got = r.submit(edit_job()).result(TIMEOUT)  # the connection serves on
        assert not got.cancelled and got.text == "    yield a + b\n"


def _answer(s: socket.socket, jid: int) -> dict:
    """The daemon's answer (fill, rewrite or error) to job `jid` on a raw connection."""
    while True:
        m = wire.recv(s)
        assert m is not None, "the daemon closed the connection"
        if m.get("id") == jid and m["op"] in ("fill", "rewrite", "error"):
            return m


def test_old_style_fill_messages_and_bad_edit_messages_on_a_raw_connection(runtime):
    """A client from before next edits (fill jobs with no "type") is served as before; a bad edit job,
    an unknown job type and a cancel with a hostile id are answered with an error for that message
    only, and the connection and the daemon serve on."""
    with scripted_daemon("steps=1,step_ms=1,rewrite=a>b") as name:
        s = wire.connect(wire.place(name, "cpu").socket)
        s.settimeout(TIMEOUT)
        try:
            s.sendall(wire.encode({"op": "hello", "pid": os.getpid(), "version": 1}))
            assert wire.recv(s)["op"] == "hello"
            old = {"prefix": "def f(", "suffix": "", "max_tokens": 4}  # as a version-1 client wrote it
            s.sendall(wire.encode({"op": "submit", "id": 1, "job": old}))
            m = _answer(s, 1)
            assert m["op"] == "fill" and wire.fill_from_message(m["fill"]).text == "x = 1"
            s.sendall(wire.encode({"op": "submit", "id": 2, "job": wire.job_message(FillJob(prefix="x"))}))
            assert _answer(s, 2)["op"] == "fill"
            bad = [
                {**GOOD, "approach": "bogus"},
                {**GOOD, "max_tokens": 10**30},
                {**GOOD, "edits": [["a"]]},
                {**GOOD, "type": "teleport"},
                {"type": "edit"},
                "not a job",
            ]
            for i, job in enumerate(bad, start=10):
                s.sendall(wire.encode({"op": "submit", "id": i, "job": job}))
                m = _answer(s, i)
                assert m["op"] == "error" and "bad job" in m["message"], m
            s.sendall(wire.encode({"op": "cancel", "id": [1, 2]}) + wire.encode({"op": "cancel", "id": {"x": 1}}))
            s.sendall(wire.encode({"op": "submit", "id": 3, "job": wire.job_message(edit_job(window="a\n"))}))
            m = _answer(s, 3)
            assert m["op"] == "rewrite" and wire.rewrite_from_message(m["rewrite"]).text == "b\n"
        finally:
            s.close()
        with remote(name) as r:  # a new window of the same daemon
            st = r.status()
            assert st["counters"]["bad_messages"] >= len(bad) and st["state"] == "ready"
            assert r.submit(edit_job(window="a a\n")).result(TIMEOUT).text == "b b\n"


def test_a_daemon_older_than_next_edits_gets_no_edit_jobs(runtime):
    """A daemon that predates next edits (hello version 1, as an older install's daemon still running
    says) is sent fills only; an edit job fails at once with an error that says what to do, whether it
    was queued before the connection or submitted after."""
    place = wire.place("old-daemon", "cpu")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(place.socket))
    srv.listen(8)
    seen: list[dict] = []

    def serve():
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        with conn:
            while (m := wire.recv(conn)) is not None:
                seen.append(m)
                if m["op"] == "hello":
                    hello = {"op": "hello", "state": "ready", "info": {}, "pid": 1, "version": 1}
                    conn.sendall(wire.encode(hello))
                elif m["op"] == "submit":  # an old daemon takes any job for a fill
                    conn.sendall(
                        wire.encode({"op": "fill", "id": m["id"], "fill": wire.fill_message(Fill("", 0, 0, 1))})
                    )

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    r = RemoteEngine("old-daemon", "cpu")
    try:
        queued = r.submit(edit_job())  # before the connection: refused when the hello says version 1
        r.start()
        assert r.wait_ready(TIMEOUT)
        with pytest.raises(EngineError, match="older than next edits.*dlm-lsp engine --stop"):
            queued.result(TIMEOUT)
        late = r.submit(edit_job())
        assert late.done()  # refused here, never sent
        with pytest.raises(EngineError, match="older than next edits"):
            late.result(0)
        assert isinstance(r.submit(FillJob(prefix="x")).result(TIMEOUT), Fill)
        assert [m["op"] for m in seen] == ["hello", "submit"] and "type" not in seen[1]["job"]
    finally:
        r.close()
        srv.close()
        t.join(TIMEOUT)


# ----------------------------------------------------------------------------- a real daemon


@pytest.fixture(scope="module")
def real(runtime, tmp_path_factory):
    """(model, the in-process engine on it, a real daemon on it whose steps each sleep 50 ms)."""
    from engine.serve.service import EngineService
    from tests.tiny import make_tiny_checkpoint

    model = str(make_tiny_checkpoint(tmp_path_factory.mktemp("edits") / "tiny", printable=True))
    local = EngineService(model, device="cpu", threads=1)
    local.load()
    slow = start_slow_daemon(model, step_ms=50)
    try:
        yield model, local, slow
    finally:
        slow.kill()
        slow.wait(TIMEOUT)


def _same_rewrite(a: Rewrite, b: Rewrite) -> bool:
    timing = {"queue_ms", "compute_ms"}
    return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(Rewrite) if f.name not in timing)


def test_a_real_daemon_answers_edit_jobs_as_the_in_process_engine_does(real):
    model, local, slow = real
    with remote(model) as r:
        assert r.daemon_pid == slow.pid and r.daemon_version == wire.PROTOCOL_VERSION
        for approach in ("window", "surprise+memory", "memory"):
            want = local.run_now(edit_job(approach=approach))
            got = r.submit(edit_job(approach=approach)).result(TIMEOUT)
            assert isinstance(got, Rewrite) and _same_rewrite(got, want), (approach, got, want)
        assert got.window_tokens > 0 and want.scored is False  # "memory" alone runs no scoring forward
        # a fill and an edit in flight together on the one connection: each is answered in kind
        edit, fill = r.submit(edit_job(approach="window")), r.submit(FillJob(prefix=PREFIX, max_tokens=4))
        got_fill, got_edit = fill.result(TIMEOUT), edit.result(TIMEOUT)
        assert isinstance(got_fill, Fill) and not got_fill.cancelled and got_fill.steps >= 1
        assert isinstance(got_edit, Rewrite) and _same_rewrite(got_edit, local.run_now(edit_job(approach="window")))
        st = r.status()
        assert st["stats"]["edit_jobs"] >= 4 and st["counters"]["bad_messages"] == 0


def test_a_real_edit_cancelled_mid_run_comes_back_cancelled(real):
    model, _, _ = real
    with remote(model) as r:
        before = r.status()["stats"]
        job = EditJob(
            prefix="for i in range(10):\n", window=LONG_WINDOW, approach="window", max_tokens=256, options=LONG_OPTS
        )
        fut = r.submit(job)
        wait_for(lambda: r.status()["queue"]["running"] >= 1, TIMEOUT, "the edit to run")
        job.cancel()  # what the server does when the document changes
        got = fut.result(TIMEOUT)
        assert isinstance(got, Rewrite) and got.cancelled and got.text == LONG_WINDOW and got.changed == 0
        assert got.steps < 200  # stopped, not run to its end
        st = wait_for(
            lambda: (lambda st: st if st["queue"]["in_flight"] == 0 else None)(r.status()), TIMEOUT, "the job to leave"
        )
        assert st["stats"]["cancelled_jobs"] == before["cancelled_jobs"] + 1
        assert st["stats"]["edit_jobs"] == before["edit_jobs"] + 1


# ----------------------------------------------------------------------------- the HTTP engine


def test_the_http_engine_refuses_an_edit_job_at_once():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from engine.clients.http_engine import NO_EDITS, HttpEngine
    from tests.http_helpers import ThreadServer

    posts: list[dict] = []

    async def models(request):
        return JSONResponse({"data": [{"id": "fim"}]})

    async def completions(request):
        posts.append(await request.json())
        return JSONResponse({"choices": [{"text": "a + b"}]})

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])
    assert "FIM endpoint" in NO_EDITS and "shared or inproc" in NO_EDITS
    unstarted = HttpEngine("http://127.0.0.1:9")
    fut = unstarted.submit(edit_job())
    assert fut.done()
    with pytest.raises(EngineError, match="not a FIM endpoint"):
        fut.result(0)
    with ThreadServer(app, ready_path="/v1/models") as srv:
        e = HttpEngine(srv.url)
        try:
            e.start()
            assert e.wait_ready(TIMEOUT)
            fut = e.submit(edit_job())
            assert fut.done()  # resolved in submit: no request, no wait
            with pytest.raises(EngineError) as err:
                fut.result(0)
            assert str(err.value) == NO_EDITS
            assert e.submit(FillJob(prefix="x")).result(TIMEOUT).text == "a + b"  # fills go on
            assert len(posts) == 1 and "window" not in posts[0]
        finally:
            e.close()
