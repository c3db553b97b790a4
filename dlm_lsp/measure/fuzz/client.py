"""The fuzzer's side of the wire: an LspClient that writes raw bytes and survives malformed output,
the server it starts, and the messages' framing and common params."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from dlm_lsp.measure.fuzz.checks import _brief
from dlm_lsp.measure.replay import LspClient

FAKE_SERVER = Path(__file__).resolve().with_name("fake_server.py")  # the real server with the scripted engine
DOC_TEXT = "dlm/documentText"
PING = "fuzz/ping"


class FuzzClient(LspClient):
    """LspClient that sends raw bytes, survives malformed output (kept in `bad_output`) and keeps
    responses nobody waits for (`stray`)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.bad_output: list[str] = []
        self.stray: list[dict[str, Any]] = []
        self.gone = False

    def _write(self, msg: Any) -> None:
        self.send_bytes(_frame(json.dumps(msg).encode("utf-8")))

    def send_bytes(self, data: bytes) -> None:
        stdin = self._stdin
        try:
            stdin.write(data)
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            self.gone = True

    async def drain(self) -> None:
        stdin = self._stdin
        try:
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            self.gone = True

    async def _read_loop(self) -> None:
        out = self._stdout
        try:
            while True:
                length: int | None = None
                while True:
                    line = await out.readline()
                    if not line:
                        return
                    line = line.strip()
                    if not line:
                        break
                    if line.lower().startswith(b"content-length:"):
                        try:
                            length = int(line.split(b":", 1)[1])
                        except ValueError:
                            self.bad_output.append(f"bad header {line[:80]!r}")
                    elif not line.lower().startswith(b"content-type:"):
                        self.bad_output.append(f"bad header {line[:80]!r}")
                if length is None:
                    self.bad_output.append("header block without Content-Length")
                    continue
                body = await out.readexactly(length)
                try:
                    msg = json.loads(body)
                except ValueError as e:
                    self.bad_output.append(f"body is not JSON ({e}): {body[:120]!r}")
                    continue
                for m in msg if isinstance(msg, list) else [msg]:
                    if isinstance(m, dict):
                        self._dispatch(m)
                    else:
                        self.bad_output.append(f"message is not an object: {_brief(m)}")
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return
        finally:
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("server exited"))

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "method" not in msg and msg.get("id") not in self.pending:
            self.stray.append(msg)
            return
        super()._dispatch(msg)

    def expect(self, msg_id: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # answers nobody awaits are fine
        self.pending[msg_id] = fut
        return fut


def _frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def server_command(model: str | None) -> list[str]:
    """The server for `model`: a `scripted:` model runs the real server with the scripted engine."""
    if model and model.startswith("scripted:"):
        return [sys.executable, str(FAKE_SERVER)]
    return [sys.executable, "-m", "dlm_lsp", "serve"]


def _doc_text(msg: Any) -> Any:
    """The text a didOpen carries (for deciding what is too big to keep)."""
    params = msg.get("params") if isinstance(msg, dict) else None
    td = params.get("textDocument") if isinstance(params, dict) else None
    return td.get("text", "") if isinstance(td, dict) else ""


def _inline_params(uri: str, line: Any, char: Any) -> dict[str, Any]:
    return {"textDocument": {"uri": uri}, "position": {"line": line, "character": char}, "context": {"triggerKind": 2}}
