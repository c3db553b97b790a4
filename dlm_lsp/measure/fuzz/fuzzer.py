"""The fuzzer: its state, a run (one input class per step, then the checks at the end) and its
report. What it does is in the mixins: messages (sending, settling answers), lifetime (the server
process), editing (documents), inputs (the input classes), shrink (minimal repros)."""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dlm_lsp.measure.fuzz.checks import CHECKS, server_exceptions
from dlm_lsp.measure.fuzz.client import server_command
from dlm_lsp.measure.fuzz.corpus import load_corpus
from dlm_lsp.measure.fuzz.editing import DocumentsMixin
from dlm_lsp.measure.fuzz.inputs import CLASSES, InputsMixin
from dlm_lsp.measure.fuzz.lifetime import LifetimeMixin
from dlm_lsp.measure.fuzz.messages import MessagesMixin
from dlm_lsp.measure.fuzz.shrink import ShrinkMixin


class Fuzzer(MessagesMixin, LifetimeMixin, DocumentsMixin, InputsMixin, ShrinkMixin):
    """One seeded run against one server command: `await Fuzzer(n, seed, ...).run()` -> the report."""

    def __init__(
        self,
        n: int,
        seed: int,
        model: str | None = None,
        timeout: float = 5.0,
        max_doc_bytes: int = 10_000_000,
        options: dict[str, Any] | None = None,
        classes: list[str] | None = None,
        server_cmd: list[str] | None = None,
        log_path: str | None = None,
        keep: int = 5,
        shrink: bool = False,
        corpus_dirs: Iterable[str | Path] = (),
    ) -> None:
        self.n, self.seed, self.model, self.timeout = n, seed, model, timeout
        self.max_doc_bytes = max_doc_bytes
        self.options = dict(options or {})
        if model:
            self.options["model"] = model
        self.cmd = server_cmd or server_command(model)
        self.log_path, self.keep, self.shrink = log_path, keep, shrink
        self.rng = random.Random(seed)
        self.classes = {c: w for c, w in CLASSES.items() if not classes or c in classes}
        self.corpus = load_corpus(corpus_dirs)
        self.client = None
        self.log = None
        self.docs = {}
        self.outstanding = []
        self.trace = collections.deque(maxlen=30)
        self.counts = {c: {"steps": 0, "messages": 0, "requests": 0, "failures": 0} for c in self.classes}
        self.failed = {c: 0 for c in CHECKS}
        self.failures = []
        self.doc_text = None  # does the server answer dlm/documentText
        self.cls, self.step = "startup", -1
        self.launches = 0
        self.expect_exit = False
        self.ids = 0
        self.answered = 0
        self.error_codes = collections.Counter()
        self.decks = {}
        self.stalls = []
        self.last_tick = time.monotonic()
        self.ranges_checked = 0  # fill ranges the answers carried
        self.stray = 0  # responses nobody waited for (parse errors with id null, late answers, batches)

    async def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.last_tick = time.monotonic()
        watch = asyncio.ensure_future(self._watch_stalls())
        await self.launch()
        names, weights = list(self.classes), list(self.classes.values())
        for step in range(self.n):
            self.step = step
            self.cls = self.rng.choices(names, weights)[0]
            self.counts[self.cls]["steps"] += 1
            if self.alive():
                try:
                    await getattr(self, self.cls)()
                    await self.settle()
                except ConnectionError:
                    pass
            if not self.alive():
                code = self.wire.process.returncode
                self.fail(
                    "exits",
                    f"the server exited on its own (code {code})"
                    if code is not None
                    else "the server closed its input",
                )
                await self.relaunch()
        self.cls = "shutdown"
        for doc in list(self.docs.values()):
            if self.alive():
                await self.close_checked(doc)
        await self.settle()
        await self.stop()
        self.check_output()
        watch.cancel()
        if self.shrink:
            await self.shrink_failures()
        if self.log is None:  # launch() opens it
            raise RuntimeError("the server's log was never opened")
        exceptions = server_exceptions(self.log)
        self.log.close()
        return {**self.report(time.monotonic() - t0), "server_exceptions": exceptions}

    def report(self, elapsed: float) -> dict[str, Any]:
        return {
            "ok": not any(self.failed.values()),
            "seed": self.seed,
            "n": self.n,
            "model": self.model or "default",
            "server": self.cmd,
            "timeout_s": self.timeout,
            "max_doc_bytes": self.max_doc_bytes,
            "elapsed_s": round(elapsed, 1),
            "launches": self.launches,
            "document_text": bool(self.doc_text),
            "answered": self.answered,
            "ranges_checked": self.ranges_checked,
            "error_codes": {str(k): v for k, v in sorted(self.error_codes.items(), key=lambda kv: str(kv[0]))},
            "stray_responses": self.stray,
            **{c: self.failed[c] for c in CHECKS},
            "classes": self.counts,
            "failures": [{k: v for k, v in f.items() if k != "_full"} for f in self.failures],
        }
