"""Training examples: masked diffusion and the server-shaped infill canvas."""

import random

import pytest

from engine.train.objective import SpecialIds, infill_example, mdlm_example
from tests.tiny import make_tiny_checkpoint

IDS = SpecialIds(mask=2, pad=0, eos=1)
TEXT = (
    "def area(w, h):\n    size = w * h\n    return size\n\n\nclass Box:\n    def __init__(self, w):\n        self.w = w\n"
    * 3
)


def _tok(tmp_path):
    from engine.tokenizer import TextTokenizer

    return TextTokenizer.load(make_tiny_checkpoint(tmp_path / "tiny"))


def test_mdlm_example_masks_and_targets_agree():
    rng = random.Random(0)
    stream = list(range(10, 200))
    for _ in range(50):
        ex = mdlm_example(stream, 64, IDS, rng)
        assert len(ex.ids) == len(ex.targets) == 64
        masked = [i for i, t in enumerate(ex.ids) if t == IDS.mask]
        assert masked and masked == [i for i, t in enumerate(ex.targets) if t >= 0]
        assert ex.weight > 0


def test_infill_canvas_is_middle_then_padding(tmp_path):
    tok = _tok(tmp_path)
    rng = random.Random(1)
    seen = 0
    for _ in range(200):
        ex = infill_example(TEXT, tok, 256, IDS, rng)
        if ex is None:
            continue
        seen += 1
        assert len(ex.ids) == len(ex.targets) <= 256
        # every target sits on a masked position; targets are text, then only padding
        tg = [t for t in ex.targets if t >= 0]
        assert all(ex.ids[i] == IDS.mask for i, t in enumerate(ex.targets) if t >= 0)
        first_pad = next((k for k, t in enumerate(tg) if t == IDS.pad), len(tg))
        assert all(t == IDS.pad for t in tg[first_pad:])
    assert seen > 100


def test_ordered_infill_reveals_a_prefix_of_the_canvas(tmp_path):
    tok = _tok(tmp_path)
    rng = random.Random(2)
    boundary_pad = 0
    for _ in range(200):
        ex = infill_example(TEXT, tok, 256, IDS, rng, ordered=1.0)
        if ex is None:
            continue
        slots = [i for i, t in enumerate(ex.targets) if t >= 0]
        # one contiguous masked run that ends the canvas: every masked slot is after every shown one
        assert slots == list(range(slots[0], slots[0] + len(slots)))
        assert ex.weight == pytest.approx(1.0 / len(slots))
        boundary_pad += ex.targets[slots[0]] == IDS.pad  # the fill ends right at the first masked slot
    assert boundary_pad > 0


def test_multi_hole_windows_hold_several_canvases_of_middle_then_padding(tmp_path):
    from engine.train.objective import collate, multi_infill_example

    tok = _tok(tmp_path)
    ids = SpecialIds(mask=tok.token_id("<|mask|>"), pad=tok.token_id("<|pad|>"), eos=tok.token_id("<|endoftext|>"))
    rng = random.Random(1)
    text = TEXT * 8
    several = 0
    for _ in range(40):
        ex = multi_infill_example(text, tok, 256, ids, rng, holes=4, ordered=0.5, chars_per_token=1.5)
        if ex is None:
            continue
        assert len(ex.ids) == len(ex.targets) == len(ex.weight) <= 256
        # targets only at masked slots; weight > 0 exactly on canvas slots; padding targets end a canvas
        assert all((t >= 0) == (i == ids.mask) for i, t in zip(ex.ids, ex.targets))
        assert all(w > 0 for w, t in zip(ex.weight, ex.targets) if t >= 0)
        runs, inside = 0, False
        for w in ex.weight:
            if w > 0 and not inside:
                runs += 1
            inside = w > 0
        several += runs >= 2
        b = collate([ex], ids.pad)
        assert b["weights"][0, : len(ex.ids)].tolist() == pytest.approx(ex.weight)
    assert several >= 20  # most windows hold more than one canvas
