// The manifest (package.json `contributes`) must match what the code reads and registers.
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import * as path from 'node:path';
import { test } from 'node:test';
import { COMMANDS } from '../src/commands';
import { LaunchError, resolveLaunch } from '../src/launch';
import {
  CLIENT_SETTINGS, DEFAULT_LANGUAGES, documentSelector, ENGINE_KEY_ENV, engineLaunch, engineSetting, extraInitOptions, LIBRARY_SETTINGS,
  NEXT_EDIT_APPROACHES, PRESTART_ENV, prestartEnv, SERVER_SETTING_OPTIONS, SERVER_SETTINGS, serverOptions, withInitOptions,
} from '../src/settings';
import { statusView } from '../src/status';

const root = path.resolve(__dirname, '../..');
const manifest = JSON.parse(readFileSync(path.join(root, 'package.json'), 'utf8'));
const properties: Record<string, { default: unknown; scope?: string; enum?: string[]; enumDescriptions?: string[]; minimum?: number; maximum?: number; type?: unknown }> =
  manifest.contributes.configuration.properties;

test('every setting the code reads is contributed, and nothing else', () => {
  const expected = [...SERVER_SETTINGS, ...CLIENT_SETTINGS, ...LIBRARY_SETTINGS].map((k) => `dlm.${k}`);
  assert.deepEqual(Object.keys(properties).sort(), expected.sort());
});

test('contributed defaults are the defaults the code falls back to', () => {
  const fromManifest = serverOptions((key) => properties[`dlm.${key}`].default);
  assert.deepEqual(fromManifest, serverOptions(() => undefined));
  assert.deepEqual(fromManifest, {
    model: null, device: 'auto', budgetMs: 300, debounceMs: 0, maxFillTokens: 64, contextTokens: null, languages: DEFAULT_LANGUAGES, minConfidence: null, workspaceContext: true, engine: null,
    nextEditApproach: 'propagate', nextEditMinConfidence: null, // the server's defaults (dlm_lsp/options.py)
  });
});

test('every server option has one setting, and a change to any of them reaches its option', () => {
  // the next-edit options live with the extension's next-edit settings, under other names
  assert.equal(SERVER_SETTING_OPTIONS['nextEdit.approach'], 'nextEditApproach');
  assert.equal(SERVER_SETTING_OPTIONS['nextEdit.minConfidence'], 'nextEditMinConfidence');
  assert.ok(SERVER_SETTINGS.includes('nextEdit.approach') && SERVER_SETTINGS.includes('nextEdit.minConfidence'));
  for (const key of ['nextEdit.approach', 'nextEdit.minConfidence']) {
    assert.ok(!(CLIENT_SETTINGS as readonly string[]).includes(key), key); // sent to the server, not kept by the client
  }
  const options = Object.values(SERVER_SETTING_OPTIONS);
  assert.deepEqual([...options].sort(), Object.keys(serverOptions(() => undefined)).sort());
  assert.equal(new Set(options).size, options.length);
  // didChangeConfiguration sends serverOptions(config.get): each setting, changed, changes its option
  const changed: Record<string, unknown> = {
    model: '/m', device: 'cpu', budgetMs: 900, debounceMs: 50, maxFillTokens: 16, contextTokens: 1024, languages: ['go'], minConfidence: 0.3,
    workspaceContext: false, engine: { url: 'http://box/v1' }, 'nextEdit.approach': 'surprise+memory', 'nextEdit.minConfidence': 0.6,
  };
  assert.deepEqual(Object.keys(changed).sort(), [...SERVER_SETTINGS].sort());
  const before = serverOptions((key) => properties[`dlm.${key}`].default);
  for (const setting of SERVER_SETTINGS) {
    const after = serverOptions((key) => (key === setting ? changed[key] : properties[`dlm.${key}`].default));
    const option = SERVER_SETTING_OPTIONS[setting];
    assert.notDeepEqual(after[option], before[option], setting);
    assert.deepEqual({ ...after, [option]: before[option] }, before, `${setting} changes ${option} only`);
  }
});

test('next-edit settings: approach and least confidence as the server takes them', () => {
  const opts = (values: Record<string, unknown>) => serverOptions((key) => values[key]);
  assert.equal(opts({ 'nextEdit.approach': 'window+memory' }).nextEditApproach, 'window+memory');
  assert.equal(opts({ 'nextEdit.minConfidence': 0.25 }).nextEditMinConfidence, 0.25);
  assert.equal(opts({ 'nextEdit.minConfidence': 0 }).nextEditMinConfidence, 0); // 0 shows every suggestion, not null
  assert.equal(opts({ 'nextEdit.minConfidence': 1 }).nextEditMinConfidence, 1);
  // unset, null or blank: the server's default approach (it has no null for it)
  for (const value of [undefined, null, '', '  ', 3]) assert.equal(opts({ 'nextEdit.approach': value }).nextEditApproach, 'propagate', String(value));
  assert.equal(opts({ 'nextEdit.approach': ' memory ' }).nextEditApproach, 'memory');
  // unset, null or not a number: null, the server's calibrated edit gate per kind
  for (const value of [undefined, null, '', '0.5', false]) assert.equal(opts({ 'nextEdit.minConfidence': value }).nextEditMinConfidence, null, String(value));
  // forwarded as written: the server warns about a value out of [0, 1] or an unknown approach and keeps its own
  assert.equal(opts({ 'nextEdit.minConfidence': 1.5 }).nextEditMinConfidence, 1.5);
  assert.equal(opts({ 'nextEdit.minConfidence': -0.1 }).nextEditMinConfidence, -0.1);
  assert.equal(opts({ 'nextEdit.approach': 'memory+window' }).nextEditApproach, 'memory+window');
  // read under the settings' names only
  assert.deepEqual(opts({ nextEditApproach: 'window', nextEditMinConfidence: 0.5 }), opts({}));
});

test('the manifest offers the approaches the server accepts, the least confidence in [0, 1]', () => {
  const approach = properties['dlm.nextEdit.approach'];
  // dlm_lsp/options.py NEXT_EDIT_APPROACHES: an approach outside it is refused with a warning
  assert.deepEqual([...(approach.enum ?? [])].sort(), ['memory', 'propagate', 'surprise', 'surprise+memory', 'window', 'window+memory']);
  assert.deepEqual(approach.enum, [...NEXT_EDIT_APPROACHES]);
  assert.equal(approach.enumDescriptions?.length, approach.enum?.length);
  const least = properties['dlm.nextEdit.minConfidence'];
  assert.deepEqual([least.minimum, least.maximum, least.type], [0, 1, ['number', 'null']]);
});

test('DLM_LSP_INIT_OPTIONS holds over the settings, at start and on every change', () => {
  // extension.ts sends withInitOptions(serverOptions(...)) at initialize and with every settings change
  const raw = JSON.stringify({ postprocess: false, nextEditApproach: 'propagate', nextEditMinConfidence: 0 });
  const defaults = (key: string) => properties[`dlm.${key}`].default;
  const sent = withInitOptions(serverOptions(defaults), raw);
  // a setting at its default (null: the edit gate) does not turn the gate back on (the e2e suite's 0)
  assert.deepEqual([sent.nextEditApproach, sent.nextEditMinConfidence, sent.postprocess], ['propagate', 0, false]);
  // nor does a value the user set
  const set = (key: string) => ({ 'nextEdit.approach': 'window', 'nextEdit.minConfidence': 0.7, budgetMs: 900 } as Record<string, unknown>)[key] ?? defaults(key);
  const held = withInitOptions(serverOptions(set), raw);
  assert.deepEqual([held.nextEditApproach, held.nextEditMinConfidence, held.budgetMs], ['propagate', 0, 900]);
  // an option the variable leaves out comes from its setting; null is held as given
  assert.deepEqual(withInitOptions(serverOptions(set), '{"nextEditMinConfidence": null}'), { ...serverOptions(set), nextEditMinConfidence: null });
  // unset or not a JSON object: the settings alone
  assert.deepEqual(withInitOptions(serverOptions(set), undefined), serverOptions(set));
  assert.deepEqual(withInitOptions(serverOptions(set), 'nonsense'), serverOptions(set));
  assert.deepEqual(withInitOptions(serverOptions(set), '[1]'), serverOptions(set));
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
