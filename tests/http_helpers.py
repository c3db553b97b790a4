"""HTTP test plumbing: an ASGI app under uvicorn on a thread (a free loopback port), and
`dlm-lsp http` as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from dlm_lsp.http.app import bind

REPO = Path(__file__).resolve().parent.parent


class ThreadServer:
    """`app` under uvicorn on a daemon thread; `url` is its base; ready once /health (or
    `ready_path`) answers `ready_status`."""

    def __init__(self, app, ready_path: str = "/health", ready_status: int = 200, port: int = 0):
        self.sock = bind("127.0.0.1", port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_path, self.ready_status = ready_path, ready_status
        self.uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def wait(self, timeout: float = 20):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == self.ready_status:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise AssertionError("the server did not get ready")

    def __enter__(self):
        return self.start().wait()

    def __exit__(self, *exc):
        self.uv.should_exit = True
        self.thread.join(10)
        self.sock.close()


class http_process:
    """`dlm-lsp http --port 0` on a model, as a subprocess; yields its base URL."""

    def __init__(self, model, *extra: str, env: dict | None = None):
        self.cmd = [
            sys.executable,
            "-m",
            "dlm_lsp",
            "http",
            "--model",
            str(model),
            "--port",
            "0",
            "--device",
            "cpu",
            "--threads",
            "1",
            *extra,
        ]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}

    def __enter__(self) -> str:
        self.log = tempfile.TemporaryFile()  # a pipe nobody reads could fill and block the server
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=self.env, cwd=REPO
        )
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            self.log.seek(0)
            raise AssertionError(f"dlm-lsp http did not start: {self.log.read()[-2000:].decode(errors='replace')}")
        self.url = json.loads(line)["listening"]
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("dlm-lsp http never became ready")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc.stdout.close()
        self.log.close()
