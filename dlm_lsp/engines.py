"""The engines the server fills with: the real engine factory, and the engine started before the
server (by `dlm-lsp serve`, dlm_lsp/launch.py), so the first fill does not wait for the engine to
begin starting only after the editor's handshake.

An editor starts `dlm-lsp serve`, then sends `initialize` with the options that pick the engine
(model, device, engine, threads: options.MACHINE_KEYS). Connecting to the shared engine (which may
have to start), or importing torch and loading the weights in this process, takes seconds. A client
that knows those options when it starts the process puts its initializationOptions in the server's
environment as DLM_LSP_PRESTART (a JSON object; the VS Code extension does): the engine they pick
starts at once, on a thread, before this process imports the server (half a second of pygls and
lsprotocol), while the editor finishes starting and the handshake goes on. A shared engine starts
in its own process, in parallel on another core; an in-process one shares this process's
interpreter lock with the server's start, so it gains less. At
`initialized` the server adopts it when the options it was sent pick the same engine, else closes it
and starts the one they pick: the options the editor sends stay the only ones that count.

Without a hint, or with one naming an HTTP endpoint (nothing slow to start), nothing starts early but
an in-process engine's imports (torch and the engine's modules), which need no option.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from dlm_lsp.options import InitializationOptions, parse_options

log = logging.getLogger("dlm.prestart")

PRESTART_ENV = "DLM_LSP_PRESTART"

OnState = Callable[[str, dict], object]
MachineKey = tuple[str | None, str, int | None, str]


def machine_key(opts: InitializationOptions) -> MachineKey | None:
    """What picks the engine: (model, device, threads, "shared" | "inproc"); None for an HTTP endpoint."""
    if isinstance(opts.engine, dict):
        return None
    kind = opts.engine or os.environ.get("DLM_ENGINE") or "shared"
    return (opts.model or None, opts.device, opts.threads, kind)


def engine_args(opts: InitializationOptions) -> tuple[str | None, str, dict[str, object]]:
    """(model, device, keywords) the engine factory is called with for `opts` (the keywords only when set)."""
    extra: dict[str, object] = {"threads": opts.threads} if opts.threads else {}
    if opts.engine:  # inproc | shared | an endpoint (server.default_engine_factory)
        extra["engine"] = opts.engine
    return opts.model, opts.device, extra


def hinted_options(environ: dict[str, str] | os._Environ[str] = os.environ) -> InitializationOptions | None:
    """The options DLM_LSP_PRESTART announces, or None when it is unset or not a JSON object."""
    raw = environ.get(PRESTART_ENV)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        log.warning("%s is not JSON; nothing starts early", PRESTART_ENV)
        return None
    if not isinstance(value, dict):
        log.warning("%s is not a JSON object; nothing starts early", PRESTART_ENV)
        return None
    opts, _ = parse_options(value, None, from_settings=False)  # bad values: the defaults, as initialize does
    return opts


class EarlyEngine:
    """An engine made and started on a thread of its own; the server adopts it (attach) or closes it.

    Its state changes are kept (the last one) until the server attaches, then passed on as they come."""

    def __init__(self, key: MachineKey, make: Callable[[OnState], Any]):
        self.key = key
        self._lock = threading.Lock()
        self._engine: Any = None
        self._last: tuple[str, dict] | None = None
        self._sink: OnState | None = None
        self._closed = False
        self.made = threading.Event()  # set once the engine exists and started, or failed to
        self._thread = threading.Thread(target=self._make, args=(make,), name="dlm-prestart", daemon=True)
        self._thread.start()

    def _make(self, make: Callable[[OnState], Any]) -> None:
        try:
            engine = make(self._on_state)
            engine.start()
        except Exception as e:  # noqa: BLE001 - the server starts its own at initialized and reports it
            log.warning("the engine did not start early: %s", e)
            engine = None
        with self._lock:
            self._engine, closed = engine, self._closed
        if closed and engine is not None:
            engine.close()
        self.made.set()

    def _on_state(self, state: str, info: dict | None = None) -> None:
        with self._lock:
            self._last = (state, dict(info or {}))
            if self._sink is not None:
                self._sink(state, self._last[1])

    def attach(self, on_state: OnState) -> tuple[Any, tuple[str, dict] | None]:
        """(the engine or None when it failed to start, its last state); later states go to
        `on_state`. Call after `made` is set."""
        with self._lock:
            if self._engine is None or self._closed:
                return None, None
            self._sink = on_state
            return self._engine, self._last

    def close(self) -> None:
        """Closes the engine, now or once it is made (never blocks on the making)."""
        with self._lock:
            self._closed = True
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()


_held: list[tuple[logging.Handler, logging.handlers.MemoryHandler]] = []


def hold_logs() -> None:
    """Keeps the log's lines off stderr until the client has the initialize answer (release_logs, at
    initialized): eglot 1.9 (Emacs 28) stops waiting for that answer when the server's stderr gets a
    line first, and the engine started early logs as it starts and loads."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if type(h) is logging.StreamHandler and h.stream is sys.stderr:
            mem = logging.handlers.MemoryHandler(100_000, flushLevel=logging.CRITICAL + 1, target=h)
            root.addHandler(mem)
            root.removeHandler(h)
            _held.append((h, mem))


def release_logs() -> None:
    """Writes the held lines and logs to stderr again from now on (nothing held: nothing to do)."""
    root = logging.getLogger()
    while _held:
        h, mem = _held.pop()
        root.addHandler(h)
        root.removeHandler(mem)
        mem.close()  # flushes what it held to stderr


_early: list[tuple[Callable[..., Any], EarlyEngine | None]] = []  # start_early's, until the server takes it


def start_early(factory: Callable[..., Any], environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Starts what the first fill needs (prestart) for the server that `take_early` hands it to."""
    _early[:] = [(factory, prestart(factory, environ))]


def take_early(
    factory: Callable[..., Any], environ: dict[str, str] | os._Environ[str] = os.environ
) -> EarlyEngine | None:
    """The engine start_early started with `factory`, else one started now (a server run without the
    `serve` command: fake_server.py, python -m dlm_lsp.server)."""
    if _early and _early[0][0] is factory:
        return _early.pop()[1]
    return prestart(factory, environ)


def prestart(
    factory: Callable[..., Any], environ: dict[str, str] | os._Environ[str] = os.environ
) -> EarlyEngine | None:
    """Starts what the first fill will need, at once: the hinted engine (an EarlyEngine), else, for an
    in-process engine, its imports on a thread. `factory` is the server's engine factory."""
    warm_imports(environ)
    opts = hinted_options(environ)
    key = machine_key(opts) if opts is not None else None
    if opts is None or key is None:
        return None
    model, device, extra = engine_args(opts)
    if key[3] == "shared" and _shared_engine_runs(model, device):
        log.info("the shared engine of %s on %s runs: connecting at initialized", model or "default", device)
        return None
    log.info("starting the engine early: %s on %s (%s)", model or "default", device, key[3])
    return EarlyEngine(key, lambda on_state: factory(model, device, on_state, **extra))


def _shared_engine_runs(model: str | None, device: str) -> bool:
    """True when the shared engine's socket is there: connecting then takes milliseconds, and a
    connection made early would only compete with the server's own start for the interpreter."""
    from engine.clients import wire

    try:
        return wire.place(model, device, create=False).socket.exists()
    except Exception:  # noqa: BLE001 - a path too long for a socket: the engine's start says so later
        return False


_warming: list[threading.Thread] = []


def warm_imports(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Starts importing an in-process engine's modules (torch: a second or more) on a thread, once
    per process; `dlm-lsp serve` calls it first thing, before the server's own imports. An engine is
    in-process when the hint says so, else when DLM_ENGINE does; a shared one needs no imports here."""
    if _warming:
        return
    opts = hinted_options(environ) or InitializationOptions()
    engine = opts.engine if isinstance(opts.engine, str) else None
    if (engine or environ.get("DLM_ENGINE") or "shared") != "inproc":
        return
    _warming.append(threading.Thread(target=_import_engine, name="dlm-prestart-imports", daemon=True))
    _warming[0].start()


def _import_engine() -> None:
    try:
        import engine.serve.service  # noqa: F401 - torch and the engine's modules, for the import's time
    except Exception as e:  # noqa: BLE001 - the real start reports any failure
        log.debug("early import failed: %s", e)


# ---------------------------------------------------------------------- the real engine


def default_engine_factory(
    model: str | None,
    device: str,
    on_state: OnState,
    threads: int | None = None,
    engine: str | dict | None = None,
) -> Any:
    """The real engine: the user's shared engine daemon (engine/clients/remote.py: this process never loads
    torch) or, with `engine` / DLM_ENGINE "inproc", an EngineService in this process (imported here
    so importing the server never loads torch), or with an `engine` endpoint object a FIM HTTP
    endpoint (engine/clients/http_engine.py)."""
    if isinstance(engine, dict):  # a FIM HTTP endpoint (dlm_lsp.options.engine_endpoint normalized it)
        from engine.clients.http_engine import HttpEngine

        return HttpEngine(
            engine["url"],
            api=engine.get("api") or "openai-fim",
            api_key_env=engine.get("apiKeyEnv"),
            model=engine.get("model"),
            on_state=on_state,
        )
    if (engine or os.environ.get("DLM_ENGINE") or "shared") == "shared":
        from engine.clients.remote import RemoteEngine

        return RemoteEngine(model=model, device=device, on_state=on_state, threads=threads)
    from engine.serve.service import EngineService

    return EngineService(model=model, device=device, on_state=on_state, threads=threads)
