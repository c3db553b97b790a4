// What the status bar shows. Pure module so the tests can check it without VS Code.

/** Params of the server's `dlm/status` notification (docs/lsp-extensions.md). */
export interface EngineStatus {
  state: 'loading' | 'ready' | 'error';
  model: string;
  device: string;
  lastLatencyMs: number | null;
  message: string | null;
}

/** States known only to the client: the server is not running or has not reported yet. */
export type ClientState = 'starting' | 'stopped' | 'missing';

export interface StatusView {
  text: string;
  tooltip: string;
  error: boolean;
}

const CLIENT_VIEWS: Record<ClientState, [string, string]> = {
  starting: ['$(loading~spin) DLM: starting', 'Starting dlm-lsp: the server loads Python, torch and then the model.'],
  stopped: ['$(debug-stop) DLM: stopped', 'dlm-lsp is not running. Run "DLM: Restart Server".'],
  missing: ['$(error) DLM: server not found', 'dlm-lsp was not found. See "DLM: Show Log".'],
};

/** Gives the status bar text and tooltip for an engine or client state. */
export function statusView(s: EngineStatus | ClientState, enabled: boolean): StatusView {
  const hint = enabled ? 'Click to turn completions off.' : 'Completions are off. Click to turn them on.';
  if (typeof s === 'string') {
    const [text, tooltip] = CLIENT_VIEWS[s];
    return { text: enabled ? text : `${text} (off)`, tooltip: `${tooltip}\n${hint}`, error: s === 'missing' };
  }
  const where = `${s.model || 'default model'} on ${s.device || 'unknown device'}`;
  const note = s.message ? `\n${s.message}` : '';
  if (s.state === 'error') {
    return { text: '$(error) DLM: error', tooltip: `dlm-lsp error (${where})${note}\nSee "DLM: Show Log".`, error: true };
  }
  if (s.state === 'loading') {
    return { text: '$(loading~spin) DLM: loading', tooltip: `Loading ${where}${note}`, error: false };
  }
  const ms = s.lastLatencyMs == null ? null : `${Math.round(s.lastLatencyMs)} ms`;
  const text = enabled ? `$(sparkle) DLM ${ms ?? 'ready'}` : `$(circle-slash) DLM ${ms ?? 'ready'} (off)`;
  const last = ms ? `last fill ${ms}` : 'no fill yet';
  return { text, tooltip: `${where}, ${last}${note}\n${hint}`, error: false };
}
