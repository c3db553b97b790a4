// Next edits, the pure part (src/nextEditModel.ts): the server's answer checked and turned into
// decoration ranges, the idle pause (debounce), and staleness (any change drops a suggestion; an
// answer for a version that is gone is never shown). The timers are a hand-driven stand-in clock.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import * as path from 'node:path';
import { test } from 'node:test';
import { applyEdits, editView, isOffScreen, NEWLINE_MARK, NextEdit, NextEditScheduler, parseNextEdit, Target, TextEdit } from '../src/nextEditModel';

const URI = 'file:///w/area.py';
const SOURCE = 'def area(size, height):\n    w = width * 2\n    return width * height + w\n';
const range = (l1: number, c1: number, l2: number, c2: number) => ({ start: { line: l1, character: c1 }, end: { line: l2, character: c2 } });
// The server's propagate answer after `width` -> `size` on line 1 (docs/lsp-extensions.md).
const RENAME: TextEdit[] = [{ range: range(1, 8, 1, 13), newText: 'size' }, { range: range(2, 11, 2, 16), newText: 'size' }];

test('the answer becomes one suggestion for the version asked, or nothing', () => {
  const t: Target = { uri: URI, version: 7, position: { line: 0, character: 13 } };
  const s = parseNextEdit({ edits: RENAME, confidence: 1 }, t);
  assert.deepEqual(s, { uri: URI, version: 7, edits: RENAME, confidence: 1 });
  assert.equal(parseNextEdit(null, t), null);
  assert.equal(parseNextEdit({ edits: [] }, t), null);
  assert.equal(parseNextEdit({ edits: [{ range: range(0, 0, 0, 1) }] }, t), null, 'no newText');
  assert.equal(parseNextEdit({ edits: [{ range: range(2, 0, 1, 0), newText: '' }] }, t), null, 'end before start');
  assert.equal(parseNextEdit({ edits: [...RENAME].reverse() }, t), null, 'out of order');
  assert.equal(parseNextEdit({ edits: [RENAME[0], { range: range(1, 10, 1, 11), newText: 'x' }] }, t), null, 'overlapping');
  assert.equal(parseNextEdit({ edits: [{ range: range(-1, 0, 0, 0), newText: '' }] }, t), null);
  assert.equal(parseNextEdit({ edits: RENAME }, t)?.confidence, null);
});

test('decorations: removed text and the added text right after it', () => {
  const view = editView(RENAME);
  assert.deepEqual(view.marks, [
    { removed: range(1, 8, 1, 13), added: { at: { line: 1, character: 13 }, lines: ['size'], label: 'size' } },
    { removed: range(2, 11, 2, 16), added: { at: { line: 2, character: 16 }, lines: ['size'], label: 'size' } },
  ]);
  assert.deepEqual(view.span, range(1, 8, 2, 16));
  // a pure insertion draws no removed text; a pure deletion no ghost text
  const [ins, del] = editView([{ range: range(0, 4, 0, 4), newText: 'x: ' }, { range: range(3, 0, 4, 0), newText: '' }]).marks;
  assert.deepEqual(ins, { removed: null, added: { at: { line: 0, character: 4 }, lines: ['x: '], label: 'x: ' } });
  assert.deepEqual(del, { removed: range(3, 0, 4, 0), added: null });
  // several added lines: one decoration can hold one line, so the breaks are shown as marks
  const multi = editView([{ range: range(2, 4, 2, 10), newText: 'if x:\n        y()' }]).marks[0].added;
  assert.deepEqual(multi?.lines, ['if x:', '        y()']);
  assert.equal(multi?.label, `if x:${NEWLINE_MARK}        y()`);
});

test('off-screen: no visible line range meets the edits', () => {
  const span = range(40, 2, 42, 0);
  assert.equal(isOffScreen(span, [range(0, 0, 30, 0)]), true);
  assert.equal(isOffScreen(span, [range(0, 0, 40, 0)]), false);
  assert.equal(isOffScreen(span, [range(0, 0, 10, 0), range(42, 0, 60, 0)]), false, 'folded: two ranges');
  assert.equal(isOffScreen(span, [range(50, 0, 90, 0)]), true);
  assert.equal(isOffScreen(span, []), true);
});

test('applying the edits gives the renamed text', () => {
  assert.equal(applyEdits(SOURCE, RENAME), 'def area(size, height):\n    w = size * 2\n    return size * height + w\n');
});

/** A stand-in editor: one document, a clock driven by hand, the requests it was asked to send. */
function harness(opts: { delayMs?: number; enabled?: boolean } = {}) {
  const h = {
    now: 0,
    timers: [] as { at: number; fn: () => void; live: boolean }[],
    doc: { uri: URI, version: 1, position: { line: 0, character: 13 } } as Target | undefined,
    enabled: opts.enabled ?? true,
    sent: [] as { target: Target; resolve: (v: unknown) => void; cancelled: boolean }[],
    shown: [] as NextEdit[],
    hidden: 0,
    visible: undefined as NextEdit | undefined,
  };
  const scheduler = new NextEditScheduler({
    enabled: () => h.enabled,
    delayMs: () => opts.delayMs ?? 400,
    target: () => (h.doc ? { ...h.doc } : undefined),
    request: (target) => {
      let resolve!: (v: unknown) => void;
      const result = new Promise((r) => (resolve = r));
      const entry = { target, resolve, cancelled: false };
      h.sent.push(entry);
      return { result, cancel: () => { entry.cancelled = true; resolve(null); } };
    },
    show: (e) => { h.shown.push(e); h.visible = e; },
    hide: () => { h.hidden++; h.visible = undefined; },
    setTimer: (fn, ms) => { const t = { at: h.now + ms, fn, live: true }; h.timers.push(t); return t; },
    clearTimer: (t) => { (t as { live: boolean }).live = false; },
  });
  /** Moves the clock on, firing the timers that come due. */
  const advance = async (ms: number) => {
    h.now += ms;
    for (const t of h.timers) if (t.live && t.at <= h.now) { t.live = false; t.fn(); }
    await new Promise((r) => setImmediate(r));
  };
  /** A keystroke: the document's version goes up and the scheduler hears of it. */
  const type = () => { h.doc!.version++; scheduler.changed(); };
  const answer = async (i: number, value: unknown) => { h.sent[i].resolve(value); await new Promise((r) => setImmediate(r)); };
  return { h, scheduler, advance, type, answer };
}

test('asks once, after the idle pause, never while typing', async () => {
  const { h, advance, type } = harness();
  type();
  await advance(300);
  type(); // typing on restarts the pause
  await advance(300);
  type();
  await advance(399);
  assert.equal(h.sent.length, 0, 'asked while typing');
  await advance(1);
  assert.equal(h.sent.length, 1);
  assert.deepEqual(h.sent[0].target, { uri: URI, version: 4, position: { line: 0, character: 13 } });
  await advance(5000);
  assert.equal(h.sent.length, 1, 'asked again without a change');
});

test('the answer is shown for its version; any change then drops it', async () => {
  const { h, scheduler, advance, type, answer } = harness();
  type();
  await advance(400);
  await answer(0, { edits: RENAME, confidence: 1 });
  assert.equal(h.shown.length, 1);
  assert.equal(scheduler.current, h.visible);
  assert.ok(scheduler.isCurrent(h.visible!, URI, 2));
  assert.ok(!scheduler.isCurrent(h.shown[0], URI, 3), 'a suggestion is for one version only');
  type();
  assert.equal(h.visible, undefined, 'a change cleared it');
  assert.equal(scheduler.current, undefined);
  assert.ok(!scheduler.isCurrent(h.shown[0], URI, 3));
});

test('an answer for a version that is gone is never shown, and the request is cancelled', async () => {
  const { h, advance, type, answer } = harness();
  type();
  await advance(400);
  type(); // a keystroke while the request is in flight
  assert.equal(h.sent[0].cancelled, true);
  await answer(0, { edits: RENAME });
  assert.equal(h.shown.length, 0);
  // the same when the change comes without the scheduler hearing first (the answer checks the version)
  await advance(400);
  assert.equal(h.sent.length, 2);
  h.doc!.version++;
  await answer(1, { edits: RENAME });
  assert.equal(h.shown.length, 0, 'shown for a stale version');
});

test('no next edit while a completion (ghost text) is shown; it wins when it comes later', async () => {
  const { h, scheduler, advance, type, answer } = harness();
  type();
  scheduler.completionShown(URI, 2); // the fill for this keystroke came back non-empty
  await advance(400);
  assert.equal(h.sent.length, 0, 'asked while a completion was shown');
  type(); // the next version has no completion (yet)
  await advance(400);
  assert.equal(h.sent.length, 1);
  await answer(0, { edits: RENAME });
  assert.ok(h.visible);
  scheduler.completionShown(URI, 3);
  assert.equal(h.visible, undefined, 'the completion did not win');
  // a completion arriving while the request is in flight: the answer is dropped
  type();
  await advance(400);
  scheduler.completionShown(URI, 4);
  assert.equal(h.sent[1].cancelled, true);
  await answer(1, { edits: RENAME });
  assert.equal(h.visible, undefined);
});

test('dismiss (Esc) hides it until the next change; off and no document ask nothing', async () => {
  const { h, scheduler, advance, type, answer } = harness();
  type();
  await advance(400);
  await answer(0, { edits: RENAME });
  scheduler.dismiss();
  assert.equal(h.visible, undefined);
  await advance(5000);
  assert.equal(h.sent.length, 1);
  h.enabled = false;
  type();
  await advance(1000);
  assert.equal(h.sent.length, 1, 'asked while off');
  h.enabled = true;
  h.doc = undefined; // e.g. a language the server does not serve
  scheduler.changed();
  await advance(1000);
  assert.equal(h.sent.length, 1);
});

test('a null answer, an error or a malformed answer shows nothing', async () => {
  const { h, advance, type, answer } = harness({ delayMs: 0 });
  for (const value of [null, { edits: [] }, { edits: [{ newText: 'x' }] }]) {
    type();
    await advance(0);
    await answer(h.sent.length - 1, value);
  }
  assert.equal(h.shown.length, 0);
});

test('the manifest binds Tab and Esc only while a next edit is shown, never over ghost text', () => {
  const manifest = JSON.parse(readFileSync(path.resolve(__dirname, '../../package.json'), 'utf8'));
  const bindings: { command: string; key: string; when: string }[] = manifest.contributes.keybindings;
  const byKey = Object.fromEntries(bindings.map((b) => [b.key, b]));
  assert.equal(byKey.tab.command, 'dlm.nextEdit.accept');
  assert.equal(byKey.escape.command, 'dlm.nextEdit.dismiss');
  for (const b of bindings) {
    assert.match(b.when, /(^| )dlm\.nextEditVisible( |$)/, b.key);
    assert.match(b.when, /!inlineSuggestionVisible/, b.key);
    assert.match(b.when, /!suggestWidgetVisible/, b.key);
  }
  const props = manifest.contributes.configuration.properties;
  assert.equal(props['dlm.nextEdit.enabled'].default, true);
  assert.equal(props['dlm.nextEdit.delayMs'].default, 400);
});
