"""A single-line fill ends at its line break (DecodeOptions.stop_newline, Canvas.stop_ids)."""

from __future__ import annotations

import pytest
import torch

from dlm_lsp.fill.context import build_request, to_fill_job
from dlm_lsp.fill.documents import Document
from engine.api import DecodeOptions, FillJob
from engine.decode.forward import build_canvas
from engine.decode.reference import reference_fill
from engine.decode.sampler import fill
from tests.tiny import tiny_service


def _model(shift: bool):
    from tests.engine_models import peaked_model

    return peaked_model(logits_shift=shift, pad=249)


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize(
    "opts",
    [
        DecodeOptions(threshold=0.3, refresh_every=1),
        DecodeOptions(threshold=0.3, window=3, cache=False),
        DecodeOptions(threshold=0.3, pad_left=False, window=4, refresh_every=1),
        DecodeOptions(selection="topk", steps=4, refresh_every=1),
    ],
)
def test_stop_ids_end_the_fill_in_the_fast_loop_as_in_the_oracle(shift, opts):
    m = _model(shift)
    stops = (171, 73, 127, 150, 61, 295)  # ids these fills use, not the one most of them repeat
    changed = 0
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        prefix, suffix = (
            torch.randint(4, 249, (12,), generator=g).tolist(),
            torch.randint(4, 249, (5,), generator=g).tolist(),
        )
        c = build_canvas(prefix, suffix, 10, m.cfg, opts)
        c.stop_ids = stops
        got = fill(m, c).ids
        assert got == reference_fill(m, prefix, suffix, 10, opts, stop_ids=list(stops)), f"seed {seed}"
        plain = fill(m, build_canvas(prefix, suffix, 10, m.cfg, opts)).ids
        changed += got != plain
        if opts.pad_left:  # the stop is committed as the end: no stop id in the fill, and the fill
            assert not set(got) & set(stops)  # is the plain one's text up to a stop at most as long
    assert changed  # the stop ids are not a no-op here


def test_to_fill_job_stops_single_line_holes_only():
    doc = Document("file:///s.py", "python", 1, "def f(items):\n    \n\ntotal = compute(items)\n")
    line = build_request(doc, doc.text.index("compute"))
    assert line.stop.single_line and to_fill_job(line, None).options.stop_newline is True
    block = build_request(doc, len("def f(items):\n    "))
    assert not block.stop.single_line and to_fill_job(block, None).options.stop_newline is False
    assert to_fill_job(line, None, options=DecodeOptions(stop_newline=False)).options.stop_newline is False


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return tiny_service(tmp_path_factory.mktemp("nl") / "m", seed=5)


def test_newline_ids_are_whitespace_with_a_line_break(service):
    ids = service.tok.newline_ids()
    assert ids and all("\n" in service.tok.token_text(i) and not service.tok.token_text(i).strip() for i in ids)
    assert service.tok.token_id("\n") in ids or any(service.tok.token_text(i) == "\n" for i in ids)
    assert not set(ids) & {service.cfg.pad_token_id, service.cfg.eos_token_id, service.cfg.mask_token_id}


def test_service_fill_with_stop_newline_equals_the_oracle_and_has_no_line_break(service):
    o = DecodeOptions(threshold=0.5, heal=False, stop_newline=True, refresh_every=1)
    for prefix in ("def add(a, b):\n    return a", "for i in range(10):\n    print(", "import os\nimport"):
        got = service.run_now(FillJob(prefix=prefix, suffix="\n", max_tokens=12, options=o))
        p_ids, s_ids = service.tok.encode_batch([prefix, "\n"])
        want = reference_fill(service.model, p_ids, s_ids, 12, o, stop_ids=list(service.tok.newline_ids()))
        assert got.token_ids == want and "\n" not in got.text


def test_a_healed_line_break_before_the_cursor_is_not_an_end(service):
    # the cursor right after an indentation: healing re-types "\n    " (a stop id) in slot 0; that
    # line break is before the cursor, so it must not end the fill (it did: "healed fill '' ...")
    o = DecodeOptions(threshold=0.5, stop_newline=True, refresh_every=1)
    seen = 0
    for prefix in (
        "def add(a, b):\n    ",
        "class Point:\n    def __init__(self, x, y):\n        ",
        "for i in range(10):\n",
    ):
        p_ids, s_ids = service.tok.encode_batch([prefix, "\n"])
        h = service.tok.heal(p_ids)
        if h is None or not set(h.first) & set(service.tok.newline_ids()):
            continue
        seen += 1
        got = service.run_now(FillJob(prefix=prefix, suffix="\n", max_tokens=12, options=o))
        want = reference_fill(
            service.model,
            p_ids[: -h.k],
            s_ids,
            13,
            o,
            heal=h.first,
            heal_then=h.then,
            stop_ids=list(service.tok.newline_ids()),
        )
        assert service.tok.decode(want).startswith(h.text)
        assert got.text == service.tok.decode(want)[len(h.text) :]
        assert "\n" not in got.text
    assert seen  # at least one prefix heals a line break
