"""`dlm-lsp fuzz`: drive the real server over stdio with seeded valid and hostile input, and check it.

The server runs as a subprocess: `dlm-lsp serve`, or for a `scripted:...` model the real server with
the scripted engine (tests/lsp_fake_server.py). Each of --n steps draws one input class (`CLASSES`)
from a seeded generator and sends its messages; at the end of a step every request it sent must
have been answered. Checks (each failure is kept with the messages that led to it):
  exits        the process never exits unless told to (shutdown + exit -> 0, exit alone -> 1)
  unanswered   every request gets a response within --timeout seconds
  bad_ranges   every range in an inlineCompletion / completion answer lies inside the document
               (line in range, column <= the line's length, not inside a surrogate pair, start <= end)
               and contains the cursor
  divergences  the server's text and version (`dlm/documentText`, when it exists) equal the
               client's reference copy, sampled during edits and before each close
  protocol     what the spec fixes: ServerNotInitialized (-32002) before initialize, MethodNotFound
               (-32601) for unknown requests, InvalidRequest (-32600) after shutdown, a null
               documentText for documents not open, well-formed output
The reference copy applies LSP edit semantics (`RefText`): lines end at \\n, \\r\\n or \\r only (never at
\\v \\f \\x1c \\x1d \\x1e \\x85 \\u2028 \\u2029); columns count UTF-16 code units; a column past the
line's end clamps to it; a line past the last clamps to the document's end. Where the spec leaves the
outcome open (a negative or over-2^31 position, a column inside a surrogate pair, lone surrogates,
a reversed range, a wrong version, ill-typed params) an edit has a set of acceptable outcomes: the
fuzzer asks the server which one it took (`dlm/documentText`) and adopts it, or, without that
request, closes and reopens the document to know its state again.
Hostile framing is always followed by `fuzz/ping` requests that must be answered, so the fuzzer
knows the stream is in step again (where the framing may swallow the next message, the second one).
A failing document's messages are cut down to a minimal sequence that still fails (`shrink`: delta
debugging, replayed on a fresh server). Time this process spends stalled (building a 10 MB reference
text) does not count against an answer's limit. The server's tracebacks are counted by exception
in the report (`server_exceptions`), not as failures: an answer after an exception is an answer.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import itertools
import json
import operator
import random
import re
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dlm_lsp.measure.replay import LspClient, LspError

REPO = Path(__file__).resolve().parents[2]
UINT_MAX = 2**31 - 1  # LSP uinteger
LINE_END = re.compile(r"(\r\n|\r|\n)")
# every Unicode line break; only the first three end a line in LSP
LINE_BREAKS = ["\n", "\r", "\r\n", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
ASTRAL = ["\U0001F600", "\U0001D518", "\U00010348", "\U0001F4A5"]  # 2 UTF-16 units each
LONE = ["\ud800", "\udbff", "\udc00", "\udfff"]
BINARY = ["\x00", "\x01", "\x07", "\x08", "\x1b[31m", "\x7f", "\ufeff", "\ufffe", "\uffff", "\x00\x00\x00", "\t\x0b"]
DOC_TEXT = "dlm/documentText"
ANY_VERSION = "<any version>"  # an outcome whose version is not checked (the client sent a wrong one)
PING = "fuzz/ping"

# input class -> weight
CLASSES = {
    "valid_session": 20, "line_breaks": 8, "positions_out_of_range": 8, "surrogate_split": 5,
    "lone_surrogates": 4, "binary_content": 4, "big_documents": 2, "unknown_language": 3, "never_opened": 4,
    "reversed_ranges": 4, "wrong_versions": 4, "wrong_types": 6, "unknown_methods": 4, "bad_framing": 8,
    "nested_params": 3, "lifecycle": 1, "storm": 3, "cancel_random": 5,
}
CHECKS = ("exits", "unanswered", "bad_ranges", "divergences", "protocol")


# ----------------------------------------------------------------------------- reference edit model


def utf16_len(s: str) -> int:
    """Length of `s` in UTF-16 code units (a lone surrogate is one unit)."""
    return len(s) if s.isascii() else len(s) + sum(1 for ch in s if ord(ch) > 0xFFFF)


class RefText:
    """A text with LSP line structure: lines end at \\n, \\r\\n or \\r; columns in UTF-16 units."""

    def __init__(self, text: str):
        self.text = text
        # [line, line end, line, ..., line] at C speed: a 10 MB text is cut in a few ms, not seconds
        if "\r" not in text:
            lens = list(map(len, text.split("\n")))
            self.starts = list(itertools.accumulate((n + 1 for n in lens[:-1]), initial=0))
            self.ends = list(map(operator.add, self.starts, lens))  # per line: its first char, its line end
            return
        parts = LINE_END.split(text)
        at = list(itertools.accumulate(map(len, parts), initial=0))
        self.starts, self.ends = at[0:-1:2], at[1::2]

    def __len__(self) -> int:
        return len(self.starts)

    def line(self, i: int) -> str:
        return self.text[self.starts[i] : self.ends[i]]

    def offsets(self, line: int, character: int) -> list[int]:
        """The str offsets of a position with line, character >= 0: one, or two (before and after the
        pair) when the column falls inside a surrogate pair. Past the end clamps."""
        if line >= len(self.starts):
            return [len(self.text)]
        s, seg = self.starts[line], self.line(line)
        if seg.isascii():
            return [s + min(character, len(seg))]
        units = 0
        for i, ch in enumerate(seg):
            if units >= character:
                return [s + i]
            w = 2 if ord(ch) > 0xFFFF else 1
            if units + w > character:
                return [s + i, s + i + 1]
            units += w
        return [s + len(seg)]

    def position(self, offset: int) -> tuple[int, int]:
        """The (line, UTF-16 column) of a str offset that is not inside a line end."""
        line = bisect.bisect_right(self.starts, offset) - 1
        return line, utf16_len(self.text[self.starts[line] : offset])

    def is_valid(self, line, character) -> bool:
        """True for a position that names a place in the text exactly (no clamping, no split pair)."""
        if not (_is_int(line) and _is_int(character)) or line < 0 or character < 0 or line >= len(self.starts):
            return False
        seg, units = self.line(line), 0
        for ch in seg:
            if units == character:
                return True
            units += 2 if ord(ch) > 0xFFFF else 1
            if units > character:
                return False
        return units == character

    def random_offset(self, rng: random.Random) -> int:
        """A random offset at a code point boundary, never between \\r and \\n."""
        i = rng.randrange(len(self.starts))
        return self.starts[i] + rng.randint(0, self.ends[i] - self.starts[i])


def norm(s: str) -> str:
    """`s` as JSON carries it: adjacent lone surrogates that form a pair become one character."""
    if s.isascii():
        return s
    try:
        s.encode("utf-8")  # fails only on surrogates
        return s
    except UnicodeEncodeError:
        pass
    return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def resolve(ref: RefText, pos) -> tuple[list[int], bool]:
    """The offsets a wire position may mean, and whether the server may as well reject it.
    A negative coordinate clamps to 0 (or is rejected); one over 2^31-1 clamps or is rejected."""
    if not isinstance(pos, dict) or not (_is_int(pos.get("line")) and _is_int(pos.get("character"))):
        return [], True
    line, char = pos["line"], pos["character"]
    odd = line < 0 or char < 0 or line > UINT_MAX or char > UINT_MAX
    if line < 0:
        return [0], True
    return ref.offsets(line, max(0, char)), odd


def apply_change(text: str, change: dict, ref: RefText | None = None) -> list[str | None]:
    """Outcomes of one content change on `text` under LSP semantics; None = the change is rejected."""
    if not isinstance(change, dict) or not isinstance(change.get("text"), str):
        return [None]
    new = change["text"]
    if "range" not in change:
        return [new]
    rng = change["range"]
    if not isinstance(rng, dict):
        return [None]
    ref = ref if ref is not None and ref.text is text else RefText(text)
    starts, rej_a = resolve(ref, rng.get("start"))
    ends, rej_b = resolve(ref, rng.get("end"))
    out: list[str | None] = [None] if (rej_a or rej_b or len(starts) > 1 or len(ends) > 1) else []
    for a in starts:
        for b in ends:
            if b < a:  # a reversed range: swapped, or rejected
                out += [None, text[:b] + new + text[a:]]
            else:
                out.append(text[:a] + new + text[b:])
    return list(dict.fromkeys(out)) or [None]


def edit_outcomes(text: str, version, changes: list, sent_version, loose_version: bool = False,
                  ref: RefText | None = None):
    """(text, version) outcomes of a didChange; a rejected notification leaves both unchanged.
    A change whose outcome is open makes the whole notification's outcome open."""
    texts: list[str | None] = [text]
    for ch in changes:
        nxt = []
        for t in texts:
            nxt += [None] if t is None else apply_change(t, ch, ref)
        texts = list(dict.fromkeys(nxt))
    out = [(text, version)] if None in texts or loose_version else []
    for t in texts:
        if t is not None:
            t = norm(t)
            out.append((t, ANY_VERSION if loose_version else sent_version))
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------- answer checks


def _ranges(method: str, result) -> tuple[list, list, str | None]:
    """(ranges that must contain the cursor, other ranges, shape problem) of an answer."""
    if result is None:
        return [], [], None
    items = result.get("items") if isinstance(result, dict) else result
    if not isinstance(items, list):
        return [], [], f"answer is not a list or a list object: {_brief(result)}"
    cursor, other = [], []
    for it in items:
        if not isinstance(it, dict):
            return [], [], f"item is not an object: {_brief(it)}"
        if method.endswith("inlineCompletion"):
            if not isinstance(it.get("insertText"), (str, dict)):
                return [], [], f"item without insertText: {_brief(it)}"
            if "range" in it:
                cursor.append(it["range"])
        else:
            te = it.get("textEdit")
            if isinstance(te, dict):
                cursor += [te[k] for k in ("range", "insert", "replace") if k in te]
            other += [e.get("range") for e in it.get("additionalTextEdits") or [] if isinstance(e, dict)]
    return cursor, other, None


def check_answer(method: str, result, ref: RefText, cursor: list[int]) -> str | None:
    """None when every range of a completion answer lies inside `ref` and those of the fill contain
    one of the `cursor` offsets (all of them clamped already); else what is wrong."""
    cursor_rngs, other, problem = _ranges(method, result)
    if problem:
        return problem
    for rng in cursor_rngs + other:
        if not isinstance(rng, dict) or not isinstance(rng.get("start"), dict) or not isinstance(rng.get("end"), dict):
            return f"malformed range {_brief(rng)}"
        s, e = rng["start"], rng["end"]
        for p in (s, e):
            if not ref.is_valid(p.get("line"), p.get("character")):
                return f"range {_fmt(rng)} has a position outside the document ({len(ref)} lines) or inside a surrogate pair"
        a, b = ref.offsets(s["line"], s["character"])[0], ref.offsets(e["line"], e["character"])[0]
        if b < a:
            return f"reversed range {_fmt(rng)}"
        if rng in cursor_rngs and cursor and not any(a <= c <= b for c in cursor):
            cur = " or ".join("%d:%d" % ref.position(c) for c in cursor)
            return f"range {_fmt(rng)} does not contain the cursor {cur}"
    return None


def _fmt(rng: dict) -> str:
    s, e = rng["start"], rng["end"]
    return f"{s.get('line')}:{s.get('character')}-{e.get('line')}:{e.get('character')}"


def _brief(obj, most: int = 160):
    """A message for a report: long strings cut (their length kept), deep structures summarized."""
    def cut(o, depth=0):
        if depth > 12:
            return "<deep>"
        if isinstance(o, str):
            return o if len(o) <= most else o[: most // 2] + f"...<{len(o)} chars>"
        if isinstance(o, list):
            return [cut(x, depth + 1) for x in o[:20]] + ([f"<{len(o) - 20} more>"] if len(o) > 20 else [])
        if isinstance(o, dict):
            return {k: cut(v, depth + 1) for k, v in o.items()}
        if isinstance(o, bytes):
            return cut(o.decode("utf-8", "backslashreplace"), depth) if len(o) <= most else \
                o[: most // 2].decode("utf-8", "backslashreplace") + f"...<{len(o)} bytes>"
        return o
    return cut(obj)


# ----------------------------------------------------------------------------- the client


class FuzzClient(LspClient):
    """LspClient that sends raw bytes, survives malformed output (kept in `bad_output`) and keeps
    responses nobody waits for (`stray`)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.bad_output: list[str] = []
        self.stray: list[dict] = []
        self.gone = False

    def _write(self, msg) -> None:
        self.send_bytes(_frame(json.dumps(msg).encode("utf-8")))

    def send_bytes(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            self.gone = True

    async def drain(self) -> None:
        try:
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            self.gone = True

    async def _read_loop(self) -> None:
        out = self.proc.stdout
        try:
            while True:
                length = None
                while True:
                    line = await out.readline()
                    if not line:
                        return
                    line = line.strip()
                    if not line:
                        break
                    if line.lower().startswith(b"content-length:"):
                        try:
                            length = int(line.split(b":", 1)[1])
                        except ValueError:
                            self.bad_output.append(f"bad header {line[:80]!r}")
                    elif not line.lower().startswith(b"content-type:"):
                        self.bad_output.append(f"bad header {line[:80]!r}")
                if length is None:
                    self.bad_output.append("header block without Content-Length")
                    continue
                body = await out.readexactly(length)
                try:
                    msg = json.loads(body)
                except ValueError as e:
                    self.bad_output.append(f"body is not JSON ({e}): {body[:120]!r}")
                    continue
                for m in msg if isinstance(msg, list) else [msg]:
                    if isinstance(m, dict):
                        self._dispatch(m)
                    else:
                        self.bad_output.append(f"message is not an object: {_brief(m)}")
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return
        finally:
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("server exited"))

    def _dispatch(self, msg: dict) -> None:
        if "method" not in msg and msg.get("id") not in self.pending:
            self.stray.append(msg)
            return
        super()._dispatch(msg)

    def expect(self, msg_id) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # answers nobody awaits are fine
        self.pending[msg_id] = fut
        return fut


def _frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def server_command(model: str | None) -> list[str]:
    """The server for `model`: a `scripted:` model runs the real server with the scripted engine."""
    if model and model.startswith("scripted:"):
        fake = REPO / "tests" / "lsp_fake_server.py"
        if not fake.exists():
            raise SystemExit(f"{fake} is missing: a scripted model needs this checkout's tests/")
        return [sys.executable, str(fake)]
    return [sys.executable, "-m", "dlm_lsp", "serve"]


# ----------------------------------------------------------------------------- the fuzzer


@dataclass
class RefDoc:
    """The client's copy of one open document, and the messages sent for it since it was opened."""

    uri: str
    lang: str
    text: str
    version: int
    top: int  # highest version sent, so the next one is higher whatever the server kept
    trace: list = field(default_factory=list)  # brief messages: the didOpen and the last ones
    left_out: int = 0  # messages dropped from the middle of `trace`
    full: list | None = field(default_factory=list)  # every message whole (None: too big to keep)
    edits: int = 0
    history: list = field(default_factory=list)  # (edit number, text) of recent states
    _ref: RefText | None = None

    def set(self, text: str, version) -> None:
        self.text, self.version = text, version
        self.history.append((self.edits, text))
        del self.history[:-16]

    def since(self, edit_no: int) -> list[str]:
        """The texts this document had from edit `edit_no` on (the states a late answer may see)."""
        return [t for n, t in self.history if n > edit_no]

    @property
    def ref(self) -> RefText:
        if self._ref is None or self._ref.text is not self.text:
            self._ref = RefText(self.text)
        return self._ref


@dataclass
class Pending:
    msg_id: object
    fut: asyncio.Future
    sent: float
    cls: str
    check: object  # (result, error) -> (check name, problem) | None
    trace: list
    method: str
    doc: RefDoc | None = None
    n_full: int | None = None  # len(doc.full) when it was sent
    limit: float | None = None  # seconds it may take (None: the fuzzer's --timeout)


URIS = [f"file:///fuzz/src/m{i}.py" for i in range(12)] + [
    "file:///fuzz/src/app.js", "file:///fuzz/src/lib.rs", "file:///fuzz/src/main.go", "file:///fuzz/notes.txt",
    "untitled:Untitled-1", "file:///fuzz/d%C3%A9j%C3%A0/v.py", "file:///fuzz/with%20space.py", "file:///c%3A/fuzz/win.py",
]
LANGS = {".py": "python", ".js": "javascript", ".rs": "rust", ".go": "go", ".txt": "plaintext"}


def _lang(uri: str) -> str:
    return next((v for k, v in LANGS.items() if uri.endswith(k)), "python")


def load_corpus() -> str:
    """Code to type: the examples, the test sample and a few stdlib modules."""
    import textwrap as _tw

    parts = [p.read_text(encoding="utf-8") for p in sorted((REPO / "examples").glob("*.py"))]
    parts += [p.read_text(encoding="utf-8") for p in sorted((REPO / "tests" / "data").glob("*.py"))]
    for mod in (_tw, bisect, collections):
        try:
            parts.append(Path(mod.__file__).read_text(encoding="utf-8")[:20000])
        except (OSError, TypeError):
            pass
    return "\n".join(parts) or "def f(x):\n    return x + 1\n"


class Fuzzer:
    def __init__(self, n: int, seed: int, model: str | None = None, timeout: float = 5.0,
                 max_doc_bytes: int = 10_000_000, options: dict | None = None, classes: list[str] | None = None,
                 server_cmd: list[str] | None = None, log_path: str | None = None, keep: int = 5,
                 shrink: bool = False):
        self.n, self.seed, self.model, self.timeout = n, seed, model, timeout
        self.max_doc_bytes = max_doc_bytes
        self.options = dict(options or {})
        if model:
            self.options["model"] = model
        self.cmd = server_cmd or server_command(model)
        self.log_path, self.keep, self.shrink = log_path, keep, shrink
        self.rng = random.Random(seed)
        self.classes = {c: w for c, w in CLASSES.items() if not classes or c in classes}
        self.corpus = load_corpus()
        self.client: FuzzClient | None = None
        self.log = None
        self.docs: dict[str, RefDoc] = {}
        self.outstanding: list[Pending] = []
        self.trace: collections.deque = collections.deque(maxlen=30)
        self.counts = {c: {"steps": 0, "messages": 0, "requests": 0, "failures": 0} for c in self.classes}
        self.failed = {c: 0 for c in CHECKS}
        self.failures: list[dict] = []
        self.doc_text: bool | None = None  # does the server answer dlm/documentText
        self.cls, self.step = "startup", -1
        self.launches = 0
        self.expect_exit = False
        self.ids = 0
        self.answered = 0
        self.error_codes: collections.Counter = collections.Counter()
        self.decks: dict[str, list] = {}
        self.stalls: list[tuple[float, float]] = []
        self.last_tick = time.monotonic()
        self.ranges_checked = 0  # fill ranges the answers carried
        self.stray = 0  # responses nobody waited for (parse errors with id null, late answers, batches)

    # ---------------------------------------------------------------- bookkeeping

    def fail(self, check: str, detail: str, trace=None, doc: RefDoc | None = None, n_full: int | None = None) -> None:
        """Counts a failure; the first few keep their messages (for a document: since its didOpen)."""
        self.failed[check] += 1
        if self.cls in self.counts:
            self.counts[self.cls]["failures"] += 1
        if sum(1 for f in self.failures if f["check"] == check) < self.keep:
            msgs = list(trace if trace is not None else doc.trace if doc is not None else self.trace)
            if doc is not None and doc.left_out and msgs and trace is None:
                msgs[1:1] = [{"left_out": f"{doc.left_out} messages"}]
            f = {"check": check, "class": self.cls, "step": self.step, "detail": detail, "messages": msgs}
            if doc is not None and doc.full is not None:
                f["_full"] = doc.full[: n_full if n_full is not None else len(doc.full)]
            self.failures.append(f)

    def _count(self, request: bool = False) -> None:
        if self.cls in self.counts:
            self.counts[self.cls]["messages"] += 1
            self.counts[self.cls]["requests"] += int(request)

    def _traced(self, entry, doc: RefDoc | None, msg: dict | None = None) -> None:
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

    def deal(self, deck: str, cards: list):
        """The next of `cards` from a shuffled deck: every card comes once before any comes again."""
        left = self.decks.get(deck)
        if not left:
            left = self.decks[deck] = self.rng.sample(cards, len(cards))
        return left.pop()

    def next_id(self) -> int:
        self.ids += 1
        return self.ids

    def notify(self, method: str, params, doc: RefDoc | None = None) -> None:
        msg = {"jsonrpc": "2.0", "method": method, "params": params}
        self._traced(_brief(msg), doc, msg)
        self._count()
        self.client._write(msg)

    def request(self, method: str, params, check=None, doc: RefDoc | None = None, msg_id=None) -> Pending:
        """Sends a request; its answer is awaited and checked by `settle`."""
        msg_id = self.next_id() if msg_id is None else msg_id
        msg = {"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}
        self._traced(_brief(msg), doc, msg)
        self._count(True)
        fut = self.client.expect(msg_id)
        self.client._write(msg)
        p = Pending(msg_id, fut, time.monotonic(), self.cls, check, list(doc.trace if doc else self.trace), method,
                    doc, len(doc.full) if doc is not None and doc.full is not None else None)
        self.outstanding.append(p)
        return p

    def raw(self, data: bytes, note: str) -> None:
        self._traced({"raw": _brief(data), "note": note}, None)
        self._count()
        self.client.send_bytes(data)

    def ping(self, check=None) -> Pending:
        return self.request(PING, {})

    async def settle(self, *only: Pending) -> None:
        """Waits for the answers to the requests sent so far (or `only` these) and checks them."""
        todo = list(only) if only else list(self.outstanding)
        await self.client.drain()
        late = False
        for p in todo:
            # the time this process itself was too busy to read answers does not count against the server
            left = p.sent + (p.limit or self.timeout) + self.stalled_since(p.sent) - time.monotonic()
            try:
                result, err = await asyncio.wait_for(asyncio.shield(p.fut), max(0.0, left)), None
            except asyncio.TimeoutError:
                self.client.pending.pop(p.msg_id, None)
                if self.alive():
                    self.fail("unanswered", f"{p.method} id {p.msg_id!r} not answered within {self.timeout:g} s", p.trace)
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
            except (asyncio.TimeoutError, LspError, ConnectionError):
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
        return self.client is not None and self.client.proc.returncode is None and not self.client.gone

    # ---------------------------------------------------------------- server lifetime

    async def launch(self) -> None:
        """Starts the server; checks a request before initialize, then initializes."""
        self.launches += 1
        if self.log is None:  # the server's stderr, read back for its tracebacks
            self.log = open(self.log_path, "w+b") if self.log_path else tempfile.TemporaryFile()
        self.client = FuzzClient(self.cmd, cwd=str(REPO), stderr=self.log)
        await self.client.start()
        self.docs.clear()
        self.outstanding.clear()
        self.trace.clear()
        cls, self.cls = self.cls, "lifecycle"
        early = "file:///fuzz/before-init.py"
        self.notify("textDocument/didOpen", {"textDocument": {"uri": early, "languageId": "python", "version": 1, "text": "x"}})
        p = self.request("textDocument/inlineCompletion", _inline_params(early, 0, 1),
                         check=_expect_code(-32002, "before initialize"))
        p.limit = max(60.0, self.timeout)  # the process is still starting (imports take seconds on a busy machine)
        await self.settle()
        init = self.request("initialize", {"processId": None, "rootUri": None, "initializationOptions": self.options,
                                           "capabilities": {"general": {"positionEncodings": ["utf-16"]},
                                                            "textDocument": {"inlineCompletion": {}}}})
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
            except (asyncio.TimeoutError, ConnectionError):
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
        ours = lambda i: i is None or (_is_int(i) and 0 < i <= self.ids) or (isinstance(i, str) and i.startswith(("batch-", "nj-")))
        odd = [m for m in c.stray if not ours(m.get("id"))]
        if odd:
            self.fail("protocol", f"{len(odd)} responses to no request sent, e.g. {_brief(odd[:2])}")
        self.stray += len(c.stray)
        c.bad_output, c.stray = [], []

    async def kill(self) -> None:
        self.check_output()
        if self.client is not None and self.client.proc.returncode is None:
            self.client.proc.kill()
            await self.client.proc.wait()
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
            self.request("textDocument/inlineCompletion", _inline_params(URIS[0], 0, 0),
                         check=_expect_code(-32600, "after shutdown"))
            await self.settle()
        self.notify("exit", None)
        await self.client.drain()
        want = 0 if shutdown else 1
        try:
            code = await asyncio.wait_for(self.client.proc.wait(), self.timeout)
            if code != want:
                self.fail("protocol", f"exit {'after' if shutdown else 'without'} shutdown: exit code {code}, want {want}")
        except asyncio.TimeoutError:
            self.fail("protocol", f"no exit within {self.timeout:g} s of the exit notification")
            await self.kill()
        self.expect_exit = False

    # ---------------------------------------------------------------- documents

    def free_uri(self) -> str | None:
        free = [u for u in URIS if u not in self.docs]
        return self.rng.choice(free) if free else None

    def snippet(self, most: int = 400) -> str:
        a = self.rng.randrange(len(self.corpus))
        a = self.corpus.rfind("\n", 0, a) + 1
        return self.corpus[a : a + self.rng.randint(0, most)]

    def open(self, uri: str, text: str, lang: str | None = None, version: int = 1) -> RefDoc:
        text = norm(text)
        doc = RefDoc(uri, lang if lang is not None else _lang(uri), text, version, version)
        doc.history.append((0, text))
        self.docs[uri] = doc
        self.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": doc.lang, "version": version,
                                                              "text": text}}, doc)
        return doc

    def any_doc(self) -> RefDoc:
        """An open document (opening one when none is)."""
        if self.docs and self.rng.random() < 0.8:
            return self.docs[self.rng.choice(sorted(self.docs))]
        uri = self.free_uri() or self.rng.choice(sorted(self.docs))
        if uri in self.docs:
            return self.docs[uri]
        return self.open(uri, self.snippet())

    async def change(self, doc: RefDoc, changes: list, version=None, loose_version: bool = False) -> None:
        """Sends a didChange; a single outcome becomes the reference, several are resolved at once."""
        if version is None:
            version = doc.top + 1
        if _is_int(version):
            doc.top = max(doc.top, version)
        outcomes = edit_outcomes(doc.text, doc.version, changes, version, loose_version, doc.ref)
        self.notify("textDocument/didChange", {"textDocument": {"uri": doc.uri, "version": version},
                                               "contentChanges": changes}, doc)
        doc.edits += 1
        if len(outcomes) == 1:
            doc.set(*outcomes[0])
            if doc.edits % 4 == 0 and self.rng.random() < 0.5:
                await self.sync(doc)
        else:
            await self.sync(doc, outcomes)

    async def sync(self, doc: RefDoc, outcomes=None) -> None:
        """Compares the server's copy with the reference (adopting one of `outcomes` when the edit's
        outcome was open); without dlm/documentText an open outcome reopens the document."""
        outcomes = outcomes or [(doc.text, doc.version)]
        if not self.doc_text:
            if len(outcomes) > 1:
                self.reopen(doc, outcomes[0][0])
            return
        p = self.request(DOC_TEXT, {"textDocument": {"uri": doc.uri}}, doc=doc)
        await self.settle(p)
        if not p.fut.done() or p.fut.exception() is not None:
            if p.fut.done() and not isinstance(p.fut.exception(), ConnectionError):
                self.fail("divergences", f"documentText failed: {p.fut.exception()}", doc.trace)
            return
        got = p.fut.result()
        if isinstance(got, dict) and isinstance(got.get("text"), str):
            got["text"] = norm(got["text"])
        if not isinstance(got, dict) or not any(got.get("text") == t and v in (got.get("version"), ANY_VERSION)
                                                for t, v in outcomes):
            want = " or ".join(f"version {v} text {_brief(t)!r}" for t, v in outcomes[:4])
            have = f"version {got.get('version')} text {_brief(got.get('text'))!r}" if isinstance(got, dict) else repr(got)
            self.fail("divergences", f"{doc.uri}: server has {have}; client has {want}{_first_diff(got, outcomes[0][0])}",
                      doc=doc)
            if isinstance(got, dict) and isinstance(got.get("text"), str) and _is_int(got.get("version")):
                doc.set(got["text"], got["version"])  # go on from the server's state
            else:
                self.reopen(doc, outcomes[0][0])
            return
        doc.set(got["text"], got["version"])

    def reopen(self, doc: RefDoc, text: str) -> None:
        """Closes and reopens `doc` with `text`: a known state again, in the same RefDoc."""
        self.notify("textDocument/didClose", {"textDocument": {"uri": doc.uri}}, doc)
        doc.top += 1
        doc.edits += 1
        doc.set(norm(text), doc.top)
        self.notify("textDocument/didOpen", {"textDocument": {"uri": doc.uri, "languageId": doc.lang,
                                                              "version": doc.top, "text": doc.text}}, doc)
        self.docs[doc.uri] = doc

    def close(self, doc: RefDoc, check: bool = True) -> None:
        self.notify("textDocument/didClose", {"textDocument": {"uri": doc.uri}}, doc)
        self.docs.pop(doc.uri, None)
        if check and self.doc_text:
            self.request(DOC_TEXT, {"textDocument": {"uri": doc.uri}}, doc=doc,
                         check=lambda r, e: ("protocol", f"documentText of a closed document: {_brief(r)}") if r is not None else None)

    async def close_checked(self, doc: RefDoc) -> None:
        await self.sync(doc)
        if doc.uri in self.docs:
            self.close(doc)

    def complete(self, doc: RefDoc, line, char, method: str = "textDocument/inlineCompletion", params=None) -> Pending:
        """Requests a fill at (line, char); its ranges are checked against the text as it is now."""
        ref, sent_at = doc.ref, doc.edits
        pos = {"line": line, "character": char}

        def check(result, err):
            if err is not None:
                return None
            self.ranges_checked += len(_ranges(method, result)[0])
            problem = check_answer(method, result, ref, resolve(ref, pos)[0])
            if problem is None:
                return None
            # the server may have read the document a few messages later (its handlers start after
            # the messages already buffered): a range valid in one of those states is not flagged
            for text in doc.since(sent_at):
                later = RefText(text)
                if check_answer(method, result, later, resolve(later, pos)[0]) is None:
                    return None
            return "bad_ranges", f"{method} at {line}:{char} of {doc.uri}: {problem}"

        return self.request(method, params or _inline_params(doc.uri, line, char), check=check, doc=doc)

    def at_cursor(self, doc: RefDoc, offset: int, method: str = "textDocument/inlineCompletion") -> Pending:
        line, char = doc.ref.position(offset)
        return self.complete(doc, line, char, method)

    def insert_change(self, doc: RefDoc, offset: int, text: str) -> dict:
        line, char = doc.ref.position(self._boundary(doc, offset))
        return {"range": {"start": {"line": line, "character": char}, "end": {"line": line, "character": char}}, "text": text}

    def range_change(self, doc: RefDoc, a: int, b: int, text: str) -> dict:
        (la, ca), (lb, cb) = doc.ref.position(self._boundary(doc, a)), doc.ref.position(self._boundary(doc, b))
        return {"range": {"start": {"line": la, "character": ca}, "end": {"line": lb, "character": cb}}, "text": text}

    async def type_text(self, doc: RefDoc, offset: int, text: str, ask: float = 0.7) -> int:
        """Types `text` at `offset` one piece at a time, asking for a fill after most keystrokes."""
        i = 0
        while i < len(text):
            k = self.rng.choice((1, 1, 1, 2, 3))
            piece = text[i : i + k]
            offset = self._boundary(doc, offset)
            await self.change(doc, [self.insert_change(doc, offset, piece)])
            offset += len(piece)
            i += k
            if self.rng.random() < ask:
                self.at_cursor(doc, offset, "textDocument/completion" if self.rng.random() < 0.15 else
                               "textDocument/inlineCompletion")
        return offset

    # ---------------------------------------------------------------- input classes

    async def valid_session(self) -> None:
        doc = self.any_doc()
        for _ in range(self.rng.randint(1, 6)):
            r = self.rng.random()
            off = doc.ref.random_offset(self.rng)
            if r < 0.5:
                await self.type_text(doc, off, self.snippet(12))
            elif r < 0.7:
                b = min(len(doc.text), off + self.rng.randint(0, 40))
                b = doc.ref.random_offset(self.rng) if self.rng.random() < 0.2 else b
                a, b = min(off, b), max(off, b)
                b = self._boundary(doc, b)
                await self.change(doc, [self.range_change(doc, a, b, self.snippet(30))])
                self.at_cursor(doc, a)
            elif r < 0.8:  # several changes in one notification, each on the text the previous left
                changes, text = [], doc.text
                for _ in range(self.rng.randint(2, 4)):
                    ref = RefText(text)
                    o = ref.random_offset(self.rng)
                    line, char = ref.position(o)
                    ch = {"range": {"start": {"line": line, "character": char}, "end": {"line": line, "character": char}},
                          "text": self.snippet(8)}
                    changes.append(ch)
                    text = apply_change(text, ch)[0]
                await self.change(doc, changes)
            elif r < 0.85:
                await self.change(doc, [{"text": self.snippet(300)}])
            else:
                self.at_cursor(doc, off, self.rng.choice(("textDocument/inlineCompletion", "textDocument/completion")))
        if self.rng.random() < 0.25:
            await self.close_checked(doc)

    def _boundary(self, doc: RefDoc, b: int) -> int:
        """`b` moved off the middle of a \\r\\n (no position names that place)."""
        return b + 1 if 0 < b < len(doc.text) and doc.text[b - 1] == "\r" and doc.text[b] == "\n" else b

    async def line_breaks(self) -> None:
        doc = self.any_doc()
        for _ in range(self.rng.randint(1, 4)):
            brk = self.rng.choice(LINE_BREAKS)
            off = doc.ref.random_offset(self.rng)
            await self.change(doc, [self.insert_change(doc, off, "a" + brk + "b" + self.rng.choice(LINE_BREAKS) + "c")])
            # edit and ask on the lines after the break: a server splitting lines differently is off here
            ref = doc.ref
            line = min(len(ref) - 1, ref.position(off)[0] + self.rng.randint(1, 3))
            char = self.rng.randint(0, utf16_len(ref.line(line)) + 2)
            await self.change(doc, [{"range": {"start": {"line": line, "character": char},
                                               "end": {"line": line, "character": char}}, "text": "Z"}])
            self.complete(doc, line, min(char, utf16_len(doc.ref.line(line))))
        if self.rng.random() < 0.3:  # a document made of every break
            uri = self.free_uri()
            if uri:
                text = "".join(f"l{i}{b}" for i, b in enumerate(self.rng.sample(LINE_BREAKS, len(LINE_BREAKS))))
                d = self.open(uri, text)
                for line in range(0, len(d.ref) + 1, 2):
                    self.complete(d, line, 1)
                await self.change(d, [{"range": {"start": {"line": len(d.ref) - 1, "character": 0},
                                                 "end": {"line": len(d.ref) - 1, "character": 1}}, "text": "!"}])
        await self.sync(doc)

    async def positions_out_of_range(self) -> None:
        doc = self.any_doc()
        ref = doc.ref
        line = self.rng.randrange(len(ref))
        llen = utf16_len(ref.line(line))
        picks = [(line, llen + self.rng.randint(1, 50)), (len(ref) + self.rng.randint(0, 5), 0),
                 (len(ref) + 3, 7), (UINT_MAX, UINT_MAX), (line, UINT_MAX), (-1, 0), (0, -1), (-5, -5),
                 (2**40, 0), (line, 2**53), (10**30, 10**30)]
        for _ in range(self.rng.randint(1, 4)):
            l, c = self.rng.choice(picks)
            self.complete(doc, l, c, self.rng.choice(("textDocument/inlineCompletion", "textDocument/completion")))
        l, c = self.rng.choice(picks)
        l2, c2 = self.rng.choice(picks + [(line, 0)])
        await self.change(doc, [{"range": {"start": {"line": l, "character": c}, "end": {"line": l2, "character": c2}},
                                 "text": self.rng.choice(("", "X", "\n", "end\r\n"))}])
        await self.sync(doc)

    async def surrogate_split(self) -> None:
        doc = self.any_doc()
        off = doc.ref.random_offset(self.rng)
        emoji = "".join(self.rng.choice(ASTRAL) for _ in range(self.rng.randint(1, 3)))
        await self.change(doc, [self.insert_change(doc, off, f"s = '{emoji}x{self.rng.choice(ASTRAL)}'")])
        line, char = doc.ref.position(off + 5)  # just before the first astral character
        mid = char + 1
        for _ in range(self.rng.randint(1, 3)):
            self.complete(doc, line, mid, self.rng.choice(("textDocument/inlineCompletion", "textDocument/completion")))
        r = self.rng.random()
        if r < 0.4:
            await self.change(doc, [{"range": {"start": {"line": line, "character": mid},
                                               "end": {"line": line, "character": mid}}, "text": "|"}])
        elif r < 0.8:
            await self.change(doc, [{"range": {"start": {"line": line, "character": mid},
                                               "end": {"line": line, "character": mid + 2}}, "text": ""}])
        await self.sync(doc)

    async def lone_surrogates(self) -> None:
        bad = "".join(self.rng.choice(LONE + ["a", "b"]) for _ in range(self.rng.randint(1, 5)))
        doc = self.any_doc()
        off = doc.ref.random_offset(self.rng)
        change = self.insert_change(doc, off, bad)
        fixed = dict(change, text="".join("\ufffd" if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in bad))
        outcomes = edit_outcomes(doc.text, doc.version, [change], doc.top + 1)
        outcomes += edit_outcomes(doc.text, doc.version, [fixed], doc.top + 1)
        doc.top += 1
        self.notify("textDocument/didChange", {"textDocument": {"uri": doc.uri, "version": doc.top},
                                               "contentChanges": [change]}, doc)
        self.complete(doc, *doc.ref.position(off))
        await self.sync(doc, list(dict.fromkeys(outcomes + [(doc.text, doc.version)])))
        if self.rng.random() < 0.3 and doc.uri in self.docs:
            await self.close_checked(doc)

    async def binary_content(self) -> None:
        doc = self.any_doc()
        junk = "".join(self.rng.choice(BINARY) for _ in range(self.rng.randint(1, 6)))
        await self.type_text(doc, doc.ref.random_offset(self.rng), junk, ask=0.5)
        if self.rng.random() < 0.3:
            uri = self.free_uri()
            if uri:
                d = self.open(uri, junk * 20 + "\x00\n\x00")
                self.complete(d, 1, 1)
                await self.sync(d)
        await self.sync(doc)

    async def big_documents(self) -> None:
        uri = self.free_uri() or self.rng.choice(sorted(self.docs))
        if uri in self.docs:
            self.close(self.docs[uri])
        size = self.max_doc_bytes
        if self.rng.random() < 0.5:
            text = (self.corpus * (size // max(1, len(self.corpus)) + 1))[:size]
        else:  # one line
            text = ("x = [" + "1, " * (size // 3))[:size]
        doc = self.open(uri, text)
        ref = doc.ref
        last = len(ref) - 1
        self.complete(doc, last, utf16_len(ref.line(last)))
        self.complete(doc, last // 2, 3)
        await self.change(doc, [self.insert_change(doc, len(doc.text) // 2, "y = 1\n")])
        await self.change(doc, [self.insert_change(doc, len(doc.text), "\nz = ")])
        self.complete(doc, len(doc.ref) - 1, 4)
        await self.close_checked(doc)

    async def unknown_language(self) -> None:
        uri = self.free_uri()
        if uri is None:
            return await self.valid_session()
        lang = self.rng.choice(["cobol", "", "Python", "x" * 300, "\U0001F4A5", "plaintext", "c++", "PYTHON"])
        doc = self.open(uri, self.snippet(200), lang)
        await self.type_text(doc, doc.ref.random_offset(self.rng), self.snippet(6))
        await self.close_checked(doc)

    async def never_opened(self) -> None:
        uri = f"file:///fuzz/never/n{self.rng.randrange(1000)}.py"
        r = self.rng.random()
        pos = {"line": 0, "character": 0}
        if r < 0.3:
            self.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": 2},
                                                   "contentChanges": [{"range": {"start": pos, "end": pos}, "text": "x"}]})
        elif r < 0.5:
            self.notify("textDocument/didClose", {"textDocument": {"uri": uri}})
        self.request(self.rng.choice(("textDocument/inlineCompletion", "textDocument/completion")),
                     _inline_params(uri, self.rng.randint(0, 3), self.rng.randint(0, 3)), check=_no_items(uri))
        if self.doc_text:
            self.request(DOC_TEXT, {"textDocument": {"uri": uri}},
                         check=lambda res, e: ("protocol", f"documentText of a never-opened document: {_brief(res)}")
                         if res is not None or e is not None else None)

    async def reversed_ranges(self) -> None:
        doc = self.any_doc()
        a, b = sorted((doc.ref.random_offset(self.rng), doc.ref.random_offset(self.rng)))
        b = self._boundary(doc, b)
        ch = self.range_change(doc, a, b, self.rng.choice(("", "R", "rev\n")))
        ch["range"] = {"start": ch["range"]["end"], "end": ch["range"]["start"]}
        await self.change(doc, [ch])

    async def wrong_versions(self) -> None:
        doc = self.any_doc()
        v = self.rng.choice([doc.version, doc.version - 1, 0, -1, -(2**31), 2**53, 3.5, "7", None])
        await self.change(doc, [self.insert_change(doc, doc.ref.random_offset(self.rng), "v")], version=v,
                          loose_version=True)
        if doc.uri in self.docs:
            await self.close_checked(doc)  # a doc at a version of 2**53 takes no further edits

    async def wrong_types(self) -> None:
        doc = self.any_doc()
        u = doc.uri
        reqs = [
            ("textDocument/inlineCompletion", []), ("textDocument/inlineCompletion", None),
            ("textDocument/inlineCompletion", {"textDocument": 5, "position": {"line": 0, "character": 0}}),
            ("textDocument/inlineCompletion", {"textDocument": {"uri": u}, "position": {"line": "1", "character": 0},
                                               "context": {"triggerKind": 2}}),
            ("textDocument/inlineCompletion", {"textDocument": {"uri": u}, "position": {"line": 1.5, "character": 0},
                                               "context": {"triggerKind": 2}}),
            ("textDocument/inlineCompletion", {"textDocument": {"uri": None}, "position": {"line": 0, "character": 0}}),
            ("textDocument/inlineCompletion", {"textDocument": {"uri": u}, "context": {"triggerKind": 2}}),
            ("textDocument/inlineCompletion", {"textDocument": {"uri": u}, "position": {"line": 0, "character": 0},
                                               "context": {"triggerKind": "x"}}),
            ("textDocument/completion", {"textDocument": {"uri": u}, "position": [1, 2]}),
            ("textDocument/completion", "params"), (DOC_TEXT, {"textDocument": "x"}), (DOC_TEXT, [u]),
            ("dlm/stats", [1, 2]),
        ]
        for _ in range(self.rng.randint(1, 3)):
            self.request(*self.rng.choice(reqs))
        r = self.rng.random()
        if r < 0.3:
            bad = self.deal("bad changes", [{}, {"x": 1}, 5, "text", [None], [{"text": None}], [{"text": 5}],
                                            [{"text": True}], [{"text": ["a"]}], [{"range": {"start": 5}, "text": "q"}],
                                            [{"range": None, "text": 3}], [{"text": "ok"}, {"text": None}]])
            self.notify("textDocument/didChange", {"textDocument": {"uri": u, "version": doc.top + 1}, "contentChanges": bad}, doc)
            doc.top += 1
            await self.sync(doc, [(doc.text, doc.version), (doc.text, doc.top)])
        elif r < 0.5:
            uri = f"file:///fuzz/bad/{self.rng.randrange(99)}.py"
            td = self.deal("bad opens", [{"languageId": None, "version": "1", "text": 5}, {"text": None},
                                         {"text": 5}, {"version": None}, {"languageId": 7}, {"text": ["x"]}])
            self.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1,
                                                                  "text": "x", **td}})
            if self.doc_text:  # an ill-typed didOpen opens nothing
                self.request(DOC_TEXT, {"textDocument": {"uri": uri}},
                             check=lambda res, e, td=td: ("divergences", f"didOpen with {td} opened {_brief(res)}")
                             if res is not None else None)
            self.notify("textDocument/didClose", {"textDocument": {"uri": uri}})
        elif r < 0.6:
            self.notify("textDocument/didClose", self.rng.choice([{}, {"textDocument": []}, None]))
        elif r < 0.7:
            await self.change(doc, [], version=doc.top + 1)  # empty but well-typed: only the version moves
        self.ping()

    async def unknown_methods(self) -> None:
        for _ in range(self.rng.randint(1, 3)):
            m = self.rng.choice(["fuzz/nothing", "$/fuzz", "textDocument/fuzz", "", "\U0001F4A5", "workspace/executeCommand2"])
            self.request(m, self.rng.choice([{}, None, [1], {"a": {"b": []}}]), check=_expect_code(-32601, f"method {m!r}"))
        if self.rng.random() < 0.5:
            self.notify(self.rng.choice(["fuzz/note", "$/fuzzNote", "$/setTrace2", "textDocument/didFuzz"]), {"x": 1})
        if self.rng.random() < 0.3:  # a method name that is not a string: Invalid Request, answered
            msg_id = self.next_id()
            self.raw(_frame(json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": 123, "params": {}}).encode()),
                     "method is a number")  # the ping after it must be answered
        self.ping()

    async def bad_framing(self) -> None:
        ok = json.dumps({"jsonrpc": "2.0", "id": 0, "method": PING, "params": {}}).encode()
        kinds = {  # kind -> (bytes, whether the ping right after must be answered)
            "invalid_json": (_frame(b'{"jsonrpc": "2.0", "id": 9, "method": '), True),
            "invalid_utf8": (_frame(b'{"jsonrpc": "2.0", "method": "\xff\xfe\xc0"}'), True),
            "non_object": (_frame(self.rng.choice([b"42", b'"hello"', b"null", b"true", b"[]", b"{}", b"[1, 2]"])), True),
            "batch": (_frame(b"[" + json.dumps({"jsonrpc": "2.0", "id": "batch-%d" % self.step, "method": PING}).encode()
                             + b', {"jsonrpc": "2.0", "method": "fuzz/note"}]'), True),
            "no_jsonrpc": (_frame(b'{"id": "nj-%d", "method": "fuzz/ping"}' % self.step), True),
            "long_content_length": (b"Content-Length: %d\r\n\r\n" % (len(ok) + 7) + ok + b"#######", True),
            "unknown_header": (b"X-Fuzz: 1\r\n" + _frame(b'{"jsonrpc": "2.0", "method": "fuzz/note"}'), True),
            "content_type": (b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\n"
                             + _frame(b'{"jsonrpc": "2.0", "method": "fuzz/note"}'), True),
            "bad_content_length": (b"Content-Length: abc\r\n\r\n", False),
            "negative_content_length": (b"Content-Length: -12\r\n\r\n", False),
            "huge_content_length": (b"Content-Length: 99999999999999\r\n\r\n", False),
            "no_content_length": (b"Content-Type: text/plain\r\n\r\n", False),
            "garbage_line": (self.rng.choice([b"hello world\r\n\r\n", b"\r\n", b"GET / HTTP/1.1\r\n\r\n",
                                              b"\x00\x01\x02\r\n\r\n"]), False),
            "deep_json": (_frame(b"[" * 100_000 + b"]" * 100_000), True),
        }
        kind = self.deal("framing", sorted(kinds))
        data, strict = kinds[kind]
        self.raw(data, kind)
        if self.rng.random() < 0.3:  # and a request written in pieces, with pauses
            msg_id = self.next_id()
            body = _frame(json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": PING}).encode())
            fut = self.client.expect(msg_id)
            for i in range(0, len(body), 7):
                self.raw(body[i : i + 7], "split write")
                await self.client.drain()
                await asyncio.sleep(0.002)
            self.outstanding.append(Pending(msg_id, fut, time.monotonic(), self.cls, None, list(self.trace), PING))
        a = self.ping()
        b = self.ping()
        if not strict:  # the garbage may swallow the next message; the one after must be answered
            await self.settle(b)
            if a in self.outstanding:
                self.outstanding.remove(a)
                self.client.pending.pop(a.msg_id, None)

    async def nested_params(self) -> None:
        doc = self.any_doc()
        off = doc.ref.random_offset(self.rng)
        line, char = doc.ref.position(off)
        params = _inline_params(doc.uri, line, char)
        params["textDocument"]["method"] = "exit"
        params["params"] = {"jsonrpc": "2.0", "id": 1, "method": "shutdown", "params": {"method": "exit"}}
        params["context"]["jsonrpc"] = "2.0"
        r = self.rng.random()
        if r < 0.4:
            self.complete(doc, line, char, params=params)
        elif r < 0.7:
            depth = self.rng.choice((50, 500, 5000))
            self.raw(_frame(b'{"jsonrpc": "2.0", "method": "workspace/didChangeConfiguration", "params": {"settings": '
                            + b'{"method": "exit", "dlm": ' * depth + b'{"budgetMs": "x"}' + b"}" * depth + b"}}"),
                     f"settings nested {depth} deep")
        else:
            msg_id = self.next_id()
            depth = self.rng.choice((1000, 100_000))
            body = b'{"jsonrpc": "2.0", "id": %d, "method": "textDocument/inlineCompletion", "params": ' % msg_id \
                + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
            self.raw(_frame(body), f"params nested {depth} deep")  # may be a parse error: answered with id null
        self.ping()

    async def lifecycle(self) -> None:
        r = self.rng.random()
        if r < 0.6 or self.launches > max(2, self.n // 200):
            self.request("initialize", {"processId": None, "rootUri": None, "capabilities": {}})
            self.notify("initialized", {})
            self.ping()
            return
        await self.settle()
        await self.stop(shutdown=r < 0.85)
        self.check_output()
        await self.launch()

    async def storm(self) -> None:
        for _ in range(self.rng.randint(30, 100)):
            r = self.rng.random()
            uri = self.rng.choice(URIS)
            doc = self.docs.get(uri)
            if doc is None:
                self.open(uri, self.snippet(300))
            elif r < 0.1:
                self.close(doc, check=False)  # its documentText might run after a later reopen
            elif r < 0.6:
                off = doc.ref.random_offset(self.rng)
                await self.change(doc, [self.insert_change(doc, off, self.snippet(3) or "q")])
                if self.rng.random() < 0.5:
                    self.at_cursor(doc, off)
            else:
                self.at_cursor(doc, doc.ref.random_offset(self.rng))
        await self.settle()
        for doc in list(self.docs.values()):
            await self.sync(doc)

    async def cancel_random(self) -> None:
        for _ in range(self.rng.randint(1, 4)):
            r = self.rng.random()
            if r < 0.4 and self.docs:
                doc = self.any_doc()
                p = self.at_cursor(doc, doc.ref.random_offset(self.rng))
                if self.rng.random() < 0.5:
                    await asyncio.sleep(self.rng.choice((0, 0.001, 0.02)))
                self.notify("$/cancelRequest", {"id": p.msg_id})
            else:
                self.notify("$/cancelRequest", self.rng.choice([
                    {"id": self.rng.randint(-5, self.ids + 100)}, {"id": str(self.rng.randrange(99))}, {"id": None},
                    {"id": {"nested": 1}}, {}, None, {"id": 2**63}]))
        self.ping()

    # ---------------------------------------------------------------- shrinking

    async def shrink_failures(self, budget_s: float = 60.0) -> None:
        """Cuts the messages of each kept divergence / bad range down to a minimal sequence that still
        fails (delta debugging on one fresh server, each try on a document of its own)."""
        todo = [f for f in self.failures if f.get("_full") and f["check"] in ("divergences", "bad_ranges")
                and (f["_full"][0] or {}).get("method") == "textDocument/didOpen"]
        if not todo:
            return
        self.client = FuzzClient(self.cmd, cwd=str(REPO), stderr=self.log)
        await self.client.start()
        try:
            await self.client.initialize(self.options)
            await self.client.wait_ready(max(60.0, self.timeout))
            for f in todo:
                got = await self._ddmin(f["_full"], f["check"], time.monotonic() + budget_s)
                f["minimal"] = [_brief(m) for m in got] if got is not None else "does not fail on its own"
        except (ConnectionError, TimeoutError, RuntimeError, asyncio.TimeoutError) as e:
            for f in todo:
                f.setdefault("minimal", f"shrinking stopped: {e!r}")
        finally:
            await self.client.stop()

    async def _ddmin(self, msgs: list, check: str, deadline: float) -> list | None:
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

    async def _fails(self, msgs: list, check: str) -> bool:
        """Replays `msgs` on a document of its own; True when `check` fails again."""
        self.ids += 1
        first = msgs[0]["params"]["textDocument"]["uri"]
        uri = (f"untitled:Shrink-{self.ids}" if first.startswith("untitled:")
               else f"file:///fuzz/shrink/{self.ids}/" + first.rsplit("/", 1)[-1])
        states: list | None = None  # the (text, version) outcomes so far; None: not open
        c = self.client
        for m in msgs:
            m = json.loads(json.dumps(m).replace(json.dumps(first)[1:-1], json.dumps(uri)[1:-1]))
            method, params = m.get("method"), m.get("params")
            if "id" not in m:
                if method == "textDocument/didOpen":
                    td = params["textDocument"]
                    states = [(norm(td["text"]), td["version"])]
                elif method == "textDocument/didChange" and states is not None:
                    ch, v = params.get("contentChanges"), params["textDocument"].get("version")
                    states = list(dict.fromkeys(o for t, ver in states for o in (
                        edit_outcomes(t, ver, ch, v) if isinstance(ch, list) else [(t, ver), (t, v)])))[:32]
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
            if check == "bad_ranges" and method in ("textDocument/inlineCompletion", "textDocument/completion") \
                    and states and isinstance(params, dict):
                pos = params.get("position")
                if all(check_answer(method, answer, RefText(t), resolve(RefText(t), pos)[0]) for t, _ in states):
                    return True
        if check != "divergences":
            return False
        got = await asyncio.wait_for(c.request(DOC_TEXT, {"textDocument": {"uri": uri}}), self.timeout)
        if states is None:
            return got is not None
        return not isinstance(got, dict) or norm(got.get("text") or "") not in {t for t, _ in states}

    # ---------------------------------------------------------------- run

    async def run(self) -> dict:
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
                code = self.client.proc.returncode
                self.fail("exits", f"the server exited on its own (code {code})" if code is not None else
                          "the server closed its input")
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
        exceptions = server_exceptions(self.log)
        self.log.close()
        return {**self.report(time.monotonic() - t0), "server_exceptions": exceptions}

    def report(self, elapsed: float) -> dict:
        return {
            "ok": not any(self.failed.values()), "seed": self.seed, "n": self.n, "model": self.model or "default",
            "server": self.cmd, "timeout_s": self.timeout, "max_doc_bytes": self.max_doc_bytes,
            "elapsed_s": round(elapsed, 1), "launches": self.launches,
            "document_text": bool(self.doc_text), "answered": self.answered, "ranges_checked": self.ranges_checked,
            "error_codes": {str(k): v for k, v in sorted(self.error_codes.items(), key=lambda kv: str(kv[0]))},
            "stray_responses": self.stray,
            **{c: self.failed[c] for c in CHECKS},
            "classes": self.counts,
            "failures": [{k: v for k, v in f.items() if k != "_full"} for f in self.failures],
        }


def server_exceptions(log, most: int = 10) -> dict[str, int]:
    """The exceptions in the server's stderr (last line of each traceback, numbers left out), by count.
    Not a check: a request answered empty after an exception is answered; but worth a look."""
    log.flush()
    log.seek(0)
    found: collections.Counter = collections.Counter()
    in_tb = False
    for raw in log:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.startswith("Traceback (most recent call last)"):
            in_tb = True
        elif in_tb and line and not line.startswith((" ", "\t")):
            found[re.sub(r"\d+", "N", line)[:160]] += 1
            in_tb = False
    return dict(found.most_common(most))


def _doc_text(msg: dict):
    """The text a didOpen carries (for deciding what is too big to keep)."""
    params = msg.get("params") if isinstance(msg, dict) else None
    td = params.get("textDocument") if isinstance(params, dict) else None
    return td.get("text", "") if isinstance(td, dict) else ""


def _inline_params(uri: str, line, char) -> dict:
    return {"textDocument": {"uri": uri}, "position": {"line": line, "character": char}, "context": {"triggerKind": 2}}


def _expect_code(code: int, what: str):
    def check(result, err):
        if err is None:
            return "protocol", f"{what}: answered {_brief(result)!r}, want error {code}"
        if err.code != code:
            return "protocol", f"{what}: error {err.code} ({err.error.get('message')}), want {code}"
        return None
    return check


def _no_items(uri: str):
    def check(result, err):
        items = result.get("items") if isinstance(result, dict) else result
        if err is None and items:
            return "protocol", f"a fill for a document never opened ({uri}): {_brief(items)}"
        return None
    return check


def _first_diff(got, want: str) -> str:
    have = got.get("text") if isinstance(got, dict) else None
    if not isinstance(have, str) or not isinstance(want, str):
        return ""
    i = next((k for k, (x, y) in enumerate(zip(have, want)) if x != y), min(len(have), len(want)))
    return f"; first difference at offset {i}: server {have[i:i + 20]!r}, client {want[i:i + 20]!r}"


# ----------------------------------------------------------------------------- CLI


def _say(*parts) -> None:
    """print() that survives lone surrogates in failure details."""
    sys.stdout.write(" ".join(map(str, parts)).encode("utf-8", "backslashreplace").decode("utf-8") + "\n")


def add_fuzz_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=10000, help="steps (default 10000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the report as JSON")
    p.add_argument("--model", default=None, help="model folder, or scripted:... for the scripted engine (default: the embedded model)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds a request may take to be answered (default 5)")
    p.add_argument("--max-doc-bytes", type=int, default=10_000_000, help="size of the big documents (default 10 MB)")
    p.add_argument("--classes", default=None, help="comma-separated input classes (default: all): " + ", ".join(CLASSES))
    p.add_argument("--options", default=None, help="extra initializationOptions as JSON")
    p.add_argument("--server-log", default=None, help="write the server's stderr here")
    p.add_argument("--server-cmd", default=None, help="run this server command instead of dlm-lsp serve")
    p.add_argument("--no-shrink", dest="shrink", action="store_false",
                   help="keep failing documents' whole message sequences (default: cut them to a minimal one)")


def run_fuzz(args: argparse.Namespace) -> int:
    classes = [c.strip() for c in args.classes.split(",")] if args.classes else None
    unknown = set(classes or []) - set(CLASSES)
    if unknown:
        print(f"unknown classes {sorted(unknown)}; known: {', '.join(CLASSES)}", file=sys.stderr)
        return 2
    fz = Fuzzer(args.n, args.seed, model=args.model, timeout=args.timeout, max_doc_bytes=args.max_doc_bytes,
                options=json.loads(args.options) if args.options else None, classes=classes, log_path=args.server_log,
                server_cmd=shlex.split(args.server_cmd) if args.server_cmd else None, shrink=args.shrink)
    rep = asyncio.run(fz.run())
    print = _say
    print(f"fuzz seed {rep['seed']}, {rep['n']} steps, {rep['elapsed_s']} s, {rep['launches']} launches, "
          f"{rep['answered']} answers, {rep['ranges_checked']} fill ranges, documentText {'yes' if rep['document_text'] else 'no'}")
    print(f"{'class':24} {'steps':>6} {'messages':>9} {'requests':>9} {'failures':>9}")
    for c, v in rep["classes"].items():
        print(f"{c:24} {v['steps']:6} {v['messages']:9} {v['requests']:9} {v['failures']:9}")
    print("  ".join(f"{c} {rep[c]}" for c in CHECKS))
    for e, k in rep["server_exceptions"].items():
        print(f"server exception x{k}: {e}")
    for f in rep["failures"]:
        print(f"FAIL {f['check']} [{f['class']} step {f['step']}]: {f['detail']}")
        if isinstance(f.get("minimal"), list):
            print(f"  minimal repro, {len(f['minimal'])} messages:")
            for m in f["minimal"]:
                print("   ", json.dumps(m, ensure_ascii=True)[:300])
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(rep, indent=1, ensure_ascii=True) + "\n")
    return 0 if rep["ok"] else 1
