"""The resident engine: one worker thread owns the model and runs every job.

submit(job) -> Future[Fill] (an EditJob: Future[Rewrite], see below). Jobs that are waiting when a step begins join the batch; finished and
cancelled jobs leave it between steps, so several documents or clients share each forward pass.
Cancel and deadline are checked between steps: a cancelled job stops within one step; a job whose
next step would pass its deadline commits all its remaining masks in that step. A job that fails
(bad input, an exception while decoding, out of memory) fails alone: its future raises EngineError,
the batch and the worker go on. A job whose deadline has passed while it was queued is answered at
once with an empty Fill (`expired`), without running.

Next edits: an EditJob goes through the same queue and worker. Its run (engine/decode/rewrite.py: a
surprise scoring forward, then denoising steps on its own canvas) takes one forward per turn of the
worker's loop, after the fills' batched step, with the fills' checks between: a cancelled edit comes
back at once (cancelled, the window unchanged), the forward that would pass its deadline is its last,
one whose deadline passed in the queue is answered unchanged (`expired`) without running.

The worker is watched: if it dies (an exception escaping its loop, a BaseException in a step) its
jobs in flight fail with an error saying so and the next submit() starts a new worker; if one step
runs longer than `stall_s` (a step that never ends) a watchdog fails the jobs of that step, leaves
the stuck thread behind and starts a new worker over the same model; after `max_stalls` stuck
workers the service goes to the 'error' state and fails every job at once instead.

Torch CPU threads: the `threads` option, else DLM_THREADS, else cpu_threads() (the cores in this
process's affinity mask less one, at most 8; so 1 on a 2-core machine, where two OpenMP threads
beside the server's own turned 10-30 ms steps into 1-8 s ones). The count is set on the worker
thread itself, because OpenMP's count is per thread.

Warm-up: on a GPU the worker first runs fills of its own, of WARM_UP_SLOTS (16, 5 and 1) slots,
before it takes a job: the first fills of a process pay CUDA's start and a kernel compilation per
new shape (seconds), which a user's first keystrokes should not pay; with the fixed-shape step
(engine/decode/static.py) it also allocates that step's buffers for `max_batch` jobs of
RESERVED_SLOTS slots and the model's context, capturing its CUDA graphs, so no user fill does. On the CPU the first fill costs
only some tens of ms more than the next (docs/research/scripts/first_fill.py), so it is off there unless
`warm_up=True`. It counts in the stats' `warmup_fills` / `warmup_ms`, not in the job counters; a
warm-up that fails is logged and the worker serves on.

The workspace memory: `workspace_files(space, {key: text or None})` puts a workspace's files into
the WorkspaceNgram named `space` (engine/bias/ngram.py), tokenized and counted on the caller's
thread, so the worker never waits for a count; files past its token cap are refused and reported.
A job names the memory (FillJob.workspace) and its document (FillJob.document), which the fill's
view leaves out.

`on_state(state, info)`: what clients learn of the model, passed on unchanged by the daemon
(engine/serve/daemon.py) to its windows: its model, device, threads, confidence gate and calibrator,
and `context_tokens`, the context its fills get unless a client asks for another
(engine.api.context_budget: the model's window, capped at 512 tokens on the CPU, 4096 on CUDA).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

import torch

from engine.api import DecodeOptions, EditJob, EngineError, Fill, FillJob, Rewrite, context_budget, with_model_defaults
from engine.bias import names, ngram
from engine.bias.edits import word_edits
from engine.decode import forward as fwd
from engine.decode import levers, reuse, sampler, static
from engine.decode import rewrite as rw
from engine.decode.cache import BatchContext, Rows
from engine.decode.canvas import Canvas
from engine.decode.forward import build_canvas
from engine.decode.reorder import SessionCache
from engine.weights.checkpoint import resolve_model_path, serving_defaults
from engine.weights.load import load_checkpoint

if TYPE_CHECKING:
    from engine.model.config import ModelConfig
    from engine.model.transformer import Transformer
    from engine.tokenizer import TextTokenizer

log = logging.getLogger("dlm.engine")

MAX_DEFAULT_THREADS = 8


def cpu_threads() -> int:
    """The torch CPU threads a resident engine uses by default: the cores this process may run on,
    less one for the server's own threads (event loop, tree-sitter, post-processing), at most 8.

    An OpenMP thread that shares a core with another busy thread spins in its barriers and a 10 ms
    step becomes a 1-8 s step (seen on 2 cores with 2 torch threads beside the server). The count
    is per calling thread (omp_set_num_threads): the worker sets its own, so OMP_NUM_THREADS is not
    needed to keep the pool small. The cap: beyond a few threads a small-batch step gains little
    and every extra thread is one more to spin. DLM_THREADS or the `threads` option override it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_THREADS, cores - 1))


def _env_threads() -> int | None:
    env = os.environ.get("DLM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else None


def is_out_of_memory(e: BaseException) -> bool:
    """True for MemoryError and torch's out-of-memory RuntimeErrors (CUDA, MPS, CPU allocator)."""
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e).lower())


def _death(e: BaseException) -> EngineError:
    return EngineError(f"the engine thread died ({type(e).__name__}: {e}); it restarts with the next request")


def _resolve(fut: Future, result: object = None, exc: BaseException | None = None) -> None:
    """Sets a future's outcome unless it has one (a watchdog and a late worker may race for it)."""
    if fut.done():
        return
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


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
    heal_text: str = ""  # token healing: the prefix's tail the fill re-types (cut from its text)


@dataclass
class _EditActive:
    """A next edit in flight (EditJob): its run (engine/decode/rewrite.py) is stepped on the worker
    between fill batches, one forward per turn, so a cancel or a newer job stops it within one step."""

    job: EditJob
    run: rw.EditRun
    future: Future
    started: float


WARM_UP_SLOTS = (16, 5, 1)  # the warm-up's fills (EngineService.warm_up)
RESERVED_SLOTS = 65  # the fixed-shape step's slots reserved at warm-up: a 64-token fill and its healed slot


class EngineService:
    """Owns the model on its own thread; thread-safe submit()."""

    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        on_state: Callable[[str, dict], object] | None = None,
        max_batch: int = 8,
        threads: int | None = None,
        stall_s: float = 60.0,
        max_stalls: int = 3,
        warm_up: bool | None = None,
        step_mode: str | None = None,
    ):
        self.model_name, self.device_name = model, device
        # the cached step (engine/decode/static.py): "graph" (CUDA graphs), "compile", "eager" (the
        # fixed-shape step run as it is) or "off" (the eager loop); None: DLM_STEP_MODE, else "auto":
        # graphs on a GPU, off on a CPU (there the eager loop is as fast and runs every lever)
        self.step_mode = step_mode or os.environ.get("DLM_STEP_MODE", "auto")
        if self.step_mode not in ("auto", *static.MODES):
            raise ValueError(f"step_mode must be auto or one of {static.MODES}, got {self.step_mode!r}")
        self._static: static.StaticStep | None = None
        # before its first job the worker runs WARM_UP_SLOTS fills of its own (None: on a GPU only, where
        # the first fills compile the Triton kernel's variants and start cuBLAS: seconds; on the CPU the
        # first fill costs some tens of ms more than the next, docs/research/scripts/first_fill.py: not worth a warm-up)
        self.warm_up = warm_up
        self._warmed = False
        self.on_state = on_state
        self.max_batch = max_batch
        # torch CPU threads: the `threads` argument, else DLM_THREADS, else (the resident worker
        # only) cpu_threads(); load() on a caller's thread applies only an explicit count
        self._explicit_threads = threads if threads and threads > 0 else _env_threads()
        self.threads = self._explicit_threads or cpu_threads()
        self.threads_from = (
            "option" if threads and threads > 0 else "DLM_THREADS" if self._explicit_threads else "cores"
        )
        # a step running longer than this is stuck (also at least 10x the slowest step seen, so a
        # big model on a slow CPU is not taken for a stuck one)
        self.stall_s, self.max_stalls = stall_s, max_stalls
        self.state = "idle"
        self.message: str | None = None
        self.device: torch.device | None = None
        self.model: Transformer | None = None
        self.tok: TextTokenizer | None = None
        self.cfg: ModelConfig | None = None
        self.serving: dict = {}  # the model's serving defaults (checkpoint.serving_defaults)
        self.corpus_names = names.NameSet(frozenset())  # the model's names.txt (engine/bias/names.py)
        self.ngram: ngram.NgramTable | None = None  # the model's ngram.safetensors (engine/bias/ngram.py)
        # workspace memories (DecodeOptions.workspace_ngram) by the name a client gave (FillJob.workspace)
        self.workspaces: dict[str, ngram.WorkspaceNgram] = {}
        self._inbox: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._lock = threading.RLock()  # guards replacing the worker
        self._gen = 0  # the current worker's generation; an older worker that wakes up leaves
        self._dead_gen = -1  # the generation of a worker that died (replaced at the next submit)
        self._busy: tuple[int, float] | None = None  # (generation, monotonic start) of the step running now
        self._jobs: list[_Active | _EditActive] = []  # the current worker's jobs in flight
        self._slowest_step_s = 0.0
        self._batch_ctx = BatchContext()
        self._sessions = SessionCache()  # per document: the last context's K/V (reorder layout only)
        self._reuse = reuse.ReuseCache()  # per document, full attention: DecodeOptions.reuse (engine/decode/reuse.py)
        # per document: its last request's texts and their ids, so the next one re-tokenizes near the edit
        self._texts: OrderedDict[str, tuple[str, list[int], str, list[int]]] = OrderedDict()
        self._full_ms_per_token = 0.0  # running estimate of a full forward's cost, for first-step deadlines
        self.stats = {
            "jobs": 0,
            "failed_jobs": 0,
            "steps": 0,
            "forwards": 0,
            "tokens": 0,
            "cancelled_jobs": 0,
            "cancelled_steps": 0,
            "batched_steps": 0,
            "max_batch_seen": 0,
            "expired_jobs": 0,
            "out_of_memory": 0,
            "worker_deaths": 0,
            "stalls": 0,
            "restarts": 0,
            "forwarded_tokens": 0,
            "reused_tokens": 0,  # rows run / context rows reused (Fill's)
            "edit_jobs": 0,  # next edits answered (EditJob), and their denoising steps
            "edit_steps": 0,
            "warmup_fills": 0,
            "warmup_ms": 0.0,
        }  # the worker's own fills before its first job
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle

    def _set_state(self, state: str, message: str | None = None) -> None:
        self.state, self.message = state, message
        if self.on_state is not None:
            try:
                self.on_state(
                    state,
                    {
                        "model": str(self.model_name or "default"),
                        "device": str(self.device or self.device_name),
                        "message": message,
                        "threads": self.threads,
                        "gate": self.serving.get("min_confidence"),
                        "calibrator": self.serving.get("calibrator"),
                        "context_tokens": self.context_budget(),
                    },
                )
            except Exception:  # a broken callback must not kill the engine
                log.exception("on_state callback failed")

    def context_budget(self) -> int | None:
        """The context tokens a client's fills get by default (engine.api.context_budget: the model's
        window, capped for the device), None before the model has loaded."""
        if self.cfg is None or self.device is None:
            return None
        return context_budget(self.device.type, self.cfg.max_seq_len, self.cfg.context_len)

    def start(self) -> EngineService:
        """Starts the worker thread, which loads the model, and its watchdog; returns at once."""
        with self._lock:
            if self._thread is None:
                self._spawn()
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="dlm-engine-watchdog", daemon=True)
                self._watchdog.start()
        return self

    def _spawn(self) -> None:
        """Starts a worker (the first one, or one replacing a dead or stuck worker); holds _lock."""
        self._gen += 1
        self._busy = None
        self._jobs = []
        self._batch_ctx = BatchContext()
        self._thread = threading.Thread(
            target=self._run, args=(self._gen,), name=f"dlm-engine-{self._gen}", daemon=True
        )
        self._thread.start()

    def load(self) -> None:
        """Loads the model on the calling thread (used by the worker and by one-shot commands)."""
        self._set_state("loading")
        try:
            if self._explicit_threads:
                torch.set_num_threads(self._explicit_threads)
            self.device = pick_device(self.device_name)
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
            self.model, self.tok, self.cfg = load_checkpoint(self.model_name, self.device, dtype)
            mode = self.step_mode if self.step_mode != "auto" else ("graph" if self.device.type == "cuda" else "off")
            self._static = None if mode == "off" else static.StaticStep(self.model, mode, self.device)
            self.serving = serving_defaults(resolve_model_path(self.model_name))
            self.corpus_names = names.NameSet(names.load_names(resolve_model_path(self.model_name)))
            try:
                self.ngram = ngram.load_table(resolve_model_path(self.model_name))
            except ngram.NgramError as e:  # the model still serves; the memory is off (a job asking for it fails)
                log.warning("corpus n-gram memory off: %s", e)
                self.ngram = None
        except Exception as e:  # noqa: BLE001 - any load failure becomes the 'error' state
            log.error("could not load model %s: %s", self.model_name or "default", e)
            self._set_state("error", f"could not load model: {e}")
            self._ready.set()
            raise
        log.info(
            "model %s loaded on %s; %d torch thread(s) (%s)",
            self.model_name or "default",
            self.device,
            self.threads,
            self.threads_from,
        )
        self._set_state("ready")
        self._ready.set()

    def _loaded(self) -> tuple[Transformer, TextTokenizer, ModelConfig, torch.device]:
        """The model, its tokenizer and config, and its device, as load() set them; EngineError before."""
        if self.model is None or self.tok is None or self.cfg is None or self.device is None:
            raise EngineError("the model is not loaded")
        return self.model, self.tok, self.cfg, self.device

    def _warm_up(self) -> None:
        """The worker's own short fills before it takes jobs, once per process (see `warm_up`); a
        failure is logged and the worker serves on (the jobs then report their own errors)."""
        if self._warmed:
            return
        model, tok, cfg, device = self._loaded()  # the worker warms up after load()
        if not (self.warm_up if self.warm_up is not None else device.type == "cuda"):
            return
        self._warmed = True
        started = time.monotonic()
        try:
            prefix = tok.encode("import os\n\n\ndef warm_up(path):\n    with open(path) as f:\n        return ")
            suffix = tok.encode("\n\n\nprint(warm_up(os.devnull))\n")
            if self._static is not None:  # the fixed-shape step's buffers (and graphs) for a full batch
                budget = self.context_budget() or 512
                self._static.reserve(self.max_batch, RESERVED_SLOTS, budget + RESERVED_SLOTS)
            for n in WARM_UP_SLOTS:  # slot counts of different shapes: each may compile its own kernel variant
                canvas = build_canvas(prefix, suffix, n, cfg, DecodeOptions(), 512, device)
                sampler.fill(model, canvas, static=self._static)  # captures the step's graphs
                with self._stats_lock:
                    self.stats["warmup_fills"] += 1
        except Exception:  # noqa: BLE001 - a warm-up must not keep the engine from serving
            log.exception("engine warm-up fill failed")
        with self._stats_lock:
            self.stats["warmup_ms"] = round((time.monotonic() - started) * 1000, 1)
        log.info("engine warm-up: %d fill(s) in %.0f ms", self.stats["warmup_fills"], self.stats["warmup_ms"])

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the model is loaded (False on timeout or load error)."""
        self._ready.wait(timeout)
        return self.state == "ready"

    def close(self) -> None:
        """Stops the worker; jobs still running come back cancelled, queued ones fail."""
        self._stop.set()
        self._inbox.put(None)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
            if thread.is_alive():  # stuck in a step: answer its jobs and the queue from here
                log.warning("engine worker did not stop within 5 s; its jobs are answered as shut down")
                self._abandon(EngineError("the engine is shut down"))
                self._fail_queued(EngineError("the engine is shut down"))

    # ------------------------------------------------------------ the watchdog

    def _watch(self) -> None:
        while not self._stop.wait(min(0.25, self.stall_s / 4)):
            try:
                self.check_worker()
            except Exception:  # noqa: BLE001 - the watchdog must outlive anything it sees
                log.exception("engine watchdog failed")

    def _stall_limit(self) -> float:
        return max(self.stall_s, 10 * self._slowest_step_s)

    def check_worker(self) -> None:
        """Replaces a worker that died or is stuck in a step (the watchdog calls this; so does submit())."""
        with self._lock:
            if self._stop.is_set() or self._thread is None or self.state == "error":
                return
            busy = self._busy
            if busy is not None and busy[0] == self._gen and time.monotonic() - busy[1] > self._stall_limit():
                self._stalled(time.monotonic() - busy[1])
            elif self._dead_gen == self._gen or not self._thread.is_alive():
                self._dead_gen = -1
                with self._stats_lock:
                    self.stats["restarts"] += 1
                log.warning("engine worker %d is gone: starting a new one", self._gen)
                self._spawn()
                if self.state == "ready":
                    self._set_state("ready", "the engine thread died; a new engine worker took over")

    def _stalled(self, seconds: float) -> None:
        """A step has run for `seconds`: fail its jobs, leave its thread, start a new worker (holds _lock)."""
        with self._stats_lock:
            self.stats["stalls"] += 1
            stalls = self.stats["stalls"]
        msg = f"an engine step was stuck for {seconds:.0f} s"
        log.error(
            "%s (worker %d); %s", msg, self._gen, "starting a new worker" if stalls < self.max_stalls else "giving up"
        )
        self._abandon(EngineError(f"{msg}; the engine was restarted"))
        if stalls >= self.max_stalls:
            self._gen += 1  # the stuck worker, should it ever wake, leaves
            self._set_state(
                "error",
                f"{msg}, {stalls} times; the engine stopped. Restart the server "
                "(and see its log; DLM_THREADS=1 helps on a busy machine)",
            )
            self._fail_queued(EngineError(self.message))
            return
        with self._stats_lock:
            self.stats["restarts"] += 1
        self._spawn()
        self._set_state("ready", f"{msg}; a new engine worker took over")

    def _abandon(self, err: EngineError) -> None:
        """Fails every job the current worker holds."""
        for a in list(self._jobs):
            if not a.future.done():
                with self._stats_lock:
                    self.stats["failed_jobs"] += 1
            _resolve(a.future, exc=err)

    def _fail_queued(self, err: EngineError) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                _resolve(item[1], exc=err)

    # ------------------------------------------------------------ jobs

    def submit(self, job: FillJob | EditJob) -> Future:
        """Queues a job; the future resolves to a Fill (an EditJob: a Rewrite; cancelled ones too) or
        raises EngineError."""
        fut: Future = Future()
        if self.state == "error":
            fut.set_exception(EngineError(self.message or "engine failed to load"))
        elif self._stop.is_set():
            fut.set_exception(EngineError("the engine is shut down"))
        else:
            self._inbox.put((job, fut))
            if self._thread is not None:
                self.check_worker()
            if self.state == "error":  # the watchdog gave up meanwhile: no worker will take it
                self._fail_queued(EngineError(self.message or "the engine stopped"))
        return fut

    def workspace_files(self, space: str, files: dict, timeout: float | None = 60.0) -> dict:
        """Puts files into the workspace memory `space` ({key: text}; a None text removes the key),
        tokenized with the model's tokenizer, then counts them (WorkspaceNgram.refresh) on the
        calling thread, never the worker's. Returns {"files", "tokens", "refused"}: files past the
        memory's token cap are refused (the caller sends its most relevant first). Waits for the
        model to load; EngineError when it does not."""
        if not isinstance(space, str) or not space or not isinstance(files, dict):
            raise EngineError("workspace_files needs a workspace name and a {key: text or None} dict")
        if self.tok is None and not self.wait_ready(timeout):
            raise EngineError(self.message or "the engine is not ready")
        tok = self._loaded()[1]
        mem = self.workspaces.get(space)
        if mem is None:
            mem = self.workspaces[space] = ngram.WorkspaceNgram()
        refused = 0
        puts = [(k, t) for k, t in files.items() if isinstance(k, str) and isinstance(t, str)]
        for k, t in files.items():
            if t is None:
                mem.remove(k)
        for i in range(0, len(puts), 64):
            chunk = puts[i : i + 64]
            for (k, _), ids in zip(chunk, tok.encode_batch([t for _, t in chunk])):
                refused += not mem.put(k, ids)
        if mem.stale or not mem.counted:
            mem.refresh()
        return {"files": len(mem), "tokens": mem.tokens, "refused": refused}

    def workspace_drop(self, space: str) -> None:
        """Forgets the workspace memory `space` (its window closed)."""
        self.workspaces.pop(space, None)

    @overload
    def run_now(self, job: FillJob) -> Fill: ...
    @overload
    def run_now(self, job: EditJob) -> Rewrite: ...
    def run_now(self, job: FillJob | EditJob) -> Fill | Rewrite:
        """Runs one job on the calling thread (headless commands, benchmarks); the model must be loaded."""
        fut: Future = Future()
        act = self._admit(job, fut)
        batch: list[_Active | _EditActive] = [act] if act is not None else []
        ctx = BatchContext()
        while batch:
            batch = self._step_batch(batch, ctx)
        return fut.result()

    def _admit(self, job: FillJob | EditJob, fut: Future) -> _Active | _EditActive | None:
        """Tokenizes a job and builds its canvas, every lever attached (engine/decode/levers.py); a bad
        job fails its future here and returns None."""
        if isinstance(job, EditJob):
            return self._admit_edit(job, fut)
        started = time.monotonic()
        try:
            if self.model is None:
                raise EngineError("the model is not loaded")
            if job.max_tokens < 1:
                raise EngineError("max_tokens must be at least 1")
            p_ids, s_ids = self._encode(job)
            canvas, heal_text = levers.prepare(job, p_ids, s_ids, self._owned())
        except Exception as e:  # noqa: BLE001
            _resolve(fut, exc=e if isinstance(e, EngineError) else EngineError(f"bad job: {e}"))
            with self._stats_lock:
                self.stats["failed_jobs"] += 1
            return None
        return _Active(job, canvas, fut, started, heal_text)

    def _admit_edit(self, job: EditJob, fut: Future) -> _EditActive | None:
        """Tokenizes an edit job (its edits with their renamed words, engine/bias/edits.py word_edits)
        and starts its run, the model's tuned decoding under the job's options; a bad job fails here."""
        started = time.monotonic()
        try:
            _, tok, cfg, device = self._loaded()
            p_ids, w_ids, s_ids = tok.encode_batch([job.prefix, job.window, job.suffix])
            pairs = [(o, n) for old, new in job.edits for o, n in [(old, new), *word_edits(old, new)]]
            flat = tok.encode_batch([t for pair in pairs for t in pair]) if pairs else []
            edits = list(zip(flat[0::2], flat[1::2]))
            run = rw.EditRun(
                p_ids,
                w_ids,
                s_ids,
                edits,
                job.approach,
                cfg,
                with_model_defaults(job.options, self.serving.get("decode", {})),
                max_tokens=job.max_tokens,
                context_tokens=job.context_tokens,
                device=device,
                surprise=job.surprise,
                spread=job.spread,
                growth=job.growth,
                memory=job.memory,
                score=job.score,
            )
            run.full_ms = self._full_ms_per_token * (len(p_ids) + len(w_ids) + len(s_ids))
            if run.canvas is not None:
                run.canvas.full_ms = run.full_ms
        except Exception as e:  # noqa: BLE001
            _resolve(fut, exc=e if isinstance(e, EngineError) else EngineError(f"bad edit job: {e}"))
            with self._stats_lock:
                self.stats["failed_jobs"] += 1
            return None
        return _EditActive(job, run, fut, started)

    def _step_edit(self, e: _EditActive, ctx: BatchContext) -> bool:
        """One forward of an edit job, after the fills' checks (cancelled: answered now; the forward
        that would pass its deadline is its last); True while it has more to run."""
        if e.job.cancelled or e.future.cancelled():
            e.run.cancelled = True
            self._finish_edit(e)
            return False
        try:
            model = self._loaded()[0]
            with torch.inference_mode():
                e.run.step(model, e.run.deadline_due(e.job.deadline))
        except Exception as ex:  # noqa: BLE001 - the job fails alone
            self._fail(e, ex)
            if is_out_of_memory(ex):
                self._release_memory(ctx)
            return False
        if e.run.done:
            self._finish_edit(e)
            return False
        return True

    def _finish_edit(self, e: _EditActive) -> None:
        try:
            r = e.run.rewrite(self._loaded()[1].decode, e.job.window)
            r.queue_ms = (e.started - e.job.submitted_at) * 1000
            r.compute_ms = (time.monotonic() - e.started) * 1000
        except Exception as ex:  # noqa: BLE001
            self._fail(e, ex)
            return
        with self._stats_lock:
            self.stats["edit_jobs"] += 1
            self.stats["edit_steps"] += r.steps
            if r.cancelled:
                self.stats["cancelled_jobs"] += 1
        _resolve(e.future, r)

    def _owned(self) -> levers.Owned:
        """What the levers read from this service, as it stands now (a job's estimate, memories, caches)."""
        _, tok, cfg, device = self._loaded()
        return levers.Owned(
            tok=tok,
            cfg=cfg,
            device=device,
            decode_defaults=self.serving.get("decode", {}),
            ngram_table=self.ngram,
            workspaces=self.workspaces,
            corpus_names=self.corpus_names,
            sessions=self._sessions,
            reuse_cache=self._reuse,
            full_ms_per_token=self._full_ms_per_token,
        )

    def _encode(self, job: FillJob) -> tuple[list[int], list[int]]:
        """The job's prefix and suffix ids. With a session key, its last request's texts and ids let
        TextTokenizer.encode_edit tokenize only from the line before the first change on (the same
        ids as tokenizing the whole texts); a new session, or a tokenizer that can't, tokenizes all."""
        tok = self._loaded()[1]
        last = self._texts.get(job.session) if job.session is not None else None
        if last is None:
            p_ids, s_ids = tok.encode_batch([job.prefix, job.suffix])
        else:
            p_ids = tok.encode_edit(last[0], last[1], job.prefix)
            s_ids = tok.encode_edit(last[2], last[3], job.suffix)
        if job.session is not None:
            self._texts[job.session] = (job.prefix, p_ids, job.suffix, s_ids)
            self._texts.move_to_end(job.session)
            while len(self._texts) > max(8, self._reuse.size):
                self._texts.popitem(last=False)
        return p_ids, s_ids

    def _finish(self, a: _Active) -> None:
        c = a.canvas
        try:
            ids = c.fill_ids()
            text = self._loaded()[1].decode(ids)
            if a.heal_text:
                if c.heal_open:  # the healed slots not committed (cancelled): nothing after them is in order
                    ids, text = [], ""
                elif text.startswith(a.heal_text):
                    text = text[len(a.heal_text) :]
                else:
                    raise EngineError(f"healed fill {text[:20]!r} does not start with {a.heal_text!r}")
            fill = Fill(
                text=text,
                tokens=len(ids),
                steps=c.steps,
                slots=c.n,
                cancelled=c.cancelled,
                deadline_hit=c.deadline_hit,
                queue_ms=(a.started - a.job.submitted_at) * 1000,
                compute_ms=(time.monotonic() - a.started) * 1000,
                tokens_per_step=list(c.tokens_per_step),
                ms_per_step=list(c.ms_per_step),
                token_ids=ids,
                confidence=c.fill_confidence(),
                reused_tokens=getattr(c, "reused", 0),
                forwarded_tokens=c.rows_forwarded,
            )
        except Exception as e:  # noqa: BLE001
            self._fail(a, e)
            return
        with self._stats_lock:
            self.stats["jobs"] += 1
            self.stats["steps"] += c.steps
            self.stats["tokens"] += len(ids)
            self.stats["forwarded_tokens"] += fill.forwarded_tokens
            self.stats["reused_tokens"] += fill.reused_tokens
            if c.cancelled:
                self.stats["cancelled_jobs"] += 1
                self.stats["cancelled_steps"] += c.steps
        _resolve(a.future, fill)

    def _fail(self, a: _Active | _EditActive, e: BaseException) -> None:
        oom = is_out_of_memory(e)
        log.error("job %s failed%s: %s", a.job.job_id, " (out of memory)" if oom else "", e, exc_info=e)
        with self._stats_lock:
            self.stats["failed_jobs"] += 1
            self.stats["out_of_memory"] += oom
        if oom:
            err = EngineError(
                f"out of memory while decoding ({e}); the job was dropped. A smaller maxFillTokens or model needs less"
            )
        else:
            err = e if isinstance(e, EngineError) else EngineError(f"decoding failed: {e}")
        _resolve(a.future, exc=err)

    def _release_memory(self, ctx: BatchContext) -> None:
        """After an out-of-memory failure: drop the batch's buffers and the allocator's cache."""
        ctx.clear()
        if self._static is not None:
            self._static.clear()
        self._sessions.clear()
        self._reuse.clear()
        self._texts.clear()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def _forward(self, model: Transformer, live: list[_Active], ctx: BatchContext) -> Sequence[Rows | BaseException]:
        """Hidden states (and their positions) per job; if the batched forward fails, each job is
        retried alone so only the culprit fails."""
        canvases = [a.canvas for a in live]
        try:
            return fwd.forward(model, canvases, ctx)
        except Exception as e:  # noqa: BLE001
            if len(live) == 1:
                return [e]
        ctx.clear()
        out: list[Rows | BaseException] = []
        for c in canvases:
            try:
                out.append(fwd.forward(model, [c], None)[0])
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out

    def _step_batch(self, batch: list[_Active | _EditActive], ctx: BatchContext) -> list[_Active | _EditActive]:
        """One turn of the worker: the fills' batched step, then one forward of each edit job;
        returns the jobs with more to run."""
        fills = [a for a in batch if isinstance(a, _Active)]
        rest: list[_Active | _EditActive] = list(self._step_fills(fills, ctx)) if fills else []
        rest += [e for e in batch if isinstance(e, _EditActive) and self._step_edit(e, ctx)]
        return rest

    @torch.inference_mode()
    def _step_fills(self, batch: list[_Active], ctx: BatchContext) -> list[_Active]:
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
        model = self._loaded()[0]  # every admitted job found it loaded (_admit)
        now = time.monotonic()
        finals = []
        for a in live:
            final = sampler.deadline_due(a.canvas, a.job.deadline, now)
            a.canvas.deadline_hit |= final
            a.canvas.final_step = final  # a final step predicts every mask: its forward must run them all
            finals.append(final)
        t0 = time.perf_counter()
        was_full = [a.canvas.needs_full() for a in live]
        ok, failed, oom = self._static_step(live, finals)
        done = {id(a) for a in ok + failed}
        eager = [(a, f) for a, f in zip(live, finals) if id(a) not in done]  # the eager loop's jobs
        hs = self._forward(model, [a for a, _ in eager], ctx) if eager else []
        for (a, f), h in zip(eager, hs):
            if isinstance(h, BaseException):
                self._fail(a, h)
                oom |= is_out_of_memory(h)
                continue
            try:
                sampler.commit(model, a.canvas, h, f)
                ok.append(a)
            except Exception as e:  # noqa: BLE001
                self._fail(a, e)
                oom |= is_out_of_memory(e)
        if oom:
            self._release_memory(ctx)
        ms = (time.perf_counter() - t0) * 1000
        for a, wf in zip(live, was_full):
            sampler.record_step(a.canvas, wf, ms)
        if all(was_full) and not any(a.canvas.reused for a in live):  # a reusing first forward runs fewer rows
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

    def _static_step(self, live: list[_Active], finals: list[bool]) -> tuple[list[_Active], list[_Active], bool]:
        """Runs the fixed-shape cached step (engine/decode/static.py) for the jobs it takes; returns
        them, those that failed with it (a failed step fails its jobs only) and whether it ran out of memory."""
        st = self._static
        taken = [(a, f) for a, f in zip(live, finals) if st is not None and static.takes(a.canvas)]
        if st is None or not taken:
            return [], [], False
        try:
            st.step([a.canvas for a, _ in taken], [f for _, f in taken])
        except Exception as e:  # noqa: BLE001 - the jobs of this step fail, the engine serves on
            st.clear()
            for a, _ in taken:
                self._fail(a, e)
            return [], [a for a, _ in taken], is_out_of_memory(e)
        return [a for a, _ in taken], [], False

    def _expired(self, job: FillJob | EditJob, fut: Future) -> bool:
        """Answers a job whose deadline passed while it was queued with an empty Fill (an unchanged
        Rewrite); True if so."""
        now = time.monotonic()
        if job.deadline is None or now < job.deadline or job.cancelled:
            return False
        with self._stats_lock:
            self.stats["expired_jobs"] += 1
        if isinstance(job, EditJob):
            _resolve(
                fut,
                Rewrite(text=job.window, deadline_hit=True, expired=True, queue_ms=(now - job.submitted_at) * 1000),
            )
            return True
        _resolve(
            fut,
            Fill(
                text="",
                tokens=0,
                steps=0,
                slots=job.max_tokens,
                deadline_hit=True,
                expired=True,
                queue_ms=(now - job.submitted_at) * 1000,
            ),
        )
        return True

    def _drain(self, active: list[_Active | _EditActive], block: bool, gen: int) -> bool:
        """Admits every queued job into `active`; returns False when close() was asked for or this
        worker was replaced."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return not self._stop.is_set() and gen == self._gen
        while True:
            if gen != self._gen:  # replaced while it waited: the item is the new worker's
                self._inbox.put(item)
                return False
            if item is None:
                return False
            try:
                if not self._expired(*item):
                    a = self._admit(*item)
                    if a is not None:
                        active.append(a)
            except BaseException as e:  # the worker dies (see _run), but this job is answered first
                _resolve(item[1], exc=_death(e))
                raise
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return not self._stop.is_set() and gen == self._gen

    def _run(self, gen: int) -> None:
        torch.set_num_threads(self.threads)  # per thread: see cpu_threads()
        try:
            torch.set_num_interop_threads(1)  # nothing here forks inter-op work; one thread fewer to spin
        except RuntimeError:  # set already, or inter-op work has started: process-wide, once
            pass
        try:
            if self.model is None:  # load() may already have run on the caller's thread
                self.load()
            self._warm_up()
        except Exception:  # noqa: BLE001
            # fail whatever is queued, and keep failing new jobs with the load error
            while not self._stop.is_set() and gen == self._gen:
                item = self._inbox.get()
                if item is None:
                    return
                _resolve(item[1], exc=EngineError(self.message or "engine failed to load"))
            return
        active: list[_Active | _EditActive] = []
        batch: list[_Active | _EditActive] = []
        try:
            self._jobs = active
            while self._drain(active, block=not active, gen=gen):
                if not active:
                    continue
                # newest jobs first: latest-wins traffic wants the fresh request served before old ones
                batch, waiting = active[-self.max_batch :], active[: -self.max_batch]
                started = time.monotonic()
                self._busy = (gen, started)
                try:
                    rest = self._step_batch(batch, self._batch_ctx)
                except Exception as e:  # noqa: BLE001 - the worker must survive anything a batch does
                    log.exception("engine step failed")
                    for a in batch:
                        self._fail(a, e)
                    self._batch_ctx.clear()
                    if is_out_of_memory(e):
                        self._release_memory(self._batch_ctx)
                    rest = []
                if gen != self._gen:
                    return  # the watchdog took this worker's jobs and replaced it while the step ran
                self._slowest_step_s = max(self._slowest_step_s, time.monotonic() - started)
                self._busy = None
                active = waiting + rest
                self._jobs = active
                batch = []
        except BaseException as e:  # noqa: BLE001 - the thread dies: say so, and let the next submit replace it
            if gen == self._gen:
                self._died(gen, e, active + [a for a in batch if a not in active])
            return
        if gen != self._gen:
            return
        for a in active:
            if isinstance(a, _EditActive):
                a.run.cancelled = True
                self._finish_edit(a)
                continue
            a.canvas.cancelled = True
            self._finish(a)
        # jobs queued after close() was asked for: answer them, never leave them hanging
        self._fail_queued(EngineError("the engine is shut down"))

    def _died(self, gen: int, e: BaseException, jobs: list[_Active | _EditActive]) -> None:
        log.critical("engine worker %d died: %r; it restarts with the next job", gen, e, exc_info=e)
        with self._stats_lock:
            self.stats["worker_deaths"] += 1
        err = _death(e)
        for a in jobs:
            if not a.future.done():
                with self._stats_lock:
                    self.stats["failed_jobs"] += 1
            _resolve(a.future, exc=err)
        self._busy = None
        self._dead_gen = gen
        if not self._inbox.empty():  # jobs are waiting: do not make them wait for another submit
            threading.Thread(target=self.check_worker, daemon=True).start()
