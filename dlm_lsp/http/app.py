"""`dlm-lsp http`: the engine's HTTP face, a Starlette app served by uvicorn.

  POST /v1/completions       OpenAI completions shape (prompt + suffix = fill in the middle)
  POST /v1/fim/completions   Inception Mercury's FIM shape
  POST /v1/edit/completions  Inception Mercury's next-edit shape (what Continue's Next Edit sends)
  GET  /v1/models            the one model served (+ a `dlm` field: its gate, the server's limits)
  GET  /health               {"status": "loading" | "ready" | "error", ...}; 200 only when ready

What the request fields mean and the `dlm` extension field of each answer: dlm_lsp/http/fim.py and
docs/serving.md. Fills go through the language server's own pipeline (context windows, hole kind,
post-processing) and its engine (`--engine inproc`, the default, or the user's `shared` daemon);
next edits through the language server's (dlm_lsp/fill/suggest.py: the EditJob, the judgement),
for the region the request marks (dlm_lsp/http/nextedit.py).

Safety, by construction (docs/reliability.md lists each threat and the test that shows it):
- bound to 127.0.0.1 unless --host says otherwise; a bearer token (read from the environment
  variable --token-env names, never from the command line) is checked on every request but
  /health when set, the moment its head is complete (TokenGate: before the body is read or a slot
  taken; a refusal closes the connection), and the server refuses to start on a non-loopback
  address without one;
- connections: a head late by --head-timeout is answered 408 and closed, a connection without a
  request closed after --idle-timeout, and the connections of one address and of all capped
  (dlm_lsp/http/guard.py); a body not in by --body-timeout after its head is answered 408 and the
  connection closed;
- a body over --max-body-kb is answered 413 (from Content-Length before reading, or while reading
  a chunked body); bad fields 400; an unknown model 404; more than --max-inflight requests at once
  503 with Retry-After (a slot is taken once the body is in: a slow body holds none);
- every request is answered: the engine's deadline (arrival + deadline_ms) commits what it has, and
  a request still without a fill DEADLINE_GRACE_S later is answered 504 with its job cancelled;
- a client that disconnects before its answer cancels its engine job (the engine stops it within a
  step); the streamed answer is computed before its first byte, so the same watch covers it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from dlm_lsp.fill import edit_gate, suggest
from dlm_lsp.http import fim as fim_api
from dlm_lsp.http import nextedit as edit_api
from dlm_lsp.http.fim import ApiError, Completed, FimPipeline, Limits
from dlm_lsp.options import CONTEXT_TOKENS_RANGE
from engine.api import DEFAULT_CONTEXT_TOKENS, reported_context_tokens

if TYPE_CHECKING:
    from dlm_lsp.fill.gate import Calibrator
    from dlm_lsp.http.guard import ConnectionGuard
    from engine.api import EditJob, FillJob, Rewrite
    from engine.tokenizer import TextTokenizer

log = logging.getLogger("dlm.http")

DEFAULT_PORT = 8765
DEFAULT_TOKEN_ENV = "DLM_HTTP_TOKEN"
NEXT_EDIT_BUDGETS = 2  # a next edit's default deadline in --budget-ms, as the language server gives it
# How long past its deadline a request waits for the engine (which commits everything at the
# deadline, so only a stuck or overloaded engine is this late) before it is answered 504.
DEADLINE_GRACE_S = 0.25
READY_WAIT_S = 0.05  # poll of the engine state while a request waits for the model to load
# Connections (docs/reliability.md): seconds a request head may take from its first byte, a body
# from the end of its head, a connection may sit without a request; connections per address, in all.
HEAD_TIMEOUT_S = 10
BODY_TIMEOUT_S = 10
IDLE_TIMEOUT_S = 15
MAX_CLIENT_CONNECTIONS = 128
MAX_CONNECTIONS = 1024
BACKLOG = 2048  # uvicorn's default: a burst of new connections waits in the kernel's queue, not refused
CLOSE = {"Connection": "close"}  # on answers given before the body is read: nothing more comes from it


class ClientGone(Exception):
    """The client disconnected before its answer."""


OnState = Callable[[str, dict], object]  # an engine's state changes: (state, info)


class TokenGate:
    """ASGI middleware: every request but GET /health must carry the bearer token, checked as soon as
    the request head is complete (HTTP/1.1 can tell no sooner: the token is a header), before its
    body is read, a slot taken or a route matched; a refusal is 401 and the connection is closed."""

    def __init__(self, app: ASGIApp, server: FimServer):
        self.app, self.server = app, server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = self.server.token
        if scope["type"] != "http" or token is None or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        scheme, _, value = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode()):
            await self.app(scope, receive, send)
            return
        e = ApiError(
            401,
            "missing or wrong API key: send Authorization: Bearer <token>",
            type="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer", **CLOSE},
        )
        await JSONResponse(e.body(), status_code=e.status, headers=e.headers)(scope, receive, send)


class FimEngine(Protocol):
    """What the server runs fills on: EngineService's interface (in this process, or RemoteEngine for the
    user's daemon). One that has a `tok` (TextTokenizer) counts prompt tokens for `usage`."""

    def start(self) -> object: ...

    def close(self) -> None: ...

    def submit(self, job: FillJob | EditJob) -> Future[Any]: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


class FimServer:
    """The engine, its state and the API's handlers; `app` is the ASGI application."""

    def __init__(
        self,
        engine_factory: Callable[[OnState], FimEngine],
        model_id: str,
        token: str | None = None,
        limits: Limits | None = None,
        language: str = "python",
        budget_ms: int = 1000,
        max_inflight: int = 64,
        tokenizer: TextTokenizer | None = None,
        context_tokens: int | None = None,
        body_timeout_s: float = BODY_TIMEOUT_S,
        next_edit_approach: str = suggest.DEFAULT_APPROACH,
        next_edit_min_confidence: float | None = None,
    ):
        self.model_id, self.token = model_id, token or None
        if next_edit_approach not in suggest.APPROACHES:
            raise ValueError(f"next-edit approach must be one of {suggest.APPROACHES}, got {next_edit_approach!r}")
        # the language server's nextEditApproach and nextEditMinConfidence, for /v1/edit/completions
        self.next_edit_approach, self.next_edit_min_confidence = next_edit_approach, next_edit_min_confidence
        self.limits = limits or Limits()
        self.language, self.budget_ms, self.max_inflight = language, budget_ms, max_inflight
        self.body_timeout_s = body_timeout_s
        self.guard: ConnectionGuard | None = None  # run_http's, whose counts /health shows
        self.tokenizer = tokenizer
        # the context a fill is given: --context-tokens, else the budget the engine reports for its
        # model and device (engine.api.context_budget), 512 until it has
        self.context_tokens = context_tokens
        self.pipeline = FimPipeline(self.limits.max_tokens_cap, context_tokens or DEFAULT_CONTEXT_TOKENS)
        self.state: str = "loading"
        self.info: dict[str, Any] = {}
        self.inflight = 0
        self.counters = {
            "requests": 0,
            "answered": 0,
            "errors": 0,
            "disconnected": 0,
            "late": 0,
            "refused": 0,
            "body_timeouts": 0,
        }
        self._lock = threading.Lock()
        self.engine = engine_factory(self._on_state)
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.openai_completions, methods=["POST"]),
                Route("/v1/fim/completions", self.mercury_completions, methods=["POST"]),
                Route("/v1/edit/completions", self.edit_completions, methods=["POST"]),
            ],
            middleware=[Middleware(TokenGate, server=self)],
            lifespan=self._lifespan,
        )

    # ------------------------------------------------------------ engine

    def _on_state(self, state: str, info: dict | None) -> None:  # any thread
        with self._lock:
            self.state = state
            self.info = dict(info or {})
            if self.context_tokens is None:
                self.pipeline.context_tokens = reported_context_tokens(self.info)
        log.info("engine %s%s", state, f": {info.get('message')}" if info and info.get("message") else "")

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)

    @property
    def calibrator(self) -> Calibrator | None:
        """The engine's calibrated gate (dlm_lsp.fill.gate), or None: the raw confidence is gated."""
        from dlm_lsp.fill.gate import Calibrator

        raw = self.info.get("calibrator")
        if raw is not getattr(self, "_calibrator_raw", None):
            self._calibrator_raw, self._calibrator = raw, Calibrator.from_json(raw)
        return getattr(self, "_calibrator", None)

    def gate(self, kind: str) -> float:
        """The model's gate on this hole kind's shown fills (gate.kind_gate)."""
        from dlm_lsp.fill.gate import kind_gate

        return kind_gate(self.info.get("gate"), kind)

    async def _wait_ready(self, deadline: float) -> None:
        """Returns once the engine is ready; raises ApiError 503 while it loads past `deadline`."""
        while self.state != "ready":
            if self.state == "error":
                raise ApiError(
                    503,
                    f"the engine failed: {self.info.get('message') or 'see the server log'}",
                    type="server_error",
                    code="engine_error",
                )
            if time.monotonic() >= deadline:
                raise ApiError(
                    503,
                    "the model is still loading; try again shortly",
                    type="server_error",
                    code="model_loading",
                    headers={"Retry-After": "1"},
                )
            await asyncio.sleep(READY_WAIT_S)

    # ------------------------------------------------------------ request plumbing

    async def _read_body(self, request: Request, deadline: float) -> bytes:
        """The body, read by `deadline` (monotonic); raises ApiError 413 (too big), 408 (late: the
        connection is closed, as it is after a 413, whatever of the body is still on its way)."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, "bad Content-Length", headers=CLOSE)
            if int(declared) > limit:
                raise ApiError(
                    413,
                    f"the request body is {declared} bytes; at most {limit} are accepted",
                    code="request_too_large",
                    headers=CLOSE,
                )
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                async for part in request.stream():
                    size += len(part)
                    if size > limit:
                        raise ApiError(
                            413, f"the request body is over {limit} bytes", code="request_too_large", headers=CLOSE
                        )
                    chunks.append(part)
        except TimeoutError:
            with self._lock:
                self.counters["body_timeouts"] += 1
            raise ApiError(
                408,
                f"the request body did not arrive within {self.body_timeout_s:g} s of its head",
                code="request_timeout",
                headers=CLOSE,
            ) from None
        return b"".join(chunks)

    @staticmethod
    async def _disconnected(request: Request) -> None:
        """Returns when the client goes away (after the body, the next ASGI message is the disconnect)."""
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    async def _await_job(self, request: Request, job: FillJob | EditJob, fut: Future[Any], deadline_ms: int) -> Any:
        """The job's Fill (an EditJob's Rewrite); raises ClientGone (job cancelled), ApiError 504 (late:
        job cancelled) or ApiError 500 (the engine failed the job)."""
        from engine.api import EngineError

        afut = asyncio.wrap_future(fut)
        gone = asyncio.ensure_future(self._disconnected(request))
        deadline = job.deadline
        assert deadline is not None  # both routes give every job one
        limit = max(0.0, deadline + DEADLINE_GRACE_S - time.monotonic())
        waiting: set[asyncio.Future[Any]] = {afut, gone}
        try:
            done, _ = await asyncio.wait(waiting, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            job.cancel()
            raise
        finally:
            gone.cancel()
        if afut in done:
            try:
                return afut.result()
            except EngineError as e:
                raise ApiError(
                    500, f"the engine failed this request: {e}", type="server_error", code="engine_error"
                ) from None
        job.cancel()
        afut.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it now
        if gone in done:
            raise ClientGone()
        with self._lock:
            self.counters["late"] += 1
        raise ApiError(
            504,
            f"no answer within the deadline ({deadline_ms} ms) + "
            f"{DEADLINE_GRACE_S * 1000:.0f} ms; the job was cancelled",
            type="server_error",
            code="deadline_exceeded",
        )

    def _tokens(self, *texts: str) -> int:
        """The tokens of the texts by the model's tokenizer, for `usage`; 0 without one."""
        tok = self.tokenizer or getattr(self.engine, "tok", None)
        if tok is None:
            return 0
        try:
            return sum(len(ids) for ids in tok.encode_batch(list(texts)))
        except Exception:  # noqa: BLE001 - usage is informative; never fail a request over it
            return 0

    # ------------------------------------------------------------ handlers

    async def health(self, request: Request) -> Response:
        """{"status", "model", "message", "inflight"}: 200 when the engine is ready, else 503."""
        body: dict[str, Any] = {
            "status": self.state,
            "model": self.model_id,
            "message": self.info.get("message"),
            "inflight": self.inflight,
        }
        if self.guard is not None:
            body["connections"] = self.guard.stats()
        return JSONResponse(body, status_code=200 if self.state == "ready" else 503)

    async def models(self, request: Request) -> Response:
        """The model list (one model) with the `dlm` field: its state, confidence gate and limits."""
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_id,
                        "object": "model",
                        "created": 0,
                        "owned_by": "dlm-lsp",
                        "dlm": {
                            "state": self.state,
                            "gate": self.info.get("gate"),
                            "calibrator": self.info.get("calibrator"),
                            "max_fill_tokens": self.limits.max_tokens_cap,
                            "context_tokens": self.pipeline.context_tokens,
                            "max_body_bytes": self.limits.max_body_bytes,
                            "max_deadline_ms": self.limits.max_deadline_ms,
                            "default_deadline_ms": self.budget_ms,
                            "language": self.language,
                            "next_edit": True,
                        },
                    }
                ],
            }
        )

    async def openai_completions(self, request: Request) -> Response:
        """POST /v1/completions (OpenAI shape)."""
        return await self._complete(request, "openai")

    async def mercury_completions(self, request: Request) -> Response:
        """POST /v1/fim/completions (Mercury's FIM shape)."""
        return await self._complete(request, "mercury")

    async def edit_completions(self, request: Request) -> Response:
        """POST /v1/edit/completions (Mercury's next-edit shape, as Continue's Next Edit sends it)."""
        return await self._serve(request, lambda raw, arrival: self._next_edit(request, raw, arrival))

    def _error(self, e: ApiError) -> Response:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @contextlib.contextmanager
    def _slot(self) -> Iterator[None]:
        """One of --max-inflight slots for a request whose body is in; raises ApiError 503 when none is free."""
        with self._lock:
            busy = self.inflight >= self.max_inflight
            if busy:
                self.counters["refused"] += 1
            else:
                self.inflight += 1
        if busy:
            raise ApiError(
                503,
                f"{self.max_inflight} requests are in flight; try again shortly",
                type="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        try:
            yield
        finally:
            with self._lock:
                self.inflight -= 1

    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_id):
            raise ApiError(
                404,
                f"model {model!r} not found; this server serves {self.model_id!r}",
                param="model",
                code="model_not_found",
            )

    async def _serve(self, request: Request, answer: Callable[[bytes, float], Awaitable[Response]]) -> Response:
        """Reads the body and answers it with `answer(body, arrival)`; every failure becomes its answer
        (ApiError its status, a client gone 499, anything else 500) and is counted."""
        arrival = time.monotonic()
        with self._lock:
            self.counters["requests"] += 1
        try:
            raw = await self._read_body(request, arrival + self.body_timeout_s)
            response = await answer(raw, arrival)
            with self._lock:
                self.counters["answered"] += 1
            return response
        except ApiError as e:
            if e.status >= 500:
                log.warning("request answered %d: %s", e.status, e.message)
                with self._lock:
                    self.counters["errors"] += 1
            return self._error(e)
        except (ClientGone, ClientDisconnect):
            with self._lock:
                self.counters["disconnected"] += 1
            log.info("client went away; its engine job was cancelled")
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - one request's bug must not take the server down
            log.exception("request failed")
            with self._lock:
                self.counters["errors"] += 1
            return self._error(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    async def _complete(self, request: Request, flavour: str) -> Response:
        return await self._serve(request, lambda raw, arrival: self._fill(request, raw, arrival, flavour))

    async def _fill(self, request: Request, raw: bytes, arrival: float, flavour: str) -> Response:
        """A completion: the body parsed, the fill through the language server's pipeline, the answer."""
        p = fim_api.parse_body(raw, flavour, self.limits, self.language, self.budget_ms)
        self._check_model(p.model)
        with self._slot():
            await self._wait_ready(arrival + p.deadline_ms / 1000.0)
            prep = self.pipeline.prepare(p, arrival)
            fill = await self._await_job(request, prep.job, self.engine.submit(prep.job), p.deadline_ms)
            done = self.pipeline.complete(prep, fill, self.gate(prep.request.hole_kind), self.calibrator)
        use = fim_api.usage(self._tokens(prep.request.prefix, prep.request.suffix), fill.tokens, flavour)
        dlm = fim_api.timing(prep, fill, done)
        cid = fim_api.completion_id()
        if p.stream:
            return StreamingResponse(
                self._events(cid, done, use, dlm, p.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(fim_api.response(cid, self.model_id, done.text, done.finish_reason, use, dlm))

    async def _next_edit(self, request: Request, raw: bytes, arrival: float) -> Response:
        """A next edit: the prompt read back into a document, its region rewritten through the language
        server's path (suggest: the EditJob, the judgement) and answered as Mercury answers."""
        p = edit_api.parse_body(raw, self.limits, self.budget_ms * NEXT_EDIT_BUDGETS)
        self._check_model(p.model)
        prompt = edit_api.parse_prompt(p.prompt)
        deadline = arrival + p.deadline_ms / 1000.0
        with self._slot():
            req = edit_api.edit_request(prompt, self.next_edit_approach, deadline, self.pipeline.context_tokens, p)
            rewrite: Rewrite | None = None
            if not req.recent:  # nothing to go on (suggest.edit_request's None)
                found = suggest.Suggestion(silent="no recent edits", new_window=req.window)
            else:
                least = 0.0  # the edit gate's, for the baseline's suggestions
                if req.job is None:
                    b = suggest.baseline(req, edit_gate.shipped())
                    new_window, confidence, least = b.window, b.confidence, b.least
                else:
                    self._check_region_fits(req.job)
                    await self._wait_ready(deadline)
                    rewrite = await self._await_job(request, req.job, self.engine.submit(req.job), p.deadline_ms)
                    new_window, confidence = rewrite.text, rewrite.confidence
                user = p.min_confidence if p.min_confidence is not None else self.next_edit_min_confidence
                found = suggest.judge(req, new_window, confidence, suggest.least_shown(user, least))
        text = edit_api.content(edit_api.new_region(req, found))
        use = fim_api.usage(self._tokens(p.prompt), self._tokens(text), "openai")
        dlm = edit_api.timing(req, found, rewrite, arrival)
        cid = edit_api.completion_id()
        if p.stream:
            return StreamingResponse(
                self._edit_events(cid, text, use, dlm, p.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(edit_api.response(cid, self.model_id, text, use, dlm))

    def _check_region_fits(self, job: EditJob) -> None:
        """Raises ApiError 400 when the model's tokenizer (if at hand) counts more tokens in the region
        than the job's slots: the engine would refuse the job."""
        tokens = self._tokens(job.window)
        if tokens > job.max_tokens:
            raise ApiError(
                400,
                f"the editable region is {tokens} tokens; at most {job.max_tokens} are rewritten: mark fewer lines",
                param="messages",
            )

    async def _events(
        self, cid: str, done: Completed, use: dict, dlm: dict, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """The answer as server-sent events: the text, the finish reason (+ dlm), usage, [DONE]."""
        if done.text:
            yield fim_api.sse(fim_api.chunk(cid, self.model_id, done.text, None))
        yield fim_api.sse(fim_api.chunk(cid, self.model_id, "", done.finish_reason, {"dlm": dlm}))
        if include_usage:
            yield fim_api.sse(fim_api.chunk(cid, self.model_id, None, None, {"usage": use}, choices=False))
        yield fim_api.SSE_DONE

    async def _edit_events(
        self, cid: str, text: str, use: dict, dlm: dict, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """A next edit's answer as chat-completion events: the message, the finish reason (+ dlm), usage, [DONE]."""
        yield fim_api.sse(edit_api.chunk(cid, self.model_id, {"role": "assistant", "content": text}, None))
        yield fim_api.sse(edit_api.chunk(cid, self.model_id, {}, "stop", {"dlm": dlm}))
        if include_usage:
            yield fim_api.sse(edit_api.chunk(cid, self.model_id, None, None, {"usage": use}))
        yield fim_api.SSE_DONE


# ---------------------------------------------------------------------- running it


def engine_factory(kind: str, model: str | None, device: str, threads: int | None) -> Callable[[OnState], FimEngine]:
    """on_state -> an engine with EngineService's interface: in this process, or the user's daemon."""

    def make(on_state: OnState) -> FimEngine:
        if kind == "shared":
            from engine.clients.remote import RemoteEngine

            return RemoteEngine(model=model, device=device, on_state=on_state, threads=threads)
        from engine.serve.service import EngineService

        return EngineService(model=model, device=device, on_state=on_state, threads=threads)

    return make


def model_id_for(model: str | None) -> str:
    """The id /v1/models gives a model: "dlm-default", or the checkpoint folder's name (never its path)."""
    if model in (None, "", "default"):
        return "dlm-default"
    return Path(str(model)).name or str(model)


def load_tokenizer(model: str | None) -> TextTokenizer | None:
    """The model's tokenizer for `usage` counts (no torch), or None."""
    from engine.clients import wire
    from engine.tokenizer import TextTokenizer

    folder = Path(wire.resolved_model(model))
    try:
        return TextTokenizer.load(folder) if (folder / "tokenizer.json").is_file() else None
    except Exception:  # noqa: BLE001
        return None


def bind(host: str, port: int, backlog: int = BACKLOG) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 takes a free one."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs a token)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: a free one)")
    p.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    p.add_argument(
        "--model-id", default=None, help="the id /v1/models gives (default: dlm-default or the folder's name)"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of the engine")
    p.add_argument(
        "--engine",
        choices=["inproc", "shared"],
        default="inproc",
        help="run the engine in this process (default) or use the user's shared engine daemon",
    )
    p.add_argument(
        "--token-env",
        default=DEFAULT_TOKEN_ENV,
        help=f"environment variable holding the bearer token (default {DEFAULT_TOKEN_ENV}); unset: no token",
    )
    p.add_argument("--budget-ms", type=int, default=1000, help="default deadline of a request (its deadline_ms)")
    p.add_argument(
        "--max-fill-tokens", type=int, default=64, help="most mask slots of one fill (max_tokens above is cut)"
    )
    p.add_argument(
        "--context-tokens",
        type=int,
        default=None,
        help="tokens of context a fill is given (default: the model's window, at most 512 on the CPU, 4096 on CUDA)",
    )
    p.add_argument("--max-body-kb", type=int, default=1024, help="largest request body accepted (413 above)")
    p.add_argument("--max-inflight", type=int, default=64, help="requests at once before 503")
    p.add_argument("--language", default="python", help="languageId of requests that name none")
    p.add_argument(
        "--head-timeout",
        type=int,
        default=HEAD_TIMEOUT_S,
        help=f"seconds a request head may take from its first byte (default {HEAD_TIMEOUT_S}; later: 408, closed)",
    )
    p.add_argument(
        "--body-timeout",
        type=int,
        default=BODY_TIMEOUT_S,
        help=f"seconds a request body may take after its head (default {BODY_TIMEOUT_S}; later: 408, closed)",
    )
    p.add_argument(
        "--idle-timeout",
        type=int,
        default=IDLE_TIMEOUT_S,
        help=f"seconds a connection may stay open without a request, first or next (default {IDLE_TIMEOUT_S})",
    )
    p.add_argument(
        "--max-client-connections",
        type=int,
        default=MAX_CLIENT_CONNECTIONS,
        help=f"open connections from one address (default {MAX_CLIENT_CONNECTIONS}; more: 503, closed)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help=f"open connections in all (default {MAX_CONNECTIONS}; more: an idle one is closed, else 503); "
        "the open-file limit is raised to fit, or this lowered to fit it",
    )
    p.add_argument(
        "--next-edit-approach",
        choices=suggest.APPROACHES,
        default=suggest.DEFAULT_APPROACH,
        help=f"how /v1/edit/completions rewrites the region, as the language server's nextEditApproach "
        f"(default {suggest.DEFAULT_APPROACH}: the recent edits' substitutions carried, no model)",
    )
    p.add_argument(
        "--next-edit-min-confidence",
        type=float,
        default=None,
        metavar="P",
        help="the least confidence of a next edit shown, for every kind, as nextEditMinConfidence "
        "(default: the edit gate's per kind, dlm_lsp/fill/edit_gate.json); a request's min_confidence wins",
    )


def run_http(args: argparse.Namespace) -> int:
    import uvicorn

    token = os.environ.get(args.token_env or "", "").strip() or None
    if not is_loopback(args.host) and token is None:
        print(
            f"dlm-lsp http: refusing to listen on {args.host} without a token: set the environment variable "
            f"{args.token_env} (or bind 127.0.0.1)",
            file=sys.stderr,
        )
        return 2
    if not 1 <= args.max_fill_tokens <= fim_api.MAX_SLOTS:
        print(f"dlm-lsp http: --max-fill-tokens must be 1..{fim_api.MAX_SLOTS}", file=sys.stderr)
        return 2
    low, high = CONTEXT_TOKENS_RANGE
    if args.context_tokens is not None and not low <= args.context_tokens <= high:
        print(f"dlm-lsp http: --context-tokens must be {low}..{high}", file=sys.stderr)
        return 2
    if args.next_edit_min_confidence is not None and not 0.0 <= args.next_edit_min_confidence <= 1.0:
        print("dlm-lsp http: --next-edit-min-confidence must be 0..1", file=sys.stderr)
        return 2
    positive = ("head_timeout", "body_timeout", "idle_timeout", "max_client_connections", "max_connections")
    for name in positive:
        if getattr(args, name) < 1:
            print(f"dlm-lsp http: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    from dlm_lsp.http.guard import ConnectionGuard, GuardLimits, fit_open_file_limit

    max_connections = fit_open_file_limit(args.max_connections)
    if max_connections < args.max_connections:
        log.warning(
            "the open-file limit holds %d connections, not --max-connections %d: raise it (ulimit -n) for more",
            max_connections,
            args.max_connections,
        )
    guard = ConnectionGuard(
        GuardLimits(
            head_timeout=args.head_timeout,
            max_connections=max_connections,
            max_per_client=min(args.max_client_connections, max_connections),
        )
    )
    limits = Limits(max_body_bytes=args.max_body_kb * 1024, max_tokens_cap=args.max_fill_tokens)
    server = FimServer(
        engine_factory(args.engine, args.model, args.device, args.threads),
        args.model_id or model_id_for(args.model),
        token=token,
        limits=limits,
        language=args.language,
        budget_ms=args.budget_ms,
        max_inflight=args.max_inflight,
        tokenizer=load_tokenizer(args.model),
        context_tokens=args.context_tokens,
        body_timeout_s=args.body_timeout,
        next_edit_approach=args.next_edit_approach,
        next_edit_min_confidence=args.next_edit_min_confidence,
    )
    server.guard = guard
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"dlm-lsp http: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        json.dumps({"listening": f"http://{shown}:{port}", "model": server.model_id, "token": token is not None}),
        flush=True,
    )
    # uvicorn's own limits as they are meant: the keep-alive timeout (guard.py arms it before a first
    # request too), the h11 head size limit (h11 named, so it holds where httptools is installed); the
    # guard's protocol adds the head deadline and the connection caps. The backlog is bind()'s.
    config = uvicorn.Config(
        server.app,
        http=guard.protocol(),
        log_level="warning",
        timeout_keep_alive=args.idle_timeout,
        lifespan="on",
        h11_max_incomplete_event_size=64 * 1024,
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0
