"""The extension inside a real VS Code (code-server 4.139.1 = VS Code 1.139.1) in headless
Chromium, against the real server on the tiny editor-test model. The tests share one window and
run in file order, each leaving the editor as the next one expects.

Run by editors/run-tests.sh (after editors/setup.sh vscode and `vsce package`); alone:
  .cache/editors/playwright/bin/python -m pytest -v editors/vscode-e2e
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ARTIFACTS
from vscode import EXAMPLE, EXTENSION_ID, HERE, RECORDER, REPO, VSCode, wait_for

VSIX = REPO / "editors/vscode/dist/dlm-lsp.vsix"
VERSION = json.loads((REPO / "editors/vscode/package.json").read_text())["version"]
FIRST_FILL_S = 90  # cold: code-server, Python + torch imports, model load, all on a busy 2-core machine
FILL_S = 30
READY = re.compile(r"DLM (ready|\d+ ms)")
facts: dict = {}  # what one test found and a later one needs (the tests share one window)


@pytest.fixture(scope="module")
def vs():
    v = VSCode(ARTIFACTS)
    facts["install"] = v.cli("--install-extension", str(VSIX), "--force") if VSIX.exists() else None
    try:
        v.start()
        yield v
    finally:
        v.close()
        (ARTIFACTS / "timings.json").write_text(json.dumps({k: facts[k] for k in facts if k.endswith("_s")}, indent=2))


def needs(*keys):
    for k in keys:
        if k not in facts:
            pytest.fail(f"an earlier test did not get as far as {k!r}")


def new_ghost(vs: VSCode, after: float, timeout: float = FILL_S) -> tuple[str, dict]:
    """Waits for ghost text shown after `after` (a time), and gives it with the fill it came from."""
    def shown():
        for h in vs.history():
            if h["t"] > after and h["ghost"]:
                return h
        return None

    h = wait_for(shown, timeout, "ghost text")
    time.sleep(0.2)  # the ghost text may be drawn in pieces
    ghost = vs.ghost() or h["ghost"]
    fills = [f for f in vs.fills() if f["items"]]
    assert fills, "ghost text shown, but the server sent no fill"
    return ghost, fills[-1]


def typed_part(doc: str, item: dict, cursor: tuple[int, int]) -> str:
    """The part of a fill's insertText the document already has (range start up to the cursor)."""
    start = item["range"]["start"]
    assert start["line"] == cursor[0], (item, cursor)
    return doc.split("\n")[cursor[0]][start["character"]:cursor[1]]


def apply(doc: str, item: dict) -> str:
    lines = doc.split("\n")
    r = item["range"]
    offset = lambda p: sum(len(l) + 1 for l in lines[: p["line"]]) + p["character"]  # noqa: E731
    return doc[: offset(r["start"])] + item["insertText"] + doc[offset(r["end"]):]


# ---------------------------------------------------------------------------------------------------


def test_vsix_installs(vs):
    r = facts["install"]
    assert r is not None, f"{VSIX} missing: build it with `npm run package` in editors/vscode"
    assert r.returncode == 0, r.stdout + r.stderr
    listed = vs.cli("--list-extensions", "--show-versions")
    assert f"{EXTENSION_ID}@{VERSION}" in listed.stdout.split(), listed.stdout + listed.stderr


def test_server_settings_are_user_settings(vs):
    """The Settings UI's User tab lists dlm.server.path (with machine-overridable it did not)."""
    vs.page.keyboard.press("Control+Comma")
    vs.page.locator(".settings-editor").wait_for(state="visible")
    time.sleep(1)  # the search box takes the focus once the editor is built
    vs.page.keyboard.type("dlm.server")
    user_tab = vs.page.locator(".settings-editor .settings-tabs-widget .action-label", has_text="User").first
    user_tab.click()
    found = vs.page.locator(".settings-editor .setting-item-contents", has_text="Server: Path")
    found.first.wait_for(state="visible", timeout=20_000)
    assert "dlm-lsp executable" in found.first.inner_text()
    vs.page.keyboard.press("Control+w")  # closes the settings editor


def test_opening_python_file_starts_server(vs):
    """Status bar: starting/loading while the server starts, then ready; a user types at once."""
    vs.explorer_row("src").click()  # expands it
    row = vs.explorer_row("example.py")
    t_open = time.time()
    row.click()
    vs.page.locator(".monaco-editor .view-lines").first.wait_for(state="visible")
    vs.go_to(7, 9)  # the empty loop body
    vs.page.keyboard.type("s")  # typed while the server loads: answered empty, asked again once ready
    facts["open_t"] = t_open
    facts["typed_t"] = time.time()
    wait_for(lambda: READY.search(vs.status()), FIRST_FILL_S, "the status bar to say DLM ready")
    facts["ready_s"] = round(time.time() - t_open, 1)
    shown = [h["status"] for h in vs.history() if h["status"]]
    assert any("loading" in s or "starting" in s for s in shown), shown
    # the engine starts with the server's process (DLM_LSP_PRESTART below), so "loading" may be over
    # before the bar is sampled; the server said it
    states = [m["params"]["state"] for m in vs.sent("dlm/status")]
    assert "loading" in states and states.index("loading") < states.index("ready"), states
    assert vs.sent("initialize"), "the extension never started the server"
    options = vs.sent("initialize")[0]["params"]["initializationOptions"]
    assert options["model"] == vs.model and options["postprocess"] is False, options
    assert options["nextEditApproach"] == "propagate" and options["nextEditMinConfidence"] == 0, options
    # the server was told the engine's options as its process started (DLM_LSP_PRESTART), so it
    # started the engine before the handshake
    tee = vs.lsp()[0]["pid"]
    environ = dict(v.partition("=")[::2] for v in Path(f"/proc/{tee}/environ").read_text().split("\0") if v)
    hint = json.loads(environ["DLM_LSP_PRESTART"])
    assert hint == {"model": vs.model, "device": "cpu", "engine": None}, hint


def test_progress_while_loading(vs):
    """The server's $/progress shows in the status bar (window progress) while the model loads."""
    needs("ready_s")
    init = vs.sent("initialize")[-1]["params"]
    assert init["capabilities"]["window"]["workDoneProgress"] is True
    progress = [m["params"]["value"] for m in vs.sent("$/progress")]
    assert [p["kind"] for p in progress][:1] == ["begin"] and progress[-1]["kind"] == "end", progress
    shown = [h["progress"] for h in vs.history() if h["progress"]]
    assert any("dlm-lsp" in p and "loading model" in p for p in shown), shown


def test_ghost_text_from_server(vs):
    """The ghost text is exactly what the server sent (less what is already typed)."""
    needs("typed_t")
    ghost, fill = new_ghost(vs, facts["typed_t"], FIRST_FILL_S)
    t_first = next(h["t"] for h in vs.history() if h["ghost"])
    facts["cold_start_to_first_ghost_s"] = round(t_first - facts["open_t"], 1)
    facts["cold_server_to_first_fill_s"] = server_to_first_fill_s(vs)
    item = fill["items"][0]
    doc = EXAMPLE.replace("\n        \n", "\n        s\n")
    cursor = (6, 9)
    assert fill["params"]["position"] == {"line": 6, "character": 9}
    expected = item["insertText"][len(typed_part(doc, item, cursor)):]
    assert ghost == expected, (ghost, item)
    vs.page.screenshot(path=str(ARTIFACTS / "ghost-text.png"))
    facts["ghost"] = (doc, item)


def test_tab_inserts_exactly_it(vs):
    needs("ghost")
    doc, item = facts["ghost"]
    vs.page.keyboard.press("Tab")
    # no wait for the ghost text to go: VS Code asks again at once after an accept, and the test
    # model answers within a poll interval, so a new ghost text may already stand there. The saved
    # file says whether Tab inserted exactly the item (the keys are handled in order).
    vs.page.keyboard.press("Control+s")
    want = apply(doc, item)
    wait_for(lambda: vs.example.read_text() == want, 10, f"example.py to be saved as {want!r}")
    facts["doc"] = want


def test_escape_dismisses(vs):
    needs("doc")
    vs.page.keyboard.press("End")
    t = time.time()
    vs.page.keyboard.press("Enter")  # a new line in the loop body: a new fill
    new_ghost(vs, t)
    vs.page.keyboard.press("Escape")
    wait_for(lambda: not vs.ghost(), 3, "Escape to remove the ghost text")
    time.sleep(1.0)
    assert not vs.ghost(), "the ghost text came back without typing"


def test_typing_something_else_removes_it(vs):
    needs("doc")
    t = time.time()
    vs.page.keyboard.type("q")
    old, fill = new_ghost(vs, t)
    n_fills = len(vs.fills())
    other = "z" if not old.startswith("z") else "y"
    t_key = time.time()
    vs.page.keyboard.type(other)
    wait_for(lambda: len(vs.fills()) > n_fills, FILL_S, "a new fill for the new text")
    time.sleep(0.3)
    after = [h["ghost"] for h in vs.history() if h["t"] > t_key]
    assert after and after[0] != old, f"the old ghost text {old!r} stayed after typing {other!r}: {after}"
    now = vs.ghost()
    newest = vs.fills()[-1]
    assert not now or newest["items"], "a ghost text shown that the newest fill does not have"


def test_status_shows_last_latency(vs):
    needs("doc")
    def latest() -> str:
        """What the bar should say now: the latency of the newest dlm/status (a fill may still land
        while we wait, and then the bar follows it)."""
        last = [m["params"] for m in vs.sent("dlm/status")][-1]["lastLatencyMs"]
        assert last is not None
        # The extension rounds with JavaScript's Math.round (halves up: 28.5 -> 29), not Python's
        # round (halves to even: 28.5 -> 28); the server sends latencies to 0.1 ms, so halves occur.
        return f"DLM {math.floor(last + 0.5)} ms"

    wait_for(lambda: latest() in vs.status(), 5, f"the status bar to say {latest()!r} (it says {vs.status()!r})")


def test_setting_change_applies_without_reload(vs):
    """dlm.debounceMs 1200 makes the server wait that long before each fill; 0 undoes it. Both
    take effect in the running window and server (no reload, no restart)."""
    needs("doc")
    n_init = len(vs.sent("initialize"))

    def latencies(since: int) -> list[float]:
        """Request-to-answer times (s) of the fills after the first `since` ones, from the recording."""
        msgs = vs.lsp()
        asked = {m["msg"]["id"]: m["t"] for m in msgs if m["msg"].get("method") == "textDocument/inlineCompletion"}
        done = [m["t"] - asked[m["msg"]["id"]] for m in msgs
                if m["dir"] == "out" and "method" not in m["msg"] and m["msg"].get("id") in asked]
        return done[since:]

    def pushed() -> dict:
        sent = vs.sent("workspace/didChangeConfiguration")
        return sent[-1]["params"]["settings"]["dlm"] if sent else {}

    vs.set_setting("dlm.debounceMs", 1200)
    wait_for(lambda: pushed().get("debounceMs") == 1200, 10, "didChangeConfiguration with debounceMs 1200")
    vs.focus_editor()
    n = len(latencies(0))
    t = time.time()
    vs.page.keyboard.type("w")
    new_ghost(vs, t)
    slow = latencies(n)
    assert slow and min(slow) >= 1.2, f"fills answered in {slow} s, under the 1.2 s debounce"
    vs.set_setting("dlm.debounceMs", 0)
    wait_for(lambda: pushed().get("debounceMs") == 0, 10, "didChangeConfiguration with debounceMs 0")
    vs.focus_editor()
    n = len(latencies(0))
    t = time.time()
    vs.page.keyboard.type("w")
    new_ghost(vs, t)
    assert len(vs.sent("initialize")) == n_init, "the server was restarted for a setting it takes live"


def test_show_log_command(vs):
    needs("ready_s")
    vs.palette("DLM: Show Log")
    output = vs.page.locator(".part.panel .output-view, .part.panel [id='workbench.panel.output']").first
    output.wait_for(state="visible", timeout=20_000)
    # the channel's first line ("starting ...") or the server's own lines: the output view renders only
    # the rows in sight, scrolled to the end, so the first line may be out of sight once a few follow it
    wait_for(lambda: any(s in vs.page.locator(".part.panel").inner_text() for s in ("starting", "dlm.server")), 20,
             "the dlm-lsp log in the Output panel")


def test_toggle_command(vs):
    needs("ready_s")
    vs.focus_editor()
    vs.palette("DLM: Toggle Completions")
    wait_for(lambda: "(off)" in vs.status(), 10, "the status bar to say (off)")
    assert vs.read_settings().get("dlm.enable") is False
    n = len(vs.sent("textDocument/inlineCompletion"))
    vs.focus_editor()
    vs.page.keyboard.type("e")
    time.sleep(2)
    assert len(vs.sent("textDocument/inlineCompletion")) == n, "asked the server while off"
    assert not vs.ghost()
    vs.palette("DLM: Toggle Completions")
    wait_for(lambda: "(off)" not in vs.status(), 10, "the status bar to lose (off)")
    assert vs.read_settings().get("dlm.enable") is True


# The next edit's decorations as drawn: the text shown struck through (removed) and the ghost text
# after it (a decoration's `after` content is CSS ::after content, not text in the DOM).
NEXT_EDIT_DOM = """() => {
  const struck = [], added = [];
  for (const e of document.querySelectorAll('.monaco-editor .view-lines span')) {
    if (e.children.length === 0 && getComputedStyle(e).textDecorationLine.includes('line-through')) struck.push(e.textContent);
    const after = getComputedStyle(e, '::after').content;
    if (after && after !== 'none' && after !== 'normal') added.push(after.replace(/^"|"$/g, ''));
  }
  return { struck: struck.join('|'), added: added.join('|') };
}"""
AREA = "def area(width, height):\n    w = width * 2\n    return width * height + w\n"


def test_next_edit_after_a_rename(vs):
    """Rename a parameter, pause: the server's next edit (nextEditApproach "propagate": the rename
    applied to the other uses) is drawn as decorations, the old name struck through and the new one
    as ghost text after it; Tab applies all of it. Completions are off for this test: the tiny
    model's ghost text would hold off next edits (a shown completion wins)."""
    needs("ready_s")
    area = vs.workspace / "src" / "area.py"
    area.write_text(AREA)
    vs.explorer_row("area.py").click()
    vs.page.locator(".monaco-editor .view-lines", has_text="def area").first.wait_for(state="visible")
    vs.palette("DLM: Toggle Completions")
    wait_for(lambda: "(off)" in vs.status(), 10, "the status bar to say (off)")
    try:
        vs.focus_editor()
        vs.go_to(1, 10)  # before `width` in the parameter list
        vs.page.keyboard.press("Control+Shift+ArrowRight")  # selects `width`
        vs.page.keyboard.type("size")

        def drawn():
            d = vs.page.evaluate(NEXT_EDIT_DOM)
            return d if d["struck"] == "width|width" and d["added"] == "size|size" else None

        drawn_now = wait_for(drawn, FILL_S, "the next edit drawn (width struck through twice, size after each)")
        vs.page.screenshot(path=str(ARTIFACTS / "next-edit.png"))
        asked = vs.sent("dlm/nextEdit")
        assert asked and asked[-1]["params"]["position"]["line"] == 0, asked
        vs.page.keyboard.press("Tab")
        # the edit goes through the extension host (a WorkspaceEdit), so it lands after the key: wait
        # for the editor to show it before saving
        shown = lambda: vs.page.locator(".editor-instance .monaco-editor .view-lines").first.inner_text().replace("\u00a0", " ")  # noqa: E731
        wait_for(lambda: "width" not in shown() and "w = size * 2" in shown(), 10, "the editor to show the edit applied")
        vs.page.keyboard.press("Control+s")
        want = AREA.replace("width", "size")
        wait_for(lambda: area.read_text() == want, 10, f"area.py to be saved as {want!r}")
        wait_for(lambda: not vs.page.evaluate(NEXT_EDIT_DOM)["struck"], 5, "the decorations to go")
        facts["next_edit"] = drawn_now
    finally:
        vs.palette("DLM: Toggle Completions")
        wait_for(lambda: "(off)" not in vs.status(), 10, "the status bar to lose (off)")
        vs.palette("View: Revert and Close Editor")  # back to example.py, where the next tests type


def test_restart_command(vs):
    needs("ready_s")
    n_init = len(vs.sent("initialize"))
    vs.palette("DLM: Restart Server")
    wait_for(lambda: len(vs.sent("initialize")) > n_init, 30, "a new server process")
    assert vs.sent("shutdown") and vs.sent("exit"), "the old server was not shut down"
    wait_for(lambda: READY.search(vs.status()), FIRST_FILL_S, "the restarted server to be ready")
    vs.focus_editor()
    t = time.time()
    vs.page.keyboard.type("r")
    new_ghost(vs, t, FIRST_FILL_S)


def test_missing_server_names_the_setting(vs):
    needs("ready_s")
    vs.set_setting("dlm.server.path", "/nonexistent/dlm-lsp")
    toast = wait_for(lambda: [n for n in vs.notifications() if "dlm.server.path" in n], 30,
                     "a notification that names dlm.server.path")
    assert "/nonexistent/dlm-lsp" in toast[0]
    wait_for(lambda: "server not found" in vs.status(), 10, "the status bar to say server not found")


def test_project_folder_starts_server_before_a_file_opens(vs):
    """A folder with a pyproject.toml activates the extension at once: the model loads while the user
    is still finding a file (activationEvents: workspaceContains)."""
    needs("ready_s")
    vs.set_setting("dlm.server.path", str(HERE / "lsp_tee.py"))  # undo the previous test
    project = vs.root / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "demo"\n')
    (project / "demo.py").write_text(EXAMPLE)
    t = time.time()
    vs.page.goto(vs.page.url.split("?")[0] + f"?folder={project}")
    vs.page.wait_for_selector(".monaco-workbench .part.statusbar")
    def started():
        return [m["pid"] for m in vs.lsp() if m["msg"].get("method") == "initialize" and
                m["msg"]["params"]["rootUri"].endswith("/project")]

    pid = wait_for(started, FIRST_FILL_S, "a server for the project folder, with no file open")[0]
    assert vs.page.locator(".editor-instance .monaco-editor").count() == 0, "a file was open"

    def ready():
        statuses = [m["msg"] for m in vs.lsp() if m["pid"] == pid and m["msg"].get("method") == "dlm/status"]
        return statuses and statuses[-1]["params"]["state"] == "ready"

    wait_for(ready, FIRST_FILL_S, "the model to be ready")
    facts["project_folder_to_ready_s"] = round(time.time() - t, 1)
    vs.page.evaluate(RECORDER)  # the reloaded window's recording
    facts["project_file_to_first_ghost_s"] = _first_ghost_after_opening(vs, "demo.py")


def server_to_first_fill_s(vs: VSCode) -> float:
    """Seconds from the newest server's start (its lsp_tee.py, a few ms before it) to its first
    non-empty fill: the part of a cold start that is the server's, whatever VS Code takes around it."""
    return round(next(f["t"] for f in vs.fills() if f["items"]), 2)  # vs.fills(): the newest server's


def _first_ghost_in_a_new_window(vs: VSCode, name: str, top: bool = False) -> float:
    """Opens a new folder holding src/example.py (example.py at its top with `top`: the folder then
    starts the server with the window) in the window; once the window has settled (5 s: its
    extension host starting is VS Code's start, not the file's opening) opens the file from the
    explorer and types at the empty loop body at once; seconds from the click to the first ghost."""
    folder = vs.root / name
    (folder if top else folder / "src").mkdir(parents=True)
    (folder / ("example.py" if top else "src/example.py")).write_text(EXAMPLE)
    vs.page.goto(vs.page.url.split("?")[0] + f"?folder={folder}")
    vs.page.wait_for_selector(".monaco-workbench .part.statusbar")
    vs.page.evaluate(RECORDER)
    vs.explorer_row("example.py" if top else "src")
    time.sleep(5)
    if top:  # the server started with the window, no file open
        wait_for(lambda: [m for m in vs.sent("initialize") if m["params"]["rootUri"].endswith(f"/{name}")], 30,
                 f"a server for {name}, started with the window")
        assert vs.page.locator(".editor-instance .monaco-editor").count() == 0, "a file was open"
    else:
        vs.explorer_row("src").click()  # expands it: finding the file, before it opens
    return _first_ghost_after_opening(vs, "example.py")


def _first_ghost_after_opening(vs: VSCode, name: str) -> float:
    """Opens `name` (the example) from the explorer and types at the empty loop body at once, as a
    user does; seconds from the click to the first ghost text."""
    row = vs.explorer_row(name)
    t_open = time.time()
    row.click()
    vs.page.locator(".monaco-editor .view-lines").first.wait_for(state="visible")
    vs.go_to(7, 9)
    vs.page.keyboard.type("s")
    new_ghost(vs, t_open, FIRST_FILL_S)
    return round(next(h["t"] for h in vs.history() if h["t"] > t_open and h["ghost"]) - t_open, 1)


def test_first_ghost_on_the_shared_engine_cold_and_running(vs):
    """The engine users get by default, the shared one (their servers' engine daemon): a window's first
    ghost text when no engine runs (the server starts it as the server's process starts), then in a
    new window while that engine runs. The times are reported (timings.json), not asserted."""
    needs("ready_s")
    runtime = Path(tempfile.mkdtemp(prefix="dlmrt-", dir="/tmp"))  # short: a socket path has 107 bytes
    env_file = Path(f"{vs.lsp_log}.env")  # lsp_tee.py adds it to the next servers' environment
    env_file.write_text(json.dumps({"DLM_ENGINE": "shared", "XDG_RUNTIME_DIR": str(runtime), "DLM_ENGINE_IDLE_S": "300"}))
    try:
        facts["shared_cold_to_first_ghost_s"] = _first_ghost_in_a_new_window(vs, "shared-cold")
        facts["shared_cold_server_to_first_fill_s"] = server_to_first_fill_s(vs)
        engines = {p: p.stat().st_ino for p in runtime.rglob("engine-*.sock")}
        assert len(engines) == 1, f"not one shared engine: {engines}"
        facts["shared_running_to_first_ghost_s"] = _first_ghost_in_a_new_window(vs, "shared-running")
        facts["shared_running_server_to_first_fill_s"] = server_to_first_fill_s(vs)
        # a folder with a Python file at its top starts the server with the window: when the file
        # opens, only the fill is left
        facts["shared_running_code_folder_to_first_ghost_s"] = _first_ghost_in_a_new_window(vs, "code-folder", top=True)
        assert {p: p.stat().st_ino for p in runtime.rglob("engine-*.sock")} == engines, "a second engine started"
    finally:
        env_file.unlink(missing_ok=True)
        stop = [*vs.server_cmd[:-1], "engine", "--stop"] if vs.server_cmd[-1] == "serve" else None
        if stop:
            subprocess.run(stop, env=dict(os.environ, XDG_RUNTIME_DIR=str(runtime)), capture_output=True, timeout=60)
        shutil.rmtree(runtime, ignore_errors=True)
