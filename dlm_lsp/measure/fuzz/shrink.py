"""Shrinking: a failing document's messages cut down to a minimal sequence that still fails (delta
debugging, replayed on a fresh server, each try on a document of its own)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from dlm_lsp.measure.fuzz.checks import _brief, check_answer
from dlm_lsp.measure.fuzz.client import DOC_TEXT, FuzzClient
from dlm_lsp.measure.fuzz.reference import RefText, edit_outcomes, norm, resolve
from dlm_lsp.measure.fuzz.state import FuzzerState
from dlm_lsp.measure.replay import LspError
from engine.paths import REPO_ROOT


class ShrinkMixin(FuzzerState):
    """Fuzzer's shrinking of kept divergences and bad ranges."""

    async def shrink_failures(self, budget_s: float = 60.0) -> None:
        """Cuts the messages of each kept divergence / bad range down to a minimal sequence that still
        fails (delta debugging on one fresh server, each try on a document of its own)."""
        todo = [
            f
            for f in self.failures
            if f.get("_full")
            and f["check"] in ("divergences", "bad_ranges")
            and (f["_full"][0] or {}).get("method") == "textDocument/didOpen"
        ]
        if not todo:
            return
        self.client = FuzzClient(self.cmd, cwd=str(REPO_ROOT), stderr=self.log)
        await self.client.start()
        try:
            await self.client.initialize(self.options)
            await self.client.wait_ready(max(60.0, self.timeout))
            for f in todo:
                got = await self._ddmin(f["_full"], f["check"], time.monotonic() + budget_s)
                f["minimal"] = [_brief(m) for m in got] if got is not None else "does not fail on its own"
        except (ConnectionError, TimeoutError, RuntimeError) as e:
            for f in todo:
                f.setdefault("minimal", f"shrinking stopped: {e!r}")
        finally:
            await self.client.stop()

    async def _ddmin(self, msgs: list[Any], check: str, deadline: float) -> list[Any] | None:
        head, rest = msgs[:1], msgs[1:]
        if not await self._fails(head + rest, check):
            return None
        n = 2
        while len(rest) >= 1 and time.monotonic() < deadline:
            size = max(1, -(-len(rest) // n))
            for i in range(0, len(rest), size):
                cand = rest[:i] + rest[i + size :]
                if await self._fails(head + cand, check):
                    rest, n = cand, max(n - 1, 2)
                    break
            else:
                if size == 1:
                    break
                n = min(2 * n, len(rest))
        return head + rest

    async def _fails(self, msgs: list[Any], check: str) -> bool:
        """Replays `msgs` on a document of its own; True when `check` fails again."""
        self.ids += 1
        first = msgs[0]["params"]["textDocument"]["uri"]
        uri = (
            f"untitled:Shrink-{self.ids}"
            if first.startswith("untitled:")
            else f"file:///fuzz/shrink/{self.ids}/" + first.rsplit("/", 1)[-1]
        )
        states: list[tuple[str, Any]] | None = None  # the (text, version) outcomes so far; None: not open
        c = self.wire
        for m in msgs:
            m = json.loads(json.dumps(m).replace(json.dumps(first)[1:-1], json.dumps(uri)[1:-1]))
            method, params = m.get("method"), m.get("params")
            if "id" not in m:
                if method == "textDocument/didOpen":
                    td = params["textDocument"]
                    states = [(norm(td["text"]), td["version"])]
                elif method == "textDocument/didChange" and states is not None:
                    ch, v = params.get("contentChanges"), params["textDocument"].get("version")
                    states = list(
                        dict.fromkeys(
                            o
                            for t, ver in states
                            for o in (edit_outcomes(t, ver, ch, v) if isinstance(ch, list) else [(t, ver), (t, v)])
                        )
                    )[:32]
                elif method == "textDocument/didClose":
                    states = None
                c._write(m)
                continue
            m["id"] = f"shrink-{self.ids}-{m['id']}"
            fut = c.expect(m["id"])
            c._write(m)
            try:
                answer = await asyncio.wait_for(fut, self.timeout)
            except LspError:
                continue
            if (
                check == "bad_ranges"
                and method in ("textDocument/inlineCompletion", "textDocument/completion")
                and states
                and isinstance(params, dict)
            ):
                pos = params.get("position")
                if all(check_answer(method, answer, RefText(t), resolve(RefText(t), pos)[0]) for t, _ in states):
                    return True
        if check != "divergences":
            return False
        got = await asyncio.wait_for(c.request(DOC_TEXT, {"textDocument": {"uri": uri}}), self.timeout)
        if states is None:
            return got is not None
        return not isinstance(got, dict) or norm(got.get("text") or "") not in {t for t, _ in states}
