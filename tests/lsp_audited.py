"""Runs a Python program under an audit hook (PEP 578) that writes what it does to the network,
to files and to other processes as JSON lines to the file named by $DLM_AUDIT_LOG.

    python tests/lsp_audited.py -m dlm_lsp serve        a module, as `python -m`
    python tests/lsp_audited.py dlm_lsp/measure/fuzz/fake_server.py a script
    python tests/lsp_audited.py -c CODE                  code (the tests' own control cases)

Recorded: every socket.* event (creation with its family, connect, bind, getaddrinfo, sendto...),
urllib requests, process launches, and `open` with the path and whether it writes. The hook is
installed before anything of the program is imported, so nothing it does is missed; a hook cannot
be removed once added (tests/test_security.py).
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys

_fd = os.open(os.environ["DLM_AUDIT_LOG"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
_FAMILIES = {int(f): f.name for f in socket.AddressFamily}
_WATCHED = (
    "socket.",
    "urllib.",
    "subprocess.",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "ctypes.dlopen",
)


def _write(record: dict) -> None:
    os.write(_fd, (json.dumps(record, default=repr) + "\n").encode())  # os.write raises no audit event


def _hook(event: str, args) -> None:
    if event == "open":
        path, mode, flags = (list(args) + [None, None, None])[:3]
        writes = bool(mode and any(c in str(mode) for c in "wax+")) or bool(
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        )
        if isinstance(path, (str, bytes, os.PathLike)):
            _write({"event": "open", "path": os.fsdecode(path), "writes": writes})
    elif event.startswith(_WATCHED):
        rec = {"event": event, "args": [repr(a) for a in args]}
        if event == "socket.__new__" and len(args) > 1 and isinstance(args[1], int):
            rec["family"] = _FAMILIES.get(args[1], str(args[1]))
        _write(rec)


sys.addaudithook(_hook)

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["-c"]:
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<audited>", "exec"), {"__name__": "__main__"})
    elif argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
