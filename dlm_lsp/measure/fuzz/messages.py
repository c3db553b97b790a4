"""Sending messages and checking their answers: every message is traced (for a failure's repro),
counted per input class, and every request is awaited and checked by `settle`."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from dlm_lsp.measure.fuzz.checks import _brief
from dlm_lsp.measure.fuzz.client import PING, FuzzClient, _doc_text
from dlm_lsp.measure.fuzz.state import FuzzerState, Pending, RefDoc
from dlm_lsp.measure.replay import LspError

if TYPE_CHECKING:
    from dlm_lsp.measure.fuzz.checks import Check


class MessagesMixin(FuzzerState):
    """Fuzzer's bookkeeping: failures, traces, message ids, sending, settling answers, stall time."""

    def fail(
        self,
        check: str,
        detail: str,
        trace: list[Any] | None = None,
        doc: RefDoc | None = None,
        n_full: int | None = None,
    ) -> None:
        """Counts a failure; the first few keep their messages (for a document: since its didOpen)."""
        self.failed[check] += 1
        if self.cls in self.counts:
            self.counts[self.cls]["failures"] += 1
        if sum(1 for f in self.failures if f["check"] == check) < self.keep:
            msgs = list(trace if trace is not None else doc.trace if doc is not None else self.trace)
            if doc is not None and doc.left_out and msgs and trace is None:
                msgs[1:1] = [{"left_out": f"{doc.left_out} messages"}]
            f: dict[str, Any] = {
                "check": check,
                "class": self.cls,
                "step": self.step,
                "detail": detail,
                "messages": msgs,
            }
            if doc is not None and doc.full is not None:
                f["_full"] = doc.full[: n_full if n_full is not None else len(doc.full)]
            self.failures.append(f)

    def _count(self, request: bool = False) -> None:
        if self.cls in self.counts:
            self.counts[self.cls]["messages"] += 1
            self.counts[self.cls]["requests"] += int(request)

    def _traced(self, entry: Any, doc: RefDoc | None, msg: dict[str, Any] | None = None) -> None:
        self.trace.append(entry)
        if doc is None:
            return
        doc.trace.append(entry)
        if len(doc.trace) > 400:
            del doc.trace[1]  # keep the didOpen
            doc.left_out += 1
        if doc.full is not None:
            doc.full.append(msg)
            if len(doc.full) > 3000 or len(str(_doc_text(msg))) > 1_000_000:
                doc.full = None  # not worth shrinking

    def deal(self, deck: str, cards: list[Any]) -> Any:
        """The next of `cards` from a shuffled deck: every card comes once before any comes again."""
        left = self.decks.get(deck)
        if not left:
            left = self.decks[deck] = self.rng.sample(cards, len(cards))
        return left.pop()

    def next_id(self) -> int:
        self.ids += 1
        return self.ids

    def notify(self, method: str, params: Any, doc: RefDoc | None = None) -> None:
        msg = {"jsonrpc": "2.0", "method": method, "params": params}
        self._traced(_brief(msg), doc, msg)
        self._count()
        self.wire._write(msg)

    def request(
        self, method: str, params: Any, check: Check | None = None, doc: RefDoc | None = None, msg_id: Any = None
    ) -> Pending:
        """Sends a request; its answer is awaited and checked by `settle`."""
        msg_id = self.next_id() if msg_id is None else msg_id
        msg = {"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}
        self._traced(_brief(msg), doc, msg)
        self._count(True)
        fut = self.wire.expect(msg_id)
        self.wire._write(msg)
        p = Pending(
            msg_id,
            fut,
            time.monotonic(),
            self.cls,
            check,
            list(doc.trace if doc else self.trace),
            method,
            doc,
            len(doc.full) if doc is not None and doc.full is not None else None,
        )
        self.outstanding.append(p)
        return p

    def raw(self, data: bytes, note: str) -> None:
        self._traced({"raw": _brief(data), "note": note}, None)
        self._count()
        self.wire.send_bytes(data)

    def ping(self, check: Check | None = None) -> Pending:
        return self.request(PING, {})

    async def settle(self, *only: Pending) -> None:
        """Waits for the answers to the requests sent so far (or `only` these) and checks them."""
        todo = list(only) if only else list(self.outstanding)
        await self.wire.drain()
        late = False
        for p in todo:
            # the time this process itself was too busy to read answers does not count against the server
            left = p.sent + (p.limit or self.timeout) + self.stalled_since(p.sent) - time.monotonic()
            try:
                result, err = await asyncio.wait_for(asyncio.shield(p.fut), max(0.0, left)), None
            except TimeoutError:
                self.wire.pending.pop(p.msg_id, None)
                if self.alive():
                    self.fail(
                        "unanswered", f"{p.method} id {p.msg_id!r} not answered within {self.timeout:g} s", p.trace
                    )
                    late = True
                continue
            except LspError as e:
                result, err = None, e
            except ConnectionError:
                continue  # the exit check reports it
            finally:
                if p in self.outstanding:
                    self.outstanding.remove(p)
            self.answered += 1
            if err is not None:
                self.error_codes[err.code] += 1
            if p.check is not None:
                got = p.check(result, err)
                if got:
                    self.fail(got[0], got[1], p.trace, p.doc, p.n_full)
        if late and self.alive():
            # is the stream wedged (a frame that never ends), or was one answer slow?
            probe = self.request(PING, {})
            try:
                await asyncio.wait_for(asyncio.shield(probe.fut), self.timeout)
            except (TimeoutError, LspError, ConnectionError):
                pass
            if probe in self.outstanding:
                self.outstanding.remove(probe)
            if not probe.fut.done():
                self.fail("unanswered", "the server stopped answering (restarted)")
                await self.relaunch()

    async def _watch_stalls(self) -> None:
        """Records the stretches when this event loop was blocked (building 10 MB reference texts...)."""
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            if now - self.last_tick > 0.1:
                self.stalls.append((self.last_tick, now))
                del self.stalls[:-10000]
            self.last_tick = now

    def stalled_since(self, t: float) -> float:
        """Seconds this process was stalled since monotonic time `t` (the current stall included)."""
        now = time.monotonic()
        current = [(self.last_tick, now)] if now - self.last_tick > 0.1 else []
        return sum(b - max(a, t) for a, b in self.stalls + current if b > t)

    def alive(self) -> bool:
        return self.client is not None and self.client.process.returncode is None and not self.client.gone

    @property
    def wire(self) -> FuzzClient:
        """The client of the server process (`launch` has made one)."""
        if self.client is None:
            raise RuntimeError("the fuzzer's server is not launched")
        return self.client
