"""Security properties of serving, each checked on the real process:
- `dlm-lsp serve` with the default model opens no network socket: an audit hook (PEP 578) records
  every socket the Python side creates, connects or resolves, and /proc shows every socket the
  process holds (C code included) - both checked after a fill, and both shown to catch one;
- the editor cannot make the server read or write files: documents come from didOpen text only,
  never from disk by URI, and nothing is written;
- the model path cannot come from workspace settings (a repository can ship those): a `model` in
  workspace/didChangeConfiguration that differs from initializationOptions' is refused.
Weights through safetensors only, with a header limit: tests/test_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dlm_lsp.options import _KEYS, MACHINE_KEYS, InitializationOptions, parse_options
from tests.lsp_helpers import FAKE_SERVER, REPO, inline, lsp_server, open_doc, scripted

AUDITED = [sys.executable, str(REPO / "tests" / "lsp_audited.py")]
INET_TABLES = ("tcp", "tcp6", "udp", "udp6", "raw", "raw6", "udplite", "udplite6")


# ----------------------------------------------------------------------------- the detectors


def sockets_of(pid: int) -> dict[int, str]:
    """inode -> what the socket is, for every socket `pid` holds: "unix" (an unnamed AF_UNIX
    socket, as asyncio's self-pipe), "unix:<path>", "tcp"/"udp6"/..., or "other" (netlink, ...)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    kinds = {}
    for table in INET_TABLES:
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and int(cols[9]) in inodes:
                kinds[int(cols[9])] = table
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        cols = line.split()
        if len(cols) > 6 and int(cols[6]) in inodes:
            kinds[int(cols[6])] = "unix" if len(cols) == 7 else f"unix:{cols[7]}"
    return {i: kinds.get(i, "other") for i in inodes}


def audit_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def network_events(events: list[dict]) -> list[dict]:
    """Audit events that reach for the network: any socket but AF_UNIX, any connect / bind / name
    lookup / send, any urllib request."""
    out = []
    for e in events:
        ev = e["event"]
        if ev == "socket.__new__" and e.get("family") == "AF_UNIX":
            continue
        if ev.startswith(("socket.", "urllib.")):
            out.append(e)
    return out


def writes(events: list[dict]) -> list[str]:
    """Paths opened for writing, less tempfile's writability probe (a random name directly in the
    temp dir, made and removed when torch asks for the temp dir)."""
    tmp = tempfile.gettempdir()
    return [
        e["path"]
        for e in events
        if e["event"] == "open"
        and e["writes"]
        and not (os.path.dirname(e["path"]) == tmp and len(os.path.basename(e["path"])) == 8)
    ]


def opened_under(events: list[dict], folder: Path) -> list[str]:
    root = os.path.realpath(folder)
    return [e["path"] for e in events if e["event"] == "open" and os.path.realpath(e["path"]).startswith(root + os.sep)]


def _env(log: Path) -> dict:
    return {**os.environ, "DLM_AUDIT_LOG": str(log), "PYTHONDONTWRITEBYTECODE": "1"}


def _audit_env(monkeypatch, log: Path) -> None:
    """The server processes started by lsp_server inherit this environment."""
    for k, v in _env(log).items():
        monkeypatch.setenv(k, v)


def test_the_detectors_see_a_socket_and_a_write(tmp_path):
    """Control: the same checks, on a child that listens on TCP and writes a file, do fail."""
    log, target = tmp_path / "audit.jsonl", tmp_path / "ws" / "written.txt"
    target.parent.mkdir()
    code = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "u = socket.socket(socket.AF_UNIX); u.bind(sys.argv[1])\n"
        f"open({str(target)!r}, 'w').write('x')\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [*AUDITED, "-c", code, str(tmp_path / "named.sock")], env=_env(log), stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        kinds = sorted(sockets_of(child.pid).values())
    finally:
        child.kill()
        child.wait()
    assert "tcp" in kinds and f"unix:{tmp_path / 'named.sock'}" in kinds
    events = audit_log(log)
    found = {e["event"] for e in network_events(events)}
    assert {"socket.__new__", "socket.bind"} <= found
    assert str(target) in writes(events) and str(target) in opened_under(events, target.parent)


# ----------------------------------------------------------------------------- no network


async def test_serving_the_default_model_opens_no_network_socket(tmp_path, monkeypatch):
    log = tmp_path / "audit.jsonl"
    _audit_env(monkeypatch, log)
    cmd = [*AUDITED, "-m", "dlm_lsp", "serve"]
    text = (REPO / "examples" / "tide_log.py").read_text()
    uri = (tmp_path / "ws" / "tide_log.py").as_uri()  # never written: the text comes from didOpen
    async with lsp_server(
        cmd, {"budgetMs": 2000, "postprocess": False}, ready_timeout=180, log_path=tmp_path / "server.log"
    ) as c:
        open_doc(c, uri, text)
        line = text[: text.index("        return self.high - self.low")].count("\n")
        await inline(c, uri, line, 8, timeout=60)
        s = await c.request("dlm/stats", {}, timeout=10)
        assert s["engineJobs"] >= 1 and s["state"] == "ready" and s["model"] == "default"
        from engine.serve.service import cpu_threads  # the thread count in use is reported (issue 16)

        env = os.environ.get("DLM_THREADS", "")
        assert s["threads"] == (int(env) if env.isdigit() and int(env) > 0 else cpu_threads())
        held = sockets_of(c.proc.pid)
    assert held and set(held.values()) == {"unix"}, held  # asyncio's self-pipe (a socketpair), nothing else
    events = audit_log(log)
    assert any(e["event"] == "open" and e["path"].endswith("model.safetensors") for e in events)  # the hook ran
    assert network_events(events) == []
    assert writes(events) == []
    assert not any(e["event"].startswith(("subprocess.", "os.system", "os.exec", "os.posix_spawn")) for e in events)


# ----------------------------------------------------------------------------- files by URI


async def test_documents_come_from_didopen_never_from_disk(tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    ws.mkdir()
    on_disk = ws / "a.py"
    on_disk.write_text("DISK_TEXT = 1\n")
    unopened = ws / "secret.py"
    unopened.write_text("SECRET = 'on disk only'\n")
    log = tmp_path / "audit.jsonl"
    _audit_env(monkeypatch, log)
    cmd = [*AUDITED, FAKE_SERVER[1]]
    async with lsp_server(cmd, {"model": scripted(echo=40), "postprocess": False}) as c:
        open_doc(c, on_disk.as_uri(), "EDITOR_TEXT = 2\n")
        items = await inline(c, on_disk.as_uri(), 0, 14)
        assert items[0]["insertText"].startswith("EDITOR_TEXT")  # the prefix the engine got: the editor's text
        assert await inline(c, unopened.as_uri(), 0, 5) == []  # never opened: nothing, not the disk file
        for uri in (
            "file:///etc/passwd",
            "file:///../../../../etc/passwd",
            "file:///proc/self/environ",
            f"file://{ws}/../../etc/shadow",
            "untitled:Untitled-1",
        ):
            assert await inline(c, uri, 0, 0) == []
        traversal = "file:///tmp/../../etc/passwd"
        open_doc(c, traversal, "OPENED = 3\n")
        assert (await inline(c, traversal, 0, 9))[0]["insertText"].startswith("OPENED")
        s = await c.request("dlm/stats", {}, timeout=10)
        assert s["requests"] >= 2
    events = audit_log(log)
    assert any(e["event"] == "open" for e in events)  # the hook ran
    assert opened_under(events, ws) == []
    assert not [
        e["path"]
        for e in events
        if e["event"] == "open" and ("passwd" in e["path"] or "shadow" in e["path"] or "environ" in e["path"])
    ]
    assert writes(events) == []


# ----------------------------------------------------------------------------- the model option


def test_model_from_workspace_settings_is_refused_and_the_rest_applies():
    init, _ = parse_options({"model": "/home/me/models/mine"})
    opts, warnings = parse_options({"model": "./evil-model", "budgetMs": 200}, init, from_settings=True)
    assert opts.model == "/home/me/models/mine" and opts.budget_ms == 200
    assert len(warnings) == 1 and "'model' cannot be changed through workspace settings" in warnings[0]
    same, warnings = parse_options({"model": "/home/me/models/mine"}, init, from_settings=True)
    assert same.model == "/home/me/models/mine" and warnings == []
    default, warnings = parse_options({"model": ""}, InitializationOptions(), from_settings=True)
    assert default.model is None and warnings == []
    assert parse_options({"model": "./mine"})[0].model == "./mine"  # initializationOptions: the user's own


@pytest.mark.parametrize("pushed", [True, False], ids=["pushed", "pulled"])
async def test_a_workspace_cannot_switch_the_model(tmp_path, pushed):
    evil = scripted(text="evil")
    caps = {"workspace": {"configuration": True}, "textDocument": {"inlineCompletion": {}}}
    async with lsp_server(
        FAKE_SERVER,
        {"model": scripted(text="mine")},
        capabilities=caps,
        config={"dlm": {"model": evil, "budgetMs": 60_000}},
    ) as c:
        open_doc(c, (tmp_path / "a.py").as_uri(), "x = \n")
        assert (await inline(c, (tmp_path / "a.py").as_uri(), 0, 4))[0]["insertText"] == "mine"
        n = len(c.notifications)
        settings = {"dlm": {"model": evil, "budgetMs": 60_000}} if pushed else {}
        c.notify("workspace/didChangeConfiguration", {"settings": settings})
        warn = await c.wait_notification("window/showMessage", lambda p: "'model'" in p["message"], since=n, timeout=10)
        assert warn["type"] == 2 and "cannot be changed through workspace settings" in warn["message"]
        assert (await inline(c, (tmp_path / "a.py").as_uri(), 0, 4))[0]["insertText"] == "mine"
        assert not any(m == "dlm/status" and p["state"] == "loading" for _, m, p in c.notifications[n:])
        s = await c.request("dlm/stats", {}, timeout=10)
        assert "mine" in s["model"] and "evil" not in s["model"]
        if not pushed:
            assert ("workspace/configuration", {"items": [{"section": "dlm"}]}) in c.server_requests


def test_the_vscode_setting_is_machine_scoped():
    """VS Code ignores a machine-scoped setting in a workspace's settings.json, so the model in
    initializationOptions is the user's own."""
    manifest = json.loads((REPO / "editors" / "vscode" / "package.json").read_text())
    props = manifest["contributes"]["configuration"]["properties"]
    assert props["dlm.model"]["scope"] == "machine"
    # ...and every option the server takes from initializationOptions only that VS Code has a setting for
    machine = [f"dlm.{camel}" for camel, name in _KEYS.items() if name in MACHINE_KEYS and f"dlm.{camel}" in props]
    assert {"dlm.model", "dlm.device", "dlm.engine"} <= set(machine)
    assert all(props[k]["scope"] == "machine" for k in machine), machine
