"""The server process's lifetime: launch (with the checks before and at initialize), relaunch,
the output checks of a process, and the spec's way to end it (shutdown, exit, exit code)."""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

from dlm_lsp.measure.fuzz.checks import _brief, _expect_code
from dlm_lsp.measure.fuzz.client import DOC_TEXT, FuzzClient, _inline_params
from dlm_lsp.measure.fuzz.reference import _is_int
from dlm_lsp.measure.fuzz.state import URIS, FuzzerState
from dlm_lsp.measure.replay import LspError
from engine.paths import REPO_ROOT


class LifetimeMixin(FuzzerState):
    """Fuzzer's server process: start, restart, check its output, end it."""

    async def launch(self) -> None:
        """Starts the server; checks a request before initialize, then initializes."""
        self.launches += 1
        if self.log is None:  # the server's stderr, read back for its tracebacks
            self.log = open(self.log_path, "w+b") if self.log_path else tempfile.TemporaryFile()
        self.client = FuzzClient(self.cmd, cwd=str(REPO_ROOT), stderr=self.log)
        await self.client.start()
        self.docs.clear()
        self.outstanding.clear()
        self.trace.clear()
        cls, self.cls = self.cls, "lifecycle"
        early = "file:///fuzz/before-init.py"
        self.notify(
            "textDocument/didOpen", {"textDocument": {"uri": early, "languageId": "python", "version": 1, "text": "x"}}
        )
        p = self.request(
            "textDocument/inlineCompletion",
            _inline_params(early, 0, 1),
            check=_expect_code(-32002, "before initialize"),
        )
        p.limit = max(60.0, self.timeout)  # the process is still starting (imports take seconds on a busy machine)
        await self.settle()
        init = self.request(
            "initialize",
            {
                "processId": None,
                "rootUri": None,
                "initializationOptions": self.options,
                "capabilities": {
                    "general": {"positionEncodings": ["utf-16"]},
                    "textDocument": {"inlineCompletion": {}},
                },
            },
        )
        await self.settle(init)
        self.notify("initialized", {})
        try:
            await self.client.wait_ready(max(60.0, self.timeout))
        except (TimeoutError, RuntimeError) as e:
            self.fail("exits", f"engine not ready: {e}")
        if self.doc_text is None:
            p = self.request(DOC_TEXT, {"textDocument": {"uri": early}})
            try:
                got = await asyncio.wait_for(asyncio.shield(p.fut), self.timeout)
                self.doc_text = True
                if got is not None:
                    self.fail("protocol", f"didOpen before initialize was kept: documentText {_brief(got)}")
            except LspError as e:
                self.doc_text = e.code != -32601
            except (TimeoutError, ConnectionError):
                self.doc_text = False
            self.outstanding.remove(p)
        self.cls = cls

    async def relaunch(self) -> None:
        await self.kill()
        await self.launch()

    def check_output(self) -> None:
        """Output checks of one server process: well-formed messages, no answer to a notification."""
        c = self.client
        if c is None:
            return
        if c.bad_output:
            self.fail("protocol", f"malformed output from the server: {c.bad_output[:3]}")

        def ours(i: Any) -> bool:
            return (
                i is None
                or (_is_int(i) and 0 < i <= self.ids)
                or (isinstance(i, str) and i.startswith(("batch-", "nj-")))
            )

        odd = [m for m in c.stray if not ours(m.get("id"))]
        if odd:
            self.fail("protocol", f"{len(odd)} responses to no request sent, e.g. {_brief(odd[:2])}")
        self.stray += len(c.stray)
        c.bad_output, c.stray = [], []

    async def kill(self) -> None:
        self.check_output()
        if self.client is not None and self.client.process.returncode is None:
            self.client.process.kill()
            await self.client.process.wait()
        self.outstanding.clear()

    async def stop(self, shutdown: bool = True) -> None:
        """Ends the server the spec's way: shutdown, a request after it (InvalidRequest), exit; the
        process must exit with 0 (1 without shutdown)."""
        if not self.alive():
            return
        self.expect_exit = True
        if shutdown:
            p = self.request("shutdown", None, check=lambda r, e: ("protocol", f"shutdown answered {e}") if e else None)
            await self.settle(p)
            self.request(
                "textDocument/inlineCompletion",
                _inline_params(URIS[0], 0, 0),
                check=_expect_code(-32600, "after shutdown"),
            )
            await self.settle()
        self.notify("exit", None)
        await self.wire.drain()
        want = 0 if shutdown else 1
        # a process's exit (its threads stopped, the interpreter torn down) takes seconds on a busy
        # machine: a generous wait still tells a server that never exits
        limit = max(30.0, self.timeout)
        try:
            code = await asyncio.wait_for(self.wire.process.wait(), limit)
            if code != want:
                self.fail(
                    "protocol", f"exit {'after' if shutdown else 'without'} shutdown: exit code {code}, want {want}"
                )
        except TimeoutError:
            self.fail("protocol", f"no exit within {limit:g} s of the exit notification")
            await self.kill()
        self.expect_exit = False
