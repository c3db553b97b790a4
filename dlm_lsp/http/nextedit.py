"""POST /v1/edit/completions: Inception Mercury's next-edit request, as Continue's Next Edit sends it,
apart from any web framework: the body -> `EditParams`; the prompt -> `EditPrompt` (the document, the
cursor, the editable region, the diffs); those -> the language server's own `EditRequest` (the
engine's EditJob for exactly that region); the judged rewrite -> Mercury's answer.

The body: {"model", "messages": [{"role": "system", ...}, {"role": "user", "content": <prompt>}],
"max_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty", "stop", "stream"}; a
user message alone is taken too, and the last user message is the prompt. Numbers are checked as
the FIM routes check them (fim.check_numbers), unknown fields ignored. Extension fields:
`deadline_ms` (default twice --budget-ms, as the language server gives a next edit two budgets),
`min_confidence` (the gate, default the server's), `seed`.

The prompt (Mercury's template):
  <|recently_viewed_code_snippets|>\\n SNIPPETS \\n<|/recently_viewed_code_snippets|>\\n\\n
  <|current_file_content|>\\ncurrent_file_path: PATH\\n FILE \\n<|/current_file_content|>\\n\\n
  <|edit_diff_history|>\\n DIFFS \\n<|/edit_diff_history|>\\n
FILE is the document's lines joined by "\\n" with a line "<|code_to_edit|>" before the editable
region's first line and a line "<|/code_to_edit|>" after its last, and "<|cursor|>" at the cursor
inside the region; DIFFS are unified diffs, oldest first (dlm_lsp/http/unidiff.py reads them).
Parsing (`parse_prompt`), each failure a 400 that says what is wrong:
  - the file block starts after "<|/recently_viewed_code_snippets|>\\n\\n<|current_file_content|>\\n"
    (its first occurrence; without a snippets block, after the first "<|current_file_content|>\\n")
    and ends at the last "\\n<|/current_file_content|>" (a diff line never starts with "<|");
  - the region is between the first line "<|code_to_edit|>" and the first line "<|/code_to_edit|>"
    after it; the cursor is the region's first "<|cursor|>" (any other stays text);
  - the diff block is required (empty when there is no history); snippets are read past: the engine
    sees the current document only.
The document is the file without the two marker lines and the cursor token. The answer is
"```\\n" + the region's new lines + "\\n\\n```" (what Continue cuts out: from the first "```\\n" to
the last "\\n\\n```"); a region the judgement leaves alone comes back unchanged, which Continue
shows as nothing.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dlm_lsp.fill import suggest
from dlm_lsp.fill.documents import language_id_for_path
from dlm_lsp.fill.nextedit import comments_of
from dlm_lsp.http import unidiff
from dlm_lsp.http.fim import (
    MAX_SLOTS,
    PROMPT_PARSE_CHARS,
    SUFFIX_PARSE_CHARS,
    ApiError,
    Limits,
    check_numbers,
    check_stop,
)

if TYPE_CHECKING:
    from engine.api import Rewrite

SNIPPETS_CLOSE = "<|/recently_viewed_code_snippets|>"
FILE_OPEN = "<|current_file_content|>\n"
FILE_CLOSE = "\n<|/current_file_content|>"
PATH_LINE = "current_file_path: "
REGION_OPEN = "<|code_to_edit|>"
REGION_CLOSE = "<|/code_to_edit|>"
CURSOR = "<|cursor|>"
DIFFS_OPEN = "<|edit_diff_history|>\n"
DIFFS_CLOSE = "\n<|/edit_diff_history|>"
# Continue ends a next-edit prompt with this before its Inception client strips it; one that
# arrives (another client forwarding Continue's messages) is stripped here
CONTINUE_TOKEN = "<|!@#IS_NEXT_EDIT!@#|>"
FENCE_OPEN, FENCE_CLOSE = "```\n", "\n\n```"
MAX_REGION_CHARS = 16_384  # the engine rewrites at most MAX_SLOTS tokens: a region past this is a mistake
EDIT_NUMBERS = (
    "max_tokens",
    "temperature",
    "top_p",
    "frequency_penalty",
    "presence_penalty",
    "n",
    "deadline_ms",
    "min_confidence",
    "seed",
)
CHUNK, COMPLETION = "chat.completion.chunk", "chat.completion"


@dataclass
class EditParams:
    """One next-edit request's body, validated."""

    prompt: str
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 0.0
    seed: int = 0
    deadline_ms: int = 2000
    min_confidence: float | None = None


@dataclass
class EditPrompt:
    """Mercury's prompt read back: the document, the cursor and the editable region in it (str
    offsets; `end` is the end of the region's last line, before its break), the diffs."""

    path: str
    text: str
    cursor: int
    start: int
    end: int
    diffs: str

    @property
    def region(self) -> str:
        return self.text[self.start : self.end]


def _bad(message: str, param: str | None = "messages") -> ApiError:
    return ApiError(400, message, param=param)


def parse_body(raw: bytes, limits: Limits, deadline_ms: int) -> EditParams:
    """The request's parameters; raises ApiError (413 over the body limit, 400 otherwise)."""
    if len(raw) > limits.max_body_bytes:
        raise ApiError(
            413,
            f"the request body is {len(raw)} bytes; at most {limits.max_body_bytes} are accepted",
            code="request_too_large",
        )
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of {role, content} objects")
    prompt = None
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'")
        if not isinstance(m.get("content"), str):
            raise _bad(f"messages[{i}].content must be a string (the next-edit prompt is text)")
        if m["role"] == "user":
            prompt = m["content"]
    if prompt is None:
        raise _bad("no message with role 'user': the last user message holds the next-edit prompt")
    p = EditParams(prompt=prompt, deadline_ms=deadline_ms)
    numbers = check_numbers(body, limits, EDIT_NUMBERS)
    p.max_tokens = int(numbers["max_tokens"]) if "max_tokens" in numbers else None
    p.temperature = float(numbers.get("temperature", 0.0))
    p.seed = int(numbers.get("seed", 0))
    p.deadline_ms = int(numbers.get("deadline_ms", deadline_ms))
    p.min_confidence = float(numbers["min_confidence"]) if "min_confidence" in numbers else None
    if body.get("stop") is not None:
        check_stop(body["stop"], True, limits)  # taken and not applied: the answer is a whole region
    v = body.get("stream")
    if v is not None and not isinstance(v, bool):
        raise _bad("'stream' must be true or false", "stream")
    p.stream = v is True
    v = body.get("stream_options")
    if v is not None:
        if not isinstance(v, dict) or not isinstance(v.get("include_usage", False), bool):
            raise _bad("'stream_options' must be an object with a boolean include_usage", "stream_options")
        p.include_usage = bool(v.get("include_usage", False))
    v = body.get("model")
    if v is not None:
        if not isinstance(v, str):
            raise _bad("'model' must be a string", "model")
        p.model = v
    return p


def parse_prompt(prompt: str) -> EditPrompt:
    """The document, cursor, region and diffs of Mercury's next-edit prompt; raises ApiError 400 (see
    the module for the rules)."""
    if prompt.endswith(CONTINUE_TOKEN):
        prompt = prompt[: -len(CONTINUE_TOKEN)]
    anchored = prompt.find(SNIPPETS_CLOSE + "\n\n" + FILE_OPEN)
    if anchored >= 0:
        body_start = anchored + len(SNIPPETS_CLOSE + "\n\n" + FILE_OPEN)
    else:
        at = prompt.find(FILE_OPEN)
        if at < 0:
            raise _bad("the prompt has no <|current_file_content|> block: send Mercury's next-edit prompt")
        body_start = at + len(FILE_OPEN)
    body_end = prompt.rfind(FILE_CLOSE)
    if body_end < body_start:
        raise _bad("the <|current_file_content|> block has no <|/current_file_content|> line after it")
    body = prompt[body_start:body_end]
    if not body.startswith(PATH_LINE) or "\n" not in body:
        raise _bad("the <|current_file_content|> block must start with a 'current_file_path: PATH' line")
    nl = body.index("\n")
    path, marked = body[len(PATH_LINE) : nl], body[nl + 1 :]
    text, start, end = _unmark_region(marked.split("\n"))
    region = text[start:end]
    at = region.find(CURSOR)
    if at < 0:
        where = "outside the editable region" if CURSOR in text else "missing"
        raise _bad(f"the {CURSOR} token is {where}: put it at the cursor, between the {REGION_OPEN} lines")
    text = text[: start + at] + text[start + at + len(CURSOR) :]
    end -= len(CURSOR)
    if end - start > MAX_REGION_CHARS:
        raise _bad(
            f"the editable region is {end - start} characters; at most {MAX_REGION_CHARS} are rewritten: mark fewer lines"
        )
    return EditPrompt(path, text, start + at, start, end, _diffs(prompt[body_end + len(FILE_CLOSE) :]))


def _unmark_region(lines: list[str]) -> tuple[str, int, int]:
    """(text, start, end): the lines without the region's two marker lines, and where the region is."""
    opens = [i for i, line in enumerate(lines) if line.rstrip("\r") == REGION_OPEN]
    closes = [i for i, line in enumerate(lines) if line.rstrip("\r") == REGION_CLOSE]
    if not opens and not closes:
        raise _bad(f"the current file has no {REGION_OPEN} and {REGION_CLOSE} lines around the region to rewrite")
    if not opens:
        raise _bad(f"the current file has a {REGION_CLOSE} line but no {REGION_OPEN} line")
    after = [i for i in closes if i > opens[0]]
    if not after:
        if closes:
            raise _bad(f"the {REGION_CLOSE} line comes before the {REGION_OPEN} line: the markers are reversed")
        raise _bad(f"the {REGION_OPEN} line has no {REGION_CLOSE} line after it")
    a, b = opens[0], after[0]
    if b == a + 1:
        raise _bad(f"the editable region between {REGION_OPEN} and {REGION_CLOSE} holds no line")
    head, region, tail = lines[:a], lines[a + 1 : b], lines[b + 1 :]
    start = sum(len(line) + 1 for line in head)
    text = "\n".join(head + region + tail)
    return text, start, start + len("\n".join(region))


def _diffs(rest: str) -> str:
    """The diffs between the history's markers in what follows the file block."""
    at = rest.find(DIFFS_OPEN)
    if at < 0:
        raise _bad("the prompt has no <|edit_diff_history|> block after the current file (send it empty if need be)")
    start = at + len(DIFFS_OPEN)
    end = rest.rfind(DIFFS_CLOSE)
    if end < start - 1:
        raise _bad("the <|edit_diff_history|> block has no <|/edit_diff_history|> line after it")
    return rest[start:end] if end >= start else ""


# ----------------------------------------------------------------------------- the product path


def edit_request(
    prompt: EditPrompt, approach: str, deadline: float, context_tokens: int, params: EditParams
) -> suggest.EditRequest:
    """The language server's EditRequest for the prompt, with the window exactly the given region
    (and its line break, as nextedit.window_lines gives one) and the diffs' last edits; no engine job
    when there is no edit to go on (suggest.edit_request's None) or for the "propagate" baseline."""
    from engine.api import DecodeOptions, EditJob

    text, start = prompt.text, prompt.start
    end = prompt.end + 1 if text.startswith("\n", prompt.end) else prompt.end
    window = text[start:end]
    recent = unidiff.recent_edits(prompt.diffs, text, prompt.cursor, suggest.RECENT_EDITS)
    job = None
    if recent and approach != "propagate":
        job = EditJob(
            prefix=_tail(text[:start]),
            window=window,
            suffix=_head(text[end:]),
            edits=suggest.edit_pairs(recent),
            approach=approach,
            max_tokens=min(params.max_tokens or MAX_SLOTS, MAX_SLOTS),
            deadline=deadline,
            options=DecodeOptions(temperature=params.temperature, seed=params.seed),
            context_tokens=context_tokens,
        )
    comments = comments_of(language_id_for_path(prompt.path))
    noncode = suggest.window_noncode(text, start, end, comments) if job is None else []
    return suggest.EditRequest(start, end, window, recent, job, approach, prompt.cursor, noncode, comments)


def _tail(prefix: str) -> str:
    """The prefix's last PROMPT_PARSE_CHARS on a line boundary: the engine sees a few kB of it at most."""
    if len(prefix) <= PROMPT_PARSE_CHARS:
        return prefix
    cut = prefix.find("\n", len(prefix) - PROMPT_PARSE_CHARS)
    return prefix[cut + 1 :] if 0 <= cut < len(prefix) - 1 else prefix[-PROMPT_PARSE_CHARS:]


def _head(suffix: str) -> str:
    if len(suffix) <= SUFFIX_PARSE_CHARS:
        return suffix
    cut = suffix.rfind("\n", 0, SUFFIX_PARSE_CHARS)
    return suffix[: cut + 1] if cut > 0 else suffix[:SUFFIX_PARSE_CHARS]


def new_region(req: suggest.EditRequest, found: suggest.Suggestion) -> str:
    """The region as the answer gives it: the suggestion's new window when one is shown, else the
    region unchanged; without the window's closing line break."""
    window = found.new_window if found.silent is None and found.new_window is not None else req.window
    return window[:-1] if req.window.endswith("\n") and window.endswith("\n") else window


def content(region: str) -> str:
    """The assistant message Continue reads a new region from."""
    return FENCE_OPEN + region + FENCE_CLOSE


# ----------------------------------------------------------------------------- responses


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def timing(req: suggest.EditRequest, found: suggest.Suggestion, rewrite: Rewrite | None, arrival: float) -> dict:
    """The `dlm` extension field: what the engine did and what the judgement decided."""
    return {
        "approach": req.approach,
        "recent_edits": len(req.recent),
        "silent": found.silent,
        "edits": len(found.edits),
        "confidence": round(found.confidence, 6),
        "steps": rewrite.steps if rewrite else 0,
        "queue_ms": round(rewrite.queue_ms, 3) if rewrite else 0.0,
        "compute_ms": round(rewrite.compute_ms, 3) if rewrite else 0.0,
        "total_ms": round((time.monotonic() - arrival) * 1000, 3),
        "deadline_hit": rewrite.deadline_hit if rewrite else False,
        "expired": rewrite.expired if rewrite else False,
        "pid": os.getpid(),
    }


def response(cid: str, model: str, text: str, use: dict, dlm: dict) -> dict:
    return {
        "id": cid,
        "object": COMPLETION,
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": use,
        "dlm": dlm,
    }


def chunk(cid: str, model: str, delta: dict | None, finish_reason: str | None, extra: dict | None = None) -> dict:
    """One server-sent event's object: a delta of the assistant message (no choices when delta is None)."""
    out: dict[str, object] = {
        "id": cid,
        "object": CHUNK,
        "created": int(time.time()),
        "model": model,
        "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    out.update(extra or {})
    return out
