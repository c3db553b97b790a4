"""The FIM completion API apart from any web framework: a request body -> `FimParams`; prompt +
suffix -> the language server's own `FillRequest` and engine job; the engine's `Fill` -> the
completion text through the same post-processing; response and stream-chunk objects.

Two request shapes are read (docs/serving.md):
  openai   POST /v1/completions: prompt (a string, or a list of one), suffix, max_tokens,
           temperature, stop (a string or a list), stream (+ stream_options.include_usage), model
  mercury  POST /v1/fim/completions, Inception's documented FIM shape: the same fields (prompt and
           suffix strings), max_tokens up to 8192, stop a list
Both answer {"id", "object": "text_completion", "created", "model", "choices": [{"index": 0,
"text", "finish_reason", "logprobs": null}], "usage": {...}, "dlm": {...}}. `dlm` is this server's
extension: the engine's timing (steps, tokens per step, ms per step, queue / compute / total ms)
and what the pipeline decided (hole kind, slots, confidence, what post-processing dropped).

Extension request fields (both shapes): `language` (an LSP languageId: which grammar parses the
prompt + suffix; default the server's --language), `deadline_ms` (the engine's budget from the
request's arrival; at the deadline it commits what it has), `postprocess` (false: the engine's text
as it came, stop sequences still cut it: what a language server that post-processes itself asks
for), `min_confidence` (the confidence gate; default the model's own, none when postprocess is
false), `seed`, and `slots` (exactly this many mask slots instead of the hole kind's count, still
within max_tokens: a language server that sized the hole itself sends it).

Every field is checked at this boundary (NUMERIC_FIELDS: each number's type and range; a bool is
not a number, a float not an integer, NaN and Infinity are in no range): a bad one is a 400 naming
it, never a 500. The sampling fields this server does not apply (a fill is decoded by its own
rules) are taken within a range and ignored: OpenAI's `top_p`, `frequency_penalty` and
`presence_penalty` within OpenAI's, Mercury's `top_k` and `repetition_penalty` within wide ones;
`n` and `best_of` must be 1, `logprobs` null / 0 / false, `echo` null / false.

Only the last PROMPT_PARSE_CHARS of the prompt and the first SUFFIX_PARSE_CHARS of the suffix (on
line boundaries) are parsed: the windows the engine sees are a few kB (some 14 kB at 4096 tokens).

`max_tokens` bounds the mask slots: a fill has as many slots as the hole kind gives (16 for the
rest of a line, 64 for a block...) and never more than max_tokens; the hole kind is inferred from
the prompt and suffix as the language server infers it from a document.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

from dlm_lsp.fill import context, postprocess
from dlm_lsp.fill.documents import Document, grammar_name, join_pairs, make_parser
from engine.api import DEFAULT_CONTEXT_TOKENS, SEED_RANGE

if TYPE_CHECKING:
    from tree_sitter import Parser

    from dlm_lsp.fill.gate import Calibrator
    from engine.api import Fill, FillJob

FLAVOURS = ("openai", "mercury")
OBJECT = "text_completion"
MAX_SLOTS = 512  # the engine's largest canvas a request may ask for (the server's maxFillTokens cap)
MAX_TOKENS = 100_000  # what max_tokens may say (the slots are cut to the server's cap anyway)
# The numeric fields of both shapes and their ranges (deadline_ms's top is Limits.max_deadline_ms):
# (field, integer?, low, high). parse_body checks each; tests/test_http_fields.py sends each bad values.
NUMERIC_FIELDS: tuple[tuple[str, bool, float, float], ...] = (
    ("max_tokens", True, 1, MAX_TOKENS),
    ("temperature", False, 0.0, 2.0),
    ("top_p", False, 0.0, 1.0),
    ("frequency_penalty", False, -2.0, 2.0),
    ("presence_penalty", False, -2.0, 2.0),
    ("top_k", True, 0, 1_000_000),  # Mercury's; no range published: a wide one
    ("repetition_penalty", False, 0.0, 10.0),  # Mercury's; likewise
    ("n", True, 1, 1),
    ("best_of", True, 1, 1),
    ("deadline_ms", True, 10, 60_000),
    ("min_confidence", False, 0.0, 1.0),
    ("seed", True, SEED_RANGE[0], SEED_RANGE[1]),
    ("slots", True, 1, MAX_SLOTS),
)
# What of the prompt and suffix the pipeline parses: the context windows are a few kB, the rest
# only supplies imports and enclosing headers, and parsing runs on the server's event loop (a
# 1 MB prompt would hold every other request for 100+ ms). Cut on line boundaries.
PROMPT_PARSE_CHARS = 32_768
SUFFIX_PARSE_CHARS = 8_192


class ApiError(Exception):
    """A request answered with an error object: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """What one request may ask for; past these it is answered 413 or 400."""

    max_body_bytes: int = 1 << 20
    max_stop: int = 16
    max_stop_chars: int = 256
    max_deadline_ms: int = 60_000
    max_tokens_cap: int = 64  # the server's maxFillTokens: max_tokens above it is cut to it


@dataclass
class FimParams:
    """One completion request, validated."""

    prompt: str
    suffix: str = ""
    max_tokens: int | None = None
    temperature: float = 0.0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    language: str = "python"
    deadline_ms: int = 1000
    postprocess: bool = True
    min_confidence: float | None = None
    seed: int = 0
    slots: int | None = None  # exactly this many mask slots (a client that chose them itself), within max_tokens


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bad(param: str, what: str) -> NoReturn:
    raise ApiError(400, f"{param!r} must be {what}", param=param)


def check_numbers(body: dict, limits: Limits, keys: tuple[str, ...] | None = None) -> dict[str, int | float]:
    """The NUMERIC_FIELDS the body sets (of `keys`, default all), each checked for its type and
    range (deadline_ms's top is limits.max_deadline_ms); raises ApiError 400 naming a bad one."""
    numbers: dict[str, int | float] = {}
    for key, integer, low, high in NUMERIC_FIELDS:
        v = body.get(key)
        if v is None or (keys is not None and key not in keys):
            continue
        if key == "deadline_ms":
            high = limits.max_deadline_ms
        if key in ("n", "best_of") and _is_int(v) and v != 1:
            raise ApiError(400, f"{key!r} other than 1 is not supported: one answer per request", param=key)
        if not (_is_int(v) if integer else _is_num(v)) or not low <= v <= high:
            _bad(key, f"an integer from {low} to {high}" if integer else f"a number from {low:g} to {high:g}")
        numbers[key] = v if integer else float(v)
    return numbers


def check_stop(v: object, lone_string: bool, limits: Limits) -> list[str]:
    """A `stop` value as a list: non-empty strings within the limits (a lone string where
    `lone_string`, OpenAI's shape); raises ApiError 400 otherwise."""
    stops = [v] if isinstance(v, str) and lone_string else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        _bad("stop", "a list of non-empty strings" + (" or a string" if lone_string else ""))
    if len(stops) > limits.max_stop or any(len(s) > limits.max_stop_chars for s in stops):
        _bad("stop", f"at most {limits.max_stop} strings of at most {limits.max_stop_chars} characters")
    return list(stops)


def parse_body(
    raw: bytes, flavour: str, limits: Limits, language: str = "python", deadline_ms: int = 1000
) -> FimParams:
    """The request's parameters; raises ApiError (413 for a body over the limit, 400 otherwise)."""
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

    def bad(param: str, what: str) -> NoReturn:
        raise ApiError(400, f"{param!r} must be {what}", param=param)

    prompt = body.get("prompt")
    if flavour == "openai" and isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        bad("prompt", "a string" + (" (or a list of one string)" if flavour == "openai" else ""))
    suffix = body.get("suffix")
    if suffix is None:
        suffix = ""
    if not isinstance(suffix, str):
        bad("suffix", "a string")
    p = FimParams(prompt=prompt, suffix=suffix, language=language, deadline_ms=deadline_ms)

    numbers = check_numbers(body, limits)
    if "max_tokens" in numbers:
        p.max_tokens = int(numbers["max_tokens"])
    if "temperature" in numbers:
        p.temperature = float(numbers["temperature"])
    if "deadline_ms" in numbers:
        p.deadline_ms = int(numbers["deadline_ms"])
    if "min_confidence" in numbers:
        p.min_confidence = float(numbers["min_confidence"])
    if "seed" in numbers:
        p.seed = int(numbers["seed"])
    if "slots" in numbers:
        p.slots = int(numbers["slots"])

    v = body.get("stop")
    if v is not None:
        p.stop = check_stop(v, flavour == "openai", limits)
    v = body.get("stream")
    if v is not None:
        if not isinstance(v, bool):
            bad("stream", "true or false")
        p.stream = v
    v = body.get("stream_options")
    if v is not None:
        if not isinstance(v, dict) or not isinstance(v.get("include_usage", False), bool):
            bad("stream_options", "an object with a boolean include_usage")
        p.include_usage = bool(v.get("include_usage", False))
    v = body.get("model")
    if v is not None:
        if not isinstance(v, str):
            bad("model", "a string")
        p.model = v
    v = body.get("echo")
    if v is not None and v is not False:
        if v is True:
            raise ApiError(400, "'echo' is not supported", param="echo")
        bad("echo", "true or false (true is not supported)")
    v = body.get("logprobs")
    if v is not None and v is not False and not (_is_int(v) and v == 0):
        if _is_int(v) and 1 <= v <= 5:
            raise ApiError(400, "'logprobs' is not supported", param="logprobs")
        bad("logprobs", "null, 0 or false (logprobs are not supported)")
    # extension fields
    v = body.get("language")
    if v is not None:
        if not isinstance(v, str) or not v or len(v) > 64:
            bad("language", 'an LSP languageId such as "python"')
        p.language = v
    v = body.get("postprocess")
    if v is not None:
        if not isinstance(v, bool):
            bad("postprocess", "true or false")
        p.postprocess = v
    return p


# ----------------------------------------------------------------------------- the fill pipeline


@dataclass
class Prepared:
    """A request on its way: the language server's FillRequest, its engine job, the syntax check."""

    params: FimParams
    request: context.FillRequest
    job: FillJob
    check: postprocess.SyntaxCheck | None  # None: no grammar, or postprocess off
    arrival: float
    context_ms: float


@dataclass
class Completed:
    text: str
    finish_reason: str  # "stop" | "length"
    dropped: str | None
    postprocess_ms: float


class FimPipeline:
    """prompt + suffix -> FillRequest -> FillJob, and Fill -> text: dlm_lsp.fill.context and
    dlm_lsp.fill.postprocess exactly as the language server runs them on a document whose text is
    prompt + suffix with the cursor between them. Not thread-safe (a tree-sitter parser per
    language is kept): one per event loop."""

    def __init__(self, max_fill_tokens: int = 64, context_tokens: int = DEFAULT_CONTEXT_TOKENS):
        self.max_fill_tokens, self.context_tokens = max_fill_tokens, context_tokens
        self._parsers: dict[str, Parser | None] = {}

    def _parser(self, language: str) -> Parser | None:
        # kept by grammar, not by the request's languageId: a client naming endless ids grows nothing
        name = grammar_name(language)
        if name is None:
            return None
        if name not in self._parsers:
            self._parsers[name] = make_parser(language)
        return self._parsers[name]

    def prepare(self, p: FimParams, arrival: float | None = None) -> Prepared:
        """The engine job for a request; its deadline is arrival + deadline_ms."""
        from engine.api import DecodeOptions

        arrival = time.monotonic() if arrival is None else arrival
        t0 = time.perf_counter()
        parser = self._parser(p.language)
        prompt, suffix = p.prompt, p.suffix
        if len(prompt) > PROMPT_PARSE_CHARS:
            cut = prompt.find("\n", len(prompt) - PROMPT_PARSE_CHARS)
            prompt = prompt[cut + 1 :] if 0 <= cut < len(prompt) - 1 else prompt[-PROMPT_PARSE_CHARS:]
        if len(suffix) > SUFFIX_PARSE_CHARS:
            cut = suffix.rfind("\n", 0, SUFFIX_PARSE_CHARS)
            suffix = suffix[: cut + 1] if cut > 0 else suffix[:SUFFIX_PARSE_CHARS]
        doc = Document("dlm-http:request", p.language, 1, prompt + suffix, parser=parser)
        offset = min(len(join_pairs(prompt)), len(doc.text))  # a surrogate pair split by the cursor is one character
        cap = min(self.max_fill_tokens, p.max_tokens or MAX_SLOTS, MAX_SLOTS)
        req = context.build_request(doc, offset, cap, self.context_tokens)
        if p.slots is not None:
            req.mask_slots = min(p.slots, cap)
        options = DecodeOptions(temperature=p.temperature, seed=p.seed)
        job = context.to_fill_job(req, arrival + p.deadline_ms / 1000.0, self.context_tokens, options)
        tree = doc.tree if p.postprocess else None
        check = postprocess.SyntaxCheck(doc.text, tree, parser, offset) if tree is not None else None
        return Prepared(p, req, job, check, arrival, (time.perf_counter() - t0) * 1000)

    @staticmethod
    def complete(prep: Prepared, fill: Fill, gate: float = 0.0, calibrator: Calibrator | None = None) -> Completed:
        """The completion text of a fill: stop sequences cut the engine's text, then (unless the
        request turned it off) the language server's post-processing decides what may be shown."""
        p = prep.params
        t0 = time.perf_counter()
        raw, stopped = fill.text, False
        cuts = [i for i in (raw.find(s) for s in p.stop) if i >= 0]
        if cuts:
            raw, stopped = raw[: min(cuts)], True
        if not p.postprocess:
            text, dropped = raw, None
        else:
            gate = p.min_confidence if p.min_confidence is not None else gate
            fin = postprocess.finish(
                prep.request, raw, prep.check, confidence=fill.confidence, min_confidence=gate, calibrator=calibrator
            )
            text, dropped = fin.text, fin.dropped
        # every slot held text and nothing cut it: the fill may go on past max_tokens
        length = not stopped and fill.tokens >= prep.job.max_tokens and not dropped
        return Completed(text, "length" if length else "stop", dropped, (time.perf_counter() - t0) * 1000)


# ----------------------------------------------------------------------------- responses


def completion_id() -> str:
    return "cmpl-" + uuid.uuid4().hex[:24]


def timing(prep: Prepared, fill: Fill, done: Completed | None) -> dict:
    """The `dlm` extension field: what the engine did and what the pipeline decided."""
    return {
        "steps": fill.steps,
        "tokens_per_step": list(fill.tokens_per_step),
        "ms_per_step": [round(x, 3) for x in fill.ms_per_step],
        "queue_ms": round(fill.queue_ms, 3),
        "compute_ms": round(fill.compute_ms, 3),
        "context_ms": round(prep.context_ms, 3),
        "postprocess_ms": round(done.postprocess_ms, 3) if done else 0.0,
        "total_ms": round((time.monotonic() - prep.arrival) * 1000, 3),
        "slots": prep.job.max_tokens,
        "tokens": fill.tokens,
        "hole_kind": prep.request.hole_kind,
        "confidence": round(fill.confidence, 6),
        "deadline_hit": fill.deadline_hit,
        "expired": fill.expired,
        # rows run through the model and context rows reused from this session's last request
        "forwarded_tokens": fill.forwarded_tokens,
        "reused_tokens": fill.reused_tokens,
        "dropped": done.dropped if done else None,
        "pid": os.getpid(),  # the process that answered: replicas behind one proxy differ
    }


def usage(prompt_tokens: int, completion_tokens: int, flavour: str) -> dict:
    out: dict[str, int] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if flavour == "mercury":  # FIMUsage has these two as well
        out.update({"reasoning_tokens": 0, "cached_input_tokens": 0})
    return out


def response(cid: str, model: str, text: str, finish_reason: str, use: dict, dlm: dict) -> dict:
    return {
        "id": cid,
        "object": OBJECT,
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
        "usage": use,
        "dlm": dlm,
    }


def chunk(
    cid: str, model: str, text: str | None, finish_reason: str | None, extra: dict | None = None, choices: bool = True
) -> dict:
    """One server-sent event's object (the same shape as the response, a delta of the text)."""
    out: dict[str, object] = {
        "id": cid,
        "object": OBJECT,
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}] if choices else [],
    }
    out.update(extra or {})
    return out


def sse(obj: dict | bytes) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
