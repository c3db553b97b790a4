// Next edits in VS Code: after an idle pause the extension asks the server for `dlm/nextEdit` and draws
// the suggestion with decorations (removed text struck through on a red background, added text as
// ghost text after it), since the stable inline-completion API cannot show an edit away from the
// cursor. Tab accepts (one WorkspaceEdit, only for the version asked), Esc dismisses; while it is
// off-screen a status bar item and the overview ruler point at it and Tab first jumps there. The
// timing and staleness rules are in nextEditModel.ts (pure, unit-tested).
import * as vscode from 'vscode';
import type { LanguageClient } from 'vscode-languageclient/node';
import { editView, EditView, isOffScreen, NextEdit, NextEditScheduler, Position, Range, Target } from './nextEditModel';

/** True while a suggestion is shown: the Tab and Esc keybindings (package.json) apply only then. */
export const CONTEXT_KEY = 'dlm.nextEditVisible';
export const NEXT_EDIT_METHOD = 'dlm/nextEdit';

const toPosition = (p: Position) => new vscode.Position(p.line, p.character);
const toRange = (r: Range) => new vscode.Range(toPosition(r.start), toPosition(r.end));

export class NextEditUI implements vscode.Disposable {
  readonly scheduler: NextEditScheduler;
  private readonly removedType: vscode.TextEditorDecorationType;
  private readonly addedType: vscode.TextEditorDecorationType;
  private readonly offScreenItem: vscode.StatusBarItem;
  private readonly subscriptions: vscode.Disposable[] = [];
  private view: EditView | undefined;
  private editor: vscode.TextEditor | undefined;
  private jumped = false;

  constructor(
    private readonly client: () => LanguageClient | undefined,
    private readonly selector: () => vscode.DocumentSelector | undefined,
    private readonly log: vscode.LogOutputChannel,
  ) {
    const config = () => vscode.workspace.getConfiguration('dlm');
    this.removedType = vscode.window.createTextEditorDecorationType({
      backgroundColor: new vscode.ThemeColor('diffEditor.removedTextBackground'),
      border: '1px solid',
      borderColor: new vscode.ThemeColor('diffEditor.removedTextBorder'),
      textDecoration: 'line-through',
      overviewRulerColor: new vscode.ThemeColor('editorOverviewRuler.deletedForeground'),
      overviewRulerLane: vscode.OverviewRulerLane.Right,
    });
    this.addedType = vscode.window.createTextEditorDecorationType({
      after: {
        color: new vscode.ThemeColor('editorGhostText.foreground'),
        backgroundColor: new vscode.ThemeColor('diffEditor.insertedTextBackground'),
        fontStyle: 'italic',
      },
      overviewRulerColor: new vscode.ThemeColor('editorOverviewRuler.addedForeground'),
      overviewRulerLane: vscode.OverviewRulerLane.Right,
    });
    this.offScreenItem = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 99);
    this.offScreenItem.name = 'dlm-lsp next edit';
    this.offScreenItem.command = 'dlm.nextEdit.accept';

    this.scheduler = new NextEditScheduler({
      enabled: () => config().get<boolean>('nextEdit.enabled', true) && this.serverOffers(),
      delayMs: () => Math.max(0, config().get<number>('nextEdit.delayMs', 400)),
      target: () => this.target(),
      request: (t) => this.request(t),
      show: (edit) => this.show(edit),
      hide: () => this.hide(),
      setTimer: (fn, ms) => setTimeout(fn, ms),
      clearTimer: (h) => clearTimeout(h as NodeJS.Timeout),
    });

    this.subscriptions.push(
      this.removedType,
      this.addedType,
      this.offScreenItem,
      vscode.workspace.onDidChangeTextDocument((e) => {
        if (e.contentChanges.length === 0) return; // only the dirty state changed
        const active = vscode.window.activeTextEditor?.document;
        if (active === e.document) this.scheduler.changed();
        else if (this.scheduler.current?.uri === this.uri(e.document)) this.scheduler.dismiss();
      }),
      vscode.window.onDidChangeActiveTextEditor(() => this.scheduler.dismiss()),
      vscode.window.onDidChangeTextEditorVisibleRanges((e) => {
        if (e.textEditor === this.editor) this.updateOffScreen();
      }),
      vscode.workspace.onDidChangeConfiguration((e) => {
        if (e.affectsConfiguration('dlm.nextEdit') && !config().get<boolean>('nextEdit.enabled', true)) this.scheduler.dismiss();
      }),
    );
  }

  /** An inline completion (ghost text) was shown for `document` at its current version. */
  completionShown(document: vscode.TextDocument): void {
    this.scheduler.completionShown(this.uri(document), document.version);
  }

  /** Tab: jumps to an off-screen suggestion first, else applies all its edits as one WorkspaceEdit
   * if the document is still at the version the suggestion was made for. */
  async accept(): Promise<boolean> {
    const edit = this.scheduler.current;
    const editor = this.editor;
    if (!edit || !editor || !this.view) return false;
    const doc = editor.document;
    if (!this.scheduler.isCurrent(edit, this.uri(doc), doc.version)) {
      this.scheduler.dismiss();
      return false;
    }
    if (!this.jumped && isOffScreen(this.view.span, editor.visibleRanges.map(fromRange))) {
      this.jumped = true;
      const start = toPosition(this.view.span.start);
      editor.selection = new vscode.Selection(start, start);
      editor.revealRange(toRange(this.view.span), vscode.TextEditorRevealType.InCenterIfOutsideViewport);
      this.updateOffScreen();
      return true;
    }
    const workspaceEdit = new vscode.WorkspaceEdit();
    for (const e of edit.edits) workspaceEdit.replace(doc.uri, toRange(e.range), e.newText);
    this.scheduler.dismiss();
    // VS Code checks the document's version against the one the extension host knew (the one
    // checked above) and refuses the edit if the text changed in between.
    const applied = await vscode.workspace.applyEdit(workspaceEdit);
    if (!applied) this.log.warn('next edit not applied: the document changed');
    return applied;
  }

  dismiss(): void {
    this.scheduler.dismiss();
  }

  dispose(): void {
    this.scheduler.dispose();
    for (const d of this.subscriptions) d.dispose();
  }

  private uri(document: vscode.TextDocument): string {
    const c = this.client();
    return c ? c.code2ProtocolConverter.asUri(document.uri) : document.uri.toString();
  }

  private serverOffers(): boolean {
    const c = this.client();
    const experimental = c?.initializeResult?.capabilities.experimental as { dlm?: { nextEdit?: boolean } } | undefined;
    return !!c && c.isRunning() && experimental?.dlm?.nextEdit === true;
  }

  private target(): Target | undefined {
    const editor = vscode.window.activeTextEditor;
    const selector = this.selector();
    if (!editor || !selector || !vscode.languages.match(selector, editor.document)) return undefined;
    const p = editor.selection.active;
    return { uri: this.uri(editor.document), version: editor.document.version, position: { line: p.line, character: p.character } };
  }

  private request(t: Target): { result: Promise<unknown>; cancel(): void } {
    const c = this.client();
    if (!c) return { result: Promise.resolve(null), cancel() {} };
    const source = new vscode.CancellationTokenSource();
    const params = { textDocument: { uri: t.uri, version: t.version }, position: t.position };
    const result = c.sendRequest(NEXT_EDIT_METHOD, params, source.token).finally(() => source.dispose());
    return { result, cancel: () => source.cancel() };
  }

  private show(edit: NextEdit): void {
    const editor = vscode.window.activeTextEditor;
    if (!editor || this.uri(editor.document) !== edit.uri) return;
    const view = editView(edit.edits);
    const hover = new vscode.MarkdownString('**Next edit** (dlm-lsp): **Tab** accepts, **Esc** dismisses');
    const removed: vscode.DecorationOptions[] = [];
    const added: vscode.DecorationOptions[] = [];
    for (const m of view.marks) {
      if (m.removed) removed.push({ range: toRange(m.removed), hoverMessage: hover });
      if (m.added) {
        const at = toPosition(m.added.at);
        const more = new vscode.MarkdownString().appendMarkdown('**Next edit** adds:').appendCodeblock(m.added.lines.join('\n'), editor.document.languageId);
        added.push({ range: new vscode.Range(at, at), hoverMessage: [hover, more], renderOptions: { after: { contentText: m.added.label } } });
      }
    }
    editor.setDecorations(this.removedType, removed);
    editor.setDecorations(this.addedType, added);
    this.editor = editor;
    this.view = view;
    this.jumped = false;
    void vscode.commands.executeCommand('setContext', CONTEXT_KEY, true);
    this.updateOffScreen();
    this.log.debug(`next edit shown: ${edit.edits.length} edit(s) for version ${edit.version}`);
  }

  private hide(): void {
    this.editor?.setDecorations(this.removedType, []);
    this.editor?.setDecorations(this.addedType, []);
    this.editor = undefined;
    this.view = undefined;
    this.offScreenItem.hide();
    void vscode.commands.executeCommand('setContext', CONTEXT_KEY, false);
  }

  private updateOffScreen(): void {
    const editor = this.editor;
    const view = this.view;
    if (!editor || !view || !isOffScreen(view.span, editor.visibleRanges.map(fromRange))) {
      this.offScreenItem.hide();
      return;
    }
    const line = view.span.start.line;
    const above = editor.visibleRanges.length > 0 && line < editor.visibleRanges[0].start.line;
    this.offScreenItem.text = `$(arrow-${above ? 'up' : 'down'}) DLM: next edit, line ${line + 1} (Tab)`;
    this.offScreenItem.tooltip = 'A next edit from dlm-lsp is off-screen: Tab (or a click here) goes to it, Tab again accepts, Esc dismisses.';
    this.offScreenItem.show();
  }
}

function fromRange(r: vscode.Range): Range {
  return { start: { line: r.start.line, character: r.start.character }, end: { line: r.end.line, character: r.end.character } };
}
