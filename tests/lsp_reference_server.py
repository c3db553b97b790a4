"""A minimal LSP server that does everything `dlm-lsp fuzz` checks right, with defects to switch on.

It exists to test the fuzzer: run plain, a fuzz run must find nothing (no false alarms); run with
`--defect NAME`, the fuzzer must catch it (a fuzzer that cannot fail is worthless). No pygls: the
framing, lifecycle and error codes are written out here, so each defect is one line away from right.
Documents use the fuzzer's own reference model (the model has its own unit tests).
Defects:
  lf_only       lines end at \\n only (\\r and \\r\\n are not line ends)
  splitlines    lines end wherever str.splitlines() cuts (\\v, \\f, \\x1c, \\x85, \\u2028, ...)
  range_shift   a fill's range starts one column right of the cursor
  crash_nul     the process exits when a document gets a NUL character
  hang_unknown  unknown requests are never answered
  drop_edit     every 5th didChange is ignored
  no_clamp      a column past the line's end runs on into the next line
  wedge_huge    a huge Content-Length is believed (the stream never recovers)
  exit_code     exit after shutdown exits with 1
  early_answer  requests before initialize are answered normally
  drop_fill     every 7th inlineCompletion is never answered (for `dlm-lsp soak`)
  slow_fill     every 10th inlineCompletion is answered 0.7 s late (for `dlm-lsp soak`)
  stale_next_edit         dlm/nextEdit answers an edit for any version, not only the current one
  next_edit_out_of_range  dlm/nextEdit's edit stands past the document's last line
dlm/nextEdit answers the current version with an empty edit at the start, any other (or a position
past the last line) with null.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dlm_lsp.measure.fuzz import reference as fuzz  # noqa: E402

MAX_BODY = 64 * 2**20
DEFECT = sys.argv[sys.argv.index("--defect") + 1] if "--defect" in sys.argv else None


class RefText(fuzz.RefText):
    """The fuzzer's line model, or the defect's."""

    def __init__(self, text):
        if DEFECT not in ("lf_only", "splitlines"):
            return super().__init__(text)
        self.text, self.starts, self.ends = text, [], []
        start = 0
        for line in text.split("\n") if DEFECT == "lf_only" else text.splitlines(True):
            body = line.rstrip("\n") if DEFECT == "lf_only" else line.splitlines()[0] if line.splitlines() else ""
            self.starts.append(start)
            self.ends.append(start + len(body))
            start += len(line) + (1 if DEFECT == "lf_only" else 0)
        if DEFECT == "splitlines" and (not text or text.splitlines(True)[-1] != text.splitlines()[-1]):
            self.starts.append(len(text))
            self.ends.append(len(text))

    def offset(self, line, char):
        if DEFECT == "no_clamp" and line < len(self.starts):
            return min(len(self.text), self.starts[line] + char)
        return self.offsets(line, char)[-1]


class _Unanswered(Exception):
    """A request the defect leaves unanswered."""


def _is_uint(v):
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= fuzz.UINT_MAX


def _pos(p):
    if not isinstance(p, dict) or not _is_uint(p.get("line")) or not _is_uint(p.get("character")):
        raise ValueError("bad position")
    return p["line"], p["character"]


def _uri(params):
    td = params.get("textDocument") if isinstance(params, dict) else None
    if not isinstance(td, dict) or not isinstance(td.get("uri"), str):
        raise ValueError("bad textDocument")
    return td["uri"]


class Server:
    def __init__(self):
        self.inp, self.out = sys.stdin.buffer, sys.stdout.buffer
        self.state = "new"  # new -> running -> shut
        self.docs = {}  # uri -> [text, version]
        self.changes = 0
        self.fills = 0

    def send(self, msg):
        body = json.dumps(msg).encode()
        self.out.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.out.flush()

    def answer(self, msg_id, result=None, error=None):
        self.send({"jsonrpc": "2.0", "id": msg_id, **({"error": error} if error else {"result": result})})

    def read(self):
        """The next body, or None for a header block that names none; raises EOFError at the end."""
        length, bad = None, False
        while True:
            line = self.inp.readline()
            if not line:
                raise EOFError
            line = line.strip()
            if not line:
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    bad = True
        if length is None or bad or length < 0 or (length > MAX_BODY and DEFECT != "wedge_huge"):
            return None
        chunks = []
        while length > 0:  # in pieces: a believed huge length waits for its bytes instead of failing to allocate
            chunk = self.inp.read1(min(length, 1 << 16))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            length -= len(chunk)
        return b"".join(chunks)

    def run(self):
        while True:
            try:
                body = self.read()
            except EOFError:
                return 1
            if body is None:
                continue
            try:
                msg = json.loads(body.decode("utf-8"))
            except (ValueError, RecursionError):
                self.answer(None, error={"code": -32700, "message": "parse error"})
                continue
            if not isinstance(msg, dict) or not isinstance(msg.get("method", ""), str):
                self.answer(
                    msg.get("id") if isinstance(msg, dict) else None,
                    error={"code": -32600, "message": "invalid request"},
                )
                continue
            if "method" not in msg:
                continue  # a response
            code = self.handle(msg["method"], msg.get("params"), "id" in msg, msg.get("id"))
            if code is not None:
                return code

    def handle(self, method, params, is_request, msg_id):
        if method == "exit":
            return (1 if DEFECT == "exit_code" else 0) if self.state == "shut" else 1
        if self.state == "new" and method != "initialize" and DEFECT != "early_answer":
            if is_request:
                self.answer(msg_id, error={"code": -32002, "message": "not initialized"})
            return None
        if self.state == "shut":
            if is_request:
                self.answer(msg_id, error={"code": -32600, "message": "shut down"})
            return None
        try:
            result = self.dispatch(method, params, is_request)
        except _Unanswered:
            return None
        except ValueError as e:
            if is_request:
                self.answer(msg_id, error={"code": -32602, "message": str(e)})
            return None
        except LookupError:
            if is_request and DEFECT != "hang_unknown":
                self.answer(msg_id, error={"code": -32601, "message": f"unknown method {method}"})
            return None
        if is_request:
            self.answer(msg_id, result)
        return None

    def dispatch(self, method, params, is_request):
        if method == "initialize":
            if self.state != "new":
                raise ValueError("initialized twice")
            self.state = "running"
            return {"capabilities": {"textDocumentSync": 2, "inlineCompletionProvider": {}, "completionProvider": {}}}
        if method == "initialized":
            self.send({"jsonrpc": "2.0", "method": "dlm/status", "params": {"state": "ready"}})
        elif method == "shutdown":
            self.state = "shut"
        elif method == "textDocument/didOpen":
            td = params.get("textDocument") if isinstance(params, dict) else None
            if (
                not isinstance(td, dict)
                or not isinstance(td.get("text"), str)
                or not isinstance(td.get("version"), int)
                or not isinstance(td.get("uri"), str)
                or not isinstance(td.get("languageId"), str)
            ):
                raise ValueError("bad didOpen")
            self.docs[td["uri"]] = [td["text"], td["version"]]
            if DEFECT == "crash_nul" and "\x00" in td["text"]:
                sys.exit(3)
        elif method == "textDocument/didChange":
            self.did_change(params)
        elif method == "textDocument/didClose":
            self.docs.pop(_uri(params), None)
        elif method in ("textDocument/inlineCompletion", "textDocument/completion"):
            self.fills += 1
            if DEFECT == "drop_fill" and self.fills % 7 == 0:
                raise _Unanswered
            if DEFECT == "slow_fill" and self.fills % 10 == 0:
                time.sleep(0.7)
            return self.fill(method, params)
        elif method == "dlm/documentText":
            uri = _uri(params)
            doc = self.docs.get(uri)
            return {"uri": uri, "text": doc[0], "version": doc[1]} if doc else None
        elif method == "dlm/nextEdit":
            return self.next_edit(params)
        elif method == "$/cancelRequest" or method == "workspace/didChangeConfiguration":
            pass
        elif is_request or not method.startswith("$/"):
            raise LookupError(method)

    def next_edit(self, params):
        """An empty edit at the start for the current version, else null (or the defect's answer)."""
        uri = _uri(params)
        version = params["textDocument"].get("version")
        if not _is_uint(version):
            raise ValueError("bad version")
        line, _ = _pos(params.get("position"))
        doc = self.docs.get(uri)
        if doc is None or line >= len(fuzz.RefText(doc[0])):
            return None
        if version != doc[1] and DEFECT != "stale_next_edit":
            return None
        line = doc[0].count("\n") + 5 if DEFECT == "next_edit_out_of_range" else 0
        zero = {"line": line, "character": 0}
        return {"edits": [{"range": {"start": zero, "end": zero}, "newText": ""}]}

    def did_change(self, params):
        uri = _uri(params)
        version = params["textDocument"].get("version")
        changes = params.get("contentChanges")
        if not isinstance(version, int) or isinstance(version, bool) or not isinstance(changes, list):
            raise ValueError("bad didChange")
        doc = self.docs.get(uri)
        if doc is None:
            return
        self.changes += 1
        if DEFECT == "drop_edit" and self.changes % 5 == 0:
            return
        text = doc[0]
        parsed = []
        for ch in changes:  # check every change before applying any
            if not isinstance(ch, dict) or not isinstance(ch.get("text"), str):
                raise ValueError("bad change")
            rng = ch.get("range")
            if rng is not None and (not isinstance(rng, dict)):
                raise ValueError("bad range")
            parsed.append((None if rng is None else (_pos(rng.get("start")), _pos(rng.get("end"))), ch["text"]))
        for rng, new in parsed:
            if rng is None:
                text = new
                continue
            ref = RefText(text)
            a, b = ref.offset(*rng[0]), ref.offset(*rng[1])
            a, b = min(a, b), max(a, b)
            text = text[:a] + new + text[b:]
        doc[0], doc[1] = text, version
        if DEFECT == "crash_nul" and "\x00" in text:
            sys.exit(3)

    def fill(self, method, params):
        uri = _uri(params)
        line, char = _pos(params.get("position"))
        doc = self.docs.get(uri)
        if doc is None:
            return {"items": []} if method.endswith("inlineCompletion") else []
        ref = RefText(doc[0])
        off = ref.offset(line, char)
        line, char = ref.position(off)
        if DEFECT == "range_shift":
            char += 1
        rng = {"start": {"line": line, "character": char}, "end": {"line": line, "character": char}}
        if method.endswith("inlineCompletion"):
            return {"items": [{"insertText": "x = 1", "range": rng}]}
        return {"isIncomplete": True, "items": [{"label": "x", "textEdit": {"range": rng, "newText": "x = 1"}}]}


if __name__ == "__main__":
    sys.setrecursionlimit(2000)
    raise SystemExit(Server().run())
