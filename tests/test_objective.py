"""Training examples: masked diffusion and the server-shaped infill canvas."""
import random

import pytest

from engine.objective import SpecialIds, infill_example, mdlm_example
from tests.tiny import make_tiny_checkpoint

IDS = SpecialIds(mask=2, pad=0, eos=1)
TEXT = "def area(w, h):\n    size = w * h\n    return size\n\n\nclass Box:\n    def __init__(self, w):\n        self.w = w\n" * 3


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
