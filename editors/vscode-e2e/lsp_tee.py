#!/usr/bin/env python3
"""Runs a language server and records every LSP message both ways, one JSON line each.

Usage: lsp_tee.py LOG -- COMMAND [ARGS...]
The VS Code end-to-end tests point `dlm.server.path` at this script, so they can check what the
server really sent (a fill's text and range, $/progress, dlm/status) against what VS Code shows,
whatever VS Code's own log levels are. Lines: {"t": seconds since start, "dir": "in"|"out", "msg": {...}}
("in": editor to server), "pid": this process's id (tells apart the servers of one log). Stdlib only.
A JSON object in LOG.env, when that file exists as the server starts, is added to the server's
environment: how a test runs the next window's server on the shared engine.
"""
import json
import os
import subprocess
import sys
import threading
import time


def frames(stream):
    """Yields (raw bytes, parsed body) for each Content-Length frame on `stream` until it ends."""
    while True:
        header = b""
        while not header.endswith(b"\r\n\r\n"):
            byte = stream.read(1)
            if not byte:
                return
            header += byte
        length = 0
        for line in header.decode("ascii", "replace").split("\r\n"):
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        body = stream.read(length)
        try:
            msg = json.loads(body)
        except ValueError:
            msg = {"unparsed": body.decode("utf-8", "replace")}
        yield header + body, msg


def main() -> int:
    log_path, sep, *cmd = sys.argv[1:]
    assert sep == "--" and cmd, __doc__
    t0 = time.monotonic()
    log = open(log_path, "a", encoding="utf-8")
    lock = threading.Lock()
    env = dict(os.environ)
    if os.path.exists(log_path + ".env"):
        with open(log_path + ".env", encoding="utf-8") as f:
            env.update(json.load(f))
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def pump(src, dst, direction):
        for raw, msg in frames(src):
            with lock:
                log.write(json.dumps({"t": round(time.monotonic() - t0, 3), "pid": os.getpid(), "dir": direction,
                                     "msg": msg}) + "\n")
                log.flush()
            try:
                dst.write(raw)
                dst.flush()
            except (BrokenPipeError, ValueError):
                return
        try:
            dst.close()
        except OSError:
            pass

    into = threading.Thread(target=pump, args=(sys.stdin.buffer, child.stdin, "in"), daemon=True)
    into.start()
    pump(child.stdout, sys.stdout.buffer, "out")
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
