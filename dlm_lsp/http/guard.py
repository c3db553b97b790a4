"""What `dlm-lsp http` does about clients that hold connections without finishing requests: uvicorn's
own h11 protocol (its keep-alive timeout, head size limit and backlog used as they are), with the
connection-level rules uvicorn does not have (no head deadline, no timer on a connection before its
first request, no cap per client: docs/reliability.md):

- a request head must be complete within `head_timeout` seconds of its first byte: else 408, closed;
- a connection that sends nothing is closed after uvicorn's keep-alive timeout, before its first
  request as between requests (uvicorn arms that timer only once a response is done);
- at most `max_per_client` connections from one address (an IPv6 one's /64): the next is answered
  503 and closed;
- at most `max_connections` in all: a new connection past it closes an idle one (no request in
  progress: between requests, or still sending its head) of the address holding the most, so a new
  client always finds room while any connection is idle; only when none is idle is it refused.

The body's deadline is the app's (app.py: its receive() under a timeout), where the request is known.
One ConnectionGuard per server; everything here runs on the server's event loop thread.
"""

from __future__ import annotations

import asyncio
import http
import ipaddress
import json
import logging
import resource
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("dlm.http")

# Descriptors kept for everything but client connections (the listening socket, model files, logs,
# the engine daemon's socket, torch's own): the connection cap is lowered to fit the open-file limit.
FD_RESERVE = 128


@dataclass
class GuardLimits:
    head_timeout: float = 10.0  # seconds from a request head's first byte to its end
    max_connections: int = 1024
    max_per_client: int = 128


def fit_open_file_limit(max_connections: int) -> int:
    """Raises this process's soft open-file limit (up to the hard one) to hold `max_connections`
    connections plus FD_RESERVE; returns the connections it holds (max_connections, or fewer)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= want:
        return max_connections
    return max(1, soft - FD_RESERVE)


def client_key(host: str) -> str:
    """Whose a connection is: its IPv4 address, or its IPv6 address's /64 (one host's usual share)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def _error_body(message: str, type: str, code: str) -> bytes:
    """The API's error object (fim.ApiError.body) for answers given before any request reached the app."""
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()


class ConnectionGuard:
    """The server's open connections, in all and by client address, and what was done to them."""

    def __init__(self, limits: GuardLimits | None = None):
        self.limits = limits or GuardLimits()
        self.by_client: dict[str, dict[GuardedH11Protocol, None]] = {}  # insertion order: oldest first
        self.open = 0
        self.counters: Counter[str] = Counter()

    def protocol(self) -> type[GuardedH11Protocol]:
        """The protocol class to give uvicorn (Config(http=...)), bound to this guard."""
        return type("BoundGuardedH11Protocol", (GuardedH11Protocol,), {"guard": self})

    def stats(self) -> dict[str, Any]:
        """Open connections and what the guard did (for /health)."""
        out: dict[str, Any] = {"open": self.open, "clients": len(self.by_client)}
        for key in ("refused_client_cap", "refused_total_cap", "evicted", "head_timeouts", "idle_closed"):
            out[key] = self.counters[key]
        return out

    def admit(self, conn: GuardedH11Protocol) -> str | None:
        """Counts a new connection in; returns why it is refused instead (None: admitted)."""
        mine = self.by_client.get(conn.client_key)
        if mine is not None and len(mine) >= self.limits.max_per_client:
            self.counters["refused_client_cap"] += 1
            return f"{self.limits.max_per_client} connections from this address are open; close one or retry"
        if self.open >= self.limits.max_connections and not self._evict_one():
            self.counters["refused_total_cap"] += 1
            return f"{self.limits.max_connections} connections are open, each with a request in progress; retry"
        self.by_client.setdefault(conn.client_key, {})[conn] = None
        self.open += 1
        return None

    def release(self, conn: GuardedH11Protocol) -> None:
        mine = self.by_client.get(conn.client_key)
        if mine is not None and conn in mine:
            del mine[conn]
            self.open -= 1
            if not mine:
                del self.by_client[conn.client_key]

    def _evict_one(self) -> bool:
        """Closes the oldest idle connection of the address holding the most; False if none is idle."""
        for key in sorted(self.by_client, key=lambda k: len(self.by_client[k]), reverse=True):
            for conn in self.by_client[key]:
                if conn.idle():
                    self.counters["evicted"] += 1
                    conn.close_for_room()  # released here: the room is needed now, not at connection_lost
                    return True
        return False


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a ConnectionGuard's rules."""

    guard: ClassVar[ConnectionGuard]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_timer: asyncio.TimerHandle | None = None
        self.client_key = client_key(self.client[0]) if self.client else "?"
        refused = self.guard.admit(self)
        if refused is not None:
            log.warning("connection from %s refused: %s", self.client_key, refused)
            self._answer_and_close(503, refused, "server_error", "too_many_connections", retry_after=True)
            return
        # the same timer uvicorn arms after each response, armed before the first request as well
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self.guard.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # A new request's first bytes start its head's clock; a complete head (or a bad one) stops it.
        if self.head_timer is None and self.conn.their_state is h11.IDLE:
            self.head_timer = self.loop.call_later(self.guard.limits.head_timeout, self._head_timeout)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self.guard.counters["idle_closed"] += 1
        super().timeout_keep_alive_handler()

    def idle(self) -> bool:
        """No request in progress: before the first, between two, or a head still arriving."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def close_for_room(self) -> None:
        self.guard.release(self)
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        self.transport.close()

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timeout(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.guard.counters["head_timeouts"] += 1
        limit = self.guard.limits.head_timeout
        message = f"the request head did not arrive within {limit:g} s"
        self._answer_and_close(408, message, "invalid_request_error", "request_timeout")

    def _answer_and_close(self, status: int, message: str, type: str, code: str, retry_after: bool = False) -> None:
        """An error answer outside any request cycle (none reached the app), then the connection closed."""
        body = _error_body(message, type, code)
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        headers += [(b"retry-after", b"1")] if retry_after else []
        headers.append((b"content-length", str(len(body)).encode()))
        try:
            reason = http.HTTPStatus(status).phrase.encode()
            out = self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
            out = (out or b"") + (self.conn.send(h11.Data(data=body)) or b"")
            out += self.conn.send(h11.EndOfMessage()) or b""
            self.transport.write(out)
        except h11.LocalProtocolError:  # a state h11 cannot answer from: closing says enough
            pass
        self._unset_keepalive_if_required()
        self.transport.close()
