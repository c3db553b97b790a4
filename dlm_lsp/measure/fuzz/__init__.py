"""`dlm-lsp fuzz`: drive the real server over stdio with seeded valid and hostile input, and check it.

The server runs as a subprocess: `dlm-lsp serve`, or for a `scripted:...` model the real server with
the scripted engine (fake_server.py, scripted_engine.py). Each of --n steps draws one input class (`CLASSES`)
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

The code typed comes from examples/ and a few stdlib modules, plus the *.py files of --corpus folders.

The parts: reference.py (the reference edit model), checks.py (answer checks), client.py (the wire),
state.py (documents and pending requests), fuzzer.py (the run and its report) with its mixins
messages.py, lifetime.py, editing.py, inputs.py (the input classes) and shrink.py; corpus.py (the code
typed); fake_server.py and scripted_engine.py (the server a `scripted:` model runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from pathlib import Path

from dlm_lsp.measure.fuzz.checks import CHECKS
from dlm_lsp.measure.fuzz.fuzzer import Fuzzer
from dlm_lsp.measure.fuzz.inputs import CLASSES

__all__ = ["add_fuzz_args", "run_fuzz"]


# ----------------------------------------------------------------------------- CLI


def _say(*parts: object) -> None:
    """print() that survives lone surrogates in failure details."""
    sys.stdout.write(" ".join(map(str, parts)).encode("utf-8", "backslashreplace").decode("utf-8") + "\n")


def add_fuzz_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=10000, help="steps (default 10000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the report as JSON")
    p.add_argument(
        "--model",
        default=None,
        help="model folder, or scripted:... for the scripted engine (default: the embedded model)",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds a request may take to be answered (default 5)")
    p.add_argument("--max-doc-bytes", type=int, default=10_000_000, help="size of the big documents (default 10 MB)")
    p.add_argument(
        "--classes", default=None, help="comma-separated input classes (default: all): " + ", ".join(CLASSES)
    )
    p.add_argument("--options", default=None, help="extra initializationOptions as JSON")
    p.add_argument("--server-log", default=None, help="write the server's stderr here")
    p.add_argument("--server-cmd", default=None, help="run this server command instead of dlm-lsp serve")
    p.add_argument(
        "--no-shrink",
        dest="shrink",
        action="store_false",
        help="keep failing documents' whole message sequences (default: cut them to a minimal one)",
    )
    p.add_argument(
        "--corpus",
        action="append",
        default=[],
        metavar="DIR",
        help="also type the *.py files of DIR (after examples/; repeatable), e.g. a checkout's tests/data",
    )


def run_fuzz(args: argparse.Namespace) -> int:
    classes = [c.strip() for c in args.classes.split(",")] if args.classes else None
    unknown = set(classes or []) - set(CLASSES)
    if unknown:
        print(f"unknown classes {sorted(unknown)}; known: {', '.join(CLASSES)}", file=sys.stderr)
        return 2
    fz = Fuzzer(
        args.n,
        args.seed,
        model=args.model,
        timeout=args.timeout,
        max_doc_bytes=args.max_doc_bytes,
        options=json.loads(args.options) if args.options else None,
        classes=classes,
        log_path=args.server_log,
        server_cmd=shlex.split(args.server_cmd) if args.server_cmd else None,
        shrink=args.shrink,
        corpus_dirs=args.corpus,
    )
    rep = asyncio.run(fz.run())
    _say(
        f"fuzz seed {rep['seed']}, {rep['n']} steps, {rep['elapsed_s']} s, {rep['launches']} launches, "
        f"{rep['answered']} answers, {rep['ranges_checked']} fill ranges, documentText {'yes' if rep['document_text'] else 'no'}"
    )
    _say(f"{'class':24} {'steps':>6} {'messages':>9} {'requests':>9} {'failures':>9}")
    for c, v in rep["classes"].items():
        _say(f"{c:24} {v['steps']:6} {v['messages']:9} {v['requests']:9} {v['failures']:9}")
    _say("  ".join(f"{c} {rep[c]}" for c in CHECKS))
    for e, k in rep["server_exceptions"].items():
        _say(f"server exception x{k}: {e}")
    for f in rep["failures"]:
        _say(f"FAIL {f['check']} [{f['class']} step {f['step']}]: {f['detail']}")
        if isinstance(f.get("minimal"), list):
            _say(f"  minimal repro, {len(f['minimal'])} messages:")
            for m in f["minimal"]:
                _say("   ", json.dumps(m, ensure_ascii=True)[:300])
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(rep, indent=1, ensure_ascii=True) + "\n")
    return 0 if rep["ok"] else 1
