"""HttpEngine: EngineService's interface (start(), submit(job) -> Future[Fill], close(), on_state,
state) over a FIM HTTP endpoint, so the language server's scheduler runs unchanged against a
`dlm-lsp http` on a team's GPU box, a Ray Serve deployment of it, any OpenAI-style FIM
`/v1/completions` server, or Inception's Mercury `/v1/fim/completions`. No torch is imported.

- `url` is the API's base (`http://gpu-box:8765/v1`; a URL without a path gets `/v1`). The API
  flavour picks the endpoint and body: `openai-fim` POSTs {base}/completions, `mercury` POSTs
  {base}/fim/completions (Inception's documented FIM shape; its `model` is required).
- The API key is read from the environment variable `api_key_env` names (an editor passes a key
  from its secret storage the same way, in the server's environment); it is never an option value.
- start() probes {base}/models on the engine's own thread: 200 -> ready (a `dlm` field there says
  the endpoint is a dlm-lsp server: its confidence gate is reported as the engine's `gate`, its
  context budget as `context_tokens`, and requests then carry the extension fields deadline_ms,
  slots and postprocess=false, since the language server post-processes itself); 401/403 -> error
  (the key is refused); no answer -> loading, probed again with back-off. A request that cannot
  connect puts it back to loading.
- submit() sends the job on an asyncio loop of this class's own thread and returns at once.
  job.cancel() (latest-wins, didChange, the scheduler's deadline) cancels the request's task: httpx
  closes the connection, which is how the server learns that the client went away (dlm-lsp http
  then cancels its own engine job within a step). The request's own timeout is the job's deadline
  + REQUEST_GRACE_S, so nothing waits forever even without a scheduler.
- Every job is answered: a Fill, Fill(cancelled=True), or EngineError with the endpoint's status
  and message. A next edit (EditJob) is refused at once with EngineError (NO_EDITS): a FIM endpoint
  fills at a cursor, it cannot rewrite a window. Answers over MAX_RESPONSE_BYTES, or not in the
  shape, are errors. A request whose backend went away behind a proxy (a Ray Serve replica killed:
  500/502/503 without this API's error object, or the connection dropped mid-answer) is sent once
  more if the deadline allows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING

from engine.api import EditJob, EngineError, Fill, FillJob
from engine.clients.remote import _ForwardingEvent  # a cancel event that also aborts the request

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("dlm.http_engine")

FLAVOURS = {"openai-fim": "/completions", "mercury": "/fim/completions"}
MERCURY_MODEL = "mercury-edit-2"  # Inception's FIM model when the settings name none
MAX_RESPONSE_BYTES = 1 << 20
REQUEST_GRACE_S = 2.0
NO_DEADLINE_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 5.0
PROBE_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
RETRY_STATUSES = (500, 502, 503)  # from a proxy whose backend went away (no error object of this API)
RETRY_MIN_LEFT_S = 0.05
NO_EDITS = "next edits need dlm-lsp's own engine (shared or inproc), not a FIM endpoint"


def _api_error(raw: bytes) -> bool:
    """True when `raw` is this API's error object ({"error": {...}}): the endpoint itself answered."""
    try:
        data = json.loads(raw)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict)


def _resolve(fut: Future, result: object = None, exc: BaseException | None = None) -> None:
    if fut.done():
        return
    try:
        fut.set_exception(exc) if exc is not None else fut.set_result(result)
    except InvalidStateError:
        pass


def base_url(url: str) -> str:
    """The API base: `url` without a trailing slash; `/v1` added when it has no path. Raises
    ValueError for anything but an http(s) URL with a host."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine url must be http:// or https:// with a host, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("engine url must not carry credentials; name an environment variable in apiKeyEnv")
    path = parts.path.rstrip("/") or "/v1"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class HttpEngine:
    """A FIM HTTP endpoint as the language server's engine; thread-safe submit()."""

    def __init__(
        self,
        url: str,
        api: str = "openai-fim",
        api_key_env: str | None = None,
        model: str | None = None,
        on_state: Callable[[str, dict], object] | None = None,
        max_connections: int = 8,
    ):
        if api not in FLAVOURS:
            raise ValueError(f"engine api must be one of {sorted(FLAVOURS)}, got {api!r}")
        self.base = base_url(url)
        self.api, self.api_key_env, self.on_state = api, api_key_env, on_state
        self.endpoint = self.base + FLAVOURS[api]
        self.model_id = model or (MERCURY_MODEL if api == "mercury" else None)
        self.max_connections = max_connections
        self.state = "idle"
        self.message: str | None = None
        self.dlm = False  # the endpoint is a dlm-lsp http server (seen in its /v1/models)
        self.gate: float | dict[str, float] | None = None  # the remote model's gate (one per hole kind, or one)
        self.calibrator: dict | None = None  # the remote model's calibrated gate (dlm_lsp.fill.gate)
        self.context_tokens: int | None = None  # the remote server's context budget (engine.api.context_budget)
        self.requests = 0
        self._api_key: str | None = None
        self._client: httpx.AsyncClient | None = None  # made on the engine's thread (_setup)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._probing: asyncio.Task | None = None
        self._inflight: dict[int, Future] = {}  # job id -> the request's concurrent future
        self._lock = threading.Lock()
        self._closed = threading.Event()
        host = urllib.parse.urlsplit(self.base)
        self.host = host.netloc
        if host.scheme == "http" and host.hostname not in ("127.0.0.1", "localhost", "::1"):
            log.warning("engine %s is plain http on another machine: code and key travel unencrypted", self.base)

    # ------------------------------------------------------------ state

    def _set_state(self, state: str, message: str | None = None) -> None:
        if (state, message) == (self.state, self.message):
            return
        self.state, self.message = state, message
        if self.on_state is not None:
            try:
                self.on_state(
                    state,
                    {
                        "model": self.model_id or self.base,
                        "device": self.host,
                        "message": message,
                        "threads": None,
                        "gate": self.gate,
                        "calibrator": self.calibrator,
                        "context_tokens": self.context_tokens,
                        "engine": "http",
                    },
                )
            except Exception:  # a broken callback must not stop the engine thread
                log.exception("on_state callback failed")

    # ------------------------------------------------------------ lifecycle

    def start(self) -> HttpEngine:
        """Starts the engine's thread and probes the endpoint from it; returns at once."""
        with self._lock:
            if self._thread is not None:
                return self
            if self.api_key_env:
                self._api_key = os.environ.get(self.api_key_env, "").strip() or None
            logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="dlm-http-engine", daemon=True)
            self._thread.start()
        self._set_state("loading", None)
        if self.api_key_env and self._api_key is None:
            self._set_state(
                "error",
                f"the environment variable {self.api_key_env} (engine apiKeyEnv) is not set: "
                "the engine's API key goes there",
            )
            return self
        asyncio.run_coroutine_threadsafe(self._setup(), self._loop)
        return self

    async def _setup(self) -> None:
        import httpx

        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections),
            timeout=NO_DEADLINE_TIMEOUT_S,
            trust_env=False,
            follow_redirects=False,
        )
        self._reprobe()

    def close(self) -> None:
        """Aborts every request (their jobs come back cancelled) and stops the thread."""
        self._closed.set()
        with self._lock:
            inflight, self._inflight = list(self._inflight.values()), {}
        for cf in inflight:
            cf.cancel()
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._probing is not None:
                self._probing.cancel()
            if self._client is not None:
                await self._client.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        except Exception:  # noqa: BLE001 - closing must not raise
            pass
        loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(5)

    def wait_ready(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while self.state not in ("ready", "error") and not self._closed.is_set():
            if end is not None and time.monotonic() > end:
                break
            time.sleep(0.02)
        return self.state == "ready"

    # ------------------------------------------------------------ probing (engine thread)

    def _http(self) -> httpx.AsyncClient:
        """The HTTP client (_setup makes it on the engine's thread before anything is sent)."""
        if self._client is None:
            raise EngineError("the engine is not started")
        return self._client

    def _headers(self) -> dict:
        h = {"accept": "application/json"}
        if self._api_key:
            h["authorization"] = f"Bearer {self._api_key}"
        return h

    def _reprobe(self) -> None:
        if self._closed.is_set() or (self._probing is not None and not self._probing.done()):
            return
        self._probing = asyncio.ensure_future(self._probe())

    async def _probe(self) -> None:
        """Asks {base}/models until the endpoint answers; ready, or error for a refused key."""
        import httpx

        tries = 0
        while not self._closed.is_set():
            try:
                r = await self._http().get(self.base + "/models", headers=self._headers(), timeout=PROBE_TIMEOUT_S)
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                self._set_state("loading", f"the engine at {self.base} does not answer ({why}); retrying")
            else:
                if r.status_code in (401, 403):
                    self._set_state(
                        "error",
                        f"the engine at {self.base} refused the API key (HTTP {r.status_code})"
                        + (
                            f"; check {self.api_key_env}"
                            if self.api_key_env
                            else "; set engine apiKeyEnv to the environment variable that holds it"
                        ),
                    )
                    return
                if r.status_code == 200:
                    self._read_models(r)
                # 404 and the like: an endpoint without a model list still serves completions
                log.info(
                    "engine at %s ready (HTTP %d from /models; %s)",
                    self.base,
                    r.status_code,
                    "dlm-lsp" if self.dlm else self.api,
                )
                self._set_state("ready", None)
                return
            await asyncio.sleep(PROBE_BACKOFF_S[min(tries, len(PROBE_BACKOFF_S) - 1)])
            tries += 1

    def _read_models(self, r: httpx.Response) -> None:
        try:
            data = r.json().get("data") or []
            first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        except (ValueError, AttributeError):
            return
        if self.model_id is None and isinstance(first.get("id"), str):
            self.model_id = first["id"]
        ext = first.get("dlm")
        self.dlm = isinstance(ext, dict)
        gate = ext.get("gate") if isinstance(ext, dict) else None
        # a number, or one per hole kind (dlm_lsp.fill.gate.kind_gate reads it); anything else: none
        if isinstance(gate, dict):
            ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in gate.values())
            self.gate = {str(k): float(v) for k, v in gate.items()} if ok else None
        else:
            self.gate = float(gate) if isinstance(gate, (int, float)) and not isinstance(gate, bool) else None
        # the remote model's calibrated gate, with its gate
        cal = ext.get("calibrator") if isinstance(ext, dict) else None
        self.calibrator = cal if isinstance(cal, dict) else None
        # the context it gives its own fills, which the language server then sends it (None: its 512)
        budget = ext.get("context_tokens") if isinstance(ext, dict) else None
        self.context_tokens = (
            budget if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 else None
        )

    # ------------------------------------------------------------ jobs

    def submit(self, job: FillJob | EditJob) -> Future:
        """Sends a job; the future resolves to a Fill (cancelled ones too) or raises EngineError (at
        once for an EditJob: NO_EDITS)."""
        fut: Future = Future()
        if isinstance(job, EditJob):
            fut.set_exception(EngineError(NO_EDITS))
            return fut
        if self._closed.is_set() or self._loop is None:
            fut.set_exception(
                EngineError("the engine is shut down" if self._closed.is_set() else "the engine is not started")
            )
            return fut
        if self.state == "error":
            fut.set_exception(EngineError(self.message or "the engine failed"))
            return fut
        if job.cancel_event.is_set():
            fut.set_result(self._cancelled(job))
            return fut
        jid = job.job_id
        job.cancel_event = _ForwardingEvent(lambda: self._abort(jid))
        cf = asyncio.run_coroutine_threadsafe(self._request(job), self._loop)
        with self._lock:
            self._inflight[jid] = cf
            self.requests += 1

        def done(f: Future) -> None:
            with self._lock:
                self._inflight.pop(jid, None)
            if f.cancelled():
                _resolve(fut, self._cancelled(job))
            elif f.exception() is not None:
                _resolve(fut, exc=f.exception())
            else:
                _resolve(fut, f.result())

        cf.add_done_callback(done)
        if job.cancel_event.is_set():  # cancelled between the check and now
            cf.cancel()
        return fut

    @staticmethod
    def _cancelled(job: FillJob) -> Fill:
        return Fill(text="", tokens=0, steps=0, slots=job.max_tokens, cancelled=True)

    def _abort(self, jid: int) -> None:
        """job.cancel(): the request's task is cancelled, and httpx closes its connection."""
        with self._lock:
            cf = self._inflight.get(jid)
        if cf is not None:
            cf.cancel()

    def _body(self, job: FillJob) -> dict:
        body = {"prompt": job.prefix, "suffix": job.suffix, "max_tokens": job.max_tokens, "stream": False}
        if self.model_id:
            body["model"] = self.model_id
        if self.api == "openai-fim":
            body["temperature"] = job.options.temperature
        if self.dlm:  # a dlm-lsp server: the exact canvas, its deadline, and the text as the engine wrote it
            body["slots"] = job.max_tokens
            body["postprocess"] = False
            body["seed"] = job.options.seed
            if job.deadline is not None:
                body["deadline_ms"] = int(min(60_000, max(10, (job.deadline - time.monotonic()) * 1000)))
        return body

    async def _request(self, job: FillJob) -> Fill:
        """POSTs the job; one retry when a proxy in front answered for a backend that went away (a
        Ray Serve replica killed mid-request: 500/502/503 without this API's error object, or the
        connection dropped mid-answer) and the deadline leaves time for it."""
        import httpx

        t0 = time.monotonic()
        for attempt in (0, 1):
            left = (
                NO_DEADLINE_TIMEOUT_S
                if job.deadline is None
                else max(0.05, job.deadline - time.monotonic() + REQUEST_GRACE_S)
            )
            retry = attempt == 0 and (job.deadline is None or job.deadline - time.monotonic() > RETRY_MIN_LEFT_S)
            try:
                status, raw = await self._send(job, left)
            except httpx.TimeoutException:
                raise EngineError(f"the engine at {self.base} did not answer within {left:.1f} s") from None
            except (httpx.RemoteProtocolError, httpx.ReadError) as e:
                if retry:
                    log.info("the engine at %s dropped a request (%s); retrying once", self.base, type(e).__name__)
                    continue
                self._went_away(e)
                raise EngineError(f"the engine at {self.base} failed: {type(e).__name__}: {e}") from None
            except httpx.HTTPError as e:
                if isinstance(e, httpx.ConnectError):
                    self._went_away(e)
                raise EngineError(f"the engine at {self.base} failed: {type(e).__name__}: {e}") from None
            if retry and status in RETRY_STATUSES and not _api_error(raw):
                log.info("the engine at %s answered HTTP %d from in front of it; retrying once", self.base, status)
                continue
            return self._fill(job, status, raw, (time.monotonic() - t0) * 1000)
        raise AssertionError("unreachable")

    async def _send(self, job: FillJob, left: float) -> tuple[int, bytes]:
        async with self._http().stream(
            "POST", self.endpoint, json=self._body(job), headers=self._headers(), timeout=left
        ) as r:
            raw = bytearray()
            async for part in r.aiter_bytes():
                raw += part
                if len(raw) > MAX_RESPONSE_BYTES:
                    raise EngineError(f"the engine at {self.base} answered over {MAX_RESPONSE_BYTES} bytes")
            return r.status_code, bytes(raw)

    def _went_away(self, e: Exception) -> None:
        if not self._closed.is_set():
            self._set_state("loading", f"the engine at {self.base} went away ({type(e).__name__}); reconnecting")
            self._reprobe()

    def _fill(self, job: FillJob, status: int, raw: bytes, round_trip_ms: float) -> Fill:
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if status != 200:
            err = data.get("error") if isinstance(data, dict) else None
            msg = err.get("message") if isinstance(err, dict) else raw[:200].decode("utf-8", "replace")
            if status in (401, 403):
                self._set_state("error", f"the engine at {self.base} refused the API key (HTTP {status})")
            raise EngineError(f"the engine at {self.base} answered HTTP {status}: {msg}")
        try:
            choice = data["choices"][0]
            text = choice["text"]
            if not isinstance(text, str):
                raise TypeError("choices[0].text is not a string")
        except (KeyError, IndexError, TypeError) as e:
            raise EngineError(f"the engine at {self.base} answered in another shape ({e})") from None
        use = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        ext = data.get("dlm") if isinstance(data.get("dlm"), dict) else {}

        def num(d: dict, k: str, default: float = 0.0) -> float:
            v = d.get(k)
            return v if isinstance(v, (int, float)) and not isinstance(v, bool) else default

        def nums(d: dict, k: str) -> list[float]:
            v = d.get(k)
            return [x for x in v if isinstance(x, (int, float))] if isinstance(v, list) else []

        tokens = int(num(use, "completion_tokens", 0))
        return Fill(
            text=text,
            tokens=tokens,
            steps=int(num(ext, "steps", 0)),
            slots=job.max_tokens,
            deadline_hit=bool(ext.get("deadline_hit")),
            queue_ms=float(num(ext, "queue_ms")),
            compute_ms=round_trip_ms,
            tokens_per_step=[int(x) for x in nums(ext, "tokens_per_step")],
            ms_per_step=[float(x) for x in nums(ext, "ms_per_step")],
            confidence=float(num(ext, "confidence", 1.0)),
            forwarded_tokens=int(num(ext, "forwarded_tokens", 0)),
            reused_tokens=int(num(ext, "reused_tokens", 0)),
        )
