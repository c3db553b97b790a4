"""The resident engine: one worker thread owns the model and runs every job.

submit(job) -> Future[Fill]. Jobs that are waiting when a step begins join the batch; finished and
cancelled jobs leave it between steps, so several documents or clients share each forward pass.
Cancel and deadline are checked between steps: a cancelled job stops within one step; a job whose
next step would pass its deadline commits all its remaining masks in that step. A job that fails
(bad input, an exception while decoding) fails alone: its future raises EngineError, the batch and
the worker go on.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine import sampler
from engine.api import EngineError, Fill, FillJob
from engine.cache import BatchContext
from engine.checkpoint import load_checkpoint

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
    canvas: sampler.Canvas
    future: Future
    started: float
    heal_text: str = ""  # token healing: the prefix's tail the fill re-types (cut from its text)


class EngineService:
    """Owns the model on its own thread; thread-safe submit()."""

    def __init__(self, model: str | None = None, device: str = "auto", on_state=None, max_batch: int = 8,
                 threads: int | None = None):
        self.model_name, self.device_name = model, device
        self.on_state = on_state
        self.max_batch = max_batch
        # DLM_THREADS caps torch's CPU threads (e.g. 1 when another job holds a core: oversubscribed
        # OpenMP threads spin against each other and a 10 ms step becomes a 1 s step)
        env = os.environ.get("DLM_THREADS", "")
        self.threads = threads or (int(env) if env.isdigit() and int(env) > 0 else None)
        self.state = "idle"
        self.message: str | None = None
        self.device: torch.device | None = None
        self.model = self.tok = self.cfg = None
        self._inbox: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._batch_ctx = BatchContext()
        self._full_ms_per_token = 0.0  # running estimate of a full forward's cost, for first-step deadlines
        self.stats = {"jobs": 0, "failed_jobs": 0, "steps": 0, "forwards": 0, "tokens": 0, "cancelled_jobs": 0,
                      "cancelled_steps": 0, "batched_steps": 0, "max_batch_seen": 0}
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
        """Stops the worker; jobs still running come back cancelled, queued ones fail."""
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
        elif self._stop.is_set():
            fut.set_exception(EngineError("the engine is shut down"))
        else:
            self._inbox.put((job, fut))
        return fut

    def run_now(self, job: FillJob) -> Fill:
        """Runs one job on the calling thread (headless commands, benchmarks); the model must be loaded."""
        fut: Future = Future()
        act = self._admit(job, fut)
        batch = [act] if act is not None else []
        ctx = BatchContext()
        while batch:
            batch = self._step_batch(batch, ctx)
        return fut.result()

    def _admit(self, job: FillJob, fut: Future) -> _Active | None:
        """Tokenizes a job and builds its canvas; a bad job fails its future here and returns None."""
        started = time.monotonic()
        try:
            if self.model is None:
                raise EngineError("the model is not loaded")
            if job.max_tokens < 1:
                raise EngineError("max_tokens must be at least 1")
            p_ids, s_ids = self.tok.encode_batch([job.prefix, job.suffix])
            heal = self.tok.heal(p_ids) if job.options.heal else None
            if heal:  # slot 0 (and maybe 1) re-types the prefix's last k tokens and may extend them
                p_ids = p_ids[: -heal.k]
            canvas = sampler.Canvas.build(p_ids, s_ids, job.max_tokens + (1 if heal else 0), self.cfg, job.options,
                                          job.context_tokens, self.device, heal=heal and heal.first,
                                          heal_then=heal and heal.then)
            canvas.full_ms = self._full_ms_per_token * canvas.ids.shape[0]
        except Exception as e:  # noqa: BLE001
            fut.set_exception(e if isinstance(e, EngineError) else EngineError(f"bad job: {e}"))
            with self._stats_lock:
                self.stats["failed_jobs"] += 1
            return None
        return _Active(job, canvas, fut, started, heal.text if heal else "")

    def _finish(self, a: _Active) -> None:
        c = a.canvas
        try:
            ids = c.fill_ids()
            text = self.tok.decode(ids)
            if a.heal_text:
                if c.heal_open:  # the healed slots not committed (cancelled): nothing after them is in order
                    ids, text = [], ""
                elif text.startswith(a.heal_text):
                    text = text[len(a.heal_text) :]
                else:
                    raise EngineError(f"healed fill {text[:20]!r} does not start with {a.heal_text!r}")
            fill = Fill(
                text=text, tokens=len(ids), steps=c.steps, slots=c.n, cancelled=c.cancelled,
                deadline_hit=c.deadline_hit, queue_ms=(a.started - a.job.submitted_at) * 1000,
                compute_ms=(time.monotonic() - a.started) * 1000, tokens_per_step=list(c.tokens_per_step),
                ms_per_step=list(c.ms_per_step), token_ids=ids, confidence=c.fill_confidence(),
            )
        except Exception as e:  # noqa: BLE001
            self._fail(a, e)
            return
        with self._stats_lock:
            self.stats["jobs"] += 1
            self.stats["steps"] += c.steps
            self.stats["tokens"] += len(ids)
            if c.cancelled:
                self.stats["cancelled_jobs"] += 1
                self.stats["cancelled_steps"] += c.steps
        if not a.future.done():
            a.future.set_result(fill)

    def _fail(self, a: _Active, e: BaseException) -> None:
        log.error("job %s failed: %s", a.job.job_id, e, exc_info=e)
        with self._stats_lock:
            self.stats["failed_jobs"] += 1
        if not a.future.done():
            a.future.set_exception(e if isinstance(e, EngineError) else EngineError(f"decoding failed: {e}"))

    @torch.inference_mode()
    def _forward(self, live: list[_Active], ctx: BatchContext) -> list[torch.Tensor | BaseException]:
        """Hidden states per job; if the batched forward fails, each job is retried alone so only
        the culprit fails."""
        canvases = [a.canvas for a in live]
        try:
            return sampler.forward(self.model, canvases, ctx)
        except Exception as e:  # noqa: BLE001
            if len(live) == 1:
                return [e]
        ctx.clear()
        out: list[torch.Tensor | BaseException] = []
        for c in canvases:
            try:
                out.append(sampler.forward(self.model, [c], None)[0])
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out

    @torch.inference_mode()
    def _step_batch(self, batch: list[_Active], ctx: BatchContext) -> list[_Active]:
        """Drops cancelled jobs, runs one step for the rest, resolves finished ones; returns the rest."""
        live = []
        for a in batch:
            if a.job.cancelled or a.future.cancelled():
                a.canvas.cancelled = True
                self._finish(a)
            else:
                live.append(a)
        if not live:
            return []
        now = time.monotonic()
        finals = []
        for a in live:
            final = sampler.deadline_due(a.canvas, a.job.deadline, now)
            a.canvas.deadline_hit |= final
            a.canvas.final_step = final  # a final step predicts every mask: its forward must run them all
            finals.append(final)
        t0 = time.perf_counter()
        was_full = [a.canvas.needs_full() for a in live]
        hs = self._forward(live, ctx)
        ok = []
        for a, h, f in zip(live, hs, finals):
            if isinstance(h, BaseException):
                self._fail(a, h)
                continue
            try:
                sampler.commit(self.model, a.canvas, h, f)
                ok.append(a)
            except Exception as e:  # noqa: BLE001
                self._fail(a, e)
        ms = (time.perf_counter() - t0) * 1000
        for a, wf in zip(live, was_full):
            sampler.record_step(a.canvas, wf, ms)
        if all(was_full):
            tokens = sum(a.canvas.ids.shape[0] for a in live)
            est = ms / max(1, tokens)
            self._full_ms_per_token = est if not self._full_ms_per_token else 0.7 * self._full_ms_per_token + 0.3 * est
        with self._stats_lock:
            self.stats["forwards"] += (1 if any(was_full) else 0) + (1 if not all(was_full) else 0)
            self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(live))
            if len(live) > 1:
                self.stats["batched_steps"] += 1
        rest = []
        for a in ok:
            if a.canvas.done:
                self._finish(a)
            else:
                rest.append(a)
        return rest

    def _drain(self, active: list[_Active], block: bool) -> bool:
        """Admits every queued job into `active`; returns False when close() was asked for."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return not self._stop.is_set()
        while True:
            if item is None:
                return False
            a = self._admit(*item)
            if a is not None:
                active.append(a)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return not self._stop.is_set()

    def _run(self) -> None:
        try:
            if self.model is None:  # load() may already have run on the caller's thread
                self.load()
        except Exception:  # noqa: BLE001
            # fail whatever is queued, and keep failing new jobs with the load error
            while not self._stop.is_set():
                item = self._inbox.get()
                if item is None:
                    return
                item[1].set_exception(EngineError(self.message or "engine failed to load"))
            return
        active: list[_Active] = []
        while self._drain(active, block=not active):
            if not active:
                continue
            # newest jobs first: latest-wins traffic wants the fresh request served before old ones
            batch, waiting = active[-self.max_batch :], active[: -self.max_batch]
            try:
                active = waiting + self._step_batch(batch, self._batch_ctx)
            except Exception as e:  # noqa: BLE001 - the worker must survive anything a batch does
                log.exception("engine step failed")
                for a in batch:
                    self._fail(a, e)
                self._batch_ctx.clear()
                active = waiting
        for a in active:
            a.canvas.cancelled = True
            self._finish(a)
        while True:  # jobs queued after close() was asked for: answer them, never leave them hanging
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].set_exception(EngineError("the engine is shut down"))
