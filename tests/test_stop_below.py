"""Stop when unsure (DecodeOptions.stop_below): in a step where no slot reaches the threshold and the
leftmost masked slot's best token is below stop_below, the fill ends there."""

from __future__ import annotations

import pytest
import torch

from engine.api import DecodeOptions, FillJob, with_model_defaults
from engine.decode.canvas import check_options
from engine.decode.forward import build_canvas
from engine.decode.reference import reference_fill
from engine.decode.sampler import fill
from engine.weights.checkpoint import serving_defaults
from tests.engine_models import peaked_model
from tests.tiny import tiny_service

# exact loops (a full forward every step, or no cache), so the oracle's full recompute is comparable
OPTS = [
    DecodeOptions(threshold=0.9, refresh_every=1),
    DecodeOptions(threshold=0.9, window=3, cache=False),
    DecodeOptions(threshold=0.6, window=4, refresh_every=1),
]


def _holes(n=10):
    for seed in range(n):
        g = torch.Generator().manual_seed(seed)
        yield torch.randint(4, 249, (12,), generator=g).tolist(), torch.randint(4, 249, (5,), generator=g).tolist()


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("opts", OPTS)
def test_the_fast_loop_stops_where_the_oracle_does_and_keeps_a_prefix_of_the_fill(shift, opts):
    import dataclasses

    m = peaked_model(logits_shift=shift, pad=249)
    stopped = dataclasses.replace(opts, stop_below=0.5)
    shorter = 0
    for prefix, suffix in _holes():
        got = fill(m, build_canvas(prefix, suffix, 10, m.cfg, stopped))
        assert got.ids == reference_fill(m, prefix, suffix, 10, stopped), (prefix, suffix)
        plain = fill(m, build_canvas(prefix, suffix, 10, m.cfg, opts))
        # the steps before the stop are the plain fill's: what was committed left of the stop slot stays
        assert plain.ids[: len(got.ids)] == got.ids
        assert got.steps <= plain.steps
        shorter += len(got.ids) < len(plain.ids)
    assert shorter  # the rule is not a no-op on these holes


def test_a_final_step_and_the_off_value_never_stop():
    m = peaked_model(pad=249)
    for prefix, suffix in _holes(4):
        plain = fill(m, build_canvas(prefix, suffix, 10, m.cfg, DecodeOptions(threshold=0.9)))
        off = fill(m, build_canvas(prefix, suffix, 10, m.cfg, DecodeOptions(threshold=0.9, stop_below=0.0)))
        assert off.ids == plain.ids
        one = fill(m, build_canvas(prefix, suffix, 10, m.cfg, DecodeOptions(threshold=0.9, stop_below=0.99, steps=1)))
        assert one.ids == fill(m, build_canvas(prefix, suffix, 10, m.cfg, DecodeOptions(threshold=0.9, steps=1))).ids


def test_bad_values_are_refused_and_serving_json_may_set_it(tmp_path):
    import json

    with pytest.raises(ValueError, match="stop_below"):
        check_options(DecodeOptions(stop_below=1.0))
    with pytest.raises(ValueError, match="pad_left"):
        check_options(DecodeOptions(stop_below=0.3, pad_left=False))
    for value, want in ((0.3, {"decode": {"stop_below": 0.3}}), (1.5, {})):
        (tmp_path / "serving.json").write_text(json.dumps({"decode": {"stop_below": value}}))
        assert serving_defaults(tmp_path) == want
    assert with_model_defaults(DecodeOptions(), {"stop_below": 0.3}).stop_below == 0.3
    assert with_model_defaults(DecodeOptions(), {}).stop_below == 0.0


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return tiny_service(tmp_path_factory.mktemp("sb") / "m", seed=5)


def test_service_fills_stop_early_with_healing_and_the_copy_boost_and_keep_a_prefix_of_the_full_fill(service):
    o = DecodeOptions(threshold=0.9, stop_below=0.2, copy_bigram=2.0, copy_order=3, refresh_every=1)
    tokens = 0
    for prefix in ("def add(a, b):\n    return a", "for i in range(10):\n    print(", "import os\nimport", "x = "):
        got = service.run_now(FillJob(prefix=prefix, suffix="\n", max_tokens=12, options=o))
        full = service.run_now(
            FillJob(
                prefix=prefix,
                suffix="\n",
                max_tokens=12,
                options=DecodeOptions(threshold=0.9, copy_bigram=2.0, copy_order=3, refresh_every=1),
            )
        )
        assert full.token_ids[: len(got.token_ids)] == got.token_ids and full.text.startswith(got.text)
        tokens += len(full.token_ids) - len(got.token_ids)
    assert tokens  # the tiny random model is unsure: some fill stopped early


def test_the_stop_may_differ_per_hole_kind(service, tmp_path):
    import json

    (tmp_path / "serving.json").write_text(
        json.dumps(
            {"decode": {"stop_below": 0.2, "stop_below_kinds": {"block": 0.0, "middle": 0.1, "line": 1.5, "args": "x"}}}
        )
    )  # out of range and not numbers: left out
    tuned = serving_defaults(tmp_path)["decode"]
    assert tuned == {"stop_below": 0.2, "stop_below_kinds": {"block": 0.0, "middle": 0.1}}
    assert [with_model_defaults(DecodeOptions(), tuned, k).stop_below for k in ("line", "middle", "block", None)] == [
        0.2,
        0.1,
        0.0,
        0.2,
    ]
    assert (
        with_model_defaults(DecodeOptions(stop_below=0.4), tuned, "block").stop_below == 0.4
    )  # an explicit setting wins
    base = dict(threshold=0.9, copy_bigram=2.0, copy_order=3, refresh_every=1)
    saved, service.serving = service.serving, {"decode": tuned}
    try:
        differ = 0
        for prefix in ("def add(a, b):\n    return a", "for i in range(10):\n    print(", "import os\nimport", "x = "):
            job = dict(prefix=prefix, suffix="\n", max_tokens=12)
            line = service.run_now(FillJob(**job, kind="line", options=DecodeOptions(**base)))
            block = service.run_now(FillJob(**job, kind="block", options=DecodeOptions(**base)))
            assert (
                line.token_ids
                == service.run_now(FillJob(**job, options=DecodeOptions(**base, stop_below=0.2))).token_ids
            )
            assert (
                block.token_ids
                == service.run_now(FillJob(**job, options=DecodeOptions(**base, stop_below=0.0))).token_ids
            )
            differ += line.token_ids != block.token_ids
        assert differ  # the kinds' stops reached the fills
    finally:
        service.serving = saved
