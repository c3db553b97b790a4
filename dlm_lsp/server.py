"""The language server: one pygls LanguageServer, thin async handlers, the engine off the loop.

Flow of one inlineCompletion request (see docs/ARCHITECTURE.md):
  typing-through? -> debounce -> engine ready? -> context.build_request -> scheduler.run (engine
  thread) -> version still the same? -> postprocess.finish -> InlineCompletionItem

Extensions (documented for editors in docs/lsp-extensions.md):
  notification  dlm/status  {"state", "model", "device", "lastLatencyMs", "message"}
                sent on every engine state change and after each fill
  request       dlm/stats   -> {"requests", "answered", "empty", "cancelled", "stale", "typedThrough",
                "typedAlong", "errors", "engineJobs", "engineSteps", "wastedSteps", "wastedStepShare",
                "lastLatencyMs", "state", "model", "device"}; counters since the server started,
                wastedSteps = engine steps of jobs that were cancelled or whose result was stale,
                typedAlong = stale fills kept for typing-through because the user typed along them;
                also "engineForwardedTokens", "engineReusedTokens", "engineReuseJobs" and
                "engineJobRows" ([forwarded, reused] per job that ran, the latest 4096): rows the
                engine ran through the model and context rows it reused from the document's last request
  request       dlm/documentText {"textDocument": {"uri"}} -> {"uri", "version", "text"} or null: the
                server's copy of a document, for fuzzers comparing it with the client's

Documents: the server keeps one copy of each (dlm_lsp/fill/documents.py) and pygls's workspace
keeps none. pygls's built-in didOpen/didChange/didClose handlers are removed, not just shadowed:
they ran before ours, kept a second copy of every document, and while updating it clamped the
params' positions in place against str.splitlines() lines (which also break at \\f, \\x85,
\\u2028...), so our handlers would then have applied edits at moved positions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote

from lsprotocol import types
from pygls.lsp.server import LanguageServer

from dlm_lsp.engines import EarlyEngine, default_engine_factory, engine_args, machine_key, release_logs, take_early
from dlm_lsp.fill import context, edit_gate, gate, postprocess, suggest
from dlm_lsp.fill.documents import Document, DocumentStore, uri_key
from dlm_lsp.fill.history import EditHistory
from dlm_lsp.fill.positions import UTF16, units_len
from dlm_lsp.fill.retrieval import SNIPPET_CHARS
from dlm_lsp.fill.workspace import FilesSink, WorkspaceIndex, root_paths
from dlm_lsp.options import InitializationOptions, dlm_section, parse_options
from dlm_lsp.protocol import DlmProtocol, content_changes, read_order, require_sync_types, run_stdio
from dlm_lsp.scheduler import Late, Scheduler, Stats, Superseded, Ticket, TypingThrough
from engine.api import reported_context_tokens

if TYPE_CHECKING:
    from tree_sitter import Tree

    from dlm_lsp.fill.context import FillRequest
    from dlm_lsp.fill.postprocess import Finished
    from engine.api import Fill, FillJob

WORKSPACE_SPACE = "workspace"  # the name of this window's workspace memory in its engine (FillJob.workspace)

log = logging.getLogger("dlm.server")

VERSION = "0.1.0"
STATUS = "dlm/status"
STATS = "dlm/stats"
DOCUMENT_TEXT = "dlm/documentText"
NEXT_EDIT = "dlm/nextEdit"
# a next edit's deadline is this many fill budgets after its request: the client asks after an idle
# pause, not per keystroke, and a window rewrite runs more slots than a line fill
NEXT_EDIT_BUDGETS = 2
HISTORY_MAX_CHARS = 500_000  # a document longer than this keeps no edit history (its diffs cost a keystroke too much)
# After a client's $/cancelRequest the request answers RequestCancelled at once, but its engine job
# gets this long before the cancel reaches the engine: VS Code cancels the previous request at every
# keystroke, and when the next request types along the job (the same rule as without a client
# cancel) the job is spared and its fill serves that request by typing-through.
CANCEL_GRACE_S = 0.05
PROGRESS_TOKEN = "dlm-lsp/loading"  # + "/<engine generation>": a token is never reused after its end

OnState = Callable[[str, dict], object]  # an engine's state changes (engine thread): (state, info)
Result = tuple[str, types.Range]  # a fill's text and the range it replaces


class Engine(Protocol):
    """What the server fills with: EngineService, RemoteEngine or HttpEngine (default_engine_factory),
    or a test's scripted engine. One with `workspace_files` gets the workspace's files."""

    def start(self) -> object: ...

    def close(self) -> None: ...

    def submit(self, job: FillJob) -> Future[Fill]: ...


# (model, device, on_state, threads=..., engine=...) -> the engine; the keywords only when set
EngineFactory = Callable[..., Engine]


MAX_OPEN_SNIPPET_DOCS = 16  # the most recently edited open documents searched with the workspace's files


class DlmServer(LanguageServer):
    """Documents, options, scheduler and the engine handle of one editor session."""

    def __init__(self, engine_factory: EngineFactory | None = None):
        super().__init__(
            "dlm-lsp", VERSION, text_document_sync_kind=types.TextDocumentSyncKind.Incremental, protocol_cls=DlmProtocol
        )
        self.options = InitializationOptions()
        self.option_warnings: list[str] = []
        self.documents = DocumentStore()
        self.stats = Stats()
        self.scheduler = Scheduler(self._submit, self.stats)
        self.typing = TypingThrough()
        # per document key: the read order (protocol.read_order) of its latest didOpen/didChange, so a
        # request read before it (its position is in a text that is gone) is answered as stale
        self.changed_at: dict[str, int] = {}
        # next edits: each document's recent edits (from didChange), and their own latest-wins queue and
        # counters, apart from fills' so that neither supersedes the other and dlm/stats keeps them apart
        self.history = EditHistory()
        self.experimental_capabilities = {"dlm": {"nextEdit": True}}  # under `experimental` at initialize
        self.edit_stats = Stats()
        self.edit_scheduler = Scheduler(self._submit, self.edit_stats)
        self.engine_factory: EngineFactory = engine_factory or default_engine_factory
        self.engine: Engine | None = None
        self.engine_gen = 0
        self.engine_state = "idle"
        self.engine_info: dict[str, Any] = {"model": "default", "device": "auto", "message": None}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._progress_open: str | None = None  # token of the progress that has begun and not ended
        self.workspace_index: WorkspaceIndex | None = None  # the workspace's files as cross-file context
        self.workspace_roots: list[Path] = []
        self.workspace_folders: list[str] = []  # folder URIs: initialize's, then as the client changes them
        self.early: EarlyEngine | None = None  # the engine started with the process (dlm_lsp.engines)
        self._adopting: EarlyEngine | None = None  # the early engine start_engine waits for

    # ------------------------------------------------------------------ engine

    def _submit(self, job: Any) -> Future[Any]:
        """The engine's future for a FillJob (a Fill) or an EditJob (a Rewrite)."""
        assert self.engine is not None  # the scheduler runs jobs only once _wait_ready saw an engine
        return self.engine.submit(job)

    def cross_file(self, uri: str, doc: Document, offset: int) -> str:
        """The fill's cross-file far text: the snippets of the workspace's other files most like the
        code at the cursor (dlm_lsp.fill.workspace) once its files are indexed, else the starts of the
        most recently edited other open documents (context.neighbour_text)."""
        if self.workspace_index is not None and self.options.workspace_context:
            try:
                others = [d for d in self.documents.neighbours(uri, doc.language_id, n=MAX_OPEN_SNIPPET_DOCS)]
                got = self.workspace_index.cross_file(uri, doc.text, offset, doc.language_id, others, SNIPPET_CHARS)
                if got is not None:
                    return got
            except Exception:  # the index is a quality lever: a failure costs it, not the fill
                log.exception("workspace snippets failed; using the open documents")
        return context.neighbour_text([d.text for d in self.documents.neighbours(uri, doc.language_id)])

    def start_workspace(self) -> None:
        """Makes the workspace index follow the option and the folders: started when the option is on
        and there are folders, re-rooted when the folders changed, stopped when the option is off."""
        if not (self.options.workspace_context and self.workspace_roots):
            if self.workspace_index is not None:
                self.workspace_index.close()
                self.workspace_index = None
        elif self.workspace_index is None:
            self.workspace_index = WorkspaceIndex(self.workspace_roots, lambda lang: self.options.serves(lang))
            self.workspace_index.on_files = self._workspace_sink()
            self.workspace_index.start()
        else:
            self.workspace_index.set_roots(self.workspace_roots)

    def change_workspace_folders(
        self, added: Sequence[types.WorkspaceFolder] | None, removed: Sequence[types.WorkspaceFolder] | None
    ) -> None:
        """workspace/didChangeWorkspaceFolders: the folders' URIs updated, the index re-rooted."""

        def key(uri: object) -> str | None:  # clients differ in escaping and trailing slashes
            return unquote(uri).rstrip("/") if isinstance(uri, str) else None

        gone = {key(getattr(f, "uri", None)) for f in removed or []}
        folders = [u for u in self.workspace_folders if key(u) not in gone]
        for uri in (getattr(f, "uri", None) for f in added or []):
            if isinstance(uri, str) and key(uri) not in {key(u) for u in folders}:  # key(uri): not None
                folders.append(uri)
        self.workspace_folders = folders
        self.workspace_roots = root_paths(None, [types.WorkspaceFolder(uri=u, name="") for u in folders])
        if self.loop is not None:
            self.start_workspace()

    def _workspace_sink(self) -> FilesSink | None:
        """fn(changes) giving the workspace's files to the current engine's workspace memory
        (EngineService / RemoteEngine .workspace_files, DecodeOptions.workspace_ngram), or None
        when the engine keeps none (an HTTP endpoint). Runs on the index's thread."""
        engine = self.engine
        if engine is None or not hasattr(engine, "workspace_files"):
            return None

        def feed(changes: dict[str, str | None]) -> None:
            engine.workspace_files(WORKSPACE_SPACE, changes)  # in-process: counted here; shared: sent

        return feed

    def start_engine(self) -> None:
        """(Re)starts the engine with the current model/device options; loading runs off the loop."""
        loop = self.loop
        assert loop is not None, "the engine starts once initialized has set the loop"
        old, self.engine = self.engine, None
        if old is not None:
            loop.run_in_executor(None, old.close)
        self.typing.clear()  # fills of another model
        self.engine_gen += 1
        gen = self.engine_gen
        self._ready = asyncio.Event()
        self.engine_state = "loading"
        self.engine_info = {"model": self.options.model or "default", "device": self.options.device, "message": None}

        def on_state(state: str, info: dict | None, gen: int = gen) -> None:  # engine thread
            loop.call_soon_threadsafe(self._engine_state_changed, gen, state, dict(info or {}))

        early, self.early = self.early, None
        if early is not None and early.key == machine_key(self.options):
            self._adopt(early, gen, on_state)
        else:
            if early is not None:  # the options picked another engine than the hint did
                log.info("the engine started early is not the one the options pick; starting that")
                loop.run_in_executor(None, early.close)
            self._make_engine(gen, on_state)
        self._begin_progress()

    def _make_engine(self, gen: int, on_state: OnState) -> None:
        try:
            model, device, extra = engine_args(self.options)
            self.engine = engine = self.engine_factory(model, device, on_state, **extra)
            engine.start()
            self._engine_made()
        except Exception as e:  # noqa: BLE001 - a bad engine setup must not take the server down
            log.exception("engine failed to start")
            self._engine_state_changed(gen, "error", {"message": f"engine failed to start: {e}"})

    def _engine_made(self) -> None:
        if self.workspace_index is not None:  # a new engine has no workspace memory: the next walk sends it all
            self.workspace_index.set_sink(self._workspace_sink())

    def _adopt(self, early: EarlyEngine, gen: int, on_state: OnState) -> None:
        """Takes the engine started with the process (dlm_lsp.engines) once it exists, off the loop;
        requests meanwhile wait for it as for a loading one. One that failed to start is made again
        here, which reports why."""
        assert self.loop is not None
        self._adopting = early

        def adopt(_: object) -> None:  # on the loop
            self._adopting = None
            if gen != self.engine_gen:  # replaced or shut down meanwhile
                early.close()
                return
            engine, last = early.attach(on_state)
            if engine is None:
                self._make_engine(gen, on_state)
                return
            self.engine = engine
            self._engine_made()
            log.info("adopted the engine started with the process")
            if last is not None:
                self._engine_state_changed(gen, *last)

        self.loop.run_in_executor(None, early.made.wait).add_done_callback(adopt)

    def _engine_state_changed(self, gen: int, state: str, info: dict) -> None:
        if gen != self.engine_gen:
            return  # a callback from an engine that was replaced
        self.engine_state = state
        self.engine_info.update({k: v for k, v in info.items() if v is not None or k == "message"})
        log.info(
            "engine %s (%s on %s, %s torch threads)%s",
            state,
            self.engine_info.get("model"),
            self.engine_info.get("device"),
            self.engine_info.get("threads", "?"),
            f": {info.get('message')}" if info.get("message") else "",
        )
        if state in ("ready", "error"):
            assert self._ready is not None  # start_engine made it before this generation's engine
            self._ready.set()
            self._end_progress(state)
        if state == "error":
            self.window_show_message(
                types.ShowMessageParams(
                    type=types.MessageType.Error,
                    message=f"dlm-lsp: {info.get('message') or 'the model failed to load'}. "
                    "Check the `model` and `device` options (or run `dlm-lsp complete` to see the error).",
                )
            )
        self.send_status()

    def send_status(self) -> None:
        """Sends the dlm/status notification."""
        self.protocol.notify(
            STATUS,
            {
                "state": self.engine_state,
                "model": str(self.engine_info.get("model") or "default"),
                "device": str(self.engine_info.get("device") or self.options.device),
                "lastLatencyMs": self.stats.last_latency_ms,
                "message": self.engine_info.get("message"),
            },
        )

    def _supports_progress(self) -> bool:
        caps = getattr(self.protocol, "client_capabilities", None)
        return bool(caps and caps.window and caps.window.work_done_progress)

    def _begin_progress(self) -> None:
        if not self._supports_progress() or self.engine_state != "loading":
            return
        token = f"{PROGRESS_TOKEN}/{self.engine_gen}"

        async def begin() -> None:
            try:
                await asyncio.wait_for(self.work_done_progress.create_async(token), 5)
                if self.engine_state != "loading" or token != f"{PROGRESS_TOKEN}/{self.engine_gen}":
                    return
                self.work_done_progress.begin(
                    token,
                    types.WorkDoneProgressBegin(
                        title="dlm-lsp", message=f"loading model {self.engine_info.get('model')}", cancellable=False
                    ),
                )
                self._progress_open = token
            except Exception as e:  # noqa: BLE001 - progress is cosmetic
                log.debug("work done progress unavailable: %s", e)

        assert self.loop is not None  # start_engine's caller: the loop is set
        self.loop.create_task(begin())

    def _end_progress(self, state: str) -> None:
        if self._progress_open:
            token, self._progress_open = self._progress_open, None
            self.work_done_progress.end(
                token, types.WorkDoneProgressEnd(message="model ready" if state == "ready" else "model failed to load")
            )

    async def _wait_ready(self, ticket: Ticket) -> bool:
        """True once the engine is ready; waits at most until the request's deadline."""
        if (self.engine is None and self._adopting is None) or self.engine_state == "error":
            return False
        if self.engine_state == "ready":
            return True
        left = ticket.deadline - time.monotonic()
        if left <= 0:
            return False
        assert self._ready is not None  # made by start_engine with the engine
        try:
            await ticket.race(asyncio.wait_for(self._ready.wait(), left))
        except TimeoutError:
            return False
        return self.engine_state == "ready"

    # ------------------------------------------------------------------ fills

    @property
    def encoding(self) -> str:
        try:
            return str(self.workspace.position_encoding or UTF16)
        except RuntimeError:
            return UTF16

    async def fill_at(self, uri: str, position: types.Position) -> Result | None:
        """Returns (text, range) of the fill at `position`, or None; never raises except
        CancelledError (the client's $/cancelRequest). A client cancel answers at once; the work
        behind it stops CANCEL_GRACE_S later unless a newer request typed along it by then."""
        holder: dict[str, Ticket] = {}
        task = asyncio.ensure_future(self._fill(uri, position, holder))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            ticket = holder.get("ticket")
            if ticket is None or task.done():
                task.cancel()
            else:
                ticket.client_cancelled = True
                ticket.spared = False
                asyncio.get_running_loop().call_later(CANCEL_GRACE_S, self.scheduler.cancel_unless_spared, ticket)
            raise

    async def _fill(self, uri: str, position: types.Position, holder: dict[str, Ticket]) -> Result | None:
        """One request from arrival to answer: the document open and served, a scheduler ticket (in
        `holder`, for fill_at's cancel), then _fill_steps; counts the outcome once, whatever ends it."""
        arrival = time.monotonic()
        doc = self.documents.get(uri)
        key = self.documents.key(uri)  # one job queue and typing-through memory for all spellings of a URI
        if doc is None:
            log.info("completion asked for a document that is not open: %s", uri)
            return None
        if not self.options.serves(doc.language_id):
            return None
        read = read_order()
        if read is not None and self.changed_at.get(key, 0) > read:
            # read before the document's latest change (a busy loop read a burst of keystrokes before
            # this task ran): its position is in a text that is gone, and treating it as a request for
            # the new text would supersede the job the user is typing along; a newer request follows
            with self.stats._lock:
                self.stats.requests += 1
                self.stats.stale += 1
            return None
        offset = doc.index(self.encoding).offset(position.line, position.character)
        ticket, spare = self._begin_ticket(key, doc, offset, arrival)
        holder["ticket"] = ticket
        outcome = "empty"
        try:
            outcome, result = await self._fill_steps(uri, position, doc, ticket, spare)
            return result
        except Late:  # the engine had nothing by the deadline + grace (counted in stats.late)
            return None
        except Superseded:
            outcome = "cancelled"
            return None
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as e:  # noqa: BLE001 - one failed request must not affect the others
            outcome = "errors"
            log.warning("fill failed for %s at %s: %s", uri, position, e, exc_info=not _is_engine_error(e))
            return None
        finally:
            self._count_outcome(ticket, outcome)

    async def _fill_steps(
        self, uri: str, position: types.Position, doc: Document, ticket: Ticket, spare: Ticket | None
    ) -> tuple[str, Result | None]:
        """(outcome, (text, range) or None): typing-through answer; else the engine's turn (debounce,
        engine ready); the request from the cursor; the engine with the ticket's deadline; stale
        results dropped; post-processing; stats; the editor's item."""
        key, offset = ticket.uri, ticket.offset  # as _fill gave them to the scheduler
        hit = await self._typed_through(key, doc, offset, ticket, spare)
        if hit is not None:
            self.stats.typed_through += 1
            return "answered", self._range_result(doc, offset, *hit)
        if not await self._engine_turn(ticket):
            return "empty", None
        if not self._is_current(uri, doc, ticket):
            return "stale", None
        req, job, tree, context_ms = self._build_job(uri, key, doc, offset, ticket)
        fill = await self.scheduler.run(ticket, job)
        standing = self._standing(uri, doc, ticket)
        if standing == "gone":
            return "stale", None
        fin = self._postprocess(req, fill, ticket, tree, doc, offset)
        stale = standing == "typed along"
        self._report_fill(uri, position, req, fill, fin, context_ms, ticket.arrival, stale)
        return self._deliver(key, doc, offset, ticket, fill, fin, stale)

    def _begin_ticket(self, key: str, doc: Document, offset: int, arrival: float) -> tuple[Ticket, Ticket | None]:
        """(ticket, spare): the request's scheduler ticket, and the document's job in flight that this
        cursor types along (spared, not cancelled, by the new ticket), or None."""
        inflight = self.scheduler.inflight(key)
        spare = inflight if inflight is not None and inflight.typed_along(doc.text, offset) else None
        ticket = self.scheduler.begin(key, doc.version, self.options.budget_ms, arrival, offset, doc.text, spare)
        return ticket, spare

    async def _typed_through(
        self, key: str, doc: Document, offset: int, ticket: Ticket, spare: Ticket | None
    ) -> tuple[str, int] | None:
        """The rest of a kept fill the user is typing through, (text, replace_len), or None."""
        hit = self.typing.rest(key, doc.text, offset)
        if hit is None and spare is not None:
            # the user is typing along a job in flight: its fill, once kept, may serve this cursor
            await self.scheduler.wait_for(ticket, spare)
            hit = self.typing.rest(key, doc.text, offset)
        return hit

    async def _engine_turn(self, ticket: Ticket) -> bool:
        """Waits out the debounce, then a loading engine; False when the engine cannot fill in time."""
        await self.scheduler.debounce(ticket, self.options.debounce_ms)
        return await self._wait_ready(ticket)

    def _is_current(self, uri: str, doc: Document, ticket: Ticket) -> bool:
        """True while the document is still at the version the ticket was made for."""
        return self.documents.get(uri) is doc and doc.version == ticket.version

    def _build_job(
        self, uri: str, key: str, doc: Document, offset: int, ticket: Ticket
    ) -> tuple[FillRequest, FillJob, Tree | None, float]:
        """(req, job, tree, context_ms): the FillRequest from the cursor (with cross-file far text),
        its FillJob under the ticket's deadline, the syntax tree as of now, the time it took."""
        t0 = time.perf_counter()
        near = self.cross_file(uri, doc, offset)
        budget = self.context_tokens()
        req = context.build_request(doc, offset, self.options.max_fill_tokens, budget, neighbours=near)
        job = context.to_fill_job(req, ticket.deadline, budget)
        job.session = key  # the engine reuses this document's last context K/V where that is exact
        if self.workspace_index is not None and self.workspace_index.on_files is not None:
            job.workspace, job.document = WORKSPACE_SPACE, uri_key(uri)  # its memory, less this file
        tree = doc.tree.copy() if doc.tree is not None else None  # edits change doc.tree in place
        return req, job, tree, (time.perf_counter() - t0) * 1000

    def _standing(self, uri: str, doc: Document, ticket: Ticket) -> str:
        """A finished fill's standing: "current" (its version is the document's), "typed along" (the
        user typed along it: kept for typing-through, not shown) or "gone" (dropped, its steps wasted)."""
        if self._is_current(uri, doc, ticket):
            return "current"
        if self.documents.get(uri) is doc and ticket.typed_along(doc.text):
            return "typed along"
        self.scheduler.mark_wasted(ticket)
        return "gone"

    def _postprocess(
        self, req: FillRequest, fill: Fill, ticket: Ticket, tree: Tree | None, doc: Document, offset: int
    ) -> Finished:
        """The engine's text made the editor's fill (postprocess.finish: filters, syntax check, gate)."""
        check = (
            postprocess.SyntaxCheck(ticket.text, tree, doc.parser, offset)
            if tree is not None and self.options.postprocess
            else None
        )
        return postprocess.finish(
            req,
            fill.text,
            check,
            filters=self.options.postprocess,
            confidence=fill.confidence,
            min_confidence=self.fill_gate(req.hole_kind),
            calibrator=self.fill_calibrator(),
        )

    def _report_fill(
        self,
        uri: str,
        position: types.Position,
        req: FillRequest,
        fill: Fill,
        fin: Finished,
        context_ms: float,
        arrival: float,
        stale: bool,
    ) -> None:
        """Records the fill's latency, logs its timings and sends dlm/status."""
        latency = (time.monotonic() - arrival) * 1000
        self.stats.last_latency_ms = round(latency, 1)
        log.debug(
            "fill %s:%d:%d %s: context %.1f ms, queue %.1f ms, engine %.1f ms, %d steps, %d tokens, "
            "postprocess %.1f ms, total %.1f ms%s%s%s",
            uri.rsplit("/", 1)[-1],
            position.line,
            position.character,
            req.hole_kind,
            context_ms,
            fill.queue_ms,
            fill.compute_ms,
            fill.steps,
            fill.tokens,
            fin.postprocess_ms,
            latency,
            " (deadline hit)" if fill.deadline_hit else "",
            f" dropped: {fin.dropped}" if fin.dropped else "",
            " (typed along: kept)" if stale else "",
        )
        self.send_status()

    def _deliver(
        self, key: str, doc: Document, offset: int, ticket: Ticket, fill: Fill, fin: Finished, stale: bool
    ) -> tuple[str, Result | None]:
        """(outcome, (text, range) or None): keeps the fill for typing-through and answers with it when
        it is for the current version and not empty."""
        if fill.cancelled:
            return "cancelled", None
        self.typing.remember(key, ticket.text, offset, fin.text, fin.replace_len)
        if stale:  # its version is gone; the fill stays for the request typing along it
            self.stats.typed_along += 1
            return "stale", None
        if not fin.text:
            return "empty", None
        return "answered", self._range_result(doc, offset, fin.text, fin.replace_len)

    def _count_outcome(self, ticket: Ticket, outcome: str) -> None:
        """Ends the ticket and counts the request once, under its outcome."""
        self.scheduler.end(ticket)
        if ticket.client_cancelled:
            outcome = "cancelled"  # the client got RequestCancelled, whatever became of the work
        with self.stats._lock:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)

    def context_tokens(self) -> int:
        """The context a fill is given: the user's contextTokens, else the engine's budget for its model
        and device (reported with its state: engine.api.context_budget), else 512."""
        return self.options.context_tokens or reported_context_tokens(self.engine_info)

    def fill_calibrator(self) -> gate.Calibrator | None:
        """The model's calibrated gate (serving.json "calibrator", reported by the engine), or None:
        the gate then compares the engine's raw confidence."""
        raw = self.engine_info.get("calibrator")
        if raw is not getattr(self, "_calibrator_raw", None):
            self._calibrator_raw, self._calibrator = raw, gate.Calibrator.from_json(raw)
        return getattr(self, "_calibrator", None)

    def fill_gate(self, kind: str = "line") -> float:
        """The confidence gate on shown fills of this hole kind: the user's minConfidence (for every
        kind), else the model's own (serving.json, reported by the engine as `gate`: one number or
        one per kind, gate.kind_gate), else 0."""
        if self.options.min_confidence is not None:
            return self.options.min_confidence
        return gate.kind_gate(self.engine_info.get("gate"), kind)

    def _range_result(self, doc: Document, offset: int, text: str, replace_len: int) -> Result:
        idx = doc.index(self.encoding)
        line, char = idx.position(offset)
        row, col = idx.row_col(offset)
        end_char = char + units_len(idx.line_text(row)[col : col + replace_len], self.encoding)
        rng = types.Range(types.Position(line, char), types.Position(line, end_char))
        return text, rng

    # ------------------------------------------------------------------ next edits

    def record_edit(self, key: str, before: str | None, index: Any, changes: object, doc: Document | None) -> None:
        """Adds a didChange's change to the document's edit history: one ranged change (a keystroke,
        a paste) by its offsets in the text before it; anything else (several changes, the full text)
        as the region where the texts differ. A document over HISTORY_MAX_CHARS keeps none."""
        if doc is None or before is None or before == doc.text:
            return
        if len(doc.text) > HISTORY_MAX_CHARS:
            self.history.drop(key)
            return
        now = time.monotonic()
        if isinstance(changes, list) and len(changes) == 1 and getattr(changes[0], "start", None) is not None:
            ch = changes[0]
            a, b = sorted((index.offset(*ch.start), index.offset(*ch.end)))
            # the splice as sent (no surrogate halves joined on the way): checked on the edit, not the text
            if len(doc.text) == len(before) - (b - a) + len(ch.text) and doc.text[a : a + len(ch.text)] == ch.text:
                self.history.record(key, a, before[a:b], ch.text, now, text=before)
                return
        a, b_old, b_new = _differing(before, doc.text)
        self.history.record(key, a, before[a:b_old], doc.text[a:b_new], now, text=before)

    async def next_edit_at(self, uri: str, version: object, position: types.Position) -> dict | None:
        """{"edits": [TextEdit...], "confidence"} for the document at exactly `version`, or None:
        nothing worth proposing, a newer version, an unknown document, no recent edit, or a job that a
        keystroke (or a newer request) superseded. Never raises except CancelledError."""
        doc = self.documents.get(uri)
        if doc is None or not isinstance(version, int) or isinstance(version, bool) or version != doc.version:
            return None
        key = self.documents.key(uri)
        idx = doc.index(self.encoding)
        if position.line >= idx.line_count():
            return None  # past the end: nothing there to rewrite
        offset = idx.offset(position.line, position.character)
        try:
            req = suggest.edit_request(
                doc.text,
                offset,
                self.history.recent(key, suggest.RECENT_EDITS),
                self.options.next_edit_approach,
                context_tokens=self.context_tokens(),
                language=doc.language_id,
            )
        except ValueError as e:
            log.warning("next edit not asked: %s", e)
            return None
        if req is None:
            return None
        ticket = self.edit_scheduler.begin(key, doc.version, self.options.budget_ms * NEXT_EDIT_BUDGETS)
        outcome, result = "empty", None
        try:
            outcome, result = await self._next_edit_steps(uri, doc, req, ticket)
            return result
        except (Late, Superseded):
            outcome = "cancelled"
            return None
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as e:  # noqa: BLE001 - one failed request must not affect the others
            outcome = "errors"
            log.warning("next edit failed for %s: %s", uri, e, exc_info=not _is_engine_error(e))
            return None
        finally:
            self.edit_scheduler.end(ticket)
            with self.edit_stats._lock:
                setattr(self.edit_stats, outcome, getattr(self.edit_stats, outcome) + 1)

    async def _next_edit_steps(
        self, uri: str, doc: Document, req: suggest.EditRequest, ticket: Ticket
    ) -> tuple[str, dict | None]:
        """(outcome, result): the engine's rewrite (or the baseline's), judged; None when stale."""
        least = 0.0  # the edit gate's, for the baseline's suggestions
        if req.job is None:
            b = suggest.baseline(req, edit_gate.shipped())
            new_window, confidence, least = b.window, b.confidence, b.least
        else:
            if not await self._wait_ready(ticket):
                return "empty", None
            req.job.deadline = ticket.deadline
            rewrite = await self.edit_scheduler.run(ticket, req.job)  # type: ignore[arg-type]
            if rewrite.cancelled:
                return "cancelled", None
            new_window, confidence = rewrite.text, rewrite.confidence
        if not self._is_current(uri, doc, ticket):
            return "stale", None
        found = suggest.judge(
            req, new_window, confidence, suggest.least_shown(self.options.next_edit_min_confidence, least)
        )
        if found.silent is not None:
            log.debug("next edit at %s: silent (%s)", uri, found.silent)
            return "empty", None
        idx = doc.index(self.encoding)
        edits = [
            {
                "range": {
                    "start": dict(zip(("line", "character"), idx.position(a), strict=True)),
                    "end": dict(zip(("line", "character"), idx.position(b), strict=True)),
                },
                "newText": text,
            }
            for a, b, text in found.edits
        ]
        return "answered", {"edits": edits, "confidence": round(found.confidence, 4)}

    # ------------------------------------------------------------------ configuration

    def apply_options(self, raw: object, initial: bool = False) -> None:
        """Applies raw option values: initializationOptions (`initial`) or workspace settings, which
        cannot change what the engine was started with (options.MACHINE_KEYS), so never restart it."""
        old = self.options
        self.options, warnings = parse_options(raw, old, from_settings=not initial)
        self.typing.clear()  # a kept fill was made under the old options
        for w in warnings:
            log.warning(w)
        if initial:
            self.option_warnings.extend(warnings)
        else:
            for w in warnings:
                self.window_show_message(types.ShowMessageParams(type=types.MessageType.Warning, message=w))
            if self.loop is not None:
                self.start_workspace()


def _is_engine_error(e: Exception) -> bool:
    return type(e).__name__ == "EngineError"


def make_server(engine_factory: EngineFactory | None = None) -> DlmServer:
    """Builds the server with every handler registered. `engine_factory(model, device, on_state)`
    replaces the real engine (tests use a scripted one)."""
    server = DlmServer(engine_factory)
    _register_lifecycle(server)
    _register_document_sync(server)
    _register_completion(server)
    _register_configuration(server)
    _register_dlm_requests(server)
    return server


def _register_lifecycle(server: DlmServer) -> None:
    """initialize, initialized, the workspace's folders as the client changes them, and shutdown."""

    @server.feature(types.INITIALIZE)
    def initialize(ls: DlmServer, params: types.InitializeParams) -> None:
        """Reads initializationOptions (bad values fall back to defaults, with a warning later)."""
        ls.apply_options(params.initialization_options, initial=True)
        ls.workspace_folders = [f.uri for f in params.workspace_folders or []] or (
            [params.root_uri] if params.root_uri else []
        )
        ls.workspace_roots = root_paths(None, [types.WorkspaceFolder(uri=u, name="") for u in ls.workspace_folders])

    @server.feature(types.INITIALIZED)
    def initialized(ls: DlmServer, params: types.InitializedParams) -> None:
        """Starts loading the model and reports option warnings."""
        release_logs()  # the client has the initialize answer (dlm_lsp.engines.hold_logs)
        ls.loop = asyncio.get_running_loop()
        for w in ls.option_warnings:
            ls.window_show_message(types.ShowMessageParams(type=types.MessageType.Warning, message=w))
        ls.option_warnings.clear()
        ls.start_engine()
        ls.start_workspace()

    @server.feature(types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS)
    def did_change_workspace_folders(ls: DlmServer, params: types.DidChangeWorkspaceFoldersParams) -> None:
        """Folders added to or removed from the workspace: the cross-file index walks the new set."""
        ls.change_workspace_folders(params.event.added, params.event.removed)

    @server.feature(types.SHUTDOWN)
    def shutdown(ls: DlmServer, params: None) -> None:
        """Stops the engine."""
        if ls.engine is not None:
            ls.engine.close()
            ls.engine = None
        ls.engine_gen += 1  # an early engine still being adopted is closed when it comes
        for early in (ls.early, ls._adopting):
            if early is not None:
                early.close()
        ls.early = None
        if ls.workspace_index is not None:
            ls.workspace_index.close()


def _register_document_sync(server: DlmServer) -> None:
    """didOpen, didChange, didClose on the server's one copy of each document (pygls's own removed)."""

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: DlmServer, params: types.DidOpenTextDocumentParams) -> None:
        """Tracks a newly opened document (the server's one copy of it: dlm_lsp/fill/documents.py)."""
        d = params.text_document
        ls.documents.open(d.uri, d.language_id, d.version, d.text)
        ls.changed_at[ls.documents.key(d.uri)] = read_order() or 0
        _tell_no_tree(ls)

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: DlmServer, params: types.DidChangeTextDocumentParams) -> None:
        """Applies edits (the tree re-parses when next used) and cancels the document's now-stale
        job (unless the edit only typed along it)."""
        uri = params.text_document.uri
        changes = content_changes(params.content_changes)
        was = ls.documents.get(uri) if isinstance(uri, str) else None
        before, index = (was.text, was.index(ls.encoding)) if was is not None else (None, None)
        doc = ls.documents.change(uri, params.text_document.version, changes, ls.encoding)
        key = ls.documents.key(uri)
        ls.changed_at[key] = read_order() or 0
        ls.edit_scheduler.cancel_document(key)  # a keystroke makes any next edit in flight stale
        try:
            ls.record_edit(key, before, index, changes, doc)
        except Exception:  # noqa: BLE001 - the history is context for next edits, never a reason to fail a change
            log.exception("edit history not updated for %s", uri)
            ls.history.drop(key)
        inflight = ls.scheduler.inflight(key)
        typing_along = inflight is not None and doc is not None and inflight.typed_along(doc.text)
        ls.scheduler.cancel_document(key, spare=inflight if typing_along else None)
        _tell_no_tree(ls)

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: DlmServer, params: types.DidCloseTextDocumentParams) -> None:
        """Forgets a closed document."""
        uri = params.text_document.uri
        key = ls.documents.key(uri)
        ls.scheduler.cancel_document(key)
        ls.typing.forget(key)
        ls.changed_at.pop(key, None)
        ls.edit_scheduler.cancel_document(key)
        ls.history.drop(key)
        ls.documents.close(uri)
        if ls.workspace_index is not None and isinstance(uri, str):
            ls.workspace_index.closed(uri)

    # pygls's built-in handlers of these keep a second copy of each document in its workspace and,
    # updating it, clamp the params' positions in place against str.splitlines() lines (which break
    # at \f, \x85, \u2028...): the handlers above would then apply moved edits. The server keeps
    # the one copy, so pygls's go and the handlers above get the params as the client sent them.
    for method in (types.TEXT_DOCUMENT_DID_OPEN, types.TEXT_DOCUMENT_DID_CHANGE, types.TEXT_DOCUMENT_DID_CLOSE):
        server.protocol.fm.builtin_features.pop(method, None)
    require_sync_types(server.protocol._converter)  # {"text": null} must not become the text "None"


def _tell_no_tree(ls: DlmServer) -> None:
    """Tells the user, once per session, that a document is too big for a syntax tree."""
    message = ls.documents.no_tree_notice()
    if message:
        ls.window_show_message(types.ShowMessageParams(type=types.MessageType.Info, message=message))


def _register_completion(server: DlmServer) -> None:
    """inlineCompletion, and completion for editors without it: both answered by DlmServer.fill_at."""

    @server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
    async def inline_completion(ls: DlmServer, params: types.InlineCompletionParams) -> types.InlineCompletionList:
        """Ghost text at the cursor: a fill from the engine, or the rest of one being typed."""
        got = await ls.fill_at(params.text_document.uri, params.position)
        if got is None:
            return types.InlineCompletionList(items=[])
        text, rng = got
        return types.InlineCompletionList(items=[types.InlineCompletionItem(insert_text=text, range=rng)])

    @server.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions(trigger_characters=[]))
    async def completion(ls: DlmServer, params: types.CompletionParams) -> types.CompletionList:
        """Fallback for editors without inline completion: the fill as one (multi-line) item."""
        got = await ls.fill_at(params.text_document.uri, params.position)
        if got is None:
            return types.CompletionList(is_incomplete=True, items=[])
        return types.CompletionList(is_incomplete=True, items=[_completion_item(*got)])


def _completion_item(text: str, rng: types.Range) -> types.CompletionItem:
    """A fill as one completion item, labelled by its first non-blank line."""
    label = text.strip().split("\n", 1)[0][:60] or text[:60]
    return types.CompletionItem(
        label=label,
        kind=types.CompletionItemKind.Snippet,
        detail="dlm-lsp fill",
        documentation=types.MarkupContent(kind=types.MarkupKind.PlainText, value=text),
        text_edit=types.TextEdit(range=rng, new_text=text),
        filter_text=label,
        insert_text_format=types.InsertTextFormat.PlainText,
        sort_text="0",
    )


def _register_configuration(server: DlmServer) -> None:
    """workspace/didChangeConfiguration: the `dlm` settings section applied."""

    @server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
    async def did_change_configuration(ls: DlmServer, params: types.DidChangeConfigurationParams) -> None:
        """Applies the `dlm` settings section (pulls it with workspace/configuration if not pushed)."""
        section = dlm_section(params.settings)
        if section is None and _supports_configuration(ls):
            try:
                got = await asyncio.wait_for(
                    ls.workspace_configuration_async(
                        types.ConfigurationParams(items=[types.ConfigurationItem(section="dlm")])
                    ),
                    5,
                )
                section = got[0] if got and isinstance(got[0], dict) else None
            except Exception as e:  # noqa: BLE001
                log.debug("workspace/configuration failed: %s", e)
        if section is not None:
            ls.apply_options(section)


def _register_dlm_requests(server: DlmServer) -> None:
    """The custom requests dlm/documentText and dlm/stats (docs/lsp-extensions.md)."""

    @server.feature(DOCUMENT_TEXT)
    def document_text(ls: DlmServer, params: object = None) -> dict | None:
        """The server's copy of a document, {"uri", "version", "text"}, or None when it is not open."""

        def field(obj: object, name: str) -> Any:  # pygls hands params of non-LSP methods over as namedtuples
            return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)

        uri = field(field(params, "textDocument"), "uri")
        if not isinstance(uri, str):
            from pygls.exceptions import JsonRpcInvalidParams

            raise JsonRpcInvalidParams(f'{DOCUMENT_TEXT} needs {{"textDocument": {{"uri": ...}}}}')
        doc = ls.documents.get(uri)
        return None if doc is None else {"uri": uri, "version": doc.version, "text": doc.text}

    @server.feature(NEXT_EDIT)
    async def next_edit(ls: DlmServer, params: object = None) -> dict | None:
        """The rewrite of the code near the cursor after the user's recent edits: {"edits": [TextEdit],
        "confidence"} for exactly that document version, or None (docs/lsp-extensions.md)."""

        def field(obj: object, name: str) -> Any:  # pygls hands params of non-LSP methods over as namedtuples
            return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)

        doc_id, pos = field(params, "textDocument"), field(params, "position")
        uri, version = field(doc_id, "uri"), field(doc_id, "version")
        line, char = field(pos, "line"), field(pos, "character")
        if not isinstance(uri, str) or not all(type(v) is int and v >= 0 for v in (line, char)):
            from pygls.exceptions import JsonRpcInvalidParams

            raise JsonRpcInvalidParams(
                f'{NEXT_EDIT} needs {{"textDocument": {{"uri", "version"}}, "position": {{"line", "character"}}}}'
            )
        return await ls.next_edit_at(uri, version, types.Position(line, char))

    @server.feature(STATS)
    def stats(ls: DlmServer, params: object = None) -> dict:
        """Counters since start (requests, cancelled, typed-through, engine steps, wasted steps...)."""
        out = ls.stats.as_json()
        out.update(
            {
                "state": ls.engine_state,
                "model": str(ls.engine_info.get("model")),
                "device": str(ls.engine_info.get("device")),
                "threads": ls.engine_info.get("threads"),
                "message": ls.engine_info.get("message"),
                "contextTokens": ls.context_tokens(),
                "nextEdit": {k: v for k, v in ls.edit_stats.as_json().items() if k != "engineJobRows"},
            }
        )
        return out


def _differing(a: str, b: str) -> tuple[int, int, int]:
    """(start, end in a, end in b) of the region where `a` and `b` differ: the common head and tail
    found by halving (slice comparisons run in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # the longest common head: a[:lo] == b[:lo]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    head = lo
    lo, hi = 0, min(len(a), len(b)) - head
    while lo < hi:  # the longest common tail not overlapping the head
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return head, len(a) - lo, len(b) - lo


def _supports_configuration(ls: DlmServer) -> bool:
    caps = getattr(ls.protocol, "client_capabilities", None)
    return bool(caps and caps.workspace and caps.workspace.configuration)


def serve(engine_factory: EngineFactory | None = None) -> int:
    """Runs the server over stdio until the client exits; returns the exit code (0 after shutdown,
    else 1). No input ends it otherwise (dlm_lsp/protocol.py)."""
    server = make_server(engine_factory)
    server.early = take_early(server.engine_factory)  # started before the client's initialize (dlm_lsp.engines)
    code = run_stdio(server)
    for engine in (server.engine, server.early, server._adopting):
        if engine is not None:
            engine.close()
    return code


# ---------------------------------------------------------------------- CLI


class _AnsweredCancels(logging.Filter):
    """Drops pygls's warning for a $/cancelRequest whose request was already answered: editors send
    one whenever the user types past a completion (routine, not a fault), and in VS Code's output
    view the warnings pushed the server's own lines out of sight."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Cancel notification for unknown message id")


def quiet_pygls() -> None:
    """pygls logs every message body at INFO; keep stderr readable."""
    logging.getLogger("pygls").setLevel(logging.WARNING)
    rpc = logging.getLogger("pygls.protocol.json_rpc")
    if not any(isinstance(f, _AnsweredCancels) for f in rpc.filters):
        rpc.addFilter(_AnsweredCancels())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_pygls()
    serve()
