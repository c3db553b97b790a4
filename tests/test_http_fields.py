"""Every field of both FIM request shapes is checked at the HTTP boundary (dlm_lsp/http/fim.py
parse_body, NUMERIC_FIELDS): a seeded generator sends each field out-of-range and wrong-type values
(huge ints, negatives, NaN / Infinity, floats where integers are expected, bools, strings, nested
objects), alone in an otherwise valid body, to parse_body and over HTTP to the real app in both
shapes: every one is a 400 naming the field, none a 500; the ranges' own ends are accepted."""

from __future__ import annotations

import json
import math
import random

import httpx
import pytest

from dlm_lsp.http.fim import FLAVOURS, NUMERIC_FIELDS, ApiError, Limits, parse_body
from tests.test_http import PROMPT, Running

SEED = 39
PATHS = {"openai": "/v1/completions", "mercury": "/v1/fim/completions"}
# What a field that is not a number may never be (None is "unset", which every field may be).
NOT_A_NUMBER: list[object] = [True, False, "1", "", "NaN", [1], [], {"v": 1}, {"v": {"w": [1.5]}}]
# The other fields and values of the wrong type or shape for them (per flavour where they differ).
OTHER_FIELDS: dict[str, list[object]] = {
    "prompt": [1, 1.5, True, None, {"p": "x"}, ["a", "b"], [1], []],
    "suffix": [1, True, ["x"], {"s": "x"}, float("nan")],
    "stop": [1, True, [""], [1], ["x"] * 17, ["x" * 257], {"s": "x"}, [["x"]]],
    "stream": [1, 0, "true", [True], {"s": True}, float("inf")],
    "stream_options": [True, 1, "x", [], {"include_usage": 1}, {"include_usage": "yes"}],
    "model": [1, True, ["m"], {"m": 1}],
    "language": [1, True, "", "x" * 65, ["python"], {"l": 1}],
    "postprocess": [1, 0, "false", [False], {"p": 1}],
    "echo": [True, 1, 0, "false", [False], {"e": 0}, float("nan")],
    "logprobs": [1, 5, 6, -1, True, 0.0, "0", [0], {"l": 0}, float("inf")],
}


def valid_number(v: object, integer: bool, low: float, high: float) -> bool:
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        return False
    return not (isinstance(v, float) and math.isnan(v)) and low <= v <= high


def bad_numbers(rng: random.Random, integer: bool, low: float, high: float) -> list[object]:
    """Values out of [low, high] or of the wrong type for a numeric field, some fixed, some drawn."""
    out: list[object] = [float("nan"), float("inf"), -float("inf"), *NOT_A_NUMBER]
    out += [2**63, 2**64, -(2**63) - 1, 10**300, -(10**300)]  # huge: past any int64 and any float
    out += [rng.randint(2, 4000) * 10 ** rng.randint(20, 290) * rng.choice((-1, 1)) for _ in range(3)]
    if integer:
        out += [low - 1, high + 1, float(low), float(high), low + 0.5, 1e3, -rng.randint(1, 10**9)]
    else:
        out += [low - 1e-9, high + 1e-6, low - rng.uniform(1, 1e6), high + rng.uniform(1, 1e6), 1e308 * 10]
    bad = [v for v in out if not valid_number(v, integer, low, high)]  # a huge int is a valid seed
    assert len(bad) >= 20, bad
    return bad


def cases(flavour: str) -> list[tuple[str, object]]:
    """(field, bad value) for every field of a shape; SEED makes the drawn ones the same each run."""
    rng = random.Random(f"{SEED}:{flavour}")
    limits = Limits()
    out: list[tuple[str, object]] = []
    for key, integer, low, high in NUMERIC_FIELDS:
        high = limits.max_deadline_ms if key == "deadline_ms" else high
        out += [(key, v) for v in bad_numbers(rng, integer, low, high)]
    for key, values in OTHER_FIELDS.items():
        if key == "prompt" and flavour == "openai":
            values = [v for v in values if v != [1]] + [[1], [["x"]]]  # a list of one must hold a string
        if key == "prompt" and flavour == "mercury":
            values = [*values, ["x"]]  # a list of one string is OpenAI's, not Mercury's
        if key == "stop" and flavour == "mercury":
            values = [*values, "\n"]  # a lone string is OpenAI's, not Mercury's
        out += [(key, v) for v in values if not (key != "prompt" and v is None)]
    return out


def body_with(flavour: str, key: str, value: object) -> bytes:
    body: dict[str, object] = {"prompt": PROMPT, "suffix": "\n", "model": "dlm-test"}
    body[key] = value
    return json.dumps(body).encode()  # NaN and Infinity as JavaScript's tokens, which json.loads takes


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_bad_value_of_every_field_is_a_400_naming_it(flavour):
    seen = set()
    for key, value in cases(flavour):
        with pytest.raises(ApiError) as e:
            parse_body(body_with(flavour, key, value), flavour, Limits())
        assert (e.value.status, e.value.param) == (400, key), (key, value, e.value.message)
        seen.add(key)
    assert seen == {k for k, *_ in NUMERIC_FIELDS} | set(OTHER_FIELDS)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_ends_of_every_range_are_accepted(flavour):
    for key, integer, low, high in NUMERIC_FIELDS:
        for v in (low, high) if integer else (low, high, (low + high) / 2):
            p = parse_body(body_with(flavour, key, v), flavour, Limits())
            if key in ("max_tokens", "deadline_ms", "seed", "slots"):
                assert getattr(p, key) == v, (key, v)
    for key, v in (("logprobs", 0), ("logprobs", False), ("echo", False), ("n", 1), ("best_of", 1)):
        parse_body(body_with(flavour, key, v), flavour, Limits())


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_over_http_bad_fields_are_400s_never_500s(flavour):
    """The same values through the real app (uvicorn, Starlette, the token gate, the handler)."""
    with Running() as s, httpx.Client(timeout=20) as client:
        ok = client.post(s.url + PATHS[flavour], content=body_with(flavour, "max_tokens", 8))
        assert ok.status_code == 200, ok.text
        statuses: dict[int, int] = {}
        for key, value in cases(flavour):
            r = client.post(
                s.url + PATHS[flavour],
                content=body_with(flavour, key, value),
                headers={"content-type": "application/json"},
            )
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code == 400, (key, value, r.status_code, r.text)
            assert r.json()["error"]["param"] == key, (key, value, r.text)
        assert list(statuses) == [400] and s.server.counters["errors"] == 0
        assert len(s.engine.jobs) == 1  # only the valid request reached the engine


def test_bodies_json_cannot_parse_are_400s():
    """Past the fields: numbers or nesting the JSON parser refuses are a 400 for the body, not a 500."""
    limits = Limits(max_body_bytes=4 << 20)
    bodies = [
        b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",  # past Python's int-from-text digit limit
        b'{"prompt": "x", "max_tokens": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",  # past the recursion limit
        b'{"prompt": "x", "temperature": NaN',  # cut short
        b"\xff\xfe{}",
        b'["prompt"]',
        b"",
    ]
    for flavour in FLAVOURS:
        for raw in bodies:
            with pytest.raises(ApiError) as e:
                parse_body(raw, flavour, limits)
            assert e.value.status == 400, raw[:60]
