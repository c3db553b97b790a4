"""Next-edit training examples (engine/train/edit_objective.py) and their wiring into `dlm-lsp train`: the
canvases are the ones engine/decode/rewrite.py decodes, on the window dlm_lsp/fill/nextedit.py picks, with
the truth's rewrite as targets; corrupted visible tokens become targets; default runs draw the old batches."""

from __future__ import annotations

import difflib
import json
import random
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dlm_lsp.fill import nextedit
from engine.api import EditJob
from engine.decode import rewrite
from engine.tokenizer import EOS, MASK, PAD, SPECIALS, TextTokenizer
from engine.train import edit_objective as eo
from engine.train.edit_pairs import apply_edits, load_case
from engine.train.loop import Batches, TrainArgs, held_out_args, loss_on
from engine.train.objective import Example, SpecialIds, collate, infill_example, mdlm_example
from engine.weights.load import load_checkpoint
from tests.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
OLD = (
    "def area(width, height):\n"
    "    size = width * height\n"
    "    return size\n"
    "\n"
    "\n"
    "def perimeter(width, height):\n"
    "    return 2 * (width + height)\n"
    "\n"
    "\n"
    "class Box:\n"
    "    def __init__(self, width, height):\n"
    "        self.width = width\n"
    "        self.height = height\n"
    "\n"
    "    def area(self):\n"
    "        return area(self.width, self.height)\n"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, tokenizer, special ids) of a tiny random checkpoint."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m")
    tok = TextTokenizer.load(folder)
    return folder, tok, SpecialIds(mask=tok.token_id(MASK), pad=tok.token_id(PAD), eos=tok.token_id(EOS))


def _nth(text: str, word: str, n: int) -> int:
    at = -1
    for _ in range(n + 1):
        at = text.index(word, at + 1)
    return at


def _case(truth: str | None, side: str = "train", file: str = "files/area.py", cid: str = "") -> dict:
    """A case in edit_pairs' format on OLD: the user renamed the first `width` to `w`; the truth renames the
    next one ("near"), one far below the cursor's window ("far"), or nothing (None: noise)."""
    edits = [[OLD.index("width"), "width", "w"]]
    doc = apply_edits(OLD, edits)
    cursor = edits[0][0] + 1
    at = {"near": _nth(doc, "width", 0), "far": _nth(doc, "self.width", 1) + len("self.")}
    return {
        "id": cid or f"area#{truth}",
        "side": side,
        "file": file,
        "edits": edits,
        "cursor": cursor,
        "truth": [at[truth], "width", "w"] if truth else None,
        "category": "repeat" if truth else "noise",
    }


@pytest.fixture()
def edit_data(tmp_path):
    """A folder of edit cases: two train cases and a noise one, a held-out one and one with no side
    (both pointing at a file that does not exist: loading them would fail)."""
    folder = tmp_path / "edits"
    (folder / "files").mkdir(parents=True)
    (folder / "files" / "area.py").write_text(OLD)
    rows = [_case("near"), _case("far"), _case(None)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = _case("near", side="heldout", file="files/missing.py", cid="held")
    sideless = {k: v for k, v in _case("near", file="files/missing.py", cid="sideless").items() if k != "side"}
    (folder / "heldout.jsonl").write_text(json.dumps(held) + "\n" + json.dumps(sideless) + "\n")
    return folder


def _filled(ex_ids: list[int], targets: list[int], pad: int) -> list[int]:
    """A canvas's slots with every masked slot's target put in, the padding dropped: the text it stands for."""
    return [t if t >= 0 else i for i, t in zip(ex_ids, targets) if (t if t >= 0 else i) != pad]


def _windows(doc: str, after: str, cursor: int) -> tuple[str, str]:
    """The server's window at the cursor, before and after the truth (which lies inside it)."""
    start, end = nextedit.window_lines(doc, cursor)
    return doc[start:end], after[start : end + len(after) - len(doc)]


# ----------------------------------------------------------------------------- the window


def test_window_lines_is_the_servers():
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(["ab", "", "  x = 1", "é"]) + rng.choice(["\n", "\r\n", "\r"]) for _ in range(30))
        text = text[: rng.randrange(len(text) + 1)]
        at = rng.randint(-2, len(text) + 2)
        kw = {"above": rng.randint(0, 4), "below": rng.randint(0, 10), "max_lines": rng.randint(1, 14)}
        assert eo.window_lines(text, at, **kw) == nextedit.window_lines(text, at, **kw), (text, at, kw)
        assert eo.edit_window(text, at, None) == nextedit.window_lines(text, at)


def test_edit_window_is_the_cursors_when_it_holds_the_truth_else_the_truths(edit_data):
    for which in ("near", "far"):
        case = _case(which)
        doc, after = load_case(edit_data, case)
        span = eo.truth_span(doc, after)
        off = case["truth"][0]
        assert span == (off + 1, len("idth"), 0)  # "width" -> "w", trimmed: "idth" deleted
        start, end = eo.edit_window(doc, case["cursor"], span[:2])
        server = nextedit.window_lines(doc, case["cursor"])
        if which == "near":
            assert (start, end) == server
        else:  # below the cursor's window: the same rule at the truth
            assert off >= server[1] and (start, end) == nextedit.window_lines(doc, off)
        assert start <= off and off + span[1] <= end
    # a truth longer than a window: whole lines to its end
    doc = "".join(f"line{i}\n" for i in range(40))
    off = doc.index("line10")
    end_of_truth = doc.index("line30") + 3
    start, end = eo.edit_window(doc, 0, (off, end_of_truth - off))
    assert start == nextedit.window_lines(doc, off)[0] and end == doc.index("line31")


# ----------------------------------------------------------------------------- (B) edit canvases


def test_window_layout_targets_the_window_after_the_truth(tiny, edit_data):
    _, tok, ids = tiny
    case = _case("near")
    doc, after = load_case(edit_data, case)
    old_text, new_text = _windows(doc, after, case["cursor"])
    assert old_text != new_text
    start = nextedit.window_lines(doc, case["cursor"])[0]
    n_old = len(tok.encode(old_text))
    for seed in range(30):
        ex = eo.edit_example(doc, after, case["cursor"], tok, 512, ids, random.Random(seed), "window")
        a, b = ex.span
        assert len(ex.ids) == len(ex.targets) <= 512
        # the server's slots: the window's tokens and their padding room, all masked at serving
        assert b - a == len(rewrite.window_slots(n_old, EditJob.growth).src)
        assert ex.ids[:a] == tok.encode(doc[:start])
        assert all(t < 0 for t in ex.targets[:a] + ex.targets[b:])
        assert all(ex.ids[i] == ids.mask for i, t in enumerate(ex.targets) if t >= 0)
        assert tok.decode(_filled(ex.ids[a:b], ex.targets[a:b], ids.pad)) == new_text
        assert ex.weight >= 1.0 / (b - a)  # 1 / (t n), t <= 1


def test_surprise_layout_shows_the_window_and_masks_what_changed(tiny, edit_data):
    _, tok, ids = tiny
    for which in ("near", "far"):
        case = _case(which)
        doc, after = load_case(edit_data, case)
        start, end = eo.edit_window(doc, case["cursor"], eo.truth_span(doc, after)[:2])
        old = tok.encode(doc[start:end])
        new = tok.encode(after[start : end + len(after) - len(doc)])
        ops = difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
        changed = [i for tag, i1, i2, _, _ in ops if tag != "equal" for i in range(max(0, i1 - 1), i2 + 1)]
        assert changed  # the tokens the diff changes, or the one either side of an insertion
        for seed in range(30):
            c = eo.surprise_canvas(old, new, ids, random.Random(seed))
            # every window token has its slot, in order; the kept ones show it
            assert [s for s in c.src if s is not None] == list(range(len(old)))
            assert all(c.ids[k] == old[s] for k, s in enumerate(c.src) if not c.run[k])
            assert any(c.run[c.src.index(i)] for i in changed)
            assert all(c.run[c.src.index(i)] for tag, i1, i2, _, _ in ops if tag != "equal" for i in range(i1, i2))
            # the layout rewrite.py builds from these remasked tokens
            remask = [c.run[c.src.index(i)] for i in range(len(old))]
            slots = rewrite.remask_slots(remask, EditJob.growth)
            assert (slots.src, slots.masked) == (c.src, c.run)
            assert not all(remask)
            assert _filled(c.ids, c.targets, ids.pad) == new
            assert all(not c.run[k] or c.ids[k] == ids.mask or c.targets[k] < 0 for k in range(len(c.ids)))
            assert all(c.run[k] for k, t in enumerate(c.targets) if t >= 0)
            # the example around it: the same slots between the server's prefix and suffix
            ex = eo.edit_example(doc, after, case["cursor"], tok, 512, ids, random.Random(seed), "surprise")
            a, b = ex.span
            assert (ex.ids[a:b], ex.targets[a:b]) == (c.ids, c.targets)
            assert ex.ids[:a] == tok.encode(doc[:start]) and ex.ids[b:] == tok.encode(doc[end:])


def test_a_new_window_longer_than_its_slots_gets_more_room(tiny):
    _, _, ids = tiny
    old, new = [10, 11, 12, 13], [10, 20, 21, 22, 23, 24, 25, 26, 27, 13]
    for seed in range(10):
        for c in (
            eo.window_canvas(old, new, ids, random.Random(seed)),
            eo.surprise_canvas(old, new, ids, random.Random(seed)),
        ):
            assert _filled(c.ids, c.targets, ids.pad) == new


def test_a_noise_case_targets_the_unchanged_window(tiny, edit_data):
    _, tok, ids = tiny
    case = _case(None)
    doc, after = load_case(edit_data, case)
    assert doc == after and eo.truth_span(doc, after) is None
    window = _windows(doc, after, case["cursor"])[0]
    for seed in range(30):
        for layout in eo.LAYOUTS:
            ex = eo.edit_example(doc, after, case["cursor"], tok, 512, ids, random.Random(seed), layout)
            a, b = ex.span
            assert any(t >= 0 for t in ex.targets[a:b])  # (b): a decoy run, nothing to change in it
            assert tok.decode(_filled(ex.ids[a:b], ex.targets[a:b], ids.pad)) == window


def test_an_edit_example_fits_seq_len_keeping_the_text_nearest_the_window(tiny, edit_data):
    _, tok, ids = tiny
    case = _case("near")
    doc, after = load_case(edit_data, case)
    doc, after = "x = 1\n" * 200 + doc + "y = 2\n" * 200, "x = 1\n" * 200 + after + "y = 2\n" * 200
    cursor = case["cursor"] + 1200
    start, end = nextedit.window_lines(doc, cursor)
    for layout in eo.LAYOUTS:
        ex = eo.edit_example(doc, after, cursor, tok, 160, ids, random.Random(1), layout)
        a, b = ex.span
        assert len(ex.ids) == 160
        assert ex.ids[:a] == tok.encode(doc[:start])[-a:] and ex.ids[b:] == tok.encode(doc[end:])[: 160 - b]
        assert 160 - b <= (160 - (b - a)) // 3  # the suffix gets a third of the room at most, as the server's
    assert eo.edit_example(doc, after, cursor, tok, 40, ids, random.Random(1), "window") is None
    with pytest.raises(ValueError, match="layout"):
        eo.edit_example(doc, after, cursor, tok, 160, ids, random.Random(1), "memory")


# ----------------------------------------------------------------------------- (C) correction


def _specials(tok: TextTokenizer) -> set[int]:
    return {tok.token_id(t) for t in SPECIALS}


def _check_corrupted(before: Example, after: Example, share: float, special: set[int]) -> list[int]:
    """Asserts what corrupt_visible promises; returns the corrupted positions."""
    visible = [i for i, (t, g) in enumerate(zip(before.ids, before.targets)) if t not in special and g < 0]
    changed = [i for i, (x, y) in enumerate(zip(before.ids, after.ids)) if x != y]
    assert len(after.ids) == len(before.ids)
    assert len(changed) == round(share * len(visible))
    assert set(changed) <= set(visible)  # never a special token, a masked slot, or a target
    assert not {after.ids[i] for i in changed} & special  # nor a special id put in
    for i, (t, g) in enumerate(zip(before.ids, before.targets)):
        if g >= 0:
            assert (after.ids[i], after.targets[i]) == (t, g)  # the masked targets stay
        elif i in visible:
            assert after.targets[i] == t  # the true token, where it was corrupted too
        else:
            assert after.targets[i] < 0
    w = after.weight
    assert sum(w[i] for i in visible if i not in changed) == pytest.approx(eo.KEEP_TOTAL)
    if changed:
        assert sum(w[i] for i in changed) == pytest.approx(eo.FIX_TOTAL)
        assert min(w[i] for i in changed) > max(w[i] for i in visible if i not in changed)
    return changed


def test_corrupt_visible_changes_the_share_of_visible_tokens_and_targets_them(tiny):
    _, tok, ids = tiny
    special = _specials(tok)
    stream = []
    for _ in range(6):
        stream += tok.encode(OLD) + [ids.eos]
    pick = eo.window_pick(tok, special)
    rng = random.Random(0)
    corrupted = 0
    for share in (0.05, 0.2, 0.5):
        for _ in range(20):
            ex = mdlm_example(stream, 128, ids, rng)
            corrupted += bool(_check_corrupted(ex, eo.corrupt_visible(ex, rng, share, pick, special), share, special))
    assert corrupted > 40
    ex = infill_example(OLD * 3, tok, 256, ids, random.Random(3))
    assert _check_corrupted(ex, eo.corrupt_visible(ex, rng, 0.1, pick, special), 0.1, special)


def test_corrupt_visible_puts_the_pre_edit_token_back_first(tiny, edit_data):
    _, tok, ids = tiny
    special = _specials(tok)
    case = _case("near")
    doc, after = load_case(edit_data, case)
    seen = 0
    for seed in range(60):
        for layout in eo.LAYOUTS:
            ex = eo.edit_example(doc, after, case["cursor"], tok, 512, ids, random.Random(seed), layout)
            wrong = [i for i, w in enumerate(ex.wrong) if w >= 0]
            if not wrong:  # the new name was masked: nothing of the old one to show
                continue
            seen += 1
            # the new name shown where the old one stood (the rest of the windows are equal)
            assert all(tok.token_text(ex.ids[i]).strip() in "w" for i in wrong)
            assert all(tok.token_text(ex.wrong[i]).strip() in "width" for i in wrong)
            out = eo.corrupt_visible(ex, random.Random(seed), 1.0, lambda r, t, c: None, special)
            assert all(out.ids[i] == ex.wrong[i] and out.targets[i] == ex.ids[i] for i in wrong)
            assert sum(a != b for a, b in zip(ex.ids, out.ids)) == len(wrong)  # the pick gave nothing more
    assert seen >= 10


def test_window_pick_gives_a_name_for_a_name(tiny):
    _, tok, ids = tiny
    special = _specials(tok)
    pick = eo.window_pick(tok, special)
    context = tok.encode("self.width = height + (depth)") + [ids.mask, ids.eos]
    name = tok.encode("height")[0]
    names = {t for t in context if tok.token_text(t).strip().isidentifier()}
    rng = random.Random(0)
    got = {pick(rng, name, context) for _ in range(200)}
    assert got <= names - {name} and len(got) > 1
    plus = tok.encode("+")[0]
    assert len({pick(rng, plus, context) for _ in range(200)} - names) > 0  # any token for a punctuation mark
    assert not {pick(rng, plus, context) for _ in range(200)} & special
    assert pick(rng, name, [name, ids.mask]) is None


# ----------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("shift", [False, True])
def test_loss_on_a_batch_mixing_edit_and_correction_examples(tiny, edit_data, tmp_path, shift):
    folder, tok, ids = tiny
    if shift:
        folder = make_tiny_checkpoint(tmp_path / "shifted", logits_shift=True)
    model, _, _ = load_checkpoint(folder)
    assert model.cfg.logits_shift == shift
    special, pick, rng = _specials(tok), eo.window_pick(tok, _specials(tok)), random.Random(0)
    stream = tok.encode(OLD * 4)
    doc, after = load_case(edit_data, _case("near"))
    cursor = _case("near")["cursor"]
    examples = [
        mdlm_example(stream, 96, ids, rng),
        infill_example(OLD * 2, tok, 160, ids, rng),
        eo.edit_example(doc, after, cursor, tok, 200, ids, rng, "window"),
        eo.edit_example(doc, after, cursor, tok, 200, ids, rng, "surprise"),
    ]
    examples += [eo.corrupt_visible(e, rng, 0.1, pick, special) for e in examples]
    b = collate(examples, ids.pad)
    model.train()
    loss = loss_on(model, b, "cpu", nullcontext)
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # a target at position i is the token at i: a shifted model reads it from row i - 1
    with torch.no_grad():
        logits = model.logits(model.hidden(b["ids"], key_valid=b["key_valid"]))  # (B, L, V)
        want = torch.zeros(())
        for r, c in (b["targets"] >= 0).nonzero().tolist():
            if c - shift >= 0:
                ce = F.cross_entropy(logits[r, c - shift][None], b["targets"][r, c][None])
                want += ce * b["weights"][r, c]
        assert float(loss_on(model, b, "cpu", nullcontext)) == pytest.approx(float(want) / len(examples), rel=1e-4)


# ----------------------------------------------------------------------------- the loop


TEXTS = [(ROOT / "engine" / "train" / n).read_text() for n in ("objective.py", "corpus.py", "grow.py", "pack.py")]


def _old_batches(texts: list[str], tok: TextTokenizer, args: TrainArgs, seed: int, n: int, k: int) -> list[dict]:
    """The batches Batches drew before the edit objectives (diffusion, one hole a window, no distillation):
    the oracle a default run must match bit for bit."""
    rng, ids = random.Random(seed), SpecialIds(tok.token_id(MASK), tok.token_id(PAD), tok.token_id(EOS))
    stream = []
    for t in tok.encode_batch(texts):
        stream += t + [ids.eos]
    cum = [sum(map(len, texts[: i + 1])) for i in range(len(texts))]
    out = []
    for _ in range(k):
        exs = []
        while len(exs) < n:
            if rng.random() < args.infill_share:
                text = rng.choices(texts, cum_weights=cum)[0]
                ex = infill_example(text, tok, args.seq_len, ids, rng, ordered=args.infill_ordered)
            else:
                ex = mdlm_example(stream, args.seq_len, ids, rng)
            if ex is not None:
                exs.append(ex)
        out.append(collate(exs, ids.pad))
    return out


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_default_batches_are_the_old_ones(tiny, edit_data):
    _, tok, _ = tiny
    plain = TrainArgs(seq_len=128)
    oracle = _old_batches(TEXTS, tok, plain, 7, 4, 6)
    drawn = Batches(TEXTS, tok, plain, seed=7)
    assert _same([drawn.batch(4) for _ in range(6)], oracle)
    # edit data named, both shares at 0: still the old batches, and no edit case read
    named = Batches(TEXTS, tok, TrainArgs(seq_len=128, edit_data=str(edit_data), edit_layouts="surprise"), seed=7)
    assert _same([named.batch(4) for _ in range(6)], oracle) and not named.edit_cases
    # the oracle is not blind: a share of edit canvases changes them
    edits = Batches(TEXTS, tok, TrainArgs(seq_len=128, edit_data=str(edit_data), edit_share=0.3), seed=7)
    assert not _same([edits.batch(4) for _ in range(6)], oracle)


def test_held_out_batches_leave_the_edit_objectives_out(tiny, edit_data):
    _, tok, _ = tiny
    edits = TrainArgs(seq_len=128, edit_data=str(edit_data), edit_share=0.5, correct_share=0.5)
    with_edits = Batches(TEXTS, tok, held_out_args(edits), seed=12345)
    without = Batches(TEXTS, tok, held_out_args(TrainArgs(seq_len=128)), seed=12345)
    assert _same([with_edits.batch(4) for _ in range(3)], [without.batch(4) for _ in range(3)])


def test_load_edit_cases_reads_the_train_side_only(edit_data, tmp_path):
    other = tmp_path / "more"
    other.mkdir()
    (other / "synthetic.jsonl").write_text(json.dumps({**_case("near"), "id": "syn", "file": "../edits/files/area.py"}))
    got = eo.load_edit_cases([edit_data, other])
    assert [c["id"] for _, c in got] == ["area#near", "area#far", "area#None", "syn"]
    assert [f for f, _ in got] == [edit_data] * 3 + [other]
    with pytest.raises(ValueError, match="not a folder"):
        eo.load_edit_cases([tmp_path / "nowhere"])


def test_parse_layouts():
    assert eo.parse_layouts("window,surprise") == {"window": 0.5, "surprise": 0.5}
    assert eo.parse_layouts("window:3, surprise:1") == {"window": 0.75, "surprise": 0.25}
    assert eo.parse_layouts("surprise") == {"surprise": 1.0}
    for bad in ("memory", "window,window", "window:x", "window:-1", "window:0", ""):
        with pytest.raises(ValueError):
            eo.parse_layouts(bad)


def test_batches_draw_edit_canvases_and_corrections_by_their_shares(tiny, edit_data):
    _, tok, ids = tiny
    special = _specials(tok)
    args = TrainArgs(seq_len=256, edit_data=f"{edit_data},", edit_share=1.0, edit_layouts="surprise")
    data = Batches(TEXTS, tok, args, seed=0)
    assert len(data.edit_cases) == 3
    for _ in range(20):
        ex = data.example()
        assert isinstance(ex, eo.EditExample)
        a, b = ex.span
        assert [i for i, t in enumerate(ex.targets) if t >= 0] and all(t < 0 for t in ex.targets[:a] + ex.targets[b:])
    fixed = Batches(TEXTS, tok, TrainArgs(seq_len=128, correct_share=1.0), seed=0)
    for _ in range(20):
        ex = fixed.example()
        shown = [i for i, t in enumerate(ex.ids) if t not in special]
        assert shown and all(ex.targets[i] >= 0 for i in shown)
    half = Batches(TEXTS, tok, TrainArgs(seq_len=128, edit_data=str(edit_data), edit_share=0.5), seed=1)
    kinds = [isinstance(half.example(), eo.EditExample) for _ in range(200)]
    assert 70 < sum(kinds) < 130


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"edit_share": 0.5}, "needs --edit-data"),
        ({"edit_share": 0.5, "objective": "ar"}, "not --objective ar"),
        ({"correct_share": 0.5, "objective": "reorder"}, "not --objective reorder"),
        ({"edit_share": 0.5, "edit_data": "EDITS", "edit_layouts": "memory"}, "layouts"),
        ({"edit_share": 0.5, "edit_data": "EMPTY"}, 'no case with side "train"'),
    ],
)
def test_bad_edit_arguments_stop_the_run_saying_why(tiny, edit_data, tmp_path, kw, says):
    _, tok, _ = tiny
    (tmp_path / "empty").mkdir()
    paths = {"EDITS": str(edit_data), "EMPTY": str(tmp_path / "empty")}
    kw = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in kw.items()}
    with pytest.raises(SystemExit, match=says):
        Batches(TEXTS, tok, TrainArgs(seq_len=128, **kw), seed=0)


def test_a_case_that_does_not_apply_is_dropped(tiny, edit_data, capsys):
    _, tok, _ = tiny
    bad = {**_case("near"), "id": "bad", "edits": [[0, "nothing like this", "x"]]}
    (edit_data / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    data = Batches(TEXTS, tok, TrainArgs(seq_len=256, edit_data=str(edit_data), edit_share=1.0), seed=0)
    assert len(data.edit_cases) == 4
    for _ in range(40):
        assert isinstance(data.example(), eo.EditExample)
    assert len(data.edit_cases) == 3 and "edit case bad dropped" in capsys.readouterr().err


def test_train_runs_with_edit_and_correction_examples_and_records_them(edit_data, tmp_path):
    from dlm_lsp.cli import main

    src = tmp_path / "src"
    src.mkdir()
    for p in sorted((ROOT / "engine" / "train").glob("*.py")):
        (src / p.name).write_text(p.read_text())
    out = tmp_path / "run"
    tiny_model = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--ffn-dim", "64", "--vocab", "512"]
    rc = main(
        ["train", "--out", str(out), "--source", str(src), "--no-stdlib", "--seq-len", "128", "--batch", "4"]
        + tiny_model
        + ["--warmup", "2", "--max-steps", "3", "--val-examples", "16", "--threads", "1", "--no-progress"]
        + ["--edit-data", str(edit_data), "--edit-share", "0.5", "--edit-layouts", "window:1,surprise:3"]
        + ["--correct-share", "0.25"]
    )
    assert rc == 0
    state = json.loads((out / "last" / "training_state.json").read_text())
    assert state["step"] == 3 and state["edit_cases"] == 3
    assert {k: state["args"][k] for k in ("edit_data", "edit_share", "edit_layouts", "correct_share")} == {
        "edit_data": str(edit_data),
        "edit_share": 0.5,
        "edit_layouts": "window:1,surprise:3",
        "correct_share": 0.25,
    }
    model, _, _ = load_checkpoint(out / "last")
    assert all(torch.isfinite(p).all() for p in model.parameters())
