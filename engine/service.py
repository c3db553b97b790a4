"""The resident engine: one worker thread owns the model and runs every job.

submit(job) -> Future[Fill]. Jobs that are waiting when a step begins join the batch; finished and
cancelled jobs leave it between steps, so several documents or clients share each forward pass.
Cancel and deadline are checked between steps: a cancelled job stops within one step; a job whose
next step would pass its deadline commits all its remaining masks in that step.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.api import EngineError, Fill, FillJob
from engine.checkpoint import load_checkpoint
from engine.sampler import Canvas, step

log = logging.getLogger("dlm.engine")


def pick_device(device: str) -> torch.device:
    if device in ("auto", "", None):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineError("device 'cuda' was asked for but no CUDA GPU is visible; use device 'cpu' or 'auto'")
    return torch.device(device)


@dataclass
class _Active:
    job: FillJob
    canvas: Canvas
    future: Future
    started: float


class EngineService:
    """Owns the model on its own thread; thread-safe submit()."""

    def __init__(self, model: str | None = None, device: str = "auto", on_state=None, max_batch: int = 8,
                 threads: int | None = None):
        self.model_name, self.device_name = model, device
        self.on_state = on_state
        self.max_batch = max_batch
        self.threads = threads
        self.state = "idle"
        self.message: str | None = None
        self.device: torch.device | None = None
        self.model = self.tok = self.cfg = None
        self._inbox: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = {"jobs": 0, "steps": 0, "cancelled_jobs": 0, "cancelled_steps": 0, "batched_steps": 0}
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle

    def _set_state(self, state: str, message: str | None = None) -> None:
        self.state, self.message = state, message
        if self.on_state is not None:
            try:
                self.on_state(state, {"model": str(self.model_name or "default"), "device": str(self.device or self.device_name), "message": message})
            except Exception:  # a broken callback must not kill the engine
                log.exception("on_state callback failed")

    def start(self) -> "EngineService":
        """Starts the worker thread, which loads the model; returns at once."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dlm-engine", daemon=True)
            self._thread.start()
        return self

    def load(self) -> None:
        """Loads the model on the calling thread (used by the worker and by one-shot commands)."""
        self._set_state("loading")
        try:
            if self.threads:
                torch.set_num_threads(self.threads)
            self.device = pick_device(self.device_name)
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
            self.model, self.tok, self.cfg = load_checkpoint(self.model_name, self.device, dtype)
        except Exception as e:  # noqa: BLE001 - any load failure becomes the 'error' state
            self._set_state("error", f"could not load model: {e}")
            self._ready.set()
            raise
        self._set_state("ready")
        self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the model is loaded (False on timeout or load error)."""
        self._ready.wait(timeout)
        return self.state == "ready"

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------ jobs

    def submit(self, job: FillJob) -> Future:
        """Queues a job; the future resolves to a Fill (cancelled ones too) or raises EngineError."""
        fut: Future = Future()
        if self.state == "error":
            fut.set_exception(EngineError(self.message or "engine failed to load"))
            return fut
        self._inbox.put((job, fut))
        return fut

    def run_now(self, job: FillJob) -> Fill:
        """Runs one job on the calling thread (headless commands, benchmarks); the model must be loaded."""
        fut: Future = Future()
        act = self._admit(job, fut)
        if act is None:
            return fut.result()
        batch = [act]
        while batch:
            batch = self._step_batch(batch)
        return fut.result()

    def _admit(self, job: FillJob, fut: Future) -> _Active | None:
        try:
            if job.max_tokens < 1:
                raise EngineError("max_tokens must be at least 1")
            p_ids, s_ids = self.tok.encode_batch([job.prefix, job.suffix])
            canvas = Canvas.build(p_ids, s_ids, job.max_tokens, self.cfg, job.options, job.context_tokens, self.device)
        except Exception as e:  # noqa: BLE001
            fut.set_exception(e if isinstance(e, EngineError) else EngineError(f"bad job: {e}"))
            return None
        return _Active(job, canvas, fut, time.monotonic())

    def _finish(self, a: _Active, cancelled: bool = False) -> None:
        c = a.canvas
        ids = c.fill_ids()
        fill = Fill(
            text=self.tok.decode(ids), tokens=len(ids), steps=c.steps, slots=c.n, cancelled=cancelled,
            deadline_hit=getattr(c, "deadline_hit", False), queue_ms=(a.started - a.job.submitted_at) * 1000,
            compute_ms=(time.monotonic() - a.started) * 1000, tokens_per_step=list(c.tokens_per_step),
            ms_per_step=list(c.ms_per_step), token_ids=ids,
        )
        with self._stats_lock:
            self.stats["jobs"] += 1
            self.stats["steps"] += c.steps
            if cancelled:
                self.stats["cancelled_jobs"] += 1
                self.stats["cancelled_steps"] += c.steps
        if not a.future.done():
            a.future.set_result(fill)

    def _step_batch(self, batch: list[_Active]) -> list[_Active]:
        """Drops cancelled jobs, runs one step for the rest, resolves finished ones; returns the rest."""
        live = []
        for a in batch:
            if a.job.cancelled or a.future.cancelled():
                self._finish(a, cancelled=True)
            else:
                live.append(a)
        if not live:
            return []
        now = time.monotonic()
        finals = []
        for a in live:
            last = a.canvas.ms_per_step[-1] / 1000 if a.canvas.ms_per_step else 0.0
            final = a.job.deadline is not None and now + last >= a.job.deadline
            if final:
                a.canvas.deadline_hit = True
            finals.append(final)
        try:
            step(self.model, [a.canvas for a in live], finals)
            if len(live) > 1:
                with self._stats_lock:
                    self.stats["batched_steps"] += 1
        except Exception as e:  # noqa: BLE001
            if len(live) == 1:
                live[0].future.set_exception(EngineError(f"decoding failed: {e}"))
                log.exception("job %s failed", live[0].job.job_id)
                return []
            # isolate the failing job: run each alone so one bad job fails only itself
            survivors = []
            for a, f in zip(live, finals):
                try:
                    step(self.model, [a.canvas], [f])
                    survivors.append(a)
                except Exception as e1:  # noqa: BLE001
                    log.exception("job %s failed", a.job.job_id)
                    a.future.set_exception(EngineError(f"decoding failed: {e1}"))
            live = survivors
        rest = []
        for a in live:
            if a.canvas.done:
                self._finish(a)
            else:
                rest.append(a)
        return rest

    def _run(self) -> None:
        try:
            self.load()
        except Exception:  # noqa: BLE001
            # fail whatever is queued, and keep failing new jobs with the load error
            while not self._stop.is_set():
                item = self._inbox.get()
                if item is None:
                    return
                item[1].set_exception(EngineError(self.message or "engine failed to load"))
        active: list[_Active] = []
        while not self._stop.is_set():
            try:
                item = self._inbox.get(timeout=0.5) if not active else self._inbox.get_nowait()
            except queue.Empty:
                item = False
            while item:
                job, fut = item
                a = self._admit(job, fut)
                if a is not None:
                    active.append(a)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = False
            if item is None:
                break
            if not active:
                continue
            # newest jobs first: latest-wins traffic wants the fresh request served before old ones
            batch, waiting = active[-self.max_batch :], active[: -self.max_batch]
            active = waiting + self._step_batch(batch)
        for a in active:
            self._finish(a, cancelled=True)
