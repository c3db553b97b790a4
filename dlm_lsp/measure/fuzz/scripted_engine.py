"""A scripted stand-in for engine.serve.service.EngineService: the engine of a `scripted:...` model
(fake_server.py, for `dlm-lsp fuzz` and `dlm-lsp soak`) and of server tests that need exact timing.

The server passes its `model` option to the engine factory, so a test picks the behaviour with
`"model": "scripted:steps=20,step_ms=50,text=hello%20world"`:
  steps     denoising steps per job (default 4)
  step_ms   sleep per step (default 10)
  slow_every, slow_ms  N > 0: every Nth job sleeps slow_ms per step instead (a mix of jobs that finish
            between keystrokes and jobs that outlast them, whatever the machine's speed)
  load_ms   time spent "loading" before ready (default 0)
  text      the fill text, URL-quoted (default "x = 1")
  fail      1: every job raises EngineError
  echo      N > 0: the fill is the last N characters of the job's prefix (checks what the server sent)
  lookup    N > 0: the fill is the first N characters of the job's lookup text (the cross-file side)
  workspace 1: the fill names the files of the job's workspace memory (workspace_files) but its
            document, by base name, sorted, joined by "+" ("-" when the job names no memory)
  confidence  the fill's confidence (default 1)
  gate      the model's own confidence gate, reported with the state as a real engine reports
            serving.json's min_confidence (default: none)
  context   the context budget reported with the state, as a real engine reports its model's and
            device's (engine.api.context_budget; default: none, an engine that reports none)
  tell      a FillJob field: the fill is that field's value as text (what the server sent)
  forwarded, reused  rows a job that ran reports: a session's first job forwards forwarded + reused
            rows, every later one of that session forwards `forwarded` and reuses `reused`, as an
            engine with exact context reuse would (Fill.forwarded_tokens, .reused_tokens; default 0, 0)
  hang      N > 0: the Nth job never finishes (the engine thread blocks, ignoring cancel and
            deadline, until close): what a step stuck forever looks like to the server
  made      1: the fill tells this engine's birth: "engine N of M, C closed, made at T ms" (N: which
            engine of this process it is, M: how many were made, C: how many closed, T: when it was
            made, from this module's import at the process's start): which engine the server fills with
  broken    1: making the engine raises EngineError("scripted broken model"), as a missing model does
  follow    a text: the fill is what follows the job's prefix in it (the prefix's end found by its
            longest tail the text holds; "" when none): a fill that proposes what the user types next
            whichever keystroke's job runs, however a slow machine spreads the keystrokes over jobs
  rewrite   a next edit's (EditJob's) answer: "old>new;old2>new2", whole-word substitutions made in
            its window (default: none, the window unchanged)
  hold      a folder: job N writes N to DIR/started-N when it takes its first step, and before it
            resolves waits until DIR/release-N or DIR/release exists (or it is cancelled, its deadline
            passes, or the engine closes): a test orders "this job is running" and "now let it end"
            by events instead of by step times, whatever the machine's speed
Like the real engine it runs jobs on its own thread, checks cancel and deadline between steps, and
resolves cancelled jobs with Fill(cancelled=True) carrying the steps taken.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypedDict

from engine.api import EditJob, EngineError, Fill, FillJob, Rewrite


def parse_script(model: str | None) -> dict[str, str]:
    params = {
        "steps": "4",
        "step_ms": "10",
        "load_ms": "0",
        "text": "x = 1",
        "fail": "0",
        "echo": "0",
        "hang": "0",
        "confidence": "1",
        "gate": "",
        "context": "",
        "tell": "",
        "forwarded": "0",
        "reused": "0",
        "lookup": "0",
        "workspace": "0",
        "slow_every": "0",
        "slow_ms": "0",
        "made": "0",
        "broken": "0",
        "follow": "",
        "hold": "",
        "rewrite": "",
    }
    body = (model or "").split(":", 1)[1] if ":" in (model or "") else ""
    for part in filter(None, body.split(",")):
        k, _, v = part.partition("=")
        params[k] = urllib.parse.unquote(v)
    return params


class _Rows(TypedDict, total=False):
    """The rows a job that ran reports (Fill's fields of the same names)."""

    forwarded_tokens: int
    reused_tokens: int


log = logging.getLogger("dlm.scripted")
_T0 = time.monotonic()  # the process's start, near enough: fake_server.py imports this module first
_births = {"made": 0, "closed": 0}
_births_lock = threading.Lock()


class ScriptedEngine:
    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        on_state: Callable[[str, dict[str, Any]], object] | None = None,
    ) -> None:
        self.model_name, self.device_name, self.on_state = model, device, on_state
        self.p = parse_script(model)
        if self.p["broken"] == "1":
            raise EngineError("scripted broken model")
        with _births_lock:
            _births["made"] += 1
            self.ordinal = _births["made"]
        self.made_ms = (time.monotonic() - _T0) * 1000
        log.info("scripted engine %d made", self.ordinal)
        self.state = "idle"
        self._inbox: queue.Queue[tuple[FillJob | EditJob, Future[Any]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.jobs_seen = 0
        self._sessions: set[str | None] = set()  # session keys that ran a job (their next job "reuses")
        self._closed = threading.Event()
        self.spaces: dict[str, set[str]] = {}  # workspace memories: name -> file keys

    def workspace_files(self, space: str, files: Mapping[str, str | None]) -> dict[str, int]:
        keys = self.spaces.setdefault(space, set())
        for k, t in files.items():
            (keys.discard(k) if t is None else keys.add(k))
        return {"files": len(keys), "tokens": 0, "refused": 0}

    def _set(self, state: str, message: str | None = None) -> None:
        self.state = state
        if self.on_state:
            self.on_state(
                state,
                {
                    "model": str(self.model_name),
                    "device": "cpu",
                    "message": message,
                    "gate": float(self.p["gate"]) if self.p["gate"] else None,
                    "context_tokens": int(self.p["context"]) if self.p["context"] and state == "ready" else None,
                },
            )

    def start(self) -> ScriptedEngine:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def submit(self, job: FillJob | EditJob) -> Future[Any]:
        """A Future of the job's Fill (FillJob) or Rewrite (EditJob)."""
        fut: Future[Any] = Future()
        self._inbox.put((job, fut))
        return fut

    def close(self) -> None:
        if not self._closed.is_set():
            with _births_lock:
                _births["closed"] += 1
        self._closed.set()
        self._inbox.put(None)

    def _run(self) -> None:
        self._set("loading")
        time.sleep(int(self.p["load_ms"]) / 1000)
        self._set("ready")
        while True:
            item = self._inbox.get()
            if item is None:
                return
            job, fut = item
            self.jobs_seen += 1
            if self.jobs_seen == int(self.p["hang"]):
                self._closed.wait()
                return
            if self.p["fail"] == "1":
                fut.set_exception(EngineError("scripted failure"))
                continue
            started = time.monotonic()
            steps, cancelled, hit = 0, False, False
            slow = int(self.p["slow_every"]) > 0 and self.jobs_seen % int(self.p["slow_every"]) == 0
            step_s = int(self.p["slow_ms" if slow else "step_ms"]) / 1000
            for _ in range(int(self.p["steps"])):
                if job.cancelled:
                    cancelled = True
                    break
                if job.deadline is not None and time.monotonic() >= job.deadline:
                    hit = True
                    break
                if steps == 0:
                    self._started(self.jobs_seen)
                time.sleep(step_s)
                steps += 1
            if not cancelled and not hit and self.p["hold"]:
                cancelled, hit = self._held(job, self.jobs_seen)
            if isinstance(job, EditJob):
                fut.set_result(self._rewrite(job, steps, cancelled, hit, started))
                continue
            n = int(self.p["echo"])
            text = job.prefix[-n:].replace("\n", "\u23ce") if n > 0 else self.p["text"]
            if int(self.p["lookup"]) > 0:
                text = job.lookup[: int(self.p["lookup"])].replace("\n", "\u23ce")
            if self.p["follow"]:
                text = _following(self.p["follow"], job.prefix)
            if self.p["tell"]:
                text = str(getattr(job, self.p["tell"]))
            if self.p["made"] == "1":
                with _births_lock:
                    made, closed = _births["made"], _births["closed"]
                text = f"engine {self.ordinal} of {made}, {closed} closed, made at {self.made_ms:.0f} ms"
            if self.p["workspace"] == "1":
                keys = self.spaces.get(job.workspace) if job.workspace is not None else None
                text = (
                    "-"
                    if keys is None
                    else "+".join(sorted(k.rsplit("/", 1)[-1] for k in set(keys) if k != job.document))
                )
            fut.set_result(
                Fill(
                    text=text,
                    tokens=len(text) // 3,
                    steps=steps,
                    slots=job.max_tokens,
                    cancelled=cancelled,
                    deadline_hit=hit,
                    confidence=float(self.p["confidence"]),
                    queue_ms=(started - job.submitted_at) * 1000,
                    compute_ms=(time.monotonic() - started) * 1000,
                    **self._rows(job, steps),
                )
            )

    def _rewrite(self, job: EditJob, steps: int, cancelled: bool, hit: bool, started: float) -> Rewrite:
        """A next edit's answer: the window with `rewrite`'s whole-word substitutions (old>new, ";"
        between pairs) made, at the script's confidence; the window unchanged when cancelled."""
        text = job.window
        if not cancelled:
            for pair in filter(None, self.p["rewrite"].split(";")):
                old, _, new = pair.partition(">")
                text = re.sub(rf"(?<!\w){re.escape(old)}(?!\w)", new.replace("\\", "\\\\"), text)
        return Rewrite(
            text=text,
            confidence=float(self.p["confidence"]),
            steps=steps,
            cancelled=cancelled,
            deadline_hit=hit,
            queue_ms=(started - job.submitted_at) * 1000,
            compute_ms=(time.monotonic() - started) * 1000,
        )

    def _started(self, n: int) -> None:
        """Tells a `hold` folder that job `n` took its first step."""
        if self.p["hold"]:
            (Path(self.p["hold"]) / f"started-{n}").write_text(str(n))

    def _held(self, job: FillJob | EditJob, n: int) -> tuple[bool, bool]:
        """(cancelled, deadline hit): waits for the `hold` folder's release of job `n`."""
        folder = Path(self.p["hold"])
        while not ((folder / f"release-{n}").exists() or (folder / "release").exists()):
            if job.cancelled or self._closed.is_set():
                return True, False
            if job.deadline is not None and time.monotonic() >= job.deadline:
                return False, True
            time.sleep(0.002)  # a poll of a condition, not a step time: the test's release ends it
        return False, False

    def _rows(self, job: FillJob, steps: int) -> _Rows:
        if not steps:
            return {}
        fwd, reused = int(self.p["forwarded"]), int(self.p["reused"])
        if job.session is None or job.session not in self._sessions:  # nothing to reuse yet
            self._sessions.add(job.session)
            fwd, reused = fwd + reused, 0
        return {"forwarded_tokens": fwd, "reused_tokens": reused}


def _following(text: str, prefix: str) -> str:
    """What follows `prefix`'s end in `text`: after the longest tail of `prefix` that `text` holds
    (its first place), "" when `text` holds none of it."""
    for n in range(min(len(prefix), len(text)), 0, -1):
        at = text.find(prefix[-n:])
        if at >= 0:
            return text[at + n :]
    return ""
