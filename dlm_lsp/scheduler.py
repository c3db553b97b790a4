"""Who gets the engine: latest-wins per document, cancellation, deadlines, typing-through.

- A new request for a document supersedes that document's older request even when the editor
  sends no `$/cancelRequest` (Neovim 0.12 sends none): the older one answers empty at once and its
  engine job is cancelled (the engine stops it within one step).
- `$/cancelRequest` answers the request at once (RequestCancelled); its work, engine job included,
  is stopped a grace moment later (`Scheduler.cancel_unless_spared`) unless a change or a newer
  request typed along it meanwhile - VS Code cancels the previous request at every keystroke, and a
  spared job serves the next request by typing-through as it does without a client cancel.
- The deadline of a job is the request's arrival + budget. The handler waits for the engine at
  most until the deadline + LATE_GRACE_S: the engine checks the deadline only between steps, so
  one slow step (a loaded CPU) or a step that never ends would otherwise hold the request. Past
  that the request answers empty (`Late`, counted in `late`), the job is cancelled and whatever
  it returns later is dropped.
- Typing-through: when the user types characters that continue the fill last shown for a document,
  the rest of that fill is returned without an engine call.
- Typing along a job in flight: when the only change since a running job started is text typed at
  its cursor (a few characters, no line break), the job is spared - neither didChange nor the next
  request cancels it. Its own request still answers empty (its version is gone), but its fill is
  kept for typing-through, and the newer request waits for it (within its own deadline) instead of
  starting a job of its own. At 10 keystrokes/s and fills of 100-300 ms this is what lets a fill be
  shown at all.
Engine step counts are booked per job, so the share of steps spent on jobs later cancelled (or
discarded as stale) can be reported.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from engine.api import Fill, FillJob

T = TypeVar("T")

log = logging.getLogger("dlm.scheduler")

JOB_ROWS_KEPT = 4096  # (forwarded, reused) rows of the latest jobs that dlm/stats reports

# How long past its deadline a request waits for the engine: a job finishing its last step right at
# the deadline still makes it; a step that runs on far past it does not hold the request.
LATE_GRACE_S = 0.1


class Superseded(Exception):
    """A newer request for the same document took over."""


class Late(Exception):
    """The engine had no result by the request's deadline + LATE_GRACE_S."""


@dataclass
class Stats:
    """Counters reported by `dlm/stats` (and by replay)."""

    requests: int = 0
    answered: int = 0  # requests answered with a non-empty fill
    empty: int = 0  # answered with nothing (filtered, not ready, no fill)
    cancelled: int = 0  # superseded by a newer request or cancelled by the client
    stale: int = 0  # the document changed while the job ran: result discarded
    typed_through: int = 0  # served from the fill already shown, no engine call
    typed_along: int = 0  # fills finished after the user typed along them, kept for typing-through
    errors: int = 0  # engine errors or exceptions answered with an empty result
    late: int = 0  # answered empty at deadline + grace because the engine had no result (counted in empty too)
    engine_jobs: int = 0
    engine_steps: int = 0
    wasted_steps: int = 0  # steps of jobs that were cancelled or discarded as stale
    # rows the engine ran through the model (Fill.forwarded_tokens) and context rows it reused from the
    # document's last request (Fill.reused_tokens), summed over jobs that ran; per job in `job_rows`
    forwarded_tokens: int = 0
    reused_tokens: int = 0
    reuse_jobs: int = 0  # jobs that reused some context rows
    job_rows: deque = field(default_factory=lambda: deque(maxlen=JOB_ROWS_KEPT), repr=False)
    last_latency_ms: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_json(self) -> dict:
        with self._lock:
            steps = self.engine_steps
            return {
                "requests": self.requests,
                "answered": self.answered,
                "empty": self.empty,
                "cancelled": self.cancelled,
                "stale": self.stale,
                "typedThrough": self.typed_through,
                "typedAlong": self.typed_along,
                "errors": self.errors,
                "late": self.late,
                "engineJobs": self.engine_jobs,
                "engineSteps": steps,
                "wastedSteps": self.wasted_steps,
                "engineForwardedTokens": self.forwarded_tokens,
                "engineReusedTokens": self.reused_tokens,
                "engineReuseJobs": self.reuse_jobs,
                "engineJobRows": [list(r) for r in self.job_rows],
                "wastedStepShare": (self.wasted_steps / steps) if steps else 0.0,
                "lastLatencyMs": self.last_latency_ms,
            }


class Ticket:
    """One inline-completion request on its way through the scheduler."""

    def __init__(
        self,
        uri: str,
        version: int,
        arrival: float,
        budget_ms: int,
        loop: asyncio.AbstractEventLoop,
        offset: int = 0,
        text: str = "",
    ):
        self.uri, self.version, self.arrival = uri, version, arrival
        self.deadline = arrival + budget_ms / 1000.0
        self.superseded: asyncio.Future = loop.create_future()
        self.finished = asyncio.Event()  # set when its handler is done (its fill kept, or not)
        self.offset, self.text = offset, text  # cursor and document text when the request arrived
        self.job: FillJob | None = None
        self.wasted = False
        self.steps: int | None = None  # engine steps of its job, once the job has finished
        self.client_cancelled = False  # the client sent $/cancelRequest for it (answered already)
        self.spared = False  # a later change or request typed along it (see Scheduler.cancel_document)

    def typed_along(self, text: str, cursor: int | None = None, most: int = 48) -> bool:
        """True when `text` (cursor at `cursor`, or wherever the length change puts it) differs from
        this request's text only by up to `most` characters typed at its cursor, on one line."""
        if cursor is None:
            cursor = self.offset + len(text) - len(self.text)
        if not self.offset <= cursor <= self.offset + most:
            return False
        if len(text) - cursor != len(self.text) - self.offset:
            return False
        if "\n" in text[self.offset : cursor]:
            return False
        c = 256
        return (
            text[max(0, self.offset - c) : self.offset] == self.text[max(0, self.offset - c) : self.offset]
            and text[cursor : cursor + c] == self.text[self.offset : self.offset + c]
        )

    async def race(self, aw: Awaitable[T]) -> T:
        """Awaits `aw` unless a newer request supersedes this one first (then raises Superseded)."""
        task = asyncio.ensure_future(aw)
        try:
            await asyncio.wait({task, self.superseded}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if self.superseded.done():
            task.cancel()
            raise Superseded()
        return task.result()


class Scheduler:
    """Latest-wins job runner over an engine `submit(job) -> concurrent Future[Fill]`."""

    def __init__(self, submit: Callable[[FillJob], Future[Fill]], stats: Stats | None = None):
        self.submit = submit
        self.stats = stats or Stats()
        self._latest: dict[str, Ticket] = {}
        self._inflight: dict[str, Ticket] = {}  # the ticket whose engine job is running, per document

    def begin(
        self,
        uri: str,
        version: int,
        budget_ms: int,
        arrival: float | None = None,
        offset: int = 0,
        text: str = "",
        spare: Ticket | None = None,
    ) -> Ticket:
        """Registers a request; supersedes the document's previous one and cancels its job (a
        `spare`d ticket keeps running: the user is typing along it)."""
        loop = asyncio.get_running_loop()
        ticket = Ticket(
            uri, version, arrival if arrival is not None else time.monotonic(), budget_ms, loop, offset, text
        )
        self.cancel_document(uri, spare)
        self._latest[uri] = ticket
        with self.stats._lock:
            self.stats.requests += 1
        return ticket

    def inflight(self, uri: str) -> Ticket | None:
        """The document's ticket whose engine job is still running, if any."""
        return self._inflight.get(uri)

    def end(self, ticket: Ticket) -> None:
        if self._latest.get(ticket.uri) is ticket:
            del self._latest[ticket.uri]
        if self._inflight.get(ticket.uri) is ticket:
            del self._inflight[ticket.uri]
        ticket.finished.set()

    def cancel(self, ticket: Ticket, supersede: bool = False) -> None:
        """Cancels a request's engine job (and wakes its handler when superseded)."""
        if supersede and not ticket.superseded.done():
            ticket.superseded.set_result(True)
        if ticket.job is not None:
            ticket.job.cancel()
        self.mark_wasted(ticket)

    def cancel_document(self, uri: str, spare: Ticket | None = None) -> None:
        """Supersedes what runs for a document (a new request, didChange, didClose), except `spare`."""
        if spare is not None:
            spare.spared = True
        for t in (self._latest.pop(uri, None), self._inflight.get(uri)):
            if t is not None and t is not spare:
                self.cancel(t, supersede=True)

    def cancel_unless_spared(self, ticket: Ticket) -> None:
        """The end of a client-cancelled request's grace: its work stops unless something typed
        along it since the cancel."""
        if not ticket.spared and not ticket.finished.is_set():
            self.cancel(ticket, supersede=True)

    async def wait_for(self, ticket: Ticket, other: Ticket) -> None:
        """Waits until `other`'s handler is done or `ticket`'s deadline passes (raises Superseded)."""
        left = ticket.deadline - time.monotonic()
        if left > 0:
            try:
                await ticket.race(asyncio.wait_for(other.finished.wait(), left))
            except TimeoutError:
                pass

    def mark_wasted(self, ticket: Ticket) -> None:
        """Books the ticket's engine steps as wasted (now, or when its job finishes)."""
        if ticket.job is None:
            return
        with self.stats._lock:
            if not ticket.wasted and ticket.steps is not None:
                self.stats.wasted_steps += ticket.steps
            ticket.wasted = True

    async def debounce(self, ticket: Ticket, ms: int) -> None:
        """Waits `ms` unless superseded first (raises Superseded)."""
        if ms > 0:
            await ticket.race(asyncio.sleep(ms / 1000.0))

    async def run(self, ticket: Ticket, job: FillJob, grace_s: float = LATE_GRACE_S) -> Fill:
        """Submits `job` and returns its Fill; raises Superseded, CancelledError, EngineError, or
        Late when it has no result by the deadline + `grace_s` (the job is cancelled then)."""
        ticket.job = job
        if ticket.superseded.done():
            job.cancel()
            raise Superseded()
        fut: Future[Fill] = self.submit(job)
        self._inflight[ticket.uri] = ticket
        fut.add_done_callback(lambda f: self._booked(ticket, f))
        afut = asyncio.wrap_future(fut)
        afut.add_done_callback(_retrieve)  # nobody awaits it after a supersede: silence its error
        limit = max(0.0, ticket.deadline + grace_s - time.monotonic())
        try:
            return await ticket.race(asyncio.wait_for(asyncio.shield(afut), limit))
        except (Superseded, asyncio.CancelledError):
            job.cancel()
            self.mark_wasted(ticket)
            raise
        except TimeoutError:
            job.cancel()
            self.mark_wasted(ticket)
            with self.stats._lock:
                self.stats.late += 1
            over = (time.monotonic() - ticket.deadline) * 1000
            log.warning(
                "engine job %s had no result %.0f ms past its deadline: answered empty, job cancelled",
                getattr(job, "job_id", "?"),
                over,
            )
            raise Late() from None

    def _booked(self, ticket: Ticket, fut: Future[Fill]) -> None:
        """Engine thread: books the finished job's steps."""
        if fut.cancelled() or fut.exception() is not None:
            return
        fill = fut.result()
        steps = fill.steps
        with self.stats._lock:
            self.stats.engine_jobs += 1
            self.stats.engine_steps += steps
            if steps:  # it ran: book its rows (an expired job, or one cancelled before its first step, ran none)
                # (a next edit's Rewrite reports no rows)
                fwd, reused = getattr(fill, "forwarded_tokens", 0), getattr(fill, "reused_tokens", 0)
                self.stats.forwarded_tokens += fwd
                self.stats.reused_tokens += reused
                self.stats.reuse_jobs += reused > 0
                self.stats.job_rows.append((fwd, reused))
            ticket.steps = steps
            if ticket.wasted:
                self.stats.wasted_steps += steps


def _retrieve(f: asyncio.Future[Any]) -> None:
    if not f.cancelled():
        f.exception()


# ----------------------------------------------------------------------------- typing-through


@dataclass
class Shown:
    """The fill last shown in a document: inserted at str offset `offset`."""

    offset: int
    text: str
    replace_len: int
    before: str  # up to 256 chars of the document before `offset` at show time
    after: str  # up to 256 chars of the document after `offset` at show time


class TypingThrough:
    """Remembers the last fill shown per document and serves its rest while the user types it."""

    CONTEXT = 256

    def __init__(self) -> None:
        self._shown: dict[str, Shown] = {}

    def remember(self, uri: str, text: str, offset: int, fill: str, replace_len: int) -> None:
        if not fill:
            self._shown.pop(uri, None)
            return
        c = self.CONTEXT
        self._shown[uri] = Shown(
            offset, fill, replace_len, text[max(0, offset - c) : offset], text[offset : offset + c]
        )

    def forget(self, uri: str) -> None:
        self._shown.pop(uri, None)

    def clear(self) -> None:
        self._shown.clear()

    def rest(self, uri: str, text: str, cursor: int) -> tuple[str, int] | None:
        """(rest of the fill, replace_len) when the text typed since the fill was shown is a proper
        prefix of it (possibly empty: the same cursor asks again) and nothing else changed; else None."""
        s = self._shown.get(uri)
        if s is None or cursor < s.offset:
            return None
        typed = text[s.offset : cursor]
        if not s.text.startswith(typed) or len(typed) >= len(s.text):
            return None
        if text[max(0, s.offset - len(s.before)) : s.offset] != s.before:
            return None
        if text[cursor : cursor + len(s.after)] != s.after:
            return None
        return s.text[len(typed) :], s.replace_len
