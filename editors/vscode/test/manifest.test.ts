// The manifest (package.json `contributes`) must match what the code reads and registers.
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import * as path from 'node:path';
import { test } from 'node:test';
import { COMMANDS } from '../src/commands';
import { LaunchError, resolveLaunch } from '../src/launch';
import { CLIENT_SETTINGS, DEFAULT_LANGUAGES, documentSelector, ENGINE_KEY_ENV, engineLaunch, engineSetting, extraInitOptions, LIBRARY_SETTINGS, PRESTART_ENV, prestartEnv, SERVER_SETTINGS, serverOptions } from '../src/settings';
import { statusView } from '../src/status';

const root = path.resolve(__dirname, '../..');
const manifest = JSON.parse(readFileSync(path.join(root, 'package.json'), 'utf8'));
const properties: Record<string, { default: unknown; scope?: string }> = manifest.contributes.configuration.properties;

test('every setting the code reads is contributed, and nothing else', () => {
  const expected = [...SERVER_SETTINGS, ...CLIENT_SETTINGS, ...LIBRARY_SETTINGS].map((k) => `dlm.${k}`);
  assert.deepEqual(Object.keys(properties).sort(), expected.sort());
});

test('contributed defaults are the defaults the code falls back to', () => {
  const fromManifest = serverOptions((key) => properties[`dlm.${key}`].default);
  assert.deepEqual(fromManifest, serverOptions(() => undefined));
  assert.deepEqual(fromManifest, { model: null, device: 'auto', budgetMs: 300, debounceMs: 0, maxFillTokens: 64, contextTokens: null, languages: DEFAULT_LANGUAGES, minConfidence: null, workspaceContext: true, engine: null });
});

test('the engine endpoint is a user setting; its key goes to the environment, never the options', () => {
  assert.equal(properties['dlm.engine'].scope, 'machine'); // a workspace cannot send the code elsewhere
  // ...nor choose the weights, nor the device they run on (the server refuses them from settings)
  assert.equal(properties['dlm.model'].scope, 'machine');
  assert.equal(properties['dlm.device'].scope, 'machine');
  assert.deepEqual(engineSetting({ url: ' http://box:8765/v1 ', api: 'mercury', apiKey: 'leak' }), { url: 'http://box:8765/v1', api: 'mercury' });
  assert.equal(engineSetting({ api: 'mercury' }), null);
  const none = engineLaunch({ url: 'http://box/v1' }, undefined);
  assert.deepEqual(none, { engine: { url: 'http://box/v1' }, env: {} });
  const stored = engineLaunch({ url: 'https://api.example.test/v1', api: 'mercury' }, 'sk-secret');
  assert.deepEqual(stored.env, { [ENGINE_KEY_ENV]: 'sk-secret' });
  assert.equal(stored.engine?.apiKeyEnv, ENGINE_KEY_ENV);
  assert.ok(!JSON.stringify(stored.engine).includes('sk-secret'));
  const named = engineLaunch({ url: 'https://x/v1', apiKeyEnv: 'INCEPTION_API_KEY' }, 'k');
  assert.deepEqual(named.env, { INCEPTION_API_KEY: 'k' });
});

test('contributed commands are exactly the registered ones', () => {
  const contributed = manifest.contributes.commands.map((c: { command: string }) => c.command).sort();
  assert.deepEqual(contributed, Object.values(COMMANDS).sort());
});

test('activates on every default language; main points at the build', () => {
  for (const lang of DEFAULT_LANGUAGES) assert.ok(manifest.activationEvents.includes(`onLanguage:${lang}`), lang);
  // ...and when a folder of such a project opens, so the model loads before the first file does
  assert.ok(manifest.activationEvents.includes('workspaceContains:pyproject.toml'));
  // or holds such files at its top (a pattern without "**" is matched there only: no workspace search)
  for (const ext of ['py', 'js', 'jsx', 'ts', 'tsx', 'go', 'rs']) assert.ok(manifest.activationEvents.includes(`workspaceContains:*.${ext}`), ext);
  assert.ok(existsSync(path.join(root, manifest.main)), `${manifest.main} missing: run npm run build`);
});

test('engines.vscode satisfies vscode-languageclient and matches @types/vscode', () => {
  const lib = JSON.parse(readFileSync(path.join(root, 'node_modules/vscode-languageclient/package.json'), 'utf8'));
  const types = JSON.parse(readFileSync(path.join(root, 'node_modules/@types/vscode/package.json'), 'utf8'));
  const [major, minor] = lib.version.split('.').map(Number);
  assert.ok(major > 10 || (major === 10 && minor >= 1), `vscode-languageclient ${lib.version} lacks built-in inline completion`);
  assert.equal(manifest.engines.vscode, lib.engines.vscode);
  assert.equal(`^${types.version}`, manifest.engines.vscode);
});

test('document selector: listed languages, or everything for "*"', () => {
  assert.deepEqual(documentSelector(['go']), [{ scheme: 'file', language: 'go' }, { scheme: 'untitled', language: 'go' }]);
  assert.deepEqual(documentSelector(['go', '*']), [{ scheme: 'file' }, { scheme: 'untitled' }]);
});

test('a missing server is one clear message', () => {
  const settings = { path: 'dlm-lsp-does-not-exist', args: ['serve'], pythonPath: '' };
  assert.throws(() => resolveLaunch(settings, { PATH: '/nonexistent' }, []), (e: Error) => {
    return e instanceof LaunchError && /not found/.test(e.message) && /dlm\.server\.path/.test(e.message);
  });
  const python = { path: 'dlm-lsp', args: ['serve'], pythonPath: '/nonexistent/python3' };
  assert.throws(() => resolveLaunch(python, {}, []), /dlm\.server\.pythonPath/);
});

test('status bar shows state and last latency', () => {
  const ready = { state: 'ready', model: 'default', device: 'cpu', lastLatencyMs: 123.4, message: null } as const;
  assert.match(statusView(ready, true).text, /DLM 123 ms$/);
  assert.match(statusView(ready, false).text, /\(off\)$/);
  assert.match(statusView({ ...ready, state: 'loading', lastLatencyMs: null }, true).text, /loading/);
  const error = statusView({ ...ready, state: 'error', message: 'no such folder' }, true);
  assert.ok(error.error && /no such folder/.test(error.tooltip));
  assert.ok(statusView('missing', true).error);
});

test('server command settings work from User settings in a remote window (code-server) too', () => {
  // VS Code drops machine and machine-overridable settings from local User settings in a remote
  // window, and code-server's window is always remote: those scopes made dlm.server.* look ignored.
  for (const key of CLIENT_SETTINGS.filter((k) => k.startsWith('server.'))) {
    assert.equal(properties[`dlm.${key}`].scope, 'window', key);
  }
  // ...and a workspace that is not trusted cannot choose the program that runs.
  const untrusted = manifest.capabilities.untrustedWorkspaces;
  assert.equal(untrusted.supported, 'limited');
  assert.deepEqual([...untrusted.restrictedConfigurations].sort(), ['dlm.server.args', 'dlm.server.path', 'dlm.server.pythonPath']);
});

test('DLM_LSP_INIT_OPTIONS adds options only when it is a JSON object', () => {
  assert.deepEqual(extraInitOptions('{"postprocess": false}'), { postprocess: false });
  for (const raw of [undefined, '', 'nonsense', '[1]', 'null', '3']) assert.deepEqual(extraInitOptions(raw), {}, String(raw));
});

test('the server is told at start which engine the options pick, never an endpoint', () => {
  const opts = serverOptions((key) => ({ model: '/m', device: 'cpu', budgetMs: 900 } as Record<string, unknown>)[key]);
  const env = prestartEnv({ ...opts, threads: 2 });
  assert.deepEqual(JSON.parse(env[PRESTART_ENV]), { model: '/m', device: 'cpu', engine: null, threads: 2 });
  assert.deepEqual(JSON.parse(prestartEnv({ ...opts, engine: 'inproc' })[PRESTART_ENV]).engine, 'inproc');
  assert.deepEqual(prestartEnv({ ...opts, engine: { url: 'http://box/v1' } }), {});
});
