"""`dlm-lsp engine`: one resident EngineService per (user, model, device), shared by every editor
window over a Unix socket (engine/clients/wire.py says where, and what the messages are).

Each window's `dlm-lsp serve` holds one connection (engine/clients/remote.py). The daemon runs each job it
is sent (a fill, or a next edit: an EditJob, answered with its Rewrite) on its one EngineService, so
jobs of every window share its batches; a message it cannot read is answered with an error for that
message only, never by ending the connection or the daemon; a cancel message cancels the job (the
worker stops it within one step, as in-process); a window whose connection ends has its jobs
cancelled. State changes (loading / ready / error) go to every window. A peer of another uid is
refused (SO_PEERCRED). With no window connected for `idle_s` the daemon exits.

Starting is race-free: binding the socket happens under an fcntl.flock on the daemon's lock file,
after a check that no live daemon answers on it; a serve that starts a daemon takes the lock first
and hands the locked descriptor to the child, so a second serve waits until the socket is bound
and then connects instead of starting another. The idle exit takes the same lock, so a daemon never
removes a socket a new one has just bound.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

from engine.api import EditJob, EngineError, FillJob, Rewrite
from engine.clients import wire

log = logging.getLogger("dlm.daemon")

IDLE_S = 600.0
# a daemon whose model failed leaves 2 s after a window has been told, or after this long when none
# has: the window that started it may not have said hello yet on a busy machine, and finding no
# daemon it would start another
ERROR_WAIT_S = 30.0


def alive(path: Path) -> bool:
    """True when a daemon accepts connections on `path`."""
    try:
        wire.connect(path, timeout=2.0).close()
        return True
    except OSError:
        return False


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Service(Protocol):
    """What the daemon runs jobs on: EngineService (engine/serve/service.py), or a test's stand-in."""

    def start(self) -> object: ...

    def close(self) -> None: ...

    def submit(self, job: FillJob | EditJob) -> Future: ...

    def workspace_files(self, space: str, files: dict) -> dict: ...

    def workspace_drop(self, space: str) -> None: ...


# (model, device, on_state, threads) -> the service (tests script one)
ServiceFactory = Callable[[str | None, str, Callable[[str, dict], None], int | None], Service]


class _Client:
    """One connection; a `window` once it said hello (a status query or a probe never does)."""

    def __init__(self, sock: socket.socket, pid: int):
        self.pid, self.since = pid, time.monotonic()
        self.window = False
        self.jobs: dict[int, FillJob | EditJob] = {}  # wire id -> job in flight
        self.submitted = 0
        self.lock = threading.Lock()
        self.closed = False
        self.channel: wire.Channel | None = None
        self.spaces: set[str] = set()  # workspace memories this connection named (dropped when it ends)
        self.space_lock = threading.Lock()  # one workspace update of a connection at a time, in order

    def send(self, msg: dict) -> bool:
        """Queues `msg` on the connection (Channel.send); its channel is attached before it reads."""
        if self.channel is None:
            raise EngineError("the connection has no channel yet")
        return self.channel.send(msg)


class EngineDaemon:
    """The socket server around one EngineService."""

    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        threads: int | None = None,
        idle_s: float = IDLE_S,
        place: wire.Place | None = None,
        service_factory: ServiceFactory | None = None,
    ):
        self.model, self.device, self.threads, self.idle_s = model, device, threads, idle_s
        self.place = place or wire.place(model, device)
        self.service_factory = service_factory
        self.service: Service | None = None
        self.state, self.info = "idle", {"model": str(model or "default"), "device": device, "message": None}
        self.loads = 0
        self.counters = {"windows": 0, "refused": 0, "disconnect_cancels": 0, "bad_messages": 0}
        self._clients: set[_Client] = set()
        self._lock = threading.Lock()
        # orders a window's hello after or before a state change, never between the state's change
        # and its broadcast (the window would take the hello's older state for the last)
        self._state_lock = threading.Lock()
        self._told_error = threading.Event()  # a window got the error state (its hello, or the broadcast)
        self._stop = threading.Event()
        self._idle_since = time.monotonic()
        self._listener: socket.socket | None = None
        self._inode: int | None = None
        self.started = time.monotonic()

    # ------------------------------------------------------------ binding and exit

    def bind(self, lock_fd: int | None = None) -> bool:
        """Binds the socket (0600) under the lock; False when a live daemon already has it."""
        fd = lock_fd if lock_fd is not None else wire.open_lock(self.place.lock)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # already ours when a serve handed it over
            path = self.place.socket
            if alive(path):
                return False
            try:
                os.unlink(path)  # a dead daemon's socket
            except FileNotFoundError:
                pass
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)  # the socket is 0600 from birth, not after a chmod
            try:
                s.bind(str(path))
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
            s.listen(64)
            self._listener, self._inode = s, os.stat(path).st_ino
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _bound(self) -> socket.socket:
        """The listening socket (bind() made it)."""
        if self._listener is None:
            raise EngineError("the daemon's socket is not bound (bind() first)")
        return self._listener

    def _engine(self) -> Service:
        """The service jobs run on (serve_forever starts it before it accepts a connection)."""
        if self.service is None:
            raise EngineError("the daemon's engine is not started (serve_forever)")
        return self.service

    def _unlink_own_socket(self) -> None:
        try:
            if os.stat(self.place.socket).st_ino == self._inode:
                os.unlink(self.place.socket)
        except FileNotFoundError:
            pass

    def _idle_exit(self) -> bool:
        """Exits (returns True) when no window has been connected for idle_s; under the lock."""
        with self._lock:
            if self._has_windows() or time.monotonic() - self._idle_since < self.idle_s:
                return False
        fd = wire.open_lock(self.place.lock)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            listener = self._bound()
            listener.settimeout(0)
            try:  # a serve that connected just now keeps the daemon
                conn, _ = listener.accept()
                self._admit(conn)
                return False
            except (TimeoutError, BlockingIOError):
                pass
            finally:
                listener.settimeout(0.5)
            with self._lock:
                if self._has_windows():
                    return False
            log.info("no window for %.0f s: the engine exits", self.idle_s)
            self._unlink_own_socket()
            listener.close()
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _has_windows(self) -> bool:
        return any(c.window for c in self._clients)

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------ running

    def _make_service(self) -> Service:
        if self.service_factory is not None:
            return self.service_factory(self.model, self.device, self._on_state, self.threads)
        from engine.serve.service import EngineService  # torch: only in the daemon

        return EngineService(model=self.model, device=self.device, on_state=self._on_state, threads=self.threads)

    def serve_forever(self) -> None:
        """Accepts windows until stop() or the idle exit; the socket must be bound."""
        self.service = service = self._make_service()
        service.start()
        listener = self._bound()
        listener.settimeout(0.5)
        log.info(
            "engine daemon %d on %s (model %s, device %s)",
            os.getpid(),
            self.place.socket,
            self.model or "default",
            self.device,
        )
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    if self._idle_exit():
                        return
                    continue
                except OSError:
                    if self._stop.is_set():
                        return
                    raise
                self._admit(conn)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        # the socket goes first: a window that reconnects at once must not land in a dead backlog
        if self._listener is not None:
            try:
                self._unlink_own_socket()
                self._listener.close()
            except OSError:
                pass
        with self._lock:
            clients = list(self._clients)
        for c in clients:
            if c.channel is not None:
                c.channel.flush_and_close(timeout=1.0)
        if self.service is not None:
            self.service.close()

    def _on_state(self, state: str, info: dict) -> None:
        """EngineService's callback: remembered for late windows and sent to every window."""
        if state == "loading":
            self.loads += 1
        with self._state_lock:
            self.state, self.info = state, dict(info or {})
            told = self._broadcast({"op": "state", "state": state, "info": self.info})
        if state == "error":
            # the model failed to load, or steps kept sticking: the windows keep the error (as
            # in-process, a server restart retries) and the next window starts a fresh daemon
            log.error(
                "engine in the error state (%s): the daemon exits; its windows keep the error", self.info.get("message")
            )
            if told:
                self._told_error.set()
            threading.Thread(target=self._exit_after_error, name="dlm-daemon-error-exit", daemon=True).start()

    def _exit_after_error(self) -> None:
        """Exits 2 s after a window has been told of the error (ERROR_WAIT_S at most without one)."""
        self._told_error.wait(ERROR_WAIT_S)
        time.sleep(2.0)
        self._exit_now()

    def _exit_now(self) -> None:
        self.stop()
        try:
            self._unlink_own_socket()
            self._bound().close()  # wakes accept()
        except OSError:
            pass

    def _broadcast(self, msg: dict) -> int:
        """Sends `msg` to every window; returns how many."""
        with self._lock:
            clients = [c for c in self._clients if c.window]
        for c in clients:
            c.send(msg)
        return len(clients)

    # ------------------------------------------------------------ one connection

    def _admit(self, conn: socket.socket) -> None:
        pid, uid = wire.peer_uid(conn)
        why = wire.refusal(uid)
        if why is not None:
            log.warning("connection from pid %d refused: %s", pid, why)
            with self._lock:
                self.counters["refused"] += 1
            try:
                conn.settimeout(1.0)
                conn.sendall(wire.encode({"op": "refused", "message": why}))
            except OSError:
                pass
            conn.close()
            return
        client = _Client(conn, pid)
        client.channel = channel = wire.Channel(
            conn,
            lambda m: self._on_message(client, m),
            lambda: self._on_close(client),
            name=f"dlm-daemon-{pid}",
        )
        with self._lock:
            self._clients.add(client)
        channel.start()

    def _on_close(self, c: _Client) -> None:
        """A connection ended: its jobs are cancelled (the worker drops them within one step)."""
        with c.lock:
            c.closed = True
            jobs = list(c.jobs.values())
        for job in jobs:
            job.cancel()
        with c.lock:
            spaces, c.spaces = c.spaces, set()
        for space in spaces:  # its workspace memories
            self._engine().workspace_drop(space)
        with self._lock:
            self._clients.discard(c)
            self.counters["disconnect_cancels"] += len(jobs)
            if not self._has_windows():
                self._idle_since = time.monotonic()
        if c.window:
            log.info("window pid %d left%s", c.pid, f"; {len(jobs)} job(s) cancelled" if jobs else "")

    def _on_message(self, c: _Client, m: dict) -> None:
        """One message of a connection; one it cannot read is answered with an error and counted,
        and the connection goes on (an exception here would end its reader)."""
        try:
            self._dispatch(c, m)
        except Exception as e:  # noqa: BLE001 - a hostile or broken message fails itself only
            log.warning("bad message from pid %d: %s", c.pid, e)
            with self._lock:
                self.counters["bad_messages"] += 1
            jid = m.get("id")
            c.send({"op": "error", "id": jid if isinstance(jid, int) else None, "message": f"bad message: {e}"[:500]})

    def _dispatch(self, c: _Client, m: dict) -> None:
        op = m.get("op")
        if op == "hello":
            with self._state_lock:
                with self._lock:
                    c.window = True
                    self.counters["windows"] += 1
                state = self.state
                c.send(
                    {
                        "op": "hello",
                        "state": state,
                        "info": self.info,
                        "pid": os.getpid(),
                        "version": wire.PROTOCOL_VERSION,
                    }
                )
            if state == "error":
                self._told_error.set()
        elif op == "submit":
            self._submit(c, m)
        elif op == "cancel":
            jid = m.get("id")
            with c.lock:
                job = c.jobs.get(jid) if isinstance(jid, int) else None
            if job is not None:
                job.cancel()
        elif op == "workspace":
            self._workspace(c, m)
        elif op == "status":
            c.send(self.status())
        elif op == "stop":
            log.info("stop asked by pid %d", c.pid)
            self._exit_now()
        else:
            with self._lock:
                self.counters["bad_messages"] += 1
            c.send({"op": "error", "id": m.get("id"), "message": f"unknown op {op!r}"})

    @staticmethod
    def _space(c: _Client, name: str) -> str:
        """A connection's workspace memory name in the service: its own, never another window's."""
        return f"{c.pid}:{id(c)}:{name}"

    def _workspace(self, c: _Client, m: dict) -> None:
        """workspace {id, space, files: {key: text or null}}: the files go into the connection's
        memory `space` (EngineService.workspace_files) on a thread of their own (tokenizing and
        counting take seconds; the connection's jobs and cancels go on meanwhile), in the order
        sent; answered workspace {id, result} or error {id, message}."""
        jid, space, files = m.get("id"), m.get("space"), m.get("files")
        if (
            not isinstance(space, str)
            or not space
            or not isinstance(files, dict)
            or any(not isinstance(k, str) or not (v is None or isinstance(v, str)) for k, v in files.items())
        ):
            c.send({"op": "error", "id": jid, "message": "bad workspace message: space and {key: text or null} files"})
            return
        full = self._space(c, space)
        with c.lock:
            c.spaces.add(full)

        def run() -> None:
            with c.space_lock:
                if c.closed:
                    return
                try:
                    result = self._engine().workspace_files(full, files)
                except Exception as e:  # noqa: BLE001 - the window hears why; the daemon goes on
                    c.send({"op": "error", "id": jid, "message": str(e) or type(e).__name__})
                    return
                if c.closed:  # the window left while its files were counted
                    self._engine().workspace_drop(full)
            c.send({"op": "workspace", "id": jid, "result": result})

        threading.Thread(target=run, name="dlm-daemon-workspace", daemon=True).start()

    def _submit(self, c: _Client, m: dict) -> None:
        jid = m.get("id")
        if not isinstance(jid, int):
            with self._lock:
                self.counters["bad_messages"] += 1
            return
        try:
            job = wire.any_job_from_message(m.get("job"))
        except (ValueError, TypeError) as e:
            with self._lock:
                self.counters["bad_messages"] += 1
            c.send({"op": "error", "id": jid, "message": f"bad job: {e}"})
            return
        if isinstance(job, FillJob) and job.workspace is not None:  # the connection's own memory of that name
            job.workspace = self._space(c, job.workspace)
        with c.lock:
            c.jobs[jid] = job
            c.submitted += 1
            gone = c.closed
        if gone:
            job.cancel()
        fut = self._engine().submit(job)
        fut.add_done_callback(lambda f: self._done(c, jid, f))

    def _done(self, c: _Client, jid: int, fut: Future) -> None:
        """Engine thread: sends the job's outcome (the channel's writer does the writing)."""
        with c.lock:
            c.jobs.pop(jid, None)
        if fut.cancelled():
            c.send({"op": "error", "id": jid, "message": "the job was cancelled"})
            return
        e = fut.exception()
        if e is not None:
            c.send({"op": "error", "id": jid, "message": str(e) or type(e).__name__})
            return
        result = fut.result()
        try:
            if isinstance(result, Rewrite):
                c.send({"op": "rewrite", "id": jid, "rewrite": wire.rewrite_message(result)})
            else:
                c.send({"op": "fill", "id": jid, "fill": wire.fill_message(result)})
        except Exception as e:  # noqa: BLE001 - an answer that cannot be sent (too big): the job fails, never hangs
            c.send({"op": "error", "id": jid, "message": f"the job's answer could not be sent: {e}"[:500]})

    def status(self) -> dict:
        """Model, state, windows, queue and counters (what `dlm-lsp engine --status` prints)."""
        svc = self.service
        with self._lock:
            windows = [
                {
                    "pid": c.pid,
                    "in_flight": len(c.jobs),
                    "jobs": c.submitted,
                    "connected_s": round(time.monotonic() - c.since, 1),
                }
                for c in self._clients
                if c.window
            ]
        inbox = getattr(svc, "_inbox", None)
        running = getattr(svc, "_jobs", None)
        spaces = dict(getattr(svc, "workspaces", None) or {})  # the windows' workspace memories
        return {
            "op": "status",
            "pid": os.getpid(),
            "socket": str(self.place.socket),
            "model": str(self.model or "default"),
            "resolved_model": wire.resolved_model(self.model),
            "device": str(self.info.get("device") or self.device),
            "state": self.state,
            "message": self.info.get("message"),
            "threads": self.info.get("threads"),
            "uptime_s": round(time.monotonic() - self.started, 1),
            "idle_exit_s": self.idle_s,
            "loads": self.loads,
            "windows": windows,
            "queue": {
                "queued": inbox.qsize() if inbox is not None else None,
                "running": len(running) if running is not None else None,
                "in_flight": sum(w["in_flight"] for w in windows),
            },
            "stats": dict(getattr(svc, "stats", {}) or {}),
            "counters": dict(self.counters),
            "rss_mb": _rss_mb(),
            "workspaces": {
                "memories": len(spaces),
                "files": sum(len(m) for m in spaces.values()),
                "tokens": sum(m.tokens for m in spaces.values()),
            },
        }


# ---------------------------------------------------------------------- CLI


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder or local HF repo id (default: the embedded model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: DLM_THREADS, else the free cores)"
    )
    p.add_argument(
        "--idle-s",
        type=float,
        default=None,
        help=f"exit after this many seconds with no window connected (default {IDLE_S:.0f}, or DLM_ENGINE_IDLE_S)",
    )
    p.add_argument(
        "--status", action="store_true", help="show every running engine of this user (model, windows, queue, counters)"
    )
    p.add_argument("--stop", action="store_true", help="stop every running engine of this user")
    p.add_argument("--json", action="store_true", help="with --status: print JSON")
    p.add_argument("--lock-fd", type=int, default=None, help=argparse.SUPPRESS)  # a starting serve's locked lock file


def idle_default() -> float:
    try:
        return float(os.environ.get("DLM_ENGINE_IDLE_S", "") or IDLE_S)
    except ValueError:
        return IDLE_S


def ask_all(op: str) -> list[dict]:
    """Sends `op` to every daemon in the runtime folder; their answers (status) or {} (stop)."""
    out: list[dict] = []
    folder = wire.runtime_dir(create=False)
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("engine-*.sock")):
        try:
            s = wire.connect(path, timeout=2.0)
        except OSError:
            continue
        try:
            s.settimeout(10.0)
            s.sendall(wire.encode({"op": op}))
            if op == "status":
                msg = wire.recv(s)
                if msg and msg.get("op") == "status":
                    out.append(msg)
            else:
                out.append({"socket": str(path)})
        except (OSError, ValueError):
            pass
        finally:
            s.close()
    return out


def _print_status(st: dict) -> None:
    s, q = st.get("stats", {}), st.get("queue", {})
    print(
        f"engine pid {st['pid']}  {st['state']}  model {st['model']} ({st['resolved_model']}) on {st['device']}, "
        f"{st.get('threads')} thread(s), rss {st.get('rss_mb') or 0:.0f} MB, up {st['uptime_s']:.0f} s"
    )
    print(f"  socket {st['socket']}; model loads {st['loads']}; exits after {st['idle_exit_s']:.0f} s without windows")
    print(
        f"  windows {len(st['windows'])}: "
        + (", ".join(f"pid {w['pid']} ({w['jobs']} jobs, {w['in_flight']} in flight)" for w in st["windows"]) or "none")
    )
    print(f"  queue: {q.get('queued')} queued, {q.get('running')} running")
    ws = st.get("workspaces") or {}
    if ws.get("memories"):
        print(f"  workspace memories {ws['memories']}: {ws['files']} files, {ws['tokens']} tokens")
    print("  " + ", ".join(f"{k} {v}" for k, v in s.items()))
    if st.get("message"):
        print(f"  message: {st['message']}")


def run_engine(args: argparse.Namespace) -> int:
    if args.status:
        found = ask_all("status")
        if args.json:
            print(json.dumps(found, indent=2))
        elif not found:
            print(f"no engine running (sockets are in {wire.runtime_dir(create=False)})")
        for st in found if not args.json else []:
            _print_status(st)
        return 0 if found else 1
    if args.stop:
        stopped = ask_all("stop")
        print(f"stopped {len(stopped)} engine(s)")
        return 0
    try:
        daemon = EngineDaemon(
            args.model, args.device, args.threads, args.idle_s if args.idle_s is not None else idle_default()
        )
        if not daemon.bind(args.lock_fd):
            print(f"an engine for this model and device is already running on {daemon.place.socket}", file=sys.stderr)
            return 0
    except EngineError as e:
        print(f"dlm-lsp engine: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: daemon.stop())
    daemon.serve_forever()
    return 0
