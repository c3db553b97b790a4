// Settings under the `dlm.` prefix. Pure module (no `vscode` import) so the tests can load it in plain node.

/** The server's initialization options (docs/lsp-extensions.md), camelCase as sent on the wire. */
export interface ServerOptions {
  model: string | null;
  device: string; // 'auto' | 'cpu' | 'cuda' | 'cuda:N'
  budgetMs: number;
  debounceMs: number;
  maxFillTokens: number;
  contextTokens: number | null; // null: the engine's budget for its model and device
  languages: string[];
  minConfidence: number | null; // null: the model's own gate (serving.json)
  workspaceContext: boolean; // cross-file snippets from the workspace folders' files
  engine: EngineSetting | null; // null: the server's own engine (the user's shared daemon)
  nextEditApproach: string; // NEXT_EDIT_APPROACHES; the server warns about any other and keeps its own
  nextEditMinConfidence: number | null; // null: the server's calibrated edit gate, per kind of suggestion
}

/** How the server computes a next edit (dlm_lsp/options.py NEXT_EDIT_APPROACHES): "propagate", the
 * recent renames carried near the cursor without a model (the server's default), or the engine's
 * layouts. The server has no null for it: an unset or empty setting sends the default. */
export const NEXT_EDIT_APPROACHES = ['propagate', 'window', 'window+memory', 'surprise', 'memory', 'surprise+memory'] as const;
export const DEFAULT_NEXT_EDIT_APPROACH = 'propagate';

/** A FIM HTTP endpoint as the server's engine (docs/serving.md). The API key is never a setting: it
 * lives in VS Code's secret storage ("DLM: Set Engine API Key") and reaches the server through its
 * environment, or in the environment variable `apiKeyEnv` names. */
export interface EngineSetting {
  url: string;
  api?: 'openai-fim' | 'mercury';
  apiKeyEnv?: string;
  model?: string;
}

/** The secret storage key of the engine's API key, and the variable it is passed in by default. */
export const ENGINE_SECRET = 'dlm.engineApiKey';
export const ENGINE_KEY_ENV = 'DLM_ENGINE_API_KEY';

// The languages the server parses with tree-sitter. The server's own default adds "*" (every other
// language, by indentation alone); a client opts into that by listing "*" itself.
export const DEFAULT_LANGUAGES = ['python', 'javascript', 'javascriptreact', 'typescript', 'typescriptreact', 'go', 'rust'];

/** Settings forwarded to the server: each setting's name after `dlm.`, and the server option it is
 * sent as. The same name but for the next-edit ones, which live under `dlm.nextEdit.` with the
 * extension's own next-edit settings. */
export const SERVER_SETTING_OPTIONS = {
  model: 'model',
  device: 'device',
  budgetMs: 'budgetMs',
  debounceMs: 'debounceMs',
  maxFillTokens: 'maxFillTokens',
  contextTokens: 'contextTokens',
  languages: 'languages',
  minConfidence: 'minConfidence',
  workspaceContext: 'workspaceContext',
  engine: 'engine',
  'nextEdit.approach': 'nextEditApproach',
  'nextEdit.minConfidence': 'nextEditMinConfidence',
} as const satisfies Record<string, keyof ServerOptions>;

/** Settings forwarded to the server, keyed by their name after `dlm.` (any change to one is sent
 * with workspace/didChangeConfiguration, as the whole option set). */
export const SERVER_SETTINGS = Object.keys(SERVER_SETTING_OPTIONS) as readonly (keyof typeof SERVER_SETTING_OPTIONS)[];

/** Settings only the extension reads: how to launch the server, the on/off switch, next edits. */
export const CLIENT_SETTINGS = ['enable', 'server.path', 'server.args', 'server.pythonPath', 'nextEdit.enabled', 'nextEdit.delayMs'] as const;

/** Read by vscode-languageclient itself because the client id is `dlm`. */
export const LIBRARY_SETTINGS = ['trace.server'] as const;

/** Gives the server options from a settings getter (vscode's `WorkspaceConfiguration.get`, keys as
 * in SERVER_SETTINGS). */
export function serverOptions(get: (key: string) => unknown): ServerOptions {
  const model = get('model');
  const approach = get('nextEdit.approach');
  return {
    // An empty string in the settings UI means "the default model", which the server spells null.
    model: typeof model === 'string' && model.trim() !== '' ? model : null,
    device: (get('device') as string) ?? 'auto',
    budgetMs: (get('budgetMs') as number) ?? 300,
    debounceMs: (get('debounceMs') as number) ?? 0,
    maxFillTokens: (get('maxFillTokens') as number) ?? 64,
    contextTokens: typeof get('contextTokens') === 'number' ? (get('contextTokens') as number) : null,
    languages: (get('languages') as string[]) ?? DEFAULT_LANGUAGES,
    minConfidence: typeof get('minConfidence') === 'number' ? (get('minConfidence') as number) : null,
    workspaceContext: get('workspaceContext') !== false,
    engine: engineSetting(get('engine')),
    // no null for the server: unset or blank is its default; any other string goes as is (the server
    // warns about one it does not know and keeps the approach it had)
    nextEditApproach: typeof approach === 'string' && approach.trim() !== '' ? approach.trim() : DEFAULT_NEXT_EDIT_APPROACH,
    // a number as is (out of [0, 1] the server warns and keeps its own), else null: the edit gate
    nextEditMinConfidence: typeof get('nextEdit.minConfidence') === 'number' ? (get('nextEdit.minConfidence') as number) : null,
  };
}

/** Gives the engine endpoint of a `dlm.engine` value (an object with a url), else null. */
export function engineSetting(value: unknown): EngineSetting | null {
  if (!value || typeof value !== 'object' || Array.isArray(value)) return null;
  const v = value as Record<string, unknown>;
  if (typeof v.url !== 'string' || v.url.trim() === '') return null;
  const out: EngineSetting = { url: v.url.trim() };
  if (v.api === 'openai-fim' || v.api === 'mercury') out.api = v.api;
  if (typeof v.apiKeyEnv === 'string' && v.apiKeyEnv !== '') out.apiKeyEnv = v.apiKeyEnv;
  if (typeof v.model === 'string' && v.model !== '') out.model = v.model;
  return out;
}

/** Gives the engine option and what to add to the server's environment once the stored secret is
 * known: the key travels in an environment variable (apiKeyEnv, else DLM_ENGINE_API_KEY), never in
 * the initialization options, which a trace log would show. */
export function engineLaunch(engine: EngineSetting | null, secret: string | undefined):
  { engine: EngineSetting | null; env: Record<string, string> } {
  if (!engine || !secret) return { engine, env: {} };
  const name = engine.apiKeyEnv ?? ENGINE_KEY_ENV;
  return { engine: { ...engine, apiKeyEnv: name }, env: { [name]: secret } };
}

/** The environment variable that tells the server, as its process starts, the options that pick its
 * engine, so it starts that engine before the initialize handshake (dlm_lsp/launch.py). */
export const PRESTART_ENV = 'DLM_LSP_PRESTART';

/** The options that pick the server's engine (the server's machine-scoped ones), as the server's
 * environment carries them: DLM_LSP_PRESTART, a JSON object. An HTTP endpoint starts nothing slow,
 * so it is not announced. */
export function prestartEnv(initOptions: Record<string, unknown>): Record<string, string> {
  const engine = initOptions.engine;
  if (engine !== null && engine !== undefined && typeof engine !== 'string') return {};
  const hint: Record<string, unknown> = {};
  for (const key of ['model', 'device', 'engine', 'threads']) if (initOptions[key] !== undefined) hint[key] = initOptions[key];
  return { [PRESTART_ENV]: JSON.stringify(hint) };
}

/** Gives the document selector for the enabled languages ("*": every file and untitled document). */
export function documentSelector(languages: string[]): { scheme: string; language?: string }[] {
  const schemes = ['file', 'untitled'];
  if (languages.includes('*')) return schemes.map((scheme) => ({ scheme }));
  return languages.flatMap((language) => schemes.map((scheme) => ({ scheme, language })));
}

/** Gives the extra initialization options in `raw` (the DLM_LSP_INIT_OPTIONS environment variable,
 * a JSON object): a hook for tests and debugging that reaches options VS Code has no setting for,
 * such as the server's `postprocess` test switch. Anything but a JSON object gives nothing. */
export function extraInitOptions(raw: string | undefined): Record<string, unknown> {
  if (!raw) return {};
  try {
    const value: unknown = JSON.parse(raw);
    return value && typeof value === 'object' && !Array.isArray(value) ? (value as Record<string, unknown>) : {};
  } catch {
    return {};
  }
}

/** The options sent to the server, at initialize and with every settings change: `options` (from the
 * settings) with DLM_LSP_INIT_OPTIONS's on top, so a value that variable sets holds for the client's
 * lifetime and a setting left at its default never replaces it (the e2e suite's
 * nextEditMinConfidence 0, the server's `postprocess` switch). */
export function withInitOptions<T extends object>(options: T, raw: string | undefined = process.env.DLM_LSP_INIT_OPTIONS): T & Record<string, unknown> {
  return { ...options, ...extraInitOptions(raw) };
}
