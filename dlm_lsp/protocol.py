"""The JSON-RPC layer under the server: stdio framing, envelopes, the LSP lifecycle; never exits on input.

pygls parses headers outside its error handling (a huge Content-Length ends the process) and turns
every nested JSON object with a "jsonrpc" key into a message, so this module owns the stdio loop:

  stdin bytes --Framer--> bodies --DlmProtocol.receive-->
    JSON (else ParseError -32700, id null) -> envelope (else InvalidRequest -32600) ->
    lifecycle (ServerNotInitialized -32002 before initialize; InvalidRequest after shutdown and on a
    second initialize) -> params typed from the top-level object only (else InvalidParams -32602)
    -> pygls's dispatch (MethodNotFound -32601 for an unknown request)

Notifications are never answered: a malformed one, an unknown one or one whose handler fails is
logged, never shown to the user. `exit` ends the loop: exit code 0 after `shutdown`, else 1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import json
import logging
import os
import re
import sys
import threading
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from lsprotocol import types
from pygls.exceptions import JsonRpcInternalError, JsonRpcMethodNotFound
from pygls.io_ import StdoutWriter
from pygls.protocol import JsonRPCNotification, JsonRPCRequestMessage, LanguageServerProtocol
from pygls.protocol.json_rpc import RPCRequest
from pygls.protocol.language_server import lsp_method

from dlm_lsp.fill.documents import ContentChange

if TYPE_CHECKING:
    from cattrs import Converter
    from pygls.lsp.server import LanguageServer

log = logging.getLogger("dlm.protocol")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a longer Content-Length is skipped (stated in docs/lsp-extensions.md)
MAX_HEADER_LINE = 8 * 1024  # a longer line without a newline cannot be a header: dropped as garbage
READ_CHUNK = 64 * 1024

PARSE_ERROR = int(types.ErrorCodes.ParseError)  # -32700
INVALID_REQUEST = int(types.ErrorCodes.InvalidRequest)  # -32600
METHOD_NOT_FOUND = int(types.ErrorCodes.MethodNotFound)  # -32601
INVALID_PARAMS = int(types.ErrorCodes.InvalidParams)  # -32602
SERVER_NOT_INITIALIZED = int(types.ErrorCodes.ServerNotInitialized)  # -32002

# ---------------------------------------------------------------------- framing

_CONTENT_LENGTH = b"content-length:"
_HEADER = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*(.*?)[ \t]*")  # RFC 7230 field name


@dataclass(frozen=True)
class Skipped:
    """Bytes the framer dropped, and why (the caller logs it)."""

    reason: str
    nbytes: int


class Framer:
    """Cuts an LSP byte stream (`Content-Length: N` and other header lines, a blank line, N bytes)
    into message bodies. `feed` never raises: a header block with a missing, malformed or too large
    Content-Length is skipped whole, and bytes that are not headers are skipped until the next
    Content-Length line (found even when glued to the end of garbage), which resynchronizes."""

    def __init__(self, max_body: int = MAX_MESSAGE_BYTES):
        self.max_body = max_body
        self._buf = bytearray()
        self._need: int | None = None  # the body length once a header block ended
        self._garbage = 0  # bytes skipped since the last header, reported when the next one starts
        self._reset_block()

    def _reset_block(self) -> None:
        self._block = 0  # bytes of the header block read so far
        self._length: int | None = None
        self._error: str | None = None

    def feed(self, data: bytes) -> list[bytes | Skipped]:
        """Returns the bodies (and the skipped stretches) that `data` completes, in stream order."""
        self._buf += data
        out: list[bytes | Skipped] = []
        while True:
            if self._need is not None:
                if len(self._buf) < self._need:
                    break
                out.append(bytes(self._buf[: self._need]))
                del self._buf[: self._need]
                self._need = None
                continue
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > MAX_HEADER_LINE:
                    self._drop_long_line()
                break
            line = bytes(self._buf[: nl + 1])
            del self._buf[: nl + 1]
            self._line(line, out)
        return out

    def eof(self) -> list[Skipped]:
        """Reports what the stream's end cut short."""
        out: list[Skipped] = []
        self._flush_garbage(out)
        if self._need is not None:
            out.append(
                Skipped(f"the input ended {self._need - len(self._buf)} bytes short of a message body", len(self._buf))
            )
        elif self._buf or self._block:
            out.append(Skipped("the input ended inside a header", len(self._buf) + self._block))
        self._buf.clear()
        self._need = None
        self._reset_block()
        return out

    def _line(self, line: bytes, out: list[bytes | Skipped]) -> None:
        text = line.rstrip(b"\r\n")
        if not text:
            if not self._block:
                if self._garbage:
                    self._garbage += len(line)  # a blank line in garbage; alone, a stray one is harmless
                return
            if self._error is not None:
                out.append(Skipped(self._error, self._block + len(line)))
            elif self._length is None:
                out.append(Skipped("a header without Content-Length", self._block + len(line)))
            else:
                self._need = self._length
            self._reset_block()
            return
        at = text.lower().find(_CONTENT_LENGTH)
        if at > 0:  # garbage with a header glued to its end (`xyzContent-Length: 5` too)
            self._garbage += self._block + at
            self._reset_block()
            line, text = line[at:], text[at:]
        m = _HEADER.fullmatch(text)
        if m is None:
            self._garbage += self._block + len(line)
            self._reset_block()
            return
        if not self._block:
            self._flush_garbage(out)
        self._block += len(line)
        if m.group(1).lower() == b"content-length":
            self._content_length(m.group(2))

    def _content_length(self, value: bytes) -> None:
        if not value.isdigit() or len(value) > 19:
            shown = value[:24] + (b"..." if len(value) > 24 else b"")
            self._error = f"Content-Length {shown.decode('latin-1')!r} ({len(value)} bytes) is not a byte count"
            return
        n = int(value)
        if self._length is not None and n != self._length:
            self._error = f"two Content-Length headers ({self._length} and {n})"
        elif n > self.max_body:
            self._error = f"a message of {n} bytes is over the {self.max_body}-byte limit"
        self._length = n

    def _drop_long_line(self) -> None:
        # keep a header that starts after the garbage, or a tail that may be the start of one
        at = bytes(self._buf).lower().rfind(_CONTENT_LENGTH)
        drop = at if at > 0 else len(self._buf) - (len(_CONTENT_LENGTH) - 1)
        self._garbage += self._block + drop
        self._reset_block()
        del self._buf[:drop]

    def _flush_garbage(self, out: list[Skipped] | list[bytes | Skipped]) -> None:
        if self._garbage:
            out.append(Skipped("bytes that are not an LSP header", self._garbage))
            self._garbage = 0


# ---------------------------------------------------------------------- envelopes


def check_envelope(data: object) -> tuple[str, int | str | None, str | None]:
    """Returns (kind, id, problem) of a parsed message: kind is request, notification, response or
    invalid; id is the one an answer may carry (None when it is missing or malformed); problem
    says why an invalid message, or a response that cannot be used, is wrong."""
    if isinstance(data, list):
        return "invalid", None, "batches are not supported"
    if not isinstance(data, dict):
        return "invalid", None, f"a message must be a JSON object, not {type(data).__name__}"
    has_id = "id" in data
    msg_id = data.get("id")
    id_ok = isinstance(msg_id, (int, str)) and not isinstance(msg_id, bool)
    reply = msg_id if id_ok else None
    version_bad = data.get("jsonrpc") != "2.0"
    if "method" not in data:
        if "result" in data or "error" in data:
            problem = (
                'jsonrpc must be "2.0"'
                if version_bad
                else None
                if id_ok or (msg_id is None and "error" in data)
                else "id must be an integer or a string"
            )
            return "response", reply, problem
        return "invalid", None, "neither a request, a notification nor a response (no method, result or error)"
    if has_id and not id_ok:
        return "invalid", None, "id must be an integer or a string"
    if version_bad:
        return "invalid", reply, 'jsonrpc must be "2.0"'
    if not isinstance(data["method"], str):
        return "invalid", reply, "method must be a string"
    return ("request" if has_id else "notification"), reply, None


class Lifecycle(enum.Enum):
    NEW = "not initialized"
    RUNNING = "initialized"
    SHUT_DOWN = "shut down"


# The read order of the message being handled: 1, 2, 3... per protocol, set while a message is handed
# to its handler. A request's handler is a task that may first run after later messages were read (a
# busy loop reads a burst of didChange + request pairs before any of those tasks starts); the task
# keeps the number of its own message (a task copies the context it was made in), so the server can
# tell a request that was read before the document's latest change from one read after it.
READ_ORDER: ContextVar[int | None] = ContextVar("dlm_read_order", default=None)


def read_order() -> int | None:
    """The read order of the message whose handler is running (READ_ORDER), None outside one."""
    return READ_ORDER.get()


class DlmProtocol(LanguageServerProtocol):
    """pygls's LSP protocol behind our own intake: `receive(body)` answers every request, only the
    top-level object becomes a message, and notifications are never answered or shown."""

    def __init__(self, server: LanguageServer, converter: Converter):
        super().__init__(server, converter)
        self.lifecycle = Lifecycle.NEW
        self.exit_code: int | None = None  # set by `exit`: the loop stops
        self._initialized_seen = False
        self._read = 0  # messages handed to handlers so far (READ_ORDER)

    @lsp_method(types.INITIALIZE)
    def lsp_initialize(self, params: types.InitializeParams) -> Any:
        """pygls's initialize, its capabilities with ours under `experimental` (the server's
        `experimental_capabilities`: the dlm/... requests a client may look for)."""
        result = yield from super().lsp_initialize(params)
        extra = getattr(self._server, "experimental_capabilities", None)
        if extra:
            result.capabilities.experimental = dict(extra)
        return result

    def send_error(self, msg_id: int | str | None, code: int, message: str) -> None:
        """Sends an error response; `msg_id` may be None (pygls would drop the id key)."""
        self._send_data({"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}})

    def receive(self, body: bytes) -> None:
        """Handles one message body; never raises except BrokenPipeError (the client is gone)."""
        try:
            data = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            log.warning("unparseable message of %d bytes: %s", len(body), str(e)[:200])
            self.send_error(None, PARSE_ERROR, f"Parse error: {str(e)[:200]}")
            return
        try:
            self._receive(data)
        except BrokenPipeError:
            raise
        except Exception:  # noqa: BLE001 - a message must never take the server down
            log.exception("message not handled: %.300r", data)

    def _receive(self, data: Any) -> None:  # parsed JSON: check_envelope says what it is
        kind, msg_id, problem = check_envelope(data)
        if kind == "invalid":
            log.warning("invalid message: %s: %.200r", problem, data)
            self.send_error(msg_id, INVALID_REQUEST, f"Invalid request: {problem}")
            return
        if kind == "response":
            self._response(data, msg_id, problem)
            return
        method, is_request = data["method"], kind == "request"
        if method == types.EXIT and not is_request:
            self.exit_code = 0 if self.lifecycle is Lifecycle.SHUT_DOWN else 1
            log.info("exit (%s): exit code %d", self.lifecycle.value, self.exit_code)
            return
        refusal = self._refusal(method)
        if refusal is not None:
            if is_request:
                log.warning("refused %s request %r: %s", method, msg_id, refusal[1])
                self.send_error(msg_id, *refusal)
            else:
                log.info("dropped %s notification: %s", method, refusal[1])
            return
        envelope: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": data.get("params")}
        if is_request:
            envelope["id"] = msg_id
        cls = self.get_message_type(method) or (JsonRPCRequestMessage if is_request else JsonRPCNotification)
        try:
            message = self._converter.structure(envelope, cls)
        except Exception as e:  # noqa: BLE001 - cattrs raises several kinds
            if is_request:
                log.warning("malformed %s request %r: %s", method, msg_id, e)
                self.send_error(msg_id, INVALID_PARAMS, f"invalid params for {method}")
            else:
                log.warning("malformed %s notification ignored: %s", method, e)
            return
        if is_request and not isinstance(message, RPCRequest):
            log.warning("%s sent as a request (id %r)", method, msg_id)
            self.send_error(msg_id, METHOD_NOT_FOUND, f"{method} is a notification, not a request")
            return
        if is_request and method == types.INITIALIZE:
            self.lifecycle = Lifecycle.RUNNING
        elif is_request and method == types.SHUTDOWN:
            self.lifecycle = Lifecycle.SHUT_DOWN
        elif method == types.INITIALIZED:
            if self._initialized_seen:
                log.info("dropped a second initialized notification")  # it would restart the engine
                return
            self._initialized_seen = True
        self._read += 1
        token = READ_ORDER.set(self._read)
        try:
            self.handle_message(message)
        finally:
            READ_ORDER.reset(token)

    def _refusal(self, method: str) -> tuple[int, str] | None:
        if self.lifecycle is Lifecycle.SHUT_DOWN:
            return INVALID_REQUEST, "the server is shut down: only exit is accepted"
        if self.lifecycle is Lifecycle.NEW and method != types.INITIALIZE:
            return SERVER_NOT_INITIALIZED, "the server is not initialized: send initialize first"
        if self.lifecycle is Lifecycle.RUNNING and method == types.INITIALIZE:
            return INVALID_REQUEST, "already initialized"
        return None

    def _response(self, data: dict[str, Any], msg_id: int | str | None, problem: str | None) -> None:
        """A client's answer to one of our requests; malformed ones fail that request, never answered."""
        if problem is None:
            try:
                self.handle_message(self.structure_message(data))
                return
            except Exception as e:  # noqa: BLE001
                problem = str(e) or type(e).__name__
        log.warning("malformed response to %r: %s", msg_id, problem)
        if msg_id is None:
            return  # none of our requests has a null id: nothing waits for it
        self._result_types.pop(msg_id, None)
        future = self._request_futures.pop(msg_id, None)
        if future is not None and not future.done():
            future.set_exception(JsonRpcInternalError(f"malformed response: {problem}"))

    # pygls would show "Error in server" (window/showMessage) for these; a log line is enough

    def _handle_notification(self, method_name: str, params: Any) -> None:
        if method_name == types.CANCEL_REQUEST:
            # only an id a request can have (a number or a string) names a request to cancel
            req_id = getattr(params, "id", None)
            if isinstance(req_id, bool) or not isinstance(req_id, (int, str)):
                log.debug("ignored $/cancelRequest with id %r", req_id)
                return
            super()._handle_notification(method_name, params)
            return
        try:
            handler = self._get_handler(method_name)
        except JsonRpcMethodNotFound:
            log.debug("ignored notification %s", method_name)
            return
        self._execute_handler(str(uuid.uuid4()), handler, self._check_handler_result, args=(params,))

    def _check_handler_result(self, future: concurrent.futures.Future[Any]) -> None:
        if not future.cancelled() and (exc := future.exception()) is not None:
            log.warning("notification handler failed: %s", exc, exc_info=exc)


# ---------------------------------------------------------------------- text sync params


def require_sync_types(converter: Converter) -> None:
    """Makes a cattrs converter refuse text-sync params of the wrong JSON types instead of coercing
    them (it turns {"text": null} into the text "None", 5 into "5", a version "1" into 1): such a
    didOpen / didChange is malformed and ignored whole (logged by the protocol layer)."""

    def is_int(v: object) -> bool:
        return type(v) is int  # not bool, not "1"

    def position(p: object) -> bool:
        return isinstance(p, dict) and is_int(p.get("line")) and is_int(p.get("character"))

    def change(o: object) -> str | None:
        if not isinstance(o, dict) or not isinstance(o.get("text"), str):
            return "text is not a string"
        rng = o.get("range", {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}})
        if not (isinstance(rng, dict) and position(rng.get("start")) and position(rng.get("end"))):
            return "range is not two positions of integers"
        return None

    def item(o: object) -> str | None:
        ok = (
            isinstance(o, dict)
            and all(isinstance(o.get(k), str) for k in ("uri", "languageId", "text"))
            and is_int(o.get("version"))
        )
        return None if ok else "uri, languageId, version or text of the wrong type"

    def versioned(o: object) -> str | None:
        ok = isinstance(o, dict) and isinstance(o.get("uri"), str) and is_int(o.get("version"))
        return None if ok else "uri or version of the wrong type"

    checks: tuple[tuple[type, Callable[[object], str | None]], ...] = (
        (types.TextDocumentContentChangePartial, change),
        (types.TextDocumentContentChangeWholeDocument, change),
        (types.TextDocumentItem, item),
        (types.VersionedTextDocumentIdentifier, versioned),
    )
    for cls, check in checks:
        base_hook = converter.get_structure_hook(cls)

        def hook(
            obj: object,
            t: type,
            base: Callable[[object, type], object] = base_hook,
            check: Callable[[object], str | None] = check,
            name: str = cls.__name__,
        ) -> object:
            problem = check(obj)
            if problem:
                raise TypeError(f"{name}: {problem}")
            return base(obj, t)

        converter.register_structure_hook(cls, hook)


def content_changes(changes: object) -> object:
    """didChange's content changes (lsprotocol's TextDocumentContentChange* objects, typed by the
    hooks of `require_sync_types`) as the document store's plain documents.ContentChange. A change of
    the wrong shape keeps its wrong fields, so the store ignores the notification whole."""
    if not isinstance(changes, (list, tuple)):
        return changes
    return [_content_change(ch) for ch in changes]


def _wire(o: object, name: str) -> Any:
    """o.name as the client sent it (None when absent), of whatever type: valid_change checks it."""
    return getattr(o, name, None)


def _content_change(ch: object) -> ContentChange:
    rng = _wire(ch, "range")
    text = _wire(ch, "text")
    if rng is None:
        return ContentChange(text)
    start, end = _wire(rng, "start"), _wire(rng, "end")
    return ContentChange(
        text,
        (_wire(start, "line"), _wire(start, "character")),
        (_wire(end, "line"), _wire(end, "character")),
    )


# ---------------------------------------------------------------------- stdio loop


def run_stdio(server: LanguageServer, stdin: BinaryIO | None = None, stdout: BinaryIO | None = None) -> int:
    """Serves `server` (a pygls server whose protocol is a DlmProtocol) over stdio until `exit` or
    the end of input; returns the process exit code: 0 after shutdown, else 1."""
    protocol = cast(DlmProtocol, server.protocol)  # built with protocol_cls=DlmProtocol
    protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
    try:
        asyncio.run(_serve(stdin or sys.stdin.buffer, protocol))
    except BrokenPipeError:
        log.error("the client closed the connection")
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    if protocol.exit_code is not None:
        return protocol.exit_code
    return 0 if protocol.lifecycle is Lifecycle.SHUT_DOWN else 1


async def _serve(stdin: BinaryIO, protocol: DlmProtocol) -> None:
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes] = asyncio.Queue(maxsize=8)  # bounded: the reader waits while we are behind
    threading.Thread(target=_pump, args=(stdin, loop, chunks), name="dlm-stdin", daemon=True).start()
    framer = Framer()
    while protocol.exit_code is None:
        chunk = await chunks.get()
        for item in framer.feed(chunk) if chunk else framer.eof():
            if isinstance(item, Skipped):
                log.warning("skipped %d bytes of input: %s", item.nbytes, item.reason)
                continue
            protocol.receive(item)
            if protocol.exit_code is not None:
                return
            await asyncio.sleep(0)  # let the handlers just scheduled start, message by message
        if not chunk:
            log.info("end of input")
            return


def _pump(stdin: BinaryIO, loop: asyncio.AbstractEventLoop, chunks: asyncio.Queue[bytes]) -> None:
    """Reads stdin on its own daemon thread (so `exit` never waits for it) into `chunks`."""
    try:
        fd = stdin.fileno()
        read = lambda: os.read(fd, READ_CHUNK)  # noqa: E731 - unbuffered: no lock held at interpreter exit
    except (AttributeError, OSError, ValueError):
        read = lambda: (getattr(stdin, "read1", None) or stdin.read)(READ_CHUNK)  # noqa: E731
    while True:
        try:
            chunk = read()
        except (OSError, ValueError) as e:
            log.error("reading stdin failed: %s", e)
            chunk = b""
        try:
            asyncio.run_coroutine_threadsafe(chunks.put(chunk), loop).result()
        except (RuntimeError, concurrent.futures.CancelledError, asyncio.CancelledError):
            return  # the loop has ended
        if not chunk:
            return
