// Next edits (the server's `dlm/nextEdit`, docs/lsp-extensions.md): the pure part, no `vscode` import,
// so the tests load it in plain node. The server's answer is checked and turned into what to draw
// (`editView`); `NextEditScheduler` decides when to ask (after an idle pause, never while typing, not
// while a fill is shown as ghost text) and when a suggestion is stale (any change of its document).

export interface Position { line: number; character: number }
export interface Range { start: Position; end: Position }
export interface TextEdit { range: Range; newText: string }

/** One suggestion: its edits apply together, to exactly the document version it was asked for. */
export interface NextEdit {
  uri: string;
  version: number;
  edits: TextEdit[];
  confidence: number | null;
}

/** Where and what to ask: the document version and the cursor at the time of asking. */
export interface Target {
  uri: string;
  version: number;
  position: Position;
}

const isPos = (p: unknown): p is Position => {
  const v = p as Position;
  return !!v && Number.isInteger(v.line) && Number.isInteger(v.character) && v.line >= 0 && v.character >= 0;
};

const before = (a: Position, b: Position) => a.line < b.line || (a.line === b.line && a.character < b.character);

/** Gives the suggestion in a `dlm/nextEdit` answer for `target`, or null: a null answer, no edits,
 * a malformed edit, or edits that overlap or are out of order (never half of a suggestion). */
export function parseNextEdit(result: unknown, target: Target): NextEdit | null {
  if (!result || typeof result !== 'object') return null;
  const r = result as { edits?: unknown; confidence?: unknown };
  if (!Array.isArray(r.edits) || r.edits.length === 0) return null;
  const edits: TextEdit[] = [];
  for (const e of r.edits as TextEdit[]) {
    if (!e || !e.range || !isPos(e.range.start) || !isPos(e.range.end) || typeof e.newText !== 'string') return null;
    if (before(e.range.end, e.range.start)) return null;
    const last = edits[edits.length - 1];
    if (last && before(e.range.start, last.range.end)) return null;
    edits.push({ range: { start: { ...e.range.start }, end: { ...e.range.end } }, newText: e.newText });
  }
  const confidence = typeof r.confidence === 'number' ? r.confidence : null;
  return { uri: target.uri, version: target.version, edits, confidence };
}

/** What the editor draws for one edit: the text it removes (struck through) and the text it adds
 * (ghost text right after the removed text; `lines` are the added lines, `label` the one-line form a
 * decoration can show, line breaks as " ⏎ "). */
export interface EditMark {
  removed: Range | null;
  added: { at: Position; lines: string[]; label: string } | null;
}

export interface EditView {
  marks: EditMark[];
  /** From the first edit's start to the last edit's end: what must be on screen to see it. */
  span: Range;
}

export const NEWLINE_MARK = ' \u23ce ';

/** Gives the marks that draw `edits` (as parsed by parseNextEdit). */
export function editView(edits: TextEdit[]): EditView {
  const marks = edits.map((e): EditMark => {
    const empty = e.range.start.line === e.range.end.line && e.range.start.character === e.range.end.character;
    const lines = e.newText.split(/\r\n|\r|\n/);
    return {
      removed: empty ? null : e.range,
      added: e.newText === '' ? null : { at: e.range.end, lines, label: lines.join(NEWLINE_MARK) },
    };
  });
  return { marks, span: { start: edits[0].range.start, end: edits[edits.length - 1].range.end } };
}

/** True when no part of `span` lies in the visible line ranges (an editor's visibleRanges). */
export function isOffScreen(span: Range, visible: Range[]): boolean {
  return !visible.some((v) => v.start.line <= span.end.line && span.start.line <= v.end.line);
}

/** Applies non-overlapping, ordered edits to `text` (UTF-16 positions, as LSP and VS Code count). */
export function applyEdits(text: string, edits: TextEdit[]): string {
  const starts = [0];
  for (let i = 0; i < text.length; i++) if (text[i] === '\n') starts.push(i + 1);
  const offset = (p: Position) => Math.min((starts[p.line] ?? text.length) + p.character, text.length);
  let out = '';
  let at = 0;
  for (const e of edits) {
    out += text.slice(at, offset(e.range.start)) + e.newText;
    at = offset(e.range.end);
  }
  return out + text.slice(at);
}

/** What the scheduler needs from the editor; the extension gives VS Code's, the tests stand-ins. */
export interface SchedulerHost {
  /** dlm.nextEdit.enabled, and the server advertises dlm/nextEdit. */
  enabled(): boolean;
  /** dlm.nextEdit.delayMs: the idle pause before asking. */
  delayMs(): number;
  /** The active editor's document and cursor, or undefined when it is not one the server serves. */
  target(): Target | undefined;
  /** Sends dlm/nextEdit for `target`; `cancel` (called when a change makes the answer stale) sends
   * $/cancelRequest. */
  request(target: Target): { result: Promise<unknown>; cancel(): void };
  show(edit: NextEdit): void;
  hide(): void;
  setTimer(fn: () => void, ms: number): unknown;
  clearTimer(handle: unknown): void;
}

/** When to ask for a next edit and which suggestion is current. One per window: it follows the
 * active editor. */
export class NextEditScheduler {
  private timer: unknown;
  private inFlight: { target: Target; cancel(): void } | undefined;
  private shown: NextEdit | undefined;
  /** The document version an inline completion (ghost text) was last shown for. */
  private completionAt: { uri: string; version: number } | undefined;
  /** Requests sent, for tests and the log. */
  requests = 0;

  constructor(private readonly host: SchedulerHost) {}

  get current(): NextEdit | undefined {
    return this.shown;
  }

  /** The user changed a document (or switched editors): the suggestion goes, an answer in flight is
   * cancelled, and the idle pause starts again. Typing thus never asks: each keystroke restarts it. */
  changed(): void {
    this.drop();
    if (this.host.enabled()) this.timer = this.host.setTimer(() => this.fire(), this.host.delayMs());
  }

  /** An inline completion was shown for this document version: while it stands, no next edit is
   * asked for or shown (the completion wins while typing). */
  completionShown(uri: string, version: number): void {
    this.completionAt = { uri, version };
    if (this.shown && this.shown.uri === uri) this.dismiss();
    if (this.inFlight && this.inFlight.target.uri === uri) this.cancelInFlight();
  }

  /** Hides the suggestion (Esc) and forgets a pending ask. */
  dismiss(): void {
    this.drop();
  }

  /** True while `edit` is the shown suggestion and its document is still at its version. */
  isCurrent(edit: NextEdit, uri: string, version: number): boolean {
    return this.shown === edit && edit.uri === uri && edit.version === version;
  }

  /** Clears the timer, the request in flight and the shown suggestion. */
  dispose(): void {
    this.drop();
  }

  private drop(): void {
    if (this.timer !== undefined) this.host.clearTimer(this.timer);
    this.timer = undefined;
    this.cancelInFlight();
    if (this.shown) {
      this.shown = undefined;
      this.host.hide();
    }
  }

  private cancelInFlight(): void {
    const f = this.inFlight;
    this.inFlight = undefined;
    f?.cancel();
  }

  private completionStands(t: Target): boolean {
    return !!this.completionAt && this.completionAt.uri === t.uri && this.completionAt.version === t.version;
  }

  /** The idle pause is over: asks for the version and cursor of now, shows the answer if the
   * document is still at that version. */
  private async fire(): Promise<void> {
    this.timer = undefined;
    const target = this.host.target();
    if (!target || !this.host.enabled() || this.completionStands(target)) return;
    this.cancelInFlight();
    const req = this.host.request(target);
    const mine = { target, cancel: req.cancel };
    this.inFlight = mine;
    this.requests++;
    let result: unknown;
    try {
      result = await req.result;
    } catch {
      result = null; // cancelled, or the server is gone: nothing to show
    }
    if (this.inFlight !== mine) return; // superseded or cancelled meanwhile
    this.inFlight = undefined;
    const now = this.host.target();
    if (!now || now.uri !== target.uri || now.version !== target.version || this.completionStands(now)) return;
    const edit = parseNextEdit(result, target);
    if (!edit) return;
    this.shown = edit;
    this.host.show(edit);
  }
}
