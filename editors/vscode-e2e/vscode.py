"""A real VS Code (code-server) in headless Chromium, driven through Playwright, with the dlm-lsp
extension installed from its .vsix and the real server behind it.

code-server runs on 127.0.0.1 in a process group of its own (killed as a group), with its own
user-data, extensions and XDG folders under a temporary directory; nothing is downloaded. The
server command goes through `lsp_tee.py`, which records every LSP message, so a test can compare
what VS Code shows with what the server sent.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
EXTENSION_ID = "dlm-lsp.dlm-lsp"
DEFAULTS = {k: v.get("default") for k, v in json.loads((REPO / "editors/vscode/package.json").read_text())
            ["contributes"]["configuration"]["properties"].items()}
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
# A document with a loop body to fill; line 7 (index 6) is the empty body, indented 8 spaces.
EXAMPLE = "import os\n\n\ndef total(items):\n    s = 0\n    for x in items:\n        \n    return s\n"

# Samples the status bar item, the window progress and the ghost text every 40 ms and keeps each
# change, so a test can ask what was shown when (a state shown for 100 ms is not missed).
RECORDER = """() => {
  if (window.__dlm) return;
  window.__dlm = [];
  const text = (id) => { const e = document.getElementById(id); return e ? e.textContent.replace(/\\u00a0/g, ' ').trim() : null; };
  const ghost = () => [...document.querySelectorAll('.monaco-editor .view-lines .ghost-text-decoration')]
    .map((e) => e.textContent).join('').replace(/\\u00a0/g, ' ');
  let last = '';
  setInterval(() => {
    const s = { status: text('%s'), progress: text('status.progress'), ghost: ghost() };
    const key = JSON.stringify(s);
    if (key !== last) { last = key; window.__dlm.push({ t: Date.now() / 1000, ...s }); }
  }, 40);
}""" % EXTENSION_ID


def env_from_setup() -> dict[str, str]:
    """The tool paths editors/setup.sh wrote to .cache/editors/env.sh (overridable by the environment)."""
    found = {}
    env_sh = Path(os.environ.get("DLM_EDITORS_CACHE", REPO / ".cache/editors")) / "env.sh"
    if env_sh.exists():
        for line in env_sh.read_text().splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            found[key] = value.strip("'")
    found.update({k: v for k, v in os.environ.items() if k.startswith("DLM_E2E_")})
    missing = [k for k in ("DLM_E2E_NODE", "DLM_E2E_CODE_SERVER", "DLM_E2E_CHROMIUM") if not found.get(k)]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} unknown: run editors/setup.sh vscode first")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float, what: str, interval: float = 0.1):
    """Returns cond()'s first truthy value; fails naming `what` after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class VSCode:
    """One code-server, one browser page, one workspace folder with src/example.py."""

    def __init__(self, artifacts: Path):
        self.tools = env_from_setup()
        self.artifacts = artifacts
        self.root = Path(tempfile.mkdtemp(prefix="dlm-vscode-e2e-"))
        self.user_data = self.root / "user-data"
        self.extensions = self.root / "extensions"
        self.workspace = self.root / "workspace"
        self.lsp_log = self.root / "lsp.jsonl"
        for d in (self.user_data / "User", self.user_data / "Machine", self.extensions, self.workspace):
            d.mkdir(parents=True)
        # in a subfolder: a folder with source files at its top starts the server with the window
        # (activationEvents), and the first tests open a file in a folder that does not
        (self.workspace / "src").mkdir()
        self.example = self.workspace / "src" / "example.py"
        self.example.write_text(EXAMPLE)
        (self.root / "config.yaml").write_text("")  # keeps code-server from writing ~/.config/code-server
        server = os.environ.get("DLM_LSP_CMD", f"{REPO}/.venv/bin/dlm-lsp serve").split()
        self.server_cmd = server
        self.user_settings = {
            # dlm.server.* in plain User settings: they used to be machine-overridable, which VS Code
            # hides from User settings in a remote window (code-server's always is).
            "dlm.server.path": str(HERE / "lsp_tee.py"),
            "dlm.server.args": [str(self.lsp_log), "--", *server],
            "dlm.budgetMs": 1500,  # a busy 2-core machine; the tiny model needs far less
            "workbench.startupEditor": "none",
            # VS Code 1.139 opens some editors (Settings among them) as a modal over the workbench by
            # default, and a startup experiment may turn that on or off per profile: one run of 4
            # got the modal, which no check found and which then swallowed every later click.
            # Editors in tabs, always, as the tests were written for.
            "workbench.editor.useModal": "off",
            "workbench.tips.enabled": False,
            "workbench.secondarySideBar.defaultVisibility": "hidden",
            "chat.disableAIFeatures": True,
            "files.autoSave": "off",
            "editor.minimap.enabled": False,
            # no suggest widget: Tab and Enter must reach the inline completion, not a word list
            "editor.quickSuggestions": {"other": "off", "comments": "off", "strings": "off"},
            "editor.suggestOnTriggerCharacters": False,
            "editor.wordBasedSuggestions": "off",
            "telemetry.telemetryLevel": "off",
            "extensions.autoCheckUpdates": False,
            "extensions.autoUpdate": False,
            "update.mode": "none",
        }
        # The tiny random-weight model of the editor suites (Makefile: .cache/editor-test-model): fast,
        # and its fills are never empty, so no check hinges on what a real model fills at one spot.
        model = os.environ.get("DLM_LSP_MODEL") or str(REPO / ".cache/editor-test-model")
        # dlm.model and dlm.device are machine-scoped (a workspace must not choose the weights or the
        # device), and VS Code reads a machine-scoped setting in a remote window, which code-server's
        # always is, from the Remote ("Machine") settings: in User settings it was honoured in some
        # runs, not others.
        machine: dict[str, str] = {"dlm.device": "cpu"}
        if model == "default":  # the bundled model: for the docs' screenshot; its fill may be empty
            self.model = None
        elif not (Path(model) / "config.json").exists():
            raise RuntimeError(f"no test model at {model}: `make test-editors` writes it (or set DLM_LSP_MODEL)")
        else:
            self.model = machine["dlm.model"] = model
        (self.user_data / "Machine" / "settings.json").write_text(json.dumps(machine, indent=2))
        self.write_settings()
        self.proc: subprocess.Popen | None = None
        self.pw = self.browser = self.page = None

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Runs code-server's command line (install / list extensions) with this profile."""
        cmd = [self.tools["DLM_E2E_NODE"], self.tools["DLM_E2E_CODE_SERVER"], "--config", str(self.root / "config.yaml"),
               "--user-data-dir", str(self.user_data), "--extensions-dir", str(self.extensions), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env())

    def env(self) -> dict[str, str]:
        env = dict(os.environ, XDG_DATA_HOME=str(self.root / "xdg-data"), XDG_CONFIG_HOME=str(self.root / "xdg-config"))
        # postprocess=false (a server test hook) keeps the tiny model's fill from being filtered to
        # nothing; nextEditApproach "propagate" makes next edits the user's recent renames applied
        # near the cursor, without the model, so a test knows what dlm/nextEdit proposes, and
        # nextEditMinConfidence 0 shows each (the edit gate, tested in tests/, would keep back a
        # parameter renamed once: release pairs say such a rename is carried less than a third of the
        # time). The extension passes DLM_LSP_INIT_OPTIONS through to initializationOptions.
        options = {"postprocess": False, "nextEditApproach": "propagate", "nextEditMinConfidence": 0}
        env["DLM_LSP_INIT_OPTIONS"] = json.dumps(options)
        env.setdefault("DLM_ENGINE", "inproc")  # an engine inside the server: dies with the process group
        return env

    def write_settings(self, **changes) -> None:
        """Rewrites User settings.json (VS Code watches it, as it does when a user edits it)."""
        for key, value in changes.items():
            if value is None:
                self.user_settings.pop(key, None)
            else:
                self.user_settings[key] = value
        (self.user_data / "User" / "settings.json").write_text(json.dumps(self.user_settings, indent=2))

    def read_settings(self) -> dict:
        """User settings.json as VS Code last wrote it. VS Code truncates the file before it writes
        it, so a read can land between the two: it is retried until the file parses (5 s)."""
        path = self.user_data / "User" / "settings.json"

        def parsed():
            try:
                return [json.loads(path.read_text())]
            except json.JSONDecodeError:
                return None

        return wait_for(parsed, 5, f"{path} to hold whole JSON", interval=0.05)[0]

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        port = free_port()
        self.code_server_log = open(self.root / "code-server.log", "w")
        cmd = [self.tools["DLM_E2E_NODE"], self.tools["DLM_E2E_CODE_SERVER"], "--config", str(self.root / "config.yaml"),
               "--user-data-dir", str(self.user_data), "--extensions-dir", str(self.extensions),
               "--auth", "none", "--bind-addr", f"127.0.0.1:{port}", "--disable-telemetry", "--disable-update-check",
               "--disable-workspace-trust", "--disable-getting-started-override", "--ignore-last-opened", str(self.workspace)]
        self.proc = subprocess.Popen(cmd, stdout=self.code_server_log, stderr=subprocess.STDOUT, env=self.env(),
                                     start_new_session=True)  # its own process group: killed as one

        def listening():
            if self.proc.poll() is not None:
                raise AssertionError(f"code-server exited ({self.proc.returncode}): see {self.root / 'code-server.log'}")
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                return True
            except OSError:
                return False

        wait_for(listening, 60, "code-server to listen")
        self.pw = sync_playwright().start()
        self.browser = self.pw.chromium.launch(executable_path=self.tools["DLM_E2E_CHROMIUM"], args=CHROMIUM_ARGS,
                                               timeout=60_000)
        self.page = self.browser.new_page(viewport={"width": 1200, "height": 700})
        self.page.set_default_timeout(20_000)  # UI waits; fills have their own
        self.page.goto(f"http://127.0.0.1:{port}/?folder={self.workspace}")
        self.page.wait_for_selector(".monaco-workbench .part.statusbar")
        self.page.evaluate(RECORDER)

    def close(self) -> None:
        for step in (lambda: self.browser and self.browser.close(), lambda: self.pw and self.pw.stop()):
            try:
                step()
            except Exception:  # noqa: BLE001 - best effort; the process group goes below anyway
                pass
        if self.proc is not None:
            pgid = self.proc.pid

            def group_alive():
                try:
                    os.killpg(pgid, 0)
                    return True
                except ProcessLookupError:
                    return False

            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                if not group_alive():
                    break
                os.killpg(pgid, sig)
                try:
                    self.proc.wait(grace)  # reaps the leader; the rest of the group may linger
                except subprocess.TimeoutExpired:
                    pass
                end = time.monotonic() + grace
                while group_alive() and time.monotonic() < end:
                    time.sleep(0.2)
            self.code_server_log.close()
        for f in [self.lsp_log, self.root / "code-server.log", *self.user_data.glob("logs/*/exthost*/dlm-lsp.dlm-lsp/*.log")]:
            if f.exists():
                shutil.copy(f, self.artifacts / f.name)
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ what is shown

    def history(self) -> list[dict]:
        """Every change of status bar item / window progress / ghost text so far, with its time."""
        return self.page.evaluate("() => window.__dlm")

    def now_shown(self) -> dict:
        return self.history()[-1]

    def status(self) -> str:
        return self.now_shown()["status"] or ""

    def ghost(self) -> str:
        return self.now_shown()["ghost"]

    def notifications(self) -> list[str]:
        return self.page.eval_on_selector_all(".notifications-toasts .notification-toast", "els => els.map(e => e.innerText)")

    # ------------------------------------------------------------------ what the server said

    def lsp(self) -> list[dict]:
        if not self.lsp_log.exists():
            return []
        return [json.loads(line) for line in self.lsp_log.read_text().splitlines() if line.strip()]

    def fills(self) -> list[dict]:
        """The inline completion exchanges of the newest server process: [{t, params, items}]."""
        msgs = self.lsp()
        starts = [m["pid"] for m in msgs if m["dir"] == "in" and m["msg"].get("method") == "initialize"]
        msgs = [m for m in msgs if m["pid"] == starts[-1]] if starts else msgs
        asked = {m["msg"]["id"]: m for m in msgs if m["dir"] == "in" and m["msg"].get("method") == "textDocument/inlineCompletion"}
        out = []
        for m in msgs:
            if m["dir"] == "out" and "method" not in m["msg"] and m["msg"].get("id") in asked:
                result = m["msg"].get("result") or {}
                items = result.get("items", []) if isinstance(result, dict) else result
                out.append({"t": m["t"], "params": asked[m["msg"]["id"]]["msg"]["params"], "items": items})
        return out

    def sent(self, method: str) -> list[dict]:
        return [m["msg"] for m in self.lsp() if m["msg"].get("method") == method]

    # ------------------------------------------------------------------ doing things

    def palette(self, title: str) -> None:
        """Runs a command from the command palette by its title, as a user would."""
        self.page.keyboard.press("F1")
        box = self.page.locator(".quick-input-widget input")
        box.wait_for(state="visible")
        box.fill(f">{title}")
        row = self.page.locator(".quick-input-widget .monaco-list-row", has_text=title).first
        row.wait_for(state="visible")
        self.page.keyboard.press("Enter")
        self.page.locator(".quick-input-widget").wait_for(state="hidden")

    def set_setting(self, key: str, value) -> None:
        """Changes a User setting in the Settings editor, as a user would (code-server does not watch
        settings.json for changes made outside it), and closes the editor again."""
        page = self.page
        page.keyboard.press("Control+Comma")
        page.locator(".settings-editor").wait_for(state="visible")
        page.locator(".settings-editor .settings-tabs-widget .action-label", has_text="User").first.click()
        row = page.locator(f'.settings-editor [data-key="{key}"]')

        def found():
            # (re)types the query: the box may not have had the focus yet, or the extension's
            # settings may not have been registered when the editor opened
            page.locator(".settings-editor .suggest-input-container").first.click()
            page.keyboard.press("Control+a")
            page.keyboard.type(key)
            try:
                row.first.wait_for(state="visible", timeout=3000)
                return True
            except Exception:  # noqa: BLE001 - playwright's TimeoutError: try again
                return False

        wait_for(found, 30, f"{key} in the Settings editor")
        if isinstance(value, bool):
            box = row.locator(".setting-value-checkbox").first
            if (box.get_attribute("aria-checked") == "true") != value:
                box.click()
        else:
            field = row.locator("input").first
            field.fill(str(value))
            page.keyboard.press("Tab")  # the edit is committed when the field loses the focus
        # VS Code leaves a value equal to the default out of settings.json
        default = DEFAULTS.get(key)
        try:
            # 30 s: on a loaded machine (session 33: make test-editors beside three training jobs) the
            # Settings editor took longer than 10 s to write the value
            wait_for(lambda: self.read_settings().get(key, default) == value, 30, f"settings.json to get {key} = {value!r}")
        finally:
            page.keyboard.press("Control+w")
            page.locator(".settings-editor").wait_for(state="hidden")

    def focus_editor(self) -> None:
        """Gives the text editor the keyboard focus without moving its cursor (a click would)."""
        self.page.locator(".editor-instance .monaco-editor .native-edit-context, .editor-instance .monaco-editor textarea.inputarea").first.focus()

    def explorer_row(self, name: str):
        """The explorer's row of a file or folder, once it is shown."""
        row = self.page.locator(".explorer-folders-view .monaco-list-row", has_text=name).first
        row.wait_for(state="visible", timeout=30_000)
        return row

    def go_to(self, line: int, column: int) -> None:
        """Puts the cursor at a 1-based line and column (Ctrl+G)."""
        self.page.keyboard.press("Control+g")
        box = self.page.locator(".quick-input-widget input")
        box.wait_for(state="visible")
        box.fill(f":{line}:{column}")
        self.page.keyboard.press("Enter")
        self.page.locator(".quick-input-widget").wait_for(state="hidden")
