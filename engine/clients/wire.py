"""What the shared engine daemon (engine/serve/daemon.py) and its clients (engine/clients/remote.py) both know:
where the socket lives, who may connect, and the messages on it. No torch here: a thin
`dlm-lsp serve` imports this and engine/clients/remote.py only.

Place: `$XDG_RUNTIME_DIR/dlm-lsp/` (else `/tmp/dlm-lsp-<uid>/`), a folder of mode 0700 owned by
the user, holding per (model, device) `engine-<key>.sock` (0600), `.lock` (fcntl.flock: starting
a daemon and its idle exit happen under it) and `.log` (the daemon's stderr). The key is a hash of
the resolved model path and the device, so each model/device pair has one daemon per user.

Frames: a 4-byte big-endian length, then that many bytes of one UTF-8 JSON object (never pickle).
Messages, each an object with "op":
  client -> daemon  hello {pid, version}; submit {id, job}; cancel {id}; status {}; workspace {id,
                    space, files: {key: text or null}} (the connection's workspace memory `space`,
                    for jobs naming it: FillJob.workspace, DecodeOptions.workspace_ngram)
  daemon -> client  hello {state, info, pid, version}; fill {id, fill}; rewrite {id, rewrite};
                    error {id, message}; state {state, info}; status {...}; refused {message};
                    workspace {id, result}
A job says what it is in "type": "edit" for an EditJob (answered rewrite {id, rewrite}), "fill" or
absent for a FillJob (answered fill {id, fill}; what every client before next edits sends). ("kind"
is FillJob's hole kind, so the job's own type has another name.) A fill job carries FillJob's
fields; an edit job EditJob's, its edits as [old, new] pairs, its numbers within EDIT_NUMBERS; both
carry DecodeOptions' fields as `options` (each of its field's type), the deadline as `remaining_s` (seconds left when sent, null for none) and their age
(`age_s`, for queue_ms). A fill carries Fill's fields, a rewrite Rewrite's. A job the daemon cannot
decode is answered error {id, message}, that job only. `version` (PROTOCOL_VERSION) is 2 since
next edits: a client does not send edit jobs to a daemon whose hello says less (or nothing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import queue
import socket
import stat
import struct
import threading
import time
import types
import typing
from collections.abc import Callable
from pathlib import Path

from engine.api import SEED_RANGE, DecodeOptions, EditJob, EngineError, Fill, FillJob, Rewrite, edit_flags
from engine.paths import DEFAULT_MODEL_DIR

MAX_FRAME = 64 * 1024 * 1024
PROTOCOL_VERSION = 2  # 2: edit jobs (EditJob -> Rewrite)
EDITS_VERSION = 2  # the first version whose daemon runs edit jobs
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


def job_message(job: FillJob | EditJob, now: float | None = None) -> dict:
    """A job -> its wire form (an EditJob: edit_job_message's); the deadline goes as the seconds left.
    A FillJob's has no "type" (as before next edits: an older daemon reads it unchanged)."""
    if isinstance(job, EditJob):
        return edit_job_message(job, now)
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
_REWRITE_FIELDS = {f.name for f in dataclasses.fields(Rewrite)}
_EDIT_DEFAULTS = EditJob(prefix="", window="")
SCORES = ("auto", "visible", "masked")  # EditJob.score (engine/decode/rewrite.py SCORES, which imports torch)
OPTION_INT_LIMIT = 2**31 - 1  # an integer decode option past this is no setting anyone meant
# an edit job's numbers: (type, least, most). Wider ones are refused on the wire: the daemon would
# build canvases (or widen loops) that size on its one worker, stalling every window it serves.
EDIT_NUMBERS: dict[str, tuple[type, float, float]] = {
    "max_tokens": (int, 1, 1 << 14),
    "context_tokens": (int, 1, 1 << 20),
    "spread": (int, 0, 1 << 14),
    "surprise": (float, 0.0, 1.0),
    "growth": (float, 0.0, 64.0),
    "memory": (float, 0.0, 1e4),
}


def _hints(cls: type) -> dict[str, object]:
    """A dataclass's field types, evaluated; {} when one cannot be (every value is then let through)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a field annotated with a name only type checkers see
        return {}


_OPTION_HINTS, _REWRITE_HINTS = _hints(DecodeOptions), _hints(Rewrite)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fits(value: object, hint: object, finite: bool) -> bool:
    """True when `value` (from JSON) is of the annotated type `hint` (None, bool, int, float, str or
    a union of them; an int is a float too). Other types are not checked here: they are let through."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if not set(allowed) <= {type(None), bool, int, float, str}:
        return True
    for t in allowed:
        if (t is type(None) and value is None) or (t is bool and isinstance(value, bool)):
            return True
        if t is str and isinstance(value, str):
            return True
        if isinstance(value, bool):
            continue
        if t is int and isinstance(value, int):
            return True
        if t is float and isinstance(value, (int, float)) and (not finite or math.isfinite(value)):
            return True
    return False


def options_from_message(opts: object) -> DecodeOptions:
    """A job's `options` (DecodeOptions' fields, any left out at their defaults) -> DecodeOptions.
    Raises ValueError for an unknown key, a value of another type than the field's, a float that is
    not finite, an integer past OPTION_INT_LIMIT or a seed outside SEED_RANGE."""
    opts = opts or {}
    if not isinstance(opts, dict) or set(opts) - _OPTION_FIELDS:
        raise ValueError(
            f"unknown decode options {sorted(set(opts) - _OPTION_FIELDS) if isinstance(opts, dict) else opts}"
        )
    for k, v in opts.items():
        if k in _OPTION_HINTS and not _fits(v, _OPTION_HINTS[k], finite=True):
            raise ValueError(f"decode option {k} must be {_OPTION_HINTS[k]}, got {v!r}"[:200])
        if isinstance(v, int) and not isinstance(v, bool):
            lo, hi = SEED_RANGE if k == "seed" else (-OPTION_INT_LIMIT, OPTION_INT_LIMIT)
            if not lo <= v <= hi:
                raise ValueError(f"decode option {k} is out of range [{lo}, {hi}]")
    return DecodeOptions(**opts)


def _timing(m: dict) -> tuple[float | None, float]:
    """(remaining_s, age_s) of a job message: finite numbers (remaining_s may be null). Raises ValueError."""
    remaining, age = m.get("remaining_s"), m.get("age_s", 0.0)
    if remaining is not None and not (_is_number(remaining) and math.isfinite(remaining)):
        raise ValueError("remaining_s must be a finite number or null")
    if not (_is_number(age) and math.isfinite(age)):
        raise ValueError("age_s must be a finite number")
    return remaining, age


def job_from_message(m: object, now: float | None = None) -> FillJob:
    """The wire form -> a FillJob with a deadline on this process's clock. Raises ValueError (an
    edit job's message among others: any_job_from_message takes both)."""
    now = time.monotonic() if now is None else now
    if not isinstance(m, dict):
        raise ValueError("job must be an object")
    if m.get("type", "fill") != "fill":
        raise ValueError(f"not a fill job: type {m.get('type')!r}"[:200])
    opts = options_from_message(m.get("options"))
    prefix, suffix = m.get("prefix"), m.get("suffix", "")
    if not isinstance(prefix, str) or not isinstance(suffix, str):
        raise ValueError("prefix and suffix must be strings")
    ints = {k: m.get(k, d) for k, d in (("max_tokens", 32), ("context_tokens", 512))}
    if any(not isinstance(v, int) or isinstance(v, bool) for v in ints.values()):
        raise ValueError("max_tokens and context_tokens must be integers")
    remaining, age = _timing(m)
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
        options=opts,
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


def edit_job_message(job: EditJob, now: float | None = None) -> dict:
    """EditJob -> its wire form ("type": "edit"; the edits as [old, new] pairs; the deadline as the seconds left)."""
    now = time.monotonic() if now is None else now
    return {
        "type": "edit",
        "prefix": job.prefix,
        "window": job.window,
        "suffix": job.suffix,
        "edits": [[old, new] for old, new in job.edits],
        "approach": job.approach,
        "max_tokens": job.max_tokens,
        "context_tokens": job.context_tokens,
        "options": dataclasses.asdict(job.options),
        "surprise": job.surprise,
        "spread": job.spread,
        "growth": job.growth,
        "memory": job.memory,
        "score": job.score,
        "remaining_s": None if job.deadline is None else job.deadline - now,
        "age_s": max(0.0, now - job.submitted_at),
    }


def edit_job_from_message(m: object, now: float | None = None) -> EditJob:
    """The wire form -> an EditJob with a deadline on this process's clock. `prefix` and `window` are
    required, any other field left out takes EditJob's default. Raises ValueError for anything else
    than the shape edit_job_message writes, and for numbers outside EDIT_NUMBERS."""
    now = time.monotonic() if now is None else now
    if not isinstance(m, dict):
        raise ValueError("job must be an object")
    if m.get("type") != "edit":
        raise ValueError(f"not an edit job: type {m.get('type')!r}"[:200])
    texts: dict[str, str] = {}
    for k in ("prefix", "window", "suffix"):
        v = m.get(k, "" if k == "suffix" else None)
        if not isinstance(v, str):
            raise ValueError(f"{k} must be a string")
        texts[k] = v
    edits = m.get("edits", [])
    if not isinstance(edits, list) or any(
        not isinstance(e, list) or len(e) != 2 or not all(isinstance(t, str) for t in e) for e in edits
    ):
        raise ValueError("edits must be a list of [old, new] string pairs")
    approach = m.get("approach", _EDIT_DEFAULTS.approach)
    if not isinstance(approach, str):
        raise ValueError("approach must be a string")
    edit_flags(approach)  # ValueError naming the approaches
    score = m.get("score", _EDIT_DEFAULTS.score)
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}"[:200])
    numbers: dict[str, int | float] = {}
    for k, (kind, lo, hi) in EDIT_NUMBERS.items():
        v = m.get(k, getattr(_EDIT_DEFAULTS, k))
        if not _is_number(v) or (kind is int and not isinstance(v, int)) or not lo <= v <= hi:
            raise ValueError(
                f"{k} must be {'an integer' if kind is int else 'a number'} in [{lo}, {hi}], got {v!r}"[:200]
            )
        numbers[k] = v if kind is int else float(v)
    opts = options_from_message(m.get("options"))
    remaining, age = _timing(m)
    return EditJob(
        prefix=texts["prefix"],
        window=texts["window"],
        suffix=texts["suffix"],
        edits=[(old, new) for old, new in edits],
        approach=approach,
        options=opts,
        score=score,
        deadline=None if remaining is None else now + remaining,
        submitted_at=now - max(0.0, age),
        max_tokens=int(numbers["max_tokens"]),
        context_tokens=int(numbers["context_tokens"]),
        spread=int(numbers["spread"]),
        surprise=numbers["surprise"],
        growth=numbers["growth"],
        memory=numbers["memory"],
    )


def any_job_from_message(m: object, now: float | None = None) -> FillJob | EditJob:
    """A job's wire form -> the FillJob or EditJob its "type" says (absent: a fill). Raises ValueError."""
    if not isinstance(m, dict):
        raise ValueError("job must be an object")
    kind = m.get("type", "fill")
    if kind == "edit":
        return edit_job_from_message(m, now)
    if kind == "fill":
        return job_from_message(m, now)
    raise ValueError(f"unknown job type {kind!r}; known: 'fill', 'edit'"[:200])


def fill_message(fill: Fill) -> dict:
    return dataclasses.asdict(fill)


def fill_from_message(m: dict) -> Fill:
    return Fill(**{k: v for k, v in m.items() if k in _FILL_FIELDS})


def rewrite_message(rewrite: Rewrite) -> dict:
    return dataclasses.asdict(rewrite)


def rewrite_from_message(m: object) -> Rewrite:
    """A rewrite's wire form -> Rewrite (unknown fields left out, missing ones at their defaults).
    Raises ValueError when it is not an object with a text, or a field is of another type."""
    if not isinstance(m, dict) or not isinstance(m.get("text"), str):
        raise ValueError("a rewrite must be an object with a text")
    known = {k: v for k, v in m.items() if k in _REWRITE_FIELDS}
    for k, v in known.items():
        if k in _REWRITE_HINTS and not _fits(v, _REWRITE_HINTS[k], finite=False):
            raise ValueError(f"rewrite field {k} must be {_REWRITE_HINTS[k]}, got {v!r}"[:200])
    ids = known.get("token_ids", [])
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("rewrite field token_ids must be a list of integers")
    return Rewrite(**known)
