"""What the shared engine daemon (engine/serve/daemon.py) and its clients (engine/clients/remote.py) both know:
where the socket lives, who may connect, and the messages on it. No torch here: a thin
`dlm-lsp serve` imports this and engine/clients/remote.py only.

Place: `$XDG_RUNTIME_DIR/dlm-lsp/` (else `/tmp/dlm-lsp-<uid>/`), a folder of mode 0700 owned by
the user, holding per (model, device) `engine-<key>.sock` (0600), `.lock` (fcntl.flock: starting
a daemon and its idle exit happen under it) and `.log` (the daemon's stderr). The key is a hash of
the resolved model path and the device, so each model/device pair has one daemon per user.

Frames: a 4-byte big-endian length, then that many bytes of one UTF-8 JSON object (never pickle).
Messages, each an object with "op":
  client -> daemon  hello {pid}; submit {id, job}; cancel {id}; status {}; workspace {id, space,
                    files: {key: text or null}} (the connection's workspace memory `space`, for
                    jobs naming it: FillJob.workspace, DecodeOptions.workspace_ngram)
  daemon -> client  hello {state, info, pid}; fill {id, fill}; error {id, message}; state {state,
                    info}; status {...}; refused {message}; workspace {id, result}
A job carries FillJob's fields, its deadline as `remaining_s` (seconds left when sent, null for
none) and its age (`age_s`, for queue_ms); a fill carries Fill's fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import queue
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from engine.api import DecodeOptions, EngineError, Fill, FillJob
from engine.paths import DEFAULT_MODEL_DIR

MAX_FRAME = 64 * 1024 * 1024
PROTOCOL_VERSION = 1
_HEADER = struct.Struct(">I")


# ----------------------------------------------------------------------------- where


def runtime_dir(create: bool = True) -> Path:
    """The user's private folder for engine sockets: $XDG_RUNTIME_DIR/dlm-lsp, else
    /tmp/dlm-lsp-<uid>; created 0700. Raises EngineError when it exists and is not the user's own
    (a folder someone else made in /tmp could watch or fake the socket)."""
    uid = os.getuid()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        path = Path(xdg) / "dlm-lsp"
    else:
        path = Path("/tmp") / f"dlm-lsp-{uid}"
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """Raises EngineError unless `path` is a real folder (no symlink) owned by this user; takes
    group and other permissions away if it has them."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise EngineError(f"{path} is not a folder; remove it so the engine socket can live there")
    if st.st_uid != os.getuid():
        raise EngineError(f"{path} belongs to uid {st.st_uid}, not to you; remove it or set XDG_RUNTIME_DIR")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def resolved_model(model: str | None) -> str:
    """The model as the key sees it, without loading anything: the default model's folder, a local
    folder's real path, or the name as given (a Hugging Face repo id)."""
    if model is None or str(model) in ("", "default"):
        return str(DEFAULT_MODEL_DIR.resolve())
    p = Path(model).expanduser()
    return str(p.resolve()) if p.is_dir() else str(model)


def engine_key(model: str | None, device: str) -> str:
    """16 hex digits naming the daemon of (model, device)."""
    return hashlib.sha256(f"{resolved_model(model)}\0{device or 'auto'}".encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Place:
    """The files of one daemon."""

    dir: Path
    key: str

    @property
    def socket(self) -> Path:
        return self.dir / f"engine-{self.key}.sock"

    @property
    def lock(self) -> Path:
        return self.dir / f"engine-{self.key}.lock"

    @property
    def log(self) -> Path:
        return self.dir / f"engine-{self.key}.log"


def place(model: str | None, device: str, create: bool = True) -> Place:
    p = Place(runtime_dir(create), engine_key(model, device))
    if len(str(p.socket).encode()) > 107:
        raise EngineError(
            f"the engine socket path {p.socket} is too long for a Unix socket; set a shorter XDG_RUNTIME_DIR"
        )
    return p


def open_lock(path: Path) -> int:
    """The lock file's descriptor (0600, not inherited by children unless passed)."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


# ----------------------------------------------------------------------------- who


def peer_uid(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def refusal(uid: int) -> str | None:
    """Why a peer with `uid` may not use this user's engine, or None when it may (same user)."""
    if uid == os.getuid():
        return None
    return f"uid {uid} may not use the engine of uid {os.getuid()}"


def connect(path: Path, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
    except BaseException:
        s.close()
        raise
    s.settimeout(None)
    return s


# ----------------------------------------------------------------------------- frames


def encode(msg: dict) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_FRAME:
        raise EngineError(f"message of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
    return _HEADER.pack(len(body)) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> dict | None:
    """The next message, or None at the end of the stream. Raises ValueError on a bad frame."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    (n,) = _HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes is over the {MAX_FRAME}-byte limit")
    body = _recv_exact(sock, n)
    if body is None:
        return None
    msg = json.loads(body.decode("utf-8"))
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ValueError("a message must be a JSON object with an 'op'")
    return msg


class Channel:
    """One connection: a reader thread hands each message to `on_message`; send() queues a
    message for a writer thread, so no caller (the engine worker, the event loop) ever blocks on a
    slow peer. `on_close` runs once, when either side ends it."""

    def __init__(
        self,
        sock: socket.socket,
        on_message: Callable[[dict], object],
        on_close: Callable[[], object],
        name: str = "dlm-wire",
    ):
        self.sock, self.on_message, self.on_close = sock, on_message, on_close
        self._out: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"{name}-read", daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"{name}-write", daemon=True)

    def start(self) -> Channel:
        self._writer.start()
        self._reader.start()
        return self

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, msg: dict) -> bool:
        """Queues `msg`; False when the channel is closed."""
        if self._closed.is_set():
            return False
        self._out.put(encode(msg))
        return True

    def close(self) -> None:
        with self._close_lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._out.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.on_close()
        except Exception:  # noqa: BLE001 - a failing callback must not leave the channel half closed
            import logging

            logging.getLogger("dlm.wire").exception("on_close failed")

    def flush_and_close(self, timeout: float = 2.0) -> None:
        """Closes once what was queued has been written (or after `timeout`)."""
        end = time.monotonic() + timeout
        while not self._out.empty() and time.monotonic() < end and not self._closed.is_set():
            time.sleep(0.01)
        self.close()

    def _read(self) -> None:
        try:
            while True:
                msg = recv(self.sock)
                if msg is None:
                    break
                self.on_message(msg)
        except (OSError, ValueError, UnicodeDecodeError):
            pass
        self.close()

    def _write(self) -> None:
        while True:
            frame = self._out.get()
            if frame is None:
                return
            try:
                self.sock.sendall(frame)
            except OSError:
                self.close()
                return


# ----------------------------------------------------------------------------- jobs and fills


def job_message(job: FillJob, now: float | None = None) -> dict:
    """FillJob -> its wire form; the deadline goes as the seconds left."""
    now = time.monotonic() if now is None else now
    return {
        "prefix": job.prefix,
        "suffix": job.suffix,
        "max_tokens": job.max_tokens,
        "context_tokens": job.context_tokens,
        "options": dataclasses.asdict(job.options),
        "remaining_s": None if job.deadline is None else job.deadline - now,
        "age_s": max(0.0, now - job.submitted_at),
        "session": job.session,
        "lookup": job.lookup,
        "kind": job.kind,
        "workspace": job.workspace,
        "document": job.document,
    }


_OPTION_FIELDS = {f.name for f in dataclasses.fields(DecodeOptions)}
_FILL_FIELDS = {f.name for f in dataclasses.fields(Fill)}


def job_from_message(m: object, now: float | None = None) -> FillJob:
    """The wire form -> a FillJob with a deadline on this process's clock. Raises ValueError."""
    now = time.monotonic() if now is None else now
    if not isinstance(m, dict):
        raise ValueError("job must be an object")
    opts = m.get("options") or {}
    if not isinstance(opts, dict) or set(opts) - _OPTION_FIELDS:
        raise ValueError(
            f"unknown decode options {sorted(set(opts) - _OPTION_FIELDS) if isinstance(opts, dict) else opts}"
        )
    prefix, suffix = m.get("prefix"), m.get("suffix", "")
    if not isinstance(prefix, str) or not isinstance(suffix, str):
        raise ValueError("prefix and suffix must be strings")
    ints = {k: m.get(k, d) for k, d in (("max_tokens", 32), ("context_tokens", 512))}
    if any(not isinstance(v, int) or isinstance(v, bool) for v in ints.values()):
        raise ValueError("max_tokens and context_tokens must be integers")
    remaining, age = m.get("remaining_s"), m.get("age_s", 0.0)
    if remaining is not None and not isinstance(remaining, (int, float)):
        raise ValueError("remaining_s must be a number or null")
    if not isinstance(age, (int, float)):
        raise ValueError("age_s must be a number")
    session = m.get("session")
    if session is not None and not isinstance(session, str):
        raise ValueError("session must be a string or null")
    lookup = m.get("lookup", "")
    if not isinstance(lookup, str):
        raise ValueError("lookup must be a string")
    names = {k: m.get(k) for k in ("kind", "workspace", "document")}
    for k, v in names.items():
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{k} must be a string or null")
    return FillJob(
        prefix=prefix,
        suffix=suffix,
        options=DecodeOptions(**opts),
        session=session,
        lookup=lookup,
        kind=names["kind"],
        workspace=names["workspace"],
        document=names["document"],
        deadline=None if remaining is None else now + remaining,
        submitted_at=now - max(0.0, age),
        max_tokens=ints["max_tokens"],
        context_tokens=ints["context_tokens"],
    )


def fill_message(fill: Fill) -> dict:
    return dataclasses.asdict(fill)


def fill_from_message(m: dict) -> Fill:
    return Fill(**{k: v for k, v in m.items() if k in _FILL_FIELDS})
