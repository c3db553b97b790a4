// VS Code client: starts `dlm-lsp serve` over stdio and lets vscode-languageclient (>= 10.1, which has
// inline completion built in) turn the server's fills into ghost text.
import * as vscode from 'vscode';
import {
  DidChangeConfigurationNotification,
  LanguageClient,
  LanguageClientOptions,
  State,
  TransportKind,
} from 'vscode-languageclient/node';
import { COMMANDS, CommandName } from './commands';
import { LaunchError, resolveLaunch } from './launch';
import { NextEditUI } from './nextEdit';
import { documentSelector, ENGINE_SECRET, engineLaunch, prestartEnv, serverOptions, withInitOptions } from './settings';
import { ClientState, EngineStatus, statusView } from './status';

let client: LanguageClient | undefined;
let log: vscode.LogOutputChannel;
let statusItem: vscode.StatusBarItem;
let lastStatus: EngineStatus | ClientState = 'stopped';
let secrets: vscode.SecretStorage | undefined;
let nextEdits: NextEditUI | undefined;
let selector: vscode.DocumentSelector | undefined;
// The open documents VS Code has asked ghost text for (the middleware sees every ask), and the
// pending fallback ask of a keystroke VS Code let pass without one (see typedWithoutAsk).
const asked = new Set<string>();
let fallback: ReturnType<typeof setTimeout> | undefined;
const FALLBACK_ASK_MS = 1000;

const config = () => vscode.workspace.getConfiguration('dlm');
const enabled = () => config().get<boolean>('enable', true);

function showStatus(s: EngineStatus | ClientState = lastStatus): void {
  lastStatus = s;
  const view = statusView(s, enabled());
  statusItem.text = view.text;
  statusItem.tooltip = view.tooltip;
  statusItem.backgroundColor = view.error ? new vscode.ThemeColor('statusBarItem.errorBackground') : undefined;
}

async function start(): Promise<void> {
  const cfg = config();
  // In Restricted Mode a workspace's .venv is not searched: it would run a program the folder ships.
  const folders = vscode.workspace.isTrusted ? vscode.workspace.workspaceFolders ?? [] : [];
  const dirs = folders.filter((f) => f.uri.scheme === 'file').map((f) => f.uri.fsPath);
  let launch;
  try {
    launch = resolveLaunch(
      {
        path: cfg.get<string>('server.path', 'dlm-lsp'),
        args: cfg.get<string[]>('server.args', ['serve']),
        pythonPath: cfg.get<string>('server.pythonPath', ''),
      },
      process.env,
      dirs,
    );
  } catch (e) {
    if (!(e instanceof LaunchError)) throw e;
    log.error(e.message);
    showStatus('missing');
    void vscode.window.showErrorMessage(e.message, 'Open Settings', 'Show Log').then((choice) => {
      if (choice === 'Open Settings') void vscode.commands.executeCommand('workbench.action.openSettings', 'dlm.server');
      if (choice === 'Show Log') log.show();
    });
    return;
  }
  log.info(`starting ${launch.command} ${launch.args.join(' ')}`);

  const options = serverOptions((key) => cfg.get(key));
  // An HTTP engine's key comes from secret storage into the server's environment, never its options.
  const secret = options.engine ? await secrets?.get(ENGINE_SECRET) : undefined;
  const { engine, env } = engineLaunch(options.engine, secret);
  options.engine = engine;
  const initializationOptions = withInitOptions(options);
  const clientOptions: LanguageClientOptions = {
    documentSelector: documentSelector(options.languages),
    initializationOptions,
    outputChannel: log,
    middleware: {
      // Returning without calling next() sends no request, so "off" costs the server nothing.
      // A fill shown as ghost text holds off next edits for that version (the completion wins).
      provideInlineCompletionItems: async (document, position, context, token, next) => {
        asked.add(document.uri.toString());
        if (!enabled()) return null;
        const result = await next(document, position, context, token);
        const items = Array.isArray(result) ? result : result?.items;
        if (items && items.length > 0 && !token.isCancellationRequested) nextEdits?.completionShown(document);
        return result;
      },
      // VS Code shows fills as ghost text; the server's textDocument/completion fallback would repeat the
      // same fill in the suggest widget and cost a second model run per keystroke.
      provideCompletionItem: () => null,
    },
  };
  const c = new LanguageClient(
    'dlm', // also makes the library read the `dlm.trace.server` setting
    'dlm-lsp',
    // the engine the options pick starts with the process, before the handshake (prestartEnv)
    { command: launch.command, args: launch.args, transport: TransportKind.stdio,
      options: { env: { ...process.env, ...env, ...prestartEnv(initializationOptions) } } },
    clientOptions,
  );
  c.onNotification('dlm/status', (params: EngineStatus) => {
    const wasReady = typeof lastStatus !== 'string' && lastStatus.state === 'ready';
    showStatus(params);
    if (params.state === 'ready' && !wasReady) askAgain(clientOptions.documentSelector as vscode.DocumentSelector);
  });
  c.onDidChangeState((e) => {
    if (e.newState === State.Starting) showStatus('starting');
    else if (e.newState === State.Stopped) showStatus('stopped');
    // Running, but the engine has not reported yet: the server is still importing torch, which
    // takes seconds; keep the spinner rather than a ready-looking item.
    else if (typeof lastStatus === 'string') showStatus('starting');
  });
  client = c;
  selector = clientOptions.documentSelector as vscode.DocumentSelector;
  try {
    await c.start();
  } catch (e) {
    log.error(`dlm-lsp failed to start: ${e}`);
    showStatus('stopped');
    void vscode.window.showErrorMessage(`dlm-lsp failed to start: ${e instanceof Error ? e.message : e}. See "DLM: Show Log".`);
  }
}

/** A keystroke in the active editor: VS Code asks for ghost text after it on its own, but code-server
 * 1.139 sometimes never asks in an editor opened when the server was already ready (seen in the
 * end-to-end suite: didChange, then no textDocument/inlineCompletion for 90 s). Until VS Code has
 * asked once for the document, a keystroke it lets pass for FALLBACK_ASK_MS is asked for here. Once
 * it has, it is trusted: it does not ask after Escape or an accepted fill, on purpose. */
function typedWithoutAsk(e: vscode.TextDocumentChangeEvent): void {
  const editor = vscode.window.activeTextEditor;
  // a keystroke: one change of at most one character (not an accepted fill, a paste or an edit applied)
  if (e.contentChanges.length !== 1 || e.contentChanges[0].text.length > 1) return;
  if (!editor || editor.document !== e.document || !selector) return;
  if (!enabled() || asked.has(e.document.uri.toString()) || !vscode.languages.match(selector, e.document)) return;
  if (fallback !== undefined) clearTimeout(fallback);
  const uri = e.document.uri.toString();
  const version = e.document.version;
  fallback = setTimeout(() => {
    fallback = undefined;
    const now = vscode.window.activeTextEditor?.document;
    if (!now || now.uri.toString() !== uri || now.version !== version) return; // typed on: that asks
    if (asked.has(uri)) return; // VS Code asks for this document itself
    void vscode.commands.executeCommand('editor.action.inlineSuggest.trigger');
  }, FALLBACK_ASK_MS);
}

/** Asks for ghost text at the cursor once the model is ready: requests made while it loaded were
 * answered empty, and VS Code would not ask again before the next keystroke. */
function askAgain(selector: vscode.DocumentSelector): void {
  const editor = vscode.window.activeTextEditor;
  if (!enabled() || !editor || !vscode.languages.match(selector, editor.document)) return;
  void vscode.commands.executeCommand('editor.action.inlineSuggest.trigger');
}

async function stop(): Promise<void> {
  const c = client;
  client = undefined;
  nextEdits?.dismiss();
  if (!c) return;
  try {
    await c.dispose(5000);
  } catch (e) {
    log.warn(`stopping dlm-lsp: ${e}`);
  }
  showStatus('stopped');
}

let lifecycle: Promise<void> = Promise.resolve();

/** Stops and starts the client; calls queue up so quick setting changes never leave two servers. */
function restart(): Promise<void> {
  lifecycle = lifecycle.then(stop).then(start).catch((e) => log.error(`restarting dlm-lsp: ${e}`));
  return lifecycle;
}

export function activate(context: vscode.ExtensionContext): void {
  secrets = context.secrets;
  log = vscode.window.createOutputChannel('dlm-lsp', { log: true });
  statusItem = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
  statusItem.command = COMMANDS.toggle;
  statusItem.name = 'dlm-lsp';
  showStatus('stopped');
  statusItem.show();
  nextEdits = new NextEditUI(() => client, () => selector, log);

  // A Record over CommandName makes the compiler insist that every declared command has a handler.
  const handlers: Record<CommandName, () => unknown> = {
    restart,
    toggle: () => {
      const inWorkspace = config().inspect('enable')?.workspaceValue !== undefined;
      const target = inWorkspace ? vscode.ConfigurationTarget.Workspace : vscode.ConfigurationTarget.Global;
      return config().update('enable', !enabled(), target);
    },
    showLog: () => log.show(),
    acceptNextEdit: () => nextEdits?.accept(),
    dismissNextEdit: () => nextEdits?.dismiss(),
    setEngineKey: async () => {
      const key = await vscode.window.showInputBox({
        title: 'dlm-lsp: API key of the dlm.engine endpoint',
        prompt: 'Kept in VS Code\'s secret storage and passed to the server in its environment. Empty: forget the key.',
        password: true,
        ignoreFocusOut: true,
      });
      if (key === undefined || !secrets) return;
      if (key.trim() === '') await secrets.delete(ENGINE_SECRET);
      else await secrets.store(ENGINE_SECRET, key.trim());
      return restart();
    },
  };
  for (const [name, handler] of Object.entries(handlers)) {
    context.subscriptions.push(vscode.commands.registerCommand(COMMANDS[name as CommandName], handler));
  }

  context.subscriptions.push(
    log,
    statusItem,
    nextEdits,
    vscode.workspace.onDidGrantWorkspaceTrust(() => restart()), // the workspace's .venv may now be used
    vscode.workspace.onDidChangeTextDocument(typedWithoutAsk),
    vscode.workspace.onDidCloseTextDocument((d) => asked.delete(d.uri.toString())),
    vscode.workspace.onDidChangeConfiguration(async (e) => {
      if (!e.affectsConfiguration('dlm')) return;
      // The launch command and the document selector are fixed for a client's lifetime; the server
      // takes the model, device and engine from initializationOptions only (docs/lsp-extensions.md).
      if (e.affectsConfiguration('dlm.server') || e.affectsConfiguration('dlm.languages') || e.affectsConfiguration('dlm.model') ||
          e.affectsConfiguration('dlm.device') || e.affectsConfiguration('dlm.engine')) {
        return restart();
      }
      if (e.affectsConfiguration('dlm.enable')) showStatus();
      if (client?.isRunning()) {
        // `engine` is read at start only (a change restarts above); its key-variable name may
        // differ from the one sent at start, which the server would take for a change
        const { engine: _engine, ...dlm } = withInitOptions(serverOptions((key) => config().get(key)));
        const settings = { dlm };
        await client.sendNotification(DidChangeConfigurationNotification.type, { settings });
      }
    }),
  );
  lifecycle = start().catch((e) => log.error(`starting dlm-lsp: ${e}`));
}

export function deactivate(): Promise<void> {
  return lifecycle.then(stop);
}
