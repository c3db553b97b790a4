"""RemoteEngine: what `dlm-lsp serve` holds when the engine is shared - EngineService's interface
(start(), submit(job) -> Future[Fill] or, for an EditJob, Future[Rewrite], close(), on_state, state)
over one connection to the user's engine daemon (engine/serve/daemon.py), which it starts when none
is running. No torch is imported here.

- submit() sends the job and returns at once; the Future resolves when the daemon answers. Fills and
  next edits (EditJob) share everything below; a daemon older than next edits (its hello's version
  below wire.EDITS_VERSION) has its edit jobs failed here with an EngineError that says so.
- job.cancel() (the scheduler's latest-wins and deadline cancels) is forwarded: the job's cancel
  event is replaced by one that sends a cancel message when set, so the daemon's worker stops the
  job within one step, as in-process.
- The daemon's state changes (loading / ready / error) arrive as on_state calls.
- When the connection drops (the daemon crashed or was killed) every job sent on it fails with
  EngineError("engine died ..."), the state goes to loading and a new connection is made at once
  (starting a new daemon; the lock makes windows that race for it end with one). A daemon that
  ended in the error state is not restarted: as in-process, the server is restarted instead.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError

from engine.api import EditJob, EngineError, Fill, FillJob, Rewrite
from engine.clients import wire
from engine.paths import REPO_ROOT

log = logging.getLogger("dlm.remote")

CONNECT_TIMEOUT_S = 120.0  # a daemon binds its socket before it loads the model: this is process start + imports


def _resolve(fut: Future, result: object = None, exc: BaseException | None = None) -> None:
    if fut.done():
        return
    try:
        fut.set_exception(exc) if exc is not None else fut.set_result(result)
    except InvalidStateError:
        pass


class _ForwardingEvent(threading.Event):
    """A job's cancel event that also tells the daemon, the first time it is set."""

    def __init__(self, on_set: Callable[[], object]):
        super().__init__()
        self._on_set = on_set

    def set(self) -> None:
        first = not self.is_set()
        super().set()
        if first:
            self._on_set()


def _cancelled(job: FillJob | EditJob) -> Fill | Rewrite:
    """A job's answer when it is cancelled before the daemon ran it: an empty Fill, an unchanged Rewrite."""
    if isinstance(job, EditJob):
        return Rewrite(text=job.window, cancelled=True)
    return Fill(text="", tokens=0, steps=0, slots=job.max_tokens, cancelled=True)


def _old_daemon(pid: int | None, version: object) -> EngineError:
    return EngineError(
        f"the shared engine (pid {pid}) speaks protocol version {version}, older than next edits "
        f"(version {wire.EDITS_VERSION}); stop it with `dlm-lsp engine --stop` and a new one starts"
    )


def _log_tail(path: str | os.PathLike[str], n: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


WORKSPACE_PART_CHARS = 4 * 1024 * 1024  # a workspace message's texts (frames stop at wire.MAX_FRAME)


def _chunks(files: Mapping[str, str | None]) -> list[dict[str, str | None]]:
    """`files` split into parts of at most WORKSPACE_PART_CHARS characters of text (at least one part)."""
    parts: list[dict[str, str | None]] = []
    part: dict[str, str | None] = {}
    size = 0
    for k, t in files.items():
        n = len(t or "") + len(k)
        if part and size + n > WORKSPACE_PART_CHARS:
            parts.append(part)
            part, size = {}, 0
        part[k] = t
        size += n
    parts.append(part)
    return parts


class RemoteEngine:
    """A connection to the shared engine of (model, device); thread-safe submit()."""

    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        on_state: Callable[[str, dict], object] | None = None,
        threads: int | None = None,
        idle_s: float | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ):
        self.model_name, self.device_name = model, device or "auto"
        self.on_state = on_state
        self.threads, self.idle_s, self.connect_timeout = threads, idle_s, connect_timeout
        self.state = "idle"
        self.message: str | None = None
        self.daemon_pid: int | None = None
        self.daemon_version: object = None  # the protocol version the daemon's hello said (None: none)
        self.connections = 0  # connections made (1 + restarts seen)
        self.started_daemons = 0  # daemons this client spawned
        self._jobs: dict[int, list] = {}  # wire id -> [job, future, sent]
        self._status_waiters: list[Future] = []
        # workspace memories (FillJob.workspace): what was sent per space, sent again to a new daemon
        self._spaces: dict[str, dict[str, str]] = {}
        self._space_waiters: dict[int, Future] = {}  # wire id (negative: never a job's) -> its future
        self._space_ids = itertools.count(-1, -1)
        self._chan: wire.Channel | None = None
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ state

    def _set_state(self, state: str, message: str | None = None, info: dict | None = None) -> None:
        self.state, self.message = state, message
        if self.on_state is None:
            return
        out: dict[str, object] = {
            "model": str(self.model_name or "default"),
            "device": self.device_name,
            "message": message,
            "threads": None,
        }
        out.update(info or {})
        out["message"] = message
        out["engine"] = "shared"
        out["engine_pid"] = self.daemon_pid
        try:
            self.on_state(state, out)
        except Exception:  # a broken callback must not kill the connection
            log.exception("on_state callback failed")

    # ------------------------------------------------------------ lifecycle

    def start(self) -> RemoteEngine:
        """Connects (starting the daemon if none runs) on a thread of its own; returns at once."""
        with self._lock:
            if self._thread is None:
                self._set_state("loading", None)
                self._thread = threading.Thread(target=self._run, name="dlm-remote", daemon=True)
                self._thread.start()
        return self

    def close(self) -> None:
        """Ends the connection (the daemon cancels this window's jobs); jobs in flight come back cancelled."""
        self._closed.set()
        self._wake.set()
        with self._lock:
            chan, self._chan = self._chan, None
            jobs, self._jobs = list(self._jobs.values()), {}
        if chan is not None:
            chan.close()
        for job, fut, _ in jobs:
            _resolve(fut, _cancelled(job))
        self._fail_status(EngineError("the engine is shut down"))

    def wait_ready(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while self.state not in ("ready", "error") and not self._closed.is_set():
            if end is not None and time.monotonic() > end:
                break
            time.sleep(0.02)
        return self.state == "ready"

    def _run(self) -> None:
        backoff = 0.0
        while not self._closed.is_set():
            try:
                sock, hello = self._connect()
            except EngineError as e:
                log.error("shared engine unavailable: %s", e)
                self._fail_unsent(e)
                self._set_state("error", str(e))
                return
            connected_at = time.monotonic()
            chan = self._attach(sock, hello)
            while not chan.closed and not self._closed.is_set():
                self._wake.wait(1.0)
                self._wake.clear()
            if self._closed.is_set():
                return
            if self.state == "error":  # the daemon failed (load error, stuck steps) and left: as in-process
                return
            # a connection that drops soon after it was made is a daemon that keeps dying: slow down
            backoff = min(30.0, max(1.0, backoff * 2)) if time.monotonic() - connected_at < 10 else 0.0
            self._set_state("loading", "the shared engine process ended; starting a new one")
            if backoff and self._closed.wait(backoff):
                return

    def _connect(self) -> tuple[socket.socket, dict]:
        """(socket, hello) of a connection to the daemon, started if needed; raises EngineError."""
        place = wire.place(self.model_name, self.device_name)
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                sock = wire.connect(place.socket)
            except OSError:
                sock = self._start_daemon(place, deadline)
            hello = self._handshake(sock)
            if hello is not None:
                return sock, hello
            sock.close()  # a daemon that was exiting (idle) as we came: try again
            if time.monotonic() > deadline:
                raise EngineError(f"the shared engine on {place.socket} does not answer; see {place.log}")
            time.sleep(0.1)

    def _handshake(self, sock: socket.socket) -> dict | None:
        """Says hello; the daemon's hello (its state), or None when the connection ended first."""
        sock.settimeout(30.0)
        try:
            try:
                sock.sendall(wire.encode({"op": "hello", "pid": os.getpid(), "version": wire.PROTOCOL_VERSION}))
            except OSError:
                pass  # a refusing daemon may have closed already: its answer is still there to read
            while True:
                msg = wire.recv(sock)
                if msg is None:
                    return None
                if msg["op"] == "refused":
                    raise EngineError(f"the shared engine refused this connection: {msg.get('message')}")
                if msg["op"] == "hello":
                    sock.settimeout(None)
                    return msg
        except (OSError, ValueError):
            return None

    def _start_daemon(self, place: wire.Place, deadline: float) -> socket.socket:
        """Starts `dlm-lsp engine` under the lock (or finds the one another window started) and
        returns a connected socket; raises EngineError with the daemon's log when it fails."""
        fd = wire.open_lock(place.lock)
        try:
            while True:  # a window starting a daemon holds the lock until that daemon has bound
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise EngineError(f"timed out waiting for {place.lock}") from None
                    time.sleep(0.05)
            try:
                return wire.connect(place.socket)
            except OSError:
                pass
            cmd = [sys.executable, "-m", "dlm_lsp", "engine", "--device", self.device_name, "--lock-fd", str(fd)]
            if self.model_name not in (None, "", "default"):
                cmd += ["--model", wire.resolved_model(self.model_name)]
            if self.threads:
                cmd += ["--threads", str(self.threads)]
            if self.idle_s is not None:
                cmd += ["--idle-s", str(self.idle_s)]
            logfd = os.open(place.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=logfd,
                    stderr=logfd,
                    pass_fds=(fd,),
                    start_new_session=True,
                    cwd=str(REPO_ROOT),
                )
            except OSError as e:
                raise EngineError(f"could not start the shared engine ({e})") from None
            finally:
                os.close(logfd)
            self.started_daemons += 1
            threading.Thread(target=proc.wait, name="dlm-remote-reap", daemon=True).start()
            log.info("started the shared engine, pid %d (log: %s)", proc.pid, place.log)
            while True:
                try:
                    return wire.connect(place.socket)
                except OSError:
                    pass
                rc = proc.poll()
                if rc is not None:
                    raise EngineError(
                        f"the shared engine exited with code {rc} before it listened: "
                        f"{_log_tail(place.log)[-600:] or 'no log'} (log: {place.log})"
                    )
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"the shared engine did not listen within {self.connect_timeout:.0f} s; see {place.log}"
                    )
                time.sleep(0.05)
        finally:
            os.close(fd)  # releases the lock unless the daemon did already

    def _attach(self, sock: socket.socket, hello: dict) -> wire.Channel:
        """Makes the connection current, sends the jobs that waited for it, reports the daemon's state."""
        chan: wire.Channel  # its on_close names it
        chan = wire.Channel(sock, self._on_message, lambda: self._dropped(chan), name="dlm-remote")
        refused: list[list] = []
        with self._lock:
            self._chan = chan
            self.daemon_pid = hello.get("pid")
            self.daemon_version = hello.get("version")
            self.connections += 1
            for space, files in self._spaces.items():  # a new daemon learns the workspaces first
                for part in _chunks(files):
                    chan.send({"op": "workspace", "id": next(self._space_ids), "space": space, "files": part})
            for jid, entry in list(self._jobs.items()):
                if entry[2]:
                    continue
                if isinstance(entry[0], EditJob) and not self._runs_edits():
                    refused.append(self._jobs.pop(jid))
                    continue
                chan.send({"op": "submit", "id": jid, "job": wire.job_message(entry[0])})
                entry[2] = True
        for _, fut, _ in refused:
            _resolve(fut, exc=_old_daemon(self.daemon_pid, self.daemon_version))
        # the hello's state before any message read after it: a state the daemon sends next (its
        # model just loaded) must not be overwritten by the older one in the hello
        self._set_state(hello.get("state") or "loading", (hello.get("info") or {}).get("message"), hello.get("info"))
        chan.start()
        return chan

    def _dropped(self, chan: wire.Channel) -> None:
        """The connection ended: every job sent on it fails (never hangs)."""
        with self._lock:
            if self._chan is not chan:
                return
            self._chan = None
            sent = [jid for jid, e in self._jobs.items() if e[2]]
            lost = [self._jobs.pop(jid) for jid in sent]
            waiters, self._space_waiters = list(self._space_waiters.values()), {}
        if not self._closed.is_set() and self.state != "error":
            log.warning("the shared engine (pid %s) went away with %d job(s) in flight", self.daemon_pid, len(lost))
        err = EngineError("engine died: the shared engine process ended while this job ran; a new one is starting")
        for _, fut, _ in lost:
            _resolve(fut, exc=err)
        for w in waiters:  # the files are kept here and sent again on the next connection
            _resolve(w, exc=err)
        self._fail_status(err)
        self._wake.set()

    # ------------------------------------------------------------ messages

    def _on_message(self, m: dict) -> None:
        op = m.get("op")
        if op in ("workspace", "error") and isinstance(m.get("id"), int) and m["id"] < 0:
            with self._lock:
                waiter = self._space_waiters.pop(m["id"], None)
            if waiter is not None:
                _resolve(waiter, m.get("result")) if op == "workspace" else _resolve(
                    waiter, exc=EngineError(str(m.get("message") or "the shared engine refused the files"))
                )
        elif op in ("fill", "rewrite", "error") and isinstance(m.get("id"), int):
            with self._lock:
                entry = self._jobs.pop(m["id"], None)
            if entry is None:
                return
            self._answer(entry[0], entry[1], m)
        elif op == "state":
            info = m.get("info") or {}
            self._set_state(str(m.get("state")), info.get("message"), info)
        elif op == "status":
            with self._lock:
                waiter = self._status_waiters.pop(0) if self._status_waiters else None
            if waiter is not None:
                _resolve(waiter, m)

    def _answer(self, job: FillJob | EditJob, fut: Future, m: dict) -> None:
        """Resolves a job's future with the daemon's answer: a Fill for a fill job, a Rewrite for an
        edit job; an error, or an answer of the other kind, fails that job only."""
        op, edit = m.get("op"), isinstance(job, EditJob)
        if op == "error":
            _resolve(fut, exc=EngineError(str(m.get("message") or "the shared engine failed this job")))
        elif op == "fill" and not edit:
            try:
                _resolve(fut, wire.fill_from_message(m.get("fill") or {}))
            except TypeError as e:
                _resolve(fut, exc=EngineError(f"bad fill from the shared engine: {e}"))
        elif op == "rewrite" and edit:
            try:
                _resolve(fut, wire.rewrite_from_message(m.get("rewrite")))
            except (TypeError, ValueError) as e:
                _resolve(fut, exc=EngineError(f"bad rewrite from the shared engine: {e}"))
        else:
            kind = "an edit" if edit else "a fill"
            _resolve(fut, exc=EngineError(f"the shared engine answered {kind} job with {op!r}"))

    def _runs_edits(self) -> bool:
        """True when the connected daemon's protocol runs edit jobs (its hello's version)."""
        v = self.daemon_version
        return isinstance(v, int) and not isinstance(v, bool) and v >= wire.EDITS_VERSION

    def _fail_unsent(self, err: EngineError) -> None:
        with self._lock:
            unsent = [jid for jid, e in self._jobs.items() if not e[2]]
            lost = [self._jobs.pop(jid) for jid in unsent]
        for _, fut, _ in lost:
            _resolve(fut, exc=err)

    def _fail_status(self, err: EngineError) -> None:
        with self._lock:
            waiters, self._status_waiters = self._status_waiters, []
        for w in waiters:
            _resolve(w, exc=err)

    # ------------------------------------------------------------ jobs

    def submit(self, job: FillJob | EditJob) -> Future:
        """Sends a job; the future resolves to a Fill (an EditJob: a Rewrite; cancelled ones too) or
        raises EngineError."""
        fut: Future = Future()
        if self._closed.is_set():
            fut.set_exception(EngineError("the engine is shut down"))
            return fut
        if self.state == "error":
            fut.set_exception(EngineError(self.message or "the shared engine failed"))
            return fut
        jid = job.job_id
        was_cancelled = job.cancel_event.is_set()
        forwarding = _ForwardingEvent(lambda: self._cancel(jid))
        if was_cancelled:
            threading.Event.set(forwarding)
        job.cancel_event = forwarding
        with self._lock:
            if isinstance(job, EditJob) and self._chan is not None and not self._runs_edits():
                fut.set_exception(_old_daemon(self.daemon_pid, self.daemon_version))
                return fut
            self._jobs[jid] = entry = [job, fut, False]
            if self._chan is not None and not was_cancelled:
                entry[2] = self._chan.send({"op": "submit", "id": jid, "job": wire.job_message(job)})
        if was_cancelled:
            self._cancel(jid)
        fut.add_done_callback(lambda f: self._cancel(jid) if f.cancelled() else None)
        return fut

    def _cancel(self, jid: int) -> None:
        """Forwards a job's cancel; a job not sent yet is answered here, cancelled."""
        with self._lock:
            entry = self._jobs.get(jid)
            if entry is None:
                return
            if entry[2] and self._chan is not None:
                self._chan.send({"op": "cancel", "id": jid})
                return
            if entry[2]:
                return  # its connection is gone: _dropped answers it
            del self._jobs[jid]
        _resolve(entry[1], _cancelled(entry[0]))

    def workspace_files(self, space: str, files: Mapping[str, str | None]) -> Future:
        """EngineService.workspace_files on the shared engine: the files ({key: text or None}) go
        into this window's memory `space` there (kept here too, and sent again to a daemon that
        replaced a dead one). The future resolves to the last part's result, or raises EngineError.
        Jobs sent meanwhile read the memory as it was: counting takes the daemon seconds."""
        fut: Future = Future()
        with self._lock:
            kept = self._spaces.setdefault(space, {})
            for k, t in files.items():
                if t is None:
                    kept.pop(k, None)
                else:
                    kept[k] = t
            chan = self._chan
            if chan is None:  # sent with the rest when the connection comes
                _resolve(fut, {"files": len(kept), "queued": True})
                return fut
            parts = _chunks(files)
            for i, part in enumerate(parts):
                wid = next(self._space_ids)
                if i == len(parts) - 1:
                    self._space_waiters[wid] = fut
                chan.send({"op": "workspace", "id": wid, "space": space, "files": part})
        return fut

    def workspace_drop(self, space: str) -> Future:
        """Forgets `space` here and empties it in the daemon (which drops it with the connection);
        the future resolves when the daemon has."""
        with self._lock:
            files = self._spaces.get(space) or {}
        fut = self.workspace_files(space, dict.fromkeys(files))
        with self._lock:
            self._spaces.pop(space, None)
        return fut

    def status(self, timeout: float = 10.0) -> dict:
        """The daemon's status (what `dlm-lsp engine --status` prints); raises EngineError."""
        waiter: Future = Future()
        with self._lock:
            chan = self._chan
            if chan is None:
                raise EngineError("not connected to the shared engine")
            self._status_waiters.append(waiter)
            chan.send({"op": "status"})
        try:
            return waiter.result(timeout)
        except TimeoutError:
            raise EngineError("the shared engine did not answer a status request") from None
