"""The fuzzer's checks of what comes back: the ranges of a completion answer, the expected error
codes, and the exceptions in the server's stderr (counted, not failed)."""

from __future__ import annotations

import collections
import re
from typing import IO, TYPE_CHECKING, Any

from dlm_lsp.measure.fuzz.reference import RefText

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeAlias

    from dlm_lsp.measure.replay import LspError

    # a request's check: (result, error) -> (check name, problem), or None when the answer is right
    Check: TypeAlias = Callable[[Any, LspError | None], tuple[str, str] | None]

CHECKS = ("exits", "unanswered", "bad_ranges", "divergences", "protocol")


def _ranges(method: str, result: Any) -> tuple[list[Any], list[Any], str | None]:
    """(ranges that must contain the cursor, other ranges, shape problem) of an answer."""
    if result is None:
        return [], [], None
    items = result.get("items") if isinstance(result, dict) else result
    if not isinstance(items, list):
        return [], [], f"answer is not a list or a list object: {_brief(result)}"
    cursor: list[Any] = []
    other: list[Any] = []
    for it in items:
        if not isinstance(it, dict):
            return [], [], f"item is not an object: {_brief(it)}"
        if method.endswith("inlineCompletion"):
            if not isinstance(it.get("insertText"), (str, dict)):
                return [], [], f"item without insertText: {_brief(it)}"
            if "range" in it:
                cursor.append(it["range"])
        else:
            te = it.get("textEdit")
            if isinstance(te, dict):
                cursor += [te[k] for k in ("range", "insert", "replace") if k in te]
            other += [e.get("range") for e in it.get("additionalTextEdits") or [] if isinstance(e, dict)]
    return cursor, other, None


def check_answer(method: str, result: Any, ref: RefText, cursor: list[int]) -> str | None:
    """None when every range of a completion answer lies inside `ref` and those of the fill contain
    one of the `cursor` offsets (all of them clamped already); else what is wrong."""
    cursor_rngs, other, problem = _ranges(method, result)
    if problem:
        return problem
    for rng in cursor_rngs + other:
        if not isinstance(rng, dict) or not isinstance(rng.get("start"), dict) or not isinstance(rng.get("end"), dict):
            return f"malformed range {_brief(rng)}"
        s, e = rng["start"], rng["end"]
        for p in (s, e):
            if not ref.is_valid(p.get("line"), p.get("character")):
                return f"range {_fmt(rng)} has a position outside the document ({len(ref)} lines) or inside a surrogate pair"
        a, b = ref.offsets(s["line"], s["character"])[0], ref.offsets(e["line"], e["character"])[0]
        if b < a:
            return f"reversed range {_fmt(rng)}"
        if rng in cursor_rngs and cursor and not any(a <= c <= b for c in cursor):
            cur = " or ".join("{}:{}".format(*ref.position(c)) for c in cursor)
            return f"range {_fmt(rng)} does not contain the cursor {cur}"
    return None


def check_next_edit(result: Any, ref: RefText) -> str | None:
    """None when a dlm/nextEdit answer is null or {"edits": [TextEdit...], ...} whose ranges lie inside
    `ref` (the document at the version asked), in order and not overlapping; else what is wrong."""
    if result is None:
        return None
    edits = result.get("edits") if isinstance(result, dict) else None
    if not isinstance(edits, list) or not edits:
        return f"next edit is neither null nor {{edits: [...]}}: {_brief(result)}"
    last = -1
    for e in edits:
        rng = e.get("range") if isinstance(e, dict) else None
        if not isinstance(e, dict) or not isinstance(e.get("newText"), str) or not isinstance(rng, dict):
            return f"malformed TextEdit {_brief(e)}"
        s, t = rng.get("start"), rng.get("end")
        if not isinstance(s, dict) or not isinstance(t, dict):
            return f"malformed range {_brief(rng)}"
        for p in (s, t):
            if not ref.is_valid(p.get("line"), p.get("character")):
                return f"next edit range {_fmt(rng)} has a position outside the document ({len(ref)} lines)"
        a, b = ref.offsets(s["line"], s["character"])[0], ref.offsets(t["line"], t["character"])[0]
        if b < a or a < last:
            return f"next edit ranges out of order or overlapping at {_fmt(rng)}"
        last = b
    return None


def _fmt(rng: dict[str, Any]) -> str:
    s, e = rng["start"], rng["end"]
    return f"{s.get('line')}:{s.get('character')}-{e.get('line')}:{e.get('character')}"


def _brief(obj: Any, most: int = 160) -> Any:
    """A message for a report: long strings cut (their length kept), deep structures summarized."""

    def cut(o: Any, depth: int = 0) -> Any:
        if depth > 12:
            return "<deep>"
        if isinstance(o, str):
            return o if len(o) <= most else o[: most // 2] + f"...<{len(o)} chars>"
        if isinstance(o, list):
            return [cut(x, depth + 1) for x in o[:20]] + ([f"<{len(o) - 20} more>"] if len(o) > 20 else [])
        if isinstance(o, dict):
            return {k: cut(v, depth + 1) for k, v in o.items()}
        if isinstance(o, bytes):
            return (
                cut(o.decode("utf-8", "backslashreplace"), depth)
                if len(o) <= most
                else o[: most // 2].decode("utf-8", "backslashreplace") + f"...<{len(o)} bytes>"
            )
        return o

    return cut(obj)


def _expect_code(code: int, what: str) -> Check:
    def check(result: Any, err: LspError | None) -> tuple[str, str] | None:
        if err is None:
            return "protocol", f"{what}: answered {_brief(result)!r}, want error {code}"
        if err.code != code:
            return "protocol", f"{what}: error {err.code} ({err.error.get('message')}), want {code}"
        return None

    return check


def _no_items(uri: str) -> Check:
    def check(result: Any, err: LspError | None) -> tuple[str, str] | None:
        items = result.get("items") if isinstance(result, dict) else result
        if err is None and items:
            return "protocol", f"a fill for a document never opened ({uri}): {_brief(items)}"
        return None

    return check


def _first_diff(got: Any, want: str) -> str:
    have = got.get("text") if isinstance(got, dict) else None
    if not isinstance(have, str) or not isinstance(want, str):
        return ""
    i = next((k for k, (x, y) in enumerate(zip(have, want)) if x != y), min(len(have), len(want)))
    return f"; first difference at offset {i}: server {have[i : i + 20]!r}, client {want[i : i + 20]!r}"


def server_exceptions(log: IO[bytes], most: int = 10) -> dict[str, int]:
    """The exceptions in the server's stderr (last line of each traceback, numbers left out), by count.
    Not a check: a request answered empty after an exception is answered; but worth a look."""
    log.flush()
    log.seek(0)
    found: collections.Counter[str] = collections.Counter()
    in_tb = False
    for raw in log:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.startswith("Traceback (most recent call last)"):
            in_tb = True
        elif in_tb and line and not line.startswith((" ", "\t")):
            found[re.sub(r"\d+", "N", line)[:160]] += 1
            in_tb = False
    return dict(found.most_common(most))
