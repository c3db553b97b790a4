// Loads the packaged bundle (out/extension.js) in plain node with a minimal stand-in for the `vscode`
// module, to check activation, command registration and the missing-server path without VS Code.
import assert from 'node:assert/strict';
import Module from 'node:module';
import * as path from 'node:path';
import { test } from 'node:test';
import { COMMANDS } from '../src/commands';

type Fn = (...args: unknown[]) => unknown;
const calls = { errors: [] as string[], commands: new Map<string, Fn>(), logs: [] as string[] };
const statusItem = { text: '', tooltip: '', show() {}, dispose() {} } as Record<string, unknown>;
const settings: Record<string, unknown> = { 'server.path': 'dlm-lsp-missing-for-test', 'server.args': ['serve'], 'server.pythonPath': '' };
const disposable = { dispose() {} };

// Anything the bundle touches at load time but this test does not care about is an inert class.
const inert = new Proxy(class {}, { get: (target, key) => (key in target ? Reflect.get(target, key) : inert) });
const vscode = new Proxy(
  {
    window: {
      createOutputChannel: () => ({ info: (m: string) => calls.logs.push(m), error: (m: string) => calls.logs.push(m), warn() {}, show() {}, dispose() {} }),
      createStatusBarItem: () => statusItem,
      showErrorMessage: async (m: string) => void calls.errors.push(m),
      createTextEditorDecorationType: () => disposable,
      onDidChangeActiveTextEditor: () => disposable,
      onDidChangeTextEditorVisibleRanges: () => disposable,
      activeTextEditor: undefined,
    },
    workspace: {
      workspaceFolders: undefined,
      isTrusted: true,
      onDidGrantWorkspaceTrust: () => disposable,
      getConfiguration: () => ({ get: (k: string, d: unknown) => settings[k] ?? d, inspect: () => undefined, update: async () => {} }),
      onDidChangeConfiguration: () => disposable,
      onDidChangeTextDocument: () => disposable,
      onDidCloseTextDocument: () => disposable,
    },
    commands: {
      registerCommand: (id: string, fn: Fn) => (calls.commands.set(id, fn), disposable),
      executeCommand: async () => undefined,
    },
    StatusBarAlignment: { Left: 1, Right: 2 },
    OverviewRulerLane: { Left: 1, Center: 2, Right: 4, Full: 7 },
    ConfigurationTarget: { Global: 1, Workspace: 2 },
    ThemeColor: class {},
  },
  { get: (target, key) => (key in target ? Reflect.get(target, key) : inert) },
);

test('activates, registers its commands and reports a missing server', async () => {
  const load = (Module as unknown as { _load: Fn })._load;
  (Module as unknown as { _load: Fn })._load = function (request: unknown, ...rest: unknown[]) {
    return request === 'vscode' ? vscode : load.call(this, request, ...rest);
  };
  try {
    const ext = require(path.resolve(__dirname, '../extension.js'));
    const subscriptions: unknown[] = [];
    ext.activate({ subscriptions });
    await new Promise((r) => setTimeout(r, 50));
    assert.deepEqual([...calls.commands.keys()].sort(), Object.values(COMMANDS).sort());
    assert.equal(calls.errors.length, 1, calls.logs.join('\n'));
    assert.match(calls.errors[0], /dlm-lsp-missing-for-test.*not found/);
    assert.match(String(statusItem.text), /server not found/);
    await ext.deactivate();
  } finally {
    (Module as unknown as { _load: Fn })._load = load;
  }
});
