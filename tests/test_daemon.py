"""The shared engine daemon (engine/serve/daemon.py) and its client (engine/clients/remote.py), with real
processes: two serves on one engine (one model load), an engine killed mid-request, cancel and
deadline across the socket, a window that disconnects, windows racing to start the daemon, the idle
exit, and the socket's permissions. Each test has its own XDG_RUNTIME_DIR; a daemon left behind is
killed by its exact pid."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from dlm_lsp.measure.replay import LspClient
from engine.api import DecodeOptions, EngineError, Fill, FillJob
from engine.clients import wire
from engine.clients.remote import RemoteEngine
from engine.serve import daemon as engine_daemon
from tests.lsp_helpers import REAL_SERVER, inline, inline_params, insert, open_doc
from tests.tiny import make_tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120
SRC = "import os\n\n\ndef total(items):\n    s = 0\n    for x in items:\n        \n    return s\n"
URI = "file:///tmp/daemon_doc.py"
PREFIX = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("daemon") / "tiny", printable=True))


@pytest.fixture
def runtime(monkeypatch):
    """A private XDG_RUNTIME_DIR (short: socket paths have a 107-byte limit); daemons still running
    at the end are killed by pid."""
    d = Path(tempfile.mkdtemp(prefix="dlmrt-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    monkeypatch.setenv("DLM_ENGINE_IDLE_S", "60")  # a daemon a failed test leaves behind exits on its own
    yield d
    for st in engine_daemon.ask_all("status"):
        _kill(st["pid"])
    shutil.rmtree(d, ignore_errors=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie. The process may be reaped between the open and the read,
    which the read reports as ESRCH (ProcessLookupError), not as a missing file."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def wait_for(pred, timeout: float = TIMEOUT, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def long_job(n: int = 200, deadline: float | None = None) -> FillJob:
    """A job of exactly n steps (one slot per step, nothing ends it early)."""
    opts = DecodeOptions(selection="topk", steps=n, heal=False, window=0, pad_left=False, pad_stop=1.1)
    return FillJob(prefix=PREFIX, max_tokens=n, options=opts, deadline=deadline)


def start_slow_daemon(model: str, step_ms: int = 50) -> subprocess.Popen:
    """A real daemon whose steps each sleep step_ms (tests/slow_engine.py), listening when this returns."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "slow_engine.py"), "--model", model, "--device", "cpu"],
        env=dict(os.environ, DLM_TEST_STEP_MS=str(step_ms)),
        cwd=str(REPO),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    path = wire.place(model, "cpu").socket
    wait_for(lambda: proc.poll() is not None or engine_daemon.alive(path), what="the slow daemon to listen")
    assert proc.poll() is None, f"the slow daemon exited with {proc.returncode}"
    return proc


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


# ----------------------------------------------------------------------------- wire


def test_jobs_and_fills_cross_the_wire_as_json_with_a_remaining_time_deadline():
    now = time.monotonic()
    job = FillJob(
        prefix="a\u00e9\U0001f600",
        suffix="z",
        max_tokens=7,
        deadline=now + 2.5,
        context_tokens=300,
        options=DecodeOptions(threshold=0.5, window=0, seed=3),
        submitted_at=now - 0.25,
    )
    msg = wire.job_message(job, now=now)
    assert msg["remaining_s"] == pytest.approx(2.5) and msg["age_s"] == pytest.approx(0.25)
    back = wire.job_from_message(json.loads(json.dumps(msg)), now=100.0)
    assert (back.prefix, back.suffix, back.max_tokens, back.context_tokens) == ("a\u00e9\U0001f600", "z", 7, 300)
    assert back.options == job.options and back.deadline == pytest.approx(102.5)
    assert back.submitted_at == pytest.approx(99.75)
    assert wire.job_from_message({**msg, "remaining_s": None}).deadline is None
    for bad in ({**msg, "options": {"nope": 1}}, {**msg, "prefix": 3}, {**msg, "max_tokens": "7"}, [1]):
        with pytest.raises(ValueError):
            wire.job_from_message(bad)
    fill = Fill(
        text="x = 1",
        tokens=3,
        steps=2,
        slots=4,
        deadline_hit=True,
        tokens_per_step=[2, 1],
        ms_per_step=[1.5, 0.5],
        token_ids=[5, 6, 7],
        confidence=0.25,
    )
    assert wire.fill_from_message(wire.fill_message(fill)) == fill


def test_frames_are_length_prefixed_json_objects_and_bad_frames_end_the_stream():
    a, b = socket.socketpair()
    try:
        a.sendall(wire.encode({"op": "status"}) + wire.encode({"op": "x", "k": [1, "\u00e9", "a\ud800b"]}))
        assert wire.recv(b) == {"op": "status"}
        assert wire.recv(b) == {"op": "x", "k": [1, "\u00e9", "a\ud800b"]}  # a lone surrogate, as documents keep them
        a.sendall((wire.MAX_FRAME + 1).to_bytes(4, "big"))
        with pytest.raises(ValueError, match="limit"):
            wire.recv(b)
        body = b"[1, 2]"
        a.sendall(len(body).to_bytes(4, "big") + body)
        with pytest.raises(ValueError, match="object"):
            wire.recv(b)
        a.close()
        assert wire.recv(b) is None
    finally:
        b.close()


# ----------------------------------------------------------------------------- permissions


def test_runtime_dir_is_private_and_a_folder_of_another_user_is_refused(runtime, monkeypatch):
    folder = wire.runtime_dir()
    assert folder == runtime / "dlm-lsp"
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    os.chmod(folder, 0o755)
    wire.runtime_dir()
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # group/other permissions taken away
    with monkeypatch.context() as m:
        m.setattr(os, "getuid", lambda: os.geteuid() + 1)  # the folder now "belongs to someone else"
        with pytest.raises(EngineError, match="not to you"):
            wire.runtime_dir()


def test_without_xdg_runtime_dir_the_fallback_is_a_private_folder_in_tmp(monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    folder = wire.runtime_dir()
    assert folder == Path("/tmp") / f"dlm-lsp-{os.getuid()}"
    st = os.lstat(folder)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_socket_is_0600_and_a_peer_of_another_uid_is_refused(runtime, monkeypatch):
    from dlm_lsp.measure.fuzz.scripted_engine import ScriptedEngine

    name = "scripted:steps=2,step_ms=1"
    d = engine_daemon.EngineDaemon(
        name, "cpu", idle_s=60, service_factory=lambda m, dev, on_state, threads: ScriptedEngine(m, dev, on_state)
    )
    assert d.bind()
    t = threading.Thread(target=d.serve_forever, daemon=True)
    t.start()
    ok = RemoteEngine(name, "cpu")
    other = RemoteEngine(name, "cpu")
    try:
        st = os.lstat(d.place.socket)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert stat.S_IMODE(os.stat(d.place.dir).st_mode) == 0o700
        assert wire.refusal(os.getuid()) is None and "may not" in wire.refusal(os.getuid() + 1)
        ok.start()
        assert ok.wait_ready(TIMEOUT)
        assert ok.submit(FillJob(prefix="x")).result(TIMEOUT).text == "x = 1"
        real = wire.peer_uid
        monkeypatch.setattr(wire, "peer_uid", lambda s: (real(s)[0], os.getuid() + 1))  # as if another user connected
        other.start()
        assert not other.wait_ready(TIMEOUT)
        assert other.state == "error" and "refused" in other.message
        with pytest.raises(EngineError, match="refused"):
            other.submit(FillJob(prefix="x")).result(TIMEOUT)
        assert d.counters["refused"] >= 1 and other.started_daemons == 0
        assert ok.submit(FillJob(prefix="y")).result(TIMEOUT).text == "x = 1"  # the user's window is unaffected
    finally:
        ok.close()
        other.close()
        d.stop()
        t.join(TIMEOUT)
    assert not d.place.socket.exists()


# ----------------------------------------------------------------------------- real processes


async def test_two_serve_processes_share_one_engine_and_both_survive_its_death(model, runtime, tmp_path):
    env = dict(os.environ, DLM_ENGINE="shared")
    opts = {"model": model, "device": "cpu", "postprocess": False, "budgetMs": 60000}
    logs = [open(tmp_path / f"serve{i}.log", "wb") for i in range(2)]
    clients = [LspClient(REAL_SERVER, env=env, cwd=str(REPO), stderr=logs[i]) for i in range(2)]
    try:
        await asyncio.gather(*(c.start() for c in clients))  # both start at once: one daemon must come of it
        await asyncio.gather(*(c.initialize(opts) for c in clients))
        await asyncio.gather(*(c.wait_ready(TIMEOUT) for c in clients))
        for c in clients:
            open_doc(c, URI, SRC)
        answers = await asyncio.gather(*(inline(c, URI, 6, 8, timeout=TIMEOUT) for c in clients))
        assert all(a and a[0]["insertText"] for a in answers), answers

        found = engine_daemon.ask_all("status")
        assert len(found) == 1, found
        st = found[0]
        assert st["loads"] == 1 and st["state"] == "ready"
        assert {w["pid"] for w in st["windows"]} == {c.proc.pid for c in clients}
        assert st["stats"]["jobs"] >= 2
        assert len(list((runtime / "dlm-lsp").glob("engine-*.sock"))) == 1
        # the thin serves never load torch (that is the memory saved); the daemon does
        assert not any(_maps_torch(c.proc.pid) for c in clients)
        assert _maps_torch(st["pid"])
        serves = [_rss_mb(c.proc.pid) for c in clients]
        print(f"\nRSS MB: daemon {_rss_mb(st['pid']):.0f}, serves {serves[0]:.0f} + {serves[1]:.0f}")

        _kill(st["pid"])  # the engine dies: both windows notice, one new daemon comes up

        def restarted():
            now = engine_daemon.ask_all("status")
            return (
                now
                if (
                    len(now) == 1
                    and now[0]["pid"] != st["pid"]
                    and now[0]["state"] == "ready"
                    and len(now[0]["windows"]) == 2
                )
                else None
            )

        again = (await asyncio.to_thread(wait_for, restarted, TIMEOUT, "a restarted engine"))[0]
        assert again["loads"] == 1
        for c in clients:
            insert(c, URI, 2, 0, 0, "x = 0\n")  # so the next fill is not the rest of the one shown
            for _ in range(200):  # the window's state goes loading -> ready; requests in between answer empty
                items = await inline(c, URI, 7, 8, timeout=TIMEOUT)
                if items:
                    break
                await asyncio.sleep(0.2)
            assert items and items[0]["insertText"]
        assert engine_daemon.ask_all("status")[0]["stats"]["jobs"] >= 2
    finally:
        await asyncio.gather(*(c.stop() for c in clients))
        for f in logs:
            f.close()


def test_engine_killed_mid_request_fails_it_and_a_restarted_engine_serves_the_next(model, runtime):
    slow = start_slow_daemon(model, step_ms=50)
    r = RemoteEngine(model, "cpu")
    try:
        r.start()
        assert r.wait_ready(TIMEOUT) and r.daemon_pid == slow.pid and r.started_daemons == 0
        fut = r.submit(long_job(200))
        wait_for(lambda: r.status()["stats"]["forwards"] >= 1, what="the job to run")
        slow.kill()
        slow.wait(TIMEOUT)
        with pytest.raises(EngineError, match="engine died"):
            fut.result(TIMEOUT)
        fill = r.submit(FillJob(prefix=PREFIX, max_tokens=4)).result(TIMEOUT)
        assert not fill.cancelled and fill.steps >= 1
        assert r.daemon_pid != slow.pid and r.connections == 2 and r.started_daemons == 1
        assert r.status()["loads"] == 1
    finally:
        r.close()
        slow.kill()
        slow.wait(TIMEOUT)


def test_cancel_and_deadline_work_across_the_socket(model, runtime):
    slow = start_slow_daemon(model, step_ms=50)
    r = RemoteEngine(model, "cpu")
    try:
        r.start()
        assert r.wait_ready(TIMEOUT)
        job = long_job(200)
        fut = r.submit(job)
        wait_for(lambda: r.status()["stats"]["forwards"] >= 2, what="the job to run")
        job.cancel()  # what the scheduler does (latest-wins, didChange, a late answer)
        # the cancel was sent before this request, on the same connection: the daemon has set it
        forwards_at_cancel = r.status()["stats"]["forwards"]
        fill = fut.result(TIMEOUT)
        assert fill.cancelled and fill.steps < fill.slots == 200
        assert fill.steps <= forwards_at_cancel + 1  # the step running when it was cancelled, no more
        st = r.status()
        assert st["stats"]["cancelled_jobs"] == 1 and st["queue"]["in_flight"] == 0

        fill = r.submit(long_job(200, deadline=time.monotonic() + 1.0)).result(TIMEOUT)
        assert fill.deadline_hit and not fill.cancelled and fill.steps < 200 and fill.tokens > 0

        already = long_job(8)
        already.cancel()
        fill = r.submit(already).result(TIMEOUT)
        assert fill.cancelled and fill.steps == 0
    finally:
        r.close()
        slow.kill()
        slow.wait(TIMEOUT)


def test_a_window_that_disconnects_has_its_jobs_cancelled(model, runtime):
    slow = start_slow_daemon(model, step_ms=50)
    watcher = RemoteEngine(model, "cpu")
    s = wire.connect(wire.place(model, "cpu").socket)
    try:
        watcher.start()
        assert watcher.wait_ready(TIMEOUT)
        s.sendall(wire.encode({"op": "hello", "pid": os.getpid()}))
        assert wire.recv(s)["op"] == "hello"
        s.sendall(wire.encode({"op": "submit", "id": 1, "job": wire.job_message(long_job(200))}))
        wait_for(lambda: watcher.status()["stats"]["forwards"] >= 1, what="the job to run")
        s.close()  # the window goes away mid-job
        st = wait_for(
            lambda: (lambda st: st if st["stats"]["cancelled_jobs"] == 1 else None)(watcher.status()),
            what="the job to be cancelled",
        )
        assert st["counters"]["disconnect_cancels"] == 1 and st["stats"]["steps"] < 200
        assert len(st["windows"]) == 1
    finally:
        s.close()
        watcher.close()
        slow.kill()
        slow.wait(TIMEOUT)


def test_windows_racing_to_start_the_engine_end_with_one_and_it_exits_when_idle(model, runtime):
    windows = [RemoteEngine(model, "cpu", idle_s=1.0) for _ in range(3)]
    try:
        barrier = threading.Barrier(len(windows))
        threads = [threading.Thread(target=lambda w=w: (barrier.wait(), w.start())) for w in windows]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert all(w.wait_ready(TIMEOUT) for w in windows)
        pids = {w.daemon_pid for w in windows}
        assert len(pids) == 1 and sum(w.started_daemons for w in windows) == 1
        st = windows[0].status()
        assert st["loads"] == 1 and len(st["windows"]) == 3
        fills = [w.submit(long_job(200)) for w in windows]  # together: one worker batches them
        assert all(f.result(TIMEOUT).steps == 200 for f in fills)
        st = windows[0].status()
        assert st["stats"]["jobs"] == 3 and st["stats"]["max_batch_seen"] >= 2 and st["stats"]["batched_steps"] > 0
    finally:
        for w in windows:
            w.close()
    pid = pids.pop()
    wait_for(lambda: _gone(pid), what="the idle daemon to exit")
    assert not list((runtime / "dlm-lsp").glob("engine-*.sock"))


def test_engine_status_command_reports_the_running_daemon(model, runtime):
    r = RemoteEngine(model, "cpu")
    try:
        r.start()
        assert r.wait_ready(TIMEOUT)
        r.submit(FillJob(prefix=PREFIX, max_tokens=4)).result(TIMEOUT)
        out = subprocess.run(
            [sys.executable, "-m", "dlm_lsp", "engine", "--status"],
            capture_output=True,
            text=True,
            cwd=str(REPO),
            timeout=TIMEOUT,
        )
        assert out.returncode == 0, out.stderr
        assert f"engine pid {r.daemon_pid}" in out.stdout and "model loads 1" in out.stdout
        assert f"pid {os.getpid()}" in out.stdout and "jobs 1" in out.stdout
    finally:
        r.close()
    (runtime / "empty").mkdir()
    none = subprocess.run(
        [sys.executable, "-m", "dlm_lsp", "engine", "--status"],
        capture_output=True,
        text=True,
        cwd=str(REPO),
        timeout=TIMEOUT,
        env=dict(os.environ, XDG_RUNTIME_DIR=str(runtime / "empty")),
    )
    assert none.returncode == 1 and "no engine running" in none.stdout


async def test_latest_wins_across_the_socket(model, runtime):
    from dlm_lsp.scheduler import Scheduler, Superseded

    slow = start_slow_daemon(model, step_ms=50)
    r = RemoteEngine(model, "cpu")
    try:
        r.start()
        assert await asyncio.to_thread(r.wait_ready, TIMEOUT)
        sched = Scheduler(r.submit)
        old = sched.begin(URI, 1, 60_000)
        run_old = asyncio.ensure_future(sched.run(old, long_job(200)))
        await asyncio.to_thread(wait_for, lambda: r.status()["stats"]["forwards"] >= 1, TIMEOUT, "the job to run")
        new = sched.begin(URI, 2, 60_000)  # the user typed on: the older request is superseded
        with pytest.raises(Superseded):
            await run_old
        fill = await sched.run(new, FillJob(prefix=PREFIX, max_tokens=4))
        assert not fill.cancelled and fill.steps >= 1

        def old_cancelled():
            st = r.status()
            return st if st["stats"]["cancelled_jobs"] == 1 else None

        st = await asyncio.to_thread(wait_for, old_cancelled, TIMEOUT, "the superseded job to be cancelled")
        assert st["stats"]["jobs"] == 2 and st["stats"]["cancelled_steps"] < 200
    finally:
        r.close()
        slow.kill()
        slow.wait(TIMEOUT)


def test_the_default_engine_is_the_shared_one_and_inproc_is_an_option(monkeypatch):
    from dlm_lsp.options import parse_options
    from dlm_lsp.server import default_engine_factory

    monkeypatch.delenv("DLM_ENGINE", raising=False)
    assert isinstance(default_engine_factory(None, "cpu", None), RemoteEngine)  # not started: no daemon
    monkeypatch.setenv("DLM_ENGINE", "inproc")
    assert type(default_engine_factory(None, "cpu", None)).__name__ == "EngineService"
    assert isinstance(default_engine_factory(None, "cpu", None, engine="shared"), RemoteEngine)  # the option wins
    opts, warnings = parse_options({"engine": "inproc"})
    assert opts.engine == "inproc" and not warnings
    opts, warnings = parse_options({"engine": "gpu-farm"})
    assert opts.engine is None and "engine" in warnings[0]


def test_a_thin_serve_imports_no_torch():
    code = (
        "import sys; from dlm_lsp import cli; cli.build_parser('serve'); import dlm_lsp.server, engine.clients.remote; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO), timeout=TIMEOUT)
    assert out.stdout.strip() == "False", out.stderr


def test_a_model_that_does_not_load_is_an_error_for_the_window_and_the_daemon_leaves(runtime, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    r = RemoteEngine(str(broken), "cpu")

    def seen() -> str:  # what a failure shows: the client's counters and the daemons' log
        logs = "".join(p.read_text(errors="replace")[-1500:] for p in sorted(runtime.rglob("*.log")))
        return (
            f"state={r.state!r} message={r.message!r} started={r.started_daemons} connections={r.connections}\n{logs}"
        )

    try:
        r.start()
        assert not r.wait_ready(TIMEOUT), seen()
        assert r.state == "error" and "could not load" in r.message and r.started_daemons == 1, seen()
        with pytest.raises(EngineError, match="could not load"):
            r.submit(FillJob(prefix=PREFIX)).result(TIMEOUT)
        pid = r.daemon_pid
        wait_for(lambda: _gone(pid), what="the failed daemon to exit")
        assert r.state == "error" and r.connections == 1, seen()  # not restarted in a loop
    finally:
        r.close()


def test_a_failed_daemon_waits_for_a_window_to_hear_the_error(runtime, tmp_path):
    """A daemon whose model failed before any window said hello (the window that started it is slow,
    on a busy machine) stays until one has heard the error, so that window gets it and does not
    start a second daemon; once told, it leaves."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlm_lsp", "engine", "--model", str(broken), "--device", "cpu"],
        cwd=str(REPO),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    r = RemoteEngine(str(broken), "cpu")
    try:
        path = wire.place(str(broken), "cpu").socket
        wait_for(lambda: proc.poll() is not None or engine_daemon.alive(path), what="the daemon to listen")
        wait_for(
            lambda: proc.poll() is not None
            or any(st.get("state") == "error" for st in engine_daemon.ask_all("status")),
            what="the daemon's model to fail",
        )  # asking its status is not a window
        time.sleep(3.0)  # past the 2 s a failed daemon waits once a window has heard the error
        assert proc.poll() is None, "the failed daemon left before any window heard why"
        r.start()
        assert not r.wait_ready(TIMEOUT)
        assert r.state == "error" and "could not load" in r.message, r.message
        assert r.started_daemons == 0 and r.daemon_pid == proc.pid  # it found the failed daemon
        assert proc.wait(TIMEOUT) is not None  # told: it leaves
    finally:
        r.close()
        if proc.poll() is None:
            proc.kill()


async def test_a_serve_whose_engine_is_killed_mid_request_answers_it_with_an_error(model, runtime, tmp_path):
    slow = start_slow_daemon(model, step_ms=500)
    env = dict(os.environ, DLM_ENGINE="shared")
    log = open(tmp_path / "serve.log", "wb")
    c = LspClient(REAL_SERVER, env=env, cwd=str(REPO), stderr=log)
    try:
        await c.start()
        await c.initialize({"model": model, "device": "cpu", "postprocess": False, "budgetMs": 60000})
        await c.wait_ready(TIMEOUT)
        open_doc(c, URI, SRC)
        _, answer = c.send_request("textDocument/inlineCompletion", inline_params(URI, 6, 8))

        def running():
            st = engine_daemon.ask_all("status")
            return st and st[0]["stats"]["forwards"] >= 1

        await asyncio.to_thread(wait_for, running, TIMEOUT, "the fill to run")
        slow.kill()
        res = await asyncio.wait_for(answer, TIMEOUT)  # answered, not left hanging
        assert res["items"] == []
        stats = await c.request("dlm/stats", {}, timeout=TIMEOUT)
        assert stats["errors"] == 1
    finally:
        await c.stop()
        log.close()
        slow.kill()
        slow.wait(TIMEOUT)


def test_a_windows_workspace_memory_lives_in_the_daemon_and_survives_its_restart(model, runtime):
    """RemoteEngine.workspace_files puts a window's files into its own memory in the daemon; a job
    naming it fills as the in-process engine does with the same files; another window's job of
    that name does not see it; a daemon that replaced a killed one is sent the files again."""
    from engine.serve.service import EngineService

    files = {
        "w/a.py": "def add(a, b):\n    return a + b\n" * 3,
        "w/b.py": "import os\nimport sys\nimport os.path\n" * 2,
        "w/self.py": "def add(a, b):\n    return a - b\n",
    }
    local = EngineService(model, device="cpu", threads=1)
    local.load()
    local.workspace_files("w", files)
    opts = DecodeOptions(threshold=0.5, heal=False, ngram=0.0, local_ngram=0.0, workspace_ngram=8.0)
    prefixes = ["def add(a, b):\n    return ", "import os\nimport ", "def add("]

    def fills(engine, space):
        return [
            engine.submit(FillJob(prefix=p, max_tokens=6, options=opts, workspace=space, document="w/self.py"))
            .result(TIMEOUT)
            .token_ids
            for p in prefixes
        ]

    want = [
        local.run_now(FillJob(prefix=p, max_tokens=6, options=opts, workspace="w", document="w/self.py")).token_ids
        for p in prefixes
    ]
    bare = [local.run_now(FillJob(prefix=p, max_tokens=6, options=opts)).token_ids for p in prefixes]
    assert want != bare  # the memory changes these fills
    r, other = RemoteEngine(model, "cpu"), RemoteEngine(model, "cpu")
    try:
        r.start()
        assert r.wait_ready(TIMEOUT)
        assert r.workspace_files("w", files).result(TIMEOUT) == {
            "files": 3,
            "tokens": local.workspaces["w"].tokens,
            "refused": 0,
        }
        assert fills(r, "w") == want
        assert r.status()["workspaces"] == {"memories": 1, "files": 3, "tokens": local.workspaces["w"].tokens}
        other.start()
        assert other.wait_ready(TIMEOUT) and other.daemon_pid == r.daemon_pid
        assert fills(other, "w") == bare  # a window reads only its own memory
        first = r.daemon_pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: r.state == "ready" and r.daemon_pid not in (None, first), what="a new daemon")
        assert fills(r, "w") == want  # sent again on the new connection, before the jobs
        assert r.workspace_drop("w").result(TIMEOUT)["files"] == 0
        assert fills(r, "w") == bare
    finally:
        r.close()
        other.close()


def test_a_state_sent_right_after_the_hello_is_the_one_a_window_keeps(runtime):
    """A daemon whose model loads as a window connects sends hello (loading) and at once state
    (ready): the window must end ready, never take the hello's older state for the last (it did when
    the connection's reader started before the hello's state was set; a fast model load made that
    common). A fake daemon on the engine's socket, many connections."""
    place = wire.place(None, "cpu")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(place.socket))
    srv.listen(64)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                if (wire.recv(conn) or {}).get("op") != "hello":
                    continue
                conn.sendall(
                    wire.encode(
                        {"op": "hello", "state": "loading", "info": {}, "pid": 1, "version": wire.PROTOCOL_VERSION}
                    )
                    + wire.encode({"op": "state", "state": "ready", "info": {}})
                )
                while wire.recv(conn) is not None:  # until the window leaves
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for _ in range(150):
            seen: list[str] = []
            r = RemoteEngine(model=None, device="cpu", on_state=lambda s, i, seen=seen: seen.append(s))
            r.start()
            try:
                deadline = time.monotonic() + 10
                while not seen[-1:] == ["ready"] and time.monotonic() < deadline:
                    time.sleep(0.002)
                time.sleep(0.01)  # a stale state would come right after
                assert seen[-1] == "ready" and r.state == "ready", seen
            finally:
                r.close()
    finally:
        stop.set()
        srv.close()
